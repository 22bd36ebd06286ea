"""Llama-family models for pagekv: definitions, weight loading (GGUF, HF safetensors), tokenizer.

Layout (arrows point down; nothing here imports runner/, core/ or server/):

    loader        load_model(path) -> LoadedModel(config, model, tokenizer, path, fingerprint);
                  read_config(path) -> ModelConfig, weights unread
      hub           a Hugging Face id -> its file or directory in the local HF cache, offline
      gguf_loader   GGUF metadata -> ModelConfig; llama.cpp tensor names -> HF names
        gguf_file     GGUF byte layout: metadata, tensor directory, dequantize
      hf_loader     config.json -> ModelConfig; safetensors shards
      tokenizer     Tokenizer (encode/decode/chat template); gguf_tokenizer builds GGUF ones;
                    hf_tokenizer gives it transformers' face (what LLM.get_tokenizer() returns)
        chat_template sandboxed Jinja rendering + message validation
      llama_family  the LLAMA, QWEN2 and MISTRAL architectures; qwen3, phi3 and gemma each
                    define one more (QWEN3, PHI3; Gemma 2 and Gemma 3)
      gemma         Gemma2/3ForCausalLM: a LlamaForCausalLM with Gemma's norms, MLP, RoPE
      quantized     GGUF quant blocks kept for the kernels, decoded exactly
      llama         LlamaForCausalLM: forward(input_ids, positions, attention) -> hidden
        layer_ops     LayerOps (norms, RoPE, SiLU*up): the torch reference, TorchOps; the same
                      ops in C++ are pagekv.kernels.fused_ops, which the runner opts in to
        rope          cos/sin table, rope scaling
        config        ModelConfig (frozen, validated)
          registry    architecture name -> Architecture (model class, GGUF tensor names);
                      the one place an architecture is registered
"""

from pagekv.models.config import ModelConfig
from pagekv.models.llama import AttentionFn, LlamaForCausalLM
from pagekv.models.loader import LoadedModel, default_model_path, load_model, read_config
from pagekv.models.tokenizer import Tokenizer

__all__ = [
    "AttentionFn",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelConfig",
    "Tokenizer",
    "default_model_path",
    "load_model",
    "read_config",
]
