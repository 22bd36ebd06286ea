"""Kernel targets for the fast-path tests, registered with `pytest_plugins` in conftest.py.

``kernel_target`` runs a test once per kernel target (``pagekv.kernels.isa.TARGETS``) with
``$PAGEKV_CPU_ISA`` set to it, so every ``load()`` and every runner the test builds uses that
target's libraries; a target this CPU cannot execute is skipped with the features it lacks,
never failed. ``PAGEKV_TEST_TARGETS=avx2,amx`` (or ``best``: the best target this CPU runs)
narrows the targets to those (``make test-quick``, ``make test-kernels TARGET=...``). Every test
that takes ``kernel_target``, and every test under ``tests/kernels/``, is marked ``kernels``.

``PAGEKV_TEST_AS_CPU=avx2`` runs the whole suite as on a CPU with AVX2 + FMA and nothing wider:
the AVX-512 and AMX flags are hidden from ``isa.cpu_features()``, the kernels default to the
``avx2`` target (servers the tests start inherit it), and torch's own kernel libraries are
capped at AVX2 by their variables, set here before anything imports torch.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pagekv.kernels import isa

TARGET_NAMES = [t.name for t in isa.TARGETS]
AS_CPU_ENV = "PAGEKV_TEST_AS_CPU"
TARGETS_ENV = "PAGEKV_TEST_TARGETS"
KERNEL_TESTS = Path(__file__).parent / "kernels"
# torch's kernel libraries, each capped at AVX2 by its own variable
TORCH_AVX2_CAPS = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}


def as_avx2_only_cpu() -> None:
    features = frozenset(f for f in isa.cpu_features() if not f.startswith(("avx512", "amx")))
    isa.cpu_features = lambda: features  # type: ignore[assignment]
    os.environ.setdefault(isa.ISA_ENV, "avx2")
    os.environ.update(TORCH_AVX2_CAPS)


if os.environ.get(AS_CPU_ENV):
    if os.environ[AS_CPU_ENV] != "avx2":
        raise pytest.UsageError(f"{AS_CPU_ENV}={os.environ[AS_CPU_ENV]!r}: only avx2 is known")
    as_avx2_only_cpu()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """At the end of the run: what the kernels saw of this CPU, and what they and torch ran."""
    import torch  # here, not at import: the caps above must come first

    terminalreporter.write_line(
        f"kernel targets: this CPU runs {', '.join(isa.runnable())}; "
        f"{isa.ISA_ENV}={os.environ.get(isa.ISA_ENV, '')!r} selects {isa.selected()}; "
        f"torch's CPU capability {torch.backends.cpu.get_cpu_capability()}"
    )


def skip_unless_runnable(name: str) -> None:
    missing = isa.BY_NAME[name].missing(isa.cpu_features())
    if missing:
        pytest.skip(f"kernel target {name}: this CPU lacks {', '.join(missing)}")


def chosen_targets() -> list[str]:
    """The targets ``kernel_target`` runs: all, or those ``$PAGEKV_TEST_TARGETS`` names."""
    named = [n.strip() for n in os.environ.get(TARGETS_ENV, "").split(",") if n.strip()]
    chosen = [isa.best() if n == "best" else n for n in named]
    unknown = sorted(set(chosen) - set(TARGET_NAMES))
    if unknown:
        raise pytest.UsageError(
            f"{TARGETS_ENV}: unknown kernel targets {unknown}; known: {TARGET_NAMES} and best"
        )
    return list(dict.fromkeys(chosen)) or TARGET_NAMES


@pytest.fixture(params=chosen_targets())
def kernel_target(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    skip_unless_runnable(request.param)
    monkeypatch.setenv(isa.ISA_ENV, request.param)
    return str(request.param)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "kernel_target" in getattr(item, "fixturenames", ()) or item.path.is_relative_to(
            KERNEL_TESTS
        ):
            item.add_marker(pytest.mark.kernels)
