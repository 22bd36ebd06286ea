"""Sampler: logit_bias, allowed_token_ids and bad words (vLLM's logits processors), on greedy
and sampled rows, with logprobs and ranks reported under the raw logits as vLLM does."""

from __future__ import annotations

import pytest
import torch

from pagekv.runner.sampler import Sampler, SamplingRow, apply_token_controls
from pagekv.sampling_params import SamplingParams


def _logits(num_rows: int, vocab_size: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab_size, generator=gen) * 3.0  # [B, V]


def _raw_rank(raw: torch.Tensor, token: int) -> int:
    """vLLM's rank: how many tokens are at least as likely."""
    return int((raw >= raw[token]).sum())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_forces_a_token_and_logprobs_stay_raw(temperature: float) -> None:
    logits = _logits(3, 200, seed=0)
    forced = int(logits[0].argmin())  # the least likely token
    params = SamplingParams(
        temperature=temperature, logit_bias={forced: 100, 5: -100}, logprobs=3, seed=1
    )
    plain = SamplingParams(temperature=0.0, logprobs=3)
    rows = [SamplingRow(params), SamplingRow(plain), SamplingRow(params)]
    out = Sampler()(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.token_ids[0] == forced
    assert out.token_ids[1] == int(logits[1].argmax())  # a row without a bias is untouched
    assert out.logprobs is not None and out.ranks is not None
    assert out.logprobs[0] == pytest.approx(raw[0, forced].item(), abs=1e-6)
    assert out.ranks[0] == 200 == _raw_rank(raw[0], forced)  # the least likely of 200
    assert out.ranks[1] == 1
    top = out.top_logprobs[0]
    assert top is not None and [t for t, _ in top] == raw[0].topk(3).indices.tolist()


def test_a_bias_on_bf16_logits_is_added_in_float32() -> None:
    logits = torch.zeros(1, 8, dtype=torch.bfloat16)
    logits[0, 2] = 64.0  # bf16 spacing at 64 is 0.5: a bias of 0.25 would vanish in bf16
    params = SamplingParams(temperature=0.0, logit_bias={3: 64.25})
    biased = apply_token_controls(logits, [SamplingRow(params)])
    assert biased.dtype == torch.float32 and biased[0, 3].item() == 64.25
    assert Sampler()(logits, [SamplingRow(params)]).token_ids == [3]


def test_allowed_token_ids_restrict_greedy_and_sampled_rows() -> None:
    logits = _logits(64, 100, seed=2)
    allowed = (3, 17, 42)
    greedy = SamplingParams(temperature=0.0, allowed_token_ids=allowed)
    sampled = SamplingParams(temperature=2.0, allowed_token_ids=allowed)
    rows = [SamplingRow(greedy if i % 2 else sampled) for i in range(64)]
    torch.manual_seed(3)
    out = Sampler()(logits, rows)
    assert set(out.token_ids) <= set(allowed)
    for i in range(1, 64, 2):
        best = max(allowed, key=lambda t: logits[i, t].item())
        assert out.token_ids[i] == best


def test_bad_words_bar_the_last_token_after_the_rest_of_the_word() -> None:
    words = ((7,), (4, 5, 9), (5, 8))
    row = SamplingRow(SamplingParams(temperature=0.0), bad_words_token_ids=words)
    assert row.barred_token_ids() == [7]  # no output yet: only the one-token word
    row.output_token_ids = [1, 4, 5]
    assert row.barred_token_ids() == [7, 9, 8]
    row.output_token_ids = [4, 6]
    assert row.barred_token_ids() == [7]
    logits = torch.zeros(1, 12)
    logits[0, 9], logits[0, 8], logits[0, 7], logits[0, 2] = 4.0, 3.0, 5.0, 1.0
    row.output_token_ids = [4, 5]
    assert Sampler()(logits, [row]).token_ids == [2]  # 7, 9 and 8 barred


def test_rows_without_controls_are_not_copied() -> None:
    logits = _logits(2, 10, seed=4)
    rows = [SamplingRow(SamplingParams(temperature=0.0)) for _ in range(2)]
    assert apply_token_controls(logits, rows) is logits


def test_ranks_count_ties_as_vllm_does() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    params = SamplingParams(temperature=0.0, logprobs=2)
    out = Sampler()(logits, [SamplingRow(params)])
    assert out.token_ids == [1]
    assert out.ranks == [2]  # two tokens are at least as likely as the chosen one
