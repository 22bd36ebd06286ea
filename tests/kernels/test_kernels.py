"""The kernel layer's machinery: targets and their choice, the header's signatures, the build's
warnings, the compile check, and the line that says what runs."""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import re
import subprocess
from pathlib import Path

import pytest
import torch

from pagekv.kernels import build, fused_ops, isa, report
from pagekv.kernels import decode as decode_kernel
from pagekv.kernels import prefill as prefill_kernel

needs_compiler = pytest.mark.skipif(build.find_compiler() is None, reason="no C++ compiler")


def test_every_cpu_runs_generic_and_targets_need_what_they_say() -> None:
    assert isa.runnable()[0] == "generic"
    assert isa.best() == isa.runnable()[-1]
    lacking = isa.BY_NAME["avx2"].missing(frozenset({"avx2", "fma", "bmi2"}))
    assert "f16c" in lacking and "movbe" in lacking and not {"avx2", "fma", "bmi2"} & set(lacking)
    assert isa.BY_NAME["generic"].missing(frozenset()) == ()
    features = isa.cpu_features()
    for target in isa.TARGETS:
        assert (target.name in isa.runnable()) == (not target.missing(features))


# The compiler's macro for each instruction set a target's flags let it use, and that set's
# name in /proc/cpuinfo.
ISA_MACROS = {
    "__SSE3__": "pni",
    "__SSSE3__": "ssse3",
    "__SSE4_1__": "sse4_1",
    "__SSE4_2__": "sse4_2",
    "__CRC32__": "sse4_2",
    "__POPCNT__": "popcnt",
    "__GCC_HAVE_SYNC_COMPARE_AND_SWAP_16": "cx16",
    "__LAHF_SAHF__": "lahf_lm",
    "__AVX__": "avx",
    "__AVX2__": "avx2",
    "__BMI__": "bmi1",
    "__BMI2__": "bmi2",
    "__F16C__": "f16c",
    "__FMA__": "fma",
    "__LZCNT__": "abm",
    "__MOVBE__": "movbe",
    "__XSAVE__": "xsave",
    "__AVX512F__": "avx512f",
    "__AVX512BW__": "avx512bw",
    "__AVX512CD__": "avx512cd",
    "__AVX512DQ__": "avx512dq",
    "__AVX512VL__": "avx512vl",
    "__AVX512BF16__": "avx512_bf16",
    "__AVX512VNNI__": "avx512_vnni",
    "__AVX512VBMI__": "avx512vbmi",
    "__AMX_TILE__": "amx_tile",
    "__AMX_BF16__": "amx_bf16",
}


def _macros(compiler: str, flags: tuple[str, ...]) -> set[str]:
    command = [compiler, *flags, "-dM", "-E", "-x", "c++", os.devnull]
    lines = subprocess.run(command, capture_output=True, text=True, check=True).stdout.splitlines()
    return {line.split()[1] for line in lines if line.startswith("#define ")}


@needs_compiler
@pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64"), reason="the x86-64 targets' flags"
)
def test_a_target_runs_only_where_the_cpu_has_every_set_its_flags_enable() -> None:
    """A CPU that lacks one of them must not get the target: the compiler may use any."""
    compiler = build.find_compiler()
    assert compiler is not None
    baseline = _macros(compiler, ())
    for target in isa.TARGETS:
        if not target.x86_only:
            continue
        enabled = _macros(compiler, target.flags) - baseline
        sets = {ISA_MACROS[m] for m in enabled if m in ISA_MACROS}
        assert sets, f"{target.name}: its flags enable no instruction set this test knows"
        unchecked = sets - set(target.needs)
        assert not unchecked, f"{target.name}'s flags enable {unchecked}, which it does not check"


# A branch on an instruction set's macro (``#if defined(__AVX2__)``): csrc/arch/'s business.
ISA_BRANCH = re.compile(r"^\s*#\s*(el)?if.*__(AVX|AMX|FMA|F16C|SSE|aarch64|ARM)", re.MULTILINE)
# Kernel files that still branch on them themselves: the prefill kernel's tiles.
ISA_BRANCHES_OUTSIDE_ARCH = {"tile_products.h"}


def test_each_target_is_one_header_and_only_the_headers_branch_on_instruction_sets() -> None:
    """Adding a target is its header, csrc/arch/<target>.h, and its entry in TARGETS
    (csrc/arch/target.h); the kernels are written once on what the headers define."""
    for target in isa.TARGETS:
        assert build.arch_header(target.name).is_file(), target.name
        assert f'-DPAGEKV_ARCH="arch/{target.name}.h"' in build.flags_for(target.name)
    branching = {p.name for p in build.CSRC.glob("*.*") if ISA_BRANCH.search(p.read_text())}
    assert branching == ISA_BRANCHES_OUTSIDE_ARCH
    assert ISA_BRANCH.search("#elif defined(__AVX512F__)\n") and not ISA_BRANCH.search(
        "#if defined(__x86_64__)\n// __AVX2__\n"
    )


