"""Paged attention, fast path: decode rows through a kernel over the block table, prefill chunks
through the prefill kernel (bf16: AMX tiles or AVX512-BF16 vectors where the target has them;
else, and float32 always, float32 vectors) or SDPA; cascade attention over a prefix the decode
rows share through the prefill kernel too (in tiles or float32 vectors as for prefill chunks,
on every target and head size it takes); drafted decodes (several tokens a sequence) in bf16
through its tiles. Agrees with ``paged_attention_reference`` (tests/kernels/).

Owns nothing: the step's ``StepLayout`` comes from ``batch.prepare_step``, the tensors from
``KVCache``. Why two paths: a decode row is one query over a long history, where the cost is
reading K/V, so the kernel reads every cached row in place, once; a prefill chunk is many
queries, where the cost is the QK^T and PV products, so blocked products win: the prefill
kernel's (pagekv/kernels/prefill.py, all chunks in one call, K/V read through the blocks), else
SDPA's. The reference instead pads every row to the longest query and the longest history of
the batch.

Flat token order of a step (decode rows first, see ``batch.prepare_step``)::

    tokens   d0 d1 d2 | p0 p0 p0 p0 p0 | p1 p1 p1
             decode   | chunk 0        | chunk 1 (history 48 cached + 3 new)
    decode:  kernel over block tables, seq_lens          -> out[:3]
    chunk 0: no history: SDPA(q, k, v of this step, causal)
    chunk 1: history: SDPA(q, K/V of 51 slots read via its blocks, causal offset by 48)
    kernel:  both chunks in one prefill kernel call over their blocks (offset 0 and 48)

Must not import ``pagekv.core`` or ``server``; of ``models``, only the layer ops'
``NativeAttention`` (what it hands a layer stack).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagekv.kernels.decode import CacheAddresses, DecodeBatch, DecodeKernel
from pagekv.kernels.prefill import PrefillBatch, PrefillKernel
from pagekv.models.layer_ops import NativeAttention
from pagekv.runner.attention import dequantize

# Decode rows below this go through the decode kernel alone even when they share a prefix:
# the prefill kernel takes 16 (row, query head) pairs at a time, and packing the prefix is not
# free.
CASCADE_MIN_ROWS = 4
# Decode steps go through the prefill kernel's tiles when their sequences feed at least this
# many query tokens on average (drafts): packing a history costs about what the decode kernel
# spends on one token, and the tiles then take every token's products almost for free.
TILES_MIN_QUERIES_PER_SEQ = 2


@dataclass(frozen=True)
class PrefillChunk:
    """One request's new tokens when it has more than one: flat tokens [start, start + len)."""

    token_start: int
    num_tokens: int
    seq_len: int  # history + new tokens after this step
    block_ids: torch.Tensor  # int64 [ceil(seq_len / block_size)]: its physical blocks
    # Only for chunks with history: bool [num_tokens, seq_len], True where new token j may see
    # position k (SDPA's causal mask assumes no history).
    mask: torch.Tensor | None = None


@dataclass(frozen=True)
class StepLayout:
    """What the fast path needs of one step: the first ``num_decode`` tokens are decode rows."""

    num_decode: int
    decode: DecodeBatch
    prefill: tuple[PrefillChunk, ...]


@dataclass(frozen=True)
class _ChunkGroup:
    """Prefill chunks of one shape (new tokens, sequence length, with or without history),
    attended in one SDPA call with the chunks as its batch: their causal masks are the same.
    Requests that share a cached prefix and add suffixes of one length (a system prompt and
    fixed-size questions, n samples of a prompt) are such chunks; each alone is too small for
    SDPA to pay for its call."""

    chunks: tuple[PrefillChunk, ...]
    rows: torch.Tensor  # int64 [G * L]: the chunks' flat token rows, chunk after chunk
    block_ids: torch.Tensor | None  # int64 [G * nb]: their blocks, chunk after chunk (history)


def _group_chunks(chunks: tuple[PrefillChunk, ...]) -> list[_ChunkGroup]:
    by_shape: dict[tuple[int, int, bool], list[PrefillChunk]] = {}
    for chunk in chunks:
        key = (chunk.num_tokens, chunk.seq_len, chunk.mask is not None)
        by_shape.setdefault(key, []).append(chunk)
    groups = []
    for members in by_shape.values():
        rows = torch.cat(
            [torch.arange(c.token_start, c.token_start + c.num_tokens) for c in members]
        )
        history = [c.block_ids for c in members if c.mask is not None]
        groups.append(_ChunkGroup(tuple(members), rows, torch.cat(history) if history else None))
    return groups


