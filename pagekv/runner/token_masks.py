"""Token masks of the sampler's rows: a structured-output grammar's (``apply_token_masks``) and
vLLM's token controls (``apply_token_controls``: ``logit_bias``, ``allowed_token_ids``, bad
words), applied to the logits before anything else. Stateless; the rows say what each asks.

Must not import ``pagekv.core``, ``models`` or ``server``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from pagekv.sampling_params import SamplingParams


class SamplingRow(Protocol):
    """What the masks read of a row (``sampler.SamplingRow``)."""

    @property
    def params(self) -> SamplingParams: ...

    @property
    def allowed_tokens(self) -> np.ndarray | None: ...

    @property
    def controlled(self) -> bool: ...

    def barred_token_ids(self) -> list[int]: ...


def apply_token_masks(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """-inf for every token a row's ``allowed_tokens`` leaves out; copies only if a row has
    them. One unpacking of the asking rows' bit masks, one masked fill.

    logits: [B, V] -> [B, V]
    """
    asking = [i for i, row in enumerate(rows) if row.allowed_tokens is not None]
    if not asking:
        return logits
    words = np.stack([rows[i].allowed_tokens for i in asking])  # type: ignore[misc]
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")  # [A, 32 * W]
    vocab_size = logits.shape[1]
    allowed = np.zeros((len(asking), vocab_size), dtype=bool)
    width = min(vocab_size, bits.shape[1])
    allowed[:, :width] = bits[:, :width]
    return _keep_only(logits, asking, allowed)


def _keep_only(logits: torch.Tensor, asking: Sequence[int], allowed: np.ndarray) -> torch.Tensor:
    """A copy of ``logits`` with -inf wherever ``allowed`` (bool [A, V], one row per row of
    ``asking``) is False."""
    index = torch.tensor(asking, device=logits.device)
    logits = logits.clone()
    refused = torch.from_numpy(~allowed).to(logits.device)
    logits[index] = logits[index].masked_fill(refused, float("-inf"))
    return logits


def apply_token_controls(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """``logit_bias`` added (the logits widened to float32 first, so a small bias is not lost
    to bf16), then -inf outside ``allowed_token_ids`` and for tokens that would complete a bad
    word (``SamplingRow.barred_token_ids``). Copies only if a row asks.

    logits: [B, V] -> [B, V]
    """
    asking = [i for i, row in enumerate(rows) if row.controlled]
    if not asking:
        return logits
    vocab_size = logits.shape[1]
    biased = [i for i in asking if rows[i].params.logit_bias]
    if biased:
        biases = [rows[i].params.logit_bias or {} for i in biased]
        row = torch.tensor([i for i, b in zip(biased, biases, strict=True) for _ in b])
        token = torch.tensor([t for b in biases for t in b], dtype=torch.int64)
        value = torch.tensor([v for b in biases for v in b.values()], dtype=torch.float32)
        inside = token < vocab_size  # the engine refuses others; a direct caller may not
        logits = logits.float() if logits.dtype != torch.float32 else logits.clone()
        device = logits.device
        logits.index_put_(
            (row[inside].to(device), token[inside].to(device)),
            value[inside].to(device),
            accumulate=True,
        )
    restricted = [i for i in asking if rows[i].params.allowed_token_ids is not None]
    if restricted:
        allowed = np.zeros((len(restricted), vocab_size), dtype=bool)
        for a, i in enumerate(restricted):
            ids = in_vocab(rows[i].params.allowed_token_ids or (), vocab_size)
            allowed[a, ids] = True
        logits = _keep_only(logits, restricted, allowed)
    barred = [(i, t) for i in asking for t in rows[i].barred_token_ids() if t < vocab_size]
    if barred:
        logits = logits.clone()
        device = logits.device
        index = torch.tensor(barred, dtype=torch.int64, device=device)  # [N, 2]
        logits[index[:, 0], index[:, 1]] = float("-inf")
    return logits


def in_vocab(ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """int64 ids of ``ids`` inside [0, vocab_size)."""
    array = np.asarray(ids, dtype=np.int64)
    return array[(array >= 0) & (array < vocab_size)]
