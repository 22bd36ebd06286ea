"""Scheduler unit tests on the real Scheduler and KVCacheManager with a fake runner (no model).

Block size is 4 unless a test says otherwise. Each scenario runs through ``run_step``, which
checks the manager's invariants and the plan before and after the fake runner executes it.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, fields

import pytest

from pagekv.core import KVCacheManager, Request, RequestStatus
from pagekv.core.invariants import check_no_leak
from pagekv.core.policy import RequestOrder
from pagekv.core.scheduler import (
    PreemptionCostModel,
    PreemptionMode,
    Scheduler,
    SchedulerConfig,
    SchedulerCounters,
    SchedulingPolicy,
)
from pagekv.engine.config import EngineConfig
from pagekv.errors import InvalidRequestError, PromptTooLongError
from tests.core.fakes import (
    FakeRunner,
    StepLog,
    expected_output,
    make_request,
    make_scheduler,
    run_step,
    run_until_done,
)

ABORT = RequestStatus.FINISHED_ABORTED


def scheduled_ids(plan_scheduled: object) -> list[str]:
    return [s.request.request_id for s in plan_scheduled]  # type: ignore[attr-defined]


# ---- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_num_batched_tokens": 15, "block_size": 16}, "max_num_batched_tokens"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_seqs": -1}, "max_num_seqs"),
        ({"max_num_seqs": "4"}, "max_num_seqs"),
        ({"max_num_batched_tokens": 32.0}, "max_num_batched_tokens"),
        ({"policy": "lottery"}, "policy"),
        ({"preemption_mode": "pray"}, "preemption_mode"),
        ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
        ({"priority_aging_steps": -5}, "priority_aging_steps"),
        ({"block_size": 0}, "block_size"),
        ({"watermark": 1.0}, "watermark"),
    ],
)
def test_scheduler_config_rejects_bad_values_naming_them(
    kwargs: dict[str, object], param: str
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SchedulerConfig(**kwargs)  # type: ignore[arg-type]
    assert info.value.param == param
    assert param in str(info.value)


def test_budget_below_block_size_message_says_why() -> None:
    with pytest.raises(InvalidRequestError, match=r"must be an integer >= block_size \(16\)"):
        SchedulerConfig(max_num_batched_tokens=8, block_size=16)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_num_batched_tokens": 8, "block_size": 16}, "max_num_batched_tokens"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"scheduling_policy": "sjf"}, "scheduling_policy"),
        ({"preemption_mode": "never"}, "preemption_mode"),
    ],
)
def test_engine_config_rejects_bad_scheduler_settings_at_start_up(
    kwargs: dict[str, object], param: str
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        EngineConfig(**kwargs)  # type: ignore[arg-type]
    assert info.value.param == param


def test_strings_become_enums_and_block_size_must_match_the_manager() -> None:
    cfg = SchedulerConfig(policy="priority", preemption_mode="auto", block_size=4)  # type: ignore[arg-type]
    assert cfg.policy is SchedulingPolicy.PRIORITY
    assert cfg.preemption_mode is PreemptionMode.AUTO
    with pytest.raises(InvalidRequestError) as info:
        Scheduler(cfg, KVCacheManager(16, block_size=8))
    assert info.value.param == "block_size"


def test_counters_are_a_flat_dataclass_of_ints() -> None:
    counters = SchedulerCounters()
    assert all(f.type in ("int", int) for f in fields(counters))
    assert all(type(v) is int for v in asdict(counters).values())


# ---- admission and rejection -------------------------------------------------------------------


def test_request_that_can_never_fit_is_rejected_before_queueing() -> None:
    sched = make_scheduler(8, max_model_len=40)
    with pytest.raises(PromptTooLongError) as info:
        sched.add(make_request("ctx", 30, 20))  # 50 > max_model_len 40
    assert info.value.param == "max_tokens"
    with pytest.raises(PromptTooLongError):
        sched.add(make_request("pool", 30, 5))  # 35 tokens = 9 blocks > the pool's 8
    assert sched.num_unfinished == 0
    assert sched.counters.rejected_requests == 2
    assert sched.counters.added_requests == 0


@pytest.mark.parametrize("priority", [1.5, "1", None, True, 2**0.5])
def test_non_integer_priority_is_rejected_naming_priority(priority: object) -> None:
    sched = make_scheduler(16)
    request = make_request("a", 4, 2)
    request.priority = priority  # type: ignore[assignment]
    with pytest.raises(InvalidRequestError) as info:
        sched.add(request)
    assert info.value.param == "priority"
    assert sched.num_unfinished == 0 and sched.counters.added_requests == 0
    with pytest.raises(InvalidRequestError):
        Scheduler.check_priority(priority)
    # Finishing a request whose add failed is harmless (the engine aborts a failed batch).
    sched.finish(request, ABORT)
    check_no_leak(sched.kv)


def test_negative_priority_is_allowed_and_served_first() -> None:
    sched = make_scheduler(64, policy="priority", max_num_seqs=1)
    for rid, priority in [("zero", 0), ("minus", -3), ("plus", 2), ("minus2", -3)]:
        sched.add(make_request(rid, 4, 1, priority=priority))
    order = []
    runner = FakeRunner(sched.kv)
    for _ in range(8):
        plan = run_step(sched, runner)
        order += [i for i in scheduled_ids(plan.scheduled) if i not in order]
    assert order == ["minus", "minus2", "zero", "plus"]  # equal priorities: first come first


def test_fcfs_admits_head_of_line_only() -> None:
    """A big request at the head that does not fit blocks the small ones behind it."""
    sched = make_scheduler(12, watermark=0.0, max_num_batched_tokens=64)
    runner = FakeRunner(sched.kv)
    sched.add(make_request("first", 24, 8))  # 6 blocks now, up to 8
    run_step(sched, runner)
    sched.add(make_request("big", 24, 4, first=5))  # 6 blocks; 5 left after first grows
    sched.add(make_request("small", 2, 1, first=6))  # would fit, but is behind "big"
    plan = run_step(sched, runner)
    assert scheduled_ids(plan.scheduled) == ["first"]
    assert [r.request_id for r in sched.waiting] == ["big", "small"]


def test_a_request_waits_one_step_for_a_prefix_another_computes_now() -> None:
    """Two requests with one prompt arrive together: the second waits a step (the first's
    prefill completes the 3 shareable blocks) and then hits them instead of computing them a
    second time in the same step. Without prefix caching there is nothing to wait for."""
    for caching in (True, False):
        kv = KVCacheManager(32, 4, enable_prefix_caching=caching)
        sched = Scheduler(SchedulerConfig(block_size=4), kv)
        runner = FakeRunner(kv)
        sched.add(make_request("a", 14, 2))
        sched.add(make_request("b", 14, 2))
        first = run_step(sched, runner)
        if not caching:
            assert scheduled_ids(first.scheduled) == ["a", "b"]
            continue
        assert scheduled_ids(first.scheduled) == ["a"]
        second = run_step(sched, runner)
        (entry,) = [s for s in second.scheduled if s.request.request_id == "b"]
        assert (entry.start_position, entry.num_tokens) == (12, 2)
        assert entry.request.num_cached_prompt_tokens == 12
        run_until_done(sched, runner, max_steps=10)


# ---- order and aging ----------------------------------------------------------------------------


def test_aging_key_serves_a_low_priority_request_as_if_it_arrived_later() -> None:
    order = RequestOrder(SchedulingPolicy.PRIORITY, aging_steps=10)
    low = make_request("low", 1, 1, priority=3)
    order.register(low, arrival_step=0)  # served as if priority 0 arriving at step 30
    early, late = make_request("early", 1, 1), make_request("late", 1, 1)
    order.register(early, arrival_step=29)
    order.register(late, arrival_step=31)
    assert order.key(early) < order.key(low) < order.key(late)
    strict = RequestOrder(SchedulingPolicy.PRIORITY, aging_steps=0)
    strict.register(low, 0)
    strict.register(late, 10**9)
    assert strict.key(late) < strict.key(low)  # no aging: the urgent one always wins


# ---- preemption -----------------------------------------------------------------------------


def _pressure(policy: str = "fcfs", mode: str = "recompute", host: int = 0) -> Scheduler:
    """Three requests of 2 blocks each in a 7-block pool; the next decode needs a third block
    for each of them: someone must go."""
    sched = make_scheduler(
        7, num_host_blocks=host, policy=policy, preemption_mode=mode, watermark=0.0
    )
    return sched


def _fill(sched: Scheduler, priorities: tuple[int, int, int] = (0, 0, 0)) -> FakeRunner:
    runner = FakeRunner(sched.kv)
    for i, p in enumerate(priorities):
        sched.add(make_request(f"r{i}", 7, 6, priority=p, first=i))
    run_step(sched, runner)  # prefill 7 tokens each: 2 blocks, 1 free slot left in block 2
    run_step(sched, runner)  # decode: position 7 fills block 2
    assert sched.kv.pool.num_free_blocks == 1
    return runner


def test_fcfs_preempts_the_newest_by_recompute_and_it_resumes_first() -> None:
    sched = _pressure()
    runner = _fill(sched)
    plan = run_step(sched, runner)  # r0 takes the free block; r1 needs one: r2 (newest) goes
    assert plan.preempted == ("r2",)
    assert scheduled_ids(plan.scheduled) == ["r0", "r1"]
    r2 = next(iter(sched.waiting))
    assert r2.status is RequestStatus.WAITING and r2.num_computed_tokens == 0
    assert sched.counters.preemptions_recompute == 1
    assert sched.counters.recomputed_tokens == 8  # 7 prompt + 1 decoded token
    sched.add(make_request("late", 2, 1))
    assert [r.request_id for r in sched.waiting] == ["r2", "late"]  # back at the head
    log = StepLog()
    run_until_done(sched, runner, 100, log)
    first: dict[str, int] = {}
    for plan in log.plans:
        for rid in scheduled_ids(plan.scheduled):
            first.setdefault(rid, plan.step)
    assert first["r2"] <= first["late"]
    assert r2.output_token_ids == expected_output(r2)
    check_no_leak(sched.kv)


def test_priority_preempts_the_lowest_priority_even_if_older() -> None:
    sched = _pressure(policy="priority")
    runner = _fill(sched, priorities=(5, 0, 0))  # r0 oldest but least urgent
    plan = run_step(sched, runner)
    assert plan.preempted == ("r0",)
    run_until_done(sched, runner, 100)
    check_no_leak(sched.kv)


def test_priority_ties_preempt_the_newest() -> None:
    sched = _pressure(policy="priority")
    runner = _fill(sched, priorities=(1, 1, 0))
    plan = run_step(sched, runner)
    assert plan.preempted == ("r1",)


def test_swap_moves_blocks_to_host_and_back_before_the_next_decode() -> None:
    sched = _pressure(mode="swap", host=8)
    runner = _fill(sched)
    plan = run_step(sched, runner)
    assert plan.preempted == ("r2",)
    assert len(plan.transfers.swap_out) == 2
    r2 = next(iter(sched.swapped))
    assert r2.status is RequestStatus.SWAPPED and r2.num_computed_tokens == 8
    assert sched.kv.is_swapped("r2")
    assert sched.counters.preemptions_swap == 1 and sched.counters.preemption_swapped_blocks == 2
    log = StepLog()
    run_until_done(sched, runner, 100, log)  # FakeRunner re-reads r2's history on return
    back = [p for p in log.plans if "r2" in scheduled_ids(p.scheduled)]
    assert back[0].transfers.swap_in, "r2 decodes again only in the step that swaps it in"
    assert sched.counters.swapped_in_requests == 1
    assert r2.output_token_ids == expected_output(r2)
    check_no_leak(sched.kv)


def test_a_swapped_request_filling_the_pool_comes_back_alone() -> None:
    """Next to others a swapped request waits for room plus a block plus the watermark; once
    nothing runs it must come back with whatever it needs, or it would wait forever."""
    sched = make_scheduler(
        25, num_host_blocks=32, preemption_mode="swap", watermark=0.04, max_num_batched_tokens=128
    )
    runner = FakeRunner(sched.kv)
    sched.add(make_request("a", 1, 6))
    run_step(sched, runner)
    big = make_request("big", 91, 4, first=7)  # 95 tokens: 24 of the pool's 25 blocks
    sched.add(big)
    log = StepLog()
    run_until_done(sched, runner, 100, log)
    assert sched.counters.preemptions_swap == 1
    assert big.num_preemptions == 1 and big.output_token_ids == expected_output(big)
    check_no_leak(sched.kv)


@pytest.mark.parametrize("host", [0, 1])
def test_swap_without_host_room_falls_back_to_recompute(host: int) -> None:
    sched = _pressure(mode="swap", host=host)
    runner = _fill(sched)
    plan = run_step(sched, runner)
    assert plan.preempted == ("r2",)
    assert sched.counters.preemptions_swap == 0
    assert sched.counters.preemptions_recompute == sched.counters.swap_fallbacks == 1
    run_until_done(sched, runner, 100)
    check_no_leak(sched.kv)


def test_auto_chooses_per_victim_by_the_cost_model() -> None:
    # Swap costs 2 * (10 ms + 0.5 ms per block); recompute 1 ms per token: with 4-token blocks
    # swapping pays off for victims over ~27 tokens. "short" holds at most 22 tokens, "long" 40.
    cost = PreemptionCostModel(recompute_s_per_token=1e-3, swap_s_per_block=5e-4, swap_s_fixed=1e-2)
    assert not cost.prefers_swap(5, 2) and cost.prefers_swap(40, 10)
    sched = make_scheduler(
        16, num_host_blocks=16, preemption_mode="auto", cost_model=cost, watermark=0.0
    )
    runner = FakeRunner(sched.kv)
    sched.add(make_request("old", 23, 20))
    sched.add(make_request("long", 39, 20, first=1))
    run_step(sched, runner)
    run_step(sched, runner)  # long: 40 computed, 10 blocks; old 24, 6 blocks: pool full
    sched.add(make_request("short", 4, 30, first=2))
    plan = run_step(sched, runner)  # old needs a block: long is the newest running
    assert plan.preempted == ("long",)
    assert sched.counters.preemptions_swap == 1
    # Now "short" runs next to "old" and both grow until "short" (newest) must go.
    for _ in range(40):
        if sched.counters.preemptions_recompute:
            break
        run_step(sched, runner)
    assert sched.counters.preemptions_recompute == 1 and sched.counters.preemptions_swap == 1
    assert sched.counters.recomputed_tokens <= 22
    run_until_done(sched, runner, 200)
    check_no_leak(sched.kv)


def test_cost_model_rejects_negative_constants() -> None:
    with pytest.raises(InvalidRequestError) as info:
        PreemptionCostModel(swap_s_per_block=-1.0)
    assert info.value.param == "swap_s_per_block"
    assert PreemptionCostModel().swap_s(0) > 0
    assert PreemptionCostModel().recompute_s(0) == 0


def test_a_lone_request_that_cannot_grow_preempts_itself_and_comes_back() -> None:
    sched = make_scheduler(4, watermark=0.0, max_num_batched_tokens=16)
    runner = FakeRunner(sched.kv)
    sched.add(make_request("a", 8, 8))  # 16 tokens = the whole pool
    sched.add(make_request("b", 4, 8, first=1))
    run_until_done(sched, runner, 200)
    assert sched.counters.preemptions_recompute >= 1
    check_no_leak(sched.kv)


# ---- chunked prefill and the budget ---------------------------------------------------------


def test_long_prompt_is_chunked_while_others_decode_every_step() -> None:
    sched = make_scheduler(64, max_num_batched_tokens=16)
    runner = FakeRunner(sched.kv)
    for i in range(3):
        sched.add(make_request(f"d{i}", 3, 40, first=i))
    run_step(sched, runner)
    sched.add(make_request("long", 100, 2, first=9))
    log = StepLog()
    while "long" not in log.finished:
        plan = run_step(sched, runner, log)
        tokens = {s.request.request_id: s.num_tokens for s in plan.scheduled}
        assert [tokens[f"d{i}"] for i in range(3)] == [1, 1, 1], "a decode stalled"
        assert plan.num_batched_tokens <= 16
    prefill_steps = [p for p in log.plans if any(s.num_tokens > 1 for s in p.scheduled)]
    assert len(prefill_steps) == 8  # 100 tokens at 13 per step
    run_until_done(sched, runner, 200)
    check_no_leak(sched.kv)


def test_a_prefill_ahead_of_decodes_leaves_them_a_token_each() -> None:
    """An urgent long prompt sorts before running decodes; its chunks leave each a token."""
    sched = make_scheduler(64, max_num_batched_tokens=16, policy="priority")
    runner = FakeRunner(sched.kv)
    for i in range(4):
        sched.add(make_request(f"d{i}", 1, 20, priority=5, first=i + 1))
    run_step(sched, runner)
    sched.add(make_request("long", 60, 2, priority=-5))
    plan = run_step(sched, runner)  # decodes first (running), then long admitted with the rest
    assert [s.num_tokens for s in plan.scheduled] == [1, 1, 1, 1, 12]
    for _ in range(4):  # 48 tokens left: long now leads the running order
        plan = run_step(sched, runner)
        assert scheduled_ids(plan.scheduled) == ["long", "d0", "d1", "d2", "d3"]
        assert [s.num_tokens for s in plan.scheduled] == [12, 1, 1, 1, 1]
    run_until_done(sched, runner, 200)
    check_no_leak(sched.kv)


def test_long_prefill_threshold_caps_one_request_per_step() -> None:
    sched = make_scheduler(64, max_num_batched_tokens=64, long_prefill_token_threshold=8)
    runner = FakeRunner(sched.kv)
    sched.add(make_request("a", 30, 1))
    sched.add(make_request("b", 30, 1, first=1))
    plan = run_step(sched, runner)
    assert [s.num_tokens for s in plan.scheduled] == [8, 8]
    log = StepLog()
    run_until_done(sched, runner, 50, log)
    assert len(log.plans) == 3  # then 8 + 8 + 6: the last chunk samples the one output token


def test_max_num_seqs_caps_every_step() -> None:
    sched = make_scheduler(128, max_num_seqs=3)
    runner = FakeRunner(sched.kv)
    for i in range(7):
        sched.add(make_request(f"r{i}", 5, 4, first=i))
    log = StepLog()
    run_until_done(sched, runner, 100, log)
    assert max(len(p.scheduled) for p in log.plans) == 3
    assert len(log.finished) == 7


# ---- abort in every state --------------------------------------------------------------------


def _branches(parent: Request, n: int) -> list[Request]:
    """The other n - 1 sequences of ``parent``'s user request (for ``Scheduler.add_group``)."""
    return [
        Request(f"{parent.request_id}#{i}", parent.prompt_token_ids, parent.params)
        for i in range(1, n)
    ]