class FastAttention:
    """One step's attention over the paged cache, for every layer: layout, scale and kernel
    are fixed for the step, the layer's q/k/v and caches change."""

    def __init__(
        self,
        layout: StepLayout,
        scale: float,
        kernel: DecodeKernel | None,
        prefill_kernel: PrefillKernel | None = None,
    ) -> None:
        self.layout = layout
        self.scale = scale
        self.kernel = kernel
        self.prefill_kernel = prefill_kernel

    @functools.cached_property
    def _groups(self) -> list[_ChunkGroup]:  # once per step, not per layer; only for SDPA
        return _group_chunks(self.layout.prefill)

    @functools.cached_property
    def _shared_table(self) -> torch.Tensor:  # once per step; only for cascade attention
        return self.layout.decode.block_tables[0, : self.layout.decode.shared_blocks]

    @functools.cached_property
    def _prefill_batch(self) -> PrefillBatch:  # once per step; only for the prefill kernel
        return _kernel_batch(self.layout.prefill)

    def native(
        self,
        caches: CacheAddresses,
        slot_mapping: torch.Tensor,
        num_tokens: int,
        num_heads: int,
        scales: CacheAddresses | None = None,
        activations: torch.dtype | None = None,
    ) -> NativeAttention | None:
        """This step's attention for a layer stack's C code (``DecodeKernel.step_attention``)
        where every layer of it would go through the decode kernel alone, as ``__call__``
        chooses: a decode step of one query token per sequence, no cascade over a shared
        prefix. None otherwise. 8-bit caches: with their ``scales`` and the model's
        ``activations`` dtype."""
        layout, kernel = self.layout, self.kernel
        k_cache = caches.first[0]
        if (
            kernel is None
            or layout.prefill
            or layout.num_decode != num_tokens
            or layout.decode.query_lens is not None
            or self._cascades(num_tokens, k_cache.dtype, k_cache.shape[-1])
        ):
            return None
        return kernel.step_attention(
            caches, slot_mapping, layout.decode, num_heads, self.scale, scales, activations
        )

    def _cascades(self, rows: int, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether decode rows attend a shared prefix by cascade attention."""
        prefill = self.prefill_kernel
        return bool(
            self.layout.decode.shared_blocks
            and rows >= CASCADE_MIN_ROWS
            and prefill is not None
            and prefill.supports_cascade(dtype, head_dim)
        )

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        caches: tuple[torch.Tensor, ...],
    ) -> torch.Tensor:
        """Causal attention of this step's queries over their sequences' cached histories.

        q: [T, H, D]; k, v: this step's new [T, KVH, D] (already written to the caches);
        caches: (k_cache, v_cache), each [num_blocks, block_size, KVH, D], or 8-bit caches and
        their scales (k_cache, v_cache, k_scale, v_scale), whose rows every path reads
        widened (prefill chunks too: as the reference, each token sees its keys rounded).
        Without a kernel (or one lacking this dtype/head dim) decode rows use torch ops.
        Returns [T, H, D], q's dtype.
        """
        nd = self.layout.num_decode
        if 0 < nd == q.shape[0]:  # a decode step (the common one): no slices, no copies
            return self._decode(q, caches, None)
        out = torch.empty_like(q)  # [T, H, D]
        if nd:
            self._decode(q[:nd], caches, out[:nd])
        if not self.layout.prefill or self._prefill_by_kernel(q, caches, out):
            return out
        for group in self._groups:
            if len(group.chunks) == 1:
                chunk = group.chunks[0]
                rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
                out[rows] = _prefill_chunk(q[rows], k[rows], v[rows], caches, chunk, self.scale)
            else:
                out[group.rows] = _prefill_group(q, k, v, caches, group, self.scale)
        return out

    def _decode(
        self, q: torch.Tensor, caches: tuple[torch.Tensor, ...], out: torch.Tensor | None
    ) -> torch.Tensor:
        """The decode rows q [nd, H, D] -> their outputs in q's dtype, in ``out`` if given."""
        batch, prefill, kernel = self.layout.decode, self.prefill_kernel, self.kernel
        k_cache, v_cache = caches[:2]
        if len(caches) == 4:  # 8-bit blocks: the decode kernel reads them with their scales
            scales = (caches[2], caches[3])
            if kernel is not None and kernel.supports(k_cache.dtype, q.shape[-1], q.dtype):
                got = kernel(q.contiguous(), k_cache, v_cache, batch, self.scale, scales=scales)
            else:
                got = decode_attention_torch(q, k_cache, v_cache, batch, self.scale, scales)
            return got.to(q.dtype) if out is None else out.copy_(got)
        # Drafted rows (two or more query tokens per sequence on average) that share no prefix,
        # in bf16: through the prefill kernel's tiles, each history packed once per kv head.
        if (
            prefill is not None
            and batch.num_queries >= TILES_MIN_QUERIES_PER_SEQ * batch.seq_lens.shape[0]
            and not (batch.shared_blocks and q.shape[0] >= CASCADE_MIN_ROWS)
            and prefill.supports(k_cache.dtype, q.shape[-1])
        ):
            tiles_out = torch.empty_like(q) if out is None else out
            if prefill.decode(q, k_cache, v_cache, batch, self.scale, tiles_out):
                return tiles_out
        if kernel is not None and kernel.supports(k_cache.dtype, q.shape[-1]):
            q_cache = q.to(k_cache.dtype).contiguous()  # [nd, H, D], no copy if the same
            result = self._decode_by_kernels(kernel, q_cache, k_cache, v_cache)
        else:
            result = decode_attention_torch(q, k_cache, v_cache, batch, self.scale)
        if out is None:
            return result.to(q.dtype)
        return out.copy_(result)

    def _decode_by_kernels(
        self, kernel: DecodeKernel, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        """The decode rows, float32 [nd, H, D]. When the rows share a prefix (a system prompt,
        n samples of one prompt), cascade attention: the prefill kernel attends the prefix once
        for all rows (``_cascades``), the decode kernel each row's own rest, and the two parts
        are merged by their log-sum-exp. Otherwise the decode kernel alone."""
        batch, prefill = self.layout.decode, self.prefill_kernel
        prefix = batch.shared_blocks * k_cache.shape[1]
        if prefill is not None and self._cascades(q.shape[0], k_cache.dtype, q.shape[-1]):
            lse = torch.empty(q.shape[:2], dtype=torch.float32)
            out = kernel(q, k_cache, v_cache, batch, self.scale, start=prefix, lse=lse)
            table = self._shared_table
            if prefill.shared_prefix(q, k_cache, v_cache, table, prefix, self.scale, out, lse):
                return out
        return kernel(q, k_cache, v_cache, batch, self.scale)

    def _prefill_by_kernel(
        self, q: torch.Tensor, caches: tuple[torch.Tensor, ...], out: torch.Tensor
    ) -> bool:
        """All prefill rows of ``out`` by the prefill kernel, if it takes this step. 8-bit
        blocks: the chunks' blocks widened first into a pool of q's dtype (``_widened``)."""
        kernel, (k_cache, v_cache) = self.prefill_kernel, caches[:2]
        dtype = q.dtype if len(caches) == 4 else k_cache.dtype
        if kernel is None or not kernel.supports_prefill(dtype, q.shape[-1]):
            return False
        if not out.is_contiguous():
            return False
        batch = self._prefill_batch
        if len(caches) == 4:
            (k_cache, v_cache), batch = self._widened(caches, dtype)
        return kernel(q.contiguous(), k_cache, v_cache, batch, self.scale, out)

    @functools.cached_property
    def _widened_blocks(self) -> tuple[torch.Tensor, PrefillBatch]:
        """The prefill chunks' blocks (each once) and the chunks as the prefill kernel reads
        them from a pool of just those blocks, in that order (once per step)."""
        ids, inverse = torch.unique(
            torch.cat([c.block_ids for c in self.layout.prefill]), return_inverse=True
        )
        chunks, at = [], 0
        for chunk in self.layout.prefill:
            count = len(chunk.block_ids)
            chunks.append(dataclasses.replace(chunk, block_ids=inverse[at : at + count]))
            at += count
        return ids, _kernel_batch(tuple(chunks))

    def _widened(
        self, caches: tuple[torch.Tensor, ...], dtype: torch.dtype
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], PrefillBatch]:
        """An 8-bit layer's blocks of this step's chunks widened to ``dtype`` (the values the
        reference reads, rounded to the model's dtype), and the batch that reads them."""
        ids, batch = self._widened_blocks
        k, v = (_read_blocks(caches, i, ids, dtype).contiguous() for i in (0, 1))
        return (k, v), batch


def _kernel_batch(chunks: tuple[PrefillChunk, ...]) -> PrefillBatch:
    """The chunks as the prefill kernel reads them."""
    rows, start = [], 0
    for chunk in chunks:
        rows.append((chunk.token_start, chunk.num_tokens, chunk.seq_len, start))
        start += len(chunk.block_ids)
    tables = torch.cat([chunk.block_ids for chunk in chunks]).to(torch.int32)
    return PrefillBatch(torch.tensor(rows, dtype=torch.int64), tables)


def _prefill_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    caches: tuple[torch.Tensor, ...],
    chunk: PrefillChunk,
    scale: float,
) -> torch.Tensor:
    """q [L, H, D], k/v [L, KVH, D] -> [L, H, D]. Without history the chunk's own K/V are the
    whole sequence (8-bit caches: their rounded rows); with history, read all seq_len slots (new
    ones included) via the blocks."""
    mask = chunk.mask
    if mask is not None or len(caches) == 4:
        blocks = chunk.block_ids
        k = _read_blocks(caches, 0, blocks, q.dtype).flatten(0, 1)[: chunk.seq_len]  # [S, KVH, D]
        v = _read_blocks(caches, 1, blocks, q.dtype).flatten(0, 1)[: chunk.seq_len]
    # 4-D inputs: torch's CPU flash kernel only takes [batch, heads, len, dim]; 3-D inputs
    # silently fall back to the slower, unfused math path.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],  # [1, H, L, D]
        k.transpose(0, 1)[None],  # [1, KVH, S, D]
        v.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )  # [1, H, L, D]
    return out[0].transpose(0, 1)


