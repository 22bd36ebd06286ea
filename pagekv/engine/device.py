"""Where the model runs: the CPU (the default; the C kernels) or a CUDA GPU (Triton kernels).

``auto`` picks CUDA when torch sees a GPU. On a GPU the KV pool takes what
``gpu_memory_utilization`` (vLLM's meaning: the fraction of the device's memory this engine may
use) leaves after the weights, less room for one step's activations.
"""

from __future__ import annotations

import importlib.util

import torch

from pagekv.errors import InvalidRequestError

DEVICES = ("auto", "cpu", "cuda")
ACTIVATION_RESERVE = 1 << 30  # bytes kept free of KV blocks for a step's activations


def resolve_device(name: str) -> torch.device:
    """The device ``name`` (one of DEVICES) means here; a clear error where CUDA is asked for
    and absent."""
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        raise InvalidRequestError(
            f"device 'cuda': torch {torch.__version__} ({build}) sees no CUDA GPU here; "
            "use --device cpu",
            "device",
        )
    if importlib.util.find_spec("triton") is None:
        raise InvalidRequestError("device 'cuda' runs Triton kernels: pip install triton", "device")
    return torch.device("cuda", torch.cuda.current_device())


def gpu_kv_bytes(device: torch.device, utilization: float) -> int:
    """Bytes of KV blocks the device has room for, measured after the weights are on it."""
    free, total = torch.cuda.mem_get_info(device)
    budget = int(total * utilization) - (total - free) - ACTIVATION_RESERVE
    if budget <= 0:
        raise InvalidRequestError(
            f"gpu_memory_utilization {utilization}: {total / 2**30:.1f} GiB x {utilization} "
            f"leaves no room for KV blocks beside the {(total - free) / 2**30:.1f} GiB in use",
            "gpu_memory_utilization",
        )
    return budget
