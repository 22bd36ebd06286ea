"""Sampler: no finite input gives a NaN row, and a row that is not finite anyway is reported.

The parameters here bypass ``SamplingParams``' float32 clamps (``_raw``), so the sampler's own
guards are what is tested: the top token survives every filter, penalties and temperature keep
finite logits finite, and a row with a NaN or +inf logit, or nothing left to draw, comes back in
``SamplerOutput.non_finite`` without disturbing the other rows.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from pagekv.runner import sampler as sampler_module
from pagekv.runner.sampler import Sampler, SamplingRow, filter_sorted
from pagekv.sampling_params import SamplingParams

VOCAB = 300


def _raw(**kwargs: Any) -> SamplingParams:
    """SamplingParams with the given fields set after validation, unclamped (1e-300 stays)."""
    params = SamplingParams()
    for name, value in kwargs.items():
        object.__setattr__(params, name, value)
    return params


def _logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, VOCAB, generator=gen) * 4  # [B, V]


def _row(params: SamplingParams, seen: list[int] | None = None) -> SamplingRow:
    gen = torch.Generator().manual_seed(0)
    return SamplingRow(params, gen, prompt_token_ids=seen or [], output_token_ids=seen or [])


@pytest.mark.parametrize(
    "params",
    [
        _raw(top_p=1e-300),
        _raw(top_p=5e-324, top_k=1),
        _raw(top_p=5e-324, min_p=1.0),
        _raw(temperature=1e300),
        _raw(temperature=1e300, top_p=1e-300),
        _raw(temperature=2e-5, top_p=0.5),
    ],
)
def test_tiny_top_p_and_extreme_temperatures_keep_the_top_token(params: SamplingParams) -> None:
    logits = _logits(8)
    logits[:, 5] = float("-inf")  # a masked token must stay masked whatever the temperature
    out = Sampler()(logits, [_row(params) for _ in range(8)])
    assert out.non_finite == [False] * 8
    assert all(0 <= t < VOCAB and t != 5 for t in out.token_ids)
    if params.top_p < 1e-30:
        assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_a_top_p_of_zero_in_float32_still_keeps_the_top_token() -> None:
    logits = _logits(4)
    kept = filter_sorted(logits, torch.full((4,), VOCAB), torch.zeros(4))
    assert torch.isfinite(kept).sum(dim=-1).tolist() == [1] * 4
    assert kept.argmax(dim=-1).tolist() == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("penalty", [1e-300, 1e-40, 5e-324, 1e300, 1e38])
@pytest.mark.parametrize("temperature", [0.0, 1.0, 1e-4])
def test_extreme_repetition_penalties_give_finite_rows(penalty: float, temperature: float) -> None:
    logits = _logits(3)
    seen = list(range(VOCAB))  # every token seen: each logit is penalized
    params = _raw(repetition_penalty=penalty, temperature=temperature, logprobs=2)
    rows = [_row(params, seen), _row(params, [1, 2, 3]), _row(params)]
    out = Sampler()(logits, rows)
    assert out.non_finite == [False] * 3
    assert all(0 <= t < VOCAB for t in out.token_ids)
    assert out.logprobs is not None and all(math.isfinite(x) for x in out.logprobs)
    if penalty < 1:  # the seen token with the largest positive logit wins outright
        top_seen = max([1, 2, 3], key=lambda t: float(logits[1, t]))
        assert float(logits[1, top_seen]) < 0 or out.token_ids[1] == top_seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("bad", ["nan", "inf", "all -inf"])
def test_a_non_finite_row_is_reported_and_the_others_are_untouched(
    dtype: torch.dtype, temperature: float, bad: str
) -> None:
    logits = _logits(4, seed=3).to(dtype)
    rows = [_row(SamplingParams(temperature=temperature, seed=i)) for i in range(4)]
    clean = Sampler()(logits, rows).token_ids
    broken = logits.clone()
    if bad == "all -inf":
        broken[2] = float("-inf")
    else:
        broken[2, 17] = float(bad)
    rows = [_row(SamplingParams(temperature=temperature, seed=i)) for i in range(4)]
    out = Sampler()(broken, rows)
    assert out.non_finite == [False, False, True, False]
    assert [out.token_ids[i] for i in (0, 1, 3)] == [clean[i] for i in (0, 1, 3)]


def test_a_nan_row_with_penalties_and_logprobs_is_reported() -> None:
    logits = _logits(2)
    logits[0, 40] = float("nan")
    params = SamplingParams(temperature=1.0, repetition_penalty=1.5, logprobs=3, top_p=0.9)
    out = Sampler()(logits, [_row(params, [40, 41]), _row(params, [40, 41])])
    assert out.non_finite == [True, False]
    assert 0 <= out.token_ids[1] < VOCAB


def test_a_filter_that_leaves_nothing_is_reported_not_drawn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug in a filter (every token at -inf) must not come out as the last token id."""
    monkeypatch.setattr(
        sampler_module, "_apply_top_k_top_p", lambda x, rows: torch.full_like(x, float("-inf"))
    )
    rows = [_row(SamplingParams(temperature=1.0)), _row(SamplingParams(temperature=0.0))]
    out = Sampler()(_logits(2), rows)
    assert out.non_finite == [True, False]
