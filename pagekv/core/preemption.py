"""How a preempted request gives its blocks back: recompute or swap, and the cost model of ``auto``.

Owns nothing but frozen constants and, in ``RateLimitedLog``, the time of the last log line.
The scheduler picks the victim (see ``policy.py``) and asks ``PreemptionCostModel`` how to evict
it. Must not import torch.

    recompute   free the victim's blocks (full ones stay in the prefix cache as evictable);
                it waits again and its computed tokens are prefilled anew on resumption
    swap        copy its blocks to the host pool and back before it decodes again
    auto        per victim, whichever the cost model says is cheaper:

                    recompute_s = computed tokens * recompute_s_per_token
                    swap_s      = 2 * (swap_s_fixed + blocks * swap_s_per_block)  (out and in)

Recompute is the fallback whenever a swap cannot happen (no host pool, or it is full): a request
is never aborted for lack of swap space.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from pagekv.errors import InvalidRequestError


class PreemptionMode(Enum):
    RECOMPUTE = "recompute"
    SWAP = "swap"
    AUTO = "auto"  # per victim, by PreemptionCostModel


@dataclass(frozen=True)
class PreemptionCostModel:
    """Estimated seconds to recompute a victim's tokens vs to swap its blocks out and back.

    The defaults are ``benchmarks/bench_swap_cost.py``'s fit on a 2-core CPU (one thread,
    SmolLM2-135M-Instruct in float32, 16-token blocks; the fit is in benchmarks/RESULTS.md):
    prefill cost per extra token, and a device->host transfer's cost per block and per call.
    On a CPU both
    pools are host memory, so swapping wins for every victim with at least one computed token;
    on a GPU (PCIe transfers, fast prefill) rerun the script and pass the result in
    ``EngineConfig(preemption_cost=...)``.
    """

    recompute_s_per_token: float = 2.88e-3
    swap_s_per_block: float = 2.86e-4
    swap_s_fixed: float = 6.57e-4

    def __post_init__(self) -> None:
        for name in ("recompute_s_per_token", "swap_s_per_block", "swap_s_fixed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise InvalidRequestError(f"{name} must be a number >= 0, got {value!r}", name)

    def recompute_s(self, num_tokens: int) -> float:
        return num_tokens * self.recompute_s_per_token

    def swap_s(self, num_blocks: int) -> float:
        """A round trip: out now, back in before the request decodes again."""
        return 2 * (self.swap_s_fixed + num_blocks * self.swap_s_per_block)

    def prefers_swap(self, num_computed_tokens: int, num_blocks: int) -> bool:
        return self.swap_s(num_blocks) < self.recompute_s(num_computed_tokens)


class RateLimitedLog:
    """At most one line per ``interval_s``; the next line emitted says how many were dropped.

    Owns the time of the last emitted line and the count suppressed since. ``clock`` is
    injectable so tests run on a virtual clock.
    """

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.clock = clock
        self._last_s: float | None = None
        self.num_suppressed = 0

    def warning(self, message: str, *args: object) -> bool:
        """Log ``message % args`` unless a line went out less than ``interval_s`` ago."""
        now = self.clock()
        if self._last_s is not None and now - self._last_s < self.interval_s:
            self.num_suppressed += 1
            return False
        if self.num_suppressed and self._last_s is not None:
            message += " (%d similar messages suppressed in the last %.0f s)"
            args = (*args, self.num_suppressed, now - self._last_s)
        self.logger.warning(message, *args)
        self._last_s = now
        self.num_suppressed = 0
        return True
