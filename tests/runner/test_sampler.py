"""Sampler: greedy, filters, seeded reproducibility inside batches, distribution, logprobs."""

from __future__ import annotations

import random

import pytest
import torch

from pagekv.runner import sampler
from pagekv.runner.sampler import (
    CANDIDATES,
    Sampler,
    SamplingRow,
    apply_penalties,
    filter_candidates,
    filter_sorted,
)
from pagekv.sampling_params import SamplingParams


def _logits(num_rows: int, vocab_size: int, seed: int, spread: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab_size, generator=gen) * spread  # [B, V]


def _rows(params: SamplingParams, num_rows: int) -> list[SamplingRow]:
    return [SamplingRow(params, None) for _ in range(num_rows)]


def test_greedy_is_argmax_with_ties_to_lowest_id() -> None:
    logits = _logits(32, 100, seed=0)
    logits[0, [7, 3, 50]] = 100.0  # three-way tie: id 3 must win
    logits_before = logits.clone()
    out = Sampler()(logits, _rows(SamplingParams(temperature=0.0), 32))
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.token_ids[0] == 3
    assert out.logprobs is None and out.top_logprobs == [None] * 32
    assert torch.equal(logits, logits_before)  # the caller's logits are not modified


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=2.0, top_p=1e-6),
        SamplingParams(temperature=1.0, min_p=1.0),
    ],
)
def test_degenerate_filters_equal_greedy(params: SamplingParams) -> None:
    logits = _logits(64, 500, seed=1)
    torch.manual_seed(0)
    out = Sampler()(logits, _rows(params, 64))
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def _allowed(logits: torch.Tensor, params: SamplingParams) -> set[int]:
    """Tokens the filters may keep, computed independently in plain Python (one row [V])."""
    probs = torch.softmax(logits.double() / params.temperature, dim=-1).tolist()
    order = sorted(range(len(probs)), key=lambda t: -probs[t])
    if params.top_k is not None:
        order = order[: params.top_k]
    total = sum(probs[t] for t in order)
    kept, mass = [], 0.0
    for t in order:
        kept.append(t)
        mass += probs[t] / total
        if mass >= params.top_p:
            break
    top = max(probs[t] for t in kept)
    kept_mass = sum(probs[t] for t in kept)
    return {t for t in kept if probs[t] / kept_mass >= params.min_p * top / kept_mass}


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.6),
        SamplingParams(temperature=0.8, min_p=0.1),
        SamplingParams(temperature=1.5, top_k=20, top_p=0.8, min_p=0.05),
    ],
)
def test_filters_never_pick_a_filtered_token(params: SamplingParams) -> None:
    row_logits = _logits(1, 64, seed=2, spread=1.5)[0]  # [V]
    allowed = _allowed(row_logits, params)
    torch.manual_seed(1)
    out = Sampler()(row_logits.expand(4000, -1), _rows(params, 4000))
    picked = set(out.token_ids)
    assert picked <= allowed
    assert len(picked) >= min(len(allowed), 3)  # and it really samples, not just argmax


def _random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.0, 0.5, 1.0, 1.7]),
        top_k=rng.choice([None, 1, 10, 200]),
        top_p=rng.choice([1.0, 0.9, 0.3]),
        min_p=rng.choice([0.0, 0.0, 0.05]),
        logprobs=rng.choice([None, 0, 3]),
    )


def test_seeded_row_is_identical_alone_and_in_batches() -> None:
    vocab_size, num_steps = 1000, 6
    params = SamplingParams(temperature=1.2, top_p=0.95, seed=1234)
    step_logits = [_logits(1, vocab_size, seed=100 + s, spread=2.0)[0] for s in range(num_steps)]
    sampler = Sampler()

    alone_gen = torch.Generator().manual_seed(1234)
    alone = [
        sampler(step_logits[s][None], [SamplingRow(params, alone_gen)]).token_ids[0]
        for s in range(num_steps)
    ]
    assert len(set(alone)) > 1  # the generator advances between steps

    rng = random.Random(0)
    batch_gen = torch.Generator().manual_seed(1234)
    others = [
        SamplingRow(
            _random_params(rng),
            torch.Generator().manual_seed(rng.randrange(10**6)) if rng.random() < 0.5 else None,
        )
        for _ in range(16)
    ]
    torch.manual_seed(7)
    for s in range(num_steps):
        position = rng.randrange(17)  # the seeded row moves around the batch
        rows = [*others[:position], SamplingRow(params, batch_gen), *others[position:]]
        logits = _logits(17, vocab_size, seed=200 + s, spread=2.0)
        logits[position] = step_logits[s]
        assert sampler(logits, rows).token_ids[position] == alone[s]


def test_frequencies_match_tempered_softmax() -> None:
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.5])
    temperature, num_draws = 0.7, 40_000
    torch.manual_seed(3)
    out = Sampler()(
        logits.expand(num_draws, -1), _rows(SamplingParams(temperature=temperature), num_draws)
    )
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=6).double()
    freq = counts / num_draws
    expected = torch.softmax(logits.double() / temperature, dim=-1)
    std = (expected * (1 - expected) / num_draws).sqrt()
    assert torch.all((freq - expected).abs() < 5 * std + 1e-4), (freq, expected)


