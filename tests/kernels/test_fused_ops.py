"""The C layer ops (``kernels/fused_ops.py``) against the torch reference
(``layer_ops.TorchOps``): op by op on random data, through a whole random model, and how the
runner picks them; every test of the fused ops on every kernel target this CPU can run."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from pagekv.kernels import build, fused_ops
from pagekv.models import layer_ops
from pagekv.models.layer_ops import TORCH_OPS, LayerOps, Linear
from pagekv.models.rope import apply_rope
from tests.kernels.test_packed_weights import _logits, _random_model
from tests.models.test_models import _tiny_config

T = TypeVar("T")


def needs_fused(test: T) -> T:
    """A test of the fused ops: run once per kernel target, skipped without a compiler. (Tests
    of torch's numbers and of the fallbacks run once.)"""
    compiler = pytest.mark.skipif(
        build.find_compiler() is None, reason="no C++ compiler: fused ops are optional"
    )
    return compiler(pytest.mark.usefixtures("kernel_target")(test))  # type: ignore[no-any-return]


DTYPES = [torch.float32, torch.bfloat16]
TOKEN_COUNTS = [1, 7, 64, 300]  # 300: enough work to split rows over threads
EPS = 1e-5


def _fused() -> fused_ops.FusedOps:
    """The ops of the test's kernel target."""
    ops = fused_ops.load()
    assert ops is not None, "a compiler is here, so the fused ops must build"
    return ops


def _randn(*shape: int, dtype: torch.dtype, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def assert_matches(got: torch.Tensor, expected: torch.Tensor, exact_bf16: bool = False) -> None:
    """bfloat16: equal, or (unless exact_bf16) within two bf16 ulps at a tiny fraction of
    elements (a norm's sum of squares in another order may flip the rounding of x * rsqrt,
    which the weight then scales: up to two ulps of the product); float32: within 1e-6
    relative."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
        return
    differ = got != expected
    if exact_bf16:
        assert not differ.any(), f"{int(differ.sum())} of {got.numel()} bf16 values differ"
        return
    # one bf16 ulp of x is 2^(exponent(x) - 7): 8 bits of precision
    ulp = torch.ldexp(torch.ones_like(expected.float()), torch.frexp(expected.float()).exponent - 8)
    diff = (got.float() - expected.float()).abs()
    assert bool((diff <= 2 * ulp).all()), f"max difference {float((diff / ulp).max())} ulp"
    assert int(differ.sum()) <= max(1, got.numel() // 1000), f"{int(differ.sum())} differ"


def test_the_comparison_can_fail() -> None:
    x = _randn(64, 32, dtype=torch.bfloat16)
    nudged = x.view(torch.int16).add(1).view(torch.bfloat16)  # every value one ulp away
    with pytest.raises(AssertionError, match="differ"):
        assert_matches(nudged, x)
    y = x.clone()
    y[0, 0] = nudged[0, 0]
    with pytest.raises(AssertionError):
        assert_matches(y, x, exact_bf16=True)
    with pytest.raises(AssertionError):
        assert_matches(x.float() * (1 + 1e-5), x.float())


@needs_fused
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_rms_norm(dtype: torch.dtype, num_tokens: int) -> None:
    x = _randn(num_tokens, 576, dtype=dtype, scale=3.0)
    weight = _randn(576, dtype=dtype, seed=1) * 0.3 + 1
    got = _fused().rms_norm(x, weight, EPS)
    assert_matches(got, TORCH_OPS.rms_norm(x, weight, EPS))


@needs_fused
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_add_rms_norm_updates_the_residual_in_place(dtype: torch.dtype, num_tokens: int) -> None:
    x = _randn(num_tokens, 576, dtype=dtype, scale=2.0)
    residual = _randn(num_tokens, 576, dtype=dtype, seed=1, scale=5.0)
    weight = _randn(576, dtype=dtype, seed=2) * 0.3 + 1
    expected, expected_residual = TORCH_OPS.add_rms_norm(x, residual, weight, EPS)
    passed = residual.clone()
    got, got_residual = _fused().add_rms_norm(x, passed, weight, EPS)
    assert got_residual.data_ptr() == passed.data_ptr()
    torch.testing.assert_close(got_residual, expected_residual, atol=0, rtol=0)  # same sum
    assert_matches(got, expected)


@needs_fused
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 2, 16), (2, 1, 128)], ids=str)
def test_split_rope_is_exact(dtype: torch.dtype, num_tokens: int, heads: tuple) -> None:
    num_heads, num_kv_heads, head_dim = heads
    width = (num_heads + 2 * num_kv_heads) * head_dim
    # a strided view, as the qkv matmul's output may be one
    qkv = _randn(num_tokens, width + 8, dtype=dtype, scale=3.0)[:, :width]
    angles = _randn(num_tokens, head_dim // 2, dtype=torch.float32, seed=1, scale=100.0)
    cos, sin = angles.cos(), angles.sin()
    got = _fused().split_rope(qkv, cos, sin, num_heads, num_kv_heads)
    expected = TORCH_OPS.split_rope(qkv, cos, sin, num_heads, num_kv_heads)
    for g, e in zip(got, expected, strict=True):
        assert g.is_contiguous()
        torch.testing.assert_close(g, e, atol=0, rtol=0)  # same float32 math, same rounding
    q = qkv[:, : num_heads * head_dim].reshape(num_tokens, num_heads, head_dim)
    torch.testing.assert_close(got[0], apply_rope(q, cos, sin), atol=0, rtol=0)


@needs_fused
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_silu_mul(dtype: torch.dtype, num_tokens: int) -> None:
    gate_up = _randn(num_tokens, 2 * 1536, dtype=dtype, scale=4.0)
    gate_up[0, :6] = torch.tensor([-200.0, -90.0, -50.0, 0.0, 50.0, 200.0]).to(dtype)  # exp ends
    assert_matches(_fused().silu_mul(gate_up), TORCH_OPS.silu_mul(gate_up))


@needs_fused
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_threads_do_not_change_a_bit(dtype: torch.dtype) -> None:
    """Prefill-sized calls split rows over threads; every op gives the same bits on one."""
    x = _randn(300, 576, dtype=dtype, scale=2.0)
    residual = _randn(300, 576, dtype=dtype, seed=1, scale=5.0)
    weight = _randn(576, dtype=dtype, seed=2) * 0.3 + 1
    qkv = _randn(300, 15 * 64, dtype=dtype, seed=3, scale=3.0)
    angles = _randn(300, 32, dtype=torch.float32, seed=4, scale=100.0)
    gate_up = _randn(300, 2 * 1536, dtype=dtype, seed=5, scale=4.0)

    def run_all() -> list[torch.Tensor]:
        ops = _fused()
        normed, res = ops.add_rms_norm(x, residual.clone(), weight, EPS)
        q, k, v = ops.split_rope(qkv, angles.cos(), angles.sin(), 9, 3)
        return [normed, res, ops.rms_norm(x, weight, EPS), q, k, v, ops.silu_mul(gate_up)]

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run_all()
        torch.set_num_threads(2)
        two = run_all()
    finally:
        torch.set_num_threads(before)
    for a, b in zip(one, two, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between two bf16 tensors in units in the last place (a sign flip
    counts as a huge distance)."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    return int((ia - ib).abs().max())


@pytest.fixture(params=["amx", "avx512-bf16"])
def matmul_unit(request: pytest.FixtureRequest, kernel_target: str) -> Iterator[str]:
    """The tiled matmul on each unit the target has (tiles, vectors), switched back after."""
    ops = fused_ops.load()
    if ops is None or ops.matmul_unit is None:
        pytest.skip("the tiled matmul needs the avx512bf16 or amx target (and a compiler)")
    default = ops.matmul_unit
    if not ops.use_matmul_unit(request.param):
        pytest.skip(f"no {request.param} on this target")
    yield request.param
    assert ops.use_matmul_unit(default)


needs_tiles = pytest.mark.usefixtures("matmul_unit")


@needs_fused
@needs_tiles
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16, 17, 64, 255, 256])
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (64, 96)], ids=str)
def test_tiled_linear_is_within_a_bf16_ulp_and_batch_invariant(
    rows: int, shape: tuple[int, int]
) -> None:
    """Decode batches of 1-256 rows through the tiles (AMX or vectors): float32 sums rounded
    once, within a bf16 ulp of torch's and of the correctly rounded product; and a row's
    numbers are the same whatever else is in the batch (oneDNN's are not above 32 rows)."""
    n, k = shape
    ops = _fused()
    weight = _randn(n, k, dtype=torch.bfloat16, seed=1) * 0.05
    packed = ops.pack(weight)
    assert packed is not None and packed.shape == (n // 16, k // 32, 16, 32)
    x = _randn(rows, k, dtype=torch.bfloat16)
    got = ops.linear(x, weight, packed, None)
    expected = torch.nn.functional.linear(x, weight)
    assert got.shape == expected.shape and got.dtype == torch.bfloat16
    # One bf16 rounding plus float32 summation error from torch's and from the exact product:
    # an entry near zero after cancellation may be a few of its own ulps away; a misplaced tile
    # is off by O(1). Most entries equal torch's.
    magnitude = x.double().abs() @ weight.double().abs().T
    for reference in (expected.double(), x.double() @ weight.double().T):
        ulp = torch.ldexp(torch.ones_like(reference), torch.frexp(reference).exponent - 8)
        assert bool(((got.double() - reference).abs() <= ulp + 2**-16 * magnitude).all())
    assert int((got != expected).sum()) <= got.numel() // 20
    for part in (slice(0, 1), slice(0, 5), slice(-5, None)):  # one row, the first, the tail
        alone = ops.linear(x[part].contiguous(), weight, packed, None)
        torch.testing.assert_close(got[part], alone, atol=0, rtol=0)


@needs_fused
@needs_tiles
def test_tiled_linear_takes_only_its_shapes() -> None:
    """Weights whose sides are not multiples of 32 keep oneDNN's packing; more than 256 rows, a
    bias, float32 rows, or no tiles go to ``layer_ops.linear`` (bit-identical to torch); tiles
    that do not match the weight are refused before the C side reads them."""
    ops = _fused()
    weight = _randn(64, 576, dtype=torch.bfloat16, seed=1)
    packed = ops.pack(weight)
    assert packed is not None and packed.dim() == 4
    ragged = ops.pack(_randn(48, 576, dtype=torch.bfloat16))
    assert ragged is None or ragged.dim() == 2  # oneDNN's copy, not tiles
    float32 = ops.pack(weight.float())
    assert float32 is None or float32.dim() in (2, 3)  # stripes or oneDNN's: tiles are bf16 only
    for x, bias, tiles in (
        (_randn(257, 576, dtype=torch.bfloat16), None, packed),
        (_randn(8, 576, dtype=torch.bfloat16), weight[:, 0].contiguous(), packed),
        (_randn(2, 576, dtype=torch.bfloat16), None, None),
    ):
        expected = torch.nn.functional.linear(x, weight, bias)
        torch.testing.assert_close(ops.linear(x, weight, tiles, bias), expected, atol=0, rtol=0)
    x32 = _randn(2, 576, dtype=torch.float32)
    w32 = weight.float()
    torch.testing.assert_close(ops.linear(x32, w32, None, None), x32 @ w32.T, atol=0, rtol=0)
    with pytest.raises(ValueError, match="tiles"):
        ops.linear(_randn(8, 576, dtype=torch.bfloat16), weight[:32], packed, None)


@needs_fused
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 12, 13, 64, 121, 241, 300])
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (64, 96)], ids=str)
def test_float32_stripes_are_within_float32_rounding_and_batch_invariant(
    rows: int, shape: tuple[int, int]
) -> None:
    """float32 matmuls of any row count through the stripes: within float32 summation error of
    the exact product, and a row's numbers the same whatever else is in the batch (one chain
    of FMAs per output; the row counts cross every target's passes and row blocks)."""
    n, k = shape
    ops = _fused()
    weight = _randn(n, k, dtype=torch.float32, seed=1) * 0.05
    packed = ops.pack(weight)
    width = ops.stripe_width
    assert packed is not None and packed.shape == (n // width, k, width)
    x = _randn(rows, k, dtype=torch.float32)
    got = ops.linear(x, weight, packed, None)
    exact = x.double() @ weight.double().T
    magnitude = x.double().abs() @ weight.double().abs().T
    assert got.shape == (rows, n) and got.dtype == torch.float32
    assert bool(((got.double() - exact).abs() <= k * 2**-24 * magnitude + 1e-30).all())
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-5)
    for part in (slice(0, 5), slice(rows - 5, rows), slice(rows // 2, rows // 2 + 1)):
        alone = ops.linear(x[part].contiguous(), weight, packed, None)
        torch.testing.assert_close(got[part], alone, atol=0, rtol=0)


@needs_fused
@pytest.mark.parametrize("rows", [1, 5, 7, 64, 257, 300])
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536)], ids=str)
def test_bf16_stripes_are_float32_sums_rounded_once_and_batch_invariant(
    rows: int, shape: tuple[int, int]
) -> None:
    """On targets without tiles, bf16 weights are packed in stripes and widened in registers:
    each output is the float32 FMA chain of the exact bf16 inputs, rounded once to bf16, at
    any row count; a row's numbers do not depend on its batch."""
    n, k = shape
    ops = _fused()
    if ops.matmul_unit is not None:
        pytest.skip("this target multiplies bf16 in tiles")
    weight = _randn(n, k, dtype=torch.bfloat16, seed=1) * 0.05
    packed = ops.pack(weight)
    width = ops.stripe_width
    assert packed is not None and packed.shape == (n // width, k, width)
    assert packed.dtype == torch.bfloat16  # half the bytes of float32
    x = _randn(rows, k, dtype=torch.bfloat16)
    got = ops.linear(x, weight, packed, None)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    float32 = ops.linear(x.float(), weight.float(), ops.pack(weight.float()), None)
    torch.testing.assert_close(got, float32.bfloat16(), atol=0, rtol=0)  # the same sums
    exact = x.double() @ weight.double().T
    magnitude = x.double().abs() @ weight.double().abs().T
    ulp = torch.ldexp(torch.ones_like(exact), torch.frexp(exact).exponent - 8)
    assert bool(((got.double() - exact).abs() <= ulp + k * 2**-24 * magnitude).all())
    for part in (slice(0, 1), slice(rows - 5, rows)):
        alone = ops.linear(x[part].contiguous(), weight, packed, None)
        torch.testing.assert_close(got[part], alone, atol=0, rtol=0)


@needs_fused
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_packed_copies_go_where_the_caller_allocates(dtype: torch.dtype) -> None:
    """Tiles and stripes are written into the tensor ``allocate`` returns (the runner's arena
    on huge pages), the same numbers as a default pack; oneDNN's copies ignore it."""
    ops = _fused()
    weight = _randn(64, 576, dtype=dtype, seed=1)
    given: list[torch.Tensor] = []

    def allocate(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        given.append(torch.full(shape, 7.0, dtype=dtype))
        return given[-1]

    packed = ops.pack(weight, allocate)
    default = ops.pack(weight)
    if packed is None or packed.dim() == 2:  # no tiles or stripes on this CPU
        assert not given
        return
    assert len(given) == 1 and packed.data_ptr() == given[0].data_ptr()
    assert default is not None and torch.equal(packed, default)


@needs_fused
def test_float32_stripes_take_only_their_shapes() -> None:
    """An out side that is not a multiple of the stripe keeps oneDNN's packing; a bias goes to
    ``layer_ops.linear`` (torch's numbers); stripes of another weight or a bf16 x are refused
    before the C side reads them."""
    ops = _fused()
    weight = _randn(64, 576, dtype=torch.float32, seed=1)
    packed = ops.pack(weight)
    assert packed is not None and packed.dim() == 3
    ragged = ops.pack(_randn(2 * ops.stripe_width + 4, 576, dtype=torch.float32))
    assert ragged is None or ragged.dim() == 2
    x = _randn(8, 576, dtype=torch.float32)
    bias = weight[:, 0].contiguous()
    expected = torch.nn.functional.linear(x, weight, bias)
    torch.testing.assert_close(ops.linear(x, weight, packed, bias), expected, atol=0, rtol=0)
    with pytest.raises(ValueError, match="stripes"):
        ops.linear(x, weight[:32], packed, None)
    with pytest.raises(ValueError, match="stripes"):
        ops.linear(x.bfloat16(), weight, packed, None)


def _layer_weights(
    ops: LayerOps, qkv_bias: bool = False, dtype: torch.dtype = torch.bfloat16
) -> dict[str, Any]:
    """One SmolLM2-shaped layer's weights as the ops take them (packed by ``ops``); a bias only
    on q/k/v, as in Qwen2."""

    def projection(out_features: int, in_features: int, seed: int) -> Linear:
        weight = _randn(out_features, in_features, dtype=dtype, seed=seed) * 0.05
        return Linear(weight, ops.pack(weight))

    qkv = projection(960, 576, 3)
    if qkv_bias:
        qkv = qkv._replace(bias=_randn(960, dtype=dtype, seed=9))
    return {
        "norms": [_randn(576, dtype=dtype, seed=s) * 0.3 + 1 for s in (1, 2)],
        "qkv": qkv,
        "o_proj": projection(576, 576, 4),
        "gate_up": projection(3072, 576, 5),
        "down": projection(576, 1536, 6),
    }


class _OneByOne:
    """Some ops, each layer half composed of their single ops (``layer_ops``' functions)."""

    def __init__(self, ops: LayerOps) -> None:
        self.ops = ops

    def attention_inputs(self, *args: Any) -> Any:
        return layer_ops.attention_inputs(self.ops, *args)

    def mlp_block(self, *args: Any) -> Any:
        return layer_ops.mlp_block(self.ops, *args)


def _run_halves(
    ops: LayerOps | _OneByOne, rows: int, first: bool, weights: dict[str, Any]
) -> list[torch.Tensor]:
    """Both halves of a layer over ``rows`` tokens through ``ops``: every tensor they return."""
    dtype = weights["norms"][0].dtype
    x = None if first else _randn(rows, 576, dtype=dtype, seed=7)
    residual = _randn(rows, 576, dtype=dtype, scale=3.0, seed=8)
    angles = (torch.arange(rows) * 37 % 4096)[:, None] * 1e-2 * torch.arange(1, 33)  # [T, 32]
    cos, sin = torch.cos(angles).float(), torch.sin(angles).float()
    norm_in, norm_post = weights["norms"]
    q, k, v, residual = ops.attention_inputs(
        x, residual, norm_in, EPS, weights["qkv"], cos, sin, 9, 3
    )
    attn = (q * 0.5).reshape(rows, 576).contiguous()  # stands in for attention's output
    out, residual = ops.mlp_block(
        attn, residual, weights["o_proj"], norm_post, EPS, weights["gate_up"], weights["down"]
    )
    return [q, k, v, attn, out, residual]


@needs_fused
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "float32"])
@pytest.mark.parametrize("rows", [1, 4, 5, 17, 64, 256])
@pytest.mark.parametrize("first", [True, False], ids=["first layer", "later layer"])
def test_layer_halves_in_one_call_are_the_ops_one_by_one(
    rows: int, first: bool, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode batch's layer halves in one C call each give exactly the bits of the same ops
    called one by one (bf16: the tiles, or the stripes; float32: the stripes, for every
    matmul), the residual stream updated in place the same way."""
    ops = _fused()
    weights = _layer_weights(ops, dtype=dtype)
    expected = _run_halves(_OneByOne(ops), rows, first, weights)

    def one_by_one(*args: object) -> None:
        raise AssertionError("the C call declined a decode batch it should take")

    monkeypatch.setattr(layer_ops, "attention_inputs", one_by_one)
    monkeypatch.setattr(layer_ops, "mlp_block", one_by_one)
    got = _run_halves(ops, rows, first, weights)
    for a, b in zip(got, expected, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(a, b), f"{int((a != b).sum())} of {a.numel()} values differ"


@needs_fused
def test_layer_halves_go_op_by_op_where_the_c_call_does_not_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """More rows than the tiles take (a prefill chunk) or a q/k/v bias (Qwen2): the composition
    of the ops, as before; a decode batch without: one call each."""
    ops = _fused()
    calls: list[str] = []
    for name in ("attention_inputs", "mlp_block"):
        real = getattr(layer_ops, name)

        def spy(*args: Any, _real: Any = real, _name: str = name) -> Any:
            calls.append(_name)
            return _real(*args)

        monkeypatch.setattr(layer_ops, name, spy)
    _run_halves(ops, 257, False, _layer_weights(ops))
    assert calls == ["attention_inputs", "mlp_block"]
    calls.clear()
    _run_halves(ops, 8, False, _layer_weights(ops, qkv_bias=True))
    assert calls == ["attention_inputs"]  # the other half has no bias: one call
    calls.clear()
    _run_halves(ops, 8, True, _layer_weights(ops))
    assert calls == []


@needs_fused
def test_wrong_inputs_are_refused_not_read() -> None:
    ops = _fused()
    x = _randn(4, 64, dtype=torch.float32)
    with pytest.raises(ValueError):
        ops.rms_norm(x, torch.ones(32), EPS)  # weight of the wrong size
    with pytest.raises(ValueError):
        ops.rms_norm(x.t(), torch.ones(4), EPS)  # not contiguous
    with pytest.raises(ValueError):
        ops.add_rms_norm(x.bfloat16(), x, torch.ones(64), EPS)  # dtypes differ
    with pytest.raises(ValueError):
        ops.split_rope(x, torch.ones(4, 4), torch.ones(4, 4), 3, 1)  # width != 5 heads * 8
    with pytest.raises(ValueError):
        ops.silu_mul(x.half())  # no float16 entry
    assert not ops.supports(torch.float16)


@needs_fused
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens", [1, 9, 40])
@pytest.mark.parametrize("changes", [{}, {"attention_bias": True}], ids=str)
def test_whole_model_logits(dtype: torch.dtype, num_tokens: int, changes: dict) -> None:
    model = _random_model(dtype, **changes)
    ids = [(3 + 17 * i) % 60 for i in range(num_tokens)]
    expected = _logits(model, ids)
    model.use_layer_ops(_fused())
    model.pack_weights()  # bf16: tiles where the sides allow, oneDNN's copies elsewhere
    got = _logits(model, ids)
    model.use_layer_ops(TORCH_OPS)
    assert model.packed_head is None  # the fused ops' packed copies went with them
    torch.testing.assert_close(_logits(model, ids), expected, atol=0, rtol=0)  # switch back
    atol = 1e-4 if dtype == torch.float32 else 0.1  # bf16: a rounding flip grows over layers
    torch.testing.assert_close(got, expected, atol=atol, rtol=0)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@needs_fused
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kept_rows_are_those_rows_of_the_whole_pass(dtype: torch.dtype) -> None:
    """forward(keep=rows) takes the other rows no further than the last layer's K/V: on the
    fused ops the kept rows' hidden states are exactly those of the whole pass (a row's
    numbers do not depend on its batch); on torch's, within float rounding."""
    from tests.models_fixtures import sdpa_attention

    model = _random_model(dtype)
    ids = torch.tensor([(3 + 17 * i) % 60 for i in range(40)])
    positions = torch.arange(len(ids))
    cases = [[39], [0, 7, 39], list(range(0, 40, 3))]
    with torch.inference_mode():
        whole = model(ids, positions, sdpa_attention)
        for rows in cases:
            keep = torch.tensor(rows)
            torch.testing.assert_close(model(ids, positions, sdpa_attention, keep), whole[keep])
        model.use_layer_ops(_fused())
        model.pack_weights()
        whole = model(ids, positions, sdpa_attention)
        for rows in cases:
            keep = torch.tensor(rows)
            got = model(ids, positions, sdpa_attention, keep)
            torch.testing.assert_close(got, whole[keep], atol=0, rtol=0)
    model.use_layer_ops(TORCH_OPS)


