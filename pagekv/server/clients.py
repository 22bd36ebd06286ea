"""Per-client limits: what one client may have in flight at once, and the ledger that counts it.

A client is the address a connection comes from. While a request is in flight (from its
admission until its response or stream ends), it counts against its client: one request, its
prompts' tokens, and its output allowance (prompts x n x max_tokens, what it may make the
engine generate). A request that would take its client past a limit is refused with 429
before it reaches the engine; the client's other requests are untouched.

Owns the counts per client; used only on the event loop's thread (no locks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

from pagekv.errors import InvalidRequestError
from pagekv.server.errors import ClientLimitError


@dataclass(frozen=True)
class Usage:
    """What one request holds while in flight."""

    requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0  # prompts x n x max_tokens

    def __add__(self, other: Usage) -> Usage:
        return Usage(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def __sub__(self, other: Usage) -> Usage:
        return Usage(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))


@dataclass(frozen=True)
class ClientLimits:
    """The most one client may hold in flight (``Usage`` fields): requests, prompt tokens, and
    output allowance."""

    max_requests: int = 256
    max_prompt_tokens: int = 1 << 20
    max_output_tokens: int = 1 << 19

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidRequestError(f"{f.name} must be an integer >= 1", f.name)

    def excess(self, usage: Usage) -> str | None:
        """The first limit ``usage`` is over, as a message; None within every limit."""
        for name, limit in (
            ("requests", self.max_requests),
            ("prompt_tokens", self.max_prompt_tokens),
            ("output_tokens", self.max_output_tokens),
        ):
            if getattr(usage, name) > limit:
                return f"{name.replace('_', ' ')} in flight would be {getattr(usage, name)}"
        return None


class ClientLedger:
    """Each client's ``Usage`` in flight; a client with nothing in flight has no entry."""

    def __init__(self, limits: ClientLimits) -> None:
        self.limits = limits
        self._usage: dict[str, Usage] = {}

    def admit(self, client: str, usage: Usage) -> Callable[[], None]:
        """Count ``usage`` against ``client``, or raise ClientLimitError (nothing counted).
        Returns the release, which may be called more than once (only the first counts)."""
        held = self._usage.get(client, Usage())
        excess = self.limits.excess(held + usage)
        if excess is not None:
            raise ClientLimitError(
                f"this client's limit is reached ({excess}; limits: {self.limits}); retry "
                "when its requests in flight finish"
            )
        self._usage[client] = held + usage
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            left = self._usage[client] - usage
            if left == Usage():
                del self._usage[client]
            else:
                self._usage[client] = left

        return release

    def usage(self, client: str) -> Usage:
        return self._usage.get(client, Usage())

    def __len__(self) -> int:
        return len(self._usage)