def test_seeded_generator_frequencies_match_softmax() -> None:
    logits = torch.tensor([[0.5, -0.3, 1.2, 0.0]])
    gen = torch.Generator().manual_seed(11)
    row = SamplingRow(SamplingParams(temperature=1.0, seed=11), gen)
    num_draws, sampler = 4000, Sampler()
    tokens = [sampler(logits, [row]).token_ids[0] for _ in range(num_draws)]
    freq = torch.bincount(torch.tensor(tokens), minlength=4).double() / num_draws
    expected = torch.softmax(logits[0].double(), dim=-1)
    std = (expected * (1 - expected) / num_draws).sqrt()
    assert torch.all((freq - expected).abs() < 5 * std), (freq, expected)


def test_logprobs_are_under_raw_logits() -> None:
    logits = _logits(4, 50, seed=4)
    rows = [
        SamplingRow(SamplingParams(temperature=0.0, logprobs=5)),
        SamplingRow(SamplingParams(temperature=0.5, top_k=3, logprobs=2)),
        SamplingRow(SamplingParams(temperature=1.0)),
        SamplingRow(SamplingParams(temperature=1.0, logprobs=0)),
    ]
    torch.manual_seed(5)
    out = Sampler()(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs is not None
    for i, token in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(raw[i, token].item(), abs=1e-6)
    for i, k in [(0, 5), (1, 2)]:
        top = out.top_logprobs[i]
        assert top is not None and len(top) == k
        values, ids = raw[i].topk(k)
        assert [t for t, _ in top] == ids.tolist()
        assert [lp for _, lp in top] == pytest.approx(values.tolist(), abs=1e-6)
    assert out.top_logprobs[2] is None
    assert out.top_logprobs[3] == []


def test_min_tokens_suppresses_eos_and_stop_ids() -> None:
    eos, stop = 4, 9
    logits = _logits(3, 20, seed=6)
    logits[:, eos] = 50.0
    logits[:, stop] = 40.0
    sampler = Sampler()
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, min_tokens=3, stop_token_ids=(stop,))
        early = [SamplingRow(params, None, num_generated=n, eos_token_ids=(eos,)) for n in range(3)]
        torch.manual_seed(8)
        tokens = sampler(logits, early).token_ids
        assert eos not in tokens and stop not in tokens
        done = SamplingRow(params, None, num_generated=3, eos_token_ids=(eos,))
        assert sampler(logits[:1], [done]).token_ids == [eos]

    ignore = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(stop,), ignore_eos=True)
    row = SamplingRow(ignore, None, num_generated=0, eos_token_ids=(eos,))
    assert sampler(logits[:1], [row]).token_ids == [eos]  # eos is not a stop when ignored
    logits[0, eos] = -50.0
    assert sampler(logits[:1], [row]).token_ids != [stop]  # stop ids still suppressed


def test_rejects_mismatched_rows() -> None:
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 5), _rows(SamplingParams(), 3))


def test_argmax_rows_matches_torch_with_ties_nan_and_infinities() -> None:
    from pagekv.runner.sampler import argmax_rows

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 1000, generator=gen)
    x[1, [10, 700]] = 50.0  # a tie: the lower id wins
    x[2, 333] = float("nan")  # NaN counts as the maximum
    x[3] = float("-inf")  # all -inf: id 0
    x[4, 999] = float("inf")
    x[5] = x[5].round()  # many ties
    got = argmax_rows(x)
    assert got.dtype == torch.int64
    assert got.tolist() == x.argmax(dim=-1).tolist()
    assert got[1] == 10 and got[2] == 333 and got[3] == 0 and got[4] == 999
    strided = x.t().contiguous().t()  # same values, column-major
    assert argmax_rows(strided).tolist() == got.tolist()