def test_carrying_the_residual_does_not_change_torch_numbers() -> None:
    """The restructured layer (residual stream apart, two halves) against the textbook pre-norm
    block written out in torch ops."""
    from pagekv.models.layer_ops import rms_norm
    from tests.models_fixtures import sdpa_attention

    model = _random_model(torch.bfloat16)
    ids = torch.tensor([3, 17, 5, 60, 2])
    cfg, eps = model.config, model.config.rms_norm_eps
    heads, kv_heads, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    linear = torch.nn.functional.linear
    with torch.inference_mode():
        cos, sin = model.rope_cos[: len(ids)], model.rope_sin[: len(ids)]
        x = torch.nn.functional.embedding(ids, model.embed_tokens)
        for i, layer in enumerate(model.layers):
            qkv = linear(rms_norm(x, layer.input_layernorm, eps), layer.qkv_proj)
            q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
            q = apply_rope(q.reshape(len(ids), heads, head_dim), cos, sin)
            k = apply_rope(k.reshape(len(ids), kv_heads, head_dim), cos, sin)
            v = v.reshape(len(ids), kv_heads, head_dim).contiguous()
            attn = sdpa_attention(i, q, k, v).reshape(len(ids), heads * head_dim)
            x = x + linear(attn, layer.o_proj)
            gate, up = linear(
                rms_norm(x, layer.post_attention_layernorm, eps), layer.gate_up_proj
            ).chunk(2, -1)
            x = x + linear(torch.nn.functional.silu(gate) * up, layer.down_proj)
        expected = rms_norm(x, model.norm, eps)
        got = model(ids, torch.arange(len(ids)), sdpa_attention)
    assert cfg.num_hidden_layers >= 2
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_disabled_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    build.forget()
    monkeypatch.setenv(fused_ops.DISABLE_ENV, "0")
    try:
        assert fused_ops.load() is None
    finally:
        build.forget()


