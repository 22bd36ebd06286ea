"""Small C++ libraries compiled on first use and loaded with ctypes: the build and its cache.

Owns only the machinery shared by the native kernels (the paged decode kernel in
``runner/cpu_kernel.py``, the fused layer ops in ``models/fused_ops.py``): find a compiler, build
a source string into a shared library cached under ``~/.cache/pagekv/kernels`` by a hash of
source, flags, compiler and CPU, and load it. Why ctypes and not ``torch.utils.cpp_extension``:
no torch headers or pybind11, so a build takes about a second instead of a minute. The kernels'
sources, entry points and fallbacks stay with their callers.

Imports nothing of pagekv and no torch, so both ``models`` and ``runner`` may use it.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

# Note: g++ may still contract a * b + c into one FMA under -std=c++17; a kernel whose numbers
# must match torch's separate roundings adds -ffp-contract=off (the fused layer ops do).
BASE_CXX_FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=c++17")


logger = logging.getLogger("pagekv")


class NativeUnavailable(Exception):
    """The library cannot be had here: no compiler, a failed build, or a failed load."""


def load_optional(
    name: str, source: str, flags: tuple[str, ...], disable_env: str, log_level: int
) -> ctypes.CDLL | None:
    """``build_and_load``, or None when ``$disable_env`` is "0" or the library cannot be had
    (logged at ``log_level`` with the reason); callers then fall back to torch ops."""
    if os.environ.get(disable_env, "1") == "0":
        return None
    try:
        return build_and_load(name, source, flags)
    except NativeUnavailable as exc:
        logger.log(log_level, "native %s unavailable (%s); using torch ops", name, exc)
        return None


def build_and_load(name: str, source: str, flags: tuple[str, ...]) -> ctypes.CDLL:
    """The library built from ``source`` with ``flags`` (once per machine, then cached).

    ``name`` prefixes the cached file. The compiler is ``$CXX`` or ``g++``. Raises
    NativeUnavailable with the reason (the compiler's last output on a failed build).
    """
    compiler = find_compiler()
    if compiler is None:
        raise NativeUnavailable("no C++ compiler found")
    key = hashlib.blake2b(digest_size=8)
    for part in (source, " ".join(flags), compiler, _cpu_identity()):
        key.update(part.encode())
    target = _cache_dir() / f"{name}_{key.hexdigest()}.so"
    try:
        if not target.exists():
            _build(compiler, flags, source, target)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        raise NativeUnavailable(f"{exc} {detail.decode(errors='replace')[-500:]}") from exc


def find_compiler() -> str | None:
    """``$CXX`` or ``g++`` on PATH, or None. Where there is one, a failed build is a bug."""
    return shutil.which(os.environ.get("CXX", "g++"))


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "pagekv" / "kernels"


def _cpu_identity() -> str:
    """-march=native binaries are only valid on a CPU with the same features."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return f"{platform.machine()}|{flags}"


def _build(compiler: str, flags: tuple[str, ...], source: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source_path = Path(tmp) / f"{target.stem}.cpp"
        source_path.write_text(source, encoding="utf-8")
        built = Path(tmp) / target.name
        subprocess.run(
            [compiler, *flags, str(source_path), "-o", str(built)],
            check=True,
            capture_output=True,
            timeout=300,
        )
        os.replace(built, target)  # atomic: a concurrent process sees all or nothing
