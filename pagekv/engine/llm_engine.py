"""The engine: requests' life cycle around ``step()``: schedule, execute, update, detokenize.

Owns: the request groups (a user request with its n branches, ``request_group.py``) and the
beam-search driver. The scheduler owns queues, the KV manager owns blocks, the runner owns
tensors; the engine wires them together and is the only thing the server and LLM API talk to.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any

import torch

from pagekv.core import invariants
from pagekv.core.kv_cache_manager import KVCacheManager
from pagekv.core.plan import Plan
from pagekv.core.request import Request, RequestStatus
from pagekv.core.scheduler import (
    PreemptionCostModel,
    PreemptionMode,
    Scheduler,
    SchedulerConfig,
    SchedulingPolicy,
)
from pagekv.core.tier_policy import LoadCostModel
from pagekv.core.trace import TraceRecorder, block_hashes_hex
from pagekv.engine.beam_driver import BeamDriver
from pagekv.engine.beam_search import BeamSearchOutput, BeamSearchParams
from pagekv.engine.block_map import block_map
from pagekv.engine.config import (
    EngineConfig,
    host_pool_bytes,
    max_model_len,
    parse_bytes,
    uses_lower_tiers,
)
from pagekv.engine.detokenizer import TokenTexts
from pagekv.engine.device import gpu_kv_bytes, resolve_device
from pagekv.engine.engine_stats import capacity_line, engine_stats
from pagekv.engine.kv_events import start_kv_events
from pagekv.engine.model_setup import int8_activations, load_configured_model
from pagekv.engine.outputs import FINISH_ERROR, RequestOutput
from pagekv.engine.prompts import PromptInput, check_token_ids, tokenize_prompt
from pagekv.engine.request_group import (
    FINISH_REASON,
    Branch,
    GroupSetup,
    RequestGroup,
    bad_words_token_ids,
)
from pagekv.engine.request_params import ParamsPolicy
from pagekv.engine.sanitizer import KVSanitizer
from pagekv.engine.structured_output import StructuredOutputs
from pagekv.engine.tier_setup import build_tiers, open_configured_store
from pagekv.errors import InvalidRequestError, PromptTooLongError
from pagekv.models.config import ModelConfig
from pagekv.models.loader import LoadedModel
from pagekv.runner.kv_cache import KVCache
from pagekv.runner.model_runner import ModelRunner, SampledToken
from pagekv.sampling_params import SamplingParams, StructuredOutputsParams
from pagekv.tiering.manager import TierManager

logger = logging.getLogger("pagekv")


def _block_bytes(config: EngineConfig, mcfg: ModelConfig, dtype: torch.dtype) -> int:
    """What one block id costs: K and V of every layer, in the KV cache's dtype."""
    layers, heads, head_dim = mcfg.num_hidden_layers, mcfg.num_key_value_heads, mcfg.head_dim
    size = config.block_size
    return KVCache.bytes_per_block(layers, size, heads, head_dim, dtype, config.kv_cache_dtype)


