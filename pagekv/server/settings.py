"""Server settings: one frozen dataclass, validated once. Engine settings live in EngineConfig."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagekv.errors import InvalidRequestError
from pagekv.server.clients import ClientLimits

MIB = 1 << 20
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
TOOL_CALL_PARSERS = ("hermes",)  # the tagged form tools.py parses: <tool_call>{...}</tool_call>


@dataclass(frozen=True)
class CorsSettings:
    """Cross-origin access for browsers (Starlette's ``CORSMiddleware``); no origins: off."""

    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


@dataclass(frozen=True)
class LogSettings:
    """What the server logs. ``access_log``: a line per response at info (status, path, time);
    ``log_requests``: vLLM's line per engine request (its id and parameters); ``log_stats``: a
    line every ``stats_interval_s`` while the engine has work (throughput, queues, KV use)."""

    uvicorn_log_level: str = "info"
    access_log: bool = True
    log_requests: bool = False
    log_stats: bool = True
    stats_interval_s: float = 10.0

    def __post_init__(self) -> None:
        if self.uvicorn_log_level not in UVICORN_LOG_LEVELS:
            raise InvalidRequestError(
                f"uvicorn_log_level must be one of {UVICORN_LOG_LEVELS}", "uvicorn_log_level"
            )
        if not (math.isfinite(self.stats_interval_s) and self.stats_interval_s > 0):
            raise InvalidRequestError("stats_interval_s must be > 0", "stats_interval_s")


@dataclass(frozen=True)
class ServerConfig:
    """How the HTTP server listens and what it accepts.

    ``served_model_names``: the names a request's ``model`` may give; the first is the one
    reported (none: the model file's name). ``max_waiting_requests``: when the engine already
    has this many requests waiting for a batch slot, new ones get 429 instead of queueing
    without bound. ``max_n``: the largest ``n`` (choices per prompt) accepted, as in OpenAI's
    API; ``max_choices``: the most sequences one request may start (prompts x n).

    Timeouts (seconds): a connection's request headers must be complete ``header_timeout_s``
    after it opens (or after its previous response), its body ``body_timeout_s`` after the
    headers (408); an idle kept-alive connection closes after ``keep_alive_timeout_s``; a
    stream whose client takes nothing for ``stream_stall_timeout_s`` is aborted and its
    blocks freed. ``client_limits``: what one client (by address) may have in flight (429).
    ``metrics_require_key``: /metrics, like /debug, needs the API key (when one is set).

    vLLM's: ``root_path`` (the prefix a proxy serves the app under), ``ssl_keyfile`` and
    ``ssl_certfile`` (TLS), ``cors``, ``sampling_defaults`` (what unset sampling fields
    take: the model's generation_config, ``generation_defaults.py``),
    ``return_tokens_as_token_ids`` (the default of the request field), ``tool_call_parser``.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_names: tuple[str, ...] = ()
    max_request_body_bytes: int = MIB
    max_waiting_requests: int = 1024
    max_n: int = 128
    max_choices: int = 256  # prompts x n in one completions request
    graceful_shutdown_s: float = 5.0
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 5.0
    stream_stall_timeout_s: float = 30.0
    client_limits: ClientLimits = field(default_factory=ClientLimits)
    metrics_require_key: bool = False
    root_path: str = ""
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    cors: CorsSettings = field(default_factory=CorsSettings)
    logs: LogSettings = field(default_factory=LogSettings)
    sampling_defaults: tuple[tuple[str, float], ...] = ()
    return_tokens_as_token_ids: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise InvalidRequestError(f"port must be in [0, 65535], got {self.port}", "port")
        for name in ("max_request_body_bytes", "max_waiting_requests", "max_n", "max_choices"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be >= 1", name)
        for name in (
            "header_timeout_s",
            "body_timeout_s",
            "keep_alive_timeout_s",
            "stream_stall_timeout_s",
        ):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise InvalidRequestError(f"{name} must be a number > 0, got {value!r}", name)
        if self.api_key is not None and not self.api_key:
            raise InvalidRequestError("api_key must not be empty", "api_key")
        if any(not name for name in self.served_model_names):
            raise InvalidRequestError("served_model_name must not be empty", "served_model_name")
        if self.root_path and (not self.root_path.startswith("/") or self.root_path == "/"):
            raise InvalidRequestError(
                f"root_path must start with '/' and name a prefix, got {self.root_path!r}",
                "root_path",
            )
        if self.ssl_keyfile is not None and self.ssl_certfile is None:
            raise InvalidRequestError("ssl_keyfile needs ssl_certfile", "ssl_certfile")
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise InvalidRequestError(
                f"tool_call_parser {self.tool_call_parser!r} is not available here; tool calls "
                f"are parsed in the form of: {', '.join(TOOL_CALL_PARSERS)} "
                "(<tool_call>{...}</tool_call>)",
                "tool_call_parser",
            )

    @property
    def use_tls(self) -> bool:
        return self.ssl_certfile is not None
