"""A decode step's layers prepared for one C call (``csrc/fused_ops.cpp``'s ``decoder_stack_*``):
the table of every layer's norm and matmul addresses (kernels.h's ``StackLayer``, one per
layer), the shapes it was made for, and the call.

Owns nothing but that table; which layers qualify and with which matmuls is ``FusedOps``'
choice (``FusedOps.prepare_stack``), the attention the stack calls is the runner's
(``layer_ops.NativeAttention``). Imports nothing from runner/ or core/.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pagekv.kernels import abi
from pagekv.models import layer_ops


@dataclass
class Stack:
    """A model's layers as ``decoder_stack_*`` reads them."""

    function: Any  # the ctypes function
    table: ctypes.Array[abi.StackLayer]
    final_norm: torch.Tensor
    hidden: int
    width: int  # of the fused qkv projection
    q_size: int
    inter: int
    max_rows: int
    unit: int | None  # bf16 tiles: the unit the table says; None for quantized stripes

    @staticmethod
    def build(
        function: Any,
        layers: Sequence[layer_ops.StackLayer],
        matmuls: Sequence[abi.StackMatmul],  # each layer's 4: qkv, o, gate_up, down
        final_norm: torch.Tensor,
        max_rows: int,
        unit: int | None,
    ) -> Stack | None:
        """None where a layer's shapes differ from the first's, or a norm from the final
        norm's."""
        first = layers[0]
        shapes = [tuple(lin.weight.shape) for lin in first.matmuls]
        norms = [final_norm, *(n for layer in layers for n in (layer.input_norm, layer.post_norm))]
        linears = [lin for layer in layers for lin in layer.matmuls]
        if not (
            all(
                n.dtype == final_norm.dtype and n.is_contiguous() and n.shape == final_norm.shape
                for n in norms
            )
            and all(tuple(lin.weight.shape) == shapes[i % 4] for i, lin in enumerate(linears))
        ):
            return None
        rows = []
        for i, layer in enumerate(layers):
            qkv, o_proj, gate_up, down = matmuls[4 * i : 4 * i + 4]
            input_norm, post_norm = layer.input_norm.data_ptr(), layer.post_norm.data_ptr()
            rows.append(abi.StackLayer(input_norm, qkv, post_norm, o_proj, gate_up, down))
        (width, hidden), (_, q_size), _, (_, inter) = shapes
        table = (abi.StackLayer * len(rows))(*rows)
        return Stack(function, table, final_norm, hidden, width, q_size, inter, max_rows, unit)

    def run(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        eps: float,
        num_heads: int,
        num_kv_heads: int,
        attention: layer_ops.NativeAttention,
        *,
        unit: int,
        threads: int,
    ) -> torch.Tensor | None:
        """``LayerOps.run_stack`` on a decode batch of the shapes it was made for; None
        (nothing written) for anything else. ``unit``: the tile unit in use now."""
        rows, half = x.shape[0], cos.shape[-1]
        head_dim = 2 * half
        if not (
            x.dtype == self.final_norm.dtype == attention.dtype
            and x.is_contiguous()
            and x.shape == (rows, self.hidden)
            and 0 < rows <= self.max_rows
            and self.width == (num_heads + 2 * num_kv_heads) * head_dim
            and self.q_size == num_heads * head_dim
            and cos.dtype == sin.dtype == torch.float32
            and cos.shape == sin.shape == (rows, half)
            and cos.is_contiguous()
            and sin.is_contiguous()
        ):
            return None
        if self.unit is not None and self.unit != unit:  # switched since (use_matmul_unit)
            for layer in self.table:
                for matmul in layer.matmuls:
                    matmul.unit = unit
            self.unit = unit
        out = torch.empty_like(x)
        status = self.function(
            ctypes.addressof(self.table),
            len(self.table),
            x.data_ptr(),
            self.final_norm.data_ptr(),
            eps,
            cos.data_ptr(),
            sin.data_ptr(),
            out.data_ptr(),
            rows,
            self.hidden,
            num_heads,
            num_kv_heads,
            head_dim,
            self.inter,
            attention.function,
            attention.context,
            threads,
        )
        if status == 1:
            raise ValueError("layer stack: the step's attention failed (a KV slot out of range)")
        return out if status == 0 else None
