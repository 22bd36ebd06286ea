"""What the scheduler does when blocks run out: preempt from the tail of ``running`` until a
request fits, and carry each preemption out.

Owns the preemption log (one line per interval at most). It acts on the scheduler's KV cache
manager, queues and counters, the same objects for the scheduler's whole life: the scheduler
decides when a request needs room, the policy's order puts the first victim at the tail of
``running``, and ``preemption.py`` says how a victim gives its blocks back (its modes and the
cost model of ``auto``). Must not import torch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from pagekv.core.kv_cache_manager import KVCacheManager
from pagekv.core.policy import RequestQueue
from pagekv.core.preemption import PreemptionMode, RateLimitedLog
from pagekv.core.request import Request, RequestStatus
from pagekv.core.scheduler_config import SchedulerConfig, SchedulerCounters

logger = logging.getLogger("pagekv")


class Preemptor:
    """Frees blocks for a request that cannot grow, by preempting the scheduler's requests."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        counters: SchedulerCounters,
        queues: tuple[list[Request], RequestQueue, RequestQueue],
        clock: Callable[[], float],
    ) -> None:
        """``queues``: the scheduler's running list, waiting and swapped queues."""
        self.config = config
        self.kv = kv
        self.counters = counters
        self.running, self.waiting, self.swapped = queues
        self.log = RateLimitedLog(logger, config.preemption_log_interval_s, clock)

    def make_room(self, request: Request, num_new: int, preempted: list[str], step: int) -> bool:
        """Grow ``request`` by ``num_new`` slots, preempting from the tail until it fits.

        The tail is never already scheduled this step (scheduling walks from the head), so no
        entry of the plan loses its blocks. False if the request had to preempt itself.
        """
        while not self.kv.append_slots(request, num_new):
            victim = self.running.pop()
            self.preempt(victim, step)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def preempt(self, victim: Request, step: int) -> None:
        """Give back the victim's blocks: swap if chosen and possible, else recompute."""
        victim.num_preemptions += 1
        rid = victim.request_id
        num_blocks = self.kv.num_held_blocks(rid)
        mode = self.choose_mode(victim, num_blocks)
        if mode is PreemptionMode.SWAP:
            moved_before = self.kv.num_swapped_out_blocks
            if self.kv.swap_out(rid):
                victim.status = RequestStatus.SWAPPED
                self.swapped.push(victim)
                self.counters.preemptions_swap += 1
                self.counters.preemption_swapped_blocks += (
                    self.kv.num_swapped_out_blocks - moved_before
                )
                self.log_preemption(victim, "swap", num_blocks, step)
                return
            self.counters.swap_fallbacks += 1
        # Recompute (also the fallback when the host pool is full: never abort for lack of
        # swap space). Full blocks stay cached as evictable, so resuming often hits them.
        self.kv.free(rid)
        self.counters.preemptions_recompute += 1
        self.counters.recomputed_tokens += victim.num_computed_tokens
        self.log_preemption(victim, "recompute", num_blocks, step)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.WAITING
        self.waiting.push(victim)  # its old key: the head of the queue under FCFS

    def choose_mode(self, victim: Request, num_blocks: int) -> PreemptionMode:
        """The configured mode; under ``auto``, whichever the cost model finds cheaper."""
        mode = self.config.preemption_mode
        if mode is not PreemptionMode.AUTO:
            return mode
        if self.kv.host_pool is None:
            return PreemptionMode.RECOMPUTE
        cost = self.config.cost_model
        swap = cost.prefers_swap(victim.num_computed_tokens, num_blocks)
        return PreemptionMode.SWAP if swap else PreemptionMode.RECOMPUTE

    def log_preemption(self, victim: Request, how: str, num_blocks: int, step: int) -> None:
        """Warn that the pool is too small for the load, rate-limited."""
        self.log.warning(
            "step %d: preempted request %r by %s (%d computed tokens, %d blocks); KV pool "
            "%d/%d blocks free or evictable, %d running, %d waiting, %d swapped. The pool is "
            "too small for the load: consider more KV memory or a lower max_num_seqs",
            step,
            victim.request_id,
            how,
            victim.num_computed_tokens,
            num_blocks,
            self.kv.pool.num_free_blocks,
            self.kv.pool.num_blocks,
            len(self.running),
            len(self.waiting),
            len(self.swapped),
        )
