"""Kernel targets for the fast-path tests, registered with `pytest_plugins` in conftest.py.

``kernel_target`` runs a test once per kernel target (``pagekv.kernels.isa.TARGETS``) with
``$PAGEKV_CPU_ISA`` set to it, so every ``load()`` and every runner the test builds uses that
target's libraries; a target this CPU cannot execute is skipped with the features it lacks,
never failed.
"""

from __future__ import annotations

import pytest

from pagekv.kernels import isa

TARGET_NAMES = [t.name for t in isa.TARGETS]


def skip_unless_runnable(name: str) -> None:
    missing = isa.BY_NAME[name].missing(isa.cpu_features())
    if missing:
        pytest.skip(f"kernel target {name}: this CPU lacks {', '.join(missing)}")


@pytest.fixture(params=TARGET_NAMES)
def kernel_target(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    skip_unless_runnable(request.param)
    monkeypatch.setenv(isa.ISA_ENV, request.param)
    return str(request.param)
