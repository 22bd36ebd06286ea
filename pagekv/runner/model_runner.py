"""The model runner: executes a ``Plan`` on the model and the KV tensors. It never decides.

Owns: the device and host KV tensors (``KVCache``), the per-request sampling generators, and
the model. Imports core only for the plan's types; decisions (who runs, which blocks) arrive
as integer block ids in the plan.

One step::

    apply transfers   swap_out, swap_in, copies (copy-on-write before any write)
    build inputs      ids, positions, slots; decode rows first, then prefill chunks (batch.py)
    forward           each layer writes its new K/V by slot, reads history via block tables
                      (fast path: fast_attention.py; the reference: attention.py)
    sample            logits of the last position of each request that samples   [S, vocab]
                      (a drafted decode: of every position it fed, each checked greedily)
"""

from __future__ import annotations

import enum
import functools
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagekv.core.plan import Plan, ScheduledRequest
from pagekv.kernels import decode as cpu_kernel
from pagekv.kernels import fused_ops, isa, report
from pagekv.kernels import prefill as prefill_kernel
from pagekv.kernels.decode import CacheAddresses
from pagekv.models.layer_ops import TORCH_OPS, NativeAttention
from pagekv.models.llama import AttentionFn
from pagekv.models.loader import LoadedModel
from pagekv.runner import host_memory
from pagekv.runner.attention import paged_attention_reference, write_kv
from pagekv.runner.batch import StepInputs, prepare_step, reference_metadata
from pagekv.runner.fast_attention import FastAttention
from pagekv.runner.kv_cache import KVCache
from pagekv.runner.sampler import Sampler, SamplerOutput, SamplingRow

logger = logging.getLogger("pagekv")


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None
    # A drafted decode: the token chosen at each position it fed (``token_id`` is the first);
    # the scheduler keeps the drafts these confirm (core.speculation.accept).
    verified: tuple[int, ...] = ()


PACK_ENV = "PAGEKV_PACKED_WEIGHTS"  # "0": plain weights on the fast path too (for A/B runs)
STACK_ENV = "PAGEKV_LAYER_STACK"  # "0": decode steps layer by layer, never in one C call


def quantized_kernels_available() -> bool:
    """Whether a fast runner here multiplies GGUF blocks with the C kernels (else they would
    be dequantized for every matmul)."""
    return fused_ops.load() is not None


class _StepAttentionFn:
    """A step's ``AttentionFn``, and (``native``) the same attention for C code to call, when
    the decode kernel takes every layer of the step (``FastAttention.native``)."""

    def __init__(self, attend: AttentionFn, native: NativeAttention | None) -> None:
        self._attend = attend
        self.native = native

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        return self._attend(layer, q, k, v)