def _state_scenario(state: str) -> tuple[Scheduler, FakeRunner, Request]:
    """A scheduler under load with the request ``target`` in ``state``."""
    sched = make_scheduler(
        10, num_host_blocks=16, preemption_mode="swap", max_num_batched_tokens=8, watermark=0.0
    )
    runner = FakeRunner(sched.kv)
    sched.add(make_request("other", 6, 20))
    prompt_len, max_tokens = (22, 8) if state == "mid_prefill" else (5, 20)
    target = make_request("target", prompt_len, max_tokens, first=3)
    branches: list[Request] = []
    if state in ("fork_pending", "parent_with_branches"):
        branches = _branches(target, 3)
    sched.add_group(target, branches)
    if state == "waiting":
        return sched, runner, target
    run_step(sched, runner)
    if state == "fork_pending":
        return sched, runner, branches[0]
    if state in ("running", "mid_prefill", "parent_with_branches"):
        return sched, runner, target
    while target.status is RequestStatus.RUNNING:  # "other" grows until "target" must go
        run_step(sched, runner)
    return sched, runner, target


@pytest.mark.parametrize(
    "state",
    ["waiting", "running", "mid_prefill", "swapped", "fork_pending", "parent_with_branches"],
)
def test_abort_in_any_state_frees_everything_at_once(state: str) -> None:
    sched, runner, target = _state_scenario(state)
    expected = {
        "waiting": RequestStatus.WAITING,
        "running": RequestStatus.RUNNING,
        "mid_prefill": RequestStatus.RUNNING,
        "swapped": RequestStatus.SWAPPED,
        "fork_pending": RequestStatus.FORK_PENDING,
        "parent_with_branches": RequestStatus.RUNNING,
    }[state]
    assert target.status is expected
    if state == "mid_prefill":
        assert 0 < target.num_computed_tokens < target.num_prompt_tokens
    pending = list(target.fork_children)
    before = sched.counters.aborted_requests
    counted = 0 if state == "fork_pending" else 1  # an unforked branch never entered
    sched.finish(target, ABORT)
    rid = target.request_id
    assert target.status is ABORT
    assert not sched.kv.has_table(rid) and not sched.kv.is_swapped(rid)
    assert all(target is not r for q in (sched.waiting, sched.running, sched.swapped) for r in q)
    assert all(b.status is ABORT for b in pending)  # a parent takes its unforked branches along
    assert sched.counters.aborted_requests == before + counted
    sched.finish(target, ABORT)  # twice: a no-op
    assert sched.counters.aborted_requests == before + counted
    run_until_done(sched, runner, 200)
    check_no_leak(sched.kv)
    c = sched.counters
    assert c.added_requests == c.finished_requests + c.aborted_requests


