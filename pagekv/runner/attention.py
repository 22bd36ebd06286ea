"""Paged attention, reference implementation: write new K/V into their slots, read history back
through the block tables.

Owns nothing: the KV tensors belong to ``KVCache``, the block tables to the core's KV manager.
This module only turns one step's ``AttentionMetadata`` into tensor indexing. It is the
correctness reference that faster kernels are tested against, so it favours plain, batched torch
over speed, but it never loops over sequences in Python (a batch may hold hundreds).

Token and slot arithmetic (block_size = 4, one sequence with seq_len = 10, q_len = 3)::

    position p      0 1 2 3 | 4 5 6 7 | 8 9 . .
    logical block   0       | 1       | 2
    block_table     [7,       2,        5]
    slot(p)         = block_table[p // 4] * 4 + p % 4  ->  p=9 lives in slot 5*4 + 1 = 21
    new tokens      j = 0, 1, 2 sit at positions 7, 8, 9 (= seq_len - q_len + j)
    query j sees    keys 0 .. seq_len - q_len + j   (causal, history read from the cache)

Must not import ``pagekv.core``, ``models`` or ``server``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """One step's batch: B sequences, T new tokens in total, flattened in sequence order.

    Shapes are checked on construction; values are not (that would force a device sync).
    """

    query_start_loc: torch.Tensor  # int64 [B+1], cumulative new-token counts; [0] == 0, [-1] == T
    seq_lens: torch.Tensor  # int64 [B], context length of each sequence after this step
    block_tables: torch.Tensor  # int64 [B, max_blocks], padded with 0; padding is never read
    slot_mapping: torch.Tensor  # int64 [T], the slot each new token's K/V is written to
    max_query_len: int  # python ints, so kernels need no device sync
    max_seq_len: int
    block_size: int

    def __post_init__(self) -> None:
        num_seqs = self.seq_lens.shape[0] if self.seq_lens.dim() == 1 else -1
        if self.seq_lens.dim() != 1 or self.query_start_loc.shape != (num_seqs + 1,):
            raise ValueError(
                f"seq_lens must be [B] and query_start_loc [B+1], got "
                f"{tuple(self.seq_lens.shape)} and {tuple(self.query_start_loc.shape)}"
            )
        if self.block_tables.dim() != 2 or self.block_tables.shape[0] != num_seqs:
            raise ValueError(
                f"block_tables must be [B={num_seqs}, max_blocks], got "
                f"{tuple(self.block_tables.shape)}"
            )
        if self.slot_mapping.dim() != 1:
            raise ValueError(f"slot_mapping must be [T], got {tuple(self.slot_mapping.shape)}")
        if self.block_size < 1 or self.max_query_len < 0 or self.max_seq_len < 0:
            raise ValueError(
                f"block_size must be >= 1 and max lengths >= 0, got block_size="
                f"{self.block_size}, max_query_len={self.max_query_len}, "
                f"max_seq_len={self.max_seq_len}"
            )
        if self.block_tables.shape[1] * self.block_size < self.max_seq_len:
            raise ValueError(
                f"block_tables cover {self.block_tables.shape[1]} blocks of {self.block_size} "
                f"tokens, fewer than max_seq_len={self.max_seq_len}"
            )

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


FP8 = torch.float8_e4m3fn  # an fp8 cache keeps these bits in uint8 planes (CPU indexing)
FP8_MAX = 448.0


def quantize_rows(x: torch.Tensor, fp8: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Round each row (the last axis) to 8 bits with its own float16 scale: int8 steps of
    amax / 127, or (``fp8``) e4m3 values of x / (amax / 448), their bits as uint8.

    x: [..., D] -> (int8 or uint8 [..., D], float16 [...]); the row is ``q * scale``. The scale
    is rounded to float16 first and the row divided by that rounded scale, so dequantizing with
    the stored scale costs only the 8-bit rounding. An all-zero row has scale 0.
    """
    amax = x.float().abs().amax(dim=-1)
    scale = (amax / (FP8_MAX if fp8 else 127.0)).to(torch.float16)
    divisor = torch.where(scale > 0, scale.float(), 1.0)
    scaled = x.float() / divisor[..., None]
    if fp8:
        return scaled.clamp_(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8), scale
    return torch.round(scaled).clamp_(-127, 127).to(torch.int8), scale