def _prefill_group(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    caches: tuple[torch.Tensor, ...],
    group: _ChunkGroup,
    scale: float,
) -> torch.Tensor:
    """``_prefill_chunk`` for G chunks of one shape at once: q [T, H, D] and k/v [T, KVH, D]
    of the whole step -> [G * L, H, D] for ``group.rows``."""
    first = group.chunks[0]
    count, length, seq_len = len(group.chunks), first.num_tokens, first.seq_len
    heads, head_dim = q.shape[1:]
    queries = q.index_select(0, group.rows).view(count, length, heads, head_dim)
    if group.block_ids is None and len(caches) == 2:  # whole prompts: their own K/V, causal
        keys = k.index_select(0, group.rows).view(count, length, *k.shape[1:])
        values = v.index_select(0, group.rows).view(count, length, *v.shape[1:])
    else:  # cached history (or 8-bit rows): every chunk's seq_len slots through its blocks
        ids = group.block_ids
        if ids is None:
            ids = torch.cat([chunk.block_ids for chunk in group.chunks])
        keys, values = (
            _read_blocks(caches, i, ids, q.dtype).view(count, -1, *k.shape[1:])[:, :seq_len]
            for i in (0, 1)
        )
    out = F.scaled_dot_product_attention(
        queries.transpose(1, 2),  # [G, H, L, D]
        keys.transpose(1, 2),  # [G, KVH, S, D]
        values.transpose(1, 2),
        attn_mask=first.mask,  # [L, S], the same for every chunk of the group
        is_causal=first.mask is None,
        scale=scale,
        enable_gqa=True,
    )  # [G, H, L, D]
    return out.transpose(1, 2).reshape(count * length, heads, head_dim)


