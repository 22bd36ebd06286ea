"""Which weights an engine loads, and how: the configured model's path (a Hugging Face id
resolved in the local HF cache), its GGUF blocks kept quantized or not, and whether they
multiply int8 activations. Owns nothing: functions of the config, the device and the kernels
available. Refuses a combination that cannot run (``InvalidRequestError`` naming the field)
before any weight is read.
"""

from __future__ import annotations

import os

import torch

from pagekv.engine.config import EngineConfig
from pagekv.errors import InvalidRequestError
from pagekv.models.loader import LoadedModel, load_model, model_path
from pagekv.runner.model_runner import quantized_kernels_available


def load_configured_model(
    config: EngineConfig, dtype: torch.dtype, device: torch.device
) -> LoadedModel:
    """The configured model, its GGUF blocks kept quantized as ``config.quantization`` says
    (on a GPU: dequantized to dtype)."""
    fast = device.type == "cpu" and quantized_kernels_available()
    path = model_path(config.model)  # a Hugging Face id: its file or directory in the HF cache
    directory = os.path.isdir(path)
    if config.quantization == "gguf":
        if directory:
            raise InvalidRequestError(
                f"quantization 'gguf' needs a GGUF file; {path} is a directory",
                "quantization",
            )
        if not fast:
            raise InvalidRequestError(
                "quantization 'gguf' needs the C kernels (CPU only), which are off or "
                "unavailable here (see the kernel build warning, PAGEKV_CPU_ISA and "
                "PAGEKV_FUSED_OPS); use quantization 'none'",
                "quantization",
            )
    keep = config.quantization == "gguf" or (config.quantization == "auto" and fast)
    if config.gguf_activations == "int8" and (directory or not keep):
        raise InvalidRequestError(
            "gguf_activations 'int8' needs a GGUF file's blocks kept quantized (quantization "
            "'gguf', or 'auto' where the C kernels run)",
            "gguf_activations",
        )
    return load_model(path, dtype, keep_quantized=keep, tokenizer=config.tokenizer)


def int8_activations(config: EngineConfig, loaded: LoadedModel, device: torch.device) -> bool:
    """Whether the model's GGUF blocks multiply activations rounded to int8: as
    ``config.gguf_activations`` says; "auto": wherever blocks are kept quantized (on the CPU)."""
    if config.gguf_activations != "auto":
        return config.gguf_activations == "int8"
    return device.type == "cpu" and any(True for _ in loaded.model.quantized_weights())
