"""Contiguous-reservation baselines: what serving without paging would keep of KV memory.

Owns a small admission simulator for systems that give each sequence one contiguous region of
KV slots when it is admitted and hold it until it finishes (Orca-like, as in the PagedAttention
paper). The region is sized by a ``Reservation`` policy:

    max     the model's maximum length               (the sequence may need all of it)
    pow2    the next power of two >= prompt + output (a size-class allocator)
    oracle  exactly prompt + output                  (knows the output length in advance)

Same arrivals, token budget, sequence cap and cost model as the paged runs; first-fit
placement in one address space (so free space can be fragmented), FCFS head-of-line admission,
no preemption (a region never grows), no sharing: each branch of an ``n > 1`` request holds and
prefills its own copy of the prompt. Must not import torch, the engine or the server.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from pagekv.sim.arrivals import ArrivalQueue
from pagekv.sim.cost_model import CostModel, StepShape
from pagekv.sim.metrics import Latencies, SimResult, UsageSeries
from pagekv.sim.simulator import SimConfig
from pagekv.sim.workload import SimRequest, expected_steps


class Reservation(Enum):
    MAX = "max"
    POW2 = "pow2"
    ORACLE = "oracle"

    def slots(self, num_tokens: int, max_model_len: int) -> int:
        if self is Reservation.MAX:
            return max_model_len
        if self is Reservation.POW2:
            return 1 << (num_tokens - 1).bit_length()
        return num_tokens


class FirstFit:
    """Free holes of one address space, sorted by start; owner of the free space."""

    def __init__(self, num_slots: int) -> None:
        self.starts: list[int] = [0]
        self.sizes: list[int] = [num_slots]

    def allocate(self, size: int) -> int | None:
        for i, hole in enumerate(self.sizes):
            if hole >= size:
                start = self.starts[i]
                if hole == size:
                    del self.starts[i], self.sizes[i]
                else:
                    self.starts[i] += size
                    self.sizes[i] -= size
                return start
        return None

    def free(self, start: int, size: int) -> None:
        i = bisect.bisect(self.starts, start)
        if i > 0 and self.starts[i - 1] + self.sizes[i - 1] == start:  # merge with the left
            i -= 1
            self.sizes[i] += size
        else:
            self.starts.insert(i, start)
            self.sizes.insert(i, size)
        if i + 1 < len(self.starts) and self.starts[i] + self.sizes[i] == self.starts[i + 1]:
            self.sizes[i] += self.sizes.pop(i + 1)
            del self.starts[i + 1]


@dataclass
class _Seq:
    """One sequence's region and progress (owned by ``_ContiguousRun``)."""

    rid: str
    group: str
    prompt_len: int
    output_len: int
    start: int = 0
    size: int = 0
    computed: int = 0
    generated: int = 0

    @property
    def known(self) -> int:
        return self.prompt_len + self.generated


def simulate_contiguous(
    requests: Sequence[SimRequest], config: SimConfig, cost: CostModel, reservation: Reservation
) -> SimResult:
    """Replay ``requests`` on a contiguous-reservation system of ``config.num_kv_tokens``."""
    return _ContiguousRun(config, cost, reservation).run(requests)


