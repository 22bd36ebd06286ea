"""Which model architectures pagekv loads, and how: one table, ``ARCHITECTURES``.

Owns the architecture names and what the loaders need to know of each (``Architecture``). A
name is what an HF directory's config.json says as its ``model_type`` and a GGUF file as its
``general.architecture`` (llama.cpp's converter writes the same names); a ``ModelConfig``'s
``model_type`` is always one of them. The table gives, for each name, the module that defines
its ``Architecture`` and the attribute holding it; the module is imported at the first lookup,
so this module imports no torch and nothing of the models, and ``ModelConfig`` checks its
names here.

Adding an architecture: a module defining the model class (or reusing one) and its
``Architecture``, and one line in ``ARCHITECTURES``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pagekv.errors import ModelLoadError


@dataclass(frozen=True)
class GGUFNames:
    """llama.cpp's tensor names -> the Hugging Face names the model's ``load_weights`` takes."""

    model: Mapping[str, str]  # whole-model tensors, e.g. "token_embd.weight"
    layer: Mapping[str, str]  # a layer's, named after "blk.N.", e.g. "attn_q.weight"

    def hf_name(self, gguf_name: str) -> str | None:
        """The HF name of a tensor of the file (None if this architecture has no such one)."""
        if gguf_name in self.model:
            return self.model[gguf_name]
        prefix, _, rest = gguf_name.partition(".")
        layer, _, suffix = rest.partition(".")
        if prefix != "blk" or not layer.isdigit() or suffix not in self.layer:
            return None
        return f"model.layers.{layer}.{self.layer[suffix]}"


@dataclass(frozen=True)
class Architecture:
    """What the loaders need to know of one architecture.

    ``model_class(config, dtype)`` builds the model with its parameters unwritten; it must be a
    ``LlamaForCausalLM`` (or a subclass), the interface the runner drives, and its
    ``load_weights`` takes Hugging Face tensor names (the class owns their mapping onto its
    parameters). ``gguf``: how GGUF files of it name their tensors (None: no GGUF files).
    ``gguf_rope_permuted``: llama.cpp's converter reordered each head's attn_q/attn_k rows for
    interleaved-pair RoPE, to be undone at load. ``gguf_norm_shift``: the converter stored
    every norm weight plus this (Gemma's norms scale by 1 + weight), taken off at load.
    ``hf_attention_bias``: q/k/v have a bias whatever config.json's ``attention_bias`` says.
    ``hf_config_fields(config.json, source)`` and ``gguf_config_fields(metadata, source)``: the
    ``ModelConfig`` fields the architecture reads its own way from config.json or from a GGUF
    file's metadata (keys without the architecture's prefix, "block_count"), replacing the
    common reading's (None: the common reading only).
    """

    model_class: Callable[..., object]
    gguf: GGUFNames | None = None
    gguf_rope_permuted: bool = False
    gguf_norm_shift: float = 0.0
    hf_attention_bias: bool = False
    hf_config_fields: Callable[[Mapping[str, object], str], Mapping[str, Any]] | None = None
    gguf_config_fields: Callable[[Mapping[str, object], str], Mapping[str, Any]] | None = None


# Architecture name -> (module, attribute) of its Architecture, in the order messages list them.
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("pagekv.models.llama_family", "LLAMA"),
    "qwen2": ("pagekv.models.llama_family", "QWEN2"),
    "mistral": ("pagekv.models.llama_family", "MISTRAL"),
    "qwen3": ("pagekv.models.qwen3", "QWEN3"),
    "phi3": ("pagekv.models.phi3", "PHI3"),
    "gemma2": ("pagekv.models.gemma", "GEMMA2"),
    "gemma3_text": ("pagekv.models.gemma", "GEMMA3"),
    "gemma3": ("pagekv.models.gemma", "GEMMA3"),  # what GGUF files of Gemma 3 say
}


def architecture_names() -> tuple[str, ...]:
    """Every registered name (imports nothing)."""
    return tuple(ARCHITECTURES)


def gguf_architecture_names() -> tuple[str, ...]:
    """The names GGUF files may say (imports every registered module)."""
    return tuple(name for name in ARCHITECTURES if _lookup(name).gguf is not None)


def architecture(name: object, source: str) -> Architecture:
    """The registered architecture ``name``; ModelLoadError naming ``source`` and the
    supported names otherwise."""
    if not isinstance(name, str) or name not in ARCHITECTURES:
        raise ModelLoadError(
            f"{source}: unsupported architecture {name!r}; supported: {architecture_names()}"
        )
    return _lookup(name)


def gguf_architecture(name: object, source: str) -> Architecture:
    """The registered architecture ``name`` of a GGUF file; ModelLoadError naming ``source``
    and the names GGUF files may say otherwise."""
    found = _lookup(name) if isinstance(name, str) and name in ARCHITECTURES else None
    if found is None or found.gguf is None:
        raise ModelLoadError(
            f"{source}: unsupported GGUF architecture {name!r}; "
            f"supported: {gguf_architecture_names()}"
        )
    return found


def _lookup(name: str) -> Architecture:
    module_name, attribute = ARCHITECTURES[name]
    found = getattr(importlib.import_module(module_name), attribute)
    if not isinstance(found, Architecture):
        raise TypeError(f"{module_name}.{attribute} (architecture {name!r}) is no Architecture")
    return found
