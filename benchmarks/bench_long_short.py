"""Long prompts among short requests: does chunked prefill protect the short ones' decode speed?

    OMP_NUM_THREADS=1 python benchmarks/bench_long_short.py [--dtype float32] [--only NAME]
                                                            [--record]

Workload (fixed seed, real default model SmolLM2-135M-Instruct, float32 by default): 60 short
requests (prompts of 20-40 tokens, 16 greedy output tokens each), one arriving every
STEPS_PER_ARRIVAL engine steps; in the runs "with long", 4 prompts of 1,500 tokens (one output
token each: they only need prefilling to hurt) arrive together with shorts 8, 20, 32 and 44.
Arrivals are counted in steps, not seconds, so every run of a setting sees the same batches
whatever the machine's load: a shared machine only changes how long steps take, not which
requests meet in them. (With wall-clock arrivals, a slow patch makes more requests arrive per
step, which makes steps slower still, and identical settings diverge.) A
run ends when the last short request finishes; the long prompts' progress by then (prefilled
tokens, of 6,000) is reported, since a setting could protect the short ones by starving the
long ones.

For each short request: TTFT; TPOT (time per output token) = (time of its last token - time of
its first) / (output tokens - 1), the vLLM definition; ITL = every gap between two of its
consecutive tokens. Reported: p50/p99 over the 60 short requests (ITL: over all their gaps),
with and without the long prompts, per setting; the criterion is TPOT p99 with the long prompts
<= 1.5 x without, under the same setting. Times are CPU time of this single-threaded process
(see CLOCK); the last column is the run's wall time.

Settings (FCFS; smaller caps protect decodes better but prefill long prompts slower):
  default        max_num_batched_tokens=2048, no per-request cap: a long prompt in one step
  budget128      max_num_batched_tokens=128
  budget32+t8    max_num_batched_tokens=32 and long_prefill_token_threshold=8: no request gets
                 more than 8 tokens a step, so new short requests are admitted beside a long
                 prefill
  budget32       max_num_batched_tokens=32: at most 32 tokens per step, decodes first; a long
                 prefill takes all the rest, so new short requests wait for it (TTFT)

The engine runs its default attention backend (the fast CPU path of pagekv/runner).
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagekv import SamplingParams
from pagekv.engine import LLMEngine
from pagekv.engine.config import EngineConfig
from pagekv.models import load_model
from pagekv.models.loader import LoadedModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record

NUM_SHORT = 60
SHORT_OUTPUT = 16
NUM_LONG = 4
LONG_TOKENS = 1500
LONG_AFTER = (8, 20, 32, 44)  # a long prompt arrives together with these shorts
STEPS_PER_ARRIVAL = 2
SEED = 1234
# Token times are read on the process's CPU clock: with one thread it is the time the steps
# took on the core, which the other jobs of a shared machine do not inflate as they do the wall
# clock (there, identical runs differ widely in TPOT p99). Wall time is reported per run.
CLOCK = time.process_time

SETTINGS: dict[str, dict[str, object]] = {
    # name: EngineConfig overrides
    "default": {},
    "budget128": {"max_num_batched_tokens": 128},
    "budget32+t8": {"max_num_batched_tokens": 32, "long_prefill_token_threshold": 8},
    "budget32": {"max_num_batched_tokens": 32},
}


@dataclass
class Arrival:
    at_step: int
    request_id: str
    prompt: list[int]
    params: SamplingParams


@dataclass
class RunResult:
    added_s: dict[str, float] = field(default_factory=dict)
    token_times: dict[str, list[float]] = field(default_factory=dict)
    long_prefilled_tokens: int = 0
    wall_s: float = 0.0
    steps: int = 0
    max_step_s: float = 0.0


def workload(with_long: bool) -> list[Arrival]:
    """The same short requests (own seeded generator) with or without the long ones."""
    rng, long_rng = random.Random(SEED), random.Random(SEED + 1)
    short = SamplingParams(temperature=0, max_tokens=SHORT_OUTPUT, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    arrivals = []
    for i in range(NUM_SHORT):
        step = 1 + i * STEPS_PER_ARRIVAL
        prompt = [rng.randrange(100, 40_000) for _ in range(rng.randint(20, 40))]
        arrivals.append(Arrival(step, f"short{i}", prompt, short))
        if with_long and i in LONG_AFTER:
            prompt = [long_rng.randrange(100, 40_000) for _ in range(LONG_TOKENS)]
            arrivals.append(Arrival(step, f"long{i}", prompt, long))
    return arrivals


def run(loaded: LoadedModel, dtype: str, setting: str, with_long: bool) -> RunResult:
    config = EngineConfig(dtype=dtype, num_kv_blocks=1024, **SETTINGS[setting])  # type: ignore[arg-type]
    engine = LLMEngine(config, loaded)
    pending = workload(with_long)
    result = RunResult()
    start, wall_start = CLOCK(), time.perf_counter()
    while pending or not _shorts_done(result):
        result.steps += 1
        while pending and pending[0].at_step <= result.steps:
            a = pending.pop(0)
            engine.add_request(a.request_id, a.prompt, a.params)
            result.added_s[a.request_id] = CLOCK() - start
        step_start = CLOCK()
        outputs = engine.step()
        done = CLOCK()
        result.max_step_s = max(result.max_step_s, done - step_start)
        for out in outputs:
            times = result.token_times.setdefault(out.request_id, [])
            times += [done - start] * (len(out.outputs[0].token_ids) - len(times))
    result.wall_s = time.perf_counter() - wall_start
    result.long_prefilled_tokens = _long_progress(engine, result)
    return result


def _shorts_done(result: RunResult) -> bool:
    times = result.token_times
    done = sum(1 for r, t in times.items() if r.startswith("short") and len(t) == SHORT_OUTPUT)
    return done == NUM_SHORT


def _long_progress(engine: LLMEngine, result: RunResult) -> int:
    """Prompt tokens of the long requests computed by the time the shorts are done."""
    sched = engine.scheduler
    live = [*sched.waiting, *sched.running, *sched.swapped]
    in_flight: int = sum(r.num_computed_tokens for r in live if r.request_id.startswith("long"))
    finished = sum(1 for rid in result.token_times if rid.startswith("long"))
    return in_flight + finished * LONG_TOKENS


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(result: RunResult) -> dict[str, float]:
    tpot, itl, ttft = [], [], []
    for rid, times in result.token_times.items():
        if rid.startswith("short") and len(times) > 1:
            ttft.append(times[0] - result.added_s[rid])
            tpot.append((times[-1] - times[0]) / (len(times) - 1))
            itl += [b - a for a, b in itertools.pairwise(times)]
    assert len(tpot) == NUM_SHORT, f"only {len(tpot)} short requests finished"
    return {
        "ttft_p50": percentile(ttft, 0.5) * 1e3,
        "tpot_p50": percentile(tpot, 0.5) * 1e3,
        "tpot_p99": percentile(tpot, 0.99) * 1e3,
        "itl_p50": percentile(itl, 0.5) * 1e3,
        "itl_p99": percentile(itl, 0.99) * 1e3,
        "mean_tpot": statistics.fmean(tpot) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--only", choices=list(SETTINGS), action="append")
    record.add_argument(parser)
    args = parser.parse_args()
    loaded = load_model(None, torch.float32 if args.dtype == "float32" else torch.bfloat16)
    print(
        f"dtype={args.dtype} threads={torch.get_num_threads()} shorts={NUM_SHORT}x"
        f"{SHORT_OUTPUT} tokens, one per {STEPS_PER_ARRIVAL} steps; "
        f"longs={NUM_LONG}x{LONG_TOKENS} tokens; policy fcfs"
    )
    columns = ("TTFT p50", "TPOT p50", "TPOT p99", "ITL p50", "ITL p99")
    print(
        f"{'setting':<13} {'long':>4} "
        + " ".join(f"{c:>9}" for c in columns)
        + f" {'p99 x':>6} {'long done':>9} {'steps':>6} {'max step':>9} {'wall':>6}"
    )
    print(
        f"{'':<18} " + " ".join(f"{'ms':>9}" for _ in columns) + f" {'':>6} {'tokens':>9}"
        f" {'':>6} {'ms':>9} {'s':>6}"
    )
    rows: list[list[record.Cell]] = []
    for name in args.only or list(SETTINGS):
        base_p99 = 0.0
        for with_long in (False, True):
            result = run(loaded, args.dtype, name, with_long)
            s = summarize(result)
            base_p99 = base_p99 or s["tpot_p99"]
            long_done = f"{result.long_prefilled_tokens:9d}" if with_long else f"{'-':>9}"
            keys = ("ttft_p50", "tpot_p50", "tpot_p99", "itl_p50", "itl_p99")
            print(
                f"{name:<13} {'yes' if with_long else 'no':>4} "
                + " ".join(f"{s[k]:9.1f}" for k in keys)
                + f" {s['tpot_p99'] / base_p99:6.2f} {long_done} {result.steps:6d} "
                f"{result.max_step_s * 1e3:9.0f} {result.wall_s:6.1f}",
                flush=True,
            )
        rows.append(record_row(name, base_p99, s, result.long_prefilled_tokens))
    if args.record is not None:
        save_record(args.record or "long_short", args.dtype, rows)


def record_row(
    name: str, base_p99: float, with_long: dict[str, float], long_done: int
) -> list[record.Cell]:
    """A setting's row: TPOT p99 without and with the long prompts, their ratio, and the
    short requests' ITL p99 and TTFT p50 with them; all in ms."""
    p99 = with_long["tpot_p99"]
    ms = [f"{with_long[key]:,.0f} ms" for key in ("itl_p99", "ttft_p50")]
    return [name, f"{base_p99:,.0f} / {p99:,.0f} ms", f"{p99 / base_p99:.2f}x", *ms, long_done]


def save_record(name: str, dtype: str, rows: list[list[record.Cell]]) -> None:
    columns = ["setting", "TPOT p99 without / with long", "ratio", "ITL p99 with"]
    columns += ["TTFT p50 with", f"long done (of {NUM_LONG * LONG_TOKENS:,})"]
    record.save(
        name,
        "Long prompts among short requests: the short ones' decode with and without them",
        columns,
        rows,
        f"{NUM_SHORT} short requests (20-40-token prompts, {SHORT_OUTPUT} tokens) one every "
        f"{STEPS_PER_ARRIVAL} steps, {NUM_LONG} prompts of {LONG_TOKENS:,} tokens among them; "
        f"FCFS, {dtype}, process CPU time; the criterion: ratio <= 1.5.",
    )


if __name__ == "__main__":
    main()
