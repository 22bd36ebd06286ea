"""Attention backends: one interface for every way a step's attention runs, one table of them.

A backend is chosen once per model (``ModelRunner(attention=...)``) and built with what it
reads for every step (``AttentionSetup``: the KV cache, the scale, each layer's window and the
scores' soft cap) and the device; it loads its own kernels. Once per step, ``step(inputs)``
builds the step's metadata and returns the per-layer attention the model calls
(``AttentionFn``: write the layer's new K/V into their slots, then attend). Adding a backend
is a class here and one entry in ``BACKENDS``.

Routes (docs/architecture.md has the table with every kernel):

    reference  every layer: paged_attention_reference (float32 torch, windows, soft caps)
    fast       layers that see their whole history (no window, or a window longer than every
               sequence of the step) and no soft cap: FastAttention (C decode, prefill and
               cascade kernels, SDPA where a kernel lacks the shape); the others: reference.
               A decode step whose every layer takes the decode kernel alone also hands the
               C layer stack its attention (``native``).
    triton     every layer: the Triton kernels (GPU, or CPU tensors in the interpreter)

Must not import ``pagekv.core`` (beyond the plan's types via batch) or ``server``.
"""

from __future__ import annotations

import enum
import functools
import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagekv.kernels import decode as decode_kernel
from pagekv.kernels import prefill as prefill_kernel
from pagekv.kernels.decode import CacheAddresses
from pagekv.models.layer_ops import NativeAttention
from pagekv.models.llama import AttentionFn
from pagekv.runner.attention import paged_attention_reference, write_kv
from pagekv.runner.batch import StepInputs, reference_metadata
from pagekv.runner.fast_attention import FastAttention
from pagekv.runner.kv_cache import KVCache

logger = logging.getLogger("pagekv")
STACK_ENV = "PAGEKV_LAYER_STACK"  # "0": decode steps layer by layer, never in one C call


class AttentionBackend(enum.Enum):
    """The backends by name (``BACKENDS`` maps each to its class)."""

    FAST = "fast"  # the CPU kernels: decode, prefill and cascade in C, SDPA where they decline
    REFERENCE = "reference"  # paged_attention_reference: the float32 correctness oracle
    # kernels.triton_attention: the GPU runner's (on CPU tensors, in Triton's interpreter)
    TRITON = "triton"


@dataclass(frozen=True)
class AttentionSetup:
    """What every step's attention reads, fixed for the model's life."""

    kv: KVCache
    block_size: int
    scale: float
    windows: tuple[int | None, ...]  # per layer: its sliding window (None: all of the history)
    softcap: float | None  # the scores' soft cap (Gemma 2), every layer
    num_heads: int


class StepAttention:
    """A step's ``AttentionFn``, and (``native``) the same attention for C code to call, when
    the decode kernel takes every layer of the step (``FastAttention.native``)."""

    def __init__(self, attend: AttentionFn, native: NativeAttention | None = None) -> None:
        self._attend = attend
        self.native = native

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        return self._attend(layer, q, k, v)


class Backend(ABC):
    """One way of running attention: built once per model, ``step`` once per step."""

    kind: AttentionBackend

    def __init__(self, setup: AttentionSetup, device: torch.device) -> None:
        self.setup = setup
        self.device = device

    @abstractmethod
    def step(self, inputs: StepInputs) -> StepAttention:
        """The step's per-layer attention (its metadata built once, here)."""

    def _reference(self, inputs: StepInputs) -> Callable[..., torch.Tensor]:
        """The reference attention of one layer of the step, its metadata built at first use."""
        setup = self.setup
        meta = functools.cache(lambda: reference_metadata(inputs, setup.block_size))

        def attend(layer: int, q: torch.Tensor, caches: tuple[torch.Tensor, ...]) -> torch.Tensor:
            k, v, *scales = caches
            return paged_attention_reference(
                q, k, v, meta(), setup.scale, window=setup.windows[layer], softcap=setup.softcap,
                scales=(scales[0], scales[1]) if scales else None,
            )  # fmt: skip

        return attend


class ReferenceBackend(Backend):
    """paged_attention_reference for every layer, on any device."""

    kind = AttentionBackend.REFERENCE

    def step(self, inputs: StepInputs) -> StepAttention:
        kv, slots, reference = self.setup.kv, inputs.slot_mapping, self._reference(inputs)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kv.write(layer, k, v, slots)
            return reference(layer, q, kv.caches(layer))

        return StepAttention(attend)


