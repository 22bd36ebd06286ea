"""Policies of the KV tiers below the device pool: when blocks are written down, when to wait.

Owns nothing but frozen constants. The KV cache manager applies ``WritePolicy`` as blocks are
committed, hit and evicted; the scheduler asks ``LoadCostModel`` whether a request should wait for
its prefix to arrive from storage or start recomputing now. Must not import torch.

Write policies (device -> host, and host -> storage alike)::

    write_through            a block is copied down as soon as it is committed (full and
                             computed): every tier holds everything; most copies
    write_through_selective  copied down at its second hit: only prefixes that recur pay
    write_back               copied down only when evicted from the tier above: fewest copies,
                             but a block lives in one tier at a time until evicted

The note behind pagekv: "having remote KV does not mean we must wait for it". A request whose
prefix is in storage waits for the prefetch only if loading is estimated cheaper than
recomputing, and never longer than recomputing would have taken (nor than the timeout)::

    load_s      = load_s_fixed + blocks * load_s_per_block      (measured at start-up)
    recompute_s = tokens * recompute_s_per_token
    wait if load_s < recompute_s, for at most min(recompute_s, timeout_s)
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from pagekv.errors import InvalidRequestError


class WritePolicy(Enum):
    WRITE_THROUGH = "write_through"
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    WRITE_BACK = "write_back"

    @classmethod
    def parse(cls, value: WritePolicy | str) -> WritePolicy:
        if isinstance(value, WritePolicy):
            return value
        names = [p.value for p in cls]
        if value not in names:
            raise InvalidRequestError(
                f"cache_write_policy must be one of {names}, got {value!r}", "cache_write_policy"
            )
        return cls(value)


@dataclass(frozen=True)
class LoadCostModel:
    """Seconds to fetch blocks from storage vs to recompute their tokens."""

    load_s_fixed: float = 2e-3
    load_s_per_block: float = 1e-3
    recompute_s_per_token: float = 2.88e-3
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("load_s_fixed", "load_s_per_block", "recompute_s_per_token", "timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise InvalidRequestError(f"{name} must be a number >= 0, got {value!r}", name)

    def load_s(self, num_blocks: int) -> float:
        return self.load_s_fixed + num_blocks * self.load_s_per_block

    def recompute_s(self, num_tokens: int) -> float:
        return num_tokens * self.recompute_s_per_token

    def prefers_load(self, num_blocks: int, block_size: int) -> bool:
        return self.load_s(num_blocks) < self.recompute_s(num_blocks * block_size)

    def max_wait_s(self, num_blocks: int, block_size: int) -> float:
        """Waiting longer than recomputing would take cannot pay off."""
        return min(self.recompute_s(num_blocks * block_size), self.timeout_s)


@dataclass
class TierCounters:
    """The host tier's monotonic counters, kept by the KV cache manager; flat ints only."""

    host_hit_blocks: int = 0  # prefix blocks found in the host cache and copied in
    offloaded_blocks: int = 0  # device -> host cache copies (by the write policy)
    storage_writes: int = 0  # blocks handed to the storage tier to write (before dedupe)
    storage_loaded_blocks: int = 0  # prefetched blocks placed into host blocks
    host_verify_failures: int = 0  # host blocks that failed verification: dropped, recomputed
    host_full_skips: int = 0  # offloads or loads skipped: every host block was in use
