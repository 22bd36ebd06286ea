"""pagekv.core.trace (format, writer, reader) and pagekv.sim.trace (replay): a recorded trace
replays with the same requests, tokens and sharing."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from pagekv.core.trace import TraceFormatError, TraceRecorder, block_hashes_hex, read_trace
from pagekv.errors import InvalidRequestError
from pagekv.sim.cli import main
from pagekv.sim.cost_model import CostModel
from pagekv.sim.simulator import SimConfig, simulate
from pagekv.sim.trace import replay_trace
from pagekv.sim.workload import SimRequest, build_workload, preset

COST = CostModel(fixed_s=0.01, per_token_s=1e-4, per_padded_context_s=1e-6)


def _serve_and_record(path: Path, requests: list[SimRequest], num_threads: int = 4) -> None:
    """What a server does with ``--trace``: every handler thread records its request."""
    recorder = TraceRecorder(path)

    def handler(part: list[SimRequest]) -> None:
        for r in part:
            hashes = block_hashes_hex(r.prompt_token_ids)
            recorder.record(r.arrival_s, len(r.prompt_token_ids), len(r.outputs[0]), hashes)

    threads = [
        threading.Thread(target=handler, args=(requests[i::num_threads],))
        for i in range(num_threads)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    recorder.close()


def test_a_recorded_trace_replays_the_same_requests_and_tokens(tmp_path: Path) -> None:
    requests = build_workload(preset("prefix", num_requests=200, rate=20.0))
    path = tmp_path / "trace.jsonl"
    _serve_and_record(path, requests)
    trace = read_trace(path, strict=True)
    assert len(trace.records) == 200 and trace.problems == []
    replayed = replay_trace(trace.records)
    assert len(replayed) == len(requests)
    assert sum(len(r.prompt_token_ids) for r in replayed) == sum(
        len(r.prompt_token_ids) for r in requests
    )
    assert sum(r.num_output_tokens for r in replayed) == sum(r.num_output_tokens for r in requests)
    assert sorted(r.arrival_s for r in replayed) == pytest.approx(
        sorted(r.arrival_s for r in requests)
    )
    original = simulate(requests, SimConfig(block_size=16), COST)
    again = simulate(replayed, SimConfig(block_size=16), COST)
    assert again.num_requests == original.num_requests == 200
    assert again.num_output_tokens == original.num_output_tokens
    assert again.num_prompt_tokens == original.num_prompt_tokens


@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_replay_reproduces_sharing_exactly_at_multiples_of_16(
    tmp_path: Path, block_size: int
) -> None:
    requests = build_workload(preset("prefix", num_requests=150))
    path = tmp_path / "trace.jsonl"
    _serve_and_record(path, requests, num_threads=1)
    replayed = replay_trace(read_trace(path).records)
    config = SimConfig(block_size=block_size, num_kv_tokens=4096)
    original, again = simulate(requests, config, COST), simulate(replayed, config, COST)
    assert original.prefix_hit_rate > 0.1
    assert again.prefix_hit_rate == pytest.approx(original.prefix_hit_rate)
    assert again.num_steps == original.num_steps


def test_replay_sharing_at_small_blocks_is_a_lower_bound(tmp_path: Path) -> None:
    requests = build_workload(preset("prefix", num_requests=150))
    path = tmp_path / "trace.jsonl"
    _serve_and_record(path, requests, num_threads=1)
    replayed = replay_trace(read_trace(path).records)
    config = SimConfig(block_size=4, num_kv_tokens=4096)
    original, again = simulate(requests, config, COST), simulate(replayed, config, COST)
    assert 0 < again.prefix_hit_rate <= original.prefix_hit_rate


def test_replayed_requests_share_leading_ids_only_where_hashes_match() -> None:
    a, b = [1] * 40, [1] * 16 + [2] * 24  # share one full 16-token block
    ha, hb = block_hashes_hex(a), block_hashes_hex(b)
    assert len(ha) == len(hb) == 2 and ha[0] == hb[0] and ha[1] != hb[1]
    ra, rb = replay_trace([_record(0.0, 40, 5, ha), _record(1.0, 40, 5, hb)])
    assert ra.prompt_token_ids[:16] == rb.prompt_token_ids[:16]
    assert not set(ra.prompt_token_ids[16:]) & set(rb.prompt_token_ids[16:])


def _record(arrival: float, prompt: int, output: int, hashes: list[str]):  # type: ignore[no-untyped-def]
    from pagekv.core.trace import TraceRecord

    return TraceRecord(arrival, prompt, output, tuple(hashes))


BAD_LINES = [
    '{"arrival_s": 0.5, "prompt_len": 20, "output_len": 4, "block_hashes": []}',
    "not json at all",
    '{"arrival_s": 1.0, "prompt_len": 0, "output_len": 4, "block_hashes": []}',
    "",
    '{"arrival_s": 1.0, "prompt_len": 20, "output_len": 4, "block_hashes": ["zz"]}',
    '{"arrival_s": 2.0, "prompt_len": 20, "output_len": 4}',
    "[1, 2, 3]",
    '{"arrival_s": 3.0, "prompt_len": 15, "output_len": 4, "block_hashes": ["%s"]}' % ("a" * 32),
    '{"arrival_s": 4.0, "prompt_len": 32, "output_len": 9, "block_hashes": ["%s"]}' % ("b" * 32),
]


def test_malformed_lines_are_reported_with_line_numbers(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(BAD_LINES) + "\n")
    trace = read_trace(path)
    assert [r.line for r in trace.records] == [1, 9]
    assert [p.line for p in trace.problems] == [2, 3, 5, 6, 7, 8]
    messages = [str(p) for p in trace.problems]
    assert messages[0].startswith("line 2: not JSON")
    assert "prompt_len must be an integer >= 1" in messages[1]
    assert "not 32 lowercase hex digits" in messages[2]
    assert "missing block_hashes" in messages[3]
    assert "at most 0 full blocks" in messages[5]
    with pytest.raises(TraceFormatError, match=r"6 malformed line\(s\): line 2: not JSON"):
        read_trace(path, strict=True)


def test_cli_skips_or_rejects_bad_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(BAD_LINES) + "\n")
    out = tmp_path / "out"
    args = ["--trace", str(path), "--block-sizes", "16,32", "--out", str(out), "--no-baselines"]
    assert main([*args, "--strict"]) == 2
    assert "line 2: not JSON" in capsys.readouterr().err
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "skipped line 3: prompt_len must be an integer >= 1" in err
    assert json.loads((out / "results.json").read_text())["paged"][0]["num_requests"] == 2


def test_an_empty_or_unreadable_trace_is_an_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(TraceFormatError, match="no valid trace record"):
        read_trace(empty)
    with pytest.raises(TraceFormatError, match="cannot read trace"):
        read_trace(tmp_path / "missing.jsonl")


def test_recorder_rejects_bad_values_and_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    with TraceRecorder(path) as recorder:
        with pytest.raises(InvalidRequestError, match="output_len must be an integer >= 1"):
            recorder.record(0.0, 10, 0, [])
        with pytest.raises(InvalidRequestError, match="at most 0 full blocks"):
            recorder.record(0.0, 10, 3, ["0" * 32])
        recorder.record(0.0, 10, 3, [])
    assert path.read_text().count("\n") == 1
    with pytest.raises(InvalidRequestError, match="closed"):
        recorder.record(0.0, 10, 3, [])
