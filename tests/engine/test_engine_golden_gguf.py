"""Golden test on a GGUF file of every quantized type the kernels take: pagekv's greedy tokens,
with the blocks kept quantized, equal transformers' float32 run on the same file.

The file is written at test time from the default model's weights (``gguf_requantize``), one
type per kind of tensor so that each meets real weights and the fused q/k/v projection has
three types in its rows: attn_q Q4_0, attn_k Q8_0, attn_v Q5_1, attn_output Q4_1, ffn_gate
Q5_0, ffn_up Q4_0, ffn_down Q4_K / Q5_K / Q6_K by layer (the K types need 256-wide rows:
only ffn_down's are), the tied embedding Q8_0 as in the original.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from gguf.constants import GGMLQuantizationType as QT

from pagekv.core.invariants import check_no_leak
from pagekv.models.loader import LoadedModel, load_model
from tests.engine.test_engine_golden import _assert_greedy_matches, _greedy_reference, make_llm
from tests.gguf_requantize import requantize

pytestmark = pytest.mark.model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived",
    "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
]
_BY_KIND = {
    "attn_q": QT.Q4_0,
    "attn_k": QT.Q8_0,
    "attn_v": QT.Q5_1,
    "attn_output": QT.Q4_1,
    "ffn_gate": QT.Q5_0,
    "ffn_up": QT.Q4_0,
}
_DOWN = (QT.Q4_K, QT.Q5_K, QT.Q6_K)


def choose(name: str, shape: tuple[int, ...]) -> QT:
    if len(shape) == 1:
        return QT.F32  # norms
    if name == "token_embd.weight":
        return QT.Q8_0
    _, layer, kind, _ = name.split(".")
    return _DOWN[int(layer) % 3] if kind == "ffn_down" else _BY_KIND[kind]


@pytest.fixture(scope="module")
def mixed_path(gguf_path: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("gguf") / "smollm2-mixed.gguf"
    requantize(gguf_path, str(path), choose)
    return str(path)


@pytest.fixture(scope="module")
def mixed(mixed_path: str) -> LoadedModel:
    return load_model(mixed_path, keep_quantized=True)


def file_reference(gguf_file: str, loaded: LoadedModel, prompts: list[str]) -> list[Any]:
    """transformers' float32 greedy runs of ``prompts`` on a GGUF file (``loaded``: its
    tokenizer)."""
    import transformers

    path = Path(gguf_file)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype="float32"
    ).eval()
    return [_greedy_reference(model, loaded.tokenizer.encode(p)) for p in prompts]


@pytest.fixture(scope="module")
def mixed_reference(mixed_path: str, mixed: LoadedModel) -> list[Any]:
    return file_reference(mixed_path, mixed, PROMPTS)


def test_the_file_has_every_quantized_type(mixed: LoadedModel) -> None:
    types = {s.qtype for _, w in mixed.model.quantized_weights() for s in w.segments}
    assert types == {*_BY_KIND.values(), *_DOWN, QT.Q8_0}
    qkv = dict(mixed.model.quantized_weights())["layers.0.qkv_proj"]
    assert [s.qtype for s in qkv.segments] == [QT.Q4_0, QT.Q8_0, QT.Q5_1]
    assert os.path.getsize(mixed.path) < 120e6


def test_greedy_equals_transformers_on_every_kernel_target(
    mixed: LoadedModel, mixed_reference: list[Any], kernel_target: str
) -> None:
    llm = make_llm(mixed, block_size=16, num_kv_blocks=512, gguf_activations="dtype")
    ids = [mixed.tokenizer.encode(p) for p in PROMPTS]
    _assert_greedy_matches(llm, ids, mixed_reference)
    check_no_leak(llm.engine.kv)
