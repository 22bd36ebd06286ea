"""The ``pagekv`` command: ``generate`` (stream one completion), ``chat`` (interactive),
``serve`` (the OpenAI-compatible HTTP server) and ``kv-map`` (a server's block map as a PNG).

Talks only to the engine (and, for ``serve``/``kv-map``, to pagekv.server, imported lazily).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import sys
from collections.abc import Sequence

from pagekv.bench import register as register_bench
from pagekv.engine.args import add_engine_arguments, engine_config
from pagekv.engine.llm_engine import LLMEngine
from pagekv.errors import PagekvError
from pagekv.sampling_params import SamplingParams
from pagekv.sim.cli import register as register_sim


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[])
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)


def _build_engine(args: argparse.Namespace) -> LLMEngine:
    engine = LLMEngine(engine_config(args))
    print(engine.system_line, engine.capacity_line, sep="\n", file=sys.stderr)
    return engine


def _params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        stop=tuple(args.stop),
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
    )


def _stream(engine: LLMEngine, request_id: str, prompt: str, params: SamplingParams) -> str:
    """Run one request to the end, printing text as it arrives; returns the whole text."""
    engine.add_request(request_id, prompt, params)
    shown = 0
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown = len(text)
    sys.stdout.write("\n")
    return text


def _generate(args: argparse.Namespace) -> None:
    engine = _build_engine(args)
    try:
        _stream(engine, "cli-0", args.prompt, _params(args))
    finally:
        engine.close()


def _chat(args: argparse.Namespace) -> None:
    engine = _build_engine(args)
    params = _params(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("Type a message; an empty line or Ctrl-D ends the chat.", file=sys.stderr)
    for turn in itertools.count():
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        prompt = engine.tokenizer.apply_chat_template(messages)
        reply = _stream(engine, f"chat-{turn}", prompt, params)
        messages.append({"role": "assistant", "content": reply})
    engine.close()


def _serve(args: argparse.Namespace) -> None:
    from pagekv.server.clients import ClientLimits
    from pagekv.server.serve import serve
    from pagekv.server.settings import ServerConfig

    config = ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        max_request_body_bytes=args.max_request_body_bytes,
        max_waiting_requests=args.max_waiting_requests,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        keep_alive_timeout_s=args.keep_alive_timeout,
        stream_stall_timeout_s=args.stream_stall_timeout,
        client_limits=ClientLimits(
            args.client_max_requests, args.client_max_prompt_tokens, args.client_max_output_tokens
        ),
        metrics_require_key=args.metrics_require_key,
    )
    if args.model_path is not None:
        args.model = args.model_path
    serve(_build_engine(args), config)  # the engine config's trace is serve's --trace


def _serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_path", nargs="?", default=None, metavar="MODEL")
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    g.add_argument("--served-model-name", default=None)
    g.add_argument(
        "--trace",
        default=None,
        metavar="FILE",
        help="record each request's arrival, lengths and prefix-block hashes (no text) for "
        "`pagekv sim --trace FILE`",
    )
    g.add_argument("--max-request-body-bytes", type=int, default=1 << 20)
    g.add_argument(
        "--max-waiting-requests",
        type=int,
        default=1024,
        help="answer 429 while this many requests wait for a batch slot",
    )
    g.add_argument(
        "--metrics-require-key",
        action="store_true",
        help="/metrics needs the API key too (/debug always does when one is set)",
    )
    t = parser.add_argument_group("timeouts (seconds)")
    t.add_argument("--header-timeout", type=float, default=10.0, help="request headers complete")
    t.add_argument("--body-timeout", type=float, default=30.0, help="body complete (else 408)")
    t.add_argument("--keep-alive-timeout", type=float, default=5.0, help="idle connection")
    t.add_argument(
        "--stream-stall-timeout",
        type=float,
        default=30.0,
        help="abort a stream whose client reads nothing for this long",
    )
    c = parser.add_argument_group("per client (by address), in flight; past them: 429")
    c.add_argument("--client-max-requests", type=int, default=256)
    c.add_argument("--client-max-prompt-tokens", type=int, default=1 << 20)
    c.add_argument(
        "--client-max-output-tokens",
        type=int,
        default=1 << 19,
        help="prompts x n x max_tokens of a client's requests",
    )


def _kv_map(args: argparse.Namespace) -> None:
    import json
    import urllib.request

    from pagekv.server.kv_png import render_block_map

    url = args.url.rstrip("/") + "/debug/kv.json"
    key = args.api_key or os.environ.get("PAGEKV_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        request = urllib.request.Request(url, headers=headers)
        with urllib.request.urlopen(request, timeout=args.timeout) as response:
            data = json.load(response)
    except (OSError, ValueError) as exc:  # unreachable, HTTP error, or not JSON
        raise PagekvError(f"cannot read the block map at {url}: {exc}") from exc
    with open(args.out, "wb") as f:
        f.write(render_block_map(data))
    states = [b["state"] for b in data["blocks"]]
    print(
        f"{args.out}: {len(states)} blocks, {states.count('in_use')} in use, "
        f"{states.count('evictable')} evictable, {states.count('free')} free"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagekv", description="PagedAttention inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt, streaming to the terminal")
    gen.add_argument("prompt")
    gen.set_defaults(func=_generate)
    chat = sub.add_parser("chat", help="interactive chat with the model's chat template")
    chat.add_argument("--system", default=None)
    chat.set_defaults(func=_chat)
    for p in (gen, chat):
        add_engine_arguments(p)
        _sampling_args(p)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _serve_args(serve)
    add_engine_arguments(serve)
    serve.set_defaults(func=_serve)
    kv_map = sub.add_parser("kv-map", help="save a running server's KV block map as a PNG")
    kv_map.add_argument("--url", default="http://127.0.0.1:8000")
    kv_map.add_argument("--out", default="kv_map.png")
    kv_map.add_argument("--timeout", type=float, default=10.0)
    kv_map.add_argument(
        "--api-key", default=None, help="the server's API key (default: $PAGEKV_API_KEY)"
    )
    kv_map.set_defaults(func=_kv_map)
    register_bench(sub)
    register_sim(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        args.func(args)
    except PagekvError as e:
        print(f"pagekv: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
