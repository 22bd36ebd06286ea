"""From a Hugging Face model directory to a ModelConfig and a stream of named weights.

Owns reading config.json (both the older rope_theta/rope_scaling keys and transformers 5's
rope_parameters) and the safetensors shards (single file or an index). Its ``model_type`` names
the architecture (registry.py). The tokenizer side of a directory is in tokenizer. PyTorch .bin
checkpoints are not supported.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from collections.abc import Iterator, Mapping

import torch
from safetensors import SafetensorError, safe_open

from pagekv.errors import ModelLoadError
from pagekv.models.config import ModelConfig, freeze_rope_scaling
from pagekv.models.registry import architecture
from pagekv.models.tokenizer import read_json

INDEX_FILE = "model.safetensors.index.json"


def read_hf_config(directory: str) -> dict[str, object]:
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise ModelLoadError(f"{directory}: not a model directory (no config.json)")
    return read_json(path)


def _number(raw: Mapping[str, object], key: str, source: str, default: float | None) -> float:
    value = raw.get(key)
    value = default if value is None else value  # config.json may say null ("head_dim": null)
    if value is None:
        raise ModelLoadError(f"{source}: config.json lacks {key!r}")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ModelLoadError(f"{source}: config.json {key!r} should be a number, got {value!r}")
    return float(value)


def _int(raw: Mapping[str, object], key: str, source: str, default: int | None = None) -> int:
    value = _number(raw, key, source, default)
    if not value.is_integer():
        raise ModelLoadError(f"{source}: config.json {key!r} should be an integer, got {value}")
    return int(value)


def _rope(raw: Mapping[str, object], source: str) -> tuple[float, Mapping[str, object] | None]:
    """(rope_theta, rope scaling dict) from either config spelling."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict):  # transformers >= 5: theta and scaling in one dict
        theta = params.get("rope_theta", raw.get("rope_theta"))
        return _number({"rope_theta": theta}, "rope_theta", source, 10000.0), params
    scaling = raw.get("rope_scaling")
    theta_value = _number(raw, "rope_theta", source, 10000.0)
    return theta_value, scaling if isinstance(scaling, dict) else None


def _check_full_rotary(raw: Mapping[str, object], params: object, source: str) -> None:
    """Refuse partial RoPE (a rotation of only the first dims of each head; Phi-4-mini,
    Phi-3.5): the model rotates whole heads."""
    factor = raw.get("partial_rotary_factor")
    if isinstance(params, dict):
        factor = params.get("partial_rotary_factor", factor)
    if factor is not None and factor != 1:
        raise ModelLoadError(f"{source}: partial_rotary_factor {factor!r} is not supported")


def _sliding_window(raw: Mapping[str, object], source: str) -> int | None:
    """The window config.json gives, None where it is off: Qwen2/Qwen3 say whether it is on in
    use_sliding_window (their sliding_window is set either way), Mistral and Phi-3 set
    sliding_window null when off; layer_types, where given, names the layers that slide."""
    if "use_sliding_window" in raw and not raw["use_sliding_window"]:
        return None
    layer_types = raw.get("layer_types")
    if isinstance(layer_types, list) and "sliding_attention" not in layer_types:
        return None
    return None if raw.get("sliding_window") is None else _int(raw, "sliding_window", source)


def hf_config(raw: Mapping[str, object], source: str) -> ModelConfig:
    """ModelConfig from a parsed config.json; ModelLoadError names `source` on any problem."""
    model_type = raw.get("model_type")
    arch = architecture(model_type, source)
    assert isinstance(model_type, str)  # a registered name
    if raw.get("hidden_act", "silu") != "silu" or raw.get("mlp_bias", False):
        raise ModelLoadError(f"{source}: only bias-free SwiGLU (silu) MLPs are supported")
    heads = _int(raw, "num_attention_heads", source)
    hidden = _int(raw, "hidden_size", source)
    theta, scaling = _rope(raw, source)
    _check_full_rotary(raw, scaling, source)
    try:
        config = ModelConfig(
            model_type=model_type,
            vocab_size=_int(raw, "vocab_size", source),
            hidden_size=hidden,
            intermediate_size=_int(raw, "intermediate_size", source),
            num_hidden_layers=_int(raw, "num_hidden_layers", source),
            num_attention_heads=heads,
            num_key_value_heads=_int(raw, "num_key_value_heads", source, heads),
            head_dim=_int(raw, "head_dim", source, hidden // max(heads, 1)),
            rms_norm_eps=_number(raw, "rms_norm_eps", source, 1e-6),
            rope_theta=theta,
            rope_scaling=freeze_rope_scaling(scaling),
            max_position_embeddings=_int(raw, "max_position_embeddings", source),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Some architectures always have q/k/v bias (Qwen2); others say so in attention_bias.
            attention_bias=arch.hf_attention_bias or bool(raw.get("attention_bias", False)),
            sliding_window=_sliding_window(raw, source),
        )
        if arch.hf_config_fields is not None:  # what the architecture reads its own way
            config = dataclasses.replace(config, **arch.hf_config_fields(raw, source))
        return config
    except ModelLoadError as exc:
        raise ModelLoadError(f"{source}: {exc}") from exc


def safetensors_files(directory: str) -> list[str]:
    """The weight shards of a directory, from the index when there is one."""
    index = read_json(os.path.join(directory, INDEX_FILE))
    if index:
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{directory}/{INDEX_FILE}: no weight_map")
        files = [os.path.join(directory, name) for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"{directory}: no *.safetensors weights (.bin is not supported)")
    for path in files:
        if not os.path.isfile(path):
            raise ModelLoadError(f"{path}: listed in {INDEX_FILE} but missing")
    return files


def hf_weights(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the shards, one at a time, in stored dtype."""
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118  # safe_open has no __iter__
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{path}: cannot read safetensors: {exc}") from exc
