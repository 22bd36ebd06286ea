"""The scheduler: whom to serve this step, and what to do when blocks run out.

Owns: the waiting, running and swapped queues, and the step counter. It decides; the KV cache
manager places blocks; the runner executes the resulting ``Plan``. Must not import torch.

One rule for every token: a request has ``num_computed_tokens`` and a target ``num_tokens``;
each step hands out tokens, under ``max_num_batched_tokens`` and ``max_num_seqs``, until they
meet. A prefill, a chunk of a long prompt, a decode and a resumed request differ only in how far
apart the two numbers are. Order within a step:

    1. swapped requests come back (only if no one was preempted last step and room is ample)
    2. running requests, oldest first; when a request cannot grow, the newest running request
       is preempted (recompute: blocks freed, full ones stay cached; swap: moved to host)
    3. waiting requests are admitted, FCFS, while budget, sequence cap and free blocks allow
       (keeping a small watermark of blocks free so admissions do not preempt each other)
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import Enum

from pagekv.core.kv_cache_manager import KVCacheManager
from pagekv.core.plan import Plan, ScheduledRequest
from pagekv.core.request import Request, RequestStatus
from pagekv.errors import InvalidRequestError, PromptTooLongError


class PreemptionMode(Enum):
    RECOMPUTE = "recompute"
    SWAP = "swap"


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE
    watermark: float = 0.01  # share of the pool kept free when admitting

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise InvalidRequestError("max_num_seqs must be >= 1", "max_num_seqs")
        if self.max_num_batched_tokens < 1:
            raise InvalidRequestError(
                "max_num_batched_tokens must be >= 1", "max_num_batched_tokens"
            )
        if self.max_model_len < 1:
            raise InvalidRequestError("max_model_len must be >= 1", "max_model_len")
        if not 0 <= self.watermark < 1:
            raise InvalidRequestError("watermark must be in [0, 1)", "watermark")


@dataclass
class SchedulerCounters:
    num_preemptions_recompute: int = 0
    num_preemptions_swap: int = 0
    num_recomputed_tokens: int = 0
    num_rejected: int = 0


class Scheduler:
    """Owner of the request queues. ``schedule()`` makes a plan; ``update()`` applies results."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.counters = SchedulerCounters()
        self.step = 0
        self._watermark_blocks = int(config.watermark * kv.pool.num_blocks)
        self._preempted_last_step = False

    # ---- requests in and out ------------------------------------------------------------------

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Reject, before anything is queued, a request that can never run."""
        total = num_prompt_tokens + max_tokens
        if total > self.config.max_model_len:
            self.counters.num_rejected += 1
            raise PromptTooLongError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} "
                f"exceeds the model's context of {self.config.max_model_len} tokens",
                "max_tokens" if num_prompt_tokens < self.config.max_model_len else "prompt",
            )
        if self.kv.num_blocks_for(total) > self.kv.pool.num_blocks:
            self.counters.num_rejected += 1
            raise PromptTooLongError(
                f"prompt + max_tokens = {total} tokens needs {self.kv.num_blocks_for(total)} "
                f"KV blocks; the whole pool has {self.kv.pool.num_blocks}",
                "prompt",
            )

    def add(self, request: Request) -> None:
        self.check_fits(request.num_prompt_tokens, request.params.max_tokens)
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request in any state: out of its queue, every block released at once."""
        if request.status.finished:
            return
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.swapped.remove(request)
        rid = request.request_id
        if self.kv.has_table(rid) or self.kv.is_swapped(rid):
            self.kv.free(rid)
        request.status = status

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    # ---- one step -------------------------------------------------------------------------------

    def schedule(self) -> Plan:
        self.step += 1
        budget = self.config.max_num_batched_tokens
        preempted: list[str] = []
        if not self._preempted_last_step:
            self._swap_in_some()
        scheduled, budget = self._schedule_running(budget, preempted)
        if not preempted and not self.swapped:
            scheduled += self._admit(budget)
        self._preempted_last_step = bool(preempted)
        return Plan(self.step, tuple(scheduled), self.kv.take_transfers(), tuple(preempted))

    def _schedule_running(
        self, budget: int, preempted: list[str]
    ) -> tuple[list[ScheduledRequest], int]:
        scheduled: list[ScheduledRequest] = []
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.append_slots(request, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                scheduled.append(self._entry(request, num_new))
                budget -= num_new
                i += 1
        return scheduled, budget

    def _admit(self, budget: int) -> list[ScheduledRequest]:
        scheduled: list[ScheduledRequest] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            num_cached = self.kv.num_cached_tokens(request)
            num_new = min(request.num_tokens - num_cached, budget)
            reserve = self._watermark_blocks if self.running else 0
            if not self.kv.can_allocate(request, num_new, reserve):
                break
            num_hit = self.kv.allocate(request, num_new)
            assert num_hit == num_cached
            self.waiting.popleft()
            if request.num_preemptions == 0:
                request.num_cached_prompt_tokens = num_hit
            request.num_computed_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(self._entry(request, num_new))
            budget -= num_new
        return scheduled

    def _swap_in_some(self) -> None:
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            request = self.swapped[0]
            need = len(self.kv.host_block_table(request.request_id)) + 1 + self._watermark_blocks
            if need > self.kv.pool.num_free_blocks or not self.kv.swap_in(request.request_id):
                return
            self.swapped.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        victim.num_preemptions += 1
        swap = self.config.preemption_mode is PreemptionMode.SWAP
        if swap and self.kv.swap_out(victim.request_id):
            victim.status = RequestStatus.SWAPPED
            self.swapped.append(victim)
            self.counters.num_preemptions_swap += 1
            return
        # Recompute (also the fallback when the host pool is full: never abort for lack of
        # swap space). Full blocks stay in the prefix cache, so resuming often hits them.
        self.kv.free(victim.request_id)
        self.counters.num_preemptions_recompute += 1
        self.counters.num_recomputed_tokens += victim.num_computed_tokens
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.WAITING
        self.waiting.appendleft(victim)

    def _entry(self, request: Request, num_new: int) -> ScheduledRequest:
        table = self.kv.block_table(request.request_id)
        return ScheduledRequest(request, request.num_computed_tokens, num_new, table)

    # ---- after the runner -----------------------------------------------------------------------

    def update(self, plan: Plan, sampled: dict[str, int]) -> list[Request]:
        """Advance computed tokens, commit full blocks, append sampled tokens.

        Returns the requests that reached a token-level stop (eos, stop token, length); they
        are finished and their blocks released here. Stop strings are the engine's to check.
        """
        finished: list[Request] = []
        for entry in plan.scheduled:
            request = entry.request
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted after the plan was made
            request.num_computed_tokens += entry.num_tokens
            self.kv.commit(request)
            if not entry.samples:
                continue
            token = sampled[request.request_id]
            request.append_token(token)
            status = request.stop_status(token)
            if status is not None:
                self.finish(request, status)
                finished.append(request)
        return finished
