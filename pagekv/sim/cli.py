"""``pagekv sim``: the block-size study from the command line, and ``pagekv sim calibrate``.

Owns argument parsing and printing only; the work is report.py's and calibrate.py's. The
``pagekv`` command wires it in with ``register(subparsers)``; ``python -m pagekv.sim`` runs it
alone. Must not import torch (calibrate.py imports it when asked), the engine or the server.

    pagekv sim --workload sharegpt --num-requests 1000 --block-sizes 1,2,4,8,16,32,64,128 \\
               --kv-tokens 23296 --out sim_out [--timeline]
    pagekv sim --trace requests.jsonl [--strict] --out sim_out
    pagekv sim calibrate --out cost.json          (then: pagekv sim --cost cost.json ...)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from pagekv.core.trace import TRACE_BLOCK_SIZE, read_trace
from pagekv.errors import PagekvError
from pagekv.sim.cost_model import CostModel
from pagekv.sim.report import DEFAULT_BLOCK_SIZES, markdown_table, run_study, write_report
from pagekv.sim.simulator import SimConfig
from pagekv.sim.trace import replay_trace
from pagekv.sim.workload import PRESETS, LengthDist, SimRequest, build_workload, preset


def _block_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"expected block sizes like 1,2,4,16, got {text!r}")
    return sizes


def register(subparsers: Any) -> None:
    """Add the ``sim`` command (and ``sim calibrate``) to a ``pagekv`` subparsers object."""
    parser = subparsers.add_parser(
        "sim", help="simulate a workload at several KV block sizes and recommend one"
    )
    _study_args(parser)
    parser.set_defaults(func=_run_study)
    sub = parser.add_subparsers(dest="sim_command")
    cal = sub.add_parser("calibrate", help="time the real model runner and fit a cost model")
    cal.add_argument("--out", default="cost_model.json", help="where to write the JSON")
    cal.add_argument("--model", default=None, help="GGUF file or HF directory (default model)")
    cal.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    cal.add_argument("--repeats", type=int, default=2, help="timings per plan (median kept)")
    cal.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    cal.add_argument("--quick", action="store_true", help="a seconds-long grid (smoke test)")
    cal.add_argument(
        "--clock",
        default="process",
        choices=["process", "wall"],
        help="time steps in process CPU seconds (default: immune to a shared machine's "
        "neighbours) or wall seconds",
    )
    cal.set_defaults(func=_run_calibrate)


def _study_args(parser: argparse.ArgumentParser) -> None:
    w = parser.add_argument_group("workload")
    w.add_argument("--workload", default="sharegpt", choices=sorted(PRESETS))
    w.add_argument(
        "--trace", default=None, metavar="FILE", help="replay a JSON-lines trace (not --workload)"
    )
    w.add_argument("--strict", action="store_true", help="reject a trace with a bad line")
    w.add_argument("--num-requests", type=int, default=None)
    w.add_argument("--prompt-len", default=None, help="fixed:N | uniform:LO,HI | lognormal:M,S")
    w.add_argument("--output-len", default=None, help="same forms as --prompt-len")
    w.add_argument("--rate", type=float, default=None, help="Poisson arrivals/s (default: all)")
    w.add_argument("--n", type=int, default=None, help="parallel samples per request")
    w.add_argument("--num-prefixes", type=int, default=None, help="shared system prompts")
    w.add_argument("--num-turns", type=int, default=None, help="turns per chat")
    w.add_argument("--seed", type=int, default=0)
    e = parser.add_argument_group("engine (simulated)")
    e.add_argument("--block-sizes", type=_block_sizes, default=list(DEFAULT_BLOCK_SIZES))
    pool = e.add_mutually_exclusive_group()
    pool.add_argument("--kv-tokens", type=int, default=None, help="KV slots (default 23296)")
    pool.add_argument(
        "--kv-blocks", type=int, default=None, help=f"KV pool in {TRACE_BLOCK_SIZE}-token blocks"
    )
    e.add_argument("--max-num-seqs", type=int, default=256)
    e.add_argument("--max-num-batched-tokens", type=int, default=2048)
    e.add_argument("--max-model-len", type=int, default=2048)
    e.add_argument("--no-prefix-caching", action="store_true")
    e.add_argument(
        "--cost", default=None, metavar="FILE", help="cost model JSON (default: shipped)"
    )
    o = parser.add_argument_group("report")
    o.add_argument("--out", default="sim_out", metavar="DIR")
    o.add_argument("--no-baselines", action="store_true", help="skip the contiguous baselines")
    o.add_argument("--timeline", action="store_true", help="draw the block pool over time")
    o.add_argument("--timeline-block-size", type=int, default=None, help="default: recommended")


def _requests(args: argparse.Namespace) -> tuple[list[SimRequest], str]:
    if args.trace is not None:
        trace = read_trace(args.trace, strict=args.strict)
        for problem in trace.problems:
            print(f"pagekv sim: {args.trace}: skipped {problem}", file=sys.stderr)
        return replay_trace(trace.records), f"trace {Path(args.trace).name}"
    changes: dict[str, object] = {"seed": args.seed}
    for name in ("num_requests", "rate", "n", "num_prefixes", "num_turns"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    if args.prompt_len is not None:
        changes["prompt"] = LengthDist.parse(args.prompt_len)
    if args.output_len is not None:
        changes["output"] = LengthDist.parse(args.output_len)
    return build_workload(preset(args.workload, **changes)), args.workload


def _config(args: argparse.Namespace) -> SimConfig:
    config = SimConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
    )
    if args.kv_tokens is not None:
        return replace(config, num_kv_tokens=args.kv_tokens)
    if args.kv_blocks is not None:
        return replace(config, num_kv_tokens=args.kv_blocks * TRACE_BLOCK_SIZE)
    return config


def _run_study(args: argparse.Namespace) -> None:
    requests, title = _requests(args)
    cost = CostModel.load(args.cost) if args.cost else CostModel.default()
    study = run_study(
        requests,
        _config(args),
        cost,
        args.block_sizes,
        title=title,
        baselines=not args.no_baselines,
        timeline=args.timeline,
        timeline_block_size=args.timeline_block_size,
        log=lambda line: print(line, file=sys.stderr),
    )
    paths = write_report(study, args.out)
    print(markdown_table(study))
    print(f"\nRecommended block size: {study.recommendation.block_size}")
    print(study.recommendation.reason)
    print("\nwrote " + ", ".join(str(p) for p in paths))


def _run_calibrate(args: argparse.Namespace) -> None:
    from pagekv.sim.calibrate import CalibrationSettings, calibrate

    settings = CalibrationSettings(
        model=args.model,
        dtype=args.dtype,
        num_threads=args.threads,
        repeats=args.repeats,
        quick=args.quick,
        clock=args.clock,
    )
    model, _ = calibrate(settings, log=lambda line: print(line, file=sys.stderr))
    Path(args.out).write_text(model.to_json() + "\n", encoding="utf-8")
    meta = model.meta
    print(
        f"wrote {args.out}: {meta['num_samples']} plans, mean |error| "
        f"{meta['mean_abs_rel_error']:.1%}, max {meta['max_abs_rel_error']:.1%}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pagekv.sim ...``: the same as ``pagekv sim ...``."""
    parser = argparse.ArgumentParser(prog="pagekv")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["sim", *(sys.argv[1:] if argv is None else argv)])
    try:
        args.func(args)
    except PagekvError as e:
        print(f"pagekv: error: {e}", file=sys.stderr)
        return 2
    return 0