def _read_blocks(
    caches: tuple[torch.Tensor, ...], which: int, block_ids: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """K (``which`` 0) or V (1) of the blocks ``block_ids`` (int64 [nb]) -> [nb, bs, KVH, D] (a
    copy); 8-bit caches (with their scales in ``caches[2:]``) widened to ``dtype``."""
    blocks = caches[which].index_select(0, block_ids)
    if len(caches) == 2:
        return blocks
    return dequantize(blocks, caches[2 + which].index_select(0, block_ids)).to(dtype)


def decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: DecodeBatch,
    scale: float,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The kernel's contract in torch ops, for when it is unavailable: gathers whole blocks
    (not positions) and computes in float32; 8-bit caches widened by their ``scales``.
    q [Q, H, D] -> float32 [Q, H, D]."""
    batch = batch.per_query()  # one row per query token
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_blocks = -(-batch.max_seq_len // block_size)
    tables = batch.block_tables[:, :num_blocks].long()  # [B, nb]
    span = num_blocks * block_size
    keys, values = k_cache[tables], v_cache[tables]  # [B, nb, bs, KVH, D]
    if scales is not None:
        keys, values = dequantize(keys, scales[0][tables]), dequantize(values, scales[1][tables])
    keys = keys.view(num_seqs, span, num_kv_heads, head_dim)  # [B, S, KVH, D]
    values = values.view(num_seqs, span, num_kv_heads, head_dim)
    valid = torch.arange(span) < batch.seq_lens[:, None]  # [B, S]
    # A slot past seq_len may hold anything, NaN included, and 0 * NaN is NaN: zero it.
    values = torch.where(valid[:, :, None, None], values.float(), 0.0)
    group = num_heads // num_kv_heads
    q_grouped = q.float().view(num_seqs, num_kv_heads, group, head_dim)  # [B, KVH, G, D]
    scores = q_grouped @ keys.float().permute(0, 2, 3, 1) * scale  # [B, KVH, G, S]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = probs @ values.permute(0, 2, 1, 3)  # [B, KVH, G, D]
    return out.reshape(num_seqs, num_heads, head_dim)
