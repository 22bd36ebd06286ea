"""The structs that cross the kernels' ABI by address, as ``ctypes.Structure`` mirrors of their
one declaration in ``csrc/kernels.h``: field by field, in order. ``tests/kernels/test_abi.py``
holds each mirror equal to the header's declaration (``build.structs``) and to the layout the
compiler gives it, so the two sides cannot drift.

A pointer field is an address (``c_void_p``, as pointer parameters are); the object it points
to must outlive every call that reads it, which is the owner's business (``PackedQuant``,
``Stack``, ``DecodeKernel.native``).

Imports nothing of pagekv, and no torch.
"""

from __future__ import annotations

import ctypes


class StepAttention(ctypes.Structure):
    """A decode step's attention as a layer stack calls it, layer after layer
    (``step_attention``): one query token per sequence, the whole of each history."""

    _fields_ = [
        ("caches", ctypes.c_void_p),  # int64 [layers, 2]: each layer's K and V cache addresses
        ("scales", ctypes.c_void_p),  # int64 [layers, 2]: their scales' (8-bit caches), or null
        ("slots", ctypes.c_void_p),  # int64 [num_seqs]: where this step's K/V rows go
        ("tables", ctypes.c_void_p),  # int32 [num_seqs, table_stride]
        ("seq_lens", ctypes.c_void_p),  # int32 [num_seqs]
        ("num_slots", ctypes.c_int64),
        ("row_bytes", ctypes.c_int64),
        ("num_seqs", ctypes.c_int32),
        ("table_stride", ctypes.c_int32),
        ("num_heads", ctypes.c_int32),
        ("kv_heads", ctypes.c_int32),
        ("block_size", ctypes.c_int32),
        ("max_seq_len", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("bf16", ctypes.c_int32),
        ("threads", ctypes.c_int32),
        ("kv_format", ctypes.c_int32),  # KvFormat: 0 the activations' type, 1 int8, 2 fp8
        ("scale", ctypes.c_float),
    ]


class QuantRun(ctypes.Structure):
    """One format's output columns [first, first + columns) of a GGUF weight in quantized
    stripes, from byte ``offset`` of the weight's stripes."""

    _fields_ = [
        ("bits", ctypes.c_long),
        ("group", ctypes.c_long),
        ("superblock", ctypes.c_long),
        ("offsets", ctypes.c_long),
        ("zero", ctypes.c_long),
        ("first", ctypes.c_long),
        ("columns", ctypes.c_long),
        ("offset", ctypes.c_long),
    ]


class QuantWeight(ctypes.Structure):
    """A GGUF weight in quantized stripes: ``num_runs`` QuantRun at ``runs``, the stripes, and
    whether its matmuls multiply int8 activations by integer dot products (``dots``)."""

    _fields_ = [
        ("runs", ctypes.c_void_p),
        ("num_runs", ctypes.c_long),
        ("stripes", ctypes.c_void_p),
        ("dots", ctypes.c_long),
    ]


class StackMatmul(ctypes.Structure):
    """A matmul of a layer stack: a QuantWeight's address (``quant``), or a dense weight's tiles
    or stripes (``packed``) and what multiplies the tiles (``unit``); its bias's address or
    None (``bias``)."""

    _fields_ = [
        ("quant", ctypes.c_void_p),
        ("packed", ctypes.c_void_p),
        ("unit", ctypes.c_long),
        ("bias", ctypes.c_void_p),
    ]


class StackLayer(ctypes.Structure):
    """One layer of a layer stack (``decoder_stack_*``): its norms' addresses and matmuls."""

    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("qkv", StackMatmul),
        ("post_norm", ctypes.c_void_p),
        ("o", StackMatmul),
        ("gate_up", StackMatmul),
        ("down", StackMatmul),
    ]

    @property
    def matmuls(self) -> tuple[StackMatmul, StackMatmul, StackMatmul, StackMatmul]:
        return (self.qkv, self.o, self.gate_up, self.down)


# Every mirror, one per struct of kernels.h.
MIRRORS: tuple[type[ctypes.Structure], ...] = (
    StepAttention,
    QuantRun,
    QuantWeight,
    StackMatmul,
    StackLayer,
)
