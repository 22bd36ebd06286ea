"""Build the C++ kernel libraries (``csrc/``) for a target, cache them, load them with ctypes.

A library is one ``csrc/<name>.cpp`` (with the headers beside it and under ``csrc/arch/``)
built for one target of ``isa.TARGETS`` at first use, into ``~/.cache/pagekv/kernels`` under a
hash of every source file, the flags and the compiler, so an edit or a new compiler rebuilds
and nothing else does. A target's flags name its header, ``csrc/arch/<target>.h``, which holds
its instruction-set bodies (``-DPAGEKV_ARCH``; ``csrc/arch/target.h``). The compiler reads the
files where they are, so its warnings and errors name real files and lines. Why ctypes and not
``torch.utils.cpp_extension``: no torch headers or pybind11, so a build takes seconds instead
of a minute.

The ctypes signatures come from ``csrc/kernels.h``, the one place each entry point is declared;
so do the fields of the structs that cross by address (``structs``, mirrored in ``abi``).

Imports nothing of pagekv but ``isa`` (and its errors), and no torch.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from pagekv.kernels import isa

CSRC = Path(__file__).parent / "csrc"
HEADER = CSRC / "kernels.h"
# Every kernel: OpenMP threads, warnings on (kept at zero by the compile check), and every
# exported function declared first in kernels.h (-Wmissing-declarations). g++ may contract
# a * b + c into one FMA under -std=c++17; a library whose numbers must match torch's separate
# roundings adds -ffp-contract=off (fused_ops does). No kernel reads the floating-point
# exception flags, so -fno-trapping-math lets the vectorizer evaluate a select's comparison
# unconditionally (without it, GCC's AVX2 code leaves loops with clamps scalar); the values
# computed are the same.
BASE_FLAGS = (
    "-O3",
    "-std=c++17",
    "-fno-trapping-math",
    "-fPIC",
    "-fopenmp",
    "-Wall",
    "-Wextra",
    "-Wmissing-declarations",
)

logger = logging.getLogger("pagekv")


class KernelUnavailable(Exception):
    """The library cannot be had here: no compiler, a failed build, or a failed load."""


def find_compiler() -> str | None:
    """``$CXX`` or ``g++`` on PATH, or None. Where there is one, a failed build is a bug."""
    return shutil.which(os.environ.get("CXX", "g++"))


def flags_for(target: str, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    header = f'-DPAGEKV_ARCH="{arch_header(target).relative_to(CSRC).as_posix()}"'
    return (*BASE_FLAGS, *isa.BY_NAME[target].flags, header, *extra)


def arch_header(target: str) -> Path:
    """The header with ``target``'s instruction-set bodies: ``csrc/arch/<target>.h``."""
    return CSRC / "arch" / f"{isa.BY_NAME[target].name}.h"


# What happened to each (library, target) this process asked for: "ok" or the reason it failed.
_outcomes: dict[tuple[str, str], str] = {}


def outcomes() -> dict[tuple[str, str], str]:
    return dict(_outcomes)


def forget() -> None:
    """Build and load afresh from the next call on (tests change the compiler or the cache)."""
    load.cache_clear()
    _outcomes.clear()


def load_optional(name: str, target: str | None, extra: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """``load(name, target)``, or None when target is None (``$PAGEKV_CPU_ISA=none``) or the
    library cannot be had (a warning with the compiler's message; callers fall back to torch)."""
    if target is None or _outcomes.get((name, target), "ok") != "ok":
        return None  # disabled, or failed before (and said so)
    try:
        return load(name, target, extra)
    except KernelUnavailable as exc:
        _outcomes[(name, target)] = str(exc)
        logger.warning("kernel %s (%s) unavailable, using torch ops: %s", name, target, exc)
        return None


def head_dims(query: Callable[[int], int]) -> Callable[[int], bool]:
    """Whether an attention kernel takes a head size, asked of its library once per size
    (``decode_head_dim``, ``prefill_head_dim``): one of ``PAGEKV_HEAD_DIMS`` in ``kernels.h``,
    the one place that lists them."""
    return functools.cache(lambda head_dim: bool(query(head_dim)))


def library_for(
    name: str, target: str | None, disable_env: str, extra: tuple[str, ...] = ()
) -> ctypes.CDLL | None:
    """The library a wrapper loads: for ``target``, or by default the selected target
    (``isa.selected()``: ``$PAGEKV_CPU_ISA`` or the best here); None where ``$disable_env`` is
    "0", the selection is ``none``, or it cannot be built."""
    if os.environ.get(disable_env, "1") == "0":
        return None
    return load_optional(name, isa.selected() if target is None else target, extra)


@functools.cache
def load(name: str, target: str, extra: tuple[str, ...] = ()) -> ctypes.CDLL:
    """``csrc/<name>.cpp`` built for ``target`` (once per machine, then cached), its functions
    typed from kernels.h. Raises KernelUnavailable with the reason (the compiler's output)."""
    compiler = find_compiler()
    if compiler is None:
        raise KernelUnavailable("no C++ compiler found (install g++ or set $CXX)")
    flags = flags_for(target, extra)
    key = hashlib.blake2b(digest_size=8)
    for part in (*_sources_text(), " ".join(flags), compiler, _compiler_version(compiler)):
        key.update(part.encode())
    built = _cache_dir() / f"{name}-{target}-{key.hexdigest()}.so"
    try:
        if not built.exists():
            _build(compiler, flags, CSRC / f"{name}.cpp", built)
        library = ctypes.CDLL(str(built))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        raise KernelUnavailable(f"{exc}\n{detail.decode(errors='replace')[-2000:]}") from exc
    for fn_name, (restype, argtypes) in signatures().items():
        fn = getattr(library, fn_name, None)
        if fn is not None:
            fn.restype, fn.argtypes = restype, argtypes
    _outcomes[(name, target)] = "ok"
    return library


# Debian's cross compiler for 64-bit ARM (g++-aarch64-linux-gnu): with it the compile check also
# builds the generic target for aarch64, whose vector layer (csrc/vec.h's plain loops) the
# compiler turns into NEON there.
AARCH64_COMPILER = "aarch64-linux-gnu-g++"


def compile_check(
    name: str, target: str, compiler: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``csrc/<name>.cpp`` compiled for ``target`` with ``-Werror`` and nothing kept: runs on
    any x86-64 machine whatever its CPU, so no target's branches rot unbuilt. A full compile
    (not ``-fsyntax-only``): some warnings come only from the optimizer's inlining.
    ``compiler``: another than the build's (a cross compiler)."""
    compiler = compiler or find_compiler()
    if compiler is None:
        raise KernelUnavailable("no C++ compiler found")
    source = str(CSRC / f"{name}.cpp")
    command = [compiler, *flags_for(target), "-Werror", "-c", source, "-o", os.devnull]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


def library_names() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in CSRC.glob("*.cpp")))


