"""The decode kernel over 8-bit KV blocks (int8, or fp8 e4m3 bits with a float16 scale per token
and kv head), on every kernel target: its C write rounds rows exactly as ``quantize_rows`` does,
and its attention equals torch's over the dequantized caches (one query token, drafted decodes,
a part after ``start`` with its log-sum-exp), for float32 and bfloat16 queries, head sizes 64,
128 and 256; against int8 keys with the queries in the int16 steps the kernel multiplies."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pagekv.kernels import build
from pagekv.kernels import decode as decode_kernel
from pagekv.kernels.decode import DecodeBatch
from pagekv.runner.attention import dequantize, write_kv
from pagekv.runner.fast_attention import decode_attention_torch

pytestmark = pytest.mark.skipif(build.find_compiler() is None, reason="no C++ compiler")

KV8 = {"int8": torch.int8, "fp8": torch.uint8}
BLOCK_SIZE = 16


@pytest.fixture
def kernel(kernel_target: str) -> Iterator[decode_kernel.DecodeKernel]:
    loaded = decode_kernel.load()
    assert loaded is not None, f"no decode kernel for {kernel_target}"
    yield loaded


def _caches(
    num_blocks: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    planes = (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
    scales = (
        torch.zeros(shape[:3], dtype=torch.float16),
        torch.zeros(shape[:3], dtype=torch.float16),
    )
    return (*planes, *scales)


def _rows(gen: torch.Generator, tokens: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """Rows of every magnitude: ordinary, tiny (fp16 subnormal scales), large, zero, ties."""
    x = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    magnitude = torch.tensor([1.0, 1e-6, 300.0, 0.0, 1.0])[torch.arange(tokens) % 5]
    x = x * magnitude[:, None, None]
    x[4::5, :, :4] = torch.tensor([127.0, -63.5, 0.5, -1.5])  # amax 127: halves are exact ties
    return x


@pytest.mark.parametrize("kv", list(KV8))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_write_rounds_rows_as_quantize_rows(
    kernel: decode_kernel.DecodeKernel, kv: str, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(1)
    k, v = (_rows(gen, 40, 3, 64).to(dtype) for _ in range(2))
    slots = torch.randperm(8 * BLOCK_SIZE, generator=gen)[:40]
    ours, torch_write = _caches(8, 3, 64, KV8[kv]), _caches(8, 3, 64, KV8[kv])
    assert kernel.quantize_kv(ours, k, v, slots)
    write_kv(*torch_write, k, v, slots)
    for mine, theirs in zip(ours, torch_write, strict=True):
        assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))
    with pytest.raises(ValueError, match="slot"):
        kernel.quantize_kv(ours, k[:1], v[:1], torch.tensor([8 * BLOCK_SIZE]))


def _batch(gen: torch.Generator, seq_lens: list[int], query_lens: list[int] | None) -> DecodeBatch:
    blocks = [-(-n // BLOCK_SIZE) for n in seq_lens]
    ids = torch.randperm(sum(blocks), generator=gen).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    at = 0
    for b, n in enumerate(blocks):
        tables[b, :n] = ids[at : at + n]
        at += n
    lens = None if query_lens is None else torch.tensor(query_lens, dtype=torch.int32)
    return DecodeBatch(
        tables,
        torch.tensor(seq_lens, dtype=torch.int32),
        max(seq_lens),
        query_lens=lens,
        num_queries=len(seq_lens) if query_lens is None else sum(query_lens),
        max_query_len=1 if query_lens is None else max(query_lens),
    )


@pytest.mark.parametrize("kv", list(KV8))
@pytest.mark.parametrize(
    ("dtype", "head_dim", "heads"),
    [
        (torch.float32, 64, (6, 3)),
        (torch.bfloat16, 64, (9, 3)),
        (torch.bfloat16, 128, (8, 2)),
        (torch.float32, 256, (4, 1)),
    ],
)
@pytest.mark.parametrize(
    "shape",
    [([1, 17, 300], None), ([40, 260], [3, 1]), ([5], None), ([33, 70, 9, 129, 400], None)],
    ids=["one token", "drafts", "one sequence", "more sequences than threads"],
)
def test_the_kernel_reads_8bit_blocks_as_torch_reads_them_dequantized(
    kernel: decode_kernel.DecodeKernel,
    kv: str,
    dtype: torch.dtype,
    head_dim: int,
    heads: tuple[int, int],
    shape: tuple[list[int], list[int] | None],
) -> None:
    gen = torch.Generator().manual_seed(head_dim + len(shape[0]))
    num_heads, kv_heads = heads
    batch = _batch(gen, *shape)
    num_blocks = int(batch.block_tables.max()) + 1
    caches = _caches(num_blocks, kv_heads, head_dim, KV8[kv])
    slots = torch.arange(num_blocks * BLOCK_SIZE)
    rows = torch.randn(len(slots), kv_heads, head_dim, generator=gen) * 3
    write_kv(*caches, rows, torch.randn(rows.shape, generator=gen), slots)
    q = torch.randn(batch.num_queries, num_heads, head_dim, generator=gen).to(dtype)
    widened = (dequantize(caches[0], caches[2]), dequantize(caches[1], caches[3]))
    scale = head_dim**-0.5
    expected = decode_attention_torch(_as_kernel_reads(q, kv), *widened, batch, scale)
    got = kernel(q, caches[0], caches[1], batch, scale, scales=(caches[2], caches[3]))
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=5e-5)
    start = 3
    if shape[1] is None and min(shape[0]) > start:  # the part after start, its log-sum-exp
        lse = torch.empty(q.shape[:2])
        part = kernel(q, caches[0], caches[1], batch, scale, start, lse, (caches[2], caches[3]))
        want, want_lse = _part_after(_as_kernel_reads(q, kv), widened, batch, scale, start)
        torch.testing.assert_close(part, want, rtol=2e-5, atol=5e-5)
        torch.testing.assert_close(lse, want_lse, rtol=2e-5, atol=2e-5)


def _as_kernel_reads(q: torch.Tensor, kv: str) -> torch.Tensor:
    """q in float32 as the kernel multiplies it: against int8 keys, each head's row in int16
    steps of amax / 32767 (integer dot products)."""
    q = q.float()
    if kv != "int8":
        return q
    amax = q.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 32767 / amax, 0.0)
    return torch.round(q * inv) * (amax / 32767)


def _part_after(
    q: torch.Tensor,
    caches: tuple[torch.Tensor, torch.Tensor],
    batch: DecodeBatch,
    scale: float,
    start: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query token per sequence over positions [start, seq_len): outputs, log-sum-exps."""
    outs, lses = [], []
    for b, n in enumerate(batch.seq_lens.tolist()):
        blocks = batch.block_tables[b, : -(-n // BLOCK_SIZE)].long()
        k, v = (c[blocks].flatten(0, 1)[start:n] for c in caches)  # [S, KVH, D]
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [S, H, D]
        scores = torch.einsum("hd,shd->hs", q[b], k) * scale
        outs.append(torch.einsum("hs,shd->hd", scores.softmax(-1), v))
        lses.append(scores.logsumexp(-1))
    return torch.stack(outs), torch.stack(lses)


def test_scales_are_required_for_8bit_caches_and_refused_for_float_ones(
    kernel: decode_kernel.DecodeKernel,
) -> None:
    gen = torch.Generator().manual_seed(0)
    batch = _batch(gen, [20], None)
    caches = _caches(2, 1, 64, torch.int8)
    q = torch.randn(1, 2, 64)
    with pytest.raises(ValueError, match="decode kernel"):
        kernel(q, caches[0], caches[1], batch, 0.125)
    floats = torch.zeros(2, BLOCK_SIZE, 1, 64)
    with pytest.raises(ValueError, match="decode kernel"):
        kernel(q, floats, floats, batch, 0.125, scales=(caches[2], caches[3]))
