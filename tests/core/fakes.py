"""Helpers for the scheduler tests (no tests here): a fake runner and a step loop, no model.

``FakeRunner`` executes a ``Plan`` the way ``ModelRunner`` does, on ``core_helpers.SimulatedKV``
instead of tensors: it applies the plan's transfers in order, writes each scheduled token's
signature into its slot, reads the request's history back through its block table (a wrong
swap, copy or prefix hit shows up as a mismatch), and "samples" ``fake_token(request)``, a
deterministic function of the request's tokens so far.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pagekv.core import KVCacheManager, Plan, Request
from pagekv.core.invariants import check_manager, check_plan
from pagekv.core.scheduler import Scheduler, SchedulerConfig
from pagekv.sampling_params import SamplingParams
from tests.core.helpers import SimulatedKV

VOCAB = 1000


def fake_next(tokens: Sequence[int], request_id: str) -> int:
    """The token a deterministic 'model' samples after ``tokens``."""
    return (tokens[-1] * 31 + len(tokens) * 7 + len(request_id)) % VOCAB


def fake_token(request: Request) -> int:
    """The token a deterministic 'model' samples after ``request``'s tokens so far."""
    return fake_next(request.all_token_ids, request.request_id)


def make_request(
    rid: str,
    prompt_len: int,
    max_tokens: int,
    *,
    priority: int = 0,
    first: int = 0,
    client: str | None = None,
) -> Request:
    prompt = [(first + 13 * i) % VOCAB for i in range(prompt_len)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, prompt, params, priority=priority, client=client)


def make_scheduler(
    num_blocks: int, block_size: int = 4, num_host_blocks: int = 0, **config: object
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, num_host_blocks=num_host_blocks)
    cfg = SchedulerConfig(block_size=block_size, **config)  # type: ignore[arg-type]
    return Scheduler(cfg, kv)


class FakeRunner:
    """Executes plans on simulated KV memory; ``check_history`` re-reads every scheduled
    request's whole history (O(tokens) per request per step)."""

    def __init__(
        self,
        kv: KVCacheManager,
        *,
        check_history: bool = True,
        model: Callable[[Sequence[int], str], int] = fake_next,
    ) -> None:
        host = kv.host_pool.num_blocks if kv.host_pool is not None else 0
        self.memory = SimulatedKV(kv.pool.num_blocks, host, kv.block_size)
        self.check_history = check_history
        self.model = model
        self.num_tokens_computed = 0
        # Drafted decodes of the last step: the model's token after each position fed.
        self.verified: dict[str, list[int]] = {}

    def execute(self, plan: Plan) -> dict[str, int]:
        self.memory.apply(plan.transfers)
        sampled: dict[str, int] = {}
        self.verified = {}
        for s in plan.scheduled:
            request, start, end = s.request, s.start_position, s.end_position
            fed = request.all_token_ids[:start] + s.token_ids  # drafts included
            self.memory.write(s.block_table, request, start, s.num_tokens, fed)
            self.num_tokens_computed += s.num_tokens
            if self.check_history:
                got = self.memory.read(s.block_table, end)
                want = [(request.cache_salt, tuple(fed[: p + 1])) for p in range(end)]
                assert got == want, f"step {plan.step}: {request.request_id} reads wrong K/V"
            rid = request.request_id
            if s.draft_token_ids:
                self.verified[rid] = [self.model(fed[: p + 1], rid) for p in range(start, end)]
            elif s.samples:
                sampled[rid] = self.model(request.all_token_ids, rid)
        return sampled


@dataclass
class StepLog:
    """What a loop observed, for assertions."""

    plans: list[Plan] = field(default_factory=list)
    finished: dict[str, int] = field(default_factory=dict)  # request id -> step it finished


def run_step(
    scheduler: Scheduler, runner: FakeRunner, log: StepLog | None = None, check: bool = True
) -> Plan:
    """One engine step without a model: schedule, (check), execute, update, (check)."""
    plan = scheduler.schedule()
    if check:
        check_manager(scheduler.kv)
        check_plan(scheduler.kv, plan)
    sampled = runner.execute(plan)
    done = scheduler.update(plan, sampled, runner.verified)
    if check:
        check_manager(scheduler.kv)
    if log is not None:
        log.plans.append(plan)
        for request in done:
            log.finished[request.request_id] = plan.step
    return plan


def run_until_done(
    scheduler: Scheduler, runner: FakeRunner, max_steps: int, log: StepLog | None = None
) -> int:
    """Step until no request is left; fails after ``max_steps`` (a livelock). Returns steps."""
    for n in range(1, max_steps + 1):
        run_step(scheduler, runner, log)
        if scheduler.num_unfinished == 0:
            return n
    raise AssertionError(f"not done after {max_steps} steps: {scheduler.num_unfinished} left")


def expected_output(
    request: Request, model: Callable[[Sequence[int], str], int] = fake_next
) -> list[int]:
    """The tokens the fake model generates for ``request``'s prompt, computed independently."""
    tokens = list(request.prompt_token_ids)
    for _ in range(request.params.max_tokens):
        tokens.append(model(tokens, request.request_id))
    return tokens[len(request.prompt_token_ids) :]
