"""The real Gemma 3 270M GGUF (Q4_K_M: Q4_K, Q5_0, Q6_K and Q8_0 blocks, head_dim 256, four
query heads on one kv head, five sliding layers to one global, a 262,144-piece SentencePiece
vocabulary): pagekv reads its shape and tokenizer as transformers does, and its greedy tokens,
blocks kept quantized, equal transformers' float32 run on the same file on every kernel
target on the exact path, with a prompt longer than the sliding window among them; with int8
activations (the default) they agree by the bf16 rule.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from pagekv import SamplingParams
from pagekv.core.invariants import check_no_leak
from pagekv.models.loader import LoadedModel, load_model
from pagekv.runner import attention_backends
from pagekv.runner.fast_attention import FastAttention
from tests.engine.test_engine_golden import _assert_greedy_matches, _greedy_reference, make_llm
from tests.engine.test_engine_golden_int8 import assert_int8_agrees

pytestmark = pytest.mark.model

WINDOW = 512
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<start_of_turn>user\nWhat is the boiling point of water?<end_of_turn>\n<start_of_turn>model\n",
    # past the sliding window: the local layers see only its last 512 positions
    "Count with me: " + ", ".join(str(i) for i in range(1, 200)),
]
TEXTS = [
    *PROMPTS,
    "  two  spaces\tand a tab\n\nand newlines",
    "émoji 🤖, 中文 and テスト",
    "   leading spaces and " + "x" * 40,
]


@pytest.fixture(scope="module")
def gemma(gemma3_path: str) -> LoadedModel:
    return load_model(gemma3_path, keep_quantized=True)


@pytest.fixture(scope="module")
def hf_reference(gemma3_path: str, gemma: LoadedModel) -> list[Any]:
    import transformers

    path = Path(gemma3_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype="float32"
    ).eval()
    return [_greedy_reference(model, gemma.tokenizer.encode(p)) for p in PROMPTS]


def test_the_file_reads_as_gemma3(gemma: LoadedModel) -> None:
    config = gemma.config
    assert (config.model_type, config.head_dim, config.vocab_size) == ("gemma3", 256, 262144)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 1)
    assert config.layer_windows == tuple(None if i % 6 == 5 else WINDOW for i in range(18))
    assert (config.rope_theta, config.rope_local_theta) == (1_000_000.0, 10_000.0)
    assert config.attention_scale == 256**-0.5 and config.tie_word_embeddings
    # the norms as the model takes them (the file stores 1 + w): near zero, not near one
    norm = gemma.model.layers[0].input_layernorm.float()
    assert abs(float(norm.mean())) < 0.5 * float(norm.abs().max())
    assert len(gemma.tokenizer.encode(PROMPTS[-1])) > WINDOW


def test_tokenizer_equals_transformers(gemma3_path: str, gemma: LoadedModel) -> None:
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(gemma3_path), gguf_file=os.path.basename(gemma3_path)
    )
    for text in TEXTS:
        ids = gemma.tokenizer.encode(text)
        assert ids == hf(text)["input_ids"], text
        assert gemma.tokenizer.decode(ids[1:], skip_special_tokens=False) == text


def test_greedy_equals_transformers_on_every_kernel_target(
    gemma: LoadedModel, hf_reference: list[Any], kernel_target: str
) -> None:
    llm = make_llm(gemma, block_size=16, num_kv_blocks=256, gguf_activations="dtype")
    assert llm.engine.runner.kernels["kernel_target"] == kernel_target
    ids = [gemma.tokenizer.encode(p) for p in PROMPTS]
    _assert_greedy_matches(llm, ids, hf_reference)
    check_no_leak(llm.engine.kv)


def test_int8_greedy_near_transformers_on_every_kernel_target(
    gemma: LoadedModel, hf_reference: list[Any], kernel_target: str
) -> None:
    """The default path: every type of the file (Q4_K, Q5_0, Q6_K, Q8_0) multiplies
    activations rounded to int8 by integer dot products."""
    llm = make_llm(gemma, block_size=16, num_kv_blocks=256)
    assert_int8_agrees(llm, [gemma.tokenizer.encode(p) for p in PROMPTS], hf_reference)


def test_sliding_layers_take_the_kernels_while_the_window_covers_every_sequence(
    gemma: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A window at least as long as every sequence of a step cuts nothing off: the sliding
    layers then run on the kernels like the global ones; past it, on the reference (which
    reads only the window)."""
    calls: Counter[str] = Counter()
    fast, reference = FastAttention.__call__, attention_backends.paged_attention_reference

    def fast_counted(*args: Any, **kwargs: Any) -> Any:
        calls["fast"] += 1
        return fast(*args, **kwargs)

    def reference_counted(*args: Any, **kwargs: Any) -> Any:
        calls["reference"] += 1
        return reference(*args, **kwargs)

    monkeypatch.setattr(FastAttention, "__call__", fast_counted)
    monkeypatch.setattr(attention_backends, "paged_attention_reference", reference_counted)
    llm = make_llm(gemma, block_size=16, num_kv_blocks=256)
    layers, steps = gemma.config.num_hidden_layers, 3
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    short, long = (gemma.tokenizer.encode(p) for p in (PROMPTS[0], PROMPTS[-1]))
    llm.generate([{"prompt_token_ids": short}], params, use_tqdm=False)
    assert calls == {"fast": layers * steps}
    calls.clear()
    llm.generate([{"prompt_token_ids": long}], params, use_tqdm=False)
    sliding = sum(w is not None for w in gemma.config.layer_windows)
    assert calls == {"fast": (layers - sliding) * steps, "reference": sliding * steps}
