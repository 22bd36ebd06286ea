"""The block-size study: run every block size and baseline, recommend one, write the report.

Owns ``Study`` (the results of one workload), the recommendation rule and the markdown and
JSON forms of the report. Plots are ``plots.py``'s. Must not import torch, the engine or the
server.

The rule (stated in every report): among block sizes whose time-averaged KV utilisation is
within ``UTIL_TOLERANCE`` (absolute) of the best, take those whose simulated throughput is
within ``THROUGHPUT_TOLERANCE`` (relative) of the best of them, and recommend the largest:
within those margins the cost model cannot tell them apart, and a larger block means fewer
block-table entries, fewer indirections and less allocator work. The per-entry cost enters the
throughput through ``CostModel.per_table_entry_s``, so tiny blocks lose there; large blocks
lose through utilisation (tails of last blocks) and through prefix hits (only full blocks are
shared) which cost prefill time.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from pagekv.sim import plots
from pagekv.sim.baselines import Reservation, simulate_contiguous
from pagekv.sim.cost_model import CostModel
from pagekv.sim.metrics import SimResult
from pagekv.sim.simulator import SimConfig, simulate
from pagekv.sim.workload import SimRequest

UTIL_TOLERANCE = 0.05
THROUGHPUT_TOLERANCE = 0.02
DEFAULT_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass(frozen=True)
class Recommendation:
    block_size: int
    reason: str


@dataclass(frozen=True)
class Study:
    title: str
    config: SimConfig  # the settings every run shares (each paged run sets its block size)
    paged: list[SimResult]
    baselines: list[SimResult]
    recommendation: Recommendation
    cost: CostModel
    timeline: SimResult | None = None  # the run that recorded block states, if asked


def run_study(
    requests: Sequence[SimRequest],
    config: SimConfig,
    cost: CostModel,
    block_sizes: Sequence[int] = DEFAULT_BLOCK_SIZES,
    *,
    title: str = "workload",
    baselines: bool = True,
    timeline: bool = False,
    timeline_block_size: int | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> Study:
    """Simulate ``requests`` at each block size (same memory) and, if asked, the baselines;
    ``timeline`` reruns one block size (default: the recommended one) recording block states.
    """
    paged = []
    for block_size in block_sizes:
        result = simulate(requests, replace(config, block_size=block_size), cost)
        log(_line(result))
        paged.append(result)
    contiguous = []
    if baselines:
        for reservation in Reservation:
            result = simulate_contiguous(requests, config, cost, reservation)
            log(_line(result))
            contiguous.append(result)
    recommendation = recommend(paged, cost)
    pictured = None
    if timeline:
        block_size = timeline_block_size or recommendation.block_size
        pictured = simulate(
            requests, replace(config, block_size=block_size), cost, record_blocks=True
        )
    return Study(title, config, paged, contiguous, recommendation, cost, pictured)


def _line(r: SimResult) -> str:
    return (
        f"{r.label:>18}: util {r.kv_utilisation:6.1%}  hit {r.prefix_hit_rate:6.1%}  "
        f"{r.throughput:9.2f} tok/s  {r.num_steps} steps  {r.num_preemptions} preemptions"
    )


def recommend(paged: Sequence[SimResult], cost: CostModel) -> Recommendation:
    """The module docstring's rule, with its reason in one sentence."""
    if not paged:
        raise ValueError("no block size was simulated")
    best_util = max(r.kv_utilisation for r in paged)
    near_util = [r for r in paged if r.kv_utilisation >= best_util - UTIL_TOLERANCE]
    best = max(near_util, key=lambda r: r.throughput)
    near = [r for r in near_util if r.throughput >= (1 - THROUGHPUT_TOLERANCE) * best.throughput]
    choice = max(near, key=lambda r: r.block_size or 0)
    assert choice.block_size is not None
    reason = (
        f"block size {choice.block_size} is the largest whose simulated throughput "
        f"({choice.throughput:.2f} tok/s) is within {THROUGHPUT_TOLERANCE:.0%} of the best "
        f"({best.throughput:.2f} tok/s at block size {best.block_size}) among block sizes "
        f"whose KV utilisation is within {UTIL_TOLERANCE * 100:.0f} points of the best "
        f"({best_util:.1%}; this one {choice.kv_utilisation:.1%}), and larger blocks need "
        f"fewer block-table entries ({choice.mean_table_entries:.0f} on average here, at "
        f"{cost.per_table_entry_s * 1e6:.1f} us each in the cost model)."
    )
    return Recommendation(choice.block_size, reason)


# ---- markdown and JSON -----------------------------------------------------------------------

