"""pagekv.sim.workload: length distributions, sharing by token ids, arrivals, bad input."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from pagekv.errors import InvalidRequestError
from pagekv.sim.workload import (
    DistKind,
    LengthDist,
    WorkloadKind,
    WorkloadSpec,
    arrival_times,
    build_workload,
    from_prompts,
    preset,
)


def test_lognormal_is_fitted_to_the_given_mean_and_std() -> None:
    dist = LengthDist(DistKind.LOGNORMAL, mean=161, std=160, max_len=1 << 20)
    samples = np.array(dist.sample(np.random.default_rng(0), 200_000))
    assert samples.min() >= 1
    assert samples.mean() == pytest.approx(161, rel=0.02)
    assert samples.std() == pytest.approx(160, rel=0.06)


def test_uniform_and_fixed_lengths() -> None:
    rng = np.random.default_rng(1)
    uniform = LengthDist.parse("uniform:32,512").sample(rng, 5000)
    assert min(uniform) >= 32 and max(uniform) <= 512
    assert set(LengthDist.parse("fixed:7").sample(rng, 10)) == {7}


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: LengthDist(DistKind.LOGNORMAL, mean=0, std=1), "mean >= 1"),
        (lambda: LengthDist(DistKind.FIXED, mean=-5), "mean >= 1"),
        (lambda: LengthDist(DistKind.LOGNORMAL, mean=100, std=-1), "std must be >= 0"),
        (lambda: LengthDist(DistKind.UNIFORM, low=-3, high=10), "1 <= low <= high"),
        (lambda: LengthDist(DistKind.UNIFORM, low=50, high=10), "1 <= low <= high"),
        (lambda: LengthDist.parse("lognormal:0,10"), "mean >= 1"),
        (lambda: LengthDist.parse("gamma:3,4"), "cannot read length distribution"),
        (lambda: LengthDist.parse("uniform:5"), "cannot read length distribution"),
        (lambda: LengthDist("poisson", mean=3), "must be one of"),
        (lambda: WorkloadSpec(num_requests=0), "num_requests must be >= 1"),
        (lambda: WorkloadSpec(rate=-1.0), "rate must be > 0"),
        (lambda: preset("nope"), "unknown workload 'nope'"),
    ],
)
def test_impossible_distributions_are_rejected_clearly(make, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidRequestError, match=message):
        make()


def _leading_common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_shared_prefixes_share_ids_and_nothing_else_does() -> None:
    requests = build_workload(preset("prefix", num_requests=60, num_prefixes=3))
    groups: dict[int, list[list[int]]] = {}
    for r in requests:
        groups.setdefault(r.prompt_token_ids[0], []).append(r.prompt_token_ids)
    assert len(groups) == 3  # every prompt starts with one of the three system prompts
    private: list[int] = [t for r in requests for o in r.outputs for t in o]
    for prompts in groups.values():
        # Fresh ids follow the prefix, so any two prompts of a group agree on it exactly.
        prefix_len = _leading_common(prompts[0], prompts[1])
        assert 24 <= prefix_len <= 80  # the prefix lengths are uniform in 24..80
        for p in prompts:
            assert p[:prefix_len] == prompts[0][:prefix_len]
            private += p[prefix_len:]
    assert len(private) == len(set(private))  # outside the prefixes, no id occurs twice


def test_multi_turn_prompts_extend_their_own_history() -> None:
    requests = build_workload(preset("chat", num_requests=8, num_turns=4))
    chat0 = [r for r in requests if r.request_id.startswith("chat-0-")]
    assert [r.follows for r in chat0] == [None, "chat-0-turn-0", "chat-0-turn-1", "chat-0-turn-2"]
    for before, after in itertools.pairwise(chat0):
        history = before.prompt_token_ids + list(before.outputs[0])
        assert after.prompt_token_ids[: len(history)] == history
        assert len(after.prompt_token_ids) > len(history)
    chat1 = [r for r in requests if r.request_id.startswith("chat-1-")]
    assert not set(chat0[-1].prompt_token_ids) & set(chat1[-1].prompt_token_ids)


def test_parallel_sampling_has_n_distinct_outputs() -> None:
    requests = build_workload(preset("parallel", num_requests=5, n=3))
    assert all(len(r.outputs) == 3 for r in requests)
    outs = [t for r in requests for o in r.outputs for t in o]
    assert len(outs) == len(set(outs))


def test_arrivals_all_at_once_or_poisson() -> None:
    assert arrival_times(None, 4, np.random.default_rng(0)) == [0.0] * 4
    times = arrival_times(10.0, 20_000, np.random.default_rng(0))
    gaps = np.diff(times)
    assert times[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.1, rel=0.03)


def test_workloads_are_deterministic_in_the_seed() -> None:
    a = build_workload(preset("sharegpt", num_requests=50, seed=3))
    b = build_workload(preset("sharegpt", num_requests=50, seed=3))
    c = build_workload(preset("sharegpt", num_requests=50, seed=4))
    assert a == b and a != c
    assert build_workload(WorkloadSpec(kind=WorkloadKind.SYNTHETIC, num_requests=2))


def test_from_prompts_keeps_ids_and_draws_outputs_above_them() -> None:
    requests = from_prompts([[5, 6, 7], [9]], [2, 3])
    assert [r.prompt_token_ids for r in requests] == [[5, 6, 7], [9]]
    assert all(t > 9 for r in requests for t in r.outputs[0])
    assert [len(r.outputs[0]) for r in requests] == [2, 3]
