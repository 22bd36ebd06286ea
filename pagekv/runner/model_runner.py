"""The model runner: executes a ``Plan`` on the model and the KV tensors. It never decides.

Owns: the device and host KV tensors (``KVCache``), the per-request sampling generators, and
the model. Imports core only for the plan's types; decisions (who runs, which blocks) arrive
as integer block ids in the plan.

One step::

    apply transfers   swap_out, swap_in, copies (copy-on-write before any write)
    build inputs      ids, positions, slots; decode rows first, then prefill chunks (batch.py)
    forward           each layer writes its new K/V by slot, reads history via block tables
                      (the model's attention backend: attention_backends.py)
    sample            logits of the last position of each request that samples   [S, vocab]
                      (a drafted decode: of every position it fed, each checked greedily)
    score             prompt logprobs: logits of the prompt positions a chunk feeds, for the
                      requests that ask (``take_prompt_logprobs``)

Prompt logprobs: position p's logits score prompt token p + 1, so a chunk feeding positions
[start, end) of a P-token prompt scores the rows [start, min(end, P - 1)); the last prompt
position's logits are the first generated token's, sampled and never scored::

    prompt   t0  t1  t2  t3  t4        P = 5, chunks [0, 3) and [3, 5)
    chunk 1  p0  p1  p2                scores t1 t2 t3
    chunk 2              p3  p4        scores t4; p4 samples the first output token
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagekv.core.plan import Plan, ScheduledRequest
from pagekv.kernels import fused_ops, isa, report
from pagekv.models.layer_ops import TORCH_OPS
from pagekv.models.llama import AttentionFn
from pagekv.models.loader import LoadedModel
from pagekv.runner import attention_backends, host_memory
from pagekv.runner.attention_backends import AttentionBackend, AttentionSetup, CpuKernelBackend
from pagekv.runner.batch import StepInputs, prepare_step
from pagekv.runner.kv_cache import KVCache
from pagekv.runner.sampler import Sampler, SamplerOutput, SamplingRow, rank_and_top

logger = logging.getLogger("pagekv")


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None
    # A drafted decode: the token chosen at each position it fed (``token_id`` is the first);
    # the scheduler keeps the drafts these confirm (core.speculation.accept).
    verified: tuple[int, ...] = ()
    # The logits of a row it sampled had no finite maximum (NaN, +inf, nothing drawable): the
    # token means nothing and the engine ends the request with an error.
    non_finite: bool = False
    rank: int | None = None  # the chosen token's rank under the raw logits, with logprobs


@dataclass(frozen=True)
class PromptLogprobsChunk:
    """One step's prompt logprobs of a request: row j scores prompt token
    ``start_position + j + 1`` given the tokens before it (float32 log-softmax of the model's
    logits, as the sampler computes a chosen token's)."""

    start_position: int
    logprobs: list[float]  # the prompt token's
    ranks: list[int]  # its rank (1: the most likely)
    top: list[list[tuple[int, float]]]  # the top-k (token id, logprob), largest first


# Prompt positions scored per LM-head call: bounds the float32 logits of a long chunk.
SCORE_BYTES = 64 * 2**20


PACK_ENV = "PAGEKV_PACKED_WEIGHTS"  # "0": plain weights on the fast path too (for A/B runs)


def quantized_kernels_available() -> bool:
    """Whether a fast runner here multiplies GGUF blocks with the C kernels (else they would
    be dequantized for every matmul)."""
    return fused_ops.load() is not None


class ModelRunner:
    """Owner of the KV tensors and sampler state; ``execute(plan)`` runs one step.

    ``num_threads`` sets torch's intra-op threads (process-wide) when given; the C kernels
    follow ``torch.get_num_threads()``. The C allocator is tuned for the process as well
    (``host_memory``).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        block_size: int,
        num_host_blocks: int = 0,
        *,
        attention: AttentionBackend | None = None,  # None: FAST on the CPU, TRITON on a GPU
        num_threads: int | None = None,
        device: torch.device | str = "cpu",
        int8_activations: bool = False,  # GGUF blocks against int8 rows (FusedOps')
        kv_cache_dtype: str = "auto",  # the KV blocks' dtype: the model's, or int8 (kv_cache.py)
    ) -> None:
        if num_threads is not None:
            if num_threads < 1:
                raise ValueError(f"num_threads must be >= 1, got {num_threads}")
            torch.set_num_threads(num_threads)
        host_memory.keep_freed_memory()  # process-wide too: steps reuse their activations' pages
        cfg = loaded.config
        self.device = torch.device(device)
        if attention is None:
            on_cpu = self.device.type == "cpu"
            attention = AttentionBackend.FAST if on_cpu else AttentionBackend.TRITON
        if self.device.type != "cpu" and attention is AttentionBackend.FAST:
            raise ValueError(f"the {attention.value} attention runs on the CPU only")
        self.model = loaded.model.to(self.device)
        self.dtype = next(loaded.model.parameters(), torch.empty(0, dtype=torch.float32)).dtype
        if attention is AttentionBackend.FAST:
            self._speed_up_model(int8_activations)
        else:  # the model may be shared with a fast runner built earlier (or be on a GPU)
            self.model.use_layer_ops(TORCH_OPS)
        self.block_size = block_size
        shape = (cfg.num_hidden_layers, block_size, cfg.num_key_value_heads, cfg.head_dim)
        pool = functools.partial(KVCache, cfg.num_hidden_layers, kv_dtype=kv_cache_dtype)
        self.kv = pool(num_blocks, *shape[1:], self.dtype, device=self.device)
        self.host_kv = (  # pinned beside a GPU: its copies to and from the device are async
            pool(num_host_blocks, *shape[1:], self.dtype, pinned=self.on_gpu)
            if num_host_blocks > 0
            else None
        )
        self._attention_setup = AttentionSetup(
            kv=self.kv,
            block_size=block_size,
            scale=cfg.attention_scale,
            windows=cfg.layer_windows,
            softcap=cfg.attn_logit_softcapping,
            num_heads=cfg.num_attention_heads,
        )
        self.attention = attention  # builds the backend
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}
        self._prompt_logprobs: dict[str, PromptLogprobsChunk] = {}
        self._vocab_size = cfg.vocab_size
        self.kernels = self._kernels()
        self.system_line = report.line(self.kernels, self.dtype)

    @property
    def attention(self) -> AttentionBackend:
        """Which attention backend runs the steps (``attention_backends``); setting it builds
        that backend for this model."""
        return self.backend.kind

    @attention.setter
    def attention(self, kind: AttentionBackend) -> None:
        self.backend = attention_backends.build(kind, self._attention_setup, self.device)

    def _kernels(self) -> dict[str, str]:
        """Which kernel runs each part of a step here (``kernels.report``)."""
        head_dim = self.kv.k[0].shape[-1]
        if self.on_gpu:
            gpu = report.describe_gpu(self.device, head_dim=head_dim)
            return {**gpu, **report.describe_weights(self.model)}
        backend, target = self.backend, None
        ops = self.model.ops if isinstance(self.model.ops, fused_ops.FusedOps) else None
        first = self.model.packed_weight(0, "qkv_proj")
        decode, prefill = (None, None)
        if isinstance(backend, CpuKernelBackend):
            decode, prefill, target = backend.kernel, backend.prefill_kernel, isa.selected()
        kernels = (decode, prefill, ops)
        info = report.describe(
            target, self.dtype, *kernels, first, head_dim=head_dim, kv_dtype=self.kv.dtype
        )
        return {**info, **report.describe_weights(self.model)}

    def _speed_up_model(self, int8_activations: bool) -> None:
        """The fast path's changes to the model: speed only, numbers within a bf16 ulp (with
        ``int8_activations``, GGUF blocks multiply rows rounded to int8)."""
        ops = fused_ops.load()  # None when disabled (PAGEKV_FUSED_OPS=0) or unavailable
        if ops is not None and int8_activations:
            ops = ops.with_int8_activations()
        if ops is not None and ops.supports(self.dtype):
            self.model.use_layer_ops(ops)  # norms, RoPE, SiLU*up: one C call each
        else:
            logger.debug("fused layer ops not used for %s; torch ops", self.dtype)
            self.model.use_layer_ops(TORCH_OPS)
        if os.environ.get(PACK_ENV, "1") != "0":
            # weights blocked for the ops' matmuls, on 2 MiB pages (room for every parameter's
            # copy: pages no copy is written to are never faulted in)
            params = list(self.model.parameters())
            quantized = [w for _, w in self.model.quantized_weights()]
            room = sum(p.numel() * p.element_size() for p in params)
            room += sum(2 * w.nbytes for w in quantized)  # the stripes take less than twice
            count = len(params) + len(quantized)
            arena = host_memory.HugePageArena(room + count * host_memory.PAGE_BYTES)
            self.model.pack_weights(arena.empty)
            host_memory.return_freed_memory()  # the packing's temporaries

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

    def take_prompt_logprobs(self) -> dict[str, PromptLogprobsChunk]:
        """The prompt logprobs the last ``execute`` computed, by request id; cleared."""
        taken, self._prompt_logprobs = self._prompt_logprobs, {}
        return taken

    @torch.inference_mode()
    def execute(
        self,
        plan: Plan,
        token_masks: Mapping[str, np.ndarray] | None = None,
        prompt_logprobs: Mapping[str, int] | None = None,
    ) -> dict[str, SampledToken]:
        """Run one step; returns the sampled token of every request whose step reached its end.

        ``token_masks``: per constrained request, int32 [positions, ceil(V / 32)], a bit mask of
        the tokens it may draw at each position it samples (``SamplingRow.allowed_tokens``).
        ``prompt_logprobs``: per request to score, how many alternatives; the prompt positions
        its chunk feeds are scored (``take_prompt_logprobs``)."""
        self.apply_transfers(plan)
        self._prompt_logprobs = {}
        if not plan.scheduled:
            return {}
        inputs = prepare_step(plan.scheduled, self.block_size)
        ids, positions = inputs.input_ids.to(self.device), inputs.positions.to(self.device)
        sampling = [i for i, s in enumerate(inputs.order) if s.samples]  # rows of inputs.order
        scoring = _scored_rows(inputs, prompt_logprobs or {})
        if not sampling and not scoring:
            self.model(ids, positions, self._attention_fn(inputs))  # the K/V only
            return {}
        entries = [inputs.order[i] for i in sampling]
        rows: list[int] = []  # flat token rows whose logits are sampled
        sampling_rows: list[SamplingRow] = []  # and how
        for i, entry in zip(sampling, entries, strict=True):
            num_drafts = len(entry.draft_token_ids)  # a drafted decode: every position it fed
            rows.extend(range(inputs.last_token[i] - num_drafts, inputs.last_token[i] + 1))
            masks = None if token_masks is None else token_masks.get(entry.request.request_id)
            sampling_rows.extend(
                self._row(entry, j, None if masks is None else masks[j])
                for j in range(num_drafts + 1)
            )
        scored = [r for score in scoring for r in score.rows]
        # rows ascend, so as many as the step's tokens are all of them (a plain decode step):
        # no index. Otherwise the model's last layer takes the other rows no further than
        # their K/V.
        every_row = not scored and len(rows) == ids.shape[0]
        keep = None if every_row else torch.tensor(rows + scored, device=self.device)
        hidden = self.model(ids, positions, self._attention_fn(inputs), keep)  # [S + R, hidden]
        if scoring:
            self._score_prompts(hidden[len(rows) :], scoring)
        if not rows:
            return {}
        # [S, vocab] in the model's dtype: the sampler widens to float32 only if it must
        logits = self.model.compute_logits(hidden[: len(rows)] if scored else hidden, float32=False)
        out = self.sampler(logits, sampling_rows)
        return self._results(entries, out)

    def _score_prompts(self, hidden: torch.Tensor, scoring: Sequence[_Scoring]) -> None:
        """Prompt logprobs of the scored rows (hidden [R, hidden], in ``scoring``'s order), a
        slice of rows per LM-head call (``SCORE_BYTES`` of float32 logits at most)."""
        vocab_size = self._vocab_size
        per_call = max(1, SCORE_BYTES // (4 * vocab_size))
        offset = 0
        for score in scoring:
            logprobs: list[float] = []
            found: list[tuple[int, list[tuple[int, float]]]] = []
            for lo in range(0, len(score.rows), per_call):
                part = hidden[offset + lo : offset + min(lo + per_call, len(score.rows))]
                logits = self.model.compute_logits(part, float32=False).float()  # [r, vocab]
                log_probs = torch.log_softmax(logits, dim=-1)
                targets = torch.tensor(score.targets[lo : lo + per_call], device=self.device)
                chosen = log_probs.gather(1, targets[:, None])  # [r, 1]
                logprobs.extend(chosen[:, 0].tolist())
                found.extend(rank_and_top(log_probs, chosen, score.num_top))
            offset += len(score.rows)
            self._prompt_logprobs[score.request_id] = PromptLogprobsChunk(
                score.start_position, logprobs, [r for r, _ in found], [t for _, t in found]
            )

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def _attention_fn(self, inputs: StepInputs) -> AttentionFn:
        """The step's per-layer attention, from the model's backend."""
        return self.backend.step(inputs)

    def _row(
        self, entry: ScheduledRequest, ahead: int = 0, allowed: np.ndarray | None = None
    ) -> SamplingRow:
        """How to sample ``entry``'s next token, or (drafts) the one ``ahead`` positions on."""
        request = entry.request
        penalized = request.params.penalized  # the ids are copied only for penalties
        matched = penalized or bool(request.bad_words_token_ids)  # and bad words
        return SamplingRow(
            params=request.params,
            generator=self._generator(request.request_id, request.params.seed),
            num_generated=request.num_output_tokens + ahead,
            eos_token_ids=request.eos_token_ids,
            prompt_token_ids=request.prompt_token_ids if penalized else (),
            # a drafted position's output so far includes the drafts before it
            output_token_ids=(
                request.output_token_ids + list(entry.draft_token_ids[:ahead]) if matched else ()
            ),
            allowed_tokens=allowed,
            bad_words_token_ids=request.bad_words_token_ids,
        )

    @staticmethod
    def _results(
        entries: Sequence[ScheduledRequest], out: SamplerOutput
    ) -> dict[str, SampledToken]:
        results: dict[str, SampledToken] = {}
        row = 0  # the sampler's row of each entry's first sampled position
        for entry in entries:
            num_rows = len(entry.draft_token_ids) + 1
            results[entry.request.request_id] = SampledToken(
                token_id=out.token_ids[row],
                logprob=None if out.logprobs is None else out.logprobs[row],
                top_logprobs=out.top_logprobs[row],
                verified=tuple(out.token_ids[row : row + num_rows]) if num_rows > 1 else (),
                non_finite=any(out.non_finite[row : row + num_rows]),
                rank=None if out.ranks is None else out.ranks[row],
            )
            row += num_rows
        return results


@dataclass(frozen=True)
class _Scoring:
    """One request's prompt rows to score this step."""

    request_id: str
    start_position: int  # the first scored row's position
    rows: list[int]  # flat token rows of the step, ascending
    targets: list[int]  # the prompt token each row scores (the next one)
    num_top: int


def _scored_rows(inputs: StepInputs, num_top: Mapping[str, int]) -> list[_Scoring]:
    """The prompt rows each asking request feeds this step (the module docstring's picture)."""
    if not num_top:
        return []
    scoring = []
    for i, entry in enumerate(inputs.order):
        request = entry.request
        k = num_top.get(request.request_id)
        end = min(entry.end_position, request.num_prompt_tokens - 1)
        if k is None or entry.draft_token_ids or end <= entry.start_position:
            continue
        first_row = inputs.last_token[i] - entry.num_tokens + 1  # the entry's first position
        start = entry.start_position
        scoring.append(
            _Scoring(
                request.request_id,
                start,
                list(range(first_row, first_row + end - start)),
                request.prompt_token_ids[start + 1 : end + 1],
                k,
            )
        )
    return scoring
