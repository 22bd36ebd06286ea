"""Makes a Python process run as on a CPU with AVX2 + FMA and nothing wider. Benchmarks only.

A directory on PYTHONPATH holding this file puts every Python process of a tree under it, the
processes a program spawns included (``benchmarks/vllm_offline.py --isa avx2`` puts vLLM's
engine and worker processes there). torch's kernel libraries are capped by their documented
variables, and torch reports no AVX-512 or AMX unit, so code that asks torch before choosing its
kernels (vLLM loads ``_C_AVX2`` and its AVX2 attention) chooses what it would on an AVX2-only
CPU.
"""

import os

# torch's kernel libraries, each capped at AVX2 by its own variable
AVX2_CAPS = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}
# what torch answers about the CPU's wider units
WIDER_UNITS = (
    "_is_avx512_supported",
    "_is_avx512_bf16_supported",
    "_is_avx512_vnni_supported",
    "_is_amx_tile_supported",
    "_is_amx_fp16_supported",
)


def _absent() -> bool:
    return False


os.environ.update(AVX2_CAPS)
try:
    import torch
except ImportError:  # a process of the tree without torch has nothing to cap
    pass
else:
    for _name in WIDER_UNITS:
        if hasattr(torch.cpu, _name):
            setattr(torch.cpu, _name, _absent)
