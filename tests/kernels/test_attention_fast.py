"""The fast paged attention (C decode kernel, its torch fallback, SDPA prefill chunks) against
``paged_attention_reference`` on the random batches of test_attention.py, and the step layout
that ``prepare_step`` builds from a plan."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pagekv.kernels import build
from pagekv.kernels import decode as cpu_kernel
from pagekv.kernels import prefill as prefill_kernel
from pagekv.kernels.decode import DecodeBatch
from pagekv.models.loader import LoadedModel
from pagekv.runner.attention import paged_attention_reference, write_kv
from pagekv.runner.fast_attention import (
    FastAttention,
    PrefillChunk,
    StepLayout,
    decode_attention_torch,
)
from tests.runner.test_attention import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, SCALE, Case, _make_case

# The kernels of the best target here; a test marked ``on_every_target`` runs once per kernel
# target, with these two swapped for that target's (``_target_kernels``). Tests of the torch
# path run once.
KERNEL = cpu_kernel.load()
PREFILL = prefill_kernel.load()


@pytest.fixture
def _target_kernels(kernel_target: str) -> Iterator[str]:
    global KERNEL, PREFILL
    saved = KERNEL, PREFILL
    KERNEL, PREFILL = cpu_kernel.load(), prefill_kernel.load()
    yield kernel_target
    KERNEL, PREFILL = saved


def _tile_unit(name: str) -> Iterator[str]:
    """The tile kernels on unit ``name`` if the target has it, switched back after."""
    if PREFILL is None or not PREFILL.available:
        pytest.skip("the bf16 tile kernels need the avx512bf16 or amx target (and a compiler)")
    default = PREFILL.backend
    if not PREFILL.use_backend(name):
        pytest.skip(f"no {name} on this target")
    yield name
    assert default is not None and PREFILL.use_backend(default)


@pytest.fixture(params=["amx", "avx512-bf16"])
def prefill_unit(request: pytest.FixtureRequest, _target_kernels: str) -> Iterator[str]:
    """The tile kernels on each unit the target has (tiles, vectors)."""
    yield from _tile_unit(request.param)


on_every_target = pytest.mark.usefixtures("_target_kernels")
needs_prefill_kernel = pytest.mark.usefixtures("prefill_unit")


@pytest.fixture(params=["amx", "avx512-bf16", "float32 vectors"])
def bf16_prefill_unit(request: pytest.FixtureRequest, _target_kernels: str) -> Iterator[str]:
    """bf16 prefill chunks on each unit the target has: tiles where it has them, else the
    float32 vector kernel reading bf16 K/V."""
    if PREFILL is None:
        pytest.skip("no C++ compiler: the kernel is optional")
    if request.param == "float32 vectors":
        if PREFILL.available:
            pytest.skip("this target prefills bf16 in tiles")
        yield request.param
        return
    yield from _tile_unit(request.param)


needs_compiler = pytest.mark.skipif(
    build.find_compiler() is None, reason="no C++ compiler: the kernel is optional"
)


def _fast_inputs(case: Case) -> tuple[list[int], StepLayout, torch.Tensor, torch.Tensor]:
    """Reorder the case's sequences decode-first, as prepare_step does.

    Returns (order of sequences, layout, new k [T, KVH, D], new v) in the fast order.
    """
    meta, bs = case.meta, case.meta.block_size
    q_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).tolist()
    seq_lens = meta.seq_lens.tolist()
    order = [b for b, n in enumerate(q_lens) if n == 1] + [b for b, n in enumerate(q_lens) if n > 1]
    decode = [b for b in order if q_lens[b] == 1]
    width = max((-(-seq_lens[b] // bs) for b in decode), default=0)
    batch = DecodeBatch(
        block_tables=meta.block_tables[decode, :width].to(torch.int32).contiguous(),
        seq_lens=torch.tensor([seq_lens[b] for b in decode], dtype=torch.int32),
        max_seq_len=max((seq_lens[b] for b in decode), default=0),
    )
    chunks, start = [], len(decode)
    for b in order[len(decode) :]:
        seq_len, num = seq_lens[b], q_lens[b]
        blocks = meta.block_tables[b, : -(-seq_len // bs)]
        mask = None
        if num < seq_len:
            positions = torch.arange(seq_len - num, seq_len)
            mask = torch.arange(seq_len)[None, :] <= positions[:, None]
        chunks.append(PrefillChunk(start, num, seq_len, blocks, mask))
        start += num
    new_k = torch.cat([case.seq_k[b][seq_lens[b] - q_lens[b] :] for b in order])
    new_v = torch.cat([case.seq_v[b][seq_lens[b] - q_lens[b] :] for b in order])
    return order, StepLayout(len(decode), batch, tuple(chunks)), new_k, new_v


def _run_fast(case: Case, backend: str) -> torch.Tensor:
    """The fast path's output, put back into the case's own token order."""
    order, layout, new_k, new_v = _fast_inputs(case)
    loc = case.meta.query_start_loc.tolist()
    rows = torch.cat([torch.arange(loc[b], loc[b + 1]) for b in order])  # fast -> case order
    kernels = (KERNEL, PREFILL) if backend == "kernel" else (None, None)
    attention = FastAttention(layout, SCALE, *kernels)
    out_fast = attention(case.q[rows], new_k, new_v, (case.k_cache, case.v_cache))
    out = torch.empty_like(out_fast)
    out[rows] = out_fast
    return out


def _assert_fast_matches_reference_float32(backend: str, block_size: int) -> None:
    for seed in range(40):
        case = _make_case(seed * 7 + block_size, block_size, torch.float32)
        expected = paged_attention_reference(case.q, case.k_cache, case.v_cache, case.meta, SCALE)
        out = _run_fast(case, backend)
        assert out.dtype == torch.float32 and not out.isnan().any()
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def _assert_fast_matches_reference_bfloat16(backend: str, block_size: int) -> None:
    for seed in range(15):
        case = _make_case(1000 + seed, block_size, torch.bfloat16)
        expected = paged_attention_reference(case.q, case.k_cache, case.v_cache, case.meta, SCALE)
        out = _run_fast(case, backend)
        assert out.dtype == torch.bfloat16
        # Same bf16 inputs; the kernels are float32 inside (the prefill kernel rounds the
        # probabilities to bf16 as SDPA does), SDPA accumulates in float32: only the rounding
        # of intermediate products and of the output to bf16 differs.
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_torch_path_matches_reference_float32(block_size: int) -> None:
    _assert_fast_matches_reference_float32("torch", block_size)


@needs_compiler
@on_every_target
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_kernels_match_reference_float32(block_size: int) -> None:
    _assert_fast_matches_reference_float32("kernel", block_size)


@pytest.mark.parametrize("block_size", [1, 16])
def test_torch_path_matches_reference_bfloat16(block_size: int) -> None:
    _assert_fast_matches_reference_bfloat16("torch", block_size)


@needs_compiler
@on_every_target
@pytest.mark.parametrize("block_size", [1, 16])
def test_kernels_match_reference_bfloat16(block_size: int) -> None:
    _assert_fast_matches_reference_bfloat16("kernel", block_size)


def _eight_bit(case: Case, kv: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The case's float caches rounded to 8 bits (int8, or fp8 bits in uint8) with scales."""
    k_cache, v_cache = case.k_cache, case.v_cache
    shape = k_cache.shape
    caches = [torch.zeros(shape, dtype=kv), torch.zeros(shape, dtype=kv)]
    caches += [torch.zeros(shape[:3], dtype=torch.float16) for _ in range(2)]
    slots = torch.arange(shape[0] * shape[1])
    write_kv(*caches, k_cache.flatten(0, 1).float(), v_cache.flatten(0, 1).float(), slots)
    return tuple(caches)


