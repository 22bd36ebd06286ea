"""The fair policy: clients in turn, and a step's prefill shared among clients and capped,
so one client's queue of long prompts neither delays nor slows another client's request."""

from __future__ import annotations

import itertools
import random

import pytest

from pagekv.core.fair_share import waterfill
from pagekv.core.invariants import check_no_leak
from pagekv.core.policy import FairTurns
from pagekv.core.scheduler import Scheduler, SchedulerConfig
from pagekv.core.step_budget import MIN_PREFILL_TOKENS, UNMEASURED_TOKENS, StepBudget
from tests.core.fakes import (
    FakeRunner,
    StepLog,
    make_request,
    make_scheduler,
    run_step,
    run_until_done,
)


def test_waterfill_gives_small_demands_all_and_splits_the_rest() -> None:
    assert waterfill({"a": 10, "b": 1000, "c": 1000}, 256) == {"a": 10, "b": 123, "c": 123}
    assert waterfill({"a": 5, "b": 7}, 256) == {"a": 5, "b": 7}
    assert waterfill({"a": 300}, 256) == {"a": 256}
    shares = waterfill({k: random.Random(k).randint(1, 500) for k in range(20)}, 1000)
    assert sum(shares.values()) <= 1000 and min(shares.values()) >= 1


def ticking(sched: Scheduler) -> Scheduler:
    """Every step takes one tick of its clock: the contended budget stays at its cap."""
    ticks = itertools.count()
    sched.clock = lambda: float(next(ticks))
    return sched


def test_the_step_budget_fits_prompt_tokens_to_step_times() -> None:
    """Contended: twice a decode-only step; under prefill_step_seconds: that long; by a cost
    model of the steps measured (a base plus a cost per prompt token)."""
    config = SchedulerConfig(policy="fair", shared_prefill_tokens=256, prefill_step_seconds=0.1)
    budget = StepBudget(config)
    assert budget.tokens(True) == budget.tokens(False) == UNMEASURED_TOKENS  # nothing measured
    budget.observe(0.010, 0)  # decodes alone: 10 ms
    budget.observe(0.010 + 100 * 0.0001, 100)  # 0.1 ms a prompt token beyond the base
    assert budget.token_s == pytest.approx(0.0001)
    assert budget.tokens(True) == 100  # (2 x 0.01 - 0.01) / 0.0001
    assert budget.tokens(False) == 900  # (0.1 - 0.01) / 0.0001
    budget.observe(0.010 + 100 * 0.0003, 100)  # deeper in the prompt: 0.3 ms, averaged
    assert budget.token_s == pytest.approx(0.0002)
    assert (budget.tokens(True), budget.tokens(False)) == (50, 450)
    for _ in range(40):  # decodes alone take longer than the target: prompts get as long again
        budget.observe(0.150, 0)
    assert budget.tokens(False) == int(budget.base_s / budget.token_s) > 450
    assert budget.tokens(True) == 256  # the shared cap
    for _ in range(20):  # far slower steps: the floor, never zero
        budget.observe(100.0, 64)
    assert budget.tokens(False) == budget.tokens(True) == MIN_PREFILL_TOKENS
    for _ in range(40):  # far faster: the ceilings (the shared cap, the step's budget)
        budget.observe(0.0101, 2048)
    assert budget.tokens(False) == config.max_num_batched_tokens
    assert budget.tokens(True) == 256


def test_without_a_step_target_only_contention_caps() -> None:
    budget = StepBudget(SchedulerConfig(policy="fair", shared_prefill_tokens=64))
    assert budget.tokens(False) == 0 and budget.tokens(True) == 64
    budget.observe(0.010, 0)
    budget.observe(0.010 + 32 * 0.001, 32)
    assert budget.tokens(False) == 0 and budget.tokens(True) == 10  # 10 ms


def test_a_long_prompt_alone_is_spread_over_steps_of_the_target_length() -> None:
    """A step takes 1 ms plus 10 ms a prompt token (the fake clock): with a 0.5 s target and
    nothing else in, each step after the first holds the prompt tokens that fit 0.5 s."""
    sched = make_scheduler(600, max_num_batched_tokens=512, prefill_step_seconds=0.5)
    clock = [0.0]
    sched.clock = lambda: clock[0]
    runner = FakeRunner(sched.kv)
    sched.add(make_request("long", 2000, 2))
    sizes = []
    while sched.running or sched.waiting:
        plan = sched.schedule()
        prefill = sum(s.num_tokens for s in plan.scheduled if s.num_tokens > 1)
        sizes.append(prefill)
        clock[0] += 0.01 * prefill + 0.001
        sched.update(plan, runner.execute(plan))
    assert sizes[0] == UNMEASURED_TOKENS
    assert set(sizes[1:-3]) == {49}, sizes  # (0.5 - 0) / 0.01 less the rounding
    check_no_leak(sched.kv)