class AttentionBackend(enum.Enum):
    FAST = "fast"  # decode kernel + prefill kernel (bf16) or SDPA per chunk (fast_attention)
    REFERENCE = "reference"  # paged_attention_reference: the float32 correctness oracle
    # kernels.triton_attention: the GPU runner's (on CPU tensors, in Triton's interpreter)
    TRITON = "triton"


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
        if self.device.type != "cpu" and attention is not AttentionBackend.TRITON:
            raise ValueError(f"the {attention.value} attention runs on the CPU only")
        self.model = loaded.model.to(self.device)
        self.dtype = next(loaded.model.parameters(), torch.empty(0, dtype=torch.float32)).dtype
        if attention is AttentionBackend.FAST:
            self._speed_up_model(int8_activations)
        else:  # the model may be shared with a fast runner built earlier (or be on a GPU)
            self.model.use_layer_ops(TORCH_OPS)
        self.block_size = block_size
        shape = (cfg.num_hidden_layers, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv = KVCache(*shape[:1], num_blocks, *shape[1:], self.dtype, device=self.device)
        self.host_kv = (  # pinned beside a GPU: its copies to and from the device are async
            KVCache(*shape[:1], num_host_blocks, *shape[1:], self.dtype, pinned=self.on_gpu)
            if num_host_blocks > 0
            else None
        )
        self.scale = cfg.attention_scale
        # Per layer: the sliding window (None: all of the history), and the scores' soft cap.
        self.windows, self.softcap = cfg.layer_windows, cfg.attn_logit_softcapping
        self.attention = attention
        self.kernel = cpu_kernel.load() if attention is AttentionBackend.FAST else None
        self.prefill_kernel = prefill_kernel.load() if attention is AttentionBackend.FAST else None
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}
        self.kernels = self._kernels(attention)
        self.system_line = report.line(self.kernels, self.dtype)
        self._cache_addresses = self._stack_addresses(attention)  # None: no layer stack

    def _stack_addresses(self, attention: AttentionBackend) -> CacheAddresses | None:
        """The pool's addresses for C code that runs a decode step's layers and calls the
        decode kernel itself; None where it may not (a layer windowed or capped, no kernel,
        ``PAGEKV_LAYER_STACK=0``)."""
        if not (
            attention is AttentionBackend.FAST
            and self.kernel is not None
            and all(w is None for w in self.windows)
            and self.softcap is None
            and os.environ.get(STACK_ENV, "1") != "0"
        ):
            return None
        return CacheAddresses.of(list(zip(self.kv.k, self.kv.v, strict=True)))

    def _kernels(self, attention: AttentionBackend) -> dict[str, str]:
        """Which kernel runs each part of a step here (``kernels.report``)."""
        head_dim = self.kv.k[0].shape[-1]
        if self.on_gpu:
            gpu = report.describe_gpu(self.device, head_dim=head_dim)
            return {**gpu, **report.describe_weights(self.model)}
        fast = attention is AttentionBackend.FAST
        ops = self.model.ops if isinstance(self.model.ops, fused_ops.FusedOps) else None
        first = self.model.packed_weight(0, "qkv_proj")
        target = isa.selected() if fast else None
        kernels = (self.kernel, self.prefill_kernel, ops)
        info = report.describe(target, self.dtype, *kernels, first, head_dim=head_dim)
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

    @torch.inference_mode()
    def execute(
        self, plan: Plan, token_masks: Mapping[str, np.ndarray] | None = None
    ) -> dict[str, SampledToken]:
        """Run one step; returns the sampled token of every request whose step reached its end.

        ``token_masks``: per constrained request, int32 [positions, ceil(V / 32)], a bit mask of
        the tokens it may draw at each position it samples (``SamplingRow.allowed_tokens``)."""
        self.apply_transfers(plan)
        if not plan.scheduled:
            return {}
        inputs = prepare_step(plan.scheduled, self.block_size)
        ids, positions = inputs.input_ids.to(self.device), inputs.positions.to(self.device)
        sampling = [i for i, s in enumerate(inputs.order) if s.samples]  # rows of inputs.order
        if not sampling:
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
        # rows ascend, so as many as the step's tokens are all of them (a plain decode step):
        # no index. Otherwise the model's last layer takes the other rows no further than
        # their K/V.
        keep = None if len(rows) == ids.shape[0] else torch.tensor(rows, device=self.device)
        hidden = self.model(ids, positions, self._attention_fn(inputs), keep)
        # [S, vocab] in the model's dtype: the sampler widens to float32 only if it must
        logits = self.model.compute_logits(hidden, float32=False)
        out = self.sampler(logits, sampling_rows)
        return self._results(entries, out)

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def _attention_fn(self, inputs: StepInputs) -> AttentionFn:
        """The per-layer attention: write this step's K/V into its slots, then attend. Layers
        with a sliding window or soft-capped scores take the reference attention (the C
        kernels attend to the whole history, uncapped), built once for the step."""
        if self.attention is AttentionBackend.TRITON:
            return self._triton_attention_fn(inputs)
        kv, slots, windows, softcap = self.kv, inputs.slot_mapping, self.windows, self.softcap
        reference_meta = functools.cache(lambda: reference_metadata(inputs, self.block_size))
        fast = FastAttention(inputs.layout, self.scale, self.kernel, self.prefill_kernel)
        kernel = self.kernel
        native = None  # every layer through the decode kernel: C code may call it itself
        if self._cache_addresses is not None:
            num_tokens, heads = inputs.input_ids.shape[0], self.model.config.num_attention_heads
            native = fast.native(self._cache_addresses, slots, num_tokens, heads)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            caches = (kv.k[layer], kv.v[layer])
            if kernel is None or not kernel.write_kv(*caches, k, v, slots):
                write_kv(*caches, k, v, slots)
            window = windows[layer]
            if self.attention is AttentionBackend.FAST and window is None and softcap is None:
                return fast(q, k, v, caches)
            return paged_attention_reference(
                q, *caches, reference_meta(), self.scale, window=window, softcap=softcap
            )

        return _StepAttentionFn(attend, native)

    def _triton_attention_fn(self, inputs: StepInputs) -> AttentionFn:
        """The Triton kernels' attention: the step's metadata on the device once, then per
        layer the slot write and the paged attention (windows and soft caps included)."""
        from pagekv.kernels import triton_attention  # imports triton: only where it runs

        meta = reference_metadata(inputs, self.block_size)
        tables, seq_lens, starts = (
            t.to(self.device, torch.int32)
            for t in (meta.block_tables, meta.seq_lens, meta.query_start_loc)
        )
        slots, kv = meta.slot_mapping.to(self.device), self.kv
        launch = triton_attention.Launch.for_step(meta.max_query_len, meta.max_seq_len)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            caches = (kv.k[layer], kv.v[layer])
            triton_attention.write_kv(*caches, k, v, slots)
            return triton_attention.paged_attention(
                q, *caches, tables, seq_lens, starts, meta.max_query_len, self.scale,
                window=self.windows[layer], softcap=self.softcap, launch=launch,
            )  # fmt: skip

        return attend

    def _row(
        self, entry: ScheduledRequest, ahead: int = 0, allowed: np.ndarray | None = None
    ) -> SamplingRow:
        """How to sample ``entry``'s next token, or (drafts) the one ``ahead`` positions on."""
        request = entry.request
        penalized = request.params.penalized  # the ids are copied only for penalties
        return SamplingRow(
            params=request.params,
            generator=self._generator(request.request_id, request.params.seed),
            num_generated=request.num_output_tokens + ahead,
            eos_token_ids=request.eos_token_ids,
            prompt_token_ids=request.prompt_token_ids if penalized else (),
            # a drafted position's output so far includes the drafts before it
            output_token_ids=(
                request.output_token_ids + list(entry.draft_token_ids[:ahead]) if penalized else ()
            ),
            allowed_tokens=allowed,
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
            )
            row += num_rows
        return results
