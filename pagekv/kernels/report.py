"""The system-info line: what this CPU has and which kernel runs each part of a step.

llama.cpp's system-info line is the model: a user who wonders why a step is slow reads, at
start-up, the CPU's vector features, the kernel target chosen (``isa``), and for each part of a
step whether a C++ kernel or torch runs it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from pagekv.kernels import build, isa
from pagekv.kernels.quant import PackedQuant
from pagekv.models.layer_ops import OpsLayout, Packed
from pagekv.models.llama import LlamaForCausalLM


def matmul_kind(packed: Packed, unit: str | None) -> str:
    """How a weight copy is multiplied: by its layout (see ``fused_ops.FusedOps.pack``)."""
    if packed is None:
        return "torch"
    if isinstance(packed, OpsLayout):
        return packed.describe()
    if packed.dim() == 4:
        return f"tiles ({unit})"
    if packed.dim() == 3:
        return f"stripes of {packed.shape[-1]}"
    return "oneDNN"


def describe(
    target: str | None,
    dtype: torch.dtype,
    decode: Any,
    prefill: Any,
    fused: Any,
    packed: Packed,
    *,
    head_dim: int,
    kv_dtype: torch.dtype | None = None,
) -> dict[str, str]:
    """The kernels a runner uses for the model's ``dtype``, its KV blocks' ``kv_dtype`` (default:
    the model's; 8-bit: int8, or fp8 bits in uint8) and ``head_dim`` (the same questions
    ``FastAttention`` asks at every step): every value a short phrase, for stats() and the line."""
    kv = kv_dtype or dtype
    decode_ok = decode is not None and decode.supports(kv, head_dim, dtype)
    prefill_ok = prefill is not None and prefill.supports_prefill(dtype, head_dim)  # 8-bit: widened
    info = {
        "cpu": isa.cpu_name(),
        "cpu_features": isa.shown_features(),
        "kernel_target": target or isa.NONE,
        "head_dim": str(head_dim),
        "decode_attention": "C++" if decode_ok else "torch",
        "prefill_attention": "C++" if prefill_ok else "SDPA",
        "layer_ops": "C++" if fused is not None else "torch",
        "matmul": matmul_kind(packed, getattr(fused, "matmul_unit", None)),
    }
    if kv != dtype:
        info["kv_cache_dtype"] = {torch.uint8: "fp8"}.get(kv, str(kv).removeprefix("torch."))
    failed = [
        f"{name} ({target_})" for (name, target_), why in build.outcomes().items() if why != "ok"
    ]
    if failed:
        info["kernel_build_failures"] = ", ".join(sorted(failed))
    return info


def describe_gpu(device: torch.device, *, head_dim: int) -> dict[str, str]:
    """The kernels of a runner on a CUDA GPU: the Triton kernels attend, torch (cuBLAS) runs
    the layers."""
    return {
        "gpu": torch.cuda.get_device_name(device),
        "cuda": str(torch.version.cuda),
        "head_dim": str(head_dim),
        "decode_attention": "Triton",
        "prefill_attention": "Triton",
        "layer_ops": "torch",
        "matmul": "torch",
    }


def describe_weights(model: LlamaForCausalLM) -> dict[str, str]:
    """How the model's weights are kept, and the bytes they take in memory (the copies the
    ops multiply where they made one of their own) and in the file (GGUF blocks only)."""
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    resident = sum(p.numel() * p.element_size() for p in model.parameters())
    types: Counter[str] = Counter()
    blocks, dots = 0, False
    for name, weight in model.quantized_weights():
        types.update(s.qtype.name for s in weight.segments)
        blocks += weight.nbytes
        packed = model.packed_weight_named(name)
        resident += packed.nbytes if isinstance(packed, OpsLayout) else weight.nbytes
        dots = dots or (isinstance(packed, PackedQuant) and packed.dots)
    if not types:
        return {"weights": dtype, "weight_bytes": str(resident)}
    kept = " + ".join(f"{t} x{n}" for t, n in sorted(types.items()))
    kept += ", int8 activations (exact: --gguf-activations dtype)" if dots else ""
    return {"weights": f"GGUF {kept}", "weight_bytes": str(resident), "gguf_bytes": str(blocks)}


def line(info: dict[str, str], dtype: torch.dtype) -> str:
    dtype_name = str(dtype).removeprefix("torch.")
    if "gpu" in info:
        where = f"GPU: {info['gpu']} (CUDA {info['cuda']})"
    else:
        where = f"CPU: {info['cpu']} ({info['cpu_features']})"
        where += f"; kernel target {info['kernel_target']}"
    if "kv_cache_dtype" in info:
        dtype_name += f" (KV blocks {info['kv_cache_dtype']})"
    text = (
        f"{where}; {dtype_name}, head_dim {info['head_dim']}: decode attention "
        f"{info['decode_attention']}, prefill attention {info['prefill_attention']}, "
        f"layer ops {info['layer_ops']}, matmuls {info['matmul']}"
    )
    if "weights" in info:
        text += f"; weights {info['weights']}, {int(info['weight_bytes']) / 1e6:.1f} MB"
        if "gguf_bytes" in info:
            text += f" (GGUF blocks in the file: {int(info['gguf_bytes']) / 1e6:.1f} MB)"
    if "kernel_build_failures" in info:
        text += f"; failed to build: {info['kernel_build_failures']}"
    return text
