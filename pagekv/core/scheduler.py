"""The scheduler: whom to serve this step, and what to do when blocks run out.

Owns: the waiting, running and swapped queues, the step counter and the counters. It decides;
the KV cache manager places blocks; the runner executes the resulting ``Plan``. The order of
requests is the policy's (``policy.py``); making room by preemption is ``preemptor.py``'s,
with the modes and cost model of ``preemption.py``; what to draft is ``speculation.py``'s. Must
not import torch.

One rule for every token: a request has ``num_computed_tokens`` and a target
``num_target_tokens``; each step hands out tokens, under ``max_num_batched_tokens`` and
``max_num_seqs``, until they meet. A prefill, a chunk of a long prompt, a decode, a prefix hit
and a resumed request differ only in how far apart the two numbers are. Order within a step:

    1. swapped requests come back, best first (only if no one was preempted last step and the
       pool has room for them plus the watermark)
    2. running requests, best first (the policy's order); each gets its next chunk, leaving a
       token of budget for every running request after it, so decodes never stall behind a
       long prefill. When a request cannot grow, the last running request (the policy's
       victim: FCFS newest; priority lowest, then newest) is preempted by recompute or swap
    3. waiting requests are admitted, best first (under the priority policy, aged so none
       starves: see policy.py) and head of line (a request that does not fit blocks those
       behind it, so small or cache-hot requests cannot starve a large one), while budget,
       sequence cap and free blocks allow, keeping a small watermark of blocks free so
       admissions do not preempt each other; not in a step that preempted or left requests
       swapped out (they come back first). A request whose next uncached prefix block another
       prefill of this step completes waits one step, then hits it (in-batch prefix sharing)

A request whose prefix the storage tier fetches waits in ``loading``, blocking no one, then in
its old place in ``waiting`` once it arrives or waiting stops paying (``LoadCostModel``).

Per step, one request's chunk is capped by ``long_prefill_token_threshold`` (0: no cap); all
prompt tokens by ``prefill_step_seconds`` (``step_budget.py``) and, under the fair policy with 2+
clients in, shared by client (``fair_share.py``). ``running`` is re-sorted only after a request
joined it out of order: a steady decode costs no sorting.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from pagekv.core.batch_prefix import blocks_completed, next_block_in
from pagekv.core.block_pool import BlockHash
from pagekv.core.fair_share import PrefillShares
from pagekv.core.kv_cache_manager import KVCacheManager
from pagekv.core.plan import Plan, ScheduledRequest
from pagekv.core.policy import RequestOrder, RequestQueue, SchedulingPolicy, check_priority
from pagekv.core.preemption import PreemptionCostModel, PreemptionMode
from pagekv.core.preemptor import Preemptor
from pagekv.core.request import Request, RequestStatus
from pagekv.core.scheduler_config import SchedulerConfig, SchedulerCounters
from pagekv.core.speculation import NgramProposer, accept
from pagekv.core.step_budget import StepBudget
from pagekv.errors import InvalidRequestError, PromptTooLongError

__all__ = [
    "PreemptionCostModel",
    "PreemptionMode",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerCounters",
    "SchedulingPolicy",
    "check_priority",
]


class Scheduler:
    """Owner of the request queues. ``schedule()`` makes a plan; ``update()`` applies results.

    ``waiting`` and ``swapped`` are ``RequestQueue``s and ``running`` a list, each in the
    policy's order (best first) at the start of every step.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if config.block_size != kv.block_size:
            raise InvalidRequestError(
                f"SchedulerConfig.block_size ({config.block_size}) differs from the KV cache "
                f"manager's ({kv.block_size})",
                "block_size",
            )
        self.config = config
        self.kv = kv
        self.order = RequestOrder(config.policy, config.priority_aging_steps)
        self.waiting = RequestQueue(self.order.key)
        self.running: list[Request] = []
        self.swapped = RequestQueue(self.order.key)
        self.loading: dict[str, tuple[Request, float]] = {}  # request id -> (request, deadline)
        self.clock = clock
        self.counters = SchedulerCounters()
        self.step = 0
        queues = (self.running, self.waiting, self.swapped)
        self.preemptor = Preemptor(config, kv, self.counters, queues, clock)
        self._watermark_blocks = int(config.watermark * kv.pool.num_blocks)
        self.step_budget = StepBudget(config)  # a step's prompt tokens, by step times
        self._preempted_last_step = False
        self._running_sorted = True  # False once a request joins ``running`` out of order
        spec = config.num_speculative_tokens
        self.proposer = (
            NgramProposer(spec, config.prompt_lookup_max, config.prompt_lookup_min)
            if spec
            else None
        )

    # ---- requests in and out ------------------------------------------------------------------

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Reject, before anything is queued, a request that can never run."""
        total = num_prompt_tokens + max_tokens
        if total > self.config.max_model_len:
            self.counters.rejected_requests += 1
            raise PromptTooLongError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} "
                f"exceeds the model's context of {self.config.max_model_len} tokens",
                "max_tokens" if num_prompt_tokens < self.config.max_model_len else "prompt",
            )
        kv, chunk = self.kv, self.config.max_num_batched_tokens
        if (need := kv.most_blocks_held(num_prompt_tokens, total, chunk)) > kv.pool.num_blocks:
            self.counters.rejected_requests += 1
            raise PromptTooLongError(
                f"prompt + max_tokens = {total} tokens needs {need} KV blocks; the whole pool "
                f"has {kv.pool.num_blocks}",
                "prompt",
            )

    @staticmethod
    def check_priority(priority: object) -> int:
        """Validate a priority before anything is created (integers only; negative allowed)."""
        return check_priority(priority)

    def add(self, request: Request) -> None:
        """Queue a new request (with any pending branches); raises before queueing if invalid."""
        check_priority(request.priority)
        self.check_fits(request.num_prompt_tokens, request.params.max_tokens)
        request.status = RequestStatus.WAITING
        self.order.register(request, self.step)
        self.waiting.push(request)
        self.counters.added_requests += 1

    def add_group(self, parent: Request, branches: Sequence[Request]) -> list[Request]:
        """Queue the sequences of one user request of n > 1: ``parent`` and its ``branches``.

        With a prompt of 2+ tokens only the parent is queued and the branches wait, pending,
        to fork off its blocks once all but its last prompt token is computed: the prompt is
        prefilled once and each branch samples its own next token. A one-token prompt has
        nothing to share, so each sequence is queued on its own. Returns the requests queued,
        in order; raises as ``add`` does (a rejected parent leaves its branches untouched).
        """
        if not branches or parent.num_prompt_tokens < 2:
            for request in (parent, *branches):
                self.add(request)
            return [parent, *branches]
        self.add(parent)
        for branch in branches:
            branch.status = RequestStatus.FORK_PENDING
        parent.fork_children = list(branches)
        return [parent]

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request in any state: out of its queue, every block released at once.

        A parent that ends before forking takes its pending branches with it. The counters
        count requests that entered the scheduler (``add`` or ``fork``), not unforked branches.
        """
        if request.status.finished:
            return
        if request.status is RequestStatus.FORK_PENDING:
            self._detach_branch(request)
        elif request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif self.loading.pop(request.request_id, None) is None and not self.waiting.discard(
            request
        ):  # WAITING (or never queued: ``add`` raised)
            self.swapped.discard(request)
        rid = request.request_id
        if self.kv.has_table(rid) or self.kv.is_swapped(rid):
            self.kv.free(rid)
        for branch in request.fork_children:
            branch.status = status
        request.fork_children = []
        request.status = status
        if self.order.forget(rid):
            if status is RequestStatus.FINISHED_ABORTED:
                self.counters.aborted_requests += 1
            else:
                self.counters.finished_requests += 1

    def _detach_branch(self, branch: Request) -> None:
        loading = [r for r, _ in self.loading.values()]
        queues = (self.waiting, self.running, self.swapped, loading)
        for parent in (r for q in queues for r in q if r.fork_children):
            if branch in parent.fork_children:
                parent.fork_children.remove(branch)
                return

    def fork(self, parent: Request) -> None:
        """Start the parent's pending branches: each shares all of its blocks (ref count + 1)."""
        for child in parent.fork_children:
            child.num_computed_tokens = parent.num_computed_tokens
            self.kv.fork(parent, child)
            self.order.register_branch(parent, child)
            child.status = RequestStatus.RUNNING
            self._join_running(child)
        self.counters.added_requests += len(parent.fork_children)
        parent.fork_children = []

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped) + len(self.loading)

    # ---- waiting for the storage tier ---------------------------------------------------------

    def wait_for_load(self, request: Request, num_blocks: int) -> bool:
        """Hold a waiting request back while ``num_blocks`` of its prefix come from storage,
        if the cost model says loading beats recomputing. Whether it is held."""
        if request.status is not RequestStatus.WAITING or request not in self.waiting:
            return False
        cost, block_size = self.config.load_cost, self.config.block_size
        if not cost.prefers_load(num_blocks, block_size):
            self.counters.load_skipped += 1
            return False
        self.waiting.discard(request)
        deadline = self.clock() + cost.max_wait_s(num_blocks, block_size)
        self.loading[request.request_id] = (request, deadline)
        self.counters.load_waits += 1
        return True

    def load_done(self, request_id: str) -> None:
        """The prefetch for a held request arrived (or failed): it queues again."""
        entry = self.loading.pop(request_id, None)
        if entry is not None:
            self.waiting.push(entry[0])
            self.counters.loads_arrived += 1

    def _expire_loads(self) -> None:
        now = self.clock()
        for rid, (request, deadline) in list(self.loading.items()):
            if now >= deadline:
                del self.loading[rid]
                self.waiting.push(request)
                self.counters.load_give_ups += 1

    # ---- one step -------------------------------------------------------------------------------

    def schedule(self) -> Plan:
        self.step += 1
        budget = self.config.max_num_batched_tokens
        preempted: list[str] = []
        if self.loading:
            self._expire_loads()
        if self.swapped and not self._preempted_last_step:
            self._swap_in_some()
        if not self._running_sorted:
            self.running.sort(key=self.order.key)
            self._running_sorted = True
        shares = self.step_budget.shares(self.running, self.waiting, budget, self.clock())
        scheduled, budget = self._schedule_running(budget, preempted, shares)
        if not preempted and not self.swapped:
            scheduled += self._admit(budget, scheduled, shares)
        self._preempted_last_step = bool(preempted)
        return Plan(self.step, tuple(scheduled), self.kv.take_transfers(), tuple(preempted))

    def _chunk(self, num_new: int, budget: int, num_after: int) -> int:
        """A prefill chunk: capped per request, leaving one token per later running request."""
        cap = self.config.long_prefill_token_threshold
        if 0 < cap < num_new:
            num_new = cap
        return min(num_new, max(budget - num_after, 1))

    def _schedule_running(
        self, budget: int, preempted: list[str], shares: PrefillShares | None
    ) -> tuple[list[ScheduledRequest], int]:
        # The decode hot path (256 requests a step): locals, and no helper calls for a decode.
        scheduled: list[ScheduledRequest] = []
        running, max_seqs = self.running, self.config.max_num_seqs
        append_slots, block_table = self.kv.append_slots, self.kv.block_table
        proposer = self.proposer
        i, end = 0, min(len(running), max_seqs)  # running[i] is the next to consider
        while i < end and budget > 0:
            request = running[i]
            start = request.num_computed_tokens
            num_new = request.num_target_tokens - start
            if num_new <= 0:  # nothing to do this step (a beam held for its siblings)
                i += 1
                continue
            drafts: tuple[int, ...] = ()
            if num_new > 1:
                num_new = self._chunk(num_new, budget, end - i - 1)
                if shares is not None:
                    num_new = shares.take(request.client, num_new)
                    if num_new <= 0:  # its client's share is spent: next step
                        i += 1
                        continue
            elif proposer is not None:
                drafts = proposer.propose_for_decode(request, budget - (end - i))
                if drafts and append_slots(request, 1 + len(drafts)):
                    num_new += len(drafts)
                else:  # no room for guesses: decode plainly (a draft never preempts anyone)
                    drafts = ()
            if not drafts and not append_slots(request, num_new):
                fits = self.preemptor.make_room(request, num_new, preempted, self.step)
                end = min(len(running), max_seqs)
                if not fits:
                    continue
            table = block_table(request.request_id)
            scheduled.append(ScheduledRequest(request, start, num_new, table, drafts))
            budget -= num_new
            i += 1
        return scheduled, budget

    def _admit(
        self,
        budget: int,
        running: list[ScheduledRequest],
        shares: PrefillShares | None,
    ) -> list[ScheduledRequest]:
        scheduled: list[ScheduledRequest] = []
        computing: set[BlockHash] = set()  # prefix blocks this step's prefills complete
        for entry in running if self.waiting else ():  # a steady decode batch skips this
            computing.update(
                blocks_completed(self.kv, entry.request, entry.start_position, entry.num_tokens)
            )
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            num_cached = self.kv.num_cached_tokens(request)
            if next_block_in(self.kv, request, num_cached, computing):
                break  # computed this step by another request: next step it is a hit
            num_new = self._chunk(request.num_target_tokens - num_cached, budget, 0)
            if shares is not None and (num_new := min(num_new, shares.left(request.client))) <= 0:
                break  # its client's share of this step is spent
            reserve = self._watermark_blocks if self.running else 0
            if not self.kv.can_allocate(request, num_new, reserve):
                break
            num_hit = self.kv.allocate(request, num_new)
            if num_hit is None:  # a host hit failed verification; there is less room than seen
                break
            self.waiting.pop()
            if request.num_preemptions == 0:
                request.num_cached_prompt_tokens = num_hit
            request.num_computed_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self._join_running(request)
            scheduled.append(self._entry(request, num_new))
            computing.update(blocks_completed(self.kv, request, num_hit, num_new))
            if shares is not None:
                shares.take(request.client, num_new)
            budget -= num_new
        return scheduled

    def _swap_in_some(self) -> None:
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            request = self.swapped.peek()
            rid = request.request_id
            if self.running:
                # Room for its blocks, its next block and the watermark, or it would only be
                # preempted again. Alone, it takes what there is (it fits the pool: check_fits).
                need = self.kv.num_held_blocks(rid) + 1 + self._watermark_blocks
                if need > self.kv.pool.num_free_blocks:
                    return
            if not self.kv.swap_in(rid):
                return
            self.swapped.pop()
            request.status = RequestStatus.RUNNING
            self._join_running(request)
            self.counters.swapped_in_requests += 1

    def _join_running(self, request: Request) -> None:
        running = self.running
        if running and self._running_sorted:
            self._running_sorted = self.order.key(running[-1]) < self.order.key(request)
        running.append(request)

    def _entry(self, request: Request, num_new: int) -> ScheduledRequest:
        table = self.kv.block_table(request.request_id)
        return ScheduledRequest(request, request.num_computed_tokens, num_new, table)

    # ---- after the runner -----------------------------------------------------------------------

    def update(
        self,
        plan: Plan,
        sampled: Mapping[str, int],
        verified: Mapping[str, Sequence[int]] | None = None,
    ) -> list[Request]:
        """Advance computed tokens, commit full blocks, append sampled tokens.

        ``sampled``: the token sampled for each entry that reached its end. ``verified``: for
        each entry with drafts, the model's greedy token at each position it fed (drafts + 1);
        the drafts it agrees with and one more token are appended (speculation.accept).
        Returns the requests that reached a token-level stop (eos, stop token, length); they
        are finished and their blocks released here. Stop strings are the engine's to check.
        """
        self.step_budget.step_done(plan, self.clock())
        finished: list[Request] = []
        block_size, commit, running = self.kv.block_size, self.kv.commit, RequestStatus.RUNNING
        release = self.kv.release_outside_window  # sliding windows only
        for entry in plan.scheduled:
            request = entry.request
            if request.status is not running:
                continue  # aborted after the plan was made
            if entry.draft_token_ids:
                assert verified is not None, "a plan with drafts needs the verified tokens"
                self._accept(entry, verified[request.request_id], finished)
                continue
            start = request.num_computed_tokens
            end = request.num_computed_tokens = start + entry.num_tokens
            if end // block_size != start // block_size:
                commit(request)  # a block filled up (commit also catches up on any before it)
            release(request)
            if request.fork_children and end == request.num_target_tokens:
                self.fork(request)
            if end != len(request.all_token_ids):
                continue  # a prompt chunk short of the end: nothing sampled (entry.samples)
            token = sampled[request.request_id]
            request.append_token(token)
            status = request.stop_status(token)
            if status is not None:
                self.finish(request, status)
                finished.append(request)
        return finished

    def _accept(
        self, entry: ScheduledRequest, targets: Sequence[int], finished: list[Request]
    ) -> None:
        """Append what a drafted decode yields, up to a stop; its K/V is computed for all but
        the last appended token (the K/V written for rejected drafts is overwritten later)."""
        request, drafts = entry.request, entry.draft_token_ids
        tokens = accept(drafts, targets)
        self.counters.draft_tokens += len(drafts)
        self.counters.accepted_draft_tokens += len(tokens) - 1
        status = None
        for token in tokens:
            request.append_token(token)
            status = request.stop_status(token)
            if status is not None:
                break
        start = request.num_computed_tokens
        request.num_computed_tokens = request.num_tokens - 1
        if request.num_computed_tokens // self.kv.block_size != start // self.kv.block_size:
            self.kv.commit(request)
        self.kv.release_outside_window(request)
        if status is not None:
            self.finish(request, status)
            finished.append(request)
