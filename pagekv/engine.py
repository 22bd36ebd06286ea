"""The engine: requests' life cycle around ``step()``: schedule, execute, update, detokenize.

Owns: the request groups (a user request with its n branches), their detokenizers and output
records. The scheduler owns queues, the KV manager owns blocks, the runner owns tensors; the
engine wires them together and is the only thing the server and the LLM API talk to.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from pagekv.config import EngineConfig, parse_bytes
from pagekv.core import invariants
from pagekv.core.kv_cache_manager import KVCacheManager
from pagekv.core.request import Request, RequestStatus
from pagekv.core.scheduler import (
    PreemptionCostModel,
    PreemptionMode,
    Scheduler,
    SchedulerConfig,
    SchedulingPolicy,
)
from pagekv.detokenizer import IncrementalDetokenizer
from pagekv.errors import InvalidRequestError
from pagekv.models.loader import LoadedModel, load_model
from pagekv.outputs import CompletionOutput, RequestOutput
from pagekv.runner.kv_cache import KVCache
from pagekv.runner.model_runner import ModelRunner, SampledToken
from pagekv.sampling_params import SamplingParams

logger = logging.getLogger("pagekv")

PromptInput = str | Sequence[int]


@dataclass
class _Branch:
    """One generated sequence of a group and what the user will see of it."""

    request: Request
    detok: IncrementalDetokenizer
    output: CompletionOutput


@dataclass
class _Group:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    branches: list[_Branch] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(b.output.finished for b in self.branches)

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[replace(b.output, token_ids=list(b.output.token_ids)) for b in self.branches],
            finished=self.finished,
            num_cached_tokens=self.branches[0].request.num_cached_prompt_tokens,
        )


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class LLMEngine:
    """``add_request`` / ``abort_request`` / ``step``: continuous batching over a paged KV cache."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        dtype = torch.float32 if config.dtype == "float32" else torch.bfloat16
        self.loaded = loaded if loaded is not None else load_model(config.model, dtype)
        self.tokenizer = self.loaded.tokenizer
        mcfg = self.loaded.config
        self.max_model_len = min(
            config.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings
        )
        block_bytes = KVCache.bytes_per_block(
            mcfg.num_hidden_layers,
            config.block_size,
            mcfg.num_key_value_heads,
            mcfg.head_dim,
            dtype,
        )
        num_blocks = (
            config.num_kv_blocks
            or parse_bytes(config.kv_cache_memory, "kv_cache_memory") // block_bytes
        )
        if num_blocks < 1:
            raise InvalidRequestError(
                "kv_cache_memory is smaller than one KV block", "kv_cache_memory"
            )
        num_host = parse_bytes(config.swap_space, "swap_space") // block_bytes
        self.kv = KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching, num_host
        )
        sched_cfg = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            block_size=config.block_size,
            preemption_mode=PreemptionMode(config.preemption_mode),
            policy=SchedulingPolicy(config.scheduling_policy),
            priority_aging_steps=config.priority_aging_steps,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            cost_model=config.preemption_cost or PreemptionCostModel(),
        )
        self.scheduler = Scheduler(sched_cfg, self.kv)
        self.runner = ModelRunner(self.loaded, num_blocks, config.block_size, num_host)
        self._groups: dict[str, _Group] = {}
        self._branch_of: dict[str, tuple[_Group, _Branch]] = {}
        self.capacity_line = self._capacity_line(num_blocks, block_bytes)
        logger.info(self.capacity_line)

    def _capacity_line(self, num_blocks: int, block_bytes: int) -> str:
        bs = self.config.block_size
        tokens = num_blocks * bs
        per_token = block_bytes // bs
        concurrency = tokens / self.max_model_len
        return (
            f"KV cache: {num_blocks} blocks x {bs} tokens = {tokens} tokens "
            f"({num_blocks * block_bytes / 2**30:.2f} GiB, {per_token / 1024:.1f} KiB per token); "
            f"max concurrency at {self.max_model_len} tokens per request: {concurrency:.2f}x"
        )

    # ---- requests in ----------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """Tokenize text, or check token ids against the vocabulary; neither may be empty."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty", "prompt")
            return prompt, self.tokenizer.encode(prompt)
        ids = list(prompt)
        if not ids:
            raise InvalidRequestError("prompt_token_ids must not be empty", "prompt")
        vocab = self.loaded.config.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidRequestError(
                    f"token id {t!r} is outside the vocabulary [0, {vocab})", "prompt"
                )
        return None, ids

    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> None:
        """Validate, tokenize and queue; raises ``InvalidRequestError`` with nothing allocated."""
        params = params or SamplingParams()
        if request_id in self._groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        if params.best_of is not None and params.best_of != params.n:
            raise InvalidRequestError("best_of different from n is not supported yet", "best_of")
        text, ids = self.tokenize_prompt(prompt)
        self.scheduler.check_fits(len(ids), params.max_tokens)
        group = _Group(request_id, text, ids)
        eos = tuple(self.tokenizer.eos_token_ids)
        for i in range(params.n):
            branch_params = params if params.seed is None else replace(params, seed=params.seed + i)
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            request = Request(rid, ids, branch_params, cache_salt=cache_salt, priority=priority)
            request.eos_token_ids = eos
            branch = _Branch(
                request,
                IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens),
                CompletionOutput(
                    index=i,
                    text="",
                    token_ids=[],
                    logprobs=[] if params.logprobs is not None else None,
                    cumulative_logprob=0.0 if params.logprobs is not None else None,
                ),
            )
            group.branches.append(branch)
        self._groups[request_id] = group
        for branch in group.branches:
            self._branch_of[branch.request.request_id] = (group, branch)
        parent, *children = [b.request for b in group.branches]
        if children and len(ids) > 1:
            # Parallel sampling: prefill once; the branches fork off the parent's blocks.
            for child in children:
                child.status = RequestStatus.FORK_PENDING
            parent.fork_children = children
            self.scheduler.add(parent)
        else:
            for request in (parent, *children):
                self.scheduler.add(request)

    def abort_request(self, request_id: str) -> bool:
        """End a request wherever it is, releasing its blocks now. False if unknown or done."""
        group = self._groups.get(request_id)
        if group is None or group.finished:
            return False
        for branch in group.branches:
            self._finish(branch, RequestStatus.FINISHED_ABORTED)
        self._forget(group)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    # ---- one step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, execute, update; returns an output for every group that changed."""
        plan = self.scheduler.schedule()
        if self.config.check_invariants:
            invariants.check_manager(self.kv)
            invariants.check_plan(self.kv, plan)
        sampled = self.runner.execute(plan)
        finished = self.scheduler.update(plan, {rid: s.token_id for rid, s in sampled.items()})
        done = {r.request_id for r in finished}
        changed: dict[str, _Group] = {}
        for rid, token in sampled.items():
            group, branch = self._branch_of[rid]
            self._on_token(branch, token, rid in done)
            changed[group.request_id] = group
        outputs = [g.to_output() for g in changed.values()]
        for group in changed.values():
            if group.finished:
                self._forget(group)
        if self.config.check_invariants:
            invariants.check_manager(self.kv)
        return outputs

    def _on_token(self, branch: _Branch, token: SampledToken, finished: bool) -> None:
        out, request = branch.output, branch.request
        out.token_ids.append(token.token_id)
        if out.logprobs is not None and token.logprob is not None:
            entry = {token.token_id: token.logprob}
            entry.update(dict(token.top_logprobs or []))
            out.logprobs.append(entry)
            out.cumulative_logprob = (out.cumulative_logprob or 0.0) + token.logprob
        is_eos = request.status is RequestStatus.FINISHED_STOPPED
        skip_text = is_eos and not request.params.include_stop_str_in_output
        delta = "" if skip_text else branch.detok.append(token.token_id)
        out.text = branch.detok.text
        if finished:
            out.finish_reason = _FINISH_REASON[request.status]
            if token.token_id in request.params.stop_token_ids:
                out.stop_reason = token.token_id
            return
        stop = branch.detok.find_stop(request.params.stop, len(delta)) if delta else None
        if stop is not None:
            text, at = stop
            keep = at + len(text) if request.params.include_stop_str_in_output else at
            branch.detok.truncate(keep)
            out.text = branch.detok.text
            out.stop_reason = text
            self._finish(branch, RequestStatus.FINISHED_STOPPED)

    def _finish(self, branch: _Branch, status: RequestStatus) -> None:
        self.scheduler.finish(branch.request, status)
        if branch.output.finish_reason is None:
            branch.output.finish_reason = _FINISH_REASON[status]

    def _forget(self, group: _Group) -> None:
        del self._groups[group.request_id]
        for branch in group.branches:
            rid = branch.request.request_id
            self._branch_of.pop(rid, None)
            self.runner.release(rid)

    # ---- reporting ------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """The engine's counters as a plain dict (the numbers the server exports)."""
        usage = self.kv.usage()
        return {
            "kv_blocks_total": usage.num_blocks,
            "kv_blocks_free": usage.num_free_blocks,
            "kv_blocks_used": usage.num_used_blocks,
            "kv_blocks_evictable": usage.num_evictable_blocks,
            "kv_usage": usage.num_used_blocks / usage.num_blocks,
            "kv_slots_allocated": usage.num_slots_allocated,
            "kv_tokens_stored": usage.num_tokens_stored,
            "kv_internal_fragmentation": usage.internal_fragmentation,
            "prefix_cache_query_tokens": usage.prefix_query_tokens,
            "prefix_cache_hit_tokens": usage.prefix_hit_tokens,
            "prefix_cache_evictions": usage.num_evictions,
            "cow_copies": usage.num_cow_copies,
            "swapped_out_blocks": usage.num_swapped_out_blocks,
            "swapped_in_blocks": usage.num_swapped_in_blocks,
            **asdict(self.scheduler.counters),
            "num_waiting": len(self.scheduler.waiting),
            "num_running": len(self.scheduler.running),
            "num_swapped": len(self.scheduler.swapped),
            "steps": self.scheduler.step,
        }

    def block_map(self) -> dict[str, Any]:
        """Every device block's state, ref count, prefix hash and owners, as plain JSON data.

        ``blocks`` is indexed by physical block id; ``hash`` is hex (None if uncommitted);
        ``owners`` are the request ids whose block table points at the block. ``requests`` maps
        each request with a device table to it; ``swapped`` each swapped-out request to its
        host block table. Read-only; call it from the thread that steps the engine.
        """
        pool = self.kv.pool
        requests = {rid: list(self.kv.block_table(rid)) for rid in self.kv.request_ids()}
        owners: dict[int, list[str]] = {}
        for rid, table in requests.items():
            for block_id in dict.fromkeys(table):
                owners.setdefault(block_id, []).append(rid)
        blocks = []
        for b in range(pool.num_blocks):
            block_hash = pool.block_hash(b)
            blocks.append(
                {
                    "id": b,
                    "state": pool.state(b).value,
                    "ref_count": pool.ref_count(b),
                    "hash": None if block_hash is None else block_hash.hex(),
                    "owners": owners.get(b, []),
                }
            )
        swapped = {
            rid: list(self.kv.host_block_table(rid)) for rid in self.kv.swapped_request_ids()
        }
        return {
            "num_blocks": pool.num_blocks,
            "block_size": self.config.block_size,
            "blocks": blocks,
            "requests": requests,
            "swapped": swapped,
        }
