"""N-gram speculative decoding in the core: drafting, acceptance, and the scheduler driving it.

The scheduler runs here against the fake runner (no model): a deterministic 'model' that mostly
repeats itself, so drafts are often right and sometimes wrong, and every step's K/V history is
re-read through the block tables, so a draft's K/V left in the wrong place, or a rejected one
read as history, fails the test.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from pagekv.core.ngram_index import NgramIndex
from pagekv.core.request import Request
from pagekv.core.scheduler import Scheduler
from pagekv.core.scheduler_config import SchedulerConfig
from pagekv.core.speculation import NgramProposer, accept
from pagekv.errors import InvalidRequestError
from pagekv.sampling_params import SamplingParams
from tests.core.fakes import (
    VOCAB,
    FakeRunner,
    StepLog,
    expected_output,
    make_request,
    make_scheduler,
    run_until_done,
)


def greedy(max_tokens: int = 16, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)  # type: ignore[arg-type]


# ---- drafting -----------------------------------------------------------------------------------


def test_draft_copies_what_followed_the_latest_match() -> None:
    tokens = [5, 1, 2, 3, 9, 1, 2, 4, 7, 1, 2]
    index = NgramIndex(max_n=3)
    # "1 2" was last followed by 4 (position 7), not by 3: the latest occurrence wins
    assert index.draft(tokens, 1, 3) == [4, 7, 1]
    assert index.draft([*tokens, 8], 1, 2) == []  # 8 never seen before
    assert NgramIndex(max_n=3).draft([1, 2, 3], 1, 4) == []  # nothing repeats


def test_a_longer_match_beats_a_later_shorter_one() -> None:
    tokens = [1, 2, 3, 9, 2, 3, 5, 0, 1, 2, 3]
    assert NgramIndex(max_n=3).draft(tokens, 1, 2) == [9, 2]  # "1 2 3" was followed by 9
    assert NgramIndex(max_n=2).draft(tokens, 1, 2) == [5, 0]  # "2 3", latest: by 5


def test_draft_runs_past_the_end_like_lz77() -> None:
    tokens = [7, 3, 9, 5, 7, 3, 9, 5, 7, 3]
    # "5 7 3" ends 4 back: 9 5, then the draft continues from its own tokens: 7 3 9 5 ...
    assert NgramIndex(max_n=4).draft(tokens, 1, 6) == [9, 5, 7, 3, 9, 5]
    assert NgramIndex(max_n=2).draft([4, 4, 4], 1, 3) == [4, 4, 4]


def test_index_grows_incrementally_and_matches_a_fresh_one() -> None:
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3]
    grown = NgramIndex(max_n=3)
    for end in range(1, len(tokens) + 1):
        for limit in (1, 3):
            assert grown.draft(tokens[:end], 1, limit) == NgramIndex(3).draft(
                tokens[:end], 1, limit
            )


def test_min_n_excludes_short_matches() -> None:
    tokens = [1, 2, 3, 4, 2]  # only "2" (n = 1) was seen before
    assert NgramIndex(4).draft(tokens, 1, 2) == [3, 4]
    assert NgramIndex(4).draft(tokens, 2, 2) == []


def test_accept_keeps_drafts_up_to_the_first_disagreement() -> None:
    assert accept([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all kept, plus the next token
    assert accept([4, 5, 6], [4, 9, 6, 7]) == [4, 9]  # 9 replaces the second draft
    assert accept([4, 5, 6], [8, 5, 6, 7]) == [8]  # a plain decode's worth
    assert accept([], [3]) == [3]
    with pytest.raises(ValueError):
        accept([4, 5], [4, 5])


def test_proposer_drafts_for_greedy_requests_without_logprobs_only() -> None:
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    proposer = NgramProposer(num_tokens=3)
    assert proposer.propose(Request("g", prompt, greedy()), 10) == [3, 1, 2]
    assert proposer.propose(Request("g", prompt, greedy()), 2) == [3, 1]  # the caller's limit
    sampled = SamplingParams(temperature=0.8, max_tokens=4)
    assert proposer.propose(Request("s", prompt, sampled), 10) == []
    assert proposer.propose(Request("l", prompt, greedy(logprobs=2)), 10) == []
    assert proposer.propose(Request("z", prompt, greedy()), 0) == []


@pytest.mark.parametrize(
    "fields",
    [
        {"num_speculative_tokens": -1},
        {"num_speculative_tokens": True},
        {"prompt_lookup_min": 0},
        {"prompt_lookup_min": 3, "prompt_lookup_max": 2},
    ],
)
def test_bad_speculation_settings_are_rejected(fields: dict[str, object]) -> None:
    with pytest.raises(InvalidRequestError):
        SchedulerConfig(**fields)  # type: ignore[arg-type]


# ---- the scheduler with drafts ------------------------------------------------------------------


def loopy(tokens: Sequence[int], request_id: str) -> int:
    """A 'model' that mostly repeats the token 3 back, and now and then does not: drafts by
    lookup are right most of the time and wrong some of the time."""
    if len(tokens) % 7 == 0:
        return (tokens[-1] * 17 + len(request_id)) % VOCAB
    return tokens[-3] if len(tokens) >= 3 else 1


def run(
    num_blocks: int, requests: list[Request], k: int, block_size: int = 4, **config: object
) -> tuple[StepLog, FakeRunner, Scheduler]:
    scheduler = make_scheduler(num_blocks, block_size, num_speculative_tokens=k, **config)
    runner = FakeRunner(scheduler.kv, model=loopy)
    for request in requests:
        scheduler.add(request)
    log = StepLog()
    run_until_done(scheduler, runner, 2000, log)
    assert not list(scheduler.kv.request_ids())  # every request's blocks given back
    assert scheduler.kv.usage().num_used_blocks == 0
    return log, runner, scheduler


def requests(n: int, max_tokens: int = 40) -> list[Request]:
    return [
        make_request(f"r{i}", 5 + 3 * i, max_tokens + 5 * (i % 3), first=11 * i) for i in range(n)
    ]


@pytest.mark.parametrize("k", [1, 3, 6])
def test_drafted_decoding_produces_the_tokens_of_plain_decoding(k: int) -> None:
    plain = requests(6)
    drafted = requests(6)
    log0, _, _ = run(200, plain, 0)
    log, _, scheduler = run(200, drafted, k)
    for a, b in zip(plain, drafted, strict=True):
        assert b.output_token_ids == expected_output(b, loopy) == a.output_token_ids
    counters = scheduler.counters
    assert counters.draft_tokens > 0
    assert 0 < counters.accepted_draft_tokens < counters.draft_tokens  # some right, some wrong
    assert len(log.plans) < len(log0.plans)  # fewer steps for the same tokens
    assert any(len(s.draft_token_ids) == k for p in log.plans for s in p.scheduled)


def test_drafts_stop_at_max_tokens_and_the_token_budget() -> None:
    reqs = [make_request(f"r{i}", 6, 9, first=3 * i) for i in range(4)]
    log, _, _ = run(200, reqs, 8, max_num_batched_tokens=8)
    for plan in log.plans:
        assert plan.num_batched_tokens <= 8
        for s in plan.scheduled:
            request = s.request
            assert len(s.draft_token_ids) <= request.params.max_tokens - (
                s.start_position + 1 - request.num_prompt_tokens
            )
    for request in reqs:
        assert request.num_output_tokens == 9
        assert request.output_token_ids == expected_output(request, loopy)


def test_a_stop_token_inside_the_accepted_drafts_ends_the_request_there() -> None:
    reference = make_request("r", 5, 60)
    want = expected_output(reference, loopy)
    stop = want[20]  # a token the model produces (perhaps earlier too): stop at its first
    first = want.index(stop)
    params = SamplingParams(temperature=0, max_tokens=60, stop_token_ids=(stop,))
    request = Request("r", reference.prompt_token_ids, params)
    run(200, [request], 5)
    assert request.output_token_ids == want[: first + 1]


def test_drafts_never_preempt_and_a_tight_pool_still_finishes() -> None:
    # 14 blocks of 4 slots for 5 requests of up to ~70 tokens: preemptions happen; a draft
    # only uses room that is free, and the outputs are still those of plain decoding
    reqs = requests(5, max_tokens=30)
    _, _, scheduler = run(14, reqs, 4)
    for request in reqs:
        assert request.output_token_ids == expected_output(request, loopy)
    counters = scheduler.counters
    assert counters.preemptions_recompute > 0
    assert counters.accepted_draft_tokens > 0


def test_sampled_requests_are_not_drafted_for() -> None:
    params = SamplingParams(temperature=0.7, max_tokens=20, seed=1)
    request = Request("s", [1, 2, 3, 1, 2, 3, 1, 2], params)
    log, _, _ = run(50, [request], 4)
    assert all(not s.draft_token_ids for p in log.plans for s in p.scheduled)
    assert request.num_output_tokens == 20
