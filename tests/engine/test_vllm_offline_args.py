"""vLLM's engine arguments read with vLLM's meanings, with no model: ``EngineConfig`` (what
``LLM(...)`` builds) and the command line (``pagekv.engine.args``, shared by ``serve``)."""

from __future__ import annotations

import argparse
import logging

import pytest

from pagekv.engine.args import add_engine_arguments, engine_config
from pagekv.engine.config import EngineConfig, host_pool_bytes
from pagekv.errors import InvalidRequestError

GIB = 2**30


def _cli(argv: list[str]) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return engine_config(parser.parse_args(argv))


@pytest.mark.parametrize(
    ("value", "tokens"),
    [
        (2048, 2048),
        ("2048", 2048),
        ("4k", 4000),
        ("4K", 4096),
        ("25.6k", 25600),
        ("1M", 2**20),
        ("1m", 10**6),
        ("auto", None),
        (-1, None),
        (None, None),
    ],
)
def test_max_model_len_reads_vllms_human_readable_form(value: object, tokens: int | None) -> None:
    assert EngineConfig(max_model_len=value).max_model_len == tokens  # type: ignore[arg-type]
    if value is not None:
        assert _cli([f"--max-model-len={value}"]).max_model_len == tokens


@pytest.mark.parametrize("value", ["1.5K", "four", "4kk", 0, -2, True, 1.5])
def test_bad_max_model_len_is_refused_by_name(value: object) -> None:
    with pytest.raises(InvalidRequestError) as info:
        EngineConfig(max_model_len=value)  # type: ignore[arg-type]
    assert info.value.param == "max_model_len"


def test_max_num_batched_tokens_reads_the_human_readable_form_too() -> None:
    assert EngineConfig(max_num_batched_tokens="8k").max_num_batched_tokens == 8000  # type: ignore[arg-type]
    assert _cli(["--max-num-batched-tokens", "2K"]).max_num_batched_tokens == 2048


@pytest.mark.parametrize(
    ("value", "size"),
    [(4, 4 * GIB), ("4", 4 * GIB), (0.5, GIB // 2), ("512MiB", 512 * 2**20), (0, 0)],
)
def test_swap_space_is_gib_as_in_vllm_unless_a_unit_says_otherwise(
    value: float | str, size: int
) -> None:
    assert host_pool_bytes(EngineConfig(swap_space=value)) == size
    assert host_pool_bytes(_cli(["--swap-space", str(value)])) == size


@pytest.mark.parametrize("value", [-1, "-4", "4 parsecs", True, float("nan")])
def test_bad_swap_space_is_refused_by_name(value: object) -> None:
    with pytest.raises(InvalidRequestError) as info:
        EngineConfig(swap_space=value)  # type: ignore[arg-type]
    assert info.value.param == "swap_space"


@pytest.mark.parametrize(
    ("given", "dtype"),
    [
        ("auto", "float32"),
        ("float", "float32"),
        ("float32", "float32"),
        ("bfloat16", "bfloat16"),
        ("half", "bfloat16"),
        ("float16", "bfloat16"),
    ],
)
def test_vllms_dtype_names(given: str, dtype: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="pagekv"):
        assert EngineConfig(dtype=given).dtype == dtype
        assert _cli([f"--dtype={given}"]).dtype == dtype
    assert ("bfloat16" in caplog.text) == (given in ("half", "float16"))


def test_kv_cache_dtype_is_the_models_or_a_clear_refusal() -> None:
    assert EngineConfig(kv_cache_dtype="auto").kv_cache_dtype == "auto"
    assert EngineConfig(kv_cache_dtype="float32").dtype == "float32"
    assert EngineConfig(dtype="bfloat16", kv_cache_dtype="bfloat16").dtype == "bfloat16"
    for eight_bit in ("int8", "fp8", "fp8_e4m3"):  # 8-bit blocks with scales
        assert EngineConfig(kv_cache_dtype=eight_bit).kv_cache_dtype == eight_bit
    for bad in ("fp8_e5m2", "bfloat16", "int4"):
        with pytest.raises(InvalidRequestError, match="kv_cache_dtype") as info:
            EngineConfig(kv_cache_dtype=bad)
        assert info.value.param == "kv_cache_dtype"
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype"):
        _cli(["--kv-cache-dtype", "fp8_e5m2"])


def test_single_device_arguments_change_nothing_and_other_values_are_refused() -> None:
    plain = EngineConfig()
    same = EngineConfig(tensor_parallel_size=1, enforce_eager=True, trust_remote_code=True)
    assert (same.tensor_parallel_size, same.enforce_eager) == (1, True)
    assert _cli(["--tensor-parallel-size", "1", "--enforce-eager", "--trust-remote-code"])
    assert plain.dtype == same.dtype
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        with pytest.raises(InvalidRequestError, match=name) as info:
            EngineConfig(**{name: 2})  # type: ignore[arg-type]
        assert info.value.param == name
    with pytest.raises(InvalidRequestError, match="tensor_parallel_size"):
        _cli(["--tensor-parallel-size", "4"])


def test_none_means_the_engines_default_as_vllms_unset_arguments() -> None:
    config = EngineConfig(
        quantization=None,  # type: ignore[arg-type]
        enable_prefix_caching=None,  # type: ignore[arg-type]
        max_num_seqs=None,  # type: ignore[arg-type]
        max_num_batched_tokens=None,  # type: ignore[arg-type]
    )
    assert config == EngineConfig()


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"seed": "x"}, "seed"),
        ({"max_logprobs": 21}, "max_logprobs"),
        ({"tokenizer": ""}, "tokenizer"),
    ],
)
def test_other_vllm_arguments_checked_by_name(kwargs: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        EngineConfig(**kwargs)  # type: ignore[arg-type]
    assert info.value.param == param
