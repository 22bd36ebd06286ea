"""Sampling one token per sequence from the last position's logits, as vLLM does.

Owns no state between steps: per-request random generators belong to the caller (one per
branch, seeded once), and the caller says how many tokens each row has generated so far.

Order of operations for a non-greedy row (a greedy one takes the argmax after the penalties
and the suppression)::

    raw logits -> token controls -> penalties -> min_tokens suppression -> / temperature
               -> top-k -> top-p -> min-p -> softmax -> inverse CDF: the token whose
                  cumulative interval holds one uniform draw

"Raw" already has a structured-output grammar's mask (vLLM masks the logits before its sampler
too); the token controls are vLLM's logits processors that change greedy rows as well:
``logit_bias`` added (in float32), then every token outside ``allowed_token_ids`` and every
token that would complete a bad word set to -inf.

Each seeded row draws its one uniform from that row's own generator, so a seeded request
samples the same tokens alone or inside any batch. (vLLM's exponential race, argmax of probs
over Exp(1) noise, needs a draw per vocabulary entry, which costs far more than a float64
cumulative sum and a search.) Logprobs are reported under the raw
logits (before token controls, penalties, min_tokens, temperature and filters), as vLLM reports
them by default (``logprobs_mode="raw_logprobs"``), with the chosen token's rank (how many tokens
are at least as likely).

No finite input makes a row NaN: penalties keep finite logits finite (at most float32's
largest), and so does the temperature on a penalized row (a model's own logits are far too small
to overflow), leaving -inf (a token that may not be drawn) as it is; no filter removes a row's
top token. A row whose own maximum is not finite (a NaN or +inf logit, or every token
masked) is reported in ``SamplerOutput.non_finite`` and nothing is drawn for it.

Must not import ``pagekv.core``, ``models`` or ``server``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagekv.kernels import decode as cpu_kernel
from pagekv.runner.token_masks import apply_token_controls, apply_token_masks, in_vocab
from pagekv.sampling_params import SamplingParams

# Below this temperature dividing the logits overflows toward inf - inf = NaN; such rows are
# sampled greedily, which is what they converge to anyway (vLLM uses the same cut-off).
GREEDY_TEMPERATURE = 1e-5
FLOAT32_MAX = torch.finfo(torch.float32).max
# The repetition penalty's factor in float32: a normal number, never 0 or inf (0 would divide
# by zero, inf would make 0 * inf). SamplingParams already clamps it to a narrower range.
REPETITION_FACTOR_RANGE = (torch.finfo(torch.float32).tiny, FLOAT32_MAX)


@dataclass
class SamplingRow:
    """One sequence of the batch, as the sampler needs it.

    ``generator``: the request's own generator (seeded once from ``params.seed`` + branch index),
    or None to draw from the global RNG. ``num_generated`` counts this sequence's output tokens so
    far; while it is below ``params.min_tokens``, EOS ids and ``stop_token_ids`` cannot be drawn.
    The penalties read ``prompt_token_ids`` and ``output_token_ids`` (the output so far); only
    rows with ``params.penalized`` need them. A row with ``allowed_tokens`` draws only those
    (its grammar decides when it may end, so min_tokens does not hold EOS back there).
    """

    params: SamplingParams
    generator: torch.Generator | None = None
    num_generated: int = 0
    eos_token_ids: tuple[int, ...] = ()
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    # Structured output: int32 [ceil(V / 32)], bit t set if token t may be drawn (None: any).
    allowed_tokens: np.ndarray | None = None
    # ``params.bad_words`` as token sequences (the engine tokenizes them); matched against
    # ``output_token_ids``, which rows with bad words must carry.
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()

    @property
    def greedy(self) -> bool:
        return self.params.temperature < GREEDY_TEMPERATURE

    @property
    def controlled(self) -> bool:
        """Whether a bias, an allow list or bad words change this row's logits."""
        params = self.params
        return bool(params.logit_bias or self.bad_words_token_ids) or (
            params.allowed_token_ids is not None
        )

    def barred_token_ids(self) -> list[int]:
        """The last token of every bad word whose other tokens end the output so far (vLLM's
        rule: only the output is matched, not the prompt)."""
        output = self.output_token_ids
        barred = []
        for word in self.bad_words_token_ids:
            prefix = len(word) - 1
            if prefix <= len(output) and tuple(output[len(output) - prefix :]) == word[:-1]:
                barred.append(word[-1])
        return barred

    def suppressed_token_ids(self) -> tuple[int, ...]:
        """Token ids that must not be drawn this step (min_tokens not yet reached)."""
        if self.num_generated >= self.params.min_tokens or self.allowed_tokens is not None:
            return ()
        eos = () if self.params.ignore_eos else self.eos_token_ids
        return eos + self.params.stop_token_ids