def test_build_failure_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    build.forget()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # /bin/false: found, always fails
    try:
        assert fused_ops.load() is None
    finally:
        build.forget()


_last_model: list[Any] = [None]  # the model _runner_ops built last


def _runner_ops(
    backend_name: str,
    monkeypatch: pytest.MonkeyPatch,
    env: str,
    dtype: torch.dtype = torch.bfloat16,
) -> LayerOps:
    from pagekv.models.loader import LoadedModel
    from pagekv.runner.model_runner import AttentionBackend, ModelRunner

    build.forget()
    monkeypatch.setenv(fused_ops.DISABLE_ENV, env)
    model = _random_model(dtype)
    _last_model[0] = model
    loaded = LoadedModel(_tiny_config(), model, None, "x", "fp")  # type: ignore[arg-type]
    try:
        ModelRunner(loaded, 4, 16, attention=AttentionBackend[backend_name])
    finally:
        build.forget()
    return model.ops


@needs_fused
def test_runner_packs_weights_into_its_huge_page_arena(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast runner packs every matmul weight through one ``HugePageArena`` with room for
    all of them; what the fused ops lay out themselves (tiles, stripes) is the arena's."""
    from pagekv.runner import host_memory

    arenas: list[tuple[int, list[torch.Tensor]]] = []

    class Spy(host_memory.HugePageArena):
        def __init__(self, nbytes: int) -> None:
            super().__init__(nbytes)
            arenas.append((nbytes, []))

        def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            arenas[-1][1].append(super().empty(shape, dtype))
            return arenas[-1][1][-1]

    monkeypatch.setattr(host_memory, "HugePageArena", Spy)
    for dtype in DTYPES:
        _runner_ops("FAST", monkeypatch, "1", dtype)
        room, handed_out = arenas[-1]
        own = [p for p in _last_model[0].layers[0].packed.values() if p is not None and p.dim() > 2]
        assert len(own) >= 3  # tiles or stripes on every target
        for packed in own:
            assert any(packed.data_ptr() == t.data_ptr() for t in handed_out)
        assert sum(t.numel() * t.element_size() for t in handed_out) <= room
    assert len(arenas) == len(DTYPES)


@needs_fused
def test_runner_uses_fused_ops_on_the_fast_path_only(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(_runner_ops("FAST", monkeypatch, "1"), fused_ops.FusedOps)
    assert _runner_ops("FAST", monkeypatch, "0") is TORCH_OPS
    assert _runner_ops("REFERENCE", monkeypatch, "1") is TORCH_OPS
