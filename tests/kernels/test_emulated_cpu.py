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

from pagekv.kernels import isa
from tests.kernel_targets import AS_CPU_ENV, TARGETS_ENV
from tests.kernels import emulated_cases
from tests.system_packages import require_binary

ROOT = Path(__file__).resolve().parents[2]
EMULATED_CPU = "EPYC-Milan"


@pytest.fixture(scope="module")
def qemu() -> str:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the emulator runs this Python only where it is an x86-64 program")
    # the emulator passes this CPU's /proc/cpuinfo through, and the target choice reads it
    lacking = isa.BY_NAME["avx2"].missing(isa.cpu_features())
    if lacking:
        pytest.skip(f"the emulated CPU shows this CPU's flags, which lack {', '.join(lacking)}")
    return require_binary("qemu-user", "qemu-x86_64")


def untargeted_env() -> dict[str, str]:
    """This process's environment without the kernel target the suite forces, if any."""
    return {k: v for k, v in os.environ.items() if k not in (isa.ISA_ENV, TARGETS_ENV)}


def emulated(qemu: str, args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """This Python with ``args`` on the emulated CPU, from the repository root, choosing its
    kernel target as that CPU would, whatever target the suite forces (``PAGEKV_CPU_ISA=none``
    included). An illegal instruction kills the emulator: the shell before it allows no core
    file."""
    env = {**untargeted_env(), "QEMU_CPU": EMULATED_CPU, AS_CPU_ENV: "avx2"}
    command = ["sh", "-c", 'ulimit -c 0 && exec "$@"', "sh", qemu, sys.executable, *args]
    return subprocess.run(
        command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


# One kernel of the roofline library, built for the target in argv[1]: a few float32 FMAs.
FMA_SCRIPT = (
    "import sys; from pagekv.kernels import build; "
    "print(build.load('roofline', sys.argv[1]).fma_f32(1000, 1))"
)


@pytest.mark.slow
def test_the_emulated_cpu_runs_avx2_and_refuses_avx512(qemu: str) -> None:
    """The check can fail: the same kernel built for avx512 is an illegal instruction there."""
    avx2 = emulated(qemu, ["-c", FMA_SCRIPT, "avx2"], timeout=300)
    assert avx2.returncode == 0, avx2.stderr[-2000:]
    assert float(avx2.stdout) > 0
    avx512 = emulated(qemu, ["-c", FMA_SCRIPT, "avx512"], timeout=300)
    assert avx512.returncode == -signal.SIGILL, (avx512.returncode, avx512.stderr[-2000:])


PLUGIN = ["-p", "no:cacheprovider", "-p", "tests.kernels.emulated_cases"]


def outcome(stdout: str) -> dict[str, int]:
    """pytest's closing counts (``19 passed, 2981 deselected in 9.00s``) by outcome."""
    closing = stdout.strip().splitlines()[-1]
    return {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", closing.split(" in ")[0])}


def test_every_emulated_case_names_one_test() -> None:
    """The cases' parameters still name one test each (checked here, without the emulator)."""
    args = [sys.executable, "-m", "pytest", "-q", "--collect-only", *PLUGIN]
    env = untargeted_env()
    run = subprocess.run(
        [*args, *emulated_cases.FILES], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    collected = [line for line in run.stdout.splitlines() if "::" in line]
    assert len(collected) == len(emulated_cases.CASES), run.stdout[-4000:]


@pytest.mark.slow
def test_the_avx2_kernel_tests_pass_on_an_emulated_avx2_only_cpu(qemu: str) -> None:
    """The cases of ``emulated_cases.py``, chosen by the plugin there from what pytest collects."""
    run = emulated(qemu, ["-m", "pytest", "-q", *PLUGIN, *emulated_cases.FILES], timeout=1200)
    report = run.stdout[-4000:]
    assert run.returncode == 0, report + run.stderr[-2000:]
    # torch saw the emulated CPU, and the kernels ran the avx2 target
    assert "torch's CPU capability AVX2" in run.stdout, report
    assert "selects avx2" in run.stdout, report
    counts = outcome(run.stdout)
    assert counts.pop("passed") == len(emulated_cases.CASES), report
    assert set(counts) <= {"deselected", "warnings", "warning"}, report