def _num_kv_blocks(config: EngineConfig, block_bytes: int, device: torch.device) -> int:
    """Device KV blocks: the configured count, or as many as ``kv_cache_memory`` holds (on a
    GPU: as many as ``gpu_memory_utilization`` leaves room for)."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    if device.type == "cuda":
        memory = gpu_kv_bytes(device, config.gpu_memory_utilization)
    else:
        memory = parse_bytes(config.kv_cache_memory, "kv_cache_memory")
    num_blocks = memory // block_bytes
    if num_blocks < 1:
        raise InvalidRequestError("kv_cache_memory is smaller than one KV block", "kv_cache_memory")
    return num_blocks


def _scheduler_config(
    config: EngineConfig, max_model_len: int, load_cost: LoadCostModel
) -> SchedulerConfig:
    """The engine's scheduling settings as the core's validated config."""
    return SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_model_len,
        block_size=config.block_size,
        preemption_mode=PreemptionMode(config.preemption_mode),
        policy=SchedulingPolicy(config.scheduling_policy),
        priority_aging_steps=config.priority_aging_steps,
        long_prefill_token_threshold=config.long_prefill_token_threshold,
        shared_prefill_tokens=config.shared_prefill_tokens,
        prefill_step_seconds=config.prefill_step_seconds,
        cost_model=config.preemption_cost or PreemptionCostModel(),
        load_cost=load_cost,
        num_speculative_tokens=config.num_speculative_tokens,
        prompt_lookup_max=config.prompt_lookup_max,
        prompt_lookup_min=config.prompt_lookup_min,
    )


class LLMEngine:
    """``add_request`` / ``abort_request`` / ``step``: continuous batching over a paged KV cache."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        dtype = torch.float32 if config.dtype == "float32" else torch.bfloat16
        device = resolve_device(config.device)
        self.loaded = loaded if loaded is not None else load_configured_model(config, dtype, device)
        self.tokenizer = self.loaded.tokenizer
        self.token_texts = TokenTexts(self.tokenizer)  # logprobs' decoded tokens, memoised
        mcfg = self.loaded.config
        self.max_model_len = max_model_len(config, mcfg)
        block_bytes = _block_bytes(config, mcfg, dtype)
        if device.type != "cpu":
            self.loaded.model.to(device)  # before the pool is sized from the memory left
        num_blocks = _num_kv_blocks(config, block_bytes, device)
        num_host = host_pool_bytes(config) // block_bytes
        lower_tiers = uses_lower_tiers(config)
        store = open_configured_store(config)  # before anything big is allocated
        self.kv = KVCacheManager(
            num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            num_host,
            write_policy=config.cache_write_policy if lower_tiers else None,
            write_storage=store is not None,
            sliding_window=mcfg.kv_window,
        )
        self.runner = ModelRunner(
            self.loaded, num_blocks, config.block_size, num_host, num_threads=config.num_threads,
            device=device, int8_activations=int8_activations(config, self.loaded, device),
            kv_cache_dtype=config.kv_cache_dtype,
        )  # fmt: skip
        self.tiers: TierManager | None = None
        load_cost = LoadCostModel()
        if self.kv.tier_state.host_caching:
            self.tiers, load_cost = build_tiers(config, self.kv, self.runner, self.loaded, store)
            self.kv.tier_state.verify_host = self.tiers.verify_host
            self.kv.tier_state.write_storage = self.tiers.store is not None
            weakref.finalize(self, self.tiers.close)  # flush writes even if close() is forgotten
        self.kv_events = start_kv_events(config.kv_events_config, self.kv, self.tiers)
        sched_cfg = _scheduler_config(config, self.max_model_len, load_cost)
        self.scheduler = Scheduler(sched_cfg, self.kv)
        self._groups: dict[str, RequestGroup] = {}
        self.params_policy = ParamsPolicy(config.seed, config.max_logprobs)
        self.structured = StructuredOutputs(self.tokenizer, mcfg.vocab_size)
        # Each finished request's lengths and prefix-block hashes (no text), for ``pagekv sim``.
        self.trace = TraceRecorder(config.trace) if config.trace else None
        self._branch_of: dict[str, tuple[RequestGroup, Branch]] = {}
        self.beams = BeamDriver(self.scheduler, self.tokenizer, self.runner.release)
        self._beam_results: dict[str, BeamSearchOutput] = {}
        self.sanitizer = KVSanitizer(self.kv, self.runner.kv) if config.kv_sanitizer else None
        self._block_bytes = block_bytes
        kv_dtype = str(self.runner.kv.dtype).removeprefix("torch.")
        self.capacity_line = capacity_line(self.kv.pool, block_bytes, self.max_model_len, kv_dtype)
        self.system_line = self.runner.system_line  # the CPU and the kernels in use
        logger.info(self.system_line)
        logger.info(self.capacity_line)

    # ---- requests in ----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        priority: int = 0,
        client: str | None = None,
    ) -> None:
        """Validate, tokenize and queue; raises ``InvalidRequestError`` with nothing allocated.
        ``client``: whose request, for the fair policy's turns (None: the one local client)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params: a SamplingParams, got {params!r:.80}", "params")
        params = params.clone()  # the caller may change theirs later (vLLM's params are mutable)
        self._check_new_id(request_id)
        vocab_size = self.loaded.config.vocab_size
        text, ids = tokenize_prompt(self.tokenizer, vocab_size, prompt)
        params = self.params_policy.apply(params.fit_to_context(self._room_tokens(len(ids))))
        check_token_ids(params.stop_token_ids, vocab_size, "stop_token_ids")
        check_token_ids(params.logit_bias or (), vocab_size, "logit_bias")
        check_token_ids(params.allowed_token_ids or (), vocab_size, "allowed_token_ids")
        bad_words = bad_words_token_ids(self.tokenizer, params.bad_words, vocab_size)
        self.scheduler.check_priority(priority)
        self.scheduler.check_fits(len(ids), params.max_tokens)
        grammar = self.structured.compile(params.structured_outputs)
        texts = self.token_texts
        setup = GroupSetup(self.tokenizer, texts, cache_salt, priority, client, bad_words)
        group = RequestGroup.create(request_id, (text, ids), params, setup)
        self._groups[request_id] = group
        for branch in group.branches:
            self._branch_of[branch.request.request_id] = (group, branch)
            if grammar is not None:
                self.structured.track(branch.request.request_id, grammar)
        parent, *children = [b.request for b in group.branches]
        for request in self.scheduler.add_group(parent, children):
            self._prefetch(request)

    def _room_tokens(self, num_prompt_tokens: int) -> int:
        """What max_tokens=None generates up to: the context's room after the prompt, or the
        whole pool's if that holds less (a request the pool could never hold is refused)."""
        kv, total = self.kv, self.max_model_len
        chunk = self.scheduler.config.max_num_batched_tokens
        if kv.most_blocks_held(num_prompt_tokens, total, chunk) > kv.pool.num_blocks:
            total = kv.pool.num_blocks * kv.block_size
        return total - num_prompt_tokens

    def check_structured_outputs(self, constraint: StructuredOutputsParams) -> None:
        """Compile ``constraint`` (cached) or raise InvalidRequestError naming its field."""
        self.structured.compile(constraint)

    def _prefetch(self, request: Request) -> None:
        """Ask the storage tier for the prefix blocks memory lacks, if waiting for them pays."""
        tiers = self.tiers
        if tiers is None or not tiers.available or not self.config.enable_prefix_caching:
            return
        if not request.reads_prefix_cache:
            return
        chain = self.kv.prefix_chain(request)
        start = 0
        while start < len(chain) and self.kv.residency(chain[start]) != (None, None):
            start += 1
        if start < len(chain) and self.scheduler.wait_for_load(request, len(chain) - start):
            tiers.start_prefetch(request.request_id, chain[start:])

    def _check_new_id(self, request_id: str) -> None:
        if request_id in self._groups or request_id in self.beams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")

    def add_beam_search_request(
        self, request_id: str, prompt: PromptInput, params: BeamSearchParams
    ) -> None:
        """Queue a beam search; its result comes from ``pop_beam_search_output`` once done."""
        self._check_new_id(request_id)
        _, ids = tokenize_prompt(self.tokenizer, self.loaded.config.vocab_size, prompt)
        self.scheduler.check_fits(len(ids), params.max_tokens)
        bs = self.kv.block_size
        worst = self.kv.num_blocks_for(len(ids)) + params.beam_width * (params.max_tokens // bs + 2)
        if worst > self.kv.pool.num_blocks:
            raise PromptTooLongError(
                f"beam search of width {params.beam_width} may need {worst} KV blocks "
                f"(shared prompt + one tail per beam); the pool has {self.kv.pool.num_blocks}",
                "beam_width",
            )
        self.beams.add(request_id, ids, params, tuple(self.tokenizer.eos_token_ids))

    def pop_beam_search_output(self, request_id: str) -> BeamSearchOutput | None:
        return self._beam_results.pop(request_id, None)

    def abort_request(self, request_id: str) -> bool:
        """End a request wherever it is, releasing its blocks now. False if unknown or done."""
        if self.beams.abort(request_id):
            return True
        group = self._groups.get(request_id)
        if group is None or group.finished:
            return False
        for branch in group.branches:
            self._finish(branch, RequestStatus.FINISHED_ABORTED)
        self._forget(group)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups) or len(self.beams) > 0

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no request holds (device and host pools; the storage tier
        keeps its copies). Returns how many; blocks in use stay. A benchmark calls this so a
        repeated pass does not hit the previous pass's prompts."""
        num = self.kv.reset_prefix_cache()
        if self.kv_events is not None:
            self.kv_events.publish()
        return num

    # ---- one step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, execute, update; returns an output for every group that changed."""
        if self.tiers is not None:
            for request_id in self.tiers.poll():
                self.scheduler.load_done(request_id)
        plan = self.scheduler.schedule()
        if self.config.check_invariants:
            invariants.check_manager(self.kv)
            invariants.check_plan(self.kv, plan)
        if self.sanitizer is not None:
            self.sanitizer.before_execute(plan)
        if self.tiers is not None:
            self.tiers.apply(plan.transfers)
            if plan.is_empty and self.scheduler.loading:
                self.tiers.wait(0.005)  # nothing to run until a prefetch lands: nap, not spin
        masks = self.structured.masks(plan.scheduled) if len(self.structured) else None
        scoring = self._track_scheduled(plan)
        sampled = self.runner.execute(plan, masks, scoring)
        if self.sanitizer is not None:
            self.sanitizer.after_execute(plan)
        for rid, chunk in self.runner.take_prompt_logprobs().items():
            scores = self._branch_of[rid][0].prompt_scores
            if scores is not None:
                scores.add(chunk)
        failed = self._end_non_finite(sampled)
        failed |= self._end_prompt_only(sampled)
        finished = self.scheduler.update(
            plan,
            {rid: s.token_id for rid, s in sampled.items() if rid not in failed},
            {rid: s.verified for rid, s in sampled.items() if s.verified},
        )
        changed = self._deliver(sampled, failed, {r.request_id for r in finished})
        for beam_output in self.beams.finish_ready():
            self._beam_results[beam_output.request_id] = beam_output
        outputs = [g.to_output() for g in changed.values()]
        if self.kv_events is not None:  # after the frees: finished requests' blocks stay cached
            self.kv_events.publish()
        for group in changed.values():
            if group.finished:
                self._forget(group)
        if self.config.check_invariants:
            invariants.check_manager(self.kv)
        return outputs

    def _deliver(
        self, sampled: dict[str, SampledToken], failed: set[str], done: set[str]
    ) -> dict[str, RequestGroup]:
        """Hand each sampled token to its beam or branch (detokenize, stop strings, grammar);
        ``done``: requests the scheduler finished. Returns the groups that changed."""
        changed: dict[str, RequestGroup] = {}
        now = time.monotonic()
        for rid, token in sampled.items():
            if self.beams.owns(rid):
                self.beams.report(rid, token.top_logprobs or [])
                continue
            group, branch = self._branch_of[rid]
            changed[group.request_id] = group
            group.on_tokens(now, token.non_finite)
            if rid in failed:
                continue
            if token.verified:  # a drafted decode: the tokens it kept, one by one
                new = branch.request.output_token_ids[len(branch.output.token_ids) :]
                for i, token_id in enumerate(new):
                    last = i == len(new) - 1
                    if branch.on_token(SampledToken(token_id, None, None), last and rid in done):
                        self._finish(branch, RequestStatus.FINISHED_STOPPED)
                        break
            elif branch.on_token(token, rid in done):  # a stop string ended it
                self._finish(branch, RequestStatus.FINISHED_STOPPED)
            unfinished = rid not in done and not branch.output.finished
            if unfinished and self.structured.advance(rid, branch.request.output_token_ids):
                self._finish(branch, RequestStatus.FINISHED_STOPPED)  # its grammar is complete
        return changed

    def _track_scheduled(self, plan: Plan) -> dict[str, int]:
        """Note when each group first runs; the requests whose prompt positions this step
        feeds must be scored, with how many alternatives each (``ModelRunner.execute``)."""
        now = time.monotonic()
        scoring: dict[str, int] = {}
        for entry in plan.scheduled:
            found = self._branch_of.get(entry.request.request_id)
            if found is None:
                continue  # a beam
            group = found[0]
            group.on_scheduled(now)
            num_top = group.needs_prompt_logprobs()
            if num_top is not None:
                scoring[entry.request.request_id] = num_top
        return scoring

    def _end_prompt_only(self, sampled: dict[str, SampledToken]) -> set[str]:
        """End each request with max_tokens=0 that reached its first token (its prompt is
        computed and scored) with finish_reason "length", the token dropped."""
        ended = set()
        for rid in sampled:
            found = self._branch_of.get(rid)
            if found is not None and found[1].request.params.max_tokens == 0:
                self._finish(found[1], RequestStatus.FINISHED_LENGTH)
                ended.add(rid)
        return ended

    def _end_non_finite(self, sampled: dict[str, SampledToken]) -> set[str]:
        """End each request whose logits had no finite maximum with finish_reason "error"
        (its blocks freed now, branches waiting to fork from it too); the batch goes on."""
        failed = {r for r, s in sampled.items() if s.non_finite and not self.beams.owns(r)}
        for rid in failed:
            logger.warning("request %s: non-finite logits; ended with an error", rid)
            group, branch = self._branch_of[rid]
            self._finish(branch, RequestStatus.FINISHED_ABORTED, FINISH_ERROR)
            for other in group.branches:
                if other.output.finish_reason is None and other.request.status.finished:
                    other.output.finish_reason = FINISH_ERROR
        return failed

    def _finish(self, branch: Branch, status: RequestStatus, reason: str | None = None) -> None:
        self.scheduler.finish(branch.request, status)
        if branch.output.finish_reason is None:
            branch.output.finish_reason = reason or FINISH_REASON[status]

    def _forget(self, group: RequestGroup) -> None:
        del self._groups[group.request_id]
        if self.trace is not None:
            for branch in group.branches:  # one line per branch: n branches share the prompt
                request = branch.request
                self.trace.record(
                    group.arrival_time,
                    request.num_prompt_tokens,
                    len(branch.output.token_ids),  # what the user got (a stop string can end
                    # a drafted decode before the tokens the request had already kept)
                    block_hashes_hex(request.prompt_token_ids, request.cache_salt),
                )
        for branch in group.branches:
            rid = branch.request.request_id
            self._branch_of.pop(rid, None)
            self.runner.release(rid)
            self.structured.release(rid)

    def kv_event_sources(self) -> dict[str, dict[str, Any]]:
        """Where this engine publishes KV events (vLLM's GET /kv_event_sources); {} if off."""
        return {} if self.kv_events is None else self.kv_events.sources()

    def close(self) -> None:
        """Finish writing to the storage tier and the trace; let go of the store. Idempotent."""
        if self.kv_events is not None:
            self.kv_events.close()
        if self.tiers is not None:
            self.tiers.close()
        if self.trace is not None:
            self.trace.close()

    # ---- reporting ------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """The engine's counters as a plain dict (the numbers the server exports)."""
        tier_stats = self.tiers.stats if self.tiers is not None else None
        return engine_stats(self.kv, self.scheduler, tier_stats, self.runner, self._block_bytes)

    def block_map(self) -> dict[str, Any]:
        """Every device block's state, ref count, prefix hash and owners (``block_map.py``)."""
        return block_map(self.kv, self.config.block_size)