class _ContiguousRun:
    """Owner of the clock, the queues and the address space of one baseline run."""

    def __init__(self, config: SimConfig, cost: CostModel, reservation: Reservation) -> None:
        self.config, self.cost, self.reservation = config, cost, reservation
        self.space = FirstFit(config.num_kv_tokens)
        self.clock_s = 0.0
        self.arrivals = ArrivalQueue(())
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.branches_left: dict[str, int] = {}
        self.latency = Latencies()
        self.usage = UsageSeries()
        self.reserved = self.stored = self.never_used = 0
        self.integral_reserved = self.integral_never_used = 0.0
        self.num_rejected = self.num_prompt_tokens = self.num_output_tokens = 0
        self.num_steps = self.max_batch = 0

    def _add(self, request: SimRequest, at_s: float) -> None:
        prompt = len(request.prompt_token_ids)
        longest = max(len(o) for o in request.outputs)
        limit = min(self.config.max_model_len, self.config.num_kv_tokens)
        if self.reservation.slots(prompt + longest, self.config.max_model_len) > limit:
            self.num_rejected += 1
            self.arrivals.release(request.request_id, self.clock_s)
            return
        n = len(request.outputs)
        self.branches_left[request.request_id] = n
        self.num_prompt_tokens += prompt
        for i, out in enumerate(request.outputs):
            rid = request.request_id if n == 1 else f"{request.request_id}#{i}"
            self.waiting.append(_Seq(rid, request.request_id, prompt, len(out)))
            self.latency.arrival_s[rid] = at_s

    def run(self, requests: Sequence[SimRequest]) -> SimResult:
        self.arrivals = ArrivalQueue(requests)
        self.usage = UsageSeries.for_steps(
            expected_steps(requests, self.config.max_num_seqs, self.config.max_num_batched_tokens)
        )
        while self.arrivals or self.waiting or self.running:
            for at_s, request in self.arrivals.due(self.clock_s):
                self._add(request, at_s)
            if not (self.waiting or self.running):
                if self.arrivals:  # idle until the next arrival
                    self.clock_s = max(self.clock_s, self.arrivals.next_s())
                continue
            self._step(self._schedule())
        return self._result()

    def _schedule(self) -> list[tuple[_Seq, int]]:
        """The core's rule: running sequences first (a token each left for later ones), then
        head-of-line admission while a region of the reservation's size is free."""
        budget, max_seqs = self.config.max_num_batched_tokens, self.config.max_num_seqs
        scheduled: list[tuple[_Seq, int]] = []
        for i, seq in enumerate(self.running):
            if budget <= 0 or len(scheduled) >= max_seqs:
                break
            num_new = seq.known - seq.computed
            if num_new > 1:
                num_new = min(num_new, max(budget - (min(len(self.running), max_seqs) - i - 1), 1))
            scheduled.append((seq, num_new))
            budget -= num_new
        while self.waiting and budget > 0 and len(self.running) < max_seqs:
            seq = self.waiting[0]
            final_len = seq.prompt_len + seq.output_len
            size = self.reservation.slots(final_len, self.config.max_model_len)
            start = self.space.allocate(size)
            if start is None:
                break
            self.waiting.popleft()
            seq.start, seq.size = start, size
            self.reserved += size
            self.never_used += size - (final_len - 1)  # the last token's K/V is never written
            self.running.append(seq)
            num_new = min(seq.known, budget)
            scheduled.append((seq, num_new))
            budget -= num_new
        return scheduled

    def _step(self, scheduled: list[tuple[_Seq, int]]) -> None:
        dt_s = max(self.cost.step_s(_shape(scheduled)), 1e-6)
        self.integral_reserved += dt_s * self.reserved
        self.integral_never_used += dt_s * self.never_used
        self.clock_s += dt_s
        self.num_steps += 1
        self.max_batch = max(self.max_batch, len(scheduled))
        for seq, num_new in scheduled:
            seq.computed += num_new
            self.stored += num_new
            if seq.computed == seq.known:
                self._sample(seq)
        if self.usage.tick(dt_s):
            self.usage.add(self.clock_s, self.reserved, self.stored, len(self.running))

    def _sample(self, seq: _Seq) -> None:
        if seq.generated == 0:
            self.latency.first_s[seq.rid] = self.clock_s
        seq.generated += 1
        self.num_output_tokens += 1
        if seq.generated < seq.output_len:
            return
        self.running.remove(seq)
        self.space.free(seq.start, seq.size)
        self.reserved -= seq.size
        self.stored -= seq.computed
        self.never_used -= seq.size - (seq.prompt_len + seq.output_len - 1)
        self.latency.finish_s[seq.rid] = self.clock_s
        self.latency.num_output[seq.rid] = seq.generated
        self.branches_left[seq.group] -= 1
        if self.branches_left[seq.group] == 0:
            self.arrivals.release(seq.group, self.clock_s)

    def _result(self) -> SimResult:
        util = self.usage.utilisation()
        internal = (
            self.integral_never_used / self.integral_reserved if self.integral_reserved else 0
        )
        return SimResult(
            label=f"contiguous {self.reservation.value}",
            block_size=None,
            num_requests=len(self.latency.finish_s),
            num_rejected=self.num_rejected,
            num_steps=self.num_steps,
            sim_time_s=self.clock_s,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens,
            kv_utilisation=util,
            internal_fragmentation=internal,
            mean_table_entries=self.usage.mean_entries(),
            prefix_hit_rate=0.0,
            num_preemptions=0,
            max_batch=self.max_batch,
            ttft_s=self.latency.ttft(),
            tpot_s=self.latency.tpot(),
            usage=self.usage,
        )


def _shape(scheduled: list[tuple[_Seq, int]]) -> StepShape:
    """A contiguous region is one table entry per sequence: the kernel needs its base only."""
    num_tokens = context = max_query = max_seq = 0
    for seq, q in scheduled:
        end = seq.computed + q
        num_tokens += q
        context += end
        max_query = max(max_query, q)
        max_seq = max(max_seq, end)
    num_seqs = len(scheduled)
    return StepShape(
        num_seqs=num_seqs,
        num_batched_tokens=num_tokens,
        num_context_tokens=context,
        num_padded_context_tokens=num_seqs * max_seq,
        num_padded_cells=num_seqs * max_query * max_seq,
        num_table_entries=num_seqs,
    )