class CpuKernelBackend(Backend):
    """The CPU kernels (``FastAttention``) for every layer that sees its whole history. Either
    kernel may be None (no compiler, or disabled): FastAttention then keeps torch's ops."""

    kind = AttentionBackend.FAST

    def __init__(self, setup: AttentionSetup, device: torch.device) -> None:
        super().__init__(setup, device)
        if device.type != "cpu":
            raise ValueError("the fast attention runs on the CPU only")
        self.kernel = decode_kernel.load()
        self.prefill_kernel = prefill_kernel.load()
        # The pool's addresses (and an 8-bit pool's scales') for C code that runs a decode
        # step's layers and calls the decode kernel itself; None where it may not (a layer
        # windowed or capped, no kernel, PAGEKV_LAYER_STACK=0).
        self.cache_addresses: CacheAddresses | None = None
        self.scale_addresses: CacheAddresses | None = None
        kv = setup.kv
        if (
            self.kernel is not None
            and all(w is None for w in setup.windows)
            and setup.softcap is None
            and os.environ.get(STACK_ENV, "1") != "0"
        ):
            self.cache_addresses = CacheAddresses.of(list(zip(kv.k, kv.v, strict=True)))
            if kv.quantized:
                self.scale_addresses = CacheAddresses.of(
                    list(zip(kv.k_scale, kv.v_scale, strict=True))
                )

    def step(self, inputs: StepInputs) -> StepAttention:
        setup, kernel, slots = self.setup, self.kernel, inputs.slot_mapping
        fast = FastAttention(inputs.layout, setup.scale, kernel, self.prefill_kernel)
        longest = max(s.start_position + s.num_tokens for s in inputs.order)
        # a window at least as long as every sequence of the step cuts nothing off
        whole = tuple(setup.softcap is None and (w is None or w >= longest) for w in setup.windows)
        reference = self._reference(inputs)
        kv = setup.kv
        native = None  # every layer through the decode kernel: C code may call it itself
        if self.cache_addresses is not None and all(whole):
            native = fast.native(
                self.cache_addresses, slots, inputs.input_ids.shape[0], setup.num_heads,
                self.scale_addresses, kv.activations,
            )  # fmt: skip

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            caches = kv.caches(layer)
            if kv.quantized:  # rounded to 8 bits by C where it takes the tensors, else torch
                if kernel is None or not kernel.quantize_kv(caches, k, v, slots):
                    kv.write(layer, k, v, slots)
            elif kernel is None or not kernel.write_kv(caches[0], caches[1], k, v, slots):
                write_kv(*caches, k, v, slots)
            if whole[layer]:
                return fast(q, k, v, caches)
            return reference(layer, q, caches)

        return StepAttention(attend, native)


class TritonBackend(Backend):
    """The Triton kernels: the step's metadata on the device once, then per layer the slot
    write and the paged attention (windows and soft caps included)."""

    kind = AttentionBackend.TRITON

    def step(self, inputs: StepInputs) -> StepAttention:
        from pagekv.kernels import triton_attention  # imports triton: only where it runs

        setup = self.setup
        meta = reference_metadata(inputs, setup.block_size)
        tables, seq_lens, starts = (
            t.to(self.device, torch.int32)
            for t in (meta.block_tables, meta.seq_lens, meta.query_start_loc)
        )
        slots, kv = meta.slot_mapping.to(self.device), setup.kv
        launch = triton_attention.Launch.for_step(meta.max_query_len, meta.max_seq_len)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            caches, scales = (kv.k[layer], kv.v[layer]), None
            if kv.quantized:  # rounded by torch's ops; the kernel widens and scales the rows
                kv.write(layer, k, v, slots)
                scales = (kv.k_scale[layer], kv.v_scale[layer])
            else:
                triton_attention.write_kv(*caches, k, v, slots)
            return triton_attention.paged_attention(
                q, *caches, tables, seq_lens, starts, meta.max_query_len, setup.scale,
                window=setup.windows[layer], softcap=setup.softcap, launch=launch, scales=scales,
            )  # fmt: skip

        return StepAttention(attend)


# Every backend by name: what ``ModelRunner(attention=...)`` builds.
BACKENDS: dict[AttentionBackend, type[Backend]] = {
    AttentionBackend.REFERENCE: ReferenceBackend,
    AttentionBackend.FAST: CpuKernelBackend,
    AttentionBackend.TRITON: TritonBackend,
}


def build(kind: AttentionBackend, setup: AttentionSetup, device: torch.device) -> Backend:
    """The backend ``kind`` for a model on ``device``."""
    return BACKENDS[kind](setup, device)