_SCALARS: dict[str, type | None] = {
    "void": None,
    "int": ctypes.c_int,
    "long": ctypes.c_long,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
}
_DECLARATION = re.compile(r"(\w+)\s+(\w+)\s*\(([^)]*)\)\s*;")


@functools.cache
def signatures() -> dict[str, tuple[type | None, list[type]]]:
    """Each function declared in kernels.h: (restype, argtypes) for ctypes."""
    text = re.sub(r"//[^\n]*", "", HEADER.read_text(encoding="utf-8"))
    body = text.split('extern "C" {', 1)[1]
    found: dict[str, tuple[type | None, list[type]]] = {}
    for restype, fn_name, params in _DECLARATION.findall(body):
        argtypes: list[type] = []
        for param in params.split(","):
            param = param.strip()
            if param in ("", "void"):
                continue
            if "*" in param:
                argtypes.append(ctypes.c_void_p)
            else:
                scalar = _SCALARS.get(param.split()[0])
                if scalar is None:
                    raise ValueError(f"kernels.h: {fn_name}: unsupported parameter {param!r}")
                argtypes.append(scalar)
        if restype not in _SCALARS or fn_name in found:
            raise ValueError(f"kernels.h: {fn_name}: declared twice or returns {restype!r}")
        found[fn_name] = (_SCALARS[restype], argtypes)
    return found


# The types a struct's field may have besides these scalars: a pointer (an address) or a struct
# declared before it.
_FIELD_SCALARS: dict[str, type] = {
    "int": ctypes.c_int,
    "long": ctypes.c_long,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
    "int32_t": ctypes.c_int32,
    "int64_t": ctypes.c_int64,
}
_STRUCT = re.compile(r"struct\s+(\w+)\s*\{([^}]*)\}\s*;")
_FIELDS = re.compile(r"^(?:const\s+)?(\w+)\s*(\*?)\s*(\w+(?:\s*,\s*\w+)*)$")


@functools.cache
def structs() -> dict[str, list[tuple[str, type | str]]]:
    """Each struct declared in kernels.h: its fields in order, each (name, type): a ctypes
    scalar, ``ctypes.c_void_p`` for a pointer, or the name of a struct declared before it."""
    text = re.sub(r"//[^\n]*", "", HEADER.read_text(encoding="utf-8"))
    found: dict[str, list[tuple[str, type | str]]] = {}
    for name, body in _STRUCT.findall(text):
        fields: list[tuple[str, type | str]] = []
        for declaration in filter(None, (d.strip() for d in body.split(";"))):
            match = _FIELDS.match(" ".join(declaration.split()))
            if match is None:
                raise ValueError(f"kernels.h: struct {name}: unsupported field {declaration!r}")
            base, pointer, names = match.groups()
            kind: type | str | None = (
                ctypes.c_void_p
                if pointer
                else _FIELD_SCALARS.get(base, base if base in found else None)
            )
            if kind is None:
                raise ValueError(f"kernels.h: struct {name}: unknown type {base!r}")
            fields += [(field.strip(), kind) for field in names.split(",")]
        if name in found:
            raise ValueError(f"kernels.h: struct {name} declared twice")
        found[name] = fields
    return found


def _sources_text() -> list[str]:
    """Every source under csrc/, named and read, in one order."""
    files = sorted(p for p in CSRC.rglob("*") if p.is_file())
    return [f"{p.relative_to(CSRC).as_posix()}\n{p.read_text(encoding='utf-8')}" for p in files]


@functools.cache
def _compiler_version(compiler: str) -> str:
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "pagekv" / "kernels"


def _build(compiler: str, flags: tuple[str, ...], source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        done = subprocess.run(
            [compiler, *flags, "-shared", str(source), "-o", str(built)],
            check=True,
            capture_output=True,
            timeout=600,
        )
        if done.stderr:  # warnings: the compile check keeps them at zero, so say so
            logger.warning("kernel build %s: %s", source.name, done.stderr.decode()[-2000:])
        os.replace(built, target)  # atomic: a concurrent process sees all or nothing
