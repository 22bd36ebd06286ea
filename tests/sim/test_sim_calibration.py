"""pagekv.sim.calibrate on the real default model: a quick grid, fitted, written, reloaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagekv.errors import InvalidRequestError
from pagekv.sim.calibrate import CalibrationSettings, calibrate, default_grid
from pagekv.sim.cli import main
from pagekv.sim.cost_model import CostModel


def test_default_grid_spans_block_sizes_and_step_kinds() -> None:
    grid = default_grid()
    assert {s.block_size for s in grid} == {1, 4, 16, 64}
    kinds = {
        "decode": any(all(q == 1 for q, _ in s.pairs) for s in grid),
        "prefill": any(all(q == c for q, c in s.pairs) and s.pairs[0][0] > 1 for s in grid),
        "prefix hit": any(1 < s.pairs[0][0] < s.pairs[0][1] for s in grid),
        "mixed": any(s.pairs[0][0] > 1 and s.pairs[-1][0] == 1 for s in grid),
    }
    assert all(kinds.values()), kinds


def test_bad_settings_are_rejected() -> None:
    with pytest.raises(InvalidRequestError, match="clock must be one of"):
        CalibrationSettings(clock="sundial")
    with pytest.raises(InvalidRequestError, match="repeats and num_threads must be >= 1"):
        CalibrationSettings(repeats=0)


@pytest.mark.model
def test_quick_calibration_fits_the_runner(tmp_path: Path) -> None:
    model, measurements = calibrate(CalibrationSettings(quick=True, repeats=1))
    assert len(measurements) == len(default_grid(quick=True))
    assert all(m.seconds and min(m.seconds) > 0 for m in measurements)
    assert model.per_token_s > 0  # a prefill of more tokens costs more
    assert model.meta["clock"] == "process" and len(model.meta["samples"]) == len(measurements)
    # The fitted model explains the measured plans (a loose bound: a shared, noisy machine).
    assert model.meta["mean_abs_rel_error"] < 0.5
    path = tmp_path / "cost.json"
    path.write_text(model.to_json())
    assert CostModel.load(path) == model


@pytest.mark.model
def test_cli_calibrate_writes_a_loadable_model(tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    assert main(["calibrate", "--quick", "--repeats", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["version"] == 1 and data["meta"]["grid"] == "quick"
    CostModel.load(out)
