"""KVCache: block copies and transfers touch exactly the named blocks; exact fingerprints."""

from __future__ import annotations

import pytest
import torch

from pagekv.errors import UnknownBlockError
from pagekv.runner.kv_cache import KVCache

NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 3, 4, 2, 8


def _filled(num_blocks: int, seed: int, dtype: torch.dtype = torch.float32) -> KVCache:
    cache = KVCache(NUM_LAYERS, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype)
    gen = torch.Generator().manual_seed(seed)
    for pool in cache.k + cache.v:
        pool.copy_(torch.randn(pool.shape, generator=gen))
    return cache


def _snapshot(cache: KVCache) -> list[torch.Tensor]:
    return [t.clone() for t in cache.k + cache.v]


def test_shapes_and_bytes_per_block() -> None:
    cache = KVCache(NUM_LAYERS, 7, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16)
    assert len(cache.k) == len(cache.v) == NUM_LAYERS
    assert all(t.shape == (7, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM) for t in cache.k + cache.v)
    assert all(t.dtype == torch.bfloat16 for t in cache.k + cache.v)
    assert KVCache.bytes_per_block(
        NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16
    ) == (2 * 3 * 4 * 2 * 8 * 2)
    # SmolLM2-135M: 30 layers, 3 kv heads, head_dim 64, block 16, fp32 -> 2*30*16*3*64*4 bytes
    assert KVCache.bytes_per_block(30, 16, 3, 64, torch.float32) == 737_280
    total = sum(t.numel() * t.element_size() for t in cache.k + cache.v)
    assert total == 7 * KVCache.bytes_per_block(
        NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16
    )


def test_rejects_bad_dimensions() -> None:
    with pytest.raises(ValueError):
        KVCache(NUM_LAYERS, 0, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float32)


def test_copy_blocks_moves_exactly_the_named_blocks() -> None:
    cache = _filled(10, seed=0)
    before = _snapshot(cache)
    pairs = [(1, 7), (3, 2), (1, 9)]
    cache.copy_blocks(pairs)
    for old, new in zip(before, cache.k + cache.v, strict=True):
        expected = old.clone()
        for src, dst in pairs:
            expected[dst] = old[src]
        assert torch.equal(new, expected)


def test_copy_blocks_is_simultaneous_when_pairs_chain() -> None:
    cache = _filled(4, seed=1)
    before = _snapshot(cache)
    cache.copy_blocks([(0, 1), (1, 2)])  # block 2 gets block 1's OLD content
    for old, new in zip(before, cache.k + cache.v, strict=True):
        assert torch.equal(new[1], old[0]) and torch.equal(new[2], old[1])
        assert torch.equal(new[0], old[0]) and torch.equal(new[3], old[3])


def test_copy_blocks_rejects_bad_ids_and_duplicate_destinations() -> None:
    cache = _filled(4, seed=2)
    before = _snapshot(cache)
    with pytest.raises(UnknownBlockError):
        cache.copy_blocks([(0, 4)])
    with pytest.raises(ValueError):
        cache.copy_blocks([(0, 1), (2, 1)])
    assert all(torch.equal(a, b) for a, b in zip(before, cache.k + cache.v, strict=True))
    cache.copy_blocks([])  # no-op


def test_transfer_between_pools_of_different_sizes() -> None:
    device_pool = _filled(6, seed=3)
    host_pool = _filled(3, seed=4)
    device_before, host_before = _snapshot(device_pool), _snapshot(host_pool)
    device_pool.transfer(host_pool, [(5, 0), (2, 2)])  # swap out
    for d_old, h_old, h_new in zip(
        device_before, host_before, host_pool.k + host_pool.v, strict=True
    ):
        assert torch.equal(h_new[0], d_old[5]) and torch.equal(h_new[2], d_old[2])
        assert torch.equal(h_new[1], h_old[1])
    assert all(
        torch.equal(a, b) for a, b in zip(device_before, device_pool.k + device_pool.v, strict=True)
    )

    host_pool.transfer(device_pool, [(0, 1)])  # swap in
    for d_old, d_new in zip(device_before, device_pool.k + device_pool.v, strict=True):
        assert torch.equal(d_new[1], d_old[5])
        others = [i for i in range(6) if i != 1]
        assert torch.equal(d_new[others], d_old[others])


@pytest.mark.parametrize(
    "other",
    [
        (NUM_LAYERS + 1, 4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float32),
        (NUM_LAYERS, 4, BLOCK_SIZE * 2, NUM_KV_HEADS, HEAD_DIM, torch.float32),
        (NUM_LAYERS, 4, BLOCK_SIZE, NUM_KV_HEADS + 1, HEAD_DIM, torch.float32),
        (NUM_LAYERS, 4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM * 2, torch.float32),
        (NUM_LAYERS, 4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16),
    ],
)
def test_transfer_rejects_layout_mismatch(
    other: tuple[int, int, int, int, int, torch.dtype],
) -> None:
    cache = _filled(4, seed=5)
    with pytest.raises(ValueError, match="layouts differ"):
        cache.transfer(KVCache(*other), [(0, 0)])


def test_transfer_rejects_ids_outside_either_pool() -> None:
    big, small = _filled(8, seed=6), _filled(2, seed=7)
    with pytest.raises(UnknownBlockError):
        big.transfer(small, [(7, 2)])
    with pytest.raises(UnknownBlockError):
        small.transfer(big, [(2, 0)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fingerprint_changes_iff_content_changes(dtype: torch.dtype) -> None:
    cache = _filled(5, seed=8, dtype=dtype)
    ids = [0, 1, 2, 3, 4]
    before = cache.block_fingerprint(ids)
    assert len(set(before)) == 5  # distinct random contents, distinct digests
    assert cache.block_fingerprint(ids) == before  # stable
    assert cache.block_fingerprint([3, 1]) == [before[3], before[1]]

    cache.v[NUM_LAYERS - 1][2, BLOCK_SIZE - 1, 1, HEAD_DIM - 1] += 1  # one element, last layer V
    after = cache.block_fingerprint(ids)
    assert after[2] != before[2]
    assert [a for i, a in enumerate(after) if i != 2] == [b for i, b in enumerate(before) if i != 2]

    cache.copy_blocks([(0, 4)])  # identical content -> identical digest
    assert cache.block_fingerprint([0, 4]) == [before[0], before[0]]
    assert cache.block_fingerprint([]) == []


def test_fingerprint_sees_every_layer_and_k_vs_v() -> None:
    cache = _filled(2, seed=9)
    base = cache.block_fingerprint([0])[0]
    for pool in cache.k + cache.v:
        saved = pool[0].clone()
        pool[0, 0, 0, 0] += 0.5
        assert cache.block_fingerprint([0])[0] != base
        pool[0].copy_(saved)
        assert cache.block_fingerprint([0])[0] == base
