"""The Triton paged-attention kernels against the reference paged attention.

Without a CUDA GPU the kernels run in Triton's interpreter on CPU tensors (``TRITON_INTERPRET``
must be set before the kernels' module is imported, hence the order below). The cases are
test_attention's: random batches of prefills, decodes and prefix-cached chunks, physical
blocks in random order, leading blocks shared between sequences, NaN in every slot never
written (a kernel reading outside the table's live slots returns NaN), GQA 9 heads over 3.
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton", reason="the triton package is not installed")

from pagekv import SamplingParams  # noqa: E402
from pagekv.engine import LLMEngine  # noqa: E402
from pagekv.engine.config import EngineConfig  # noqa: E402
from pagekv.kernels import triton_attention  # noqa: E402
from pagekv.llm import LLM  # noqa: E402
from pagekv.models.loader import LoadedModel  # noqa: E402
from pagekv.runner.attention import (  # noqa: E402
    paged_attention_reference,
    quantize_rows,
    write_kv,
)
from pagekv.runner.model_runner import AttentionBackend  # noqa: E402
from tests.engine.test_engine_golden import _LONG, _greedy_reference, assert_matches_reference  # noqa: E402
from tests.runner.test_attention import (  # noqa: E402
    HEAD_DIM,
    NUM_HEADS,
    NUM_KV_HEADS,
    SCALE,
    Case,
    _contiguous_reference,
    _free_blocks_outside_window,
    _make_case,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _triton(case: Case, **kwargs: object) -> torch.Tensor:
    meta = case.meta

    def on(t: torch.Tensor) -> torch.Tensor:
        return t.to(DEVICE)

    out = triton_attention.paged_attention(
        on(case.q),
        on(case.k_cache),
        on(case.v_cache),
        on(meta.block_tables.to(torch.int32)),
        on(meta.seq_lens.to(torch.int32)),
        on(meta.query_start_loc.to(torch.int32)),
        meta.max_query_len,
        SCALE,
        **kwargs,  # type: ignore[arg-type]
    )
    return out.cpu()


@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
def test_matches_the_reference_float32(block_size: int) -> None:
    shared = 0
    for seed in range(12):
        case = _make_case(seed * 7 + block_size, block_size, torch.float32)
        shared += case.num_shared_blocks
        expected = paged_attention_reference(case.q, case.k_cache, case.v_cache, case.meta, SCALE)
        out = _triton(case)
        assert not out.isnan().any()
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    assert block_size == 1 or shared > 0  # some sequences did read another's blocks


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [1, 16])
def test_matches_contiguous_attention_half_precision(block_size: int, dtype: torch.dtype) -> None:
    for seed in range(8):
        case = _make_case(300 + seed, block_size, dtype)
        out = _triton(case)
        assert out.dtype == dtype
        # the same half-precision inputs, float32 inside: the probabilities' rounding to the
        # cache's dtype before P @ V and the final rounding differ
        torch.testing.assert_close(out.float(), _contiguous_reference(case), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("fp8", [False, True], ids=["int8", "fp8"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_8_bit_blocks_match_the_reference_over_the_same_blocks(block_size: int, fp8: bool) -> None:
    """int8 rows (or e4m3 bits in uint8) with a float16 scale per row, widened and scaled as
    they load: the reference over the same blocks, to float32 rounding."""
    for seed in range(6):
        case = _make_case(500 + seed, block_size, torch.float32)
        (k8, k_scale), (v8, v_scale) = (
            quantize_rows(case.k_cache, fp8),
            quantize_rows(case.v_cache, fp8),
        )
        scales = (k_scale, v_scale)
        expected = paged_attention_reference(case.q, k8, v8, case.meta, SCALE, scales=scales)
        eight_bit = dataclasses.replace(case, k_cache=k8, v_cache=v8)
        out = _triton(eight_bit, scales=tuple(t.to(DEVICE) for t in scales))
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_long_prefill_spans_several_query_tiles() -> None:
    """Prefill chunks longer than one tile of query rows, one continuing a cached prefix."""
    case = _make_case(7, 16, torch.float32, lens=[(70, 70), (90, 37), (33, 1)])
    expected = paged_attention_reference(case.q, case.k_cache, case.v_cache, case.meta, SCALE)
    torch.testing.assert_close(_triton(case), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    "launch", [triton_attention.SHORT_DECODE, triton_attention.LONG_DECODE], ids=str
)
def test_decode_launches_match_the_reference(launch: triton_attention.Launch) -> None:
    """The runner's decode launches: tiles of keys spanning several blocks, the last one
    partial, histories shorter than one tile."""
    case = _make_case(11, 16, torch.float32, lens=[(300, 1), (130, 1), (17, 1), (1, 1)])
    expected = paged_attention_reference(case.q, case.k_cache, case.v_cache, case.meta, SCALE)
    torch.testing.assert_close(_triton(case, launch=launch), expected, atol=2e-5, rtol=2e-5)


def test_launch_for_each_step() -> None:
    for_step = triton_attention.Launch.for_step
    assert for_step(48, 4096) == triton_attention.DEFAULT_LAUNCH  # prefill chunks in the step
    assert for_step(1, 1024) == triton_attention.SHORT_DECODE
    assert for_step(1, 1025) == triton_attention.LONG_DECODE
    with pytest.raises(ValueError, match="block_n"):
        triton_attention.Launch(block_n=48)


@pytest.mark.parametrize("window", [1, 5, 9])
def test_sliding_window_never_reads_the_blocks_it_may_free(window: int) -> None:
    freed = 0
    for seed in range(10):
        case = _make_case(seed * 11 + window, 4, torch.float32)
        expected = _contiguous_reference(case, window=window)
        freed += _free_blocks_outside_window(case, window)
        torch.testing.assert_close(_triton(case, window=window), expected, atol=2e-5, rtol=2e-5)
    assert freed > 0


@pytest.mark.parametrize("softcap", [0.5, 30.0])
def test_soft_capped_scores(softcap: float) -> None:
    for seed in range(6):
        case = _make_case(900 + seed, 16, torch.float32)
        out = _triton(case, softcap=softcap)
        torch.testing.assert_close(out, _contiguous_reference(case, softcap=softcap))


def test_copy_on_write_then_diverge() -> None:
    """Two sequences share a partial last block; copy-on-write gives the second its own copy,
    each then writes a different token at the same position: each reads its own."""
    block_size, prompt = 8, 13
    num_blocks = 6
    gen = torch.Generator().manual_seed(3)
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.full(shape, float("nan"), device=DEVICE)
    v_cache = torch.full(shape, float("nan"), device=DEVICE)
    k = torch.randn(prompt + 1, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(DEVICE)
    v = torch.randn(prompt + 1, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(DEVICE)
    first = [4, 1]  # the prompt's two blocks
    slots = [first[p // block_size] * block_size + p % block_size for p in range(prompt)]
    triton_attention.write_kv(
        k_cache, v_cache, k[:prompt], v[:prompt], torch.tensor(slots, device=DEVICE)
    )
    # fork: the second shares block 4 and copies block 1 (copy-on-write) into block 2
    k_cache[2], v_cache[2] = k_cache[1], v_cache[1]
    second = [4, 2]
    k_new = torch.randn(2, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(DEVICE)
    v_new = torch.randn(2, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(DEVICE)
    offset = prompt % block_size
    new_slots = torch.tensor([1 * block_size + offset, 2 * block_size + offset], device=DEVICE)
    triton_attention.write_kv(k_cache, v_cache, k_new, v_new, new_slots)
    q = torch.randn(2, NUM_HEADS, HEAD_DIM, generator=gen).to(DEVICE)
    tables = torch.tensor([first, second], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([prompt + 1] * 2, dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    out = triton_attention.paged_attention(q, k_cache, v_cache, tables, seq_lens, starts, 1, SCALE)
    for b in range(2):
        keys = torch.cat([k[:prompt], k_new[b : b + 1]]).repeat_interleave(3, 1)  # [S, H, D]
        values = torch.cat([v[:prompt], v_new[b : b + 1]]).repeat_interleave(3, 1)
        probs = (torch.einsum("hd,shd->hs", q[b], keys) * SCALE).softmax(-1)
        torch.testing.assert_close(out[b], torch.einsum("hs,shd->hd", probs, values))
    assert not torch.allclose(out[0], out[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_the_reference_and_skips_negative_slots(dtype: torch.dtype) -> None:
    rng = random.Random(5)
    shape = (7, 4, NUM_KV_HEADS, HEAD_DIM)
    slots = [*rng.sample(range(28), 10), -1, -1]
    k = torch.randn(len(slots), NUM_KV_HEADS, HEAD_DIM, device=DEVICE)
    v = torch.randn(len(slots), NUM_KV_HEADS, HEAD_DIM, device=DEVICE)
    # each cache behind a guard block: a write to slot -1 would land in the guard
    buffers = [
        torch.zeros((shape[0] + 1, *shape[1:]), dtype=dtype, device=DEVICE) for _ in range(4)
    ]
    caches = [b[1:] for b in buffers]
    index = torch.tensor(slots, device=DEVICE)
    triton_attention.write_kv(caches[0], caches[1], k, v, index)
    keep = index >= 0
    write_kv(caches[2], caches[3], k[keep], v[keep], index[keep])
    assert torch.equal(buffers[0], buffers[2]) and torch.equal(buffers[1], buffers[3])
    assert int((caches[0] != 0).any(-1).any(-1).sum()) == 10  # ten slots written, no more


def test_rejects_heads_that_do_not_fit() -> None:
    case = _make_case(1, 4, torch.float32)
    with pytest.raises(ValueError, match="does not fit"):  # checked before any launch
        triton_attention.paged_attention(
            case.q[:, :8],
            case.k_cache,
            case.v_cache,
            case.meta.block_tables,
            case.meta.seq_lens,
            case.meta.query_start_loc,
            case.meta.max_query_len,
            SCALE,
        )


@pytest.mark.model
@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU: test_cuda_engine.py")
def test_engine_greedy_equals_transformers(loaded: LoadedModel, hf_model: object) -> None:
    """The whole engine with the Triton attention (fp32; in the interpreter without a GPU):
    chunked prefill (48 tokens a step) continuing through the cache, prefix-cache hits and
    decode rows in one batch give transformers' greedy tokens."""
    shared = loaded.tokenizer.encode(_LONG)[:40]
    prompts = [shared + loaded.tokenizer.encode(t) for t in (" when", " of Gutenberg, who")]
    prompts.append(loaded.tokenizer.encode("The capital of France is"))
    config = EngineConfig(
        block_size=16, num_kv_blocks=64, max_num_batched_tokens=48, check_invariants=True
    )
    engine = LLMEngine(config, loaded)
    engine.runner.attention = AttentionBackend.TRITON
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    outs = LLM.from_engine(engine).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )
    assert any(o.num_cached_tokens > 0 for o in outs)  # a prefix hit happened
    for out, ids in zip(outs, prompts, strict=True):
        ref = _greedy_reference(hf_model, ids, steps=8)  # type: ignore[arg-type]
        completion = out.outputs[0]
        assert completion.logprobs is not None
        logprobs = [completion.logprobs[j][t].logprob for j, t in enumerate(completion.token_ids)]
        assert_matches_reference(completion.token_ids, ref, logprobs)


