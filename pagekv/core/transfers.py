"""The block transfers pending for the next plan, and the pins that keep their sources alive.

Owns: the pins (device and host) that keep transfer sources alive and unwritten until the plan
is taken, the pending swap-outs and swap-ins, the pending copy-on-write copies, and the twins
(a device block and a host block known to hold the same K/V, so a block shared by two swapped
requests moves once). Moves are keyed by destination, so releasing a destination cancels its
move: every release of the manager's blocks goes through ``release`` for that reason. The KV
cache manager decides what moves (swap, copy-on-write, host hits); the ``TierState`` queues its
offloads here through the manager (``HostFills``), and ``take`` hands its saves and loads out
with these. The ``BlockPool``s own the reference counts. Must not import torch.

Twins survive while both sides stay unwritten and referenced::

    swap_out(a):  device 3 -> host 7 (a move)     twins 3 <-> 7
    swap_out(b):  b shares device 3               host 7 gains a reference, nothing moves
    append_slots writes into 3, or 3 or 7 is freed: the twin is broken
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from pagekv.core.block_pool import BlockPool
from pagekv.core.plan import BlockTransfers
from pagekv.core.tier_state import TierState


class PendingTransfers:
    """One step's transfers (in apply order, by destination) and their sources' pins."""

    def __init__(self, pool: BlockPool, host_pool: BlockPool | None, tiers: TierState) -> None:
        self.pool = pool
        self.host_pool = host_pool
        self._tiers = tiers
        self.pins: Counter[int] = Counter()  # device transfer sources, until taken
        self.host_pins: Counter[int] = Counter()
        # Pending transfers, keyed by destination so releasing a destination cancels its move:
        self.swap_out: dict[int, int] = {}  # host block <- device block
        self.swap_in: dict[int, int] = {}  # device block <- host block (source pinned)
        # Pending copy-on-write copies, destination -> source, in the order they were made.
        self.copies: dict[int, int] = {}
        # Twins, both ways. Broken when either side is written or released.
        self.host_twin: dict[int, int] = {}  # device block -> host block
        self.device_twin: dict[int, int] = {}  # host block -> device block

    # ---- queries --------------------------------------------------------------------------------

    def is_incoming(self, block_id: int) -> bool:
        """Whether a device block's K/V arrives with a copy or swap-in not yet applied."""
        return block_id in self.copies or block_id in self.swap_in

    def num_moves(self, blocks: Sequence[int], to_host: bool) -> int:
        """How many of ``blocks`` a swap must move (those without a live twin)."""
        twin = self.host_twin if to_host else self.device_twin
        return sum(1 for b in blocks if b not in twin)

    def swap_out_source(self, host_block: int) -> int | None:
        """The device block a pending swap-out copies into ``host_block``, if one does."""
        return self.swap_out.get(host_block)

    # ---- queueing -------------------------------------------------------------------------------

    def copy(self, shared: int) -> int:
        """Copy-on-write: a fresh device block that gets ``shared``'s K/V, which it replaces in
        a table (whose reference to ``shared`` is released here)."""
        # A block that is itself the destination of a pending copy holds nothing yet: copy
        # from that copy's (pinned) source, since copies of one plan apply all at once.
        src = self.copies.get(shared, shared)
        dst = self.pool.allocate_one()
        self.pins[src] += 1  # src stays alive (and unwritten) until the copy is taken
        self.pool.touch([src])
        self.release(self.pool, [shared])  # the table's reference moves to dst
        self.copies[dst] = src
        return dst

    def queue_swap_in(self, device_block: int, host_block: int) -> None:
        """A host prefix hit: ``host_block`` (pinned by ``pin_host``) fills ``device_block``."""
        self.swap_in[device_block] = host_block

    def queue_offload(self, device_block: int, host_block: int) -> None:
        """Copy ``device_block`` into ``host_block`` with the next plan's swap-outs."""
        self.swap_out[host_block] = device_block

    def move(self, blocks: Sequence[int], to_host: bool) -> list[int]:
        """Map each block to the other pool: its live twin, or a new block plus a move.

        A swap-in's host source is pinned until the plan is taken, so no swap-out of the same
        step can overwrite it. (A swap-out's device source needs no pin: swap-outs run first.)
        """
        dst_pool = self.host_pool if to_host else self.pool
        assert dst_pool is not None
        twin, back, moves = (
            (self.host_twin, self.device_twin, self.swap_out)
            if to_host
            else (self.device_twin, self.host_twin, self.swap_in)
        )
        out: list[int] = []
        for block_id in blocks:
            target = twin.get(block_id)
            if target is None:
                target = dst_pool.allocate_one()
                twin[block_id] = target
                back[target] = block_id
                if to_host:
                    # A pending copy's destination is not written yet: move from its source.
                    moves[target] = self.copies.get(block_id, block_id)
                else:
                    moves[target] = block_id
                    self.pin_host(block_id)
            else:
                dst_pool.touch([target])
            out.append(target)
        return out

    def break_twin(self, block_id: int, host: bool = False) -> None:
        """Forget the twin of a device block (or, with ``host``, of a host block)."""
        twin, back = (
            (self.device_twin, self.host_twin) if host else (self.host_twin, self.device_twin)
        )
        other = twin.pop(block_id, None)
        if other is not None:
            back.pop(other, None)

    # ---- pins and releases ----------------------------------------------------------------------

    def pin_host(self, block_id: int) -> None:
        assert self.host_pool is not None
        self.host_pins[block_id] += 1
        self.host_pool.touch([block_id])

    def pin_fill(self, host_block: int) -> None:
        """Keep a new host block's allocation reference as a pin until the plan is taken."""
        self.host_pins[host_block] += 1

    def release(self, pool: BlockPool, blocks: Sequence[int]) -> None:
        """Free blocks. A block reaching ref 0 loses its twin, and any pending transfer into it
        is cancelled: nobody will read it, and it may be handed out again this very step."""
        pool.free(blocks)
        loads = self._tiers.pending_loads
        if not (self.host_twin or self.copies or self.swap_in or self.swap_out or loads):
            return
        is_host = pool is self.host_pool
        for block_id in blocks:
            if pool._ref[block_id] != 0:
                continue
            self.break_twin(block_id, host=is_host)
            if is_host:
                self.swap_out.pop(block_id, None)
                self._tiers.on_host_release(block_id)
            elif block_id in self.copies:
                self._unpin(self.pool, self.pins, self.copies.pop(block_id))
            elif block_id in self.swap_in:
                self._unpin(self.host_pool, self.host_pins, self.swap_in.pop(block_id))

    def _unpin(self, pool: BlockPool | None, pins: Counter[int], block_id: int) -> None:
        assert pool is not None
        pins[block_id] -= 1
        if pins[block_id] == 0:
            del pins[block_id]
        self.release(pool, [block_id])

    # ---- hand-off -------------------------------------------------------------------------------

    def take(self) -> BlockTransfers:
        """Hand out the pending transfers (in apply order), with the tier state's saves and
        loads, and release their sources' pins."""
        saves, loads = self._tiers.take()
        transfers = BlockTransfers(
            saves=saves,
            loads=loads,
            swap_out=tuple((src, dst) for dst, src in self.swap_out.items()),
            swap_in=tuple((src, dst) for dst, src in self.swap_in.items()),
            copies=tuple((src, dst) for dst, src in self.copies.items()),
        )
        self.swap_out.clear()
        self.swap_in.clear()
        self.copies.clear()
        if self.pins:
            pinned = list(self.pins.elements())
            self.pins.clear()
            self.release(self.pool, pinned)
        if self.host_pins and self.host_pool is not None:
            # Last pinned, first released: a chain's tail then leaves the host LRU before its
            # head (as ``free`` does on the device), so what stays is a usable prefix.
            pinned = list(self.host_pins.elements())[::-1]
            self.host_pins.clear()
            self.release(self.host_pool, pinned)
        return transfers
