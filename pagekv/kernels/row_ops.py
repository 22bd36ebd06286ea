"""The layer ops on rows in C++ (``csrc/fused_ops.cpp``): RMSNorm (with the residual add),
RoPE with the q/k/v split, and SiLU x up, each one call per layer for float32 and bfloat16
rows, the numbers ``layer_ops.TorchOps`` gives (see ``fused_ops``). ``FusedOps`` adds the
matmuls and the layer halves to these.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from pagekv.kernels.dense import SUFFIXES, by_dtype


def threads() -> int:
    return torch.get_num_threads()  # the engine's thread setting, as the decode kernel's


class RowOps:
    """The row ops of a loaded library; every call checks dtypes, shapes and layout first and
    raises ValueError on a mismatch."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._functions: dict[tuple[str, torch.dtype], Any] = {  # ctypes functions
            (op, dtype): function
            for op in ("add_rms_norm", "split_rope", "silu_mul")
            for dtype, function in by_dtype(library, op).items()
        }

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        return dtype in SUFFIXES

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        _check_rows(x, weight)
        out = torch.empty_like(x)
        fn = self._functions[("add_rms_norm", x.dtype)]
        fn(None, x.data_ptr(), weight.data_ptr(), out.data_ptr(), *x.shape, eps, threads())
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Updates ``residual`` in place and returns it."""
        _check_rows(residual, weight)
        if not (x.is_contiguous() and x.shape == residual.shape and x.dtype == residual.dtype):
            raise ValueError("fused add_rms_norm: x must match the residual")
        out = torch.empty_like(x)
        fn = self._functions[("add_rms_norm", x.dtype)]
        rows, n = residual.shape
        fn(
            x.data_ptr(),
            residual.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            n,
            eps,
            threads(),
        )
        return out, residual

    def split_rope(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        num_tokens, width = qkv.shape
        half = cos.shape[-1]
        head_dim = 2 * half
        if not (
            qkv.dtype in SUFFIXES
            and qkv.stride(1) == 1
            and width == (num_heads + 2 * num_kv_heads) * head_dim
            and cos.dtype == sin.dtype == torch.float32
            and cos.is_contiguous()
            and sin.is_contiguous()
            and cos.shape == sin.shape == (num_tokens, half)
        ):
            raise ValueError("fused split_rope: wrong dtype, shape or layout of its inputs")
        q = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype)
        k = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=qkv.dtype)
        v = torch.empty_like(k)
        fn = self._functions[("split_rope", qkv.dtype)]
        fn(
            qkv.data_ptr(),
            qkv.stride(0),
            q.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            num_tokens,
            num_heads,
            num_kv_heads,
            head_dim,
            threads(),
        )
        return q, k, v

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not (
            gate_up.dtype in SUFFIXES
            and gate_up.is_contiguous()
            and gate_up.dim() == 2
            and gate_up.shape[1] % 2 == 0
        ):
            raise ValueError("fused silu_mul: gate_up must be a contiguous [T, 2 * I]")
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((rows, inter), dtype=gate_up.dtype)
        fn = self._functions[("silu_mul", gate_up.dtype)]
        fn(gate_up.data_ptr(), out.data_ptr(), rows, inter, threads())
        return out


def _check_rows(x: torch.Tensor, weight: torch.Tensor) -> None:
    if not (
        x.dim() == 2
        and x.is_contiguous()
        and weight.is_contiguous()
        and weight.shape == (x.shape[1],)
        and x.dtype == weight.dtype
        and x.dtype in SUFFIXES
    ):
        raise ValueError("fused rms_norm: x must be a contiguous [T, hidden] like its weight")
