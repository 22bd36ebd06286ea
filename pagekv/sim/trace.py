"""Replaying a recorded request trace (``pagekv.core.trace``) in the simulator.

Replay gives every distinct prefix-block key 16 fresh token ids, the same ids wherever that key
recurs, and fresh ids to everything else (the prompt's tail, the outputs). Sharing is therefore
reproduced at 16-token granularity:

    shared prompt tokens (recorded)   |<-- 16 -->|<-- 16 -->|<-- 16 -->|..7..|
    replayed as shared                |<-- 16 -->|<-- 16 -->|<-- 16 -->|      (48 of 55)

exact at block sizes that are multiples of 16; at smaller block sizes the up to 15 shared
tokens past the last full 16-block are replayed as unshared, so hits there are a lower bound.
Prompt tokens that repeat an earlier request's *output* (a chat's history) are only shared
among the prompts that contain them: outputs are not recorded.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagekv.core.trace import TRACE_BLOCK_SIZE, TraceRecord
from pagekv.sim.workload import SimRequest, TokenIds


def replay_trace(records: Sequence[TraceRecord]) -> list[SimRequest]:
    """Requests whose token ids reproduce the recorded sharing (see the module docstring).

    Arrival times are shifted so the earliest record arrives at t = 0; order is by arrival.
    """
    if not records:
        return []
    ids = TokenIds()
    blocks: dict[str, list[int]] = {}
    start = min(r.arrival_s for r in records)
    ordered = sorted(records, key=lambda r: r.arrival_s)
    requests = []
    for i, rec in enumerate(ordered):
        prompt: list[int] = []
        for key in rec.block_hashes:
            block = blocks.get(key)
            if block is None:
                block = blocks[key] = ids.take(TRACE_BLOCK_SIZE)
            prompt += block
        prompt += ids.take(rec.prompt_len - len(prompt))
        output = (tuple(ids.take(rec.output_len)),)
        requests.append(SimRequest(f"trace-{i}", rec.arrival_s - start, prompt, output))
    return requests
