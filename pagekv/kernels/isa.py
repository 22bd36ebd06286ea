"""Kernel targets: the instruction sets a library is built for, and which one runs here.

Every kernel library is built once per target from the same sources (``csrc/``); each target's
instruction-set bodies are one header, ``csrc/arch/<target>.h``, which its build names and the
vector layer (``csrc/vec.h``) includes. Adding a target is that header and its entry in
``TARGETS`` (``csrc/arch/target.h`` lists what the header defines). At run time the best target
this CPU can execute is chosen, or the one ``$PAGEKV_CPU_ISA`` names (``none``: no C kernels,
torch ops everywhere), so a machine with more can measure the lesser ones.

Imports nothing of pagekv but its errors, and no torch.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

from pagekv.errors import PagekvError

ISA_ENV = "PAGEKV_CPU_ISA"
NONE = "none"  # $PAGEKV_CPU_ISA=none: the torch fallbacks everywhere


@dataclass(frozen=True)
class Target:
    name: str
    flags: tuple[str, ...]  # compiler flags selecting the instruction set
    needs: tuple[str, ...]  # /proc/cpuinfo flags the CPU must have
    x86_only: bool = True

    def missing(self, features: frozenset[str]) -> tuple[str, ...]:
        """The features this CPU lacks for the target (empty: it runs here)."""
        if self.x86_only and not _is_x86():
            return ("x86-64",)
        return tuple(f for f in self.needs if f not in features)


# All that -march=x86-64-v3 lets the compiler use, as Linux names it: x86-64-v2 (SSE3 is "pni",
# LAHF/SAHF "lahf_lm"), then AVX, AVX2, BMI1/2, F16C, FMA, LZCNT ("abm"), MOVBE and XSAVE. Every
# AVX2 CPU has them all, but a hypervisor may hide one.
_X86_64_V2 = ("pni", "ssse3", "sse4_1", "sse4_2", "popcnt", "cx16", "lahf_lm")
_AVX2 = (*_X86_64_V2, "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")
# Instruction set from the target, scheduling tuned for the CPU that builds (kernels are built on
# the machine that runs them): the same tuning -march=native gave.
_TUNE = ("-mtune=native",) if platform.machine().lower() in ("x86_64", "amd64") else ()
_AVX512 = (*_AVX2, "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd")
# With AVX512-BF16 the int8 dot products of AVX512-VNNI and the byte permutes of AVX512-VBMI,
# which Sapphire Rapids and later and Zen 4 and later all have (Cooper Lake, without VBMI, runs
# the avx512 target).
_BF16 = ("avx512_bf16", "avx512_vnni", "avx512vbmi")
_BF16_FLAGS = ("-mavx512bf16", "-mavx512vnni", "-mavx512vbmi")

# Lesser to greater; each needs what the ones before it need (but generic). Each is built with
# its header, csrc/arch/<name>.h.
TARGETS: tuple[Target, ...] = (
    Target("generic", (), (), x86_only=False),  # the compiler's default instruction set
    Target("avx2", ("-march=x86-64-v3", *_TUNE), _AVX2),
    Target("avx512", ("-march=x86-64-v4", *_TUNE), _AVX512),
    Target("avx512bf16", ("-march=x86-64-v4", *_BF16_FLAGS, *_TUNE), (*_AVX512, *_BF16)),
    Target(
        "amx",
        ("-march=x86-64-v4", *_BF16_FLAGS, "-mamx-tile", "-mamx-bf16", *_TUNE),
        (*_AVX512, *_BF16, "amx_tile", "amx_bf16"),
    ),
)
BY_NAME = {t.name: t for t in TARGETS}


# What multiplies packed bf16 tiles, by the codes the libraries' best_tile_unit() returns.
TILE_UNITS = {2: "amx", 1: "avx512-bf16"}


class KernelTargetError(PagekvError, ValueError):
    """``$PAGEKV_CPU_ISA`` names no target, or one this CPU cannot execute."""


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


@functools.cache
def cpu_features() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (empty where /proc/cpuinfo is not)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def runnable() -> tuple[str, ...]:
    """The targets this CPU can execute, lesser to greater."""
    return _runnable(cpu_features())


@functools.cache  # asked each step (which library a wrapper loads): one lookup, not a scan
def _runnable(features: frozenset[str]) -> tuple[str, ...]:
    return tuple(t.name for t in TARGETS if not t.missing(features))


def best() -> str:
    return runnable()[-1]


def selected() -> str | None:
    """The target the kernels load: ``$PAGEKV_CPU_ISA`` if set, else the best one here; None
    for ``none``. Raises KernelTargetError for a name that is not a target or cannot run here."""
    return _selected(os.environ.get(ISA_ENV, "").strip().lower(), cpu_features())


@functools.cache
def _selected(name: str, features: frozenset[str]) -> str | None:
    if not name:
        return _runnable(features)[-1]
    if name == NONE:
        return None
    if name not in BY_NAME:
        choices = ", ".join([*BY_NAME, NONE])
        raise KernelTargetError(f"{ISA_ENV}={name!r}: not a kernel target (one of {choices})")
    missing = BY_NAME[name].missing(features)
    if missing:
        raise KernelTargetError(
            f"{ISA_ENV}={name}: this CPU lacks {', '.join(missing)}; it can run "
            + ", ".join(_runnable(features))
        )
    return name


def shown_features() -> str:
    """The vector features that matter to the kernels, as found on this CPU."""
    features = cpu_features()
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "asimd", "sve")
    return " ".join(f for f in wanted if f in features) or "none of avx2/avx512/amx"
