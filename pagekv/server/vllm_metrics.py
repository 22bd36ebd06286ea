"""vLLM's metric names on /metrics, so that vLLM's dashboards and alerts read this server.

Mirrors vLLM 0.32's ``PrometheusStatLogger`` (vllm/v1/metrics/loggers.py): the same names,
types, help texts, histogram buckets (vllm/v1/metrics/buckets.py) and labels (``model_name``:
the served model name; ``engine``: "0", this server's one engine). Every number is this
engine's: queue lengths, KV usage, prefix-cache and preemption counters come from
``engine.stats()`` at each scrape; token counts and latencies are measured by the engine thread
from the step's outputs (``step_done``), as vLLM measures them from its engine-core outputs:

    arrival --queue--> first scheduled --prefill--> first token --decode--> last token
       '-------------------------- e2e (to the finish) ----------------------------'

Queue, prefill, decode and inference times and per-request preemptions are subtractions of the
engine's own timestamps (``RequestOutput.metrics``, vLLM's ``RequestStateStats``).

Owns: the ``vllm:*`` metric objects and, for each request in flight, its token count and the
time of its last token (engine thread only).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagekv.engine.llm_engine import LLMEngine
from pagekv.engine.outputs import RequestOutput

ENGINE = "0"  # vLLM labels each engine of a data-parallel group; this server has one
LABELS = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's, all shown from 0

# vllm/v1/metrics/buckets.py, 0.32
REQUEST_LATENCY_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)


def token_buckets(max_model_len: int) -> list[int]:
    """vLLM's request-token buckets: 1, 2, 5, 10, 20, 50, ... up to ``max_model_len``."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


@dataclass(frozen=True)
class ServedModel:
    """What the vLLM names say about this server, fixed at start: ``name`` (the ``model_name``
    label), ``max_model_len`` (the request-token buckets), ``cache_config`` (the labels of
    ``vllm:cache_config_info``, vLLM's CacheConfig fields that this engine has)."""

    name: str
    max_model_len: int
    cache_config: Mapping[str, str]

    @classmethod
    def of(cls, engine: LLMEngine, name: str) -> ServedModel:
        """Read from the engine before its thread starts."""
        stats, config = engine.stats(), engine.config
        cache_config = {
            "block_size": config.block_size,
            "cache_dtype": config.dtype,  # the KV cache is kept in the model's dtype
            "enable_prefix_caching": config.enable_prefix_caching,
            "gpu_memory_utilization": config.gpu_memory_utilization,
            "num_gpu_blocks": stats["kv_blocks_total"],  # the device pool, CPU or GPU
            "num_cpu_blocks": stats["host_blocks_total"],  # the host pool (swap, host cache)
        }
        return cls(name, engine.max_model_len, {k: str(v) for k, v in cache_config.items()})


@dataclass
class _InFlight:
    """A request after its first token: what the next step's output is compared with."""

    num_tokens: int
    first_token_s: float
    last_token_s: float


def _num_tokens(output: RequestOutput) -> int:
    return sum(len(o.token_ids) for o in output.outputs)


