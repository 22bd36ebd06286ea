"""``pagekv serve``'s own flags, named, typed and defaulted as ``vllm serve``'s, and the
``ServerConfig`` they make. The engine's flags come from ``pagekv.engine.args``.

Owns the mapping from flags to ``ServerConfig``. A value that cannot be honoured is refused by
argparse under serve's usage, naming the flag, before the model loads (a missing TLS file, a
chat template path that does not exist, a tool-call parser this server does not have); a
value that changes nothing here is accepted. Imports nothing heavy: the parser is built for
every ``pagekv`` command.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from typing import Any

from pagekv.server.clients import ClientLimits
from pagekv.server.settings import (
    TOOL_CALL_PARSERS,
    UVICORN_LOG_LEVELS,
    CorsSettings,
    LogSettings,
    ServerConfig,
)

JINJA_CHARS = "{}\n"  # a --chat-template holding one of these is the template itself


class ServeHelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already speaks of it."""

    def _format_action(self, action: argparse.Action) -> str:
        said = "default" in (action.help or "").lower()
        if action.option_strings and action.default is not argparse.SUPPRESS and not said:
            action = copy.copy(action)
            action.help = f"{action.help or ''} (default: %(default)s)".strip()
        return super()._format_action(action)


def chat_template_text(value: str) -> str:
    """``--chat-template``: a file's text, or the value itself when it holds Jinja (``{``,
    ``}`` or a newline), as vLLM reads it; a path that does not exist is refused."""
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        if any(c in value for c in JINJA_CHARS):
            return value
        raise argparse.ArgumentTypeError(
            f"{value!r} looks like a file path, but cannot be read ({exc.strerror})"
        ) from None


def readable_file(value: str) -> str:
    if not os.path.isfile(value) or not os.access(value, os.R_OK):
        raise argparse.ArgumentTypeError(f"{value!r} is not a readable file")
    return value


def string_list(value: str) -> list[str]:
    """vLLM's CORS lists: a JSON list of strings (``'["http://a", "http://b"]'``); a bare
    string is taken as a list of one."""
    try:
        parsed: Any = json.loads(value)
    except ValueError:
        parsed = value
    if isinstance(parsed, str):
        return [parsed]
    if isinstance(parsed, list) and all(isinstance(item, str) for item in parsed):
        return parsed
    raise argparse.ArgumentTypeError(f"{value!r}: a JSON list of strings, or one string")


def generation_config(value: str) -> str:
    if value in ("auto", "vllm") or os.path.isfile(os.path.join(value, "generation_config.json")):
        return value
    raise argparse.ArgumentTypeError(
        f"{value!r}: auto, vllm, or a folder holding a generation_config.json"
    )


def tool_call_parser(value: str) -> str:
    if value in TOOL_CALL_PARSERS:
        return value
    raise argparse.ArgumentTypeError(
        f"{value!r} is not available here; tool calls are parsed in the hermes form "
        f"(<tool_call>{{...}}</tool_call>): one of {', '.join(TOOL_CALL_PARSERS)}"
    )


def _add(
    group: argparse._ArgumentGroup, parser: argparse.ArgumentParser, *names: str, **kw: Any
) -> None:
    """Add an option unless the parser already has it (the engine's flags may define it)."""
    if not any(name in parser._option_string_actions for name in names):
        group.add_argument(*names, **kw)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """serve's flags: listening, logging, TLS and CORS, the OpenAI API, and client limits."""
    parser.add_argument("model_path", nargs="?", default=None, metavar="MODEL")
    _listening_args(parser)
    _logging_args(parser)
    _api_args(parser)
    _limit_args(parser)


def _listening_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the names requests may give as model; the first is reported (default: the "
        "model file's name)",
    )
    g.add_argument("--root-path", default=None, help="the path prefix a proxy serves us under")
    g.add_argument("--ssl-keyfile", type=readable_file, default=None)
    g.add_argument("--ssl-certfile", type=readable_file, default=None, help="serve HTTPS")
    _add(g, parser, "--seed", type=int, default=0, help="seeds the draws of unseeded requests")
    c = parser.add_argument_group("CORS (browsers on other origins; off without origins)")
    c.add_argument("--allowed-origins", type=string_list, default=[], help="e.g. '[\"*\"]'")
    c.add_argument("--allowed-methods", type=string_list, default=["*"])
    c.add_argument("--allowed-headers", type=string_list, default=["*"])
    c.add_argument("--allow-credentials", action="store_true")


def _logging_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("logging")
    g.add_argument(
        "--enable-log-requests",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="log each engine request's id and parameters",
    )
    g.add_argument(
        "--disable-log-requests", dest="enable_log_requests", action="store_false",
        help="vLLM's older spelling of --no-enable-log-requests (the default)",
    )  # fmt: skip
    g.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="no stats line every 10 s while there is work (throughput, queues, KV cache)",
    )
    g.add_argument("--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS)
    g.add_argument(
        "--disable-uvicorn-access-log",
        action="store_true",
        help="no line per response (status, path, time)",
    )
    g.add_argument(
        "--trace",
        default=None,
        metavar="FILE",
        help="record each request's arrival, lengths and prefix-block hashes (no text) for "
        "`pagekv sim --trace FILE`",
    )
    g.add_argument(
        "--metrics-require-key",
        action="store_true",
        help="/metrics needs the API key too (/debug always does when one is set)",
    )


def _api_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("OpenAI API")
    g.add_argument(
        "--chat-template",
        type=chat_template_text,
        default=None,
        help="a Jinja file, or the template itself (default: the model's)",
    )
    g.add_argument(
        "--generation-config",
        type=generation_config,
        default="auto",
        help="defaults for unset sampling fields: auto (the model's generation_config.json; "
        "default), vllm (none), or a folder holding one",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted: tool_choice auto always parses the model's tagged calls here",
    )
    g.add_argument("--tool-call-parser", type=tool_call_parser, default=None, metavar="hermes")
    g.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="logprobs name tokens as 'token_id:N' (a request may ask for it too)",
    )


def _limit_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("limits")
    g.add_argument("--max-request-body-bytes", type=int, default=1 << 20)
    g.add_argument(
        "--max-waiting-requests",
        type=int,
        default=1024,
        help="answer 429 while this many requests wait for a batch slot",
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


def check_serve_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What one flag alone cannot tell: refused under serve's usage."""
    if args.ssl_keyfile is not None and args.ssl_certfile is None:
        parser.error("--ssl-keyfile needs --ssl-certfile")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser (hermes)")


def server_config(
    args: argparse.Namespace, sampling_defaults: dict[str, float] | None = None
) -> ServerConfig:
    """The ``ServerConfig`` of serve's parsed flags (``InvalidRequestError`` naming a field)."""
    return ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_names=tuple(args.served_model_name or ()),
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
        root_path=args.root_path or "",
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        cors=CorsSettings(
            tuple(args.allowed_origins),
            tuple(args.allowed_methods),
            tuple(args.allowed_headers),
            args.allow_credentials,
        ),
        logs=LogSettings(
            uvicorn_log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
            log_requests=args.enable_log_requests,
            log_stats=not args.disable_log_stats,
        ),
        sampling_defaults=tuple(sorted((sampling_defaults or {}).items())),
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        tool_call_parser=args.tool_call_parser,
    )
