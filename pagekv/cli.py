"""The ``pagekv`` command: ``generate`` (stream one completion), ``chat`` (interactive),
``serve`` (the OpenAI-compatible HTTP server) and ``kv-map`` (a server's block map as a PNG).

Talks only to the engine (and, for ``serve``/``kv-map``, to pagekv.server, imported lazily).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagekv.bench import register as register_bench
from pagekv.engine.args import add_engine_arguments, engine_config
from pagekv.engine.config import EngineConfig
from pagekv.engine.llm_engine import LLMEngine
from pagekv.errors import InvalidRequestError, PagekvError
from pagekv.sampling_params import SamplingParams
from pagekv.server.cli_args import ServeHelpFormatter, add_serve_arguments
from pagekv.sim.cli import register as register_sim

if TYPE_CHECKING:
    from pagekv.models.chat_template import ChatTemplate

STARTUP_HEARTBEAT_S = 5.0


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


def _serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Check every flag, take the port, then load the model and serve: a bad flag or a port in
    use fails at once, not after the model has loaded."""
    from pagekv.server.cli_args import check_serve_arguments, server_config
    from pagekv.server.serve import bind

    check_serve_arguments(parser, args)
    if args.model_path is not None:
        args.model = args.model_path
    try:
        server_config(args)  # its checks, before anything is loaded
        config = engine_config(args)
    except InvalidRequestError as exc:
        flag = f"argument --{exc.param.replace('_', '-')}: " if exc.param else ""
        parser.error(f"{flag}{exc}")
    if args.chat_template is not None:
        _chat_template(args.chat_template, {})  # does it compile? (its tokens come with the model)
    _serve_logging()
    sock = bind(args.host, args.port)
    try:
        engine = _load_for_serving(config)
        try:
            _serve_engine(args, engine, sock)
        finally:
            engine.close()
    finally:
        sock.close()


def _serve_logging() -> None:
    """Lines with their level and time, as vLLM's; pagekv's at info."""
    logging.basicConfig(
        level=logging.WARNING,
        format="%(levelname)s %(asctime)s %(message)s",
        datefmt="%m-%d %H:%M:%S",
        force=True,
    )
    logging.getLogger("pagekv").setLevel(logging.INFO)


def _load_for_serving(config: EngineConfig) -> LLMEngine:
    """The engine, with a line before, one every few seconds while it loads, and one after; the
    engine's own lines between name the kernels and the KV pool."""
    logger = logging.getLogger("pagekv.server")
    model = config.model or "SmolLM2-135M-Instruct (the default)"
    logger.info("loading the model %s (dtype %s)", model, config.dtype)
    start = time.monotonic()
    done = threading.Event()

    def heartbeat() -> None:
        while not done.wait(STARTUP_HEARTBEAT_S):
            logger.info("still loading (%.0f s)", time.monotonic() - start)

    threading.Thread(target=heartbeat, name="pagekv-loading", daemon=True).start()
    try:
        engine = LLMEngine(config)
    finally:
        done.set()
    logger.info("engine ready in %.1f s", time.monotonic() - start)
    return engine


def _serve_engine(args: argparse.Namespace, engine: LLMEngine, sock: socket.socket) -> None:
    """serve's config now that the model is known (its generation config, chat template)."""
    from pagekv.server.cli_args import server_config
    from pagekv.server.generation_defaults import sampling_defaults
    from pagekv.server.serve import serve

    defaults = sampling_defaults(args.generation_config, engine.loaded.path)
    if defaults:
        logging.getLogger("pagekv.server").warning(
            "unset sampling fields default to the model's generation config (--generation-config "
            "vllm for none): %s",
            defaults,
        )
    render = None
    if args.chat_template is not None:
        render = _chat_template(args.chat_template, _special_tokens(engine)).render
    serve(engine, server_config(args, defaults), sock, render)


def _chat_template(text: str, special_tokens: dict[str, str]) -> ChatTemplate:
    from pagekv.models.chat_template import ChatTemplate

    try:
        return ChatTemplate(text, special_tokens)
    except PagekvError as exc:
        raise PagekvError(f"--chat-template: {exc}") from None


def _special_tokens(engine: LLMEngine) -> dict[str, str]:
    """What a chat template may name: the model's BOS and EOS tokens."""
    tokenizer = engine.tokenizer
    out = {}
    if tokenizer.eos_token_ids:
        out["eos_token"] = tokenizer.id_to_token(tokenizer.eos_token_ids[0])
    if tokenizer.bos_token_id is not None:
        out["bos_token"] = tokenizer.id_to_token(tokenizer.bos_token_id)
    return out


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


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``pagekv`` parser and its commands' parsers by name."""
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
    serve = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server", formatter_class=ServeHelpFormatter
    )
    add_engine_arguments(serve, prefill_step_seconds=0.5)
    add_serve_arguments(serve)  # after the engine's: a flag both know is the engine's
    serve.set_defaults(func=lambda args: _serve(args, serve))
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
    return parser, dict(sub.choices)


def main(argv: Sequence[str] | None = None) -> int:
    parser, commands = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # under the command's usage, not the top level's
        commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(level=logging.WARNING)
    try:
        args.func(args)
    except PagekvError as e:
        print(f"pagekv: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
