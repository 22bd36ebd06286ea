"""GGUF weights kept quantized: the decoders against gguf's reference, the C kernels on every
target against the dequantized weights, the loader, and the engine's choice.

Every weight the kernels multiply must be exactly gguf's dequantized value (``quant_rows``
reads them back from the packed stripes); the matmul is a float32 chain per output, so it
agrees with a float64 product of the dequantized weights to float32 rounding, and a row's
numbers do not depend on its batch.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as QT
from gguf.quants import dequantize

from pagekv.engine import LLMEngine
from pagekv.engine.config import EngineConfig
from pagekv.errors import InvalidRequestError
from pagekv.kernels import fused_ops, isa
from pagekv.kernels.quant import PackedQuant
from pagekv.models import layer_ops
from pagekv.models.layer_ops import Linear
from pagekv.models.loader import LoadedModel, load_model
from pagekv.models.quantized import (
    FORMATS,
    QuantizedWeight,
    Segment,
    decode,
    drop_file_pages,
    reconstruct,
)
from tests.gguf_requantize import quantize_any, random_blocks, requantize

WIDTH = 512  # a multiple of every block size (the K types': 256)


def assert_float32_product(out: torch.Tensor, x: torch.Tensor, dense: torch.Tensor) -> None:
    """out agrees with the float64 product x @ dense^T within the float32 bound of any order
    of its sums: K float32 roundings of magnitude at most |x| @ |dense|^T (two per step where
    the target has no FMA instruction)."""
    exact = x.double() @ dense.double().T
    bound = 2 * x.shape[1] * 2.0**-24 * (x.double().abs() @ dense.double().abs().T)
    assert ((out.double() - exact).abs() <= bound).all()


def quantized(qtypes: list[QT], rows: int, seed: int = 0) -> QuantizedWeight:
    """A weight [rows * len(qtypes), WIDTH] of one segment per type, random blocks."""
    segments = tuple(
        Segment(q, random_blocks(q, rows, WIDTH, seed + i)) for i, q in enumerate(qtypes)
    )
    return QuantizedWeight((rows * len(qtypes), WIDTH), segments)


@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda q: q.name)
def test_decoded_form_is_gguf_dequantization_exactly(qtype: QT) -> None:
    blocks = random_blocks(qtype, 8, WIDTH, seed=1)
    decoded = decode(Segment(qtype, blocks), WIDTH)
    assert decoded.q.max() < 2**decoded.format.bits
    assert np.array_equal(reconstruct(decoded), dequantize(blocks, qtype).reshape(8, WIDTH))


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q5_K, QT.Q6_K], ids=lambda q: q.name)
def test_the_test_encoders_of_k_types_are_close(qtype: QT) -> None:
    """The K encoders that write test files (gguf_requantize) give blocks gguf decodes back
    to the weights within their step."""
    x = np.random.default_rng(2).normal(0, 0.05, size=(16, WIDTH)).astype(np.float32)
    back = dequantize(quantize_any(x, qtype), qtype).reshape(x.shape)
    bits = FORMATS[qtype][0].bits
    assert np.abs(back - x).max() < 2.5 * np.abs(x).max() / 2**bits


@pytest.fixture
def ops(kernel_target: str) -> fused_ops.FusedOps:
    loaded = fused_ops.load(kernel_target)
    assert loaded is not None, f"the fused ops must build for {kernel_target}"
    return loaded


@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda q: q.name)
def test_packed_stripes_hold_gguf_weights_exactly(ops: fused_ops.FusedOps, qtype: QT) -> None:
    weight = quantized([qtype], 64)
    packed = ops.pack(weight)
    assert isinstance(packed, PackedQuant)
    back = ops.packed_rows(packed, torch.arange(64))
    assert back is not None and np.array_equal(back.numpy(), weight.dequantize())


def test_mixed_segments_are_runs_and_multiply_right(ops: fused_ops.FusedOps) -> None:
    """A fused weight of Q4_K, Q4_K, Q6_K, Q8_0 rows: three runs, each into its columns."""
    weight = quantized([QT.Q4_K, QT.Q4_K, QT.Q6_K, QT.Q8_0], 32, seed=3)
    packed = ops.pack(weight)
    assert isinstance(packed, PackedQuant)
    assert [r.columns for r in packed.runs] == [64, 32, 32]
    dense = torch.from_numpy(weight.dequantize())
    x = torch.randn(5, WIDTH)
    assert_float32_product(ops.linear(x, weight, packed, None), x, dense)
    ids = torch.tensor([0, 70, 100, 127, 31])
    back = ops.packed_rows(packed, ids)
    assert back is not None and np.array_equal(back.numpy(), weight.dequantize()[ids.numpy()])
    for bad in (-1, 128):  # outside every run: an error, not another row's numbers
        with pytest.raises(IndexError, match="outside"):
            ops.packed_rows(packed, torch.tensor([3, bad]))


@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda q: q.name)
def test_quantized_matmul_matches_the_dequantized_weights(
    ops: fused_ops.FusedOps, qtype: QT
) -> None:
    weight = quantized([qtype], 64, seed=4)
    packed = ops.pack(weight)
    dense = torch.from_numpy(weight.dequantize())
    x = torch.randn(300, WIDTH)  # several passes and row blocks: the widened stripes
    out = ops.linear(x, weight, packed, None)
    assert_float32_product(out, x, dense)
    for rows in (1, 2, 5, 13):  # a row's numbers do not depend on its batch
        part = ops.linear(x[:rows].contiguous(), weight, packed, None)
        assert torch.equal(part, out[:rows])
    xb = x[:7].bfloat16()
    got = ops.linear(xb, weight, packed, None)
    assert got.dtype == torch.bfloat16
    want = (xb.double() @ dense.double().T).bfloat16()
    assert (got.double() - want.double()).abs().max() <= want.double().abs().max() / 64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda q: q.name)
def test_gated_linear_is_silu_mul_of_linear(
    ops: fused_ops.FusedOps, qtype: QT, dtype: torch.dtype
) -> None:
    """A gated MLP's weight (gate's rows, then up's) in one pass that writes only
    silu(gate) * up: exactly silu_mul of the matmul's output, for one pass of a few rows,
    several passes, and several row blocks."""
    weight = quantized([qtype, qtype], 32, seed=5)
    packed = ops.pack(weight)
    assert isinstance(packed, PackedQuant)
    gen = torch.Generator().manual_seed(5)
    for rows in (1, 2, 3, 7, 13, 241, 300):
        x = torch.randn(rows, WIDTH, generator=gen).to(dtype)
        fused = ops.quant.gated(x, packed, 2)
        if dtype == torch.float32:  # bf16 batches may go to AVX512-BF16's tiles instead
            assert fused is not None, "the kernel declined a gated weight it should take"
        got = ops.gated_linear(x, weight, packed, None)
        want = ops.silu_mul(ops.linear(x, weight, packed, None))
        assert got.shape == (rows, 32) and got.dtype == dtype
        assert torch.equal(got, want), f"{rows} rows: {int((got != want).sum())} values differ"
        assert fused is None or torch.equal(fused, want)


def test_gated_linear_of_mixed_formats_is_the_two_ops(ops: fused_ops.FusedOps) -> None:
    """Gate and up of different formats: the one-pass kernel declines, and the ops one by one
    give the result."""
    weight = quantized([QT.Q4_K, QT.Q6_K], 32, seed=6)
    packed = ops.pack(weight)
    assert isinstance(packed, PackedQuant)
    x = torch.randn(9, WIDTH)
    assert ops.quant.gated(x, packed, 2) is None
    got = ops.gated_linear(x, weight, packed, None)
    assert torch.equal(got, ops.silu_mul(ops.linear(x, weight, packed, None)))


@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda q: q.name)
def test_bf16_batches_match_the_bf16_rounded_weights(ops: fused_ops.FusedOps, qtype: QT) -> None:
    """bf16 activations in batches of 8 rows or more: where the target has AVX512-BF16, the
    stripes dequantized into bf16 tiles (multiplied by AMX where the target has it, in chunks of
    rows: 1,100 rows are more than one), so the product of the rows with the weights rounded to
    bf16 (the dense bf16 path's weights); elsewhere the stripes' float32 weights. Either to the
    output's bf16 rounding and any order of float32 sums; a row's numbers are those of any
    such batch it is in."""
    weight = quantized([qtype], 64, seed=5)
    packed = ops.pack(weight)
    dense = torch.from_numpy(weight.dequantize())
    tiles = ops.dense.tiles_max_rows > 0  # AVX512-BF16
    dense = (dense.bfloat16() if tiles else dense).double()
    x = torch.randn(1100, WIDTH).bfloat16()
    out = ops.linear(x, weight, packed, None)
    assert out.dtype == torch.bfloat16
    exact = x.double() @ dense.T
    sums = 2 * WIDTH * 2.0**-24 * (x.double().abs() @ dense.abs().T)
    assert ((out.double() - exact).abs() <= 2.0**-8 * exact.abs() + sums).all()
    for rows in (8, 13, 64, 1030):
        assert torch.equal(ops.linear(x[:rows].contiguous(), weight, packed, None), out[:rows])


def rounded_to_int8(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the int8 kernels round it (quant_dot.h), float64: per group of 32 inputs
    q = round(x * (127 / max|x|)) (to even; each operation one float32 rounding, in numpy:
    torch's scalar division may take another path), times the scale max|x| / 127."""
    groups = x.float().numpy().reshape(x.shape[0], -1, 32)
    amax = np.abs(groups).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(groups * inverse), -127, 127)
    return torch.from_numpy((q * (amax / np.float32(127))).reshape(x.shape)).double()


