"""One step's model inputs, built from the plan's scheduled requests: token ids, positions,
slots, and the attention layouts (fast and reference).

Owns the flat token order of a step: decode rows (one new token; a drafted decode's last token
and drafts) first, then the prefill chunks, each group in plan order. The model is per-token
except attention, so the order only has to agree between the inputs, the attention layout and
the rows read back for sampling.

Slot of position p of a request (see attention.py for the picture)::

    slot(p) = block_table[p // block_size] * block_size + p % block_size

Imports the core's plan types only to read them. Must not import ``models`` or ``server``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagekv.core.plan import ScheduledRequest
from pagekv.kernels.decode import DecodeBatch
from pagekv.runner.attention import AttentionMetadata
from pagekv.runner.fast_attention import PrefillChunk, StepLayout


@dataclass(frozen=True)
class StepInputs:
    """Everything the forward needs, in the step's flat token order."""

    order: tuple[ScheduledRequest, ...]  # decode rows first, then prefill chunks
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    slot_mapping: torch.Tensor  # int64 [T]
    last_token: list[int]  # per entry of ``order``: flat index of its last token fed
    layout: StepLayout


def _decode_rows(
    entries: Sequence[ScheduledRequest], block_size: int
) -> tuple[list[int], list[int], list[int], DecodeBatch]:
    """Token ids, positions and slots of the decode rows, and their kernel batch.

    A drafted decode is one row per position it feeds, each attending up to its own position:
    row for row what decoding those tokens one step at a time would compute, in one step, and
    the kernel reads its history once for all of them (``DecodeBatch.query_lens``)."""
    drafted = any(s.draft_token_ids for s in entries)
    if drafted:
        ids = [t for s in entries for t in s.token_ids]
        positions = [p for s in entries for p in range(s.start_position, s.end_position)]
        slots = [
            s.block_table[p // block_size] * block_size + p % block_size
            for s in entries
            for p in range(s.start_position, s.end_position)
        ]
    else:  # the common step: one token per entry
        ids = [s.request.all_token_ids[s.start_position] for s in entries]
        positions = [s.start_position for s in entries]
        slots = [
            s.block_table[p // block_size] * block_size + p % block_size
            for s, p in zip(entries, positions, strict=True)
        ]
    seq_lens = [s.start_position + s.num_tokens for s in entries]
    num_blocks = [-(-n // block_size) for n in seq_lens]
    width = max(num_blocks, default=0)
    tables = [
        s.block_table[:n] + [0] * (width - n) for s, n in zip(entries, num_blocks, strict=True)
    ]
    block_tables = torch.tensor(tables, dtype=torch.int32).view(len(entries), width)
    first = min((s.start_position for s in entries), default=0)
    batch = DecodeBatch(
        block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        max_seq_len=max(seq_lens, default=0),
        shared_blocks=_shared_blocks(block_tables, first // block_size),
        query_lens=(
            torch.tensor([s.num_tokens for s in entries], dtype=torch.int32) if drafted else None
        ),
        num_queries=len(ids),
        max_query_len=max((s.num_tokens for s in entries), default=1),
    )
    return ids, positions, slots, batch


def _shared_blocks(block_tables: torch.Tensor, limit: int) -> int:
    """How many leading columns (at most ``limit``) of int32 [B, width] are the same in every
    row: blocks of a prefix the decode rows share (``DecodeBatch.shared_blocks``)."""
    if block_tables.shape[0] < 2 or limit == 0:
        return 0
    lead = block_tables[:, :limit]
    differs = (lead != lead[:1]).any(0)  # [limit]
    return int(differs.int().argmax()) if bool(differs.any()) else limit


def _prefill_chunk(
    entry: ScheduledRequest, token_start: int, block_size: int
) -> tuple[PrefillChunk, torch.Tensor, torch.Tensor]:
    """The chunk's attention record, positions int64 [L] and slots int64 [L]."""
    start, num = entry.start_position, entry.num_tokens
    seq_len = start + num
    blocks = torch.tensor(entry.block_table[: -(-seq_len // block_size)], dtype=torch.int64)
    positions = torch.arange(start, seq_len)  # [L]
    slots = blocks[positions // block_size] * block_size + positions % block_size  # [L]
    mask = None
    if start > 0:  # history in the cache: SDPA reads it through the blocks, masked with an offset
        mask = torch.arange(seq_len)[None, :] <= positions[:, None]  # [L, S]
    return PrefillChunk(token_start, num, seq_len, blocks, mask), positions, slots


def prepare_step(scheduled: Sequence[ScheduledRequest], block_size: int) -> StepInputs:
    """Build the step's inputs; one pass over the rows, no per-token Python loop."""
    decode = [s for s in scheduled if s.num_tokens == 1 or s.draft_token_ids]
    prefill = [s for s in scheduled if s.num_tokens > 1 and not s.draft_token_ids]
    ids, decode_positions, decode_slots, decode_batch = _decode_rows(decode, block_size)
    positions = [torch.tensor(decode_positions, dtype=torch.int64)]
    slots = [torch.tensor(decode_slots, dtype=torch.int64)]
    last_token = list(itertools.accumulate((s.num_tokens for s in decode), initial=-1))[1:]
    chunks: list[PrefillChunk] = []
    for entry in prefill:
        chunk, chunk_positions, chunk_slots = _prefill_chunk(entry, len(ids), block_size)
        chunks.append(chunk)
        positions.append(chunk_positions)
        slots.append(chunk_slots)
        ids += entry.token_ids
        last_token.append(len(ids) - 1)
    return StepInputs(
        order=(*decode, *prefill),
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.cat(positions),
        slot_mapping=torch.cat(slots),
        last_token=last_token,
        layout=StepLayout(len(decode_positions), decode_batch, tuple(chunks)),
    )


def reference_metadata(inputs: StepInputs, block_size: int) -> AttentionMetadata:
    """The same step as ``AttentionMetadata`` for ``paged_attention_reference``."""
    order = inputs.order
    q_lens = torch.tensor([s.num_tokens for s in order], dtype=torch.int64)  # [B]
    seq_lens = torch.tensor([s.start_position + s.num_tokens for s in order])  # [B]
    query_start_loc = torch.zeros(len(order) + 1, dtype=torch.int64)
    torch.cumsum(q_lens, 0, out=query_start_loc[1:])
    num_blocks = [-(-int(n) // block_size) for n in seq_lens]
    width = max(num_blocks)
    tables = [s.block_table[:n] + [0] * (width - n) for s, n in zip(order, num_blocks, strict=True)]
    return AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=torch.tensor(tables, dtype=torch.int64),  # [B, max_blocks]
        slot_mapping=inputs.slot_mapping,
        max_query_len=int(q_lens.max()),
        max_seq_len=int(seq_lens.max()),
        block_size=block_size,
    )