def test_abort_after_schedule_before_update_is_skipped_by_update() -> None:
    sched = make_scheduler(16)
    runner = FakeRunner(sched.kv)
    sched.add(make_request("a", 5, 4))
    sched.add(make_request("b", 5, 4, first=1))
    plan = sched.schedule()
    sampled = runner.execute(plan)
    sched.finish(plan.scheduled[0].request, ABORT)
    done = sched.update(plan, sampled)
    assert done == []
    assert plan.scheduled[0].request.num_computed_tokens == 0
    assert plan.scheduled[1].request.num_computed_tokens == 5
    run_until_done(sched, runner, 50)
    check_no_leak(sched.kv)


def test_parallel_branches_fork_after_the_prompt_and_finish() -> None:
    sched = make_scheduler(32)
    runner = FakeRunner(sched.kv)
    parent = make_request("p", 9, 3)
    branches = _branches(parent, 3)
    assert sched.add_group(parent, branches) == [parent]
    assert sched.counters.added_requests == 1
    plan = run_step(sched, runner)
    assert plan.scheduled[0].num_tokens == 8  # all but the last prompt token
    assert all(b.status is RequestStatus.RUNNING for b in branches)
    assert sched.counters.added_requests == 3
    later = make_request("later", 3, 1, first=5)
    sched.add(later)
    assert [r.request_id for r in sched.running] == ["p", "p#1", "p#2"]
    assert sched.order.key(branches[1]) < sched.order.key(later)  # branches arrived with p
    run_until_done(sched, runner, 50)
    assert sched.counters.finished_requests == sched.counters.added_requests == 4
    check_no_leak(sched.kv)


