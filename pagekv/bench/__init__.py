"""``pagekv bench``: throughput and latency on the standard workloads.

    pagekv bench --workload random --dtype bfloat16 --json-out out.json   # offline, in process
    pagekv bench serve --url http://127.0.0.1:8000 --workload prefix      # against a server
    pagekv bench roofline --workload random --dtype bfloat16 --target 462  # the floor here

Owns the command's arguments; the runs live in ``offline`` and ``serve``, the workloads in
``workloads`` (shared with the scripts under benchmarks/), the table and JSON in ``report``,
the least work of a workload against this machine's peaks in ``roofline``.
The CLI wires it in with ``bench.register(subparsers)``; nothing here touches the CLI module.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from pagekv.bench.report import format_table, write_json
from pagekv.bench.workloads import Workload, load_workload
from pagekv.engine.args import add_engine_arguments, engine_config
from pagekv.sampling_params import StructuredOutputsParams

__all__ = ["BENCH_KV_CACHE_MEMORY", "register", "roofline_report"]

# The KV pool every offline comparison gives each engine (vLLM's VLLM_CPU_KVCACHE_SPACE=2).
BENCH_KV_CACHE_MEMORY = "2GiB"


def register(subparsers: Any) -> None:
    """Add the ``bench`` subcommand to an ``argparse`` subparsers object."""
    parser = subparsers.add_parser(
        "bench", help="throughput/latency on a standard workload (offline or against a server)"
    )
    parser.add_argument(
        "mode",
        nargs="?",
        default="offline",
        choices=["offline", "serve", "roofline"],
        help="offline: run the engine in this process (default); serve: an HTTP server; "
        "roofline: the fastest the workload could run on this machine (no engine)",
    )
    parser.add_argument("--workload", default="random", help="random | prefix | FILE.json")
    parser.add_argument("--json-out", default=None, help="write the result as JSON here")
    parser.add_argument(
        "--json-schema",
        default=None,
        help="offline: every request under this JSON schema (inline JSON or a file)",
    )
    add_engine_arguments(
        parser, title="offline engine", kv_cache_memory=BENCH_KV_CACHE_MEMORY, tiers=False
    )
    serve = parser.add_argument_group("serve")
    serve.add_argument("--url", default="http://127.0.0.1:8000")
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--max-concurrency", type=int, default=64)
    serve.add_argument("--api-key", default=None)
    roof = parser.add_argument_group("roofline")
    roof.add_argument("--target", type=float, default=None, help="a rate to set against the floor")
    roof.add_argument("--measured", type=float, default=None, help="a measured rate, likewise")
    parser.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> None:
    """Run the benchmark the parsed arguments describe; print the table, maybe write JSON."""
    workload = load_workload(args.workload)
    if args.mode == "roofline":
        print(roofline_report(args, workload))
        return
    if args.mode == "serve":
        from pagekv.bench.serve import ServeSettings, run_serve

        serve_settings = ServeSettings(
            url=args.url,
            model=args.served_model_name,
            max_concurrency=args.max_concurrency,
            api_key=args.api_key,
        )
        result = run_serve(workload, serve_settings)
    else:
        from pagekv.bench.offline import run_offline, warm_up
        from pagekv.engine.llm_engine import LLMEngine

        engine = LLMEngine(engine_config(args))
        warm_up(engine)
        result = run_offline(engine, workload, _schema_constraint(args.json_schema))
    print(format_table(result))
    if args.json_out:
        write_json(result, args.json_out)
        print(f"wrote {args.json_out}", file=sys.stderr)


def _schema_constraint(spec: str | None) -> StructuredOutputsParams | None:
    if spec is None:
        return None
    text = spec
    if not spec.lstrip().startswith("{"):
        with open(spec) as f:
            text = f.read()
    return StructuredOutputsParams(json=json.loads(text))


def roofline_report(args: argparse.Namespace, workload: Workload) -> str:
    """``pagekv bench roofline``: the workload's least work on the model against this machine."""
    from pagekv.bench import roofline
    from pagekv.models import read_config

    config = read_config(args.model)
    threads = args.num_threads or len(os.sched_getaffinity(0))
    work = roofline.count_work(
        config,
        workload,
        args.dtype,
        share_prefix=args.enable_prefix_caching,
        cache_bytes=roofline.last_level_cache_bytes(),
    )
    title = (
        f"roofline: {workload.name}, {args.dtype}, {config.num_hidden_layers} layers x "
        f"{config.hidden_size}, {len(workload.requests)} requests, "
        f"{workload.num_prompt_tokens} prompt + {workload.num_output_tokens} output tokens"
    )
    peaks = roofline.measure_peaks(threads)
    return roofline.format_roofline(work, peaks, args.dtype, title, args.target, args.measured)


def main(argv: list[str] | None = None) -> int:
    """``python -m pagekv.bench ...`` until the CLI registers the subcommand."""
    parser = argparse.ArgumentParser(prog="pagekv")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    args.func(args)
    return 0
