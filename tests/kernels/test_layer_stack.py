"""A decode step's layers in one C call (``LayerOps.run_stack``, fused_ops.cpp's
``decoder_stack_*`` calling decode.cpp's ``step_attention`` for each layer's attention): the
same tokens and the same logprobs, bit for bit, as the layers one by one, on every kernel
target this CPU runs.

The engine serves requests of different lengths that join while others decode, so its steps
are pure decode batches of 1-3 rows (the stack) and steps with prefill chunks (layer by
layer), and each run is compared with one where the stack is never offered. A slot outside
the pool is an error before anything is written, as ``DecodeKernel.write_kv``'s.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pagekv import SamplingParams
from pagekv.core.invariants import check_no_leak
from pagekv.engine import LLMEngine
from pagekv.engine.config import EngineConfig
from pagekv.kernels import fused_ops, isa
from pagekv.kernels.decode import DecodeBatch
from pagekv.models.loader import load_model
from pagekv.runner.attention_backends import CpuKernelBackend
from pagekv.runner.fast_attention import FastAttention

pytestmark = pytest.mark.model

PROMPTS = [
    "The capital of France is",
    "List three colours of the rainbow, then explain why the sky looks blue during the day:",
    "def fibonacci(n):",
]
# (quantization, dtype, gguf_activations): the GGUF blocks exact in float32 and bf16, rounded
# to int8, and the file dequantized to bf16 (the tiles or the bf16 stripes) and to float32
# (the float32 stripes)
CASES = [
    ("gguf", "float32", "dtype"),
    ("gguf", "bfloat16", "dtype"),
    ("gguf", "bfloat16", "int8"),
    ("none", "bfloat16", "dtype"),
    ("none", "float32", "dtype"),
]


def run(engine: LLMEngine) -> list[tuple[list[int], list[float]]]:
    """Greedy outputs with logprobs; the last prompt joins after a few decode steps."""
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=1, ignore_eos=True)
    ids = engine.tokenizer.encode
    for i, prompt in enumerate(PROMPTS[:-1]):
        engine.add_request(f"r{i}", ids(prompt), params)
    outputs: dict[str, Any] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
        steps += 1
        if steps == 4:
            engine.add_request("late", ids(PROMPTS[-1]), params)
    check_no_leak(engine.kv)
    results = []
    for rid in ("r0", "r1", "late"):
        completion = outputs[rid].outputs[0]
        logprobs = [
            entry[token].logprob
            for entry, token in zip(completion.logprobs, completion.token_ids, strict=True)
        ]
        results.append((list(completion.token_ids), logprobs))
    return results


def stack_calls(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Records whether each ``run_stack`` call of the engine's ops ran the stack."""
    ops = engine.runner.model.ops
    assert isinstance(ops, fused_ops.FusedOps)
    calls: list[bool] = []
    original = type(ops).run_stack

    def counted(self: fused_ops.FusedOps, *args: Any) -> torch.Tensor | None:
        out = original(self, *args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(type(ops), "run_stack", counted)
    return calls


def stack_and_layers(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """``run`` with every decode step through the stack, then with the stack never offered."""
    calls = stack_calls(engine, monkeypatch)
    with_stack = run(engine)
    assert calls and all(calls), "the decode steps did not go through the stack"
    with monkeypatch.context() as patch:
        patch.setattr(FastAttention, "native", lambda *args: None)
        calls.clear()
        layer_by_layer = run(engine)
        assert not calls
    return with_stack, layer_by_layer


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_the_stack_gives_the_layers_bits(
    kernel_target: str, case: tuple[str, str, str], gguf_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    quantization, dtype, activations = case
    if fused_ops.load() is None:
        pytest.skip(f"no fused ops on kernel target {kernel_target}")
    block_sizes = [16, 1] if kernel_target == isa.best() else [16]
    for block_size in block_sizes:
        config = EngineConfig(
            model=gguf_path,
            dtype=dtype,
            quantization=quantization,
            gguf_activations=activations,
            block_size=block_size,
            enable_prefix_caching=False,
        )
        with_stack, layer_by_layer = stack_and_layers(LLMEngine(config), monkeypatch)
        for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(
            with_stack, layer_by_layer, strict=True
        ):
            assert tokens == ref_tokens
            assert logprobs == ref_logprobs  # exactly: the same kernels in the same order


BIAS_CASES = [
    ("gguf", "float32", "int8"),
    ("gguf", "float32", "dtype"),
    ("gguf", "bfloat16", "dtype"),
]


@pytest.mark.parametrize("case", BIAS_CASES, ids=["-".join(c) for c in BIAS_CASES])
def test_biases_go_through_the_stack_with_the_layers_bits(
    kernel_target: str, case: tuple[str, str, str], gguf_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """q/k/v and o biases (Qwen2's, and a subclass's) on GGUF weights: the stack adds them
    after its matmuls as the layers add them one by one, so the same bits. (Dense weights with
    a bias go layer by layer: torch's linear adds it.)"""
    quantization, dtype, activations = case
    if fused_ops.load() is None:
        pytest.skip(f"no fused ops on kernel target {kernel_target}")
    torch_dtype = torch.float32 if dtype == "float32" else torch.bfloat16
    loaded = load_model(gguf_path, torch_dtype, keep_quantized=quantization == "gguf")
    generator = torch.Generator().manual_seed(0)
    for layer in loaded.model.layers:
        for name, rows in (
            ("qkv_bias", layer.qkv_proj.shape[0]),
            ("o_bias", layer.o_proj.shape[0]),
        ):
            bias = torch.randn(rows, generator=generator) * 0.5
            setattr(layer, name, torch.nn.Parameter(bias.to(torch_dtype), requires_grad=False))
    config = EngineConfig(
        dtype=dtype,
        quantization=quantization,
        gguf_activations=activations,
        enable_prefix_caching=False,
    )
    with_stack, layer_by_layer = stack_and_layers(LLMEngine(config, loaded), monkeypatch)
    assert with_stack == layer_by_layer
    without = LLMEngine(config, load_model(gguf_path, torch_dtype))
    assert run(without) != with_stack  # the biases change the tokens: they were added


def test_a_slot_outside_the_pool_is_an_error_with_nothing_written(
    kernel_target: str, gguf_path: str
) -> None:
    if fused_ops.load() is None:
        pytest.skip(f"no fused ops on kernel target {kernel_target}")
    engine = LLMEngine(EngineConfig(model=gguf_path, dtype="bfloat16", num_kv_blocks=8))
    runner, model = engine.runner, engine.runner.model
    cfg = model.config
    backend = runner.backend
    assert isinstance(backend, CpuKernelBackend)
    addresses, kernel = backend.cache_addresses, backend.kernel
    assert addresses is not None and kernel is not None
    num_slots = runner.kv.k[0].shape[0] * runner.kv.k[0].shape[1]
    batch = DecodeBatch(
        torch.zeros((1, 1), dtype=torch.int32), torch.ones(1, dtype=torch.int32), max_seq_len=1
    )
    bad = torch.tensor([num_slots], dtype=torch.int64)
    native = kernel.step_attention(
        addresses, bad, batch, cfg.num_attention_heads, cfg.attention_scale
    )
    assert native is not None
    stack = model._stack()
    assert stack is not None
    positions = torch.zeros(1, dtype=torch.int64)
    x = model._embed(torch.tensor([504]))
    cos, sin = model.rope_cos[positions], model.rope_sin[positions]
    heads = (cfg.num_attention_heads, cfg.num_key_value_heads)
    with pytest.raises(ValueError, match="KV slot"):
        model.ops.run_stack(stack, x, cos, sin, cfg.rms_norm_eps, *heads, native)
    assert all(not bool(t.any()) for t in runner.kv.k + runner.kv.v)  # nothing written
    # and the engine serves as before
    out = engine.tokenizer.encode("The capital of France is")
    engine.add_request("after", out, SamplingParams(temperature=0, max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()
    check_no_leak(engine.kv)
