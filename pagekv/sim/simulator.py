"""The paged simulator: a workload replayed through the real Scheduler and KVCacheManager.

Owns one run's simulated clock, its arrival queue and the bookkeeping of what happened. The
decisions (admission, block allocation, prefix hits, forks, copy-on-write, preemption) are made
by ``pagekv.core``, unmodified; only the model is replaced: a step costs what the ``CostModel``
says, and "sampling" reads the next planned output id of the request. Must not import torch,
the engine or the server.

One simulated step::

    arrivals with time <= clock join the scheduler (a chat turn arrives after its predecessor)
    plan = scheduler.schedule()          the real decision
    clock += cost.step_s(shape of plan)  instead of the model
    scheduler.update(plan, next ids)     the real bookkeeping: commit, fork, finish, free
    every few steps: kv.usage()          the real usage figures, weighted by simulated time
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagekv.core import KVCacheManager, Request
from pagekv.core.plan import Plan
from pagekv.core.scheduler import PreemptionMode, Scheduler, SchedulerConfig
from pagekv.errors import InvalidRequestError, PromptTooLongError
from pagekv.sampling_params import SamplingParams
from pagekv.sim.arrivals import ArrivalQueue
from pagekv.sim.cost_model import CostModel, StepShape
from pagekv.sim.metrics import BlockTimeline, Latencies, SimResult, UsageSeries
from pagekv.sim.workload import SimRequest, expected_steps

MAX_IDLE_STEPS = 1000  # consecutive empty plans with work left: a stall, i.e. a bug


@dataclass(frozen=True)
class SimConfig:
    """The engine settings a run simulates. The pool holds ``num_kv_tokens`` slots at every
    block size (``num_kv_tokens // block_size`` blocks), so block sizes compete on equal memory.
    """

    block_size: int = 16
    num_kv_tokens: int = 23_296  # what 1 GiB holds for the default model in float32
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    num_host_tokens: int = 0  # host pool for swap preemption

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise InvalidRequestError(f"block_size must be >= 1, got {self.block_size}", "block")
        if self.num_kv_tokens < self.block_size:
            raise InvalidRequestError(
                f"the KV pool ({self.num_kv_tokens} tokens) is smaller than one block of "
                f"{self.block_size}",
                "kv_tokens",
            )
        if self.num_host_tokens < 0:
            raise InvalidRequestError("num_host_tokens must be >= 0", "num_host_tokens")

    @property
    def num_blocks(self) -> int:
        return self.num_kv_tokens // self.block_size

    def build(self) -> Scheduler:
        """The real core objects this run drives."""
        kv = KVCacheManager(
            self.num_blocks,
            self.block_size,
            self.enable_prefix_caching,
            self.num_host_tokens // self.block_size,
        )
        config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            preemption_mode=PreemptionMode(self.preemption_mode),
        )
        return Scheduler(config, kv, clock=lambda: 0.0)


def simulate(
    requests: Sequence[SimRequest],
    config: SimConfig,
    cost: CostModel,
    *,
    record_blocks: bool = False,
) -> SimResult:
    """Replay ``requests`` through the core at ``config``; ``record_blocks`` keeps the picture."""
    return _PagedRun(config, cost, record_blocks).run(requests)


class _PagedRun:
    """One run: owner of the simulated clock, the arrival heap and the measurements."""

    def __init__(self, config: SimConfig, cost: CostModel, record_blocks: bool) -> None:
        self.config = config
        self.cost = cost
        self.scheduler = config.build()
        self.kv = self.scheduler.kv
        self.clock_s = 0.0
        self.arrivals = ArrivalQueue(())
        self.outputs: dict[str, tuple[int, ...]] = {}
        self.group_of: dict[str, str] = {}  # branch id -> user request id
        self.branches_left: dict[str, int] = {}
        self.latency = Latencies()
        self.usage = UsageSeries()
        self.blocks = BlockTimeline(self.kv.pool.num_blocks) if record_blocks else None
        self.num_rejected = self.num_prompt_tokens = self.num_output_tokens = 0
        self.num_steps = self.max_batch = 0

    # ---- arrivals -------------------------------------------------------------------------------

    def _add(self, request: SimRequest, at_s: float) -> None:
        outputs = sorted(request.outputs, key=len, reverse=True)  # the longest rides the parent
        rids = (
            [request.request_id]
            if len(outputs) == 1
            else [f"{request.request_id}#{i}" for i in range(len(outputs))]
        )
        core = [
            Request(rid, request.prompt_token_ids, _params(len(out)), arrival_time=at_s)
            for rid, out in zip(rids, outputs, strict=True)
        ]
        parent, *children = core
        try:
            self.scheduler.add_group(parent, children)
        except PromptTooLongError:
            self.num_rejected += 1
            self.arrivals.release(request.request_id, self.clock_s)
            return
        self.branches_left[request.request_id] = len(core)
        for rid, out in zip(rids, outputs, strict=True):
            self.outputs[rid] = out
            self.group_of[rid] = request.request_id
            self.latency.arrival_s[rid] = at_s
        self.num_prompt_tokens += len(request.prompt_token_ids)

    # ---- the loop -------------------------------------------------------------------------------

    def run(self, requests: Sequence[SimRequest]) -> SimResult:
        self.arrivals = ArrivalQueue(requests)
        self.usage = UsageSeries.for_steps(
            expected_steps(requests, self.config.max_num_seqs, self.config.max_num_batched_tokens)
        )
        idle = 0
        while self.arrivals or self.scheduler.num_unfinished:
            for at_s, request in self.arrivals.due(self.clock_s):
                self._add(request, at_s)
            if not self.scheduler.num_unfinished:
                if self.arrivals:  # idle until the next arrival
                    self.clock_s = max(self.clock_s, self.arrivals.next_s())
                continue
            plan = self.scheduler.schedule()
            idle = idle + 1 if not plan.scheduled else 0
            if idle > MAX_IDLE_STEPS:
                raise RuntimeError(f"simulation stalled at step {self.num_steps}: {plan}")
            self._step(plan)
        return self._result()

    def _step(self, plan: Plan) -> None:
        dt_s = self.cost.step_s(StepShape.of_plan(plan))
        if not plan.scheduled:
            dt_s = max(dt_s, self.cost.fixed_s, 1e-6)
        self.clock_s += dt_s
        self.num_steps += 1
        self.max_batch = max(self.max_batch, len(plan.scheduled))
        sampled = self._sample(plan)
        for request in self.scheduler.update(plan, sampled):
            self._finished(request)
        if self.usage.tick(dt_s):
            usage = self.kv.usage()
            self.usage.add(
                self.clock_s,
                usage.num_slots_allocated,
                usage.num_tokens_stored,
                usage.num_logical_blocks,
            )
        if self.blocks is not None and self.blocks.tick():
            pool = self.kv.pool
            owners = self.kv.block_owners()
            self.blocks.add(self.clock_s, list(pool.iter_evictable()), owners, self.group_of)

    def _sample(self, plan: Plan) -> dict[str, int]:
        sampled: dict[str, int] = {}
        now = self.clock_s
        for entry in plan.scheduled:
            request = entry.request
            if entry.start_position + entry.num_tokens != request.num_tokens:
                continue  # a prompt chunk short of the end samples nothing
            rid = request.request_id
            done = request.num_output_tokens
            sampled[rid] = self.outputs[rid][done]
            if done == 0 and rid not in self.latency.first_s:
                self.latency.first_s[rid] = now
        self.num_output_tokens += len(sampled)
        return sampled

    def _finished(self, request: Request) -> None:
        rid = request.request_id
        self.latency.finish_s[rid] = self.clock_s
        self.latency.num_output[rid] = request.num_output_tokens
        group = self.group_of[rid]
        self.branches_left[group] -= 1
        if self.branches_left[group] == 0:
            self.arrivals.release(group, self.clock_s)

    def _result(self) -> SimResult:
        usage = self.kv.usage()
        counters = self.scheduler.counters
        hit = (
            usage.prefix_hit_tokens / usage.prefix_query_tokens
            if usage.prefix_query_tokens
            else 0.0
        )
        util = self.usage.utilisation()
        return SimResult(
            label=f"paged bs={self.config.block_size}",
            block_size=self.config.block_size,
            num_requests=len(self.latency.finish_s),
            num_rejected=self.num_rejected,
            num_steps=self.num_steps,
            sim_time_s=self.clock_s,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens,
            kv_utilisation=util,
            internal_fragmentation=1.0 - util if self.usage.slots else 0.0,
            mean_table_entries=self.usage.mean_entries(),
            prefix_hit_rate=hit,
            num_preemptions=counters.preemptions_recompute + counters.preemptions_swap,
            max_batch=self.max_batch,
            ttft_s=self.latency.ttft(),
            tpot_s=self.latency.tpot(),
            usage=self.usage,
            blocks=self.blocks,
        )


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
