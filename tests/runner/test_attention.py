"""paged_attention_reference against per-sequence contiguous SDPA, and write_kv slot placement."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from pagekv.runner.attention import AttentionMetadata, paged_attention_reference, write_kv

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64
SCALE = HEAD_DIM**-0.5


@dataclass
class Case:
    """A random batch: contiguous per-sequence K/V and queries, plus the paged cache built
    from them."""

    meta: AttentionMetadata
    q: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor
    seq_k: list[torch.Tensor]  # per sequence [seq_len, KVH, D]
    seq_v: list[torch.Tensor]
    seq_q: list[torch.Tensor]  # per sequence [q_len, H, D]
    num_shared_blocks: int  # block-table entries that point at another sequence's block


def _lengths(rng: random.Random, block_size: int) -> tuple[int, int]:
    """(seq_len, q_len) of one sequence: prefill, decode, or prefill continuing a cached prefix."""
    kind = rng.choice(["prefill", "decode", "prefix"])
    seq_len = rng.randint(1, 3 * block_size + 5) if block_size > 1 else rng.randint(1, 40)
    if kind == "prefill":
        return seq_len, seq_len
    if kind == "decode":
        return seq_len, 1
    return seq_len, rng.randint(1, seq_len)


def _make_case(
    seed: int, block_size: int, dtype: torch.dtype, lens: list[tuple[int, int]] | None = None
) -> Case:
    """``lens``: (seq_len, q_len) per sequence; random when None."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    if lens is None:
        lens = [_lengths(rng, block_size) for _ in range(rng.randint(1, 6))]
    blocks_needed = [-(-s // block_size) for s, _ in lens]
    num_blocks = sum(blocks_needed) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)  # physical blocks in random order

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    tables: list[list[int]] = []
    num_shared_blocks = 0
    seq_k: list[torch.Tensor] = []
    seq_v: list[torch.Tensor] = []
    for b, (seq_len, _) in enumerate(lens):
        k, v = randn(seq_len, NUM_KV_HEADS, HEAD_DIM), randn(seq_len, NUM_KV_HEADS, HEAD_DIM)
        table: list[int] = []
        # Share full leading blocks with an earlier sequence: same blocks, same history.
        if b > 0 and rng.random() < 0.5:
            other = rng.randrange(b)
            num_shared = min(
                len(tables[other]), seq_len // block_size, lens[other][0] // block_size
            )
            if num_shared:
                shared_tokens = num_shared * block_size
                table = tables[other][:num_shared]
                num_shared_blocks += num_shared
                k[:shared_tokens], v[:shared_tokens] = (
                    seq_k[other][:shared_tokens],
                    seq_v[other][:shared_tokens],
                )
        table += [free.pop() for _ in range(blocks_needed[b] - len(table))]
        tables.append(table)
        seq_k.append(k)
        seq_v.append(v)
    seq_q = [randn(q_len, NUM_HEADS, HEAD_DIM) for _, q_len in lens]

    max_blocks = max(blocks_needed) + rng.randint(0, 2)
    block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables])
    # NaN everywhere not written: any read of an unwritten slot would poison the output.
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)

    def slots(b: int, positions: range) -> list[int]:
        return [tables[b][p // block_size] * block_size + p % block_size for p in positions]

    new_slots: list[int] = []
    for b, (seq_len, q_len) in enumerate(lens):
        cached = range(seq_len - q_len)
        cached_slots = torch.tensor(slots(b, cached), dtype=torch.int64)
        n = len(cached)
        write_kv(k_cache, v_cache, seq_k[b][:n], seq_v[b][:n], cached_slots)
        new_slots += slots(b, range(seq_len - q_len, seq_len))
    slot_mapping = torch.tensor(new_slots, dtype=torch.int64)
    new_k = torch.cat([k[s - ql :] for k, (s, ql) in zip(seq_k, lens, strict=True)])
    new_v = torch.cat([v[s - ql :] for v, (s, ql) in zip(seq_v, lens, strict=True)])
    write_kv(k_cache, v_cache, new_k, new_v, slot_mapping)

    q_lens = [ql for _, ql in lens]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()]),
        seq_lens=torch.tensor([s for s, _ in lens]),
        block_tables=block_tables,
        slot_mapping=slot_mapping,
        max_query_len=max(q_lens),
        max_seq_len=max(s for s, _ in lens),
        block_size=block_size,
    )
    q = torch.cat(seq_q)
    return Case(meta, q, k_cache, v_cache, seq_k, seq_v, seq_q, num_shared_blocks)


def _contiguous_reference(
    case: Case, window: int | None = None, softcap: float | None = None
) -> torch.Tensor:
    """Per-sequence attention over contiguous K/V with an explicit offset causal mask (and
    sliding window, soft-capped scores), float32."""
    outs = []
    group = NUM_HEADS // NUM_KV_HEADS
    for q, k, v in zip(case.seq_q, case.seq_k, case.seq_v, strict=True):
        q_len, seq_len = q.shape[0], k.shape[0]
        query_pos = seq_len - q_len + torch.arange(q_len)[:, None]
        mask = torch.arange(seq_len)[None, :] <= query_pos
        if window is not None:
            mask &= torch.arange(seq_len)[None, :] > query_pos - window
        k_h = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
        v_h = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = q.float().transpose(0, 1) @ k_h.transpose(1, 2) * SCALE  # [H, q_len, S]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        outs.append((probs @ v_h).transpose(0, 1))  # [q_len, H, D]
    return torch.cat(outs)