@dataclass
class SamplerOutput:
    """One step's result, one entry per row."""

    token_ids: list[int]
    # The chosen token's logprob under log_softmax(raw logits); None if no row asked.
    logprobs: list[float] | None
    # Per row: the top-k (token id, logprob) under the raw logits when params.logprobs = k.
    top_logprobs: list[list[tuple[int, float]] | None]
    # Per row: True if its logits had no finite maximum (a NaN or +inf logit, or no token left
    # to draw); its token id is then meaningless and the request must end with an error.
    non_finite: list[bool]
    # Per row that asked for logprobs: the chosen token's rank under the raw logits (1: the
    # most likely; ties share the lower rank, as vLLM counts); None elsewhere.
    ranks: list[int | None] | None = None


class Sampler:
    """Turns logits [B, V] (float32, or the model's bf16) into one token per row. Stateless.

    Filters are vectorized over the batch with per-row parameters as tensors, and a filter no
    row uses is skipped, so an all-greedy batch costs one argmax.
    """

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [B={len(rows)}, V], got {tuple(logits.shape)}")
        raw = apply_token_masks(logits, rows)  # [B, V], the grammar's mask in it
        logits = apply_token_controls(raw, rows)  # float32 if a row has a bias
        plain = not any(row.params.penalized for row in rows)
        if plain and all(row.greedy and row.params.logprobs is None for row in rows):
            # The maximum is the same in any dtype (bf16 -> float32 is exact): no widening
            suppressed = _suppress_stop_tokens(logits, rows)
            token_ids = argmax_rows(suppressed)
            bad = non_finite_rows(suppressed, token_ids)
            return SamplerOutput(token_ids.tolist(), None, [None] * len(rows), bad)
        controlled = logits is not raw
        logits = logits.float()  # [B, V]
        raw = raw.float() if controlled else logits  # the logprobs' distribution
        processed = _suppress_stop_tokens(apply_penalties(logits, rows), rows)  # [B, V]
        # Greedy for every row first (argmax breaks ties toward the lowest id); sampled rows
        # are overwritten below.
        token_ids = argmax_rows(processed)  # int64 [B]
        bad = non_finite_rows(processed, token_ids)
        sampled = [i for i, row in enumerate(rows) if not row.greedy and not bad[i]]
        if sampled:
            index = torch.tensor(sampled, device=logits.device)  # int64 [S]
            token_ids[index], drawn = _sample(processed[index], [rows[i] for i in sampled])
            for i, ok in zip(sampled, drawn, strict=True):
                bad[i] = bad[i] or not ok  # a filter's bug: report it, draw nothing
        chosen, top, ranks = _logprobs(raw, token_ids, rows)
        return SamplerOutput(token_ids.tolist(), chosen, top, bad, ranks)


def non_finite_rows(logits: torch.Tensor, token_ids: torch.Tensor) -> list[bool]:
    """Per row, whether its value at its argmax is NaN or infinite: argmax takes a NaN or +inf
    if the row has one and -inf only if every token is -inf, so one gather checks the row.

    logits: [B, V]; token_ids: int64 [B], each row's argmax"""
    top = logits.gather(1, token_ids.to(logits.device)[:, None])[:, 0]  # [B]
    return [bool(bad) for bad in (~torch.isfinite(top)).tolist()]