@pytest.mark.parametrize("cols", [1000, 49152, 7])
def test_argmax_rows_of_bfloat16_logits_match_float32(cols: int) -> None:
    """The bf16 path (the C kernel, logits read in place) agrees with the float32 argmax of the
    same values: ties to the lowest id, NaN as the maximum, rows shorter than a vector."""
    from pagekv.runner.sampler import argmax_rows

    gen = torch.Generator().manual_seed(cols)
    x = torch.randn(9, cols, generator=gen).bfloat16()
    x[1, [0, cols - 1]] = 50.0
    x[2, cols // 2] = float("nan")
    x[2, cols - 1] = float("nan")  # the first NaN counts
    x[3] = float("-inf")
    x[4, cols - 1] = float("inf")
    x[5] = x[5].round()
    got = argmax_rows(x)
    assert got.tolist() == x.float().argmax(dim=-1).tolist()
    assert got[1] == 0 and got[2] == cols // 2 and got[3] == 0 and got[4] == cols - 1


def test_greedy_rows_sample_bfloat16_logits_without_widening_them() -> None:
    """All-greedy rows take the bf16 logits as they are (min_tokens still suppresses EOS);
    a batch with a sampled or logprob row widens to float32 and samples as before."""
    logits = _logits(4, 300, seed=3).bfloat16()
    eos = int(logits[0].float().argmax())
    greedy = SamplingParams(temperature=0.0, min_tokens=2)
    rows = [SamplingRow(greedy, None, num_generated=n, eos_token_ids=(eos,)) for n in range(4)]
    out = Sampler()(logits, rows)
    assert out.logprobs is None and out.top_logprobs == [None] * 4
    assert out.token_ids == Sampler()(logits.float(), rows).token_ids
    assert out.token_ids[0] != eos  # suppressed below min_tokens
    logprob_rows = [SamplingRow(SamplingParams(temperature=0.0, logprobs=2))] * 4
    widened = Sampler()(logits, logprob_rows)
    assert widened.logprobs is not None and widened.token_ids == logits.float().argmax(-1).tolist()


def _penalized_by_hand(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """OpenAI's and vLLM's definitions, token by token."""
    out = logits.clone()
    p = row.params
    seen = set(row.prompt_token_ids) | set(row.output_token_ids)
    for t in range(len(out)):
        if t in seen:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        count = list(row.output_token_ids).count(t)
        out[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return out


def test_penalties_follow_their_definitions_on_the_rows_that_ask() -> None:
    logits = _logits(4, 40, seed=5)
    rows = [
        SamplingRow(SamplingParams(temperature=0), None, 0, (), [1, 2], [3, 3]),  # no penalty
        SamplingRow(
            SamplingParams(temperature=0, repetition_penalty=1.5), None, 0, (), [1, 2, 2], [5]
        ),
        SamplingRow(
            SamplingParams(temperature=0, frequency_penalty=0.5, presence_penalty=-1.0),
            None,
            0,
            (),
            [7],
            [8, 8, 8, 9, 10**6],  # an id past the vocabulary counts for nothing
        ),
        SamplingRow(
            SamplingParams(
                temperature=0, repetition_penalty=0.5, frequency_penalty=2, presence_penalty=2
            ),
            None,
            0,
            (),
            [0, 39],
            [39, 39, 4],
        ),
    ]
    before = logits.clone()
    out = apply_penalties(logits, rows)
    assert torch.equal(logits, before)  # a copy
    assert torch.equal(out[0], logits[0])
    for i in (1, 2, 3):
        torch.testing.assert_close(out[i], _penalized_by_hand(logits[i], rows[i]))
    assert apply_penalties(logits, rows[:1]) is logits  # nobody asks: no copy
    # the sampler's greedy choice is the argmax after the penalties, from bf16 logits too
    for given in (logits, logits.bfloat16()):
        chosen = Sampler()(given, rows).token_ids
        assert chosen == apply_penalties(given.float(), rows).argmax(dim=-1).tolist()


def test_a_sampled_rows_penalties_come_before_its_filters() -> None:
    logits = torch.zeros(1, 8)
    logits[0, 3] = 5.0  # the likeliest token by far, until it has been generated enough
    params = SamplingParams(temperature=1.0, frequency_penalty=2.0, top_k=1, seed=0)
    row = SamplingRow(params, None, output_token_ids=[3, 3])
    assert Sampler()(logits, [row]).token_ids == [3]  # 5 - 2 x 2 = 1 is still the top
    row.output_token_ids = [3, 3, 3]
    assert Sampler()(logits, [row]).token_ids == [0]  # 5 - 2 x 3 < 0: top-1 is now token 0


@pytest.mark.parametrize("seed", range(6))
def test_candidate_filter_equals_the_full_sort(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(seed)
    vocab_size, num_rows = 6000, 48
    logits = torch.randn(num_rows, vocab_size, generator=gen) * 2.0
    head = torch.randint(0, vocab_size, (num_rows, 30), generator=gen)
    peaked = torch.rand(num_rows, 30, generator=gen) * (12.0 if seed % 2 else 3.0)
    logits.scatter_add_(1, head, peaked)
    if seed >= 3:  # bf16 logits: ties everywhere, at the candidates' edge too
        logits = logits.bfloat16().float()
    logits[::7, :100] = float("-inf")  # suppressed tokens
    ks = [1, 2, 40, 1023, 1024, 1025, 3000, vocab_size]
    ps = [1e-6, 0.3, 0.9, 0.95, 0.999, 1.0]
    top_k = torch.tensor([ks[i % len(ks)] for i in range(num_rows)])
    top_p = torch.tensor([ps[(i // len(ks) + i) % len(ps)] for i in range(num_rows)])
    expected = filter_sorted(logits, top_k, top_p)
    sorted_rows: list[int] = []  # rows the candidates could not decide

    def counted(rows: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        sorted_rows.append(len(rows))
        return filter_sorted(rows, k, p)

    monkeypatch.setattr(sampler, "filter_sorted", counted)
    assert torch.equal(filter_candidates(logits, top_k, top_p), expected)
    kept = (expected > float("-inf")).sum(dim=-1)
    assert kept.min() >= 1 and kept.max() > CANDIDATES
    assert 0 < sum(sorted_rows) < num_rows // 2  # most rows decided by the candidates alone