PHASE_HELP = "Histogram of time spent in {} phase for request."
# field of RequestHistograms -> (vLLM name, help, buckets); None: the request-token buckets
HISTOGRAMS: dict[str, tuple[str, str, Sequence[float] | None]] = {
    "iteration_tokens": (
        "vllm:iteration_tokens_total",
        "Histogram of number of tokens per engine_step.",
        ITERATION_TOKENS_BUCKETS,
    ),
    "prompt_tokens": ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", None),
    "generation_tokens": (
        "vllm:request_generation_tokens",
        "Number of generation tokens processed.",
        None,
    ),
    "max_generation_tokens": (
        "vllm:request_max_num_generation_tokens",
        "Histogram of maximum number of requested generation tokens.",
        None,
    ),
    "params_n": (
        "vllm:request_params_n",
        "Histogram of the n request parameter.",
        PARAMS_N_BUCKETS,
    ),
    "prefill_kv_computed": (
        "vllm:request_prefill_kv_computed_tokens",
        "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
        None,
    ),
    "ttft": (
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        TTFT_BUCKETS_S,
    ),
    "itl": (
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        ITL_BUCKETS_S,
    ),
    "tpot": (
        "vllm:request_time_per_output_token_seconds",
        "Histogram of time_per_output_token_seconds per request.",
        ITL_BUCKETS_S,
    ),
    "e2e": (
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        REQUEST_LATENCY_BUCKETS_S,
    ),
    "queue_time": (
        "vllm:request_queue_time_seconds",
        PHASE_HELP.format("WAITING"),
        REQUEST_LATENCY_BUCKETS_S,
    ),
    "inference_time": (
        "vllm:request_inference_time_seconds",
        PHASE_HELP.format("RUNNING"),
        REQUEST_LATENCY_BUCKETS_S,
    ),
    "prefill_time": (
        "vllm:request_prefill_time_seconds",
        PHASE_HELP.format("PREFILL"),
        REQUEST_LATENCY_BUCKETS_S,
    ),
    "decode_time": (
        "vllm:request_decode_time_seconds",
        PHASE_HELP.format("DECODE"),
        REQUEST_LATENCY_BUCKETS_S,
    ),
    "num_preemptions": (
        "vllm:request_num_preemptions",
        "Histogram of the number of times a request was preempted.",
        NUM_PREEMPTIONS_BUCKETS,
    ),
}


@dataclass(frozen=True)
class RequestHistograms:
    """One labelled child of each of vLLM's histograms (``HISTOGRAMS``)."""

    iteration_tokens: Histogram
    prompt_tokens: Histogram
    generation_tokens: Histogram
    max_generation_tokens: Histogram
    params_n: Histogram
    prefill_kv_computed: Histogram
    ttft: Histogram
    itl: Histogram
    tpot: Histogram
    e2e: Histogram
    queue_time: Histogram
    inference_time: Histogram
    prefill_time: Histogram
    decode_time: Histogram
    num_preemptions: Histogram

    @classmethod
    def create(cls, served: ServedModel, registry: CollectorRegistry) -> RequestHistograms:
        tokens = token_buckets(served.max_model_len)
        children = {
            field: Histogram(name, doc, LABELS, registry=registry, buckets=buckets or tokens)
            for field, (name, doc, buckets) in HISTOGRAMS.items()
        }
        return cls(**{f: h.labels(served.name, ENGINE) for f, h in children.items()})


