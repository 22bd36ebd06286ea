"""The model runner: executes a ``Plan`` on the model and the KV tensors. It never decides.

Owns: the device and host KV tensors (``KVCache``), the per-request sampling generators, and
the model. Imports core only for the plan's types; decisions (who runs, which blocks) arrive
as integer block ids in the plan.

One step::

    apply transfers   swap_out, swap_in, copies (copy-on-write before any write)
    build inputs      input ids, positions, slot mapping, padded block tables   [T], [B, ...]
    forward           each layer writes its new K/V by slot, reads history via block tables
    sample            logits of the last position of each request that samples   [S, vocab]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagekv.core.plan import Plan, ScheduledRequest
from pagekv.models.loader import LoadedModel
from pagekv.runner.attention import AttentionMetadata, paged_attention_reference, write_kv
from pagekv.runner.kv_cache import KVCache
from pagekv.runner.sampler import Sampler, SamplerOutput, SamplingRow


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None


class ModelRunner:
    """Owner of the KV tensors and sampler state; ``execute(plan)`` runs one step."""

    def __init__(
        self, loaded: LoadedModel, num_blocks: int, block_size: int, num_host_blocks: int = 0
    ) -> None:
        cfg = loaded.config
        self.model = loaded.model
        self.dtype = next(loaded.model.parameters(), torch.empty(0, dtype=torch.float32)).dtype
        self.block_size = block_size
        shape = (cfg.num_hidden_layers, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv = KVCache(shape[0], num_blocks, block_size, shape[2], shape[3], self.dtype)
        self.host_kv = (
            KVCache(shape[0], num_host_blocks, block_size, shape[2], shape[3], self.dtype)
            if num_host_blocks > 0
            else None
        )
        self.scale = cfg.head_dim**-0.5
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}

    # ---- per-request sampler state --------------------------------------------------------------

    def release(self, request_id: str) -> None:
        """Forget a finished request's generator."""
        self._generators.pop(request_id, None)

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator().manual_seed(seed)
            self._generators[request_id] = gen
        return gen

    # ---- one step -------------------------------------------------------------------------------

    def apply_transfers(self, plan: Plan) -> None:
        t = plan.transfers
        if t.swap_out:
            assert self.host_kv is not None, "swap planned without a host pool"
            self.kv.transfer(self.host_kv, t.swap_out)
        if t.swap_in:
            assert self.host_kv is not None, "swap planned without a host pool"
            self.host_kv.transfer(self.kv, t.swap_in)
        if t.copies:
            self.kv.copy_blocks(t.copies)

    @torch.inference_mode()
    def execute(self, plan: Plan) -> dict[str, SampledToken]:
        """Run one step; returns the sampled token of every request whose step reached its end."""
        self.apply_transfers(plan)
        if not plan.scheduled:
            return {}
        input_ids, positions, meta = self._prepare(plan.scheduled)

        def attention(
            layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
        ) -> torch.Tensor:
            write_kv(self.kv.k[layer], self.kv.v[layer], k, v, meta.slot_mapping)
            return paged_attention_reference(
                q, self.kv.k[layer], self.kv.v[layer], meta, self.scale
            )

        hidden = self.model(input_ids, positions, attention)  # [T, hidden]
        sampling = [i for i, s in enumerate(plan.scheduled) if s.samples]
        if not sampling:
            return {}
        last = meta.query_start_loc[1:][sampling] - 1  # [S] last new token of each sampling row
        logits = self.model.compute_logits(hidden[last])  # [S, vocab] float32
        rows = [self._row(plan.scheduled[i]) for i in sampling]
        out = self.sampler(logits, rows)
        return self._results([plan.scheduled[i] for i in sampling], out)

    def _row(self, entry: ScheduledRequest) -> SamplingRow:
        request = entry.request
        return SamplingRow(
            params=request.params,
            generator=self._generator(request.request_id, request.params.seed),
            num_generated=request.num_output_tokens,
            eos_token_ids=request.eos_token_ids,
        )

    @staticmethod
    def _results(
        entries: Sequence[ScheduledRequest], out: SamplerOutput
    ) -> dict[str, SampledToken]:
        results: dict[str, SampledToken] = {}
        for i, entry in enumerate(entries):
            results[entry.request.request_id] = SampledToken(
                token_id=out.token_ids[i],
                logprob=None if out.logprobs is None else out.logprobs[i],
                top_logprobs=out.top_logprobs[i],
            )
        return results

    def _prepare(
        self, scheduled: Sequence[ScheduledRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        q_lens = torch.tensor([s.num_tokens for s in scheduled], dtype=torch.int64)  # [B]
        starts = torch.tensor([s.start_position for s in scheduled], dtype=torch.int64)  # [B]
        seq_lens = starts + q_lens
        query_start_loc = torch.zeros(len(scheduled) + 1, dtype=torch.int64)
        torch.cumsum(q_lens, 0, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        row = torch.repeat_interleave(torch.arange(len(scheduled)), q_lens)  # [T] request index
        positions = starts[row] + (torch.arange(num_tokens) - query_start_loc[:-1][row])  # [T]
        max_blocks = max(len(s.block_table) for s in scheduled)
        tables = torch.zeros(len(scheduled), max_blocks, dtype=torch.int64)  # [B, max_blocks]
        for i, s in enumerate(scheduled):
            tables[i, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int64)
        slot_mapping = tables[row, positions // bs] * bs + positions % bs  # [T]
        ids: list[int] = []
        for s in scheduled:
            ids += s.token_ids
        meta = AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=tables,
            slot_mapping=slot_mapping,
            max_query_len=int(q_lens.max()),
            max_seq_len=int(seq_lens.max()),
            block_size=bs,
        )
        return torch.tensor(ids, dtype=torch.int64), positions, meta