@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda q: q.name)
def test_int8_activations_are_the_rounded_rows_product(ops: fused_ops.FusedOps, qtype: QT) -> None:
    """Packed for int8 activations, every format multiplies each row rounded to int8 groups:
    the float64 product of the rounded rows with the exact weights, to float32 rounding, and
    not the unrounded product. A row's numbers do not depend on its batch, float32 or bf16
    activations."""
    int8 = ops.with_int8_activations()
    assert int8.with_int8_activations() is int8 and ops.with_int8_activations() is int8
    weight = quantized([qtype], 64, seed=6)
    packed = int8.pack(weight)
    assert isinstance(packed, PackedQuant) and packed.dots
    dense = torch.from_numpy(weight.dequantize())
    x = torch.randn(37, WIDTH)
    out = int8.linear(x, weight, packed, None)
    assert_float32_product(out, rounded_to_int8(x), dense)
    exact = ops.linear(x, weight, ops.pack(weight), None)
    assert not torch.equal(out, exact)
    for rows in (1, 2, 5):
        assert torch.equal(int8.linear(x[:rows].contiguous(), weight, packed, None), out[:rows])
    xb = x[:9].bfloat16()
    got = int8.linear(xb, weight, packed, None)
    want = (rounded_to_int8(xb) @ dense.double().T).bfloat16()
    assert got.dtype == torch.bfloat16
    assert (got.double() - want.double()).abs().max() <= want.double().abs().max() / 64


