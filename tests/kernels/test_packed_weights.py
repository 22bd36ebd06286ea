"""oneDNN-prepacked weights (``LlamaForCausalLM.pack_weights``) change speed, not numbers (bf16), or
only their float32 rounding."""

from __future__ import annotations

import pytest
import torch

from pagekv.models import LlamaForCausalLM
from pagekv.models.layer_ops import PACKED_MAX_ROWS, pack
from pagekv.models.llama import LlamaDecoderLayer, _slice
from tests.models.test_models import _tiny_config
from tests.models_fixtures import sdpa_attention

needs_packing = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(),  # type: ignore[no-untyped-call]
    reason="this torch build has no oneDNN",
)
# oneDNN's bf16 kernels need more than AVX2 + FMA; where it has none, pack() declines bf16
needs_bf16_packing = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
    or pack(torch.zeros(32, 32, dtype=torch.bfloat16)) is None,
    reason="oneDNN has no bf16 kernels for this CPU (they need more than AVX2 + FMA)",
)


def _random_model(dtype: torch.dtype, **changes: object) -> LlamaForCausalLM:
    model = LlamaForCausalLM(_tiny_config(**changes), dtype)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model


def _logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), sdpa_attention)
        return model.compute_logits(hidden)  # [T, vocab]


def _layer(model: LlamaForCausalLM) -> LlamaDecoderLayer:
    layer = model.layers[0]
    assert isinstance(layer, LlamaDecoderLayer)
    return layer


@needs_bf16_packing
@pytest.mark.parametrize(
    "changes", [{}, {"attention_bias": True}, {"tie_word_embeddings": False}], ids=str
)
@pytest.mark.parametrize("num_tokens", [1, 7, PACKED_MAX_ROWS + 3])
def test_packed_bf16_model_gives_identical_logits(changes: dict, num_tokens: int) -> None:
    model = _random_model(torch.bfloat16, max_position_embeddings=2 * PACKED_MAX_ROWS, **changes)
    ids = [(3 + 17 * i) % 60 for i in range(num_tokens)]
    plain = _logits(model, ids)
    model.pack_weights()
    assert all(p is not None for p in _layer(model).packed.values())
    assert model.packed_head is not None
    torch.testing.assert_close(_logits(model, ids), plain, atol=0, rtol=0)


@needs_packing
def test_loading_weights_drops_stale_packed_copies() -> None:
    model = _random_model(torch.bfloat16)
    model.pack_weights()
    ids = [3, 17, 5, 60, 2]
    # load the same tensors negated: the packed copies would still hold the old ones
    model.load_weights((name, -t) for name, t in _hf_named(model))
    assert _layer(model).packed == {} and model.packed_head is None
    fresh = _random_model(torch.bfloat16)
    fresh.load_weights((name, -t) for name, t in _hf_named(_random_model(torch.bfloat16)))
    torch.testing.assert_close(_logits(model, ids), _logits(fresh, ids), atol=0, rtol=0)


def _hf_named(model: LlamaForCausalLM) -> list[tuple[str, torch.Tensor]]:
    return [
        (name, _slice(module, param, part, model.config).clone())
        for name, (module, param, part) in model._targets().items()
    ]


@needs_packing
def test_packed_float32_model_agrees_within_float32_rounding() -> None:
    """float32: oneDNN's packed kernels instead of MKL's sgemm: other sums, the same math."""
    model = _random_model(torch.float32)
    ids = [(3 + 17 * i) % 60 for i in range(9)]
    plain = _logits(model, ids)
    model.pack_weights()
    assert all(p is not None for p in _layer(model).packed.values())
    packed = _logits(model, ids)
    torch.testing.assert_close(packed, plain, atol=1e-4, rtol=1e-5)
    assert torch.equal(packed.argmax(-1), plain.argmax(-1))
