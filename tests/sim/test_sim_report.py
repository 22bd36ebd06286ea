"""pagekv.sim report, recommendation, cost model and CLI."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from pagekv.errors import InvalidRequestError
from pagekv.sim.cli import main
from pagekv.sim.cost_model import CostModel, StepShape, fit, nonnegative_least_squares
from pagekv.sim.report import markdown, recommend, run_study, write_report
from pagekv.sim.simulator import SimConfig, simulate
from pagekv.sim.workload import DistKind, LengthDist, WorkloadKind, WorkloadSpec, build_workload

PNG = b"\x89PNG\r\n\x1a\n"
NO_ENTRY_COST = CostModel(fixed_s=0.05, per_token_s=3e-3, per_padded_context_s=1e-4)


@pytest.fixture(autouse=True)
def _quiet_preemption_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="pagekv")


def _fixed(n: int) -> LengthDist:
    return LengthDist(DistKind.FIXED, mean=n)


SHORT_SHARED = WorkloadSpec(
    kind=WorkloadKind.SHARED_PREFIX,
    num_requests=400,
    num_prefixes=2,
    prefix=_fixed(56),
    prompt=LengthDist(DistKind.UNIFORM, low=4, high=12),
    output=LengthDist(DistKind.UNIFORM, low=8, high=24),
)
LONG_PRIVATE = WorkloadSpec(
    num_requests=48,
    prompt=LengthDist(DistKind.UNIFORM, low=768, high=1536),
    output=LengthDist(DistKind.UNIFORM, low=16, high=48),
)
SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


@pytest.mark.parametrize("cost", [CostModel.default(), NO_ENTRY_COST], ids=["default", "flat"])
def test_short_shared_prompts_do_not_get_the_largest_block(cost: CostModel) -> None:
    requests = build_workload(SHORT_SHARED)
    results = [simulate(requests, SimConfig(block_size=b), cost) for b in SIZES]
    hits = {r.block_size: r.prefix_hit_rate for r in results}
    assert hits[16] > 0.6 and hits[128] == 0.0  # 56-token prefixes fill no 128-token block
    choice = recommend(results, cost)
    assert choice.block_size < 64, choice.reason


@pytest.mark.parametrize("cost", [CostModel.default(), NO_ENTRY_COST], ids=["default", "flat"])
def test_long_private_prompts_do_not_get_block_size_one(cost: CostModel) -> None:
    requests = build_workload(LONG_PRIVATE)
    configs = [SimConfig(block_size=b, num_kv_tokens=1 << 17) for b in SIZES]
    results = [simulate(requests, config, cost) for config in configs]
    assert all(r.prefix_hit_rate == 0 and r.num_preemptions == 0 for r in results)
    choice = recommend(results, cost)
    assert choice.block_size >= 16, choice.reason
    assert "within 2% of the best" in choice.reason


def test_report_files_table_and_rule(tmp_path: Path) -> None:
    requests = build_workload(SHORT_SHARED)
    study = run_study(
        requests, SimConfig(), CostModel.default(), (8, 16, 32), title="short", timeline=True
    )
    paths = write_report(study, tmp_path)
    names = {p.name for p in paths}
    assert {"report.md", "results.json", "util_hit.png", "throughput.png"} <= names
    assert {"memory_timeline.png", "block_timeline.png"} <= names
    for p in paths:
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == PNG
    text = (tmp_path / "report.md").read_text()
    assert f"**Recommended block size: {study.recommendation.block_size}.**" in text
    assert "Rule: among block sizes within 5 points of the best KV utilisation" in text
    assert "| paged bs=16 |" in text and "| contiguous oracle |" in text
    data = json.loads((tmp_path / "results.json").read_text())
    assert [r["block_size"] for r in data["paged"]] == [8, 16, 32]
    assert len(data["baselines"]) == 3
    assert study.timeline is not None and study.timeline.blocks is not None
    image = study.timeline.blocks.image()
    assert image.shape[0] == SimConfig().num_kv_tokens // study.recommendation.block_size
    assert markdown(study).count("\n|") >= 7


def test_fit_recovers_known_costs() -> None:
    rng = np.random.default_rng(0)
    shapes = []
    for _ in range(60):
        seqs, query, seq = int(rng.integers(1, 64)), int(rng.integers(1, 512)), 0
        seq = int(rng.integers(query, 2048))
        shapes.append(
            StepShape(
                num_seqs=seqs,
                num_batched_tokens=query + seqs - 1,
                num_context_tokens=int(seqs * seq * rng.uniform(0.3, 1.0)),
                num_padded_context_tokens=seqs * seq,
                num_padded_cells=seqs * query * seq,
                num_table_entries=int(seqs * seq / rng.choice([1, 4, 16])),
            )
        )
    truth = CostModel(
        fixed_s=0.1, per_token_s=3e-3, per_padded_context_s=1.5e-4, per_table_entry_s=2e-5
    )
    seconds = [truth.step_s(s) * rng.uniform(0.99, 1.01) for s in shapes]
    model = fit(shapes, seconds, {"grid": "test"})
    for name in ("fixed_s", "per_token_s", "per_padded_context_s", "per_table_entry_s"):
        assert getattr(model, name) == pytest.approx(getattr(truth, name), rel=0.1), name
    assert all(c >= 0 for c in model.coefficients())
    assert model.meta["mean_abs_rel_error"] < 0.02 and model.meta["grid"] == "test"


def test_nonnegative_least_squares_clamps_what_would_be_negative() -> None:
    x = np.array([[1.0, 0.0], [1.0, 1.0], [1.0, 2.0]])
    y = np.array([3.0, 2.0, 1.0])  # the unconstrained slope is -1
    c = nonnegative_least_squares(x, y)
    assert c[1] == 0.0 and c[0] == pytest.approx(2.0)


def test_cost_model_json_round_trip_and_bad_files(tmp_path: Path) -> None:
    model = CostModel.default()
    assert model.per_token_s > 0 and model.meta.get("grid")
    assert CostModel.from_json(model.to_json()) == model
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": 1, "coefficients": {"per_token_s": -1}}')
    with pytest.raises(InvalidRequestError, match="per_token_s must be >= 0"):
        CostModel.load(bad)
    bad.write_text('{"version": 1, "coefficients": {"per_banana_s": 1}}')
    with pytest.raises(InvalidRequestError, match="'coefficients' must map"):
        CostModel.load(bad)
    with pytest.raises(InvalidRequestError, match="cannot read cost model"):
        CostModel.load(tmp_path / "missing.json")


def test_cli_study_with_timeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    args = ["--workload", "chat", "--num-requests", "60", "--block-sizes", "4,16"]
    args += ["--kv-blocks", "256", "--timeline", "--out", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "Recommended block size:" in printed and "| paged bs=4 |" in printed
    assert (out / "block_timeline.png").read_bytes()[:8] == PNG
    assert main(["--workload", "alpaca", "--prompt-len", "lognormal:0,3"]) == 2
    assert "mean >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--block-sizes", "0,16"])
