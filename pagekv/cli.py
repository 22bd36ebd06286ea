"""The ``pagekv`` command: ``generate`` (stream one completion) and ``chat`` (interactive).

Talks only to the engine.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import sys
from collections.abc import Sequence

from pagekv.config import EngineConfig
from pagekv.engine import LLMEngine
from pagekv.errors import PagekvError
from pagekv.sampling_params import SamplingParams


def _engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M)"
    )
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory", default="1GiB")
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[])


def _build_engine(args: argparse.Namespace) -> LLMEngine:
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    engine = LLMEngine(config)
    print(engine.capacity_line, file=sys.stderr)
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
    _stream(engine, "cli-0", args.prompt, _params(args))


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
        _engine_args(p)
        _sampling_args(p)
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
