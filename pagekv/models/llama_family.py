"""The three architectures the Llama-family decoder (llama.py) is: ``LLAMA``, ``QWEN2`` and
``MISTRAL`` (registered in registry.py), and llama.cpp's names for its tensors in a GGUF file,
which the other families' tables extend."""

from __future__ import annotations

from pagekv.models.config import qwen_layer_types
from pagekv.models.llama import LlamaForCausalLM
from pagekv.models.registry import Architecture, GGUFNames

# llama.cpp's names for this decoder's tensors, whichever of its architectures wrote the file.
GGUF_NAMES = GGUFNames(
    model={
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    },
    layer={
        "attn_norm.weight": "input_layernorm.weight",
        "attn_q.weight": "self_attn.q_proj.weight",
        "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight",
        "attn_q.bias": "self_attn.q_proj.bias",
        "attn_k.bias": "self_attn.k_proj.bias",
        "attn_v.bias": "self_attn.v_proj.bias",
        "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight",
        "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
    },
)

# llama.cpp's converter permutes Llama's q/k rows; Qwen2 always has q/k/v bias (its config.json
# does not say so); Mistral's GGUF files call themselves llama, so it has none of its own.
LLAMA = Architecture(LlamaForCausalLM, GGUF_NAMES, gguf_rope_permuted=True)
QWEN2 = Architecture(
    LlamaForCausalLM, GGUF_NAMES, hf_attention_bias=True, hf_config_fields=qwen_layer_types
)
MISTRAL = Architecture(LlamaForCausalLM)