def dequantize(rows: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """8-bit rows (int8, or fp8 bits in uint8) times their scales, in float32."""
    values = rows.view(FP8) if rows.dtype == torch.uint8 else rows
    return values.float() * scales.float()[..., None]


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *args: torch.Tensor,
) -> None:
    """Write this step's new K/V into the cache, in place, token ``t`` into ``slot_mapping[t]``.

    ``write_kv(k_cache, v_cache, k, v, slot_mapping)``, or for an 8-bit cache (int8, or fp8
    bits in uint8)
    ``write_kv(k_cache, v_cache, k_scale, v_scale, k, v, slot_mapping)`` (rows rounded by
    ``quantize_rows``, their scales written to the same slots).
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]; scales: [num_blocks,
    block_size, num_kv_heads]; k, v: [T, num_kv_heads, head_dim]; slot_mapping: int64 [T]
    """
    if len(args) == 5:
        k_scale, v_scale, k, v, slot_mapping = args
        fp8 = k_cache.dtype == torch.uint8
        (qk, sk), (qv, sv) = quantize_rows(k, fp8), quantize_rows(v, fp8)
        _write_rows(k_cache, v_cache, qk, qv, slot_mapping)
        _write_rows(k_scale, v_scale, sk, sv, slot_mapping)
        return
    k, v, slot_mapping = args
    _write_rows(k_cache, v_cache, k, v, slot_mapping)


