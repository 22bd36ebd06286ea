"""8-bit KV blocks (runner/kv_cache.py, ``kv_dtype="int8"`` or ``"fp8"``): the capacity they
buy, the rounding they cost, and that every move of a block (copy-on-write, swap, a store
record) carries its scales."""

from __future__ import annotations

import pytest
import torch

from pagekv.runner.attention import AttentionMetadata, paged_attention_reference, quantize_rows
from pagekv.runner.kv_cache import KVCache

LAYERS, BS, KVH = 2, 4, 2


def pool(num_blocks: int, head_dim: int = 8, kv_dtype: str = "int8") -> KVCache:
    return KVCache(LAYERS, num_blocks, BS, KVH, head_dim, torch.float32, kv_dtype=kv_dtype)


def fill(kv: KVCache, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    slots = torch.arange(kv.num_blocks * BS)
    for layer in range(LAYERS):
        k, v = (torch.randn(len(slots), KVH, kv.head_dim, generator=gen) for _ in range(2))
        kv.write(layer, k * 3, v, slots)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_int8_blocks_hold_nearly_twice_bf16s_tokens_and_four_times_float32s(head_dim) -> None:
    size = {d: KVCache.bytes_per_block(16, 16, 8, head_dim, torch.float32, d) for d in
            ("float32", "bfloat16", "int8", "fp8")}  # fmt: skip
    assert size["bfloat16"] / size["int8"] >= 1.9
    assert size["float32"] / size["int8"] >= 3.8
    assert size["fp8"] == size["int8"]
    kv = KVCache(16, 3, 16, 8, head_dim, torch.float32, kv_dtype="int8")
    assert kv.block_nbytes == size["int8"]


def test_rows_round_to_int8_within_half_a_step() -> None:
    x = torch.randn(50, KVH, 64) * torch.logspace(-3, 3, 50)[:, None, None]
    x[3] = 0.0  # an all-zero row: scale 0, exact
    q, scale = quantize_rows(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float16 and int(q.abs().max()) <= 127
    error = (q.float() * scale.float()[..., None] - x).abs()
    assert bool((error <= scale.float()[..., None] / 2 * 1.0001 + 1e-12).all())
    assert float(error[3].max()) == 0.0


def test_rows_round_to_fp8_within_e4m3s_relative_step() -> None:
    x = torch.randn(50, KVH, 64) * torch.logspace(-3, 3, 50)[:, None, None]
    q, scale = quantize_rows(x, fp8=True)
    assert q.dtype == torch.uint8 and scale.dtype == torch.float16
    value = q.view(torch.float8_e4m3fn).float() * scale.float()[..., None]
    # e4m3: 3 mantissa bits (half a step: 1/16 relative), subnormals below 2^-6 of the scale
    bound = x.abs() / 16 + scale.float()[..., None] * 2.0**-10
    assert bool(((value - x).abs() <= bound * 1.001).all())


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_copy_swap_and_store_records_carry_the_scales(kv_dtype: str) -> None:
    device, host = pool(4, kv_dtype=kv_dtype), pool(6, kv_dtype=kv_dtype)
    fill(device)
    device.copy_blocks([(0, 3)])  # copy-on-write
    for plane in device.planes:
        assert torch.equal(plane[3], plane[0])
    device.transfer(host, [(1, 5), (2, 0)])  # swap out
    assert device.block_fingerprint([1, 2]) == host.block_fingerprint([5, 0])
    payload = device.read_blocks([2])[0]  # a store record
    assert len(payload) == device.block_nbytes
    fresh = pool(2, kv_dtype=kv_dtype)
    fresh.write_block(1, payload)
    assert fresh.block_fingerprint([1]) == device.block_fingerprint([2])
    fresh.k_scale[1][1, 0, 0] += 1  # the scales are part of the block's content
    assert fresh.block_fingerprint([1]) != device.block_fingerprint([2])


def test_pools_of_different_kv_dtypes_do_not_exchange_blocks() -> None:
    with pytest.raises(ValueError, match="layouts differ"):
        pool(2).transfer(pool(2, kv_dtype="auto"), [(0, 0)])
    with pytest.raises(ValueError, match="layouts differ"):
        pool(2).transfer(pool(2, kv_dtype="fp8"), [(0, 0)])


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_reference_attention_over_8_bit_blocks_is_close_to_float_blocks(kv_dtype: str) -> None:
    """The same history in float32 and 8-bit blocks: outputs differ by the rounding only."""
    exact, rounded = pool(4, 64, "auto"), pool(4, 64, kv_dtype)
    fill(exact, seed=1)
    fill(rounded, seed=1)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([13]),
        block_tables=torch.tensor([[0, 1, 2, 3]]),
        seq_lens=torch.tensor([14]),
        query_start_loc=torch.tensor([0, 1]),
        max_query_len=1,
        max_seq_len=14,
        block_size=BS,
    )
    q = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(2))
    want = paged_attention_reference(q, *exact.caches(0), meta, 0.125)
    k, v, k_scale, v_scale = rounded.caches(0)
    got = paged_attention_reference(q, k, v, meta, 0.125, scales=(k_scale, v_scale))
    # int8: 1/254 of a row's largest value; e4m3: 1/16 of each value (3 mantissa bits); the
    # scores (keys three times the values) amplify either through the softmax
    error = float((got - want).abs().max())
    assert error < {"int8": 0.04, "fp8": 0.2}[kv_dtype]
    assert float((got - want).abs().max()) > 0  # it did read the rounded blocks
