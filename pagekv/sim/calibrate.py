"""Calibration: time the real model runner on synthetic plans and fit a ``CostModel``.

Owns the grid of calibration plans and the timing loop. This is the only module of pagekv.sim
that runs the model: torch, pagekv.models and pagekv.runner are imported inside ``calibrate``,
so ``import pagekv.sim`` stays torch-free.

Each plan is built with the real ``KVCacheManager`` (so block tables are genuine) and executed
by the real ``ModelRunner``; the grid spans what engine steps look like: decode batches (equal
and mixed lengths), prefills and prefix-hit prefills, prefill chunks mixed with decodes, and
the same shapes at several block sizes so the per-table-entry cost can be told apart. Some
plans differ in one feature only, so the fit can tell the features apart: decode batches of
equal and of spread lengths (summed vs padded context), prefills of one long sequence and of
many short ones (per token vs per sequence: logits are computed for the last token of each).
"""

from __future__ import annotations

import datetime
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from pagekv.core import KVCacheManager, Plan, Request, ScheduledRequest
from pagekv.core.plan import BlockTransfers
from pagekv.errors import InvalidRequestError
from pagekv.sampling_params import SamplingParams
from pagekv.sim.cost_model import CostModel, StepShape, fit

Pairs = tuple[tuple[int, int], ...]  # one (new tokens, context after the step) per sequence


def _decode(num_seqs: int, context: int) -> Pairs:
    return ((1, context),) * num_seqs


def _spread(num_seqs: int, low: int, high: int) -> Pairs:
    step = (high - low) / max(1, num_seqs - 1)
    return tuple((1, int(low + i * step)) for i in range(num_seqs))


def _mixed(chunk: int, context: int, num_decodes: int, decode_context: int) -> Pairs:
    return ((chunk, context), *_decode(num_decodes, decode_context))


@dataclass(frozen=True)
class PlanSpec:
    block_size: int
    pairs: Pairs

    @property
    def num_padded_cells(self) -> int:
        return len(self.pairs) * max(q for q, _ in self.pairs) * max(c for _, c in self.pairs)


HEAVY_CELLS = 5_000_000  # plans past this many padded attention cells are timed once
CLOCKS: dict[str, Callable[[], float]] = {
    "process": time.process_time,
    "wall": time.perf_counter,
}


def default_grid(quick: bool = False) -> list[PlanSpec]:
    """The plans to time; ``quick`` is a seconds-long subset (for tests)."""
    if quick:
        shapes16 = [_decode(4, 64), _decode(16, 128), ((64, 64),), ((128, 256),)]
        shapes16 += [_mixed(32, 64, 7, 96), _spread(12, 16, 200)]
        return [PlanSpec(16, p) for p in shapes16] + [PlanSpec(1, _decode(16, 128))]
    shapes = [
        _decode(1, 64),
        _decode(8, 256),
        _decode(16, 1024),
        _decode(32, 128),
        _decode(64, 256),
        _decode(64, 768),
        _decode(128, 384),
        _spread(48, 32, 1024),
        _spread(64, 32, 768),
        _spread(16, 64, 1024),
        ((128, 128),),
        ((128, 128),) * 8,
        ((32, 32),) * 32,
        ((1024, 1024),),
        ((512, 512),) * 4,
        ((256, 1024),),
        ((64, 512),) * 8,
        _mixed(512, 512, 23, 512),
        _mixed(448, 512, 47, 512),
        _mixed(128, 128, 31, 384),
        ((256, 256),) * 2 + _decode(62, 256),
    ]
    grid = [PlanSpec(16, p) for p in shapes]
    for block_size in (1, 4, 64):
        grid += [PlanSpec(block_size, _decode(64, 512)), PlanSpec(block_size, _decode(32, 256))]
    grid.append(PlanSpec(1, _mixed(256, 256, 15, 256)))
    return grid