def _finite(values: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``new`` (computed from ``values``) with each result of a finite value clamped to
    float32's finite range, and the rest (-inf masks, NaN) left as they came."""
    return torch.where(torch.isfinite(values), new.clamp(-FLOAT32_MAX, FLOAT32_MAX), new)


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition, frequency and presence penalties (``SamplingParams``) on the rows that ask;
    copies only if one does. Only the tokens a row has seen change, so only those are read and
    written: one gather and one scatter for all asking rows, not a dense pass over [rows, V].

    logits: float32 [B, V] -> [B, V]
    """
    asking = [i for i, row in enumerate(rows) if row.params.penalized]
    if not asking:
        return logits
    vocab_size = logits.shape[1]
    parts: list[tuple[np.ndarray, ...]] = []  # per row: row, token, count, penalties
    for i in asking:
        params = rows[i].params
        output = in_vocab(rows[i].output_token_ids, vocab_size)
        seen, counts = np.unique(output, return_counts=True)
        if params.repetition_penalty != 1:
            in_output = seen
            seen = np.union1d(seen, in_vocab(rows[i].prompt_token_ids, vocab_size))
            counts_of_seen = np.zeros(len(seen), dtype=np.int64)
            counts_of_seen[np.searchsorted(seen, in_output)] = counts
            counts = counts_of_seen
        n = len(seen)
        parts.append(
            (
                np.full(n, i),
                seen,
                counts,
                np.full(n, params.repetition_penalty),
                np.full(n, params.frequency_penalty),
                np.full(n, params.presence_penalty),
            )
        )
    row, token, count, repetition, frequency, presence = (
        torch.from_numpy(np.concatenate(column)) for column in zip(*parts, strict=True)
    )
    values = logits[row, token]  # [N]
    repetition, frequency, presence = (
        t.to(values.dtype) for t in (repetition, frequency, presence)
    )
    repetition = repetition.clamp(*REPETITION_FACTOR_RANGE)
    new = torch.where(values > 0, values / repetition, values * repetition)
    new = new - frequency * count - presence * (count > 0)
    logits = logits.clone()
    logits[row, token] = _finite(values, new)
    return logits


def _suppress_stop_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Set EOS and stop ids to -inf on rows still under min_tokens; copies only if needed.

    logits: [B, V] -> [B, V]
    """
    vocab_size = logits.shape[1]
    row_index: list[int] = []
    token_index: list[int] = []
    for i, row in enumerate(rows):
        # An id outside the vocabulary can never be drawn, so there is nothing to suppress.
        ids = [t for t in row.suppressed_token_ids() if t < vocab_size]
        row_index.extend([i] * len(ids))
        token_index.extend(ids)
    if not row_index:
        return logits
    logits = logits.clone()
    device = logits.device
    logits[torch.tensor(row_index, device=device), torch.tensor(token_index, device=device)] = (
        float("-inf")
    )
    return logits


def _sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> tuple[torch.Tensor, list[bool]]:
    """Temperature, filters, then the inverse CDF. logits: [S, V] -> int64 [S], and per row
    whether its probabilities were finite (softmax makes a row NaN throughout or nowhere)."""
    device = logits.device
    temperature = torch.tensor([r.params.temperature for r in rows], device=device)  # [S]
    temperature = temperature.clamp(GREEDY_TEMPERATURE, FLOAT32_MAX)  # 1e300 is inf in float32
    scaled = logits / temperature[:, None]  # [S, V]
    if any(r.params.penalized for r in rows):  # only penalties make finite logits overflow
        scaled = _finite(logits, scaled)
    scaled = _apply_top_k_top_p(scaled, rows)
    scaled = _apply_min_p(scaled, rows)
    probs = torch.softmax(scaled, dim=-1)  # [S, V]
    drawn = [bool(ok) for ok in torch.isfinite(probs[:, 0]).tolist()]
    return _inverse_cdf(probs, _uniforms(rows)), drawn


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for [B, V]: the first maximum of each row (NaN counts as the
    maximum, as in torch). On CPU, float32 through numpy, whose SIMD argmax beats torch's, and
    bfloat16 through the C kernel (no widening to float32 first): one of these runs every
    step."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return torch.from_numpy(np.argmax(x.contiguous().numpy(), axis=-1))
    kernel = cpu_kernel.load() if x.device.type == "cpu" else None
    found = kernel.argmax_rows(x.contiguous()) if kernel is not None else None
    return found if found is not None else x.argmax(dim=-1)


# Top-k / top-p look at this many candidates, the largest logits, before sorting a whole row.
CANDIDATES = 1024


def _apply_top_k_top_p(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Mask all but each row's top-k tokens, then all but its top-p nucleus.

    logits: [S, V] -> [S, V]. The nucleus is the smallest set, in descending probability, whose
    cumulative probability reaches top_p; the top token is always kept; ties rank by lower id.
    Rows that filter nothing are left alone; the rest go through ``filter_candidates``.
    """
    vocab_size = logits.shape[1]
    top_k = [min(r.params.top_k or vocab_size, vocab_size) for r in rows]
    # top_p = 1 gets a threshold of 2 so float rounding in the cumsum can never trim a row that
    # only asks for top-k
    top_p = [r.params.top_p if r.params.top_p < 1 else 2.0 for r in rows]
    filtering = [i for i in range(len(rows)) if top_k[i] < vocab_size or top_p[i] < 1]
    if not filtering:
        return logits
    device = logits.device
    index = torch.tensor(filtering, device=device)
    k = torch.tensor([top_k[i] for i in filtering], device=device)  # [F]
    p = torch.tensor([top_p[i] for i in filtering], device=device)  # [F]
    out = logits.clone()
    out[index] = filter_candidates(logits[index], k, p)
    return out


def filter_candidates(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """``filter_sorted``'s result, bit for bit, from the ``CANDIDATES`` largest logits of each
    row (a full sort of every row of a large vocabulary would dominate the step) wherever
    those decide it: every kept token ranks above the last candidate's value (so no token
    outside the candidates, or tied with their last, could be kept instead) and top-k keeps at
    most the candidates or everything. Other rows: the full sort.

    logits [F, V], top_k int [F] (at most V), top_p [F] -> [F, V]
    """
    vocab_size = logits.shape[1]
    if vocab_size <= 2 * CANDIDATES:
        return filter_sorted(logits, top_k, top_p)
    values, ids = logits.topk(CANDIDATES, dim=-1)  # [F, C], descending, ties in any order
    ids, by_id = ids.sort(dim=-1)  # ties ranked by lower id, as the stable sort ranks them
    values, order = values.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(-1, order)  # [F, C]: the row's first C tokens in filter_sorted's order
    out, num_kept = _keep_ranked(logits, values, ids, top_k, top_p)
    above_last = (values > values[:, -1:]).sum(dim=-1)  # ranks no outside token can take
    decided = (num_kept <= above_last) & ((top_k <= CANDIDATES) | (top_k >= vocab_size))
    if not bool(decided.all()):
        rest = (~decided).nonzero()[:, 0]
        out[rest] = filter_sorted(logits[rest], top_k[rest], top_p[rest])
    return out


def filter_sorted(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p over a stable sort of each whole row (ties ranked by lower id).

    logits [F, V], top_k int [F] (at most V), top_p [F] -> [F, V]
    """
    values, ids = logits.sort(dim=-1, descending=True, stable=True)  # [F, V] each
    return _keep_ranked(logits, values, ids, top_k, top_p)[0]


def _keep_ranked(
    logits: torch.Tensor,
    values: torch.Tensor,
    ids: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Given each row's first N tokens in rank order (``values``, ``ids``: [F, N], N = V or
    ``CANDIDATES``): the row with all but its top-k and then top-p tokens at -inf, [F, V], and
    how many it keeps, [F]. The probabilities are normalized over the top-k set, summed over
    the first ``CANDIDATES`` ranks when it lies within them and over the whole row when top-k
    keeps everything, the same numbers in the same shapes whatever N is (so both callers agree
    to the bit); a top-k set beyond the candidates needs N = V."""
    num_ranked, vocab_size = values.shape[1], logits.shape[1]
    head = min(num_ranked, CANDIDATES)
    rank = torch.arange(num_ranked, device=logits.device)
    drop = rank[None, :] >= top_k[:, None]  # [F, N]
    in_top_k = values.masked_fill(drop, float("-inf"))
    total = torch.logsumexp(in_top_k[:, :head], dim=-1)  # [F]
    for rows, over in (
        (top_k >= vocab_size, logits),
        ((top_k > head) & (top_k < vocab_size), in_top_k),
    ):
        if bool(rows.any()):  # only meaningful when N = V for the second
            total[rows] = torch.logsumexp(over[rows], dim=-1)
    probs = torch.exp(in_top_k - total[:, None])  # [F, N]
    drop |= probs.cumsum(dim=-1) - probs >= top_p[:, None]  # probability mass ranked before
    drop[:, 0] = False  # the top token always stays (a top_p that rounds to 0 kept nothing)
    out = torch.full_like(logits, float("-inf"))
    out.scatter_(-1, ids, values.masked_fill(drop, float("-inf")))
    return out, (~drop).sum(dim=-1)


def _apply_min_p(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Mask tokens whose probability is below min_p times the row's top probability.

    logits: [S, V] -> [S, V]
    """
    min_p = [r.params.min_p for r in rows]
    if not any(p > 0 for p in min_p):
        return logits
    probs = torch.softmax(logits, dim=-1)  # [S, V]
    top = probs.amax(dim=-1, keepdim=True)  # [S, 1]
    threshold = torch.tensor(min_p, device=logits.device)[:, None] * top  # [S, 1]
    return logits.masked_fill((probs < threshold) & (probs < top), float("-inf"))  # top stays


def _uniforms(rows: Sequence[SamplingRow]) -> torch.Tensor:
    """float64 [S] in [0, 1): a seeded row's from its own generator (one draw a step, whatever
    else is in the batch), the rest from the global RNG."""
    draws = torch.rand(len(rows), dtype=torch.float64)
    for i, row in enumerate(rows):
        if row.generator is not None:
            draws[i] = torch.rand(1, dtype=torch.float64, generator=row.generator)[0]
    return draws


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The token of each row whose interval of the row's cumulative probabilities (float64, so
    rounding shifts no interval by more than ~1e-16) holds its uniform scaled to the row's
    total. A token of probability 0 has an empty interval and is never drawn.
    probs [S, V], uniforms float64 [S] -> int64 [S]"""
    cdf = probs.double().cumsum(dim=-1)  # [S, V]
    targets = (uniforms.to(cdf.device) * cdf[:, -1])[:, None]  # [S, 1], below each total
    return torch.searchsorted(cdf, targets, right=True)[:, 0].clamp_(max=probs.shape[1] - 1)


def _logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, rows: Sequence[SamplingRow]
) -> tuple[list[float] | None, list[list[tuple[int, float]] | None], list[int | None] | None]:
    """Chosen-token logprob for every row, its rank and top-k alternatives for the rows that
    asked, under the raw logits.

    logits: float32 [B, V]; token_ids: int64 [B]. Computed only when some row asked.
    """
    wanted = [r.params.logprobs for r in rows]
    top: list[list[tuple[int, float]] | None] = [None] * len(rows)
    if all(k is None for k in wanted):
        return None, top, None
    raw = torch.log_softmax(logits, dim=-1)  # [B, V]
    chosen_t = raw.gather(1, token_ids[:, None].to(raw.device))  # [B, 1]
    asking = {i: k for i, k in enumerate(wanted) if k is not None}  # row -> k
    index = torch.tensor(list(asking), device=logits.device)  # [A]
    found = rank_and_top(raw[index], chosen_t[index], max(asking.values()))
    ranks: list[int | None] = [None] * len(rows)
    for a, (i, k) in enumerate(asking.items()):
        ranks[i], top[i] = found[a][0], found[a][1][:k]
    return chosen_t[:, 0].tolist(), top, ranks


def rank_and_top(
    logprobs: torch.Tensor, chosen: torch.Tensor, k: int
) -> list[tuple[int, list[tuple[int, float]]]]:
    """Per row: the rank of its chosen value (how many entries are at least as large: vLLM's
    count) and its ``k`` largest entries as (token id, logprob), largest first.

    logprobs: float32 [R, V]; chosen: [R, 1], each row's chosen token's value."""
    ranks = (logprobs >= chosen).sum(dim=-1).tolist()  # [R]
    values, ids = logprobs.topk(min(k, logprobs.shape[1]), dim=-1)  # [R, k] each
    pairs = [
        list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)
    ]
    return list(zip(ranks, pairs, strict=True))