_COLUMNS = (
    "run",
    "KV util",
    "int. frag",
    "table entries",
    "prefix hit",
    "preempt",
    "max batch",
    "tok/s",
    "TTFT p50 / p99 (s)",
    "TPOT p50 / p99 (s)",
)


def _row(r: SimResult) -> list[str]:
    return [
        r.label,
        f"{r.kv_utilisation:.1%}",
        f"{r.internal_fragmentation:.1%}",
        f"{r.mean_table_entries:.0f}",
        f"{r.prefix_hit_rate:.1%}" if r.block_size is not None else "-",
        str(r.num_preemptions),
        str(r.max_batch),
        f"{r.throughput:.2f}",
        f"{r.ttft_s.p50:.1f} / {r.ttft_s.p99:.1f}",
        f"{r.tpot_s.p50:.2f} / {r.tpot_s.p99:.2f}",
    ]


def markdown_table(study: Study) -> str:
    lines = ["| " + " | ".join(_COLUMNS) + " |", "|" + " --- |" * len(_COLUMNS)]
    for r in [*study.paged, *study.baselines]:
        lines.append("| " + " | ".join(_row(r)) + " |")
    return "\n".join(lines)


def markdown(study: Study, plots: Sequence[str] = ()) -> str:
    """report.md: settings, the table, the recommendation and its rule, the plots."""
    c, first = study.config, study.paged[0] if study.paged else None
    num_requests = first.num_requests if first else 0
    lines = [
        f"# Block-size study: {study.title}",
        "",
        f"{num_requests} sequences; KV pool of {c.num_kv_tokens} token slots at every block "
        f"size; max {c.max_num_seqs} sequences and {c.max_num_batched_tokens} tokens per "
        f"step; max model length {c.max_model_len}; prefix caching "
        f"{'on' if c.enable_prefix_caching else 'off'}; preemption by {c.preemption_mode}. "
        f"Cost model: {study.cost.meta.get('measured', 'unknown date')}, "
        f"{study.cost.meta.get('machine', '')} ({study.cost.meta.get('grid', 'custom')}).",
        "",
        markdown_table(study),
        "",
        "KV util: tokens stored / slots reserved, integrated over simulated time (paged: "
        "`KVCacheManager.usage()`; contiguous: the reserved regions). int. frag: paged, "
        "slots of allocated blocks holding no token; contiguous, reserved slots that the "
        "sequence will never fill. table entries: block-table entries, time-averaged "
        "(contiguous: one per sequence). prefix hit: prompt tokens found in the prefix cache "
        "at admission, including a preempted request's own blocks when it is readmitted. "
        "tok/s: generated tokens per simulated second.",
        "",
        f"**Recommended block size: {study.recommendation.block_size}.** "
        f"{study.recommendation.reason[0].upper()}{study.recommendation.reason[1:]}",
        "",
        f"Rule: among block sizes within {UTIL_TOLERANCE * 100:.0f} points of the best KV "
        f"utilisation, the largest whose throughput is within {THROUGHPUT_TOLERANCE:.0%} of "
        "the best.",
    ]
    lines += [""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    return "\n".join(lines) + "\n"


def to_json(study: Study) -> dict[str, object]:
    def one(r: SimResult) -> dict[str, object]:
        return {
            "label": r.label,
            "block_size": r.block_size,
            "num_requests": r.num_requests,
            "num_rejected": r.num_rejected,
            "num_steps": r.num_steps,
            "sim_time_s": r.sim_time_s,
            "num_output_tokens": r.num_output_tokens,
            "kv_utilisation": r.kv_utilisation,
            "internal_fragmentation": r.internal_fragmentation,
            "mean_table_entries": r.mean_table_entries,
            "prefix_hit_rate": r.prefix_hit_rate,
            "num_preemptions": r.num_preemptions,
            "max_batch": r.max_batch,
            "throughput": r.throughput,
            "ttft_s": vars(r.ttft_s),
            "tpot_s": vars(r.tpot_s),
        }

    return {
        "title": study.title,
        "recommendation": vars(study.recommendation),
        "paged": [one(r) for r in study.paged],
        "baselines": [one(r) for r in study.baselines],
    }


def write_report(study: Study, out_dir: str | Path) -> list[Path]:
    """report.md, results.json and the PNG plots under ``out_dir``; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = plots.write_plots(study, out)
    (out / "report.md").write_text(markdown(study, [str(p) for p in written]), encoding="utf-8")
    (out / "results.json").write_text(json.dumps(to_json(study), indent=2), encoding="utf-8")
    return [out / "report.md", out / "results.json", *written]
