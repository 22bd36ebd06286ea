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

# C++ shared by the bf16 kernels (the fused ops' matmul, the prefill attention): float32 ->
# bfloat16 rounding for any AVX-512 CPU; the tile permission and one tile configuration for all
# of them where the CPU has AMX; which unit multiplies tiles.
BF16_SOURCE = r"""
#if defined(__AVX512F__)
#include <cstdint>
#include <immintrin.h>

// 16 float32 -> bfloat16, rounded to nearest even as torch does; NaN stays NaN.
static inline __m256i round_bf16x16(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q),
                              _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
}
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#include <sys/syscall.h>
#include <unistd.h>

static bool amx_permitted() {  // Linux grants the tile state on request, once per process
    static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                   18 /* XFEATURE_XTILEDATA */) == 0;
    return ok;
}

// Every tile register 16 rows x 64 bytes: 16 x 32 bf16 operands, 16 x 16 float32 sums.
static inline void configure_tiles() {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg{};
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    _tile_loadconfig(&cfg);
}
#endif
#if defined(__AVX512F__)
// What multiplies packed bf16 tiles here (the codes of TILE_UNITS): 2, AMX (built for it and
// granted by Linux); 1, AVX512-BF16 vector dot products reading the same tiles.
static int best_tile_unit() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    return amx_permitted() ? 2 : 1;
#else
    return 1;
#endif
}
#endif
"""
# best_tile_unit()'s codes, by name (the kernels' ``backend`` / ``matmul_unit``).
TILE_UNITS = {2: "amx", 1: "avx512-bf16"}


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