def test_add_group_queues_the_parent_and_parks_the_branches_on_it() -> None:
    sched = make_scheduler(32)
    parent = make_request("p", 9, 3)
    branches = _branches(parent, 3)
    assert sched.add_group(parent, branches) == [parent]
    assert list(sched.waiting) == [parent] and parent.status is RequestStatus.WAITING
    assert parent.fork_children == branches and parent.fork_children is not branches
    assert all(b.status is RequestStatus.FORK_PENDING for b in branches)
    assert sched.counters.added_requests == 1  # the branches enter when forked


def test_add_group_queues_each_sequence_of_a_one_token_prompt() -> None:
    """A one-token prompt has no block to share before its last token: no fork."""
    sched = make_scheduler(32)
    parent = make_request("p", 1, 3)
    branches = _branches(parent, 3)
    assert sched.add_group(parent, branches) == [parent, *branches]
    assert list(sched.waiting) == [parent, *branches]
    assert parent.fork_children == []
    assert all(r.status is RequestStatus.WAITING for r in (parent, *branches))
    assert sched.counters.added_requests == 3
    run_until_done(sched, FakeRunner(sched.kv), 50)
    assert sched.counters.finished_requests == 3
    check_no_leak(sched.kv)


def test_add_group_of_one_is_add() -> None:
    sched = make_scheduler(32)
    alone = make_request("a", 5, 3)
    assert sched.add_group(alone, []) == [alone]
    assert list(sched.waiting) == [alone] and alone.fork_children == []


