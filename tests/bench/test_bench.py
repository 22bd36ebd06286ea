"""``pagekv bench``: the standard workloads are exactly as specified, the command parses, the
report's numbers are right, and one offline pass on the real model counts every token."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from pagekv.bench import register
from pagekv.bench.report import BenchResult, format_table, percentile, write_json
from pagekv.bench.workloads import (
    RANDOM_OUTPUT_TOKENS,
    RANDOM_PROMPT_TOKENS,
    load_workload,
    prefix_workload,
    random_workload,
)
from pagekv.engine import LLMEngine
from pagekv.engine.config import EngineConfig
from pagekv.engine.outputs import RequestOutput
from pagekv.models.loader import LoadedModel


def test_random_workload_is_the_specified_one() -> None:
    w = random_workload()
    assert len(w.requests) == 64
    assert w.num_prompt_tokens == RANDOM_PROMPT_TOKENS == 17_709
    assert w.num_output_tokens == RANDOM_OUTPUT_TOKENS == 8_885
    rng = np.random.default_rng(0)
    prompt_lens = rng.integers(32, 512, size=64, endpoint=True)
    assert [len(r.prompt_token_ids) for r in w.requests] == prompt_lens.tolist()
    assert all(100 <= t <= 10000 for r in w.requests for t in r.prompt_token_ids)
    assert random_workload() == w  # deterministic


def test_prefix_workload_shares_a_256_token_prefix() -> None:
    w = prefix_workload()
    prefix = w.requests[0].prompt_token_ids[:256]
    assert len(w.requests) == 64
    assert all(r.prompt_token_ids[:256] == prefix for r in w.requests)
    assert all(len(r.prompt_token_ids) == 288 and r.output_len == 64 for r in w.requests)
    assert len({tuple(r.prompt_token_ids[256:]) for r in w.requests}) == 64


def test_workload_file_and_its_errors(tmp_path: Path) -> None:
    good = tmp_path / "w.json"
    good.write_text(json.dumps([{"prompt_token_ids": [5, 6, 7], "output_len": 4}]))
    w = load_workload(str(good))
    assert w.num_prompt_tokens == 3 and w.num_output_tokens == 4
    for bad in ([], [{"prompt_token_ids": [], "output_len": 4}], [{"prompt_token_ids": [1]}]):
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError):
            load_workload(str(path))


def test_percentile_matches_numpy() -> None:
    values = [0.3, 0.1, 0.7, 0.2, 0.9, 0.4]
    for pct in (0, 50, 90, 99, 100):
        assert percentile(values, pct) == pytest.approx(float(np.percentile(values, pct)))
    assert np.isnan(percentile([], 50))


def test_register_adds_bench_with_its_options() -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["bench", "--workload", "prefix", "--dtype", "bfloat16", "--num-threads", "1"]
    )
    assert (args.mode, args.workload, args.dtype, args.num_threads) == (
        "offline",
        "prefix",
        "bfloat16",
        1,
    )
    assert callable(args.func)
    serve = parser.parse_args(["bench", "serve", "--url", "http://h:1"])
    assert serve.mode == "serve" and serve.url == "http://h:1"


def test_report_table_and_json(tmp_path: Path) -> None:
    result = BenchResult("offline", "random", 2, 10, 8, 2.0, [0.1, 0.2], [0.01, 0.03])
    assert result.output_tokens_per_s == 4.0 and result.total_tokens_per_s == 9.0
    assert "output throughput" in format_table(result)
    write_json(result, str(tmp_path / "r.json"))
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["output_tokens_per_s"] == 4.0
    assert data["ttft_ms"]["p50"] == pytest.approx(150.0)


@pytest.mark.model
def test_offline_pass_on_the_real_model(loaded: LoadedModel, tmp_path: Path) -> None:
    from pagekv.bench.offline import greedy_params, run_offline, warm_up

    items = [
        {"prompt_token_ids": list(range(200 + i, 240 + 3 * i)), "output_len": 3 + i}
        for i in range(4)
    ]
    path = tmp_path / "small.json"
    path.write_text(json.dumps(items))
    workload = load_workload(str(path))
    engine = LLMEngine(EngineConfig(kv_cache_memory="64MiB"), loaded)
    warm_up(engine)
    result = run_offline(engine, workload)
    assert result.num_requests == 4 and result.num_output_tokens == 3 + 4 + 5 + 6
    assert len(result.ttft_s) == 4 and len(result.tpot_s) == 4
    assert result.elapsed_s > 0 and result.peak_rss_bytes > 0
    assert not engine.has_unfinished_requests()
    # The pass left its prompts cached (a request now would hit them) ...
    engine.add_request("probe", items[0]["prompt_token_ids"], greedy_params(1))
    (probe,) = [out for out in _drain(engine) if out.finished]
    assert probe.num_cached_tokens >= 32
    # ... yet a second pass starts cold, as the first did.
    assert run_offline(engine, workload).num_cached_prompt_tokens == 0


def _drain(engine: LLMEngine) -> list[RequestOutput]:
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs
