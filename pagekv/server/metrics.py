"""Prometheus metrics of one server, in its own ``CollectorRegistry`` (no globals).

Engine numbers come from ``engine.stats()``: every numeric key is exported as the gauge
``pagekv_<key>``, and the monotonic ones are exported again as counters with Prometheus names
(``COUNTERS``). Request timings (TTFT, TPOT, end to end) and request outcomes are measured by
the engine thread and the error handler. prometheus-client's metric objects are thread-safe.
With ``export_vllm_names`` the same numbers are also exported under vLLM's names
(``vllm_metrics``), for vLLM's dashboards.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from pagekv.engine.outputs import RequestOutput
from pagekv.server.vllm_metrics import ServedModel, VllmMetrics

PREFIX = "pagekv_"

# stats key -> (counter name without _total, labels); stats counters never go down.
COUNTERS: dict[str, tuple[str, dict[str, str]]] = {
    "prefix_cache_query_tokens": ("prefix_cache_queries", {}),
    "prefix_cache_hit_tokens": ("prefix_cache_hits", {}),
    "prefix_cache_evictions": ("prefix_cache_evicted_blocks", {}),
    "preemptions_recompute": ("preemptions", {"mode": "recompute"}),
    "preemptions_swap": ("preemptions", {"mode": "swap"}),
    "recomputed_tokens": ("recomputed_tokens", {}),
    "rejected_requests": ("engine_rejected_requests", {}),
    "cow_copies": ("cow_copied_blocks", {}),
    "swapped_out_blocks": ("swapped_out_blocks", {}),
    "swapped_in_blocks": ("swapped_in_blocks", {}),
    "steps": ("engine_steps", {}),
}
COUNTER_HELP = {
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache.",
    "preemptions": "Requests preempted, by mode.",
}

LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
STEP_BUCKETS_S = tuple(round(0.001 * 1.25**i, 6) for i in range(50))  # 1 ms to 56 s, by 25%
TPOT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class EngineStatsCollector(Collector):
    """Turns the latest ``engine.stats()`` snapshot into gauge and counter families."""

    def __init__(self) -> None:
        self.snapshot: Mapping[str, Any] = {}

    def describe(self) -> list[Metric]:
        return []  # names depend on the snapshot; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        stats = dict(self.snapshot)
        for key, value in sorted(stats.items()):
            if _is_number(value):
                yield GaugeMetricFamily(PREFIX + key, f"engine.stats()[{key!r}]", value=value)
        families: dict[str, CounterMetricFamily] = {}
        for key, (name, labels) in COUNTERS.items():
            if not _is_number(stats.get(key)):
                continue
            if name not in families:
                help_text = COUNTER_HELP.get(name, f"engine.stats()[{key!r}]")
                families[name] = CounterMetricFamily(PREFIX + name, help_text, labels=list(labels))
            families[name].add_metric(list(labels.values()), stats[key])
        yield from families.values()
        kernels = stats.get("kernels")
        if isinstance(kernels, Mapping):
            info = InfoMetricFamily(PREFIX + "kernels", "The CPU and the kernel running each part")
            info.add_metric([], {str(k): str(v) for k, v in kernels.items()})
            yield info


class Metrics:
    """The server's registry and its request-level metrics; ``vllm``: the same under vLLM's
    names, once ``export_vllm_names`` is called (before the engine thread starts)."""

    def __init__(self) -> None:
        self.vllm: VllmMetrics | None = None
        self.registry = CollectorRegistry(auto_describe=True)
        self.engine_stats = EngineStatsCollector()
        self.registry.register(self.engine_stats)
        r = self.registry
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "From arrival to the first generated token.",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "Mean time between output tokens after the first, per request.",
            buckets=TPOT_BUCKETS_S,
            registry=r,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "From arrival to the last token.",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.step = Histogram(
            PREFIX + "step_seconds",
            "Engine steps: the time of each (one batch through the model).",
            buckets=STEP_BUCKETS_S,
            registry=r,
        )
        self.success = Counter(
            PREFIX + "request_success",
            "Requests that finished, by finish reason.",
            ["finish_reason"],
            registry=r,
        )
        self.aborts = Counter(
            PREFIX + "request_aborted", "Requests aborted (client gone).", registry=r
        )
        self.errors = Counter(
            PREFIX + "http_errors", "Error responses, by status.", ["status"], registry=r
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Tokens generated by finished requests.", registry=r
        )

    def export_vllm_names(self, served: ServedModel) -> None:
        """Also export vLLM's metric names, labelled with ``served.name``."""
        self.vllm = VllmMetrics(served, self.registry)

    # ---- called by the engine thread ----------------------------------------------------------

    def first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)
        if self.vllm is not None:
            self.vllm.first_token(ttft_s)

    def step_done(self, start_s: float, now_s: float, outputs: Sequence[RequestOutput]) -> None:
        """After each step, before its outputs are delivered."""
        self.step.observe(now_s - start_s)
        if self.vllm is not None:
            self.vllm.step_done(now_s, outputs)

    def finished(
        self, output: RequestOutput, arrival_s: float, first_token_s: float, now_s: float
    ) -> None:
        if self.vllm is not None:
            self.vllm.finished(output, arrival_s, now_s)
        self.e2e.observe(now_s - arrival_s)
        num_tokens = max((len(o.token_ids) for o in output.outputs), default=0)
        if num_tokens > 1:
            self.tpot.observe((now_s - first_token_s) / (num_tokens - 1))
        reason = output.outputs[0].finish_reason if output.outputs else None
        self.success.labels(finish_reason=reason or "unknown").inc()
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generation_tokens.inc(sum(len(o.token_ids) for o in output.outputs))

    def aborted(self, request_id: str) -> None:
        self.aborts.inc()
        if self.vllm is not None:
            self.vllm.aborted(request_id)

    # ---- called by HTTP handlers ----------------------------------------------------------------

    def error(self, status: int) -> None:
        self.errors.labels(status=str(status)).inc()

    @property
    def latest_stats(self) -> Mapping[str, Any] | None:
        """The engine snapshot the last exposition showed (None before the first)."""
        return self.engine_stats.snapshot or None

    def exposition(self, stats: Mapping[str, Any]) -> bytes:
        """The Prometheus text format, with ``stats`` as the engine's current snapshot."""
        self.engine_stats.snapshot = dict(stats)
        if self.vllm is not None:
            self.vllm.set_stats(stats)
        return generate_latest(self.registry)