def test_add_group_rejects_before_anything_is_queued() -> None:
    sched = make_scheduler(4)
    parent = make_request("p", 9, 20)  # 29 tokens: more than the 16 slots of the pool
    branches = _branches(parent, 3)
    with pytest.raises(PromptTooLongError):
        sched.add_group(parent, branches)
    assert not sched.waiting and parent.fork_children == []
    assert all(b.status is RequestStatus.WAITING for b in branches)
    assert sched.counters.rejected_requests == 1 and sched.counters.added_requests == 0


def test_a_held_request_is_skipped_until_released() -> None:
    """A request whose target equals its computed tokens (a beam waiting for its siblings)
    gets nothing this step, keeps its blocks, and continues once released."""
    sched = make_scheduler(32)
    runner = FakeRunner(sched.kv)
    a, b = make_request("a", 5, 4), make_request("b", 5, 4, first=1)
    sched.add(a)
    sched.add(b)
    run_step(sched, runner)
    a.hold()  # its last token stays uncomputed
    plan = run_step(sched, runner)
    assert scheduled_ids(plan.scheduled) == ["b"]
    assert a.status is RequestStatus.RUNNING and sched.kv.has_table("a")
    a.release_hold()
    plan = run_step(sched, runner)
    assert scheduled_ids(plan.scheduled) == ["a", "b"]
    run_until_done(sched, runner, 50)
    assert a.output_token_ids == expected_output(a)
    check_no_leak(sched.kv)


# ---- observability --------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_preemption_log_is_rate_limited_and_counts_the_suppressed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    kv = KVCacheManager(7, 4)
    sched = Scheduler(
        SchedulerConfig(block_size=4, watermark=0.0, preemption_log_interval_s=5.0), kv, clock=clock
    )
    caplog.set_level(logging.WARNING, logger="pagekv")
    for _ in range(4):
        sched.preemptor.log_preemption(make_request("x", 1, 1), "recompute", 3, sched.step)
        clock.now += 1.0
    assert len(caplog.records) == 1
    assert "preempted request 'x' by recompute" in caplog.records[0].getMessage()
    clock.now += 5.0
    sched.preemptor.log_preemption(make_request("y", 1, 1), "swap", 2, sched.step)
    assert len(caplog.records) == 2
    assert "(3 similar messages suppressed in the last 9 s)" in caplog.records[1].getMessage()
    assert caplog.records[1].name == "pagekv"


def test_preemptions_are_logged_through_the_pagekv_logger(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="pagekv")
    sched = _pressure()
    runner = _fill(sched)
    run_step(sched, runner)
    assert any("preempted request 'r2'" in r.getMessage() for r in caplog.records)