def test_the_selection_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(isa.ISA_ENV, raising=False)
    assert isa.selected() == isa.best()
    for name in isa.runnable():
        monkeypatch.setenv(isa.ISA_ENV, name.upper())
        assert isa.selected() == name
    monkeypatch.setenv(isa.ISA_ENV, "none")
    assert isa.selected() is None
    assert decode_kernel.load() is None and fused_ops.load() is None
    assert prefill_kernel.load() is None
    monkeypatch.setenv(isa.ISA_ENV, "sse9")
    with pytest.raises(isa.KernelTargetError, match="not a kernel target"):
        isa.selected()


def test_a_target_this_cpu_lacks_is_refused_with_what_it_lacks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    avx2_cpu = frozenset(isa.BY_NAME["avx2"].needs)
    monkeypatch.setattr(isa, "cpu_features", lambda: avx2_cpu)
    monkeypatch.setenv(isa.ISA_ENV, "avx512bf16")
    with pytest.raises(isa.KernelTargetError, match=r"lacks avx512f.*it can run generic, avx2"):
        isa.selected()
    monkeypatch.delenv(isa.ISA_ENV)
    assert "avx512" not in isa.runnable() and isa.selected() == isa.runnable()[-1]


def test_the_header_types_every_entry_point() -> None:
    signatures = build.signatures()
    restype, argtypes = signatures["write_rows"]
    assert restype is ctypes.c_int
    assert argtypes == [ctypes.c_void_p] * 5 + [ctypes.c_long] * 3
    assert signatures["stripes_width"] == (ctypes.c_int, [])
    assert signatures["argmax_bf16_rows"][0] is None
    assert len(signatures) >= 30


@needs_compiler
def test_every_declared_function_is_defined_by_exactly_one_library() -> None:
    target = isa.best()
    libraries = [build.load(name, target) for name in build.library_names()]
    for fn_name in build.signatures():
        defined = [lib for lib in libraries if hasattr(lib, fn_name)]
        assert len(defined) == 1, fn_name


@needs_compiler
def test_the_compile_check_fails_on_a_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "kernels.h").write_text(build.HEADER.read_text())
    (tmp_path / "clean.cpp").write_text('#include "kernels.h"\nint stripes_width() { return 8; }\n')
    (tmp_path / "unused.cpp").write_text("static int f(int x) { int y = 1; return x; }\n")
    monkeypatch.setattr(build, "CSRC", tmp_path)
    assert build.compile_check("clean", "generic").returncode == 0
    unused = build.compile_check("unused", "avx2")  # avx2 compiles here whatever the CPU
    assert unused.returncode != 0 and "unused.cpp:1" in unused.stderr


@needs_compiler
def test_a_failed_build_is_a_warning_with_the_compiler_message(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "kernels.h").write_text(build.HEADER.read_text())
    (tmp_path / "broken.cpp").write_text("int broken( { }\n")
    monkeypatch.setattr(build, "CSRC", tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    build.forget()
    try:
        with caplog.at_level(logging.WARNING, logger="pagekv"):
            assert build.load_optional("broken", "generic") is None
            assert build.load_optional("broken", "generic") is None  # said once, not rebuilt
        warnings = [r for r in caplog.records if "broken" in r.getMessage()]
        assert len(warnings) == 1 and "broken.cpp:1" in warnings[0].getMessage()
        assert build.outcomes()[("broken", "generic")] != "ok"
    finally:
        build.forget()


class _DecodeOf64:
    """A decode kernel as the report sees it: one that takes head_dim 64 only."""

    @staticmethod
    def supports(dtype: torch.dtype, head_dim: int, query: torch.dtype | None = None) -> bool:
        return head_dim == 64


def test_the_line_names_the_cpu_target_and_kernels() -> None:
    stripes = torch.empty(4, 8, 16)
    info = report.describe("avx2", torch.float32, _DecodeOf64(), None, None, stripes, head_dim=64)
    assert info["kernel_target"] == "avx2" and info["matmul"] == "stripes of 16"
    assert info["decode_attention"] == "C++" and info["prefill_attention"] == "SDPA"
    line = report.line(info, torch.float32)
    assert line.startswith(f"CPU: {isa.cpu_name()} (")
    assert "kernel target avx2; float32, head_dim 64:" in line
    # a head_dim the kernel does not take is torch's, and the line says so
    wide = report.describe("avx2", torch.float32, _DecodeOf64(), None, None, stripes, head_dim=96)
    assert wide["decode_attention"] == "torch" and "head_dim 96: decode attention torch" in (
        report.line(wide, torch.float32)
    )
    # 8-bit KV blocks are named beside the model's dtype
    kv8 = report.describe(
        "avx2", torch.bfloat16, _DecodeOf64(), None, None, stripes, head_dim=64, kv_dtype=torch.int8
    )
    assert "bfloat16 (KV blocks int8), head_dim 64: decode attention C++" in (
        report.line(kv8, torch.bfloat16)
    )
    assert report.matmul_kind(torch.empty(2, 3, 16, 32), "amx") == "tiles (amx)"
    assert report.matmul_kind(None, None) == "torch"