def test_rows_that_are_not_whole_stripes_are_not_packed(ops: fused_ops.FusedOps) -> None:
    weight = quantized([QT.Q8_0], ops.stripe_width + ops.stripe_width // 2)
    assert ops.pack(weight) is None
    x = torch.randn(3, WIDTH)  # multiplied anyway: dequantized for the call
    dense = torch.from_numpy(weight.dequantize())
    torch.testing.assert_close(ops.linear(x, weight, None, None), x @ dense.T)


def test_loader_keeps_the_files_blocks(loaded_gguf: LoadedModel, loaded: LoadedModel) -> None:
    weights = dict(loaded_gguf.model.quantized_weights())
    layers = loaded.config.num_hidden_layers
    assert len(weights) == 1 + 4 * layers  # the tied embedding and four matmuls a layer
    assert {s.qtype for w in weights.values() for s in w.segments} == {QT.Q4_1, QT.Q8_0}
    qkv = weights["layers.0.qkv_proj"]
    assert [s.rows for s in qkv.segments] == [576, 192, 192]  # q, k, v
    dense = loaded.model.layers[0].qkv_proj.data.numpy()
    assert np.array_equal(qkv.dequantize(), dense)  # the same numbers, q/k rows unpermuted
    assert sum(w.nbytes for w in weights.values()) < 0.2 * sum(
        p.numel() * 4 for p in loaded.model.parameters()
    )
    assert loaded_gguf.fingerprint != loaded.fingerprint  # their KV may differ in ulps


def test_dropped_file_pages_read_back_the_same(loaded_gguf: LoadedModel) -> None:
    """The runner drops the GGUF file's pages once the weights are packed; the blocks, still
    mapped, read back from the file the same."""
    weights = [w for _, w in loaded_gguf.model.quantized_weights()]
    ids = np.array([0, 7, 49151])
    embeddings = dict(loaded_gguf.model.quantized_weights())["embed_tokens"]
    before = (embeddings.rows(ids), weights[3].dequantize())
    size = Path(loaded_gguf.path).stat().st_size
    assert size // 2 < drop_file_pages(weights) < size  # their whole pages: most of the file
    assert np.array_equal(embeddings.rows(ids), before[0])
    assert np.array_equal(weights[3].dequantize(), before[1])


def test_quantized_model_gives_the_dense_models_logits(
    loaded_gguf: LoadedModel, loaded: LoadedModel
) -> None:
    from tests.models_fixtures import full_logits

    ids = loaded.tokenizer.encode("The capital of France is")
    torch.testing.assert_close(
        full_logits(loaded_gguf.model, ids), full_logits(loaded.model, ids), rtol=0, atol=1e-3
    )


def test_engine_choice_and_its_line(gguf_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """quantization 'auto' keeps the file's blocks where a kernel target is selected (this
    CPU's, or PAGEKV_CPU_ISA's), and dequantizes them where the kernels are off; kept, they
    multiply int8 activations by default, and the line names the flag of the exact path."""
    if isa.selected() is not None:  # the suite's run with PAGEKV_CPU_ISA=none has none
        auto = LLMEngine(EngineConfig(model=gguf_path, num_kv_blocks=64))
        int8 = "GGUF Q4_1 x210 + Q8_0 x1, int8 activations (exact: --gguf-activations dtype)"
        assert auto.runner.kernels["weights"] == int8
        assert f"weights {int8}" in auto.system_line
        # the stripes keep the file's scales as they are: about the file's bytes
        kept, file = auto.runner.kernels["weight_bytes"], auto.runner.kernels["gguf_bytes"]
        assert int(kept) < 1.01 * int(file)
        exact = LLMEngine(EngineConfig(model=gguf_path, num_kv_blocks=64, gguf_activations="dtype"))
        assert exact.runner.kernels["weights"] == "GGUF Q4_1 x210 + Q8_0 x1"
    dense = LLMEngine(EngineConfig(model=gguf_path, num_kv_blocks=64, quantization="none"))
    assert dense.runner.kernels["weights"] == "float32"
    monkeypatch.setenv("PAGEKV_CPU_ISA", "none")  # no kernels: auto dequantizes
    off = LLMEngine(EngineConfig(model=gguf_path, num_kv_blocks=64))
    assert off.runner.kernels["weights"] == "float32"
    with pytest.raises(InvalidRequestError, match="needs the C kernels") as err:
        LLMEngine(EngineConfig(model=gguf_path, num_kv_blocks=64, quantization="gguf"))
    assert err.value.param == "quantization"


def test_bad_quantization_values_are_refused(tmp_path: object) -> None:
    with pytest.raises(InvalidRequestError) as err:
        EngineConfig(quantization="int4")
    assert err.value.param == "quantization"
    with pytest.raises(InvalidRequestError) as err:
        EngineConfig(gguf_activations="int4")
    assert err.value.param == "gguf_activations" and "['auto', 'dtype', 'int8']" in str(err.value)
    for settings in ({"quantization": "none"}, {"model": str(tmp_path)}):
        with pytest.raises(InvalidRequestError) as err:  # nothing would round to int8
            LLMEngine(EngineConfig(gguf_activations="int8", **settings))  # type: ignore[arg-type]
        assert err.value.param == "gguf_activations"
    with pytest.raises(InvalidRequestError, match="needs a GGUF file"):
        LLMEngine(EngineConfig(model=str(tmp_path), quantization="gguf"))


def test_a_type_without_a_kernel_is_dequantized_with_one_line(
    gguf_path: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """ffn_down as Q3_K (no kernel; the only tensors wide enough for a K type): those load
    dequantized, the rest stay blocks, and one warning line names the type and count."""
    path = tmp_path / "q3k.gguf"

    def choose(name: str, shape: tuple[int, ...]) -> QT:
        if len(shape) == 1:
            return QT.F32
        return QT.Q3_K if ".ffn_down." in name else QT.Q8_0

    requantize(gguf_path, str(path), choose)
    with caplog.at_level(logging.WARNING, logger="pagekv"):
        mixed = load_model(str(path), keep_quantized=True)
    lines = [r.getMessage() for r in caplog.records if "dequantized at load" in r.getMessage()]
    assert len(lines) == 1 and "Q3_K x30" in lines[0]
    kept = dict(mixed.model.quantized_weights())
    assert "layers.0.down_proj" not in kept and "layers.0.qkv_proj" in kept
    assert isinstance(mixed.model.layers[0].down_proj, torch.Tensor)
    dense = load_model(str(path))
    from tests.models_fixtures import full_logits

    ids = dense.tokenizer.encode("The capital of France is")
    torch.testing.assert_close(
        full_logits(mixed.model, ids), full_logits(dense.model, ids), rtol=0, atol=1e-3
    )


@pytest.mark.parametrize("int8", [False, True], ids=["exact", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_layer_halves_in_one_call_are_the_ops_one_by_one(
    ops: fused_ops.FusedOps, loaded_gguf: LoadedModel, dtype: torch.dtype, rows: int, int8: bool
) -> None:
    """A decode batch's two layer halves with the file's quantized weights in one C call each
    (float32 or bf16 activations, exact or rounded to int8): exactly the bits of the same ops
    one by one."""
    ops = ops.with_int8_activations() if int8 else ops
    layer = loaded_gguf.model.layers[3]
    cfg = loaded_gguf.config

    def linear(name: str) -> Linear:
        weight = getattr(layer, name)
        return Linear(weight, ops.pack(weight))

    qkv, o_proj, gate_up, down = (
        linear(n) for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    )
    norm_in, norm_post = (
        getattr(layer, n).data.to(dtype) for n in ("input_layernorm", "post_attention_layernorm")
    )
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, cfg.hidden_size, generator=gen).to(dtype)
    residual = torch.randn(rows, cfg.hidden_size, generator=gen).to(dtype)
    angles = torch.arange(rows)[:, None] * 1e-2 * torch.arange(1, cfg.head_dim // 2 + 1)
    cos, sin = torch.cos(angles).float(), torch.sin(angles).float()
    eps, heads = cfg.rms_norm_eps, (cfg.num_attention_heads, cfg.num_key_value_heads)

    def both(attention_inputs: Any, mlp_block: Any) -> list[torch.Tensor]:
        res = residual.clone()
        q, k, v, res = attention_inputs(ops, x, res, norm_in, eps, qkv, cos, sin, *heads)
        attn = (q * 0.5).reshape(rows, -1).contiguous()
        out, res = mlp_block(ops, attn, res, o_proj, norm_post, eps, gate_up, down)
        return [q, k, v, out, res]

    one_by_one = both(layer_ops.attention_inputs, layer_ops.mlp_block)

    def refuse(*args: object) -> None:
        raise AssertionError("the C call declined a decode batch it should take")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layer_ops, "attention_inputs", refuse)
        patch.setattr(layer_ops, "mlp_block", refuse)
        one_call = both(
            lambda ops_, *a: ops_.attention_inputs(*a), lambda ops_, *a: ops_.mlp_block(*a)
        )
    for a, b in zip(one_call, one_by_one, strict=True):
        assert a.dtype == b.dtype == dtype
        assert torch.equal(a, b), f"{int((a != b).sum())} of {a.numel()} values differ"
