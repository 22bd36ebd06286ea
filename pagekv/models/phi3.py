"""Phi-3: the Llama-family decoder with q/k/v and gate/up stored fused in the checkpoint
(``PHI3``, registered in registry.py).

Owns the mapping of its checkpoint names onto llama.py's parameters, which are fused the same
way (``self_attn.qkv_proj``: q, then k, then v; ``mlp.gate_up_proj``: gate, then up), so
loading copies each whole. Its other differences from Llama are refused at load rather than
run wrong: longrope scaling (config.py knows no such rope_scaling type) and partial RoPE
(hf_loader.py, gguf_loader.py). GGUF files name the fused tensors attn_qkv and ffn_up.
"""

from __future__ import annotations

from pagekv.models.llama import _LAYER_PARAMS, LlamaDecoderLayer, LlamaForCausalLM
from pagekv.models.llama_family import GGUF_NAMES
from pagekv.models.registry import Architecture, GGUFNames

_SPLIT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")

# llama.py's layer names, the split projections (and their biases: Phi-3 has none) replaced
# by the fused ones
_PHI3_LAYER_PARAMS = {
    **{name: target for name, target in _LAYER_PARAMS.items() if name.split(".")[1] not in _SPLIT},
    "self_attn.qkv_proj.weight": ("qkv_proj", None),
    "mlp.gate_up_proj.weight": ("gate_up_proj", None),
}


class Phi3DecoderLayer(LlamaDecoderLayer):
    """A Llama layer loaded from fused checkpoint tensors."""

    hf_params = _PHI3_LAYER_PARAMS


class Phi3ForCausalLM(LlamaForCausalLM):
    """The Llama decoder built of Phi-3 layers."""

    layer_class = Phi3DecoderLayer


# llama.cpp's Phi-3 files: fused attn_qkv, and ffn_up holding gate then up; rows as HF's.
GGUF_NAMES_PHI3 = GGUFNames(
    model=GGUF_NAMES.model,
    layer={
        "attn_norm.weight": "input_layernorm.weight",
        "attn_qkv.weight": "self_attn.qkv_proj.weight",
        "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "ffn_up.weight": "mlp.gate_up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
    },
)

PHI3 = Architecture(Phi3ForCausalLM, GGUF_NAMES_PHI3)