class VllmMetrics:
    """The ``vllm:*`` metrics of one server, registered in its registry."""

    def __init__(self, served: ServedModel, registry: CollectorRegistry) -> None:
        self.served = served
        self._in_flight: dict[str, _InFlight] = {}
        self._stats = VllmStatsCollector(served)
        registry.register(self._stats)
        values = (served.name, ENGINE)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=registry).labels(*values)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self.prompt_tokens_cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*LABELS, "finished_reason"],
            registry=registry,
        )
        self.success = {r: success.labels(*values, r) for r in FINISH_REASONS}
        self.h = RequestHistograms.create(served, registry)

    # ---- engine thread --------------------------------------------------------------------------

    def first_token(self, ttft_s: float) -> None:
        self.h.ttft.observe(ttft_s)

    def step_done(self, now_s: float, outputs: Sequence[RequestOutput]) -> None:
        """One step's outputs, as vLLM reads an iteration: new tokens per request, and for a
        request's first tokens its prompt (all of it, and the part computed, not cached)."""
        step_tokens = 0
        for output in outputs:
            num_tokens = _num_tokens(output)
            seen = self._in_flight.get(output.request_id)
            if seen is None:
                if num_tokens == 0:  # best_of shows nothing until the end
                    continue
                num_prompt = len(output.prompt_token_ids)
                self.prompt_tokens.inc(num_prompt)
                self.prompt_tokens_cached.inc(output.num_cached_tokens)
                step_tokens += num_prompt - output.num_cached_tokens
                self._in_flight[output.request_id] = _InFlight(num_tokens, now_s, now_s)
            elif num_tokens > seen.num_tokens:
                self.h.itl.observe(now_s - seen.last_token_s)
                num_tokens -= seen.num_tokens
                seen.num_tokens += num_tokens
                seen.last_token_s = now_s
            else:
                continue
            step_tokens += num_tokens
            self.generation_tokens.inc(num_tokens)
        if step_tokens:
            self.h.iteration_tokens.observe(step_tokens)

    def finished(self, output: RequestOutput, arrival_s: float, now_s: float) -> None:
        seen = self._in_flight.pop(output.request_id, None)
        self.h.e2e.observe(now_s - arrival_s)
        reason = output.outputs[0].finish_reason if output.outputs else None
        if reason in self.success:
            self.success[reason].inc()
        num_prompt = len(output.prompt_token_ids)
        lengths = [len(o.token_ids) for o in output.outputs]
        self.h.prompt_tokens.observe(num_prompt)
        self.h.generation_tokens.observe(sum(lengths))
        self.h.max_generation_tokens.observe(max(lengths, default=0))
        self.h.params_n.observe(len(output.outputs))
        self.h.prefill_kv_computed.observe(num_prompt - output.num_cached_tokens)
        longest = max(lengths, default=0)
        if seen is not None and longest > 1:  # vLLM: decode time / (tokens - 1), else 0
            self.h.tpot.observe((seen.last_token_s - seen.first_token_s) / (longest - 1))
        else:
            self.h.tpot.observe(0.0)
        self._phases(output)

    def _phases(self, output: RequestOutput) -> None:
        """The request's phases from the engine's timestamps, subtracted as vLLM does."""
        m = output.metrics
        if m is None or not m.scheduled_ts or not m.first_token_ts:
            return  # ended before its first token (the engine left it no phases to time)
        self.h.queue_time.observe(m.scheduled_ts - m.queued_ts)
        self.h.prefill_time.observe(m.first_token_ts - m.scheduled_ts)
        self.h.decode_time.observe(m.last_token_ts - m.first_token_ts)
        self.h.inference_time.observe(m.last_token_ts - m.scheduled_ts)
        self.h.num_preemptions.observe(m.num_preemptions)

    def aborted(self, request_id: str) -> None:
        self._in_flight.pop(request_id, None)

    # ---- scrape ---------------------------------------------------------------------------------

    def set_stats(self, stats: Mapping[str, Any]) -> None:
        self._stats.snapshot = dict(stats)


# vLLM name -> (stats keys summed, help); gauges, then counters (the engine's, monotonic)
STATS_GAUGES = {
    "vllm:num_requests_running": (
        ("num_running",),
        "Number of requests in model execution batches.",
    ),
    "vllm:num_requests_waiting": (
        ("num_waiting", "num_swapped"),  # vLLM puts preempted requests back in waiting
        "Number of requests waiting to be processed.",
    ),
    "vllm:kv_cache_usage_perc": (("kv_usage",), "KV-cache usage. 1 means 100 percent usage."),
}
STATS_COUNTERS = {
    "vllm:prefix_cache_queries": (
        ("prefix_cache_query_tokens",),
        "Prefix cache queries, in terms of number of queried tokens.",
    ),
    "vllm:prefix_cache_hits": (
        ("prefix_cache_hit_tokens",),
        "Prefix cache hits, in terms of number of cached tokens.",
    ),
    "vllm:num_preemptions": (
        ("preemptions_recompute", "preemptions_swap"),
        "Cumulative number of preemption from the engine.",
    ),
}


class VllmStatsCollector(Collector):
    """The vLLM gauges and counters that ``engine.stats()`` holds, and the cache config."""

    def __init__(self, served: ServedModel) -> None:
        self.served = served
        self.snapshot: Mapping[str, Any] = {}

    def describe(self) -> list[Metric]:
        return []  # families appear with the first snapshot that has their keys

    def collect(self) -> Iterator[Metric]:
        stats, values = self.snapshot, [self.served.name, ENGINE]
        for name, (keys, doc) in STATS_GAUGES.items():
            if all(k in stats for k in keys):
                gauge = GaugeMetricFamily(name, doc, labels=LABELS)
                gauge.add_metric(values, sum(stats[k] for k in keys))
                yield gauge
        for name, (keys, doc) in STATS_COUNTERS.items():
            if all(k in stats for k in keys):
                counter = CounterMetricFamily(name, doc, labels=LABELS)
                counter.add_metric(values, sum(stats[k] for k in keys))
                yield counter
        config = {**self.served.cache_config, "engine": ENGINE}
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=list(config),
        )
        info.add_metric(list(config.values()), 1)
        yield info