@dataclass(frozen=True)
class CalibrationSettings:
    model: str | None = None  # None: the default SmolLM2-135M-Instruct
    dtype: str = "float32"
    num_threads: int = 1
    repeats: int = 2  # each plan is timed this often (heavy ones once); the median is fitted
    quick: bool = False
    seed: int = 0
    # "process": CPU seconds of this process, what a step costs on an otherwise idle core, so
    # a shared machine's neighbours do not leak into the model (they stretch wall time on a
    # small shared machine); right for one torch thread. "wall": elapsed time.
    clock: str = "process"

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise InvalidRequestError(f"dtype must be float32 or bfloat16, got {self.dtype}")
        if self.repeats < 1 or self.num_threads < 1:
            raise InvalidRequestError("repeats and num_threads must be >= 1", "repeats")
        if self.clock not in CLOCKS:
            raise InvalidRequestError(f"clock must be one of {sorted(CLOCKS)}", "clock")


@dataclass(frozen=True)
class Measurement:
    spec: PlanSpec
    shape: StepShape
    seconds: list[float]


def calibrate(
    settings: CalibrationSettings, log: Callable[[str], None] = lambda _: None
) -> tuple[CostModel, list[Measurement]]:
    """Load the model, time every plan of the grid, fit; returns the model and the timings."""
    import torch

    from pagekv.models.loader import load_model
    from pagekv.runner.model_runner import ModelRunner

    torch.set_num_threads(settings.num_threads)
    dtype = torch.float32 if settings.dtype == "float32" else torch.bfloat16
    loaded = load_model(settings.model, dtype)
    grid = default_grid(settings.quick)
    rng = random.Random(settings.seed)
    measurements: list[Measurement] = []
    for block_size in sorted({s.block_size for s in grid}):
        specs = [s for s in grid if s.block_size == block_size]
        # One plan lives at a time (each is freed after its run): room for the largest.
        num_blocks = max(sum(-(-c // block_size) for _, c in s.pairs) for s in specs)
        kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        runner = ModelRunner(loaded, num_blocks, block_size)
        timer = _PlanTimer(kv, runner.execute, rng, CLOCKS[settings.clock])
        timer.time(specs[0])  # warm-up: first calls of each kernel, allocator growth
        order = [
            s
            for s in specs
            for _ in range(1 if s.num_padded_cells > HEAVY_CELLS else settings.repeats)
        ]
        rng.shuffle(order)
        times: dict[PlanSpec, list[float]] = {s: [] for s in specs}
        shapes: dict[PlanSpec, StepShape] = {}
        for spec in order:
            shapes[spec], seconds = timer.time(spec)
            times[spec].append(seconds)
            log(f"bs={block_size} seqs={len(spec.pairs)} {shapes[spec]}: {seconds:.3f} s")
        measurements += [Measurement(s, shapes[s], times[s]) for s in specs]
    meta = _meta(settings, loaded.path)
    model = fit(
        [m.shape for m in measurements],
        [statistics.median(m.seconds) for m in measurements],
        meta,
    )
    return model, measurements


class _PlanTimer:
    """Builds a plan from a ``PlanSpec`` on the real KV manager, runs it, frees it."""

    def __init__(
        self,
        kv: KVCacheManager,
        execute: Callable[[Plan], object],
        rng: random.Random,
        clock: Callable[[], float],
    ) -> None:
        self.kv, self.execute, self.rng, self.clock = kv, execute, rng, clock
        self.step = 0

    def time(self, spec: PlanSpec) -> tuple[StepShape, float]:
        self.step += 1
        entries = []
        for i, (num_new, context) in enumerate(spec.pairs):
            ids = [self.rng.randrange(100, 10000) for _ in range(context)]
            params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
            request = Request(f"cal-{self.step}-{i}", ids, params)
            self.kv.allocate(request, context)
            table = self.kv.block_table(request.request_id)
            entries.append(ScheduledRequest(request, context - num_new, num_new, table))
        plan = Plan(self.step, tuple(entries), BlockTransfers())
        start = self.clock()
        self.execute(plan)
        seconds = self.clock() - start
        for entry in entries:
            self.kv.free(entry.request.request_id)
        return StepShape.of_plan(plan), seconds


def _meta(settings: CalibrationSettings, model_path: str) -> dict[str, object]:
    import torch

    return {
        "measured": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "model": model_path.rsplit("/", 1)[-1],
        "dtype": settings.dtype,
        "num_threads": settings.num_threads,
        "repeats": settings.repeats,
        "grid": "quick" if settings.quick else "default",
        "clock": settings.clock,
        "torch": torch.__version__,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "runner": "pagekv ModelRunner, reference paged attention (padded)",
    }