def _free_blocks_outside_window(case: Case, window: int) -> int:
    """Free what a sliding-window layer may: point every table entry that no query of the step
    sees at block 0, and poison (NaN) the blocks no sequence needs any more; returns how many
    entries were freed."""
    meta, freed, needed = case.meta, [], set()
    q_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).tolist()
    for b, (seq_len, q_len) in enumerate(zip(meta.seq_lens.tolist(), q_lens, strict=True)):
        first_needed = max(0, seq_len - q_len - window + 1) // meta.block_size
        freed += [(b, logical) for logical in range(first_needed)]
        needed.update(meta.block_tables[b, first_needed : -(-seq_len // meta.block_size)].tolist())
    for b, logical in freed:
        block = int(meta.block_tables[b, logical])
        if block not in needed:
            case.k_cache[block] = float("nan")
            case.v_cache[block] = float("nan")
        meta.block_tables[b, logical] = 0
    return len(freed)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", [1, 3, 7])
def test_sliding_window_never_reads_the_blocks_it_may_free(block_size: int, window: int) -> None:
    freed = 0
    for seed in range(30):
        case = _make_case(seed * 13 + window, block_size, torch.float32)
        expected = _contiguous_reference(case, window=window)
        freed += _free_blocks_outside_window(case, window)
        out = paged_attention_reference(
            case.q, case.k_cache, case.v_cache, case.meta, SCALE, window=window
        )
        assert not out.isnan().any()
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert freed > 0  # some cases did free blocks


@pytest.mark.parametrize("softcap", [0.5, 50.0])
def test_soft_capped_scores(softcap: float) -> None:
    for seed in range(20):
        case = _make_case(seed + 500, 16, torch.float32)
        out = paged_attention_reference(
            case.q, case.k_cache, case.v_cache, case.meta, SCALE, softcap=softcap
        )
        torch.testing.assert_close(out, _contiguous_reference(case, softcap=softcap))
    # a small cap changes the result (the cap is applied, not ignored)
    plain = paged_attention_reference(case.q, case.k_cache, case.v_cache, case.meta, SCALE)
    assert softcap > 1 or not torch.allclose(out, plain, atol=1e-3)


@pytest.mark.parametrize("block_size", [1, 16])
def test_matches_contiguous_sdpa_bfloat16(block_size: int) -> None:
    for seed in range(15):
        case = _make_case(1000 + seed, block_size, torch.bfloat16)
        out = paged_attention_reference(case.q, case.k_cache, case.v_cache, case.meta, SCALE)
        assert out.dtype == torch.bfloat16
        # Same bf16 inputs, both computed in float32: only the final rounding to bf16 differs.
        torch.testing.assert_close(out.float(), _contiguous_reference(case), atol=1e-2, rtol=1e-2)


def test_large_decode_batch() -> None:
    """Many decode rows at once (the shape of a busy step), one shared prefix block."""
    gen = torch.Generator().manual_seed(0)
    num_seqs, block_size, seq_len = 128, 16, 40
    num_blocks = num_seqs * 2 + 1
    k_cache = torch.randn(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    tables = torch.cat([torch.zeros(num_seqs, 1, dtype=torch.int64), perm.view(num_seqs, 2)], 1)
    positions = torch.arange(seq_len)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(num_seqs + 1),
        seq_lens=torch.full((num_seqs,), seq_len),
        block_tables=tables,
        slot_mapping=tables[:, -1] * block_size + (seq_len - 1) % block_size,
        max_query_len=1,
        max_seq_len=seq_len,
        block_size=block_size,
    )
    q = torch.randn(num_seqs, NUM_HEADS, HEAD_DIM, generator=gen)
    out = paged_attention_reference(q, k_cache, v_cache, meta, SCALE)
    slots = tables[:, positions // block_size] * block_size + positions % block_size  # [B, S]
    k = k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots].repeat_interleave(3, dim=2)
    v = v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots].repeat_interleave(3, dim=2)
    expected = F.scaled_dot_product_attention(
        q[:, :, None], k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3), scale=SCALE
    )[:, :, 0]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("contiguous", [True, False])
def test_write_kv_places_tokens_at_slots(contiguous: bool) -> None:
    """Both write paths (flat rows; block and offset for a cache with no flat view) write in
    place: the caches' own storage holds the tokens afterwards."""
    num_blocks, block_size = 5, 4
    width = 3 if contiguous else 6
    k_cache = torch.zeros(num_blocks, block_size, 2, width)[..., :3]
    v_cache = torch.zeros(num_blocks, block_size, 2, width)[..., :3]
    assert k_cache.is_contiguous() == contiguous
    slot_mapping = torch.tensor([13, 2, 19, 4])
    k = torch.arange(1, 5, dtype=torch.float32)[:, None, None].expand(4, 2, 3)
    write_kv(k_cache, v_cache, k, -k, slot_mapping)
    for token, slot in enumerate(slot_mapping.tolist()):
        block, offset = divmod(slot, block_size)
        assert torch.all(k_cache[block, offset] == token + 1)
        assert torch.all(v_cache[block, offset] == -(token + 1))
    assert int((k_cache != 0).sum()) == 4 * 2 * 3  # nothing else touched
    assert int((v_cache != 0).sum()) == 4 * 2 * 3


def test_write_kv_rejects_mismatched_shapes() -> None:
    cache = torch.zeros(2, 4, 2, 3)
    with pytest.raises(ValueError):
        write_kv(cache, cache.clone(), torch.zeros(2, 3, 3), torch.zeros(2, 3, 3), torch.arange(2))


def test_metadata_rejects_short_block_tables() -> None:
    with pytest.raises(ValueError):
        AttentionMetadata(
            query_start_loc=torch.tensor([0, 1]),
            seq_lens=torch.tensor([9]),
            block_tables=torch.zeros(1, 2, dtype=torch.int64),
            slot_mapping=torch.tensor([8]),
            max_query_len=1,
            max_seq_len=9,
            block_size=4,
        )
