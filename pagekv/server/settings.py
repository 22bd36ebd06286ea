"""Server settings: one frozen dataclass, validated once. Engine settings live in EngineConfig."""

from __future__ import annotations

from dataclasses import dataclass

from pagekv.errors import InvalidRequestError

MIB = 1 << 20


@dataclass(frozen=True)
class ServerConfig:
    """How the HTTP server listens and what it accepts.

    ``max_waiting_requests``: when the engine already has this many requests waiting for a
    batch slot, new ones get 429 instead of queueing without bound. ``max_n``: the largest
    ``n`` (choices per prompt) accepted, as in OpenAI's API; ``max_choices``: the most
    sequences one request may start (prompts x n).
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

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise InvalidRequestError(f"port must be in [0, 65535], got {self.port}", "port")
        for name in ("max_request_body_bytes", "max_waiting_requests", "max_n", "max_choices"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be >= 1", name)
        if self.api_key is not None and not self.api_key:
            raise InvalidRequestError("api_key must not be empty", "api_key")