def test_turns_of_one_client_are_arrival_order_and_a_newcomer_goes_next() -> None:
    turns = FairTurns()
    assert [turns.take(f"a{i}", "A") for i in range(5)] == [0, 1, 2, 3, 4]
    turns.give_back("a0")
    turns.give_back("a1")
    assert turns.take("b0", "B") == 2  # the lowest live turn: behind a2 only
    assert turns.take("b1", "B") == 3
    assert turns.take("a5", "A") == 5  # A keeps its own order
    for rid in ("a2", "a3", "a4", "a5", "b0", "b1"):
        turns.give_back(rid)
    # nothing live: the virtual time stays where it was, for old and new clients alike
    assert turns.take("c0", "C") == turns.take("a6", "A") == turns.virtual_time == 2


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
def test_one_client_is_served_exactly_as_fcfs(policy: str) -> None:
    """Offline every request has client None: the fair policy's plans are fcfs's."""

    def plans(policy: str) -> list[list[tuple[str, int]]]:
        sched = make_scheduler(40, max_num_batched_tokens=32, policy=policy)
        runner = FakeRunner(sched.kv)
        log = StepLog()
        for i in range(12):
            sched.add(make_request(f"r{i}", 5 + 7 * i % 30, 3 + i % 5, first=i))
            run_step(sched, runner, log)
        run_until_done(sched, runner, 500, log)
        check_no_leak(sched.kv)
        return [[(s.request.request_id, s.num_tokens) for s in p.scheduled] for p in log.plans]

    assert plans(policy) == plans("fcfs")


def test_a_short_request_of_another_client_overtakes_a_queue_of_long_prompts() -> None:
    sched = ticking(
        make_scheduler(400, max_num_batched_tokens=128, policy="fair", shared_prefill_tokens=32)
    )
    runner = FakeRunner(sched.kv)
    for i in range(8):
        sched.add(make_request(f"long{i}", 300, 4, first=i, client="A"))
    run_step(sched, runner)
    sched.add(make_request("short", 10, 6, first=99, client="B"))
    log = StepLog()
    steps = 0
    while "short" not in log.finished:
        plan = run_step(sched, runner, log)
        steps += 1
        prefill = sum(s.num_tokens for s in plan.scheduled if s.num_tokens > 1)
        assert prefill <= 32, "a step's prefill is capped while two clients are in"
    # its 10-token prompt in the first step, then one token a step: 6 outputs in 6 steps
    assert steps == 6
    run_until_done(sched, runner, 2000, log)
    check_no_leak(sched.kv)


def test_alone_a_client_gets_the_whole_budget_again() -> None:
    sched = ticking(
        make_scheduler(400, max_num_batched_tokens=128, policy="fair", shared_prefill_tokens=32)
    )
    runner = FakeRunner(sched.kv)
    sched.add(make_request("b", 4, 3, client="B"))
    sched.add(make_request("a", 300, 2, first=1, client="A"))
    plan = run_step(sched, runner)
    assert sum(s.num_tokens for s in plan.scheduled) <= 4 + 32
    log = StepLog()
    run_until_done(sched, runner, 50, log)
    # once b is done, a prefills at the full budget
    assert max(sum(s.num_tokens for s in p.scheduled) for p in log.plans) == 128
    check_no_leak(sched.kv)


def test_the_client_with_most_in_flight_is_preempted_first() -> None:
    sched = make_scheduler(24, max_num_batched_tokens=64, policy="fair")
    runner = FakeRunner(sched.kv)
    for i in range(3):
        sched.add(make_request(f"a{i}", 8, 30, first=i, client="A"))
    sched.add(make_request("b0", 8, 30, first=7, client="B"))
    log = StepLog()
    for _ in range(24):
        run_step(sched, runner, log)
    victims = [rid for p in log.plans for rid in p.preempted]
    assert victims and "b0" not in victims and victims[0] == "a2"
    run_until_done(sched, runner, 1000, log)
    check_no_leak(sched.kv)