@needs_compiler
@on_every_target
@pytest.mark.parametrize("kv", [torch.int8, torch.uint8], ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_over_8bit_blocks_match_the_reference(kv: torch.dtype, dtype: torch.dtype) -> None:
    """Decode rows (the decode kernel's 8-bit entries) and prefill chunks (the prefill kernel
    over the chunks' blocks widened) against the reference reading the same 8-bit blocks."""
    for seed in range(12):
        case = _make_case(2000 + seed, 16, dtype)
        caches = _eight_bit(case, kv)
        expected = paged_attention_reference(
            case.q, caches[0], caches[1], case.meta, SCALE, scales=(caches[2], caches[3])
        )
        order, layout, new_k, new_v = _fast_inputs(case)
        loc = case.meta.query_start_loc.tolist()
        rows = torch.cat([torch.arange(loc[b], loc[b + 1]) for b in order])
        out = torch.empty_like(case.q)
        out[rows] = FastAttention(layout, SCALE, KERNEL, PREFILL)(
            case.q[rows], new_k, new_v, caches
        )
        # int8 keys meet int16 queries in the decode kernel; bf16: the widened rows rounded
        tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-3
        torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_of_one_shape_are_attended_together(dtype: torch.dtype) -> None:
    """Prefill chunks of the same shape (several suffixes over cached prefixes, several whole
    prompts of one length) go through one batched SDPA call: the same numbers as one call per
    chunk, and as the reference."""
    lens = [(40, 8), (12, 12), (40, 8), (7, 1), (40, 8), (12, 12), (40, 5), (25, 25)]
    case = _make_case(5, 16, dtype, lens=lens)
    order, layout, new_k, new_v = _fast_inputs(case)
    loc = case.meta.query_start_loc.tolist()
    rows = torch.cat([torch.arange(loc[b], loc[b + 1]) for b in order])
    q, caches = case.q[rows], (case.k_cache, case.v_cache)
    grouped = FastAttention(layout, SCALE, None)(q, new_k, new_v, caches)
    assert sorted(len(g.chunks) for g in FastAttention(layout, SCALE, None)._groups) == [1, 1, 2, 3]
    for chunk in layout.prefill:  # the same chunk alone in its step
        alone = StepLayout(0, layout.decode, (chunk,))
        tokens = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
        single = FastAttention(alone, SCALE, None)(q, new_k, new_v, caches)
        torch.testing.assert_close(grouped[tokens], single[tokens], atol=0, rtol=0)
    out = torch.empty_like(grouped)
    out[rows] = grouped
    expected = paged_attention_reference(case.q, case.k_cache, case.v_cache, case.meta, SCALE)
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)


