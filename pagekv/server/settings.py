"""Server settings: one frozen dataclass, validated once. Engine settings live in EngineConfig."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagekv.errors import InvalidRequestError
from pagekv.server.clients import ClientLimits

MIB = 1 << 20


@dataclass(frozen=True)
class ServerConfig:
    """How the HTTP server listens and what it accepts.

    ``max_waiting_requests``: when the engine already has this many requests waiting for a
    batch slot, new ones get 429 instead of queueing without bound. ``max_n``: the largest
    ``n`` (choices per prompt) accepted, as in OpenAI's API; ``max_choices``: the most
    sequences one request may start (prompts x n).

    Timeouts (seconds): a connection's request headers must be complete ``header_timeout_s``
    after it opens (or after its previous response), its body ``body_timeout_s`` after the
    headers (408); an idle kept-alive connection closes after ``keep_alive_timeout_s``; a
    stream whose client takes nothing for ``stream_stall_timeout_s`` is aborted and its
    blocks freed. ``client_limits``: what one client (by address) may have in flight (429).
    ``metrics_require_key``: /metrics, like /debug, needs the API key (when one is set).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None  # None: the model file's name
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