@pytest.mark.model
@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU: test_cuda_engine.py")
def test_engine_over_8_bit_blocks_matches_the_reference_attention(loaded: LoadedModel) -> None:
    """int8 blocks: the engine with the Triton attention (in the interpreter) gives the tokens
    of the same engine with the reference attention (torch over 8-bit blocks), logprobs close.
    Not equal: the two sum in different orders, and a last-bit difference in a layer's output
    moves a later layer's K/V across an int8 rounding boundary now and then (one step), which
    moves a logprob by up to about a tenth (0.063 on an Intel Xeon with AMX, whose matmuls
    round otherwise than a Zen 4's): held to 0.15 each and 0.02 on average."""
    prompts = [loaded.tokenizer.encode(t) for t in (_LONG[:200], "The capital of France is")]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    results = []
    for backend in (AttentionBackend.TRITON, AttentionBackend.REFERENCE):
        config = EngineConfig(kv_cache_dtype="int8", block_size=16, num_kv_blocks=64)
        engine = LLMEngine(config, loaded)
        engine.runner.attention = backend
        outs = LLM.from_engine(engine).generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
        )
        results.append([o.outputs[0] for o in outs])
    deviations = []
    for triton_out, cpu_out in zip(*results, strict=True):
        assert triton_out.token_ids == cpu_out.token_ids
        for j, token in enumerate(cpu_out.token_ids):
            want = cpu_out.logprobs[j][token].logprob
            deviations.append(abs(triton_out.logprobs[j][token].logprob - want))
    # a flip moves one logprob by up to about a tenth; most tokens see none
    assert max(deviations) < 0.15 and sum(deviations) / len(deviations) < 0.02, deviations