@dataclass
class PrefillStep:
    """A step of prefill chunks only: q and the new k/v [T, heads, head_dim] in flat order."""

    q: torch.Tensor
    new_k: torch.Tensor
    new_v: torch.Tensor
    caches: tuple[torch.Tensor, torch.Tensor]
    layout: StepLayout

    def attend(self, prefill: prefill_kernel.PrefillKernel | None) -> torch.Tensor:
        attention = FastAttention(self.layout, SCALE, None, prefill)
        return attention(self.q, self.new_k, self.new_v, self.caches)


NO_DECODE = DecodeBatch(torch.zeros(0, 0, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), 0)


def _prefill_step(
    seed: int,
    lens: list[tuple[int, int]],
    heads: tuple[int, int],
    block_size: int,
    dtype: torch.dtype = torch.bfloat16,
    head_dim: int = 64,
) -> PrefillStep:
    """Prefill chunks of (history, new tokens) through shuffled blocks, NaN in every slot no
    chunk has written."""
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-(h + n) // block_size) for h, n in lens]
    order = torch.randperm(sum(needed) + 2, generator=gen)
    shape = (sum(needed) + 2, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    chunks, new_k, new_v, used, start = [], [], [], 0, 0
    for (history, new), count in zip(lens, needed, strict=True):
        blocks = order[used : used + count]
        used += count
        positions = torch.arange(history + new)
        slots = blocks[positions // block_size] * block_size + positions % block_size
        for cache, step_rows in ((k_cache, new_k), (v_cache, new_v)):
            rows = torch.randn(history + new, num_kv_heads, head_dim, generator=gen).to(cache.dtype)
            cache.view(-1, num_kv_heads, head_dim)[slots] = rows
            step_rows.append(rows[history:])
        mask = positions[None, :] <= (history + torch.arange(new))[:, None]
        chunks.append(PrefillChunk(start, new, history + new, blocks, mask if history else None))
        start += new
    q = torch.randn(start, num_heads, head_dim, generator=gen).to(dtype)
    layout = StepLayout(0, NO_DECODE, tuple(chunks))
    return PrefillStep(q, torch.cat(new_k), torch.cat(new_v), (k_cache, v_cache), layout)


@pytest.mark.usefixtures("bf16_prefill_unit")
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("heads", [(NUM_HEADS, NUM_KV_HEADS), (8, 1), (4, 4), (10, 2)])
def test_prefill_kernel_matches_float32_attention(heads: tuple[int, int], block_size: int) -> None:
    """Whole prompts and chunks over a history, 2 to 333 new tokens (partial query blocks,
    several 64-key score rows), against float32 attention of the same bf16 numbers: within
    what SDPA in bf16 gets, and never reading an unwritten (NaN) slot."""
    assert PREFILL is not None
    lens = [(0, 277), (0, 5), (48, 100), (13, 2), (0, 64), (200, 133), (0, 2), (63, 65)]
    _assert_bf16_prefill_near_float32(_prefill_step(block_size, lens, heads, block_size))


def _assert_bf16_prefill_near_float32(step: PrefillStep) -> None:
    """The prefill kernel's bf16 rows against float32 attention of the same bf16 numbers: within
    what SDPA in bf16 gets, and never reading an unwritten (NaN) slot."""
    assert PREFILL is not None
    out, sdpa = step.attend(PREFILL), step.attend(None)
    group = step.q.shape[1] // step.caches[0].shape[2]
    for chunk in step.layout.prefill:
        rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
        keys, values = (
            c[chunk.block_ids].flatten(0, 1)[: chunk.seq_len].float().repeat_interleave(group, 1)
            for c in step.caches
        )
        history = chunk.seq_len - chunk.num_tokens
        visible = (
            torch.arange(chunk.seq_len)[None, :]
            <= history + torch.arange(chunk.num_tokens)[:, None]
        )
        expected = F.scaled_dot_product_attention(
            step.q[rows].float().transpose(0, 1),
            keys.transpose(0, 1),
            values.transpose(0, 1),
            attn_mask=visible,
            scale=SCALE,
        ).transpose(0, 1)
        assert not out[rows].isnan().any()
        error = (out[rows].float() - expected).abs().max().item()
        sdpa_error = (sdpa[rows].float() - expected).abs().max().item()
        assert error <= max(2 * sdpa_error, 1e-2), (chunk, error, sdpa_error)


# Head sizes beyond the default model's 64, with their models' GQA groups: 128 as Qwen2.5-1.5B
# (12 heads on 2 KV heads), 256 as Gemma 3 (4 on 1), and groups of 1 and 8.
WIDE_HEADS = [(128, (12, 2)), (128, (8, 1)), (128, (4, 4)), (256, (4, 1)), (256, (2, 2))]


@on_every_target
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize(("head_dim", "heads"), WIDE_HEADS, ids=str)
def test_prefill_kernel_takes_wide_heads(
    head_dim: int, heads: tuple[int, int], block_size: int
) -> None:
    """head_dim 128 and 256 through the float32-vector kernel on every target: float32 within
    float32 rounding of SDPA, each chunk the same bits alone; bf16 (widened as it is packed)
    near float32 attention."""
    if PREFILL is None or not PREFILL.supports_prefill(torch.float32, head_dim):
        pytest.skip("no C++ compiler: the kernel is optional")
    assert PREFILL.supports_prefill(torch.bfloat16, head_dim)
    lens = [(0, 77), (0, 5), (48, 40), (13, 2), (100, 33)]
    step = _prefill_step(block_size, lens, heads, block_size, torch.float32, head_dim)
    out, sdpa = step.attend(PREFILL), step.attend(None)
    assert out.dtype == torch.float32 and not out.isnan().any()
    torch.testing.assert_close(out, sdpa, atol=2e-5, rtol=2e-5)
    _assert_each_chunk_alone_is_the_same(step, out)
    _assert_bf16_prefill_near_float32(
        _prefill_step(block_size, lens, heads, block_size, torch.bfloat16, head_dim)
    )


@on_every_target
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("heads", [(NUM_HEADS, NUM_KV_HEADS), (8, 1), (4, 4), (10, 2)])
def test_float32_prefill_kernel_matches_sdpa(heads: tuple[int, int], block_size: int) -> None:
    """float32 chunks (whole prompts, chunks over a history, 2 to 333 new tokens: partial query
    and key blocks) through the kernel: within float32 rounding of SDPA on the same numbers,
    never reading an unwritten (NaN) slot, and a chunk's rows the same bits alone in its step
    as beside the others."""
    if PREFILL is None or not PREFILL.supports_prefill(torch.float32, 64):
        pytest.skip("no C++ compiler: the kernel is optional")
    lens = [(0, 277), (0, 5), (48, 100), (13, 2), (0, 64), (200, 133), (0, 2), (63, 65)]
    step = _prefill_step(block_size, lens, heads, block_size, torch.float32)
    out, sdpa = step.attend(PREFILL), step.attend(None)
    assert out.dtype == torch.float32 and not out.isnan().any()
    torch.testing.assert_close(out, sdpa, atol=2e-5, rtol=2e-5)
    _assert_each_chunk_alone_is_the_same(step, out)


def _assert_each_chunk_alone_is_the_same(step: PrefillStep, together: torch.Tensor) -> None:
    """Each chunk of ``step`` attended alone in a step gives the bits it got beside the others
    (``together``, the whole step's output through the prefill kernel)."""
    for chunk in step.layout.prefill:
        rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
        alone = PrefillStep(
            step.q[rows],
            step.new_k[rows],
            step.new_v[rows],
            step.caches,
            StepLayout(0, NO_DECODE, (dataclasses.replace(chunk, token_start=0),)),
        ).attend(PREFILL)
        torch.testing.assert_close(alone, together[rows], atol=0, rtol=0)


@pytest.mark.usefixtures("bf16_prefill_unit")
def test_prefill_kernel_rows_do_not_depend_on_the_step() -> None:
    """A chunk's rows are the same bits alone in its step as beside other chunks (its query
    blocks' extra keys add exact zeros; threads split work, never a row's sums)."""
    lens = [(0, 40), (17, 30), (0, 300), (100, 9)]
    step = _prefill_step(3, lens, (NUM_HEADS, NUM_KV_HEADS), 16)
    _assert_each_chunk_alone_is_the_same(step, step.attend(PREFILL))


@on_every_target
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("heads", [(NUM_HEADS, NUM_KV_HEADS), (8, 1), (4, 4), (10, 2)])
def test_kernel_matches_torch_decode(
    dtype: torch.dtype, head_dim: int, heads: tuple[int, int]
) -> None:
    """Long, ragged decode histories through shuffled blocks; NaN in every unwritten slot.
    Group sizes 3, 8, 1, 5: the kernel specializes some and loops over heads for the rest."""
    num_heads, num_kv_heads = heads
    if build.find_compiler() is None:
        pytest.skip("no C++ compiler")
    assert KERNEL is not None, "a compiler is here, so the kernel must build"
    gen = torch.Generator().manual_seed(head_dim)
    num_seqs, block_size, max_blocks = 37, 16, 40
    num_blocks = num_seqs * max_blocks + 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    seq_lens = torch.randint(1, block_size * max_blocks + 1, (num_seqs,), generator=gen)
    positions = torch.arange(block_size * max_blocks)
    unwritten = positions[None, :] >= seq_lens[:, None]  # [B, S]
    tables = torch.randperm(num_blocks, generator=gen)[: num_seqs * max_blocks]
    tables = tables.view(num_seqs, max_blocks)
    flat_k, flat_v = (
        k_cache.view(-1, num_kv_heads, head_dim),
        v_cache.view(-1, num_kv_heads, head_dim),
    )
    slots = (tables[:, positions // block_size] * block_size + positions % block_size)[unwritten]
    flat_k[slots], flat_v[slots] = float("nan"), float("nan")
    batch = DecodeBatch(tables.to(torch.int32), seq_lens.to(torch.int32), int(seq_lens.max()))
    q = torch.randn(num_seqs, num_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    out = KERNEL(q, k_cache, v_cache, batch, scale)
    expected = decode_attention_torch(q, k_cache, v_cache, batch, scale)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def _drafted_decodes(
    seed: int,
    dtype: torch.dtype,
    heads: tuple[int, int],
    query_lens: list[int],
    seq_lens: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DecodeBatch]:
    """Drafted decodes: sequence b feeds its last ``query_lens[b]`` positions; block size 16,
    shuffled blocks, NaN in every slot past each sequence (the last block's tail, unused blocks),
    so a token reading past its sequence fails. Returns (q, k_cache, v_cache, batch)."""
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(seed)
    block_size = 16
    width = max(-(-n // block_size) for n in seq_lens)
    num_blocks = len(seq_lens) * width + 1
    shape = (num_blocks, block_size, num_kv_heads, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: len(seq_lens) * width]
    tables = tables.view(len(seq_lens), width).to(torch.int32)
    for b, n in enumerate(seq_lens):
        for cache in (k_cache, v_cache):
            cache[tables[b, (n - 1) // block_size].long(), (n - 1) % block_size + 1 :] = float(
                "nan"
            )
            cache[tables[b, -(-n // block_size) :].long()] = float("nan")
    batch = DecodeBatch(
        tables,
        torch.tensor(seq_lens, dtype=torch.int32),
        max(seq_lens),
        query_lens=torch.tensor(query_lens, dtype=torch.int32),
        num_queries=sum(query_lens),
        max_query_len=max(query_lens),
    )
    q = torch.randn(sum(query_lens), num_heads, HEAD_DIM, generator=gen).to(dtype)
    return q, k_cache, v_cache, batch


@pytest.mark.skipif(KERNEL is None, reason="no C++ compiler: the kernel is optional")
@on_every_target
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(NUM_HEADS, NUM_KV_HEADS), (10, 2), (4, 4)])
def test_kernel_attends_several_query_tokens_of_a_sequence(
    dtype: torch.dtype, heads: tuple[int, int]
) -> None:
    """Drafted decodes: the last ``query_lens[b]`` positions of sequence b in one task, each
    seeing the history up to itself. The rows of the same tokens given one at a time
    (``per_query``, which read the history once each): bit for bit in float32, within float32
    rounding in bf16 (several tokens' scores take the pair-transposed path); close to torch's
    reference; every slot past a sequence is NaN, so a token reading past itself fails."""
    assert KERNEL is not None
    query_lens, seq_lens = [1, 5, 3, 1, 8, 2], [1, 37, 300, 64, 9, 130]
    q, k_cache, v_cache, batch = _drafted_decodes(7, dtype, heads, query_lens, seq_lens)
    tables = batch.block_tables
    out = KERNEL(q, k_cache, v_cache, batch, SCALE)
    one_by_one = batch.per_query()
    first_tokens = [1, 33, 298, 64, 2, 129]  # one row per query token, up to itself
    want = [
        n
        for first, q_len in zip(first_tokens, query_lens, strict=True)
        for n in range(first, first + q_len)
    ]
    assert one_by_one.seq_lens.tolist() == want
    exact = 0 if dtype == torch.float32 else 1e-5
    torch.testing.assert_close(
        out, KERNEL(q, k_cache, v_cache, one_by_one, SCALE), atol=exact, rtol=exact
    )
    expected = decode_attention_torch(q, k_cache, v_cache, batch, SCALE)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for bad in ([1, 5, 3, 1, 8, 0], [1, 5, 3, 1, 10, 2]):  # a sequence with no query; 10 > 9
        with pytest.raises(ValueError):
            DecodeBatch(
                tables,
                batch.seq_lens,
                max(seq_lens),
                query_lens=torch.tensor(bad, dtype=torch.int32),
                num_queries=sum(bad),
                max_query_len=max(bad),
            )
    with pytest.raises(ValueError):  # q rows that do not match the query lengths
        KERNEL(q[:-1], k_cache, v_cache, batch, SCALE)


@pytest.mark.skipif(KERNEL is None, reason="no C++ compiler: the kernel is optional")
@on_every_target
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(NUM_HEADS, NUM_KV_HEADS), (8, 1), (4, 4), (10, 2)])
@pytest.mark.parametrize(("query_lens", "seq_lens"), [([1], [333]), ([1, 4], [17, 290])])
def test_threads_sharing_a_sequence_change_no_bit(
    dtype: torch.dtype, heads: tuple[int, int], query_lens: list[int], seq_lens: list[int]
) -> None:
    """With fewer sequences than threads, the threads share each sequence (its positions, rows
    and value dims); with more, each takes whole ones. Every thread count gives the bits of
    one thread, log-sum-exps and a history from ``start`` included."""
    assert KERNEL is not None
    q, k_cache, v_cache, batch = _drafted_decodes(11, dtype, heads, query_lens, seq_lens)
    start = 16  # below every sequence's first query position
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3, 4, 6):  # 4 and 6: more threads than kv heads
            torch.set_num_threads(threads)
            lse = torch.empty(q.shape[:2])
            outs.append((KERNEL(q, k_cache, v_cache, batch, SCALE, start, lse), lse))
    finally:
        torch.set_num_threads(before)
    assert not outs[0][0].isnan().any()
    for out, lse in outs[1:]:
        torch.testing.assert_close(out, outs[0][0], atol=0, rtol=0)
        torch.testing.assert_close(lse, outs[0][1], atol=0, rtol=0)


@needs_prefill_kernel
@pytest.mark.parametrize("heads", [(NUM_HEADS, NUM_KV_HEADS), (10, 2), (4, 4)])
def test_drafted_decodes_on_tiles(heads: tuple[int, int]) -> None:
    """bf16 drafted decodes through the prefill kernel's tiles (``PrefillKernel.decode``): the
    float32 attention of each token over the history up to itself, within bf16 rounding (the
    probabilities are rounded to bf16, as SDPA does); changing the last position of every
    sequence leaves every earlier token's row bit for bit as it was; slots past a sequence are
    NaN. ``FastAttention`` takes this path for steps of two or more query tokens per sequence
    on average, and the decode kernel for one token each."""
    assert PREFILL is not None and KERNEL is not None
    num_kv_heads, block_size = heads[1], 16
    query_lens, seq_lens = [1, 5, 3, 8, 2, 4], [1, 37, 300, 64, 9, 130]
    q, k_cache, v_cache, batch = _drafted_decodes(11, torch.bfloat16, heads, query_lens, seq_lens)
    tables = batch.block_tables
    out = torch.full_like(q, float("nan"))
    assert PREFILL.decode(q, k_cache, v_cache, batch, SCALE, out)
    expected = decode_attention_torch(q, k_cache, v_cache, batch, SCALE)  # float32 inside
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    last = torch.cumsum(torch.tensor(query_lens), 0) - 1  # each sequence's last token's row
    changed_k, changed_v = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(seq_lens):
        block, offset = tables[b, (n - 1) // block_size].long(), (n - 1) % block_size
        changed_k[block, offset] = 3.0
        changed_v[block, offset] *= 40
    out_changed = torch.empty_like(out)
    assert PREFILL.decode(q, changed_k, changed_v, batch, SCALE, out_changed)
    earlier = torch.ones(len(q), dtype=torch.bool)
    earlier[last] = False
    assert torch.equal(out_changed[earlier], out[earlier])
    assert (out_changed[last] != out[last]).flatten(1).any(1).all()
    caches = (k_cache, v_cache)
    routed = FastAttention(StepLayout(len(q), batch, ()), SCALE, KERNEL, PREFILL)(
        q, q[:, :num_kv_heads], q[:, :num_kv_heads], caches
    )
    assert torch.equal(routed, out)
    one_each = DecodeBatch(tables, batch.seq_lens, max(seq_lens))  # the decode kernel's turn
    q1 = q[: len(seq_lens)].contiguous()
    routed = FastAttention(StepLayout(len(q1), one_each, ()), SCALE, KERNEL, PREFILL)(
        q1, q1[:, :num_kv_heads], q1[:, :num_kv_heads], caches
    )
    assert torch.equal(routed, KERNEL(q1, k_cache, v_cache, one_each, SCALE).to(torch.bfloat16))
    with pytest.raises(ValueError):  # q rows that do not match the query lengths
        PREFILL.decode(q[:-1], k_cache, v_cache, batch, SCALE, out[:-1])
    short = dataclasses.replace(batch, block_tables=tables[:-1].contiguous())
    with pytest.raises(ValueError):  # a table row missing: the C side would read past it
        PREFILL.decode(q, k_cache, v_cache, short, SCALE, out)


def _decode_rows_sharing(
    seed: int, dtype: torch.dtype, shared_blocks: int, seq_lens: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DecodeBatch]:
    """Decode rows whose tables begin with the same ``shared_blocks`` blocks (then their own,
    shuffled), block size 16, NaN in every slot past each row's sequence."""
    gen = torch.Generator().manual_seed(seed)
    block_size, kv_heads = 16, NUM_KV_HEADS
    own = [-(-n // block_size) - shared_blocks for n in seq_lens]
    num_blocks = shared_blocks + sum(own) + 1
    order = torch.randperm(num_blocks, generator=gen).tolist()
    common, rest = order[:shared_blocks], order[shared_blocks:]
    tables = []
    for count in own:
        tables.append(common + rest[:count])
        rest = rest[count:]
    shape = (num_blocks, block_size, kv_heads, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    for table, n in zip(tables, seq_lens, strict=True):  # unwritten: the last block's tail
        for cache in (k_cache, v_cache):
            cache[table[-1], (n - 1) % block_size + 1 :] = float("nan")
    width = max(len(t) for t in tables)
    batch = DecodeBatch(
        torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
        max(seq_lens),
        shared_blocks,
    )
    q = torch.randn(len(seq_lens), NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    return q, k_cache, v_cache, batch


@pytest.mark.skipif(KERNEL is None, reason="no C++ compiler: the kernel is optional")
@on_every_target
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_attends_from_a_start_and_reports_log_sum_exp(dtype: torch.dtype) -> None:
    """With ``start``, the kernel attends positions [start, seq_len) only (the earlier ones
    are NaN here) and gives each head's log-sum-exp of its scaled scores there."""
    assert KERNEL is not None
    q, k_cache, v_cache, batch = _decode_rows_sharing(1, dtype, 3, [49, 50, 64, 65, 130, 300])
    start = 3 * 16
    for cache in (k_cache, v_cache):  # the kernel must not read the shared blocks now
        cache[batch.block_tables[0, :3].long()] = float("nan")
    lse = torch.empty(q.shape[:2])
    out = KERNEL(q, k_cache, v_cache, batch, SCALE, start=start, lse=lse)
    group = NUM_HEADS // NUM_KV_HEADS
    for b, n in enumerate(batch.seq_lens.tolist()):
        blocks = batch.block_tables[b, : -(-n // 16)].long()
        keys, values = (
            c[blocks].flatten(0, 1)[start:n].float().repeat_interleave(group, 1)
            for c in (k_cache, v_cache)
        )  # [n - start, H, D]
        scores = torch.einsum("hd,shd->hs", q[b].float(), keys) * SCALE
        torch.testing.assert_close(lse[b], torch.logsumexp(scores, -1), atol=1e-4, rtol=1e-5)
        expected = torch.einsum("hs,shd->hd", torch.softmax(scores, -1), values)
        torch.testing.assert_close(out[b], expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):  # a start that leaves a row nothing
        KERNEL(q, k_cache, v_cache, batch, SCALE, start=49, lse=lse)


@pytest.mark.skipif(KERNEL is None, reason="no C++ compiler: the kernel is optional")
@on_every_target
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_several_query_tokens_from_a_start_with_log_sum_exp(dtype: torch.dtype) -> None:
    """Drafted decodes over a shared prefix (cascade attention's decode part): with ``start``
    and ``lse``, several query tokens per sequence give what the same tokens give one per row
    (bit for bit in float32, within float32 rounding of the scores in bf16)."""
    assert KERNEL is not None
    _, k_cache, v_cache, shared = _decode_rows_sharing(2, dtype, 3, [60, 64, 130, 300])
    query_lens = [3, 1, 5, 2]
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    batch = dataclasses.replace(
        shared,
        query_lens=torch.tensor(query_lens, dtype=torch.int32),
        num_queries=sum(query_lens),
        max_query_len=max(query_lens),
    )
    start = 3 * 16
    lse, lse_rows = torch.empty(q.shape[:2]), torch.empty(q.shape[:2])
    out = KERNEL(q, k_cache, v_cache, batch, SCALE, start=start, lse=lse)
    rows = KERNEL(q, k_cache, v_cache, batch.per_query(), SCALE, start=start, lse=lse_rows)
    exact = 0 if dtype == torch.float32 else 1e-5
    torch.testing.assert_close(out, rows, atol=exact, rtol=exact)
    torch.testing.assert_close(lse, lse_rows, atol=exact, rtol=exact)
    assert not out.isnan().any() and not lse.isnan().any()
    with pytest.raises(ValueError):  # the first token of sequence 0 (position 57) is before it
        KERNEL(q, k_cache, v_cache, batch, SCALE, start=58, lse=lse)


@needs_prefill_kernel
@pytest.mark.parametrize("rows", [4, 7, 64])
def test_cascade_attention_over_a_shared_prefix(rows: int) -> None:
    """bf16 decode rows sharing 5 blocks: the prefix through the prefill kernel once for all
    rows, merged with each row's rest from the decode kernel, agrees with float32 attention
    over whole sequences as closely as the decode kernel alone does, within bf16 rounding."""
    assert PREFILL is not None and KERNEL is not None
    seq_lens = [81 + (37 * i) % 150 for i in range(rows)]
    q, k_cache, v_cache, batch = _decode_rows_sharing(2, torch.bfloat16, 5, seq_lens)
    layout = StepLayout(rows, batch, ())
    caches = (k_cache, v_cache)
    cascade = FastAttention(layout, SCALE, KERNEL, PREFILL)(q, q[:, :3], q[:, :3], caches)
    alone = FastAttention(layout, SCALE, KERNEL, None)(q, q[:, :3], q[:, :3], caches)
    expected = decode_attention_torch(q, k_cache, v_cache, batch, SCALE)  # float32 inside
    assert not torch.equal(cascade, alone)  # the cascade ran: other roundings
    torch.testing.assert_close(cascade.float(), expected, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(alone.float(), expected, atol=2e-2, rtol=2e-2)


def test_shared_blocks_of_a_decode_batch() -> None:
    """prepare_step counts the leading blocks all decode rows share, only whole blocks before
    each row's own position."""
    from pagekv.runner.batch import _shared_blocks

    def shared(tables: list[list[int]], limit: int) -> int:
        return _shared_blocks(torch.tensor(tables, dtype=torch.int32), limit)

    assert shared([[4, 5, 6, 7], [4, 5, 6, 9], [4, 5, 2, 0]], 3) == 2
    assert shared([[4, 5, 6, 7], [4, 5, 6, 7]], 3) == 3  # capped by the positions
    assert shared([[4, 5, 6]], 3) == 0  # one row: nothing to share
    assert shared([[1, 5], [4, 5]], 2) == 0
    assert shared([[1, 5], [1, 5]], 0) == 0


@pytest.mark.skipif(KERNEL is None, reason="no C++ compiler: the kernel is optional")
@on_every_target
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [0, 1, 64, 300])
def test_kernel_writes_kv_rows_like_torch(dtype: torch.dtype, tokens: int) -> None:
    """The kernel's KV write puts the same bytes in the same slots as ``write_kv``; a slot out
    of range raises before anything is written; other dtypes or layouts are declined."""
    assert KERNEL is not None
    gen = torch.Generator().manual_seed(tokens)
    k_cache = torch.randn(40, 16, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v_cache = torch.randn(40, 16, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    slots = torch.randperm(40 * 16, generator=gen)[:tokens]
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    write_kv(expected_k, expected_v, k, v, slots)
    assert KERNEL.write_kv(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    if tokens:
        bad = slots.clone()
        bad[-1] = 40 * 16  # one past the end
        with pytest.raises(ValueError, match="slot"):
            KERNEL.write_kv(k_cache, v_cache, k + 1, v + 1, bad)
        assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    assert not KERNEL.write_kv(k_cache, v_cache, k.double(), v.double(), slots)
    assert not KERNEL.write_kv(k_cache, v_cache, k, v, slots.to(torch.int32))
    assert not KERNEL.write_kv(k_cache[:, ::2], v_cache[:, ::2], k, v, slots)


@pytest.mark.parametrize("module", [cpu_kernel, prefill_kernel], ids=["decode", "prefill"])
def test_kernel_disabled_by_environment(monkeypatch: pytest.MonkeyPatch, module: Any) -> None:
    build.forget()
    monkeypatch.setenv(module.DISABLE_ENV, "0")
    try:
        assert module.load() is None
    finally:
        build.forget()


def test_kernel_build_failure_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A compiler that fails leaves the engine on torch ops, with a warning, not an error."""
    build.forget()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # /bin/false: found, always fails
    try:
        assert cpu_kernel.load() is None
    finally:
        build.forget()


def test_head_dim_without_kernel_entry_uses_torch() -> None:
    assert HEAD_DIM == 64
    if KERNEL is not None:
        assert all(KERNEL.supports(torch.float32, d) for d in (64, 128, 256))
        assert not KERNEL.supports(torch.float32, 80)
    if PREFILL is not None:
        assert not PREFILL.supports_prefill(torch.float32, 80)


@pytest.mark.model
@on_every_target
def test_engine_fast_path_equals_reference_path(loaded: LoadedModel) -> None:
    """Whole engine, fp32: chunked prefill (budget 48 tokens), prefix-cache hits and decode rows
    mixed in one step give the same greedy tokens and logprobs on both attention backends."""
    from pagekv import SamplingParams
    from pagekv.engine import LLMEngine
    from pagekv.engine.config import EngineConfig
    from pagekv.llm import LLM
    from pagekv.runner.model_runner import AttentionBackend

    shared = list(range(300, 340))
    prompts = [shared + [400 + i] * (3 + 7 * i) for i in range(5)] + [[11, 12], [13]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    results = {}
    for backend in (AttentionBackend.FAST, AttentionBackend.REFERENCE):
        config = EngineConfig(block_size=16, num_kv_blocks=256, max_num_batched_tokens=48)
        engine = LLMEngine(config, loaded)
        engine.runner.attention = backend
        outs = LLM.from_engine(engine).generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
        )
        results[backend] = [o.outputs[0] for o in outs]
        assert any(o.num_cached_tokens > 0 for o in outs)  # prefix hits happened
    for fast, ref in zip(
        results[AttentionBackend.FAST], results[AttentionBackend.REFERENCE], strict=True
    ):
        assert fast.token_ids == ref.token_ids
        assert fast.cumulative_logprob == pytest.approx(ref.cumulative_logprob, abs=1e-3)