def _write_rows(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if k_cache.shape != v_cache.shape or k.shape != v.shape:
        raise ValueError(
            f"K and V must match: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)}, "
            f"new {tuple(k.shape)} / {tuple(v.shape)}"
        )
    if k.shape[1:] != k_cache.shape[2:] or k.shape[0] != slot_mapping.shape[0]:
        raise ValueError(
            f"new K/V {tuple(k.shape)} do not fit cache {tuple(k_cache.shape)} with "
            f"{slot_mapping.shape[0]} slots"
        )
    if k_cache.is_contiguous() and v_cache.is_contiguous():
        # A slot is a row of the flattened cache: one row copy per token (cheaper than
        # indexing by block and offset). view() never copies, so the writes land in the cache.
        rows = k_cache.view(-1, *k_cache.shape[2:])
        rows.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.view(rows.shape).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
        return
    # A non-contiguous cache has no flat view: index by (block, offset), still in place.
    block_size = k_cache.shape[1]
    block_ids = slot_mapping // block_size  # [T]
    offsets = slot_mapping % block_size  # [T]
    k_cache[block_ids, offsets] = k.to(k_cache.dtype)
    v_cache[block_ids, offsets] = v.to(v_cache.dtype)


def _gather_history(
    cache: torch.Tensor,
    meta: AttentionMetadata,
    positions: torch.Tensor,
    key_valid: torch.Tensor,
    scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Read every sequence's padded history at ``positions`` (int64 [S]) through its block
    table in one indexing op (an int8 cache's rows times their ``scales``).

    cache: [num_blocks, block_size, num_kv_heads, head_dim]; key_valid: bool [B, S]
    returns float32 [B, num_kv_heads, S, head_dim], zero where a key is not valid.
    """
    logical_blocks = positions // meta.block_size  # [S]
    physical = meta.block_tables[:, logical_blocks]  # [B, S]
    offsets = positions % meta.block_size  # [S]
    history = cache[physical, offsets]  # [B, S, kv_heads, D]
    if scales is not None:
        history = dequantize(history, scales[physical, offsets])
    # Slots past a sequence's length hold whatever an earlier owner left (possibly NaN from an
    # uninitialised pool); a masked weight of 0 times NaN is still NaN, so zero them out.
    history = torch.where(key_valid[:, :, None, None], history.float(), 0.0)
    return history.transpose(1, 2)  # [B, kv_heads, S, D]


def _token_coordinates(meta: AttentionMetadata, num_tokens: int) -> tuple[torch.Tensor, ...]:
    """Map flat token t to (sequence b, index j among b's new tokens), without a device sync.

    returns seq_of_token int64 [T], index_in_seq int64 [T], query_lens int64 [B]
    """
    device = meta.seq_lens.device
    query_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]  # [B]
    seq_of_token = torch.repeat_interleave(
        torch.arange(meta.num_seqs, device=device), query_lens, output_size=num_tokens
    )  # [T]
    index_in_seq = torch.arange(num_tokens, device=device) - meta.query_start_loc[seq_of_token]
    return seq_of_token, index_in_seq, query_lens


def _keys_read(
    meta: AttentionMetadata, query_lens: torch.Tensor, window: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The key positions the step reads, from the first any query sees, and per sequence
    which of them its queries may see at all (not past its length, nor, with a window, before
    its first query's window: those blocks may be given back already).

    returns key_pos int64 [S], key_valid bool [B, S]
    """
    first_key = 0
    first_query = meta.seq_lens - query_lens  # [B]
    if window is not None and meta.num_seqs:
        first_key = max(0, int(first_query.min()) - window + 1)
    key_pos = torch.arange(first_key, meta.max_seq_len, device=meta.seq_lens.device)  # [S]
    key_valid = key_pos[None, :] < meta.seq_lens[:, None]  # [B, S]
    if window is not None:
        key_valid &= key_pos[None, :] > (first_query - window)[:, None]
    return key_pos, key_valid


def _attention_mask(
    meta: AttentionMetadata, query_lens: torch.Tensor, key_pos: torch.Tensor, window: int | None
) -> torch.Tensor:
    """Causal + length mask, True where query j of sequence b may attend to key position k:
    k <= p for the query's position p, and p - window < k with a sliding window.

    returns bool [B, Q, S]
    """
    device = meta.seq_lens.device
    query_idx = torch.arange(meta.max_query_len, device=device)  # [Q]
    query_pos = (meta.seq_lens - query_lens)[:, None] + query_idx[None, :]  # [B, Q]
    # Padded query rows (j >= q_len) sit at positions >= seq_len; clamping them to the last
    # real position gives them a non-empty row, so their softmax never produces NaN.
    last_pos = (meta.seq_lens - 1)[:, None]  # [B, 1]
    query_pos = torch.minimum(query_pos, last_pos)  # [B, Q]
    mask = key_pos[None, None, :] <= query_pos[:, :, None]  # [B, Q, S]
    if window is not None:
        mask &= key_pos[None, None, :] > query_pos[:, :, None] - window
    return mask


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of this step's queries over each sequence's cached history.

    q: [T, H, D]; caches: [num_blocks, block_size, KVH, D]; ``scales``: an int8 cache's (K, V)
    row scales, [num_blocks, block_size, KVH]. Returns [T, H, D] in q's dtype, in float32 math,
    after the caller's ``write_kv`` (prefill, decode, prefix-cached prefill). ``window``: a query
    at p sees keys p - window < k <= p only; ``softcap``: scores -> tanh(s / cap) * cap."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads != 0 or k_cache.shape[3] != head_dim:
        raise ValueError(
            f"q {tuple(q.shape)} does not fit cache {tuple(k_cache.shape)}: num_heads must be "
            f"a multiple of num_kv_heads and head_dims must match"
        )
    group = num_heads // num_kv_heads
    num_seqs, max_q = meta.num_seqs, meta.max_query_len

    seq_of_token, index_in_seq, query_lens = _token_coordinates(meta, num_tokens)
    key_pos, key_valid = _keys_read(meta, query_lens, window)  # [S], [B, S]
    k_scale, v_scale = scales if scales is not None else (None, None)
    keys = _gather_history(k_cache, meta, key_pos, key_valid, k_scale)  # [B, KVH, S, D]
    values = _gather_history(v_cache, meta, key_pos, key_valid, v_scale)  # [B, KVH, S, D]

    q_pad = q.new_zeros((num_seqs, max_q, num_heads, head_dim), dtype=torch.float32)
    q_pad[seq_of_token, index_in_seq] = q.float()  # [B, Q, H, D]
    # Query head h = kv_head * group + g uses kv head h // group: fold the group into the query
    # axis so K/V are never expanded per query head.
    q_grouped = (
        q_pad.view(num_seqs, max_q, num_kv_heads, group, head_dim)
        .permute(0, 2, 3, 1, 4)
        .reshape(num_seqs, num_kv_heads, group * max_q, head_dim)
    )  # [B, KVH, G*Q, D]

    scores = torch.matmul(q_grouped, keys.transpose(-1, -2)) * scale  # [B, KVH, G*Q, S]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    span = key_pos.shape[0]
    scores = scores.view(num_seqs, num_kv_heads, group, max_q, span)
    mask = _attention_mask(meta, query_lens, key_pos, window)  # [B, Q, S]
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(num_seqs, num_kv_heads, group * max_q, span)
    out = torch.matmul(probs, values)  # [B, KVH, G*Q, D]

    out = (
        out.view(num_seqs, num_kv_heads, group, max_q, head_dim)
        .permute(0, 3, 1, 2, 4)
        .reshape(num_seqs, max_q, num_heads, head_dim)
    )  # [B, Q, H, D]
    return out[seq_of_token, index_in_seq].to(q.dtype)  # [T, H, D]
