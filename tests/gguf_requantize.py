"""Test support: GGUF files written at test time from the default model's weights, each tensor
quantized to a chosen type, so that every quantized format the kernels take meets real weights.

The ``gguf`` package quantizes the legacy types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1); the K types
(Q4_K, Q5_K, Q6_K) get the plain encoders below: each block's scales from its sub-blocks'
ranges, no search. Their blocks are valid by construction (the tests check them against
``gguf.quants.dequantize``, the reference decoder), and good enough that the model still
speaks; matching llama.cpp's quantizer is not the point.

PYTEST_DONT_REWRITE
"""

from __future__ import annotations

from collections.abc import Callable

import gguf
import numpy as np
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize

QK_K = 256


def _f16(values: np.ndarray) -> np.ndarray:
    """float32 [n] -> the fp16 bytes [n, 2], and the fp16 values as float32 [n, 1]."""
    half = values.astype(np.float16)
    return half.view(np.uint8).reshape(-1, 2), half.astype(np.float32).reshape(-1, 1)


def _k_scales_bytes(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins [n, 8] -> Q4_K/Q5_K's 12 bytes [n, 12]."""
    first = (scales[:, :4] & 63) | ((scales[:, 4:] >> 4) << 6)
    second = (mins[:, :4] & 63) | ((mins[:, 4:] >> 4) << 6)
    rest = (scales[:, 4:] & 15) | ((mins[:, 4:] & 15) << 4)
    return np.concatenate([first, second, rest], axis=1).astype(np.uint8)


def _affine_k(x: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Blocks [n, 256] -> (q [n, 256], the 16 bytes of d, dmin and scales, nothing else)."""
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    low = np.minimum(sub.min(axis=2), 0.0)
    span = (sub.max(axis=2) - low) / levels
    d_bytes, d = _f16(np.maximum(span.max(axis=1), 1e-8) / 63)
    m_bytes, dmin = _f16(np.maximum((-low).max(axis=1), 1e-8) / 63)
    scales = np.clip(np.rint(span / d), 0, 63).astype(np.uint8)
    mins = np.clip(np.rint(-low / dmin), 0, 63).astype(np.uint8)
    step = (d * scales)[:, :, None]
    offset = (dmin * mins)[:, :, None]
    q = np.rint((sub + offset) / np.where(step > 0, step, 1.0))
    q = np.clip(np.where(step > 0, q, 0), 0, levels).astype(np.uint8).reshape(n, QK_K)
    head = np.concatenate([d_bytes, m_bytes, _k_scales_bytes(scales, mins)], axis=1)
    return q, head, step


def _low_nibbles(q: np.ndarray, run: int) -> np.ndarray:
    """q [n, m] -> bytes [n, m / 2]: each run of 2 * run values, the first run in the low
    nibbles and the second in the high ones."""
    n, m = q.shape
    pairs = (q & 15).reshape(n, m // (2 * run), 2, run)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, m // 2).astype(np.uint8)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    q, head, _ = _affine_k(x, 15)
    return np.concatenate([head, _low_nibbles(q, 32)], axis=1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    q, head, _ = _affine_k(x, 31)
    high = (q >> 4).reshape(-1, 8, 32)  # bit b of byte j: value 32 b + j
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for b in range(8):
        qh |= (high[:, b] << b).astype(np.uint8)
    return np.concatenate([head, qh, _low_nibbles(q, 32)], axis=1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    scale = np.abs(sub).max(axis=2) / 31
    d_bytes, d = _f16(np.maximum(scale.max(axis=1), 1e-8) / 127)
    scales = np.clip(np.rint(scale / d), -128, 127).astype(np.int8)
    step = (d * scales.astype(np.float32))[:, :, None]
    q = np.rint(sub / np.where(step != 0, step, 1.0)) + 32
    q = np.clip(np.where(step != 0, q, 32), 0, 63).astype(np.uint8).reshape(n, QK_K)
    ql = _low_nibbles(q, 64)
    high = (q >> 4).reshape(n, 2, 4, 32)  # half h, field s: values 128 h + 32 s + j
    qh = np.zeros((n, 2, 32), dtype=np.uint8)
    for s in range(4):
        qh |= (high[:, :, s] << (2 * s)).astype(np.uint8)
    return np.concatenate([ql, qh.reshape(n, 64), scales.view(np.uint8), d_bytes], axis=1)


_K_ENCODERS: dict[QT, Callable[[np.ndarray], np.ndarray]] = {
    QT.Q4_K: quantize_q4_k,
    QT.Q5_K: quantize_q5_k,
    QT.Q6_K: quantize_q6_k,
}


def random_blocks(qtype: QT, rows: int, width: int, seed: int = 0) -> np.ndarray:
    """Valid blocks of ``qtype`` that encode nothing: random bytes, every fp16 field (by the
    reference decoder, the ones it reads as scales) set to a small finite value."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * width // block_size, type_size), dtype=np.uint8)
    for at in _F16_FIELDS[qtype]:
        scales = rng.normal(0, 0.01, size=len(blocks)).astype(np.float16)
        blocks[:, at : at + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


# Byte offsets of each type's fp16 fields in a block.
_F16_FIELDS = {
    QT.Q8_0: (0,),
    QT.Q4_0: (0,),
    QT.Q5_0: (0,),
    QT.Q4_1: (0, 2),
    QT.Q5_1: (0, 2),
    QT.Q4_K: (0, 2),
    QT.Q5_K: (0, 2),
    QT.Q6_K: (208,),
    QT.Q2_K: (80, 82),
    QT.Q3_K: (108,),
}


def quantize_any(values: np.ndarray, qtype: QT) -> np.ndarray:
    """float32 [rows, width] -> the blocks of ``qtype``, uint8 [rows, bytes per row]; a type
    with no encoder here (Q2_K, Q3_K) gets ``random_blocks``."""
    if qtype in (QT.Q2_K, QT.Q3_K):
        return random_blocks(qtype, *values.shape)
    encoder = _K_ENCODERS.get(qtype)
    if encoder is None:
        return quantize(values, qtype)
    rows, width = values.shape
    blocks = encoder(values.reshape(rows * width // QK_K, QK_K).astype(np.float32))
    return blocks.reshape(rows, -1)


def requantize(source: str, target: str, choose: Callable[[str, tuple[int, ...]], QT]) -> None:
    """Write ``target``: ``source``'s metadata, and each tensor dequantized then quantized to
    ``choose(name, shape)`` (F32 keeps it float32)."""
    reader = gguf.GGUFReader(source)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(target, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    for tensor in reader.tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # numpy order
        values = dequantize(tensor.data, tensor.tensor_type).reshape(shape).astype(np.float32)
        qtype = choose(tensor.name, shape)
        if qtype == QT.F32:
            writer.add_tensor(tensor.name, values)
            continue
        blocks = quantize_any(values.reshape(-1, shape[-1]), qtype)
        writer.add_tensor(tensor.name, blocks.reshape(*shape[:-1], -1), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
