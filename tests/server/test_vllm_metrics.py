"""vLLM's metric names on /metrics (``pagekv/server/vllm_metrics.py``), without a model: steps
of made-up outputs go through ``Metrics`` as the engine thread sends them, and the exposition
is read back with prometheus' own parser. The real server under a real Prometheus is
``test_vllm_metrics_prometheus.py``."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagekv.engine.outputs import CompletionOutput, RequestOutput, RequestStateStats
from pagekv.server.metrics import Metrics
from pagekv.server.vllm_metrics import ServedModel, token_buckets

LABELS = (("engine", "0"), ("model_name", "smol"))
PHASES = (
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_inference_time_seconds",
    "request_num_preemptions",
)
STATS = {
    "num_running": 2,
    "num_waiting": 1,
    "num_swapped": 1,
    "kv_usage": 0.25,
    "prefix_cache_query_tokens": 40,
    "prefix_cache_hit_tokens": 16,
    "preemptions_recompute": 3,
    "preemptions_swap": 1,
}


def output(
    rid: str, tokens: list[list[int]], reason: str | None = None, cached: int = 0
) -> RequestOutput:
    outs = [CompletionOutput(i, "", list(t), finish_reason=reason) for i, t in enumerate(tokens)]
    done = reason is not None
    return RequestOutput(rid, None, [1, 2, 3, 4, 5], outs, finished=done, num_cached_tokens=cached)


def exported(
    metrics: Metrics,
) -> tuple[dict[str, str], dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    """(family name -> type, (sample name, sorted labels) -> value)."""
    types, samples = {}, {}
    for family in text_string_to_metric_families(metrics.exposition(STATS).decode()):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return types, samples


@pytest.fixture
def metrics() -> Metrics:
    m = Metrics()
    m.export_vllm_names(ServedModel("smol", 2048, {"block_size": "16", "num_gpu_blocks": "64"}))
    return m


def test_request_token_buckets_are_vllms_one_two_five_series() -> None:
    assert token_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert token_buckets(2048)[-3:] == [500, 1000, 2000]


def test_engine_stats_become_vllm_gauges_and_counters(metrics: Metrics) -> None:
    types, samples = exported(metrics)
    assert types["vllm:num_requests_running"] == "gauge"
    assert samples[("vllm:num_requests_running", LABELS)] == 2
    assert samples[("vllm:num_requests_waiting", LABELS)] == 2  # swapped out: waiting again
    assert samples[("vllm:kv_cache_usage_perc", LABELS)] == 0.25
    assert types["vllm:prefix_cache_queries"] == "counter"
    assert samples[("vllm:prefix_cache_queries_total", LABELS)] == 40
    assert samples[("vllm:prefix_cache_hits_total", LABELS)] == 16
    assert samples[("vllm:num_preemptions_total", LABELS)] == 4
    info = (("block_size", "16"), ("engine", "0"), ("num_gpu_blocks", "64"))
    assert samples[("vllm:cache_config_info", info)] == 1
    assert samples[("pagekv_kv_usage", ())] == 0.25  # pagekv's own names stay


def test_steps_count_tokens_and_latencies_as_vllm_does(metrics: Metrics) -> None:
    metrics.step_done(0.0, 1.0, [output("a", [[7]], cached=2), output("b", [[]])])
    metrics.first_token(0.75)
    metrics.step_done(1.0, 1.5, [output("a", [[7, 8, 9]])])  # two tokens at once (drafts)
    metrics.step_done(1.5, 1.75, [output("a", [[7, 8, 9, 10]], "length")])
    metrics.finished(output("a", [[7, 8, 9, 10]], "length", cached=2), 0.25, 1.0, 1.75)
    types, samples = exported(metrics)
    value = {name: samples[(name, LABELS)] for name, labels in samples if labels == LABELS}
    assert value["vllm:prompt_tokens_total"] == 5  # the whole prompt, at its first token
    assert value["vllm:prompt_tokens_cached_total"] == 2
    assert value["vllm:generation_tokens_total"] == 4
    # steps: 3 prompt tokens computed + 1 sampled, then 2, then 1
    assert value["vllm:iteration_tokens_total_count"] == 3
    assert value["vllm:iteration_tokens_total_sum"] == 7
    assert types["vllm:inter_token_latency_seconds"] == "histogram"
    assert value["vllm:inter_token_latency_seconds_count"] == 2
    assert value["vllm:inter_token_latency_seconds_sum"] == 0.75
    assert value["vllm:request_time_per_output_token_seconds_sum"] == 0.25  # 0.75 s / 3
    assert value["vllm:time_to_first_token_seconds_sum"] == 0.75
    assert value["vllm:e2e_request_latency_seconds_sum"] == 1.5
    assert value["vllm:request_prompt_tokens_sum"] == 5
    assert value["vllm:request_generation_tokens_sum"] == 4
    assert value["vllm:request_max_num_generation_tokens_sum"] == 4
    assert value["vllm:request_prefill_kv_computed_tokens_sum"] == 3
    assert value["vllm:request_params_n_sum"] == 1
    success = {
        labels: v for (name, labels), v in samples.items() if name == "vllm:request_success_total"
    }
    assert success[(*LABELS[:1], ("finished_reason", "length"), *LABELS[1:])] == 1
    assert success[(*LABELS[:1], ("finished_reason", "stop"), *LABELS[1:])] == 0  # shown from 0


def test_n_branches_count_as_one_request_with_their_longest_branch(metrics: Metrics) -> None:
    metrics.step_done(0.0, 1.0, [output("a", [[1], [2]])])
    metrics.step_done(1.0, 2.0, [output("a", [[1, 3], [2]])])
    final = output("a", [[1, 3, 4], [2, 5]], "stop")
    metrics.step_done(2.0, 3.0, [final])
    metrics.finished(final, 0.0, 1.0, 3.0)
    _, samples = exported(metrics)
    assert samples[("vllm:generation_tokens_total", LABELS)] == 5
    assert samples[("vllm:request_params_n_sum", LABELS)] == 2
    assert samples[("vllm:request_max_num_generation_tokens_sum", LABELS)] == 3
    assert samples[("vllm:request_time_per_output_token_seconds_sum", LABELS)] == 1.0


def test_an_aborted_request_is_forgotten(metrics: Metrics) -> None:
    metrics.step_done(0.0, 1.0, [output("a", [[1]])])
    metrics.aborted("a")
    assert metrics.vllm is not None and not metrics.vllm._in_flight
    _, samples = exported(metrics)
    assert samples[("pagekv_request_aborted_total", ())] == 1


def test_a_one_token_request_has_zero_time_per_output_token(metrics: Metrics) -> None:
    final = output("a", [[1]], "stop")
    metrics.step_done(0.0, 1.0, [final])
    metrics.finished(final, 0.0, 1.0, 1.0)
    _, samples = exported(metrics)
    assert samples[("vllm:request_time_per_output_token_seconds_count", LABELS)] == 1
    assert samples[("vllm:request_time_per_output_token_seconds_sum", LABELS)] == 0
    assert samples[("vllm:inter_token_latency_seconds_count", LABELS)] == 0


def test_phases_are_the_engines_timestamps_subtracted(metrics: Metrics) -> None:
    final = output("a", [[1, 2, 3]], "stop")
    final.metrics = RequestStateStats(
        num_generation_tokens=3,
        num_preemptions=1,
        queued_ts=10.0,
        scheduled_ts=10.5,
        first_token_ts=11.25,
        last_token_ts=12.0,
    )
    metrics.finished(final, 9.75, 11.5, 12.25)
    _, samples = exported(metrics)
    sums = {name: samples[(f"vllm:{name}_sum", LABELS)] for name in PHASES}
    assert sums == {
        "request_queue_time_seconds": 0.5,
        "request_prefill_time_seconds": 0.75,
        "request_decode_time_seconds": 0.75,
        "request_inference_time_seconds": 1.5,
        "request_num_preemptions": 1,
    }


def test_a_request_ended_before_its_first_token_has_no_phases(metrics: Metrics) -> None:
    final = output("a", [[]], "abort")
    final.metrics = RequestStateStats(queued_ts=10.0)
    metrics.finished(final, 9.75, 10.0, 10.5)
    _, samples = exported(metrics)
    assert all(samples[(f"vllm:{name}_count", LABELS)] == 0 for name in PHASES)
    assert samples[("vllm:e2e_request_latency_seconds_count", LABELS)] == 1
