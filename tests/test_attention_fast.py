"""The fast paged attention (C decode kernel, its torch fallback, SDPA prefill chunks) against
``paged_attention_reference`` on the random batches of test_attention.py, and the step layout
that ``prepare_step`` builds from a plan."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_attention import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, SCALE, Case, _make_case

from pagekv import native
from pagekv.models.loader import LoadedModel
from pagekv.runner import cpu_kernel
from pagekv.runner.attention import paged_attention_reference
from pagekv.runner.cpu_kernel import DecodeBatch
from pagekv.runner.fast_attention import (
    FastAttention,
    PrefillChunk,
    StepLayout,
    decode_attention_torch,
)

KERNEL = cpu_kernel.load()
BACKENDS = [
    "torch",
    pytest.param(
        "kernel",
        marks=pytest.mark.skipif(
            native.find_compiler() is None, reason="no C++ compiler: the kernel is optional"
        ),
    ),
]


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
        chunk = PrefillChunk(start, num, seq_len)
        if num < seq_len:
            positions = torch.arange(seq_len - num, seq_len)
            mask = torch.arange(seq_len)[None, :] <= positions[:, None]
            blocks = meta.block_tables[b, : -(-seq_len // bs)]
            chunk = PrefillChunk(start, num, seq_len, block_ids=blocks, mask=mask)
        chunks.append(chunk)
        start += num
    new_k = torch.cat([case.seq_k[b][seq_lens[b] - q_lens[b] :] for b in order])
    new_v = torch.cat([case.seq_v[b][seq_lens[b] - q_lens[b] :] for b in order])
    return order, StepLayout(len(decode), batch, tuple(chunks)), new_k, new_v


def _run_fast(case: Case, backend: str) -> torch.Tensor:
    """The fast path's output, put back into the case's own token order."""
    order, layout, new_k, new_v = _fast_inputs(case)
    loc = case.meta.query_start_loc.tolist()
    rows = torch.cat([torch.arange(loc[b], loc[b + 1]) for b in order])  # fast -> case order
    kernel = KERNEL if backend == "kernel" else None
    attention = FastAttention(layout, SCALE, kernel)
    out_fast = attention(case.q[rows], new_k, new_v, (case.k_cache, case.v_cache))
    out = torch.empty_like(out_fast)
    out[rows] = out_fast
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_fast_matches_reference_float32(backend: str, block_size: int) -> None:
    for seed in range(40):
        case = _make_case(seed * 7 + block_size, block_size, torch.float32)
        expected = paged_attention_reference(case.q, case.k_cache, case.v_cache, case.meta, SCALE)
        out = _run_fast(case, backend)
        assert out.dtype == torch.float32 and not out.isnan().any()
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [1, 16])
def test_fast_matches_reference_bfloat16(backend: str, block_size: int) -> None:
    for seed in range(15):
        case = _make_case(1000 + seed, block_size, torch.bfloat16)
        expected = paged_attention_reference(case.q, case.k_cache, case.v_cache, case.meta, SCALE)
        out = _run_fast(case, backend)
        assert out.dtype == torch.bfloat16
        # Same bf16 inputs; the kernel is float32 inside, SDPA accumulates in float32: only
        # the rounding of intermediate products and of the output to bf16 differs.
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(NUM_HEADS, NUM_KV_HEADS), (8, 1), (4, 4), (10, 2)])
def test_kernel_matches_torch_decode(
    dtype: torch.dtype, head_dim: int, heads: tuple[int, int]
) -> None:
    """Long, ragged decode histories through shuffled blocks; NaN in every unwritten slot.
    Group sizes 3, 8, 1, 5: the kernel specializes some and loops over heads for the rest."""
    num_heads, num_kv_heads = heads
    if native.find_compiler() is None:
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


def test_kernel_disabled_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu_kernel.load.cache_clear()
    monkeypatch.setenv(cpu_kernel.DISABLE_ENV, "0")
    try:
        assert cpu_kernel.load() is None
    finally:
        cpu_kernel.load.cache_clear()


def test_kernel_build_failure_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A compiler that fails leaves the engine on torch ops, with a warning, not an error."""
    cpu_kernel.load.cache_clear()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # /bin/false: found, always fails
    try:
        assert cpu_kernel.load() is None
    finally:
        cpu_kernel.load.cache_clear()


def test_head_dim_without_kernel_entry_uses_torch() -> None:
    assert HEAD_DIM == 64
    if KERNEL is not None:
        assert KERNEL.supports(torch.float32, 64) and not KERNEL.supports(torch.float32, 80)


@pytest.mark.model
def test_engine_fast_path_equals_reference_path(loaded: LoadedModel) -> None:
    """Whole engine, fp32: chunked prefill (budget 48 tokens), prefix-cache hits and decode rows
    mixed in one step give the same greedy tokens and logprobs on both attention backends."""
    from pagekv import SamplingParams
    from pagekv.config import EngineConfig
    from pagekv.engine import LLMEngine
    from pagekv.llm import LLM
    from pagekv.runner.model_runner import AttentionBackend

    shared = list(range(300, 340))
    prompts = [shared + [400 + i] * (3 + 7 * i) for i in range(5)] + [[11, 12], [13]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    results = {}
    for backend in AttentionBackend:
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
