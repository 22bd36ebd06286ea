"""What one engine step must do: the scheduler's decision, handed to the runner as plain data.

Owns nothing; frozen records. Must not import torch. Blocks cross from core to runner only as
integer ids inside these records.

Block transfers are applied before the forward pass, in this order (0 and 1 by the engine's
tier manager, the rest by the runner)::

    0. saves     (device or host -> storage) snapshot blocks to write to the storage tier; they
                 read blocks this same plan may already have given to someone else (a block
                 written back as it is evicted), so they run before anything writes
    1. loads     (storage -> host)  K/V prefetched from storage, verified, into new host blocks
    2. swap_out  (device -> host)   swapped requests' blocks and offloads to the host cache;
                                    like saves, they read blocks that may have been handed out
    3. swap_in   (host -> device)   swapped requests coming back and host-cache hits; the host
                                    sources are pinned until the plan is taken, so no swap-out
                                    of this step can overwrite them
    4. copies    (device -> device) copy-on-write; a source may itself be a block swapped in at
                                    step 3, and is pinned until the plan is taken
    5. forward   writes the new tokens' K/V into their slots, never into a shared block
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagekv.core.block_pool import BlockHash
from pagekv.core.request import Request

BlockPair = tuple[int, int]


@dataclass(frozen=True, slots=True)
class StorageWrite:
    """Write one block's K/V to the storage tier under its prefix hash."""

    block_id: int
    on_host: bool  # block_id names a host block (else a device block)
    block_hash: BlockHash


@dataclass(frozen=True)
class BlockTransfers:
    """Block moves to apply before the forward, in field order (see the module docstring)."""

    saves: tuple[StorageWrite, ...] = ()
    loads: tuple[tuple[BlockHash, int], ...] = ()  # (prefix hash, host block) from storage
    swap_out: tuple[BlockPair, ...] = ()  # (device block, host block), offloads included
    swap_in: tuple[BlockPair, ...] = ()  # (host block, device block), host-cache hits included
    copies: tuple[BlockPair, ...] = ()  # (source device block, destination device block)

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads or self.swap_out or self.swap_in or self.copies)


@dataclass(slots=True)  # not frozen: one per request every step; frozen ones cost more
class ScheduledRequest:
    """One request's share of a step: feed ``num_tokens`` tokens from ``start_position``.

    ``block_table`` is the manager's live list for the request; read it, never change it. It
    covers at least ``start_position + num_tokens`` tokens when the plan is made.

    A drafted decode (speculation.py) feeds its last token and then ``draft_token_ids``, which
    are not (yet) the request's tokens: ``num_tokens = 1 + len(draft_token_ids)``, and the
    model's choice at every one of those positions comes back.
    """

    request: Request
    start_position: int
    num_tokens: int
    block_table: list[int]
    draft_token_ids: tuple[int, ...] = ()

    @property
    def end_position(self) -> int:
        """One past the last position fed this step."""
        return self.start_position + self.num_tokens

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the known tokens, so a new token is sampled."""
        end = self.start_position + self.num_tokens - len(self.draft_token_ids)
        return end == self.request.num_tokens

    @property
    def token_ids(self) -> list[int]:
        """The tokens fed: the request's from ``start_position``, then any drafts."""
        if self.draft_token_ids:
            return self.request.all_token_ids[self.start_position :] + list(self.draft_token_ids)
        end = self.start_position + self.num_tokens
        return self.request.all_token_ids[self.start_position : end]


@dataclass(frozen=True)
class Plan:
    """The whole step: who runs, which blocks move, and what the scheduler did to make room."""

    step: int
    scheduled: tuple[ScheduledRequest, ...]
    transfers: BlockTransfers
    preempted: tuple[str, ...] = ()
    rejected: tuple[str, ...] = field(default=())

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.transfers
