"""A benchmark run's numbers: the result record, latency percentiles, the table and the JSON.

Owns formatting only; no torch, no engine. Offline and HTTP runs both produce a ``BenchResult``.
"""

from __future__ import annotations

import json
import math
import resource
from dataclasses import asdict, dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)


@dataclass
class BenchResult:
    """One timed pass over a workload. Times in seconds; rates per second of ``elapsed_s``."""

    mode: str  # "offline" | "serve"
    workload: str
    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int
    elapsed_s: float
    ttft_s: list[float] = field(default_factory=list)  # per request, from the run's start
    tpot_s: list[float] = field(default_factory=list)  # per request with >1 output token
    settings: dict[str, Any] = field(default_factory=dict)
    peak_rss_bytes: int = 0
    num_cached_prompt_tokens: int = 0

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.num_prompt_tokens + self.num_output_tokens) / self.elapsed_s

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("ttft_s")
        data.pop("tpot_s")
        data["output_tokens_per_s"] = self.output_tokens_per_s
        data["total_tokens_per_s"] = self.total_tokens_per_s
        data["ttft_ms"] = {f"p{p}": percentile(self.ttft_s, p) * 1e3 for p in PERCENTILES}
        data["tpot_ms"] = {f"p{p}": percentile(self.tpot_s, p) * 1e3 for p in PERCENTILES}
        return data


def percentile(values: list[float], pct: float) -> float:
    """Linear-interpolated percentile (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * pct / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def format_table(result: BenchResult) -> str:
    """The human-readable summary printed at the end of a run."""
    rows = [
        ("workload", result.workload),
        ("requests", f"{result.num_requests}"),
        ("prompt tokens", f"{result.num_prompt_tokens:,}"),
        ("output tokens", f"{result.num_output_tokens:,}"),
        ("cached prompt tokens", f"{result.num_cached_prompt_tokens:,}"),
        ("elapsed", f"{result.elapsed_s:.2f} s"),
        ("output throughput", f"{result.output_tokens_per_s:,.1f} tok/s"),
        ("total throughput", f"{result.total_tokens_per_s:,.1f} tok/s"),
    ]
    for name, values in (("TTFT", result.ttft_s), ("TPOT", result.tpot_s)):
        shown = " / ".join(f"{percentile(values, p) * 1e3:,.1f}" for p in PERCENTILES)
        rows.append((f"{name} p50/p90/p99", f"{shown} ms"))
    if result.peak_rss_bytes:
        rows.append(("peak RSS", f"{result.peak_rss_bytes / 2**30:.2f} GiB"))
    rows += [(key, str(value)) for key, value in result.settings.items() if value is not None]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def write_json(result: BenchResult, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result.to_json(), f, indent=2)
        f.write("\n")
