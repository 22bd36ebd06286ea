"""Cascade attention (``PrefillKernel.shared_prefix``) on every kernel target: decode rows whose
sequences begin with the same blocks get the prefix attended once for all of them, merged into
each row's attention over its own rest by log-sum-exp. Against float32 attention in torch over
whole sequences, for float32 and bf16, every head size of the kernels, GQA groups 1, 4 and 6,
block sizes 1 and 16, prefixes that do and do not fill their last 16-key block; and routed by
``FastAttention`` for decode steps that share a prefix. bf16 tiles where the target has them
(head size 64), float32 vectors everywhere else."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from pagekv.kernels import build
from pagekv.kernels import decode as decode_kernel
from pagekv.kernels import prefill as prefill_kernel
from pagekv.kernels.decode import DecodeBatch
from pagekv.kernels.prefill import PrefillKernel
from pagekv.runner.fast_attention import (
    CASCADE_MIN_ROWS,
    FastAttention,
    StepLayout,
    decode_attention_torch,
)

NUM_KV_HEADS = 2
PREFIX_LENS = [5, 37, 48, 133]  # 48: whole 16-key blocks; the others end inside one


@pytest.fixture
def kernel(kernel_target: str) -> PrefillKernel:
    """The prefill kernel of ``kernel_target``: where a compiler is, it must build."""
    if build.find_compiler() is None:
        pytest.skip("no C++ compiler: the kernel is optional")
    loaded = prefill_kernel.load()
    assert loaded is not None
    return loaded


def _tolerance(kernel: PrefillKernel, dtype: torch.dtype, head_dim: int) -> float:
    """Float32 vectors keep every product in float32: within float32 rounding of torch on the
    same numbers, bf16 inputs too. The tiles round the probabilities to bf16, as SDPA does."""
    return 2e-2 if kernel.supports(dtype, head_dim) else 1e-5


@dataclass
class SharedPrefix:
    """Decode rows over a prefix in the cache (through ``table``) and a rest of their own (not
    in the cache: the rest's part comes from torch, so the test sees the prefix part alone)."""

    q: torch.Tensor  # [B, H, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor
    table: torch.Tensor  # int32 [ceil(prefix_len / block_size)]
    prefix_len: int
    rest_k: torch.Tensor  # float32 [B, R, H, D], already repeated for each query head
    rest_v: torch.Tensor

    def rest(self, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's attention over its rest (float32 [B, H, D]) and its log-sum-exp [B, H]."""
        scores = torch.einsum("bhd,brhd->bhr", self.q.float(), self.rest_k) * scale
        out = torch.einsum("bhr,brhd->bhd", torch.softmax(scores, -1), self.rest_v)
        return out.contiguous(), torch.logsumexp(scores, -1)

    def whole(self, scale: float) -> torch.Tensor:
        """Each row's float32 attention over prefix and rest together [B, H, D]."""
        group = self.q.shape[1] // self.k_cache.shape[2]
        keys, values = (
            c[self.table.long()]
            .flatten(0, 1)[: self.prefix_len]
            .float()
            .repeat_interleave(group, 1)
            for c in (self.k_cache, self.v_cache)
        )  # [P, H, D]
        num_seqs = self.q.shape[0]
        keys = torch.cat([keys.expand(num_seqs, -1, -1, -1), self.rest_k], 1)  # [B, P + R, H, D]
        values = torch.cat([values.expand(num_seqs, -1, -1, -1), self.rest_v], 1)
        scores = torch.einsum("bhd,bshd->bhs", self.q.float(), keys) * scale
        return torch.einsum("bhs,bshd->bhd", torch.softmax(scores, -1), values)


def _shared_prefix(
    seed: int, dtype: torch.dtype, head_dim: int, group: int, block_size: int, prefix_len: int
) -> SharedPrefix:
    """7 rows (partial blocks of 16 rows for every group), the prefix through shuffled blocks
    with NaN in every slot past it (the last block's tail, the blocks it does not use)."""
    gen = torch.Generator().manual_seed(seed)
    num_seqs, num_heads = 7, NUM_KV_HEADS * group
    num_blocks = -(-prefix_len // block_size)
    shape = (num_blocks + 3, block_size, NUM_KV_HEADS, head_dim)
    k_cache, v_cache = (torch.full(shape, float("nan"), dtype=dtype) for _ in range(2))
    table = torch.randperm(num_blocks + 3, generator=gen)[:num_blocks]
    positions = torch.arange(prefix_len)
    for cache in (k_cache, v_cache):
        rows = torch.randn(prefix_len, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
        cache[table[positions // block_size], positions % block_size] = rows
    q = torch.randn(num_seqs, num_heads, head_dim, generator=gen).to(dtype)
    rest_k, rest_v = (
        torch.randn(num_seqs, 9, NUM_KV_HEADS, head_dim, generator=gen)
        .to(dtype)
        .float()
        .repeat_interleave(group, 2)
        for _ in range(2)
    )
    return SharedPrefix(q, k_cache, v_cache, table.to(torch.int32), prefix_len, rest_k, rest_v)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("group", [1, 4, 6])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_equals_attention_over_whole_sequences(
    kernel: PrefillKernel, dtype: torch.dtype, head_dim: int, group: int, block_size: int
) -> None:
    """The prefix part merged into the rest's attention is attention over both, within
    float32 rounding in vectors (bf16 in tiles); ``lse`` is read and left as it was; a slot
    past the prefix (NaN) is never read."""
    assert kernel.supports_cascade(dtype, head_dim)
    scale = head_dim**-0.5
    tolerance = _tolerance(kernel, dtype, head_dim)
    for prefix_len in PREFIX_LENS:
        case = _shared_prefix(prefix_len, dtype, head_dim, group, block_size, prefix_len)
        out, lse = case.rest(scale)
        lse_before = lse.clone()
        assert kernel.shared_prefix(
            case.q, case.k_cache, case.v_cache, case.table, prefix_len, scale, out, lse
        )
        assert not out.isnan().any()
        torch.testing.assert_close(out, case.whole(scale), atol=tolerance, rtol=tolerance)
        assert torch.equal(lse, lse_before)


def test_cascade_declines_what_it_does_not_take(kernel: PrefillKernel) -> None:
    """Head sizes outside the kernels' list and float16 are not taken; query heads that are no
    multiple of the kv heads are declined by the C side, with ``out`` untouched; a table too
    short for the prefix is refused before the C side reads past it."""
    assert not kernel.supports_cascade(torch.float32, 80)
    assert not kernel.supports_cascade(torch.float16, 64)
    case = _shared_prefix(0, torch.float32, 128, 3, 16, 37)
    out, lse = case.rest(1.0)
    before = out.clone()
    q = case.q[:, :5].contiguous()  # 5 query heads over 2 kv heads
    o, s = out[:, :5].contiguous(), lse[:, :5].contiguous()
    assert not kernel.shared_prefix(q, case.k_cache, case.v_cache, case.table, 37, 1.0, o, s)
    assert torch.equal(o, before[:, :5])
    with pytest.raises(ValueError):
        kernel.shared_prefix(case.q, case.k_cache, case.v_cache, case.table, 49, 1.0, out, lse)
    with pytest.raises(ValueError):
        kernel.shared_prefix(
            case.q.half(), case.k_cache, case.v_cache, case.table, 37, 1.0, out, lse
        )


def _decode_step(
    dtype: torch.dtype, head_dim: int, num_seqs: int
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], DecodeBatch]:
    """A decode step of ``num_seqs`` rows, 12 query heads over 2, block size 16, whose tables
    begin with the same 3 blocks (then their own); NaN past each row's sequence."""
    gen = torch.Generator().manual_seed(num_seqs)
    block_size, shared = 16, 3
    seq_lens = [49 + (29 * i) % 90 for i in range(num_seqs)]
    own = [-(-n // block_size) - shared for n in seq_lens]
    order = torch.randperm(shared + sum(own) + 1, generator=gen).tolist()
    rest, tables = order[shared:], []
    for count in own:
        tables.append(order[:shared] + rest[:count])
        rest = rest[count:]
    shape = (len(order), block_size, NUM_KV_HEADS, head_dim)
    caches = tuple(torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    for table, n in zip(tables, seq_lens, strict=True):
        for cache in caches:
            cache[table[-1], (n - 1) % block_size + 1 :] = float("nan")
    width = max(len(t) for t in tables)
    batch = DecodeBatch(
        torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
        max(seq_lens),
        shared,
    )
    q = torch.randn(num_seqs, 12, head_dim, generator=gen).to(dtype)
    return q, (caches[0], caches[1]), batch


@pytest.mark.parametrize("num_seqs", [CASCADE_MIN_ROWS - 1, CASCADE_MIN_ROWS, 11])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_steps_sharing_a_prefix_go_through_the_cascade(
    kernel: PrefillKernel,
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    head_dim: int,
    num_seqs: int,
) -> None:
    """``FastAttention`` takes the cascade for CASCADE_MIN_ROWS decode rows or more sharing a
    prefix, at every head size and in float32 as in bf16, and agrees with float32 attention
    over whole sequences; below that, the decode kernel alone."""
    decode = decode_kernel.load()
    assert decode is not None
    q, caches, batch = _decode_step(dtype, head_dim, num_seqs)
    cascades: list[bool] = []  # what each call of shared_prefix returned
    original = PrefillKernel.shared_prefix

    def counted(self: PrefillKernel, *args: Any) -> bool:
        cascades.append(original(self, *args))
        return cascades[-1]

    monkeypatch.setattr(PrefillKernel, "shared_prefix", counted)
    scale = head_dim**-0.5
    out = FastAttention(StepLayout(num_seqs, batch, ()), scale, decode, kernel)(
        q, q[:, :NUM_KV_HEADS], q[:, :NUM_KV_HEADS], caches
    )
    assert cascades == ([True] if num_seqs >= CASCADE_MIN_ROWS else [])
    expected = decode_attention_torch(q, *caches, batch, scale)  # float32 inside
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output's rounding
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)
