"""PNG plots of a block-size study, and the block timeline picture.

Owns the figures only; matplotlib is imported inside each function (Agg backend, no display),
so importing pagekv.sim does not load it. Must not import torch, the engine or the server. A
study is read through ``PlottedStudy`` (``report.Study`` is one): the report writes the plots,
so the plots do not import the report.

    util_hit.png         KV utilisation and prefix-cache hit rate vs block size
    throughput.png       simulated throughput vs block size, baselines as lines
    memory_timeline.png  slots reserved vs tokens stored over simulated time
    block_timeline.png   the physical pool over time, one row per block, one column per
                         sample: free / evictable / shared / in use (a colour per request)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pagekv.sim.metrics import EVICTABLE, FREE, OWNER_BASE, SHARED, BlockTimeline, SimResult

if TYPE_CHECKING:
    from pagekv.sim.simulator import SimConfig


class Recommended(Protocol):
    """The recommendation, as the plots mark it."""

    @property
    def block_size(self) -> int: ...


class PlottedStudy(Protocol):
    """What the plots read of a block-size study."""

    @property
    def title(self) -> str: ...

    @property
    def config(self) -> SimConfig: ...

    @property
    def paged(self) -> Sequence[SimResult]: ...

    @property
    def baselines(self) -> Sequence[SimResult]: ...

    @property
    def recommendation(self) -> Recommended: ...

    @property
    def timeline(self) -> SimResult | None: ...


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(study: PlottedStudy, out: Path) -> list[Path]:
    paths = [
        plot_util_hit(study, out / "util_hit.png"),
        plot_throughput(study, out / "throughput.png"),
        plot_memory_timeline(study, out / "memory_timeline.png"),
    ]
    if study.timeline is not None and study.timeline.blocks is not None:
        paths.append(plot_block_timeline(study.timeline, out / "block_timeline.png"))
    return paths


def _block_axis(ax: Any, sizes: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes)
    ax.set_xticklabels([str(s) for s in sizes])
    ax.set_xlabel("block size (tokens)")
    ax.grid(True, alpha=0.3)


def plot_util_hit(study: PlottedStudy, path: Path) -> Path:
    plt = _pyplot()
    sizes = [r.block_size or 0 for r in study.paged]
    fig, ax = plt.subplots(figsize=(8.5, 4.2))
    ax.plot(sizes, [100 * r.kv_utilisation for r in study.paged], "o-", label="KV utilisation")
    ax.plot(sizes, [100 * r.prefix_hit_rate for r in study.paged], "s-", label="prefix hit rate")
    for r, style in zip(study.baselines, (":", "--", "-."), strict=False):
        ax.axhline(100 * r.kv_utilisation, color="grey", linestyle=style, label=r.label)
    ax.axvline(study.recommendation.block_size, color="green", alpha=0.4, label="recommended")
    _block_axis(ax, sizes)
    ax.set_ylabel("%")
    ax.set_ylim(0, 105)
    ax.set_title(f"{study.title}: KV utilisation and prefix hits")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)


def plot_throughput(study: PlottedStudy, path: Path) -> Path:
    plt = _pyplot()
    sizes = [r.block_size or 0 for r in study.paged]
    fig, ax = plt.subplots(figsize=(8.5, 4.2))
    ax.plot(sizes, [r.throughput for r in study.paged], "o-", label="paged")
    for r, style in zip(study.baselines, (":", "--", "-."), strict=False):
        ax.axhline(r.throughput, color="grey", linestyle=style, label=r.label)
    ax.axvline(study.recommendation.block_size, color="green", alpha=0.4, label="recommended")
    _block_axis(ax, sizes)
    ax.set_ylabel("generated tokens / simulated s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{study.title}: simulated throughput")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)


def plot_memory_timeline(study: PlottedStudy, path: Path) -> Path:
    """Slots reserved (solid) and tokens stored (dashed) for the recommended block size and
    each baseline: the gap between a pair of lines is the memory that holds no token."""
    plt = _pyplot()
    chosen = [r for r in study.paged if r.block_size == study.recommendation.block_size]
    fig, ax = plt.subplots(figsize=(8, 5.2))
    for r in [*chosen, *study.baselines]:
        u = r.usage
        (line,) = ax.plot(u.times_s, u.slots, "-", label=f"{r.label}: reserved")
        ax.plot(u.times_s, u.tokens, "--", color=line.get_color(), label=f"{r.label}: stored")
    ax.axhline(study.config.num_kv_tokens, color="black", linewidth=0.8, label="pool")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("KV slots")
    ax.set_title(f"{study.title}: KV memory over time")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    return _save(fig, path)


def plot_block_timeline(result: SimResult, path: Path) -> Path:
    """Every physical block (rows) at every sampled step (columns), coloured by state."""
    plt = _pyplot()
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    blocks: BlockTimeline | None = result.blocks
    assert blocks is not None, "the run did not record block states"
    owner_colours = [plt.get_cmap("tab20")(i) for i in range(blocks.palette)]
    cmap = ListedColormap(["white", "#c8c8c8", "black", *owner_colours])
    image = blocks.image()
    fig, ax = plt.subplots(figsize=(10, 5))
    times = blocks.times_s or [0.0]
    ax.imshow(
        image,
        aspect="auto",
        interpolation="nearest",
        cmap=cmap,
        vmin=FREE,
        vmax=OWNER_BASE + blocks.palette - 1,
        extent=(times[0], times[-1], blocks.num_blocks - 0.5, -0.5),
    )
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("physical block id")
    ax.set_title(
        f"KV pool over time, block size {result.block_size}: each colour is one request's "
        "blocks, scattered anywhere in the pool"
    )
    legend = [
        Patch(facecolor="white", edgecolor="grey", label="free"),
        Patch(facecolor="#c8c8c8", label="evictable (cached, unused)"),
        Patch(facecolor="black", label="shared (ref > 1)"),
        Patch(facecolor=owner_colours[0], label="in use by one request"),
    ]
    ax.legend(handles=legend, fontsize=8, loc="upper right", framealpha=0.9)
    assert EVICTABLE == 1 and SHARED == 2  # the colour map above lists states in this order
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path
