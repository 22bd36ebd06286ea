"""The avx2 target on an emulated AVX2-only CPU, whatever CPU runs the suite.

QEMU's user-mode emulator (Debian's ``qemu-user``) runs Python as an AMD EPYC Milan (Zen 3: AVX2
and FMA, no AVX-512, no AMX), where an instruction that CPU lacks is an illegal instruction, as
on the real one: in pagekv's avx2 libraries, in the torch kernels under them (torch reads the
emulated CPU's features and picks its AVX2 code), in numpy. A child pytest runs there the
kernel tests of the avx2 target, with ``PAGEKV_TEST_AS_CPU=avx2``: the emulator shows the
host's /proc/cpuinfo, so the wider flags are hidden from the target choice as that CPU would
not show them.

The emulator is tens of times slower than the CPU under it, so only a few small cases of each
kernel and two tiny models run there (about four minutes); the whole suite, the default model's
golden tests included, runs as an AVX2-only CPU with ``PAGEKV_TEST_AS_CPU=avx2`` alone.
"""

from __future__ import annotations

import os
import platform
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from kernel_targets import AS_CPU_ENV
from system_packages import require_binary

from pagekv.kernels import isa

ROOT = Path(__file__).resolve().parents[1]
EMULATED_CPU = "EPYC-Milan"
# One or a few cases of each kernel of the avx2 target, small shapes: decode and prefill
# attention, float32, bf16 and GGUF matmul stripes, int8 dot products, the layer halves in one
# call, the elementwise ops; then the engine's greedy tokens against transformers' float32 ones
# on tiny random models of two families, Phi-3 (its layers in one C call) and Qwen3 (op by op).
# Named one by one, so that a rename fails here instead of shrinking the run.
KERNEL_TESTS = {
    "test_attention_fast.py": (
        "test_kernel_matches_torch_decode[avx2-heads0-64-dtype0]",
        "test_kernel_matches_torch_decode[avx2-heads0-64-dtype1]",
        "test_threads_sharing_a_sequence_change_no_bit[avx2-query_lens0-seq_lens0-heads0-dtype0]",
        "test_prefill_kernel_matches_float32_attention[float32 vectors-avx2-heads0-16]",
    ),
    "test_fused_ops.py": (
        "test_float32_stripes_are_within_float32_rounding_and_batch_invariant[avx2-(64, 96)-1]",
        "test_float32_stripes_are_within_float32_rounding_and_batch_invariant[avx2-(64, 96)-7]",
        "test_float32_stripes_are_within_float32_rounding_and_batch_invariant[avx2-(64, 96)-300]",
        "test_bf16_stripes_are_float32_sums_rounded_once_and_batch_invariant[avx2-(960, 576)-7]",
        "test_layer_halves_in_one_call_are_the_ops_one_by_one[avx2-later layer-5-float32]",
        "test_layer_halves_in_one_call_are_the_ops_one_by_one[avx2-later layer-5-bf16]",
        "test_rms_norm[avx2-64-torch.float32]",
        "test_silu_mul[avx2-64-torch.float32]",
        "test_split_rope_is_exact[avx2-(9, 3, 64)-64-torch.float32]",
    ),
    "test_quantized.py": (
        "test_quantized_matmul_matches_the_dequantized_weights[avx2-Q4_1]",
        "test_quantized_matmul_matches_the_dequantized_weights[avx2-Q6_K]",
        "test_int8_activations_are_the_rounded_rows_product[avx2-Q4_1]",
    ),
    "test_families.py": (
        "test_greedy_equals_transformers_on_every_kernel_target[phi3-avx2]",
        "test_greedy_equals_transformers_on_every_kernel_target[qwen3-avx2]",
    ),
}


@pytest.fixture(scope="module")
def qemu() -> str:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the emulator runs this Python only where it is an x86-64 program")
    # the emulator passes this CPU's /proc/cpuinfo through, and the target choice reads it
    lacking = isa.BY_NAME["avx2"].missing(isa.cpu_features())
    if lacking:
        pytest.skip(f"the emulated CPU shows this CPU's flags, which lack {', '.join(lacking)}")
    return require_binary("qemu-user", "qemu-x86_64")


def emulated(qemu: str, args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """This Python with ``args`` on the emulated CPU, from the repository root, choosing its
    kernel target as that CPU would, whatever target the suite forces (``PAGEKV_CPU_ISA=none``
    included). An illegal instruction kills the emulator: the shell before it allows no core
    file."""
    env = {name: value for name, value in os.environ.items() if name != isa.ISA_ENV}
    env.update({"QEMU_CPU": EMULATED_CPU, AS_CPU_ENV: "avx2"})
    command = ["sh", "-c", 'ulimit -c 0 && exec "$@"', "sh", qemu, sys.executable, *args]
    return subprocess.run(
        command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


# One kernel of the roofline library, built for the target in argv[1]: a few float32 FMAs.
FMA_SCRIPT = (
    "import sys; from pagekv.kernels import build; "
    "print(build.load('roofline', sys.argv[1]).fma_f32(1000, 1))"
)


def test_the_emulated_cpu_runs_avx2_and_refuses_avx512(qemu: str) -> None:
    """The check can fail: the same kernel built for avx512 is an illegal instruction there."""
    avx2 = emulated(qemu, ["-c", FMA_SCRIPT, "avx2"], timeout=300)
    assert avx2.returncode == 0, avx2.stderr[-2000:]
    assert float(avx2.stdout) > 0
    avx512 = emulated(qemu, ["-c", FMA_SCRIPT, "avx512"], timeout=300)
    assert avx512.returncode == -signal.SIGILL, (avx512.returncode, avx512.stderr[-2000:])


def test_the_avx2_kernel_tests_pass_on_an_emulated_avx2_only_cpu(qemu: str) -> None:
    cases = [f"tests/{file}::{case}" for file, names in KERNEL_TESTS.items() for case in names]
    args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", *cases]
    run = emulated(qemu, args, timeout=1200)
    report = run.stdout[-4000:]
    assert run.returncode == 0, report + run.stderr[-2000:]
    # torch saw the emulated CPU, and the kernels ran the avx2 target
    assert "torch's CPU capability AVX2" in run.stdout, report
    assert "selects avx2" in run.stdout, report
    assert re.search(rf"\b{len(cases)} passed", run.stdout), report
