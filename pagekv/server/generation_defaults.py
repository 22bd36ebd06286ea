"""What unset sampling fields of a request take: vLLM's ``--generation-config``.

``auto`` (vLLM's default): the model's own ``generation_config.json`` (an HF directory's; a
GGUF file has none), keeping only the sampling fields vLLM reads and only where they differ
from transformers' ``GenerationConfig`` defaults, as vLLM's ``to_diff_dict`` does;
``max_new_tokens`` becomes ``max_tokens``. ``vllm``: none (the API's own defaults). Any other
value is a folder holding a ``generation_config.json``.

A request's own value always wins; the defaults fill what it leaves unset.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from pagekv.errors import InvalidRequestError

# The sampling fields vLLM takes from a generation config, with transformers' defaults (a
# value equal to its default is no change; None: any value is one).
READ_FIELDS: dict[str, float | None] = {
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_k": 50,
    "top_p": 1.0,
    "min_p": None,
    "max_new_tokens": None,
}
PARAM = "generation_config"


def config_file(source: str, model_path: str) -> str | None:
    """The ``generation_config.json`` that ``source`` names (None: there is none to read);
    a folder given that has none is refused."""
    if source == "vllm":
        return None
    if source == "auto":
        path = os.path.join(model_path, "generation_config.json")
        return path if os.path.isdir(model_path) and os.path.isfile(path) else None
    path = os.path.join(source, "generation_config.json")
    if not os.path.isfile(path):
        raise InvalidRequestError(
            f"--generation-config: {path} does not exist (give auto, vllm or a folder "
            "holding a generation_config.json)",
            PARAM,
        )
    return path


def sampling_defaults(source: str, model_path: str) -> dict[str, float]:
    """The defaults ``source`` gives for a model at ``model_path`` (see the module docstring)."""
    path = config_file(source, model_path)
    if path is None:
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data: Any = json.load(f)
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(f"--generation-config: cannot read {path}: {exc}", PARAM) from exc
    if not isinstance(data, dict):
        raise InvalidRequestError(f"--generation-config: {path} is not a JSON object", PARAM)
    out: dict[str, float] = {}
    for name, hf_default in READ_FIELDS.items():
        value = data.get(name)
        if value is None or value == hf_default:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise InvalidRequestError(
                f"--generation-config: {path}: {name} must be a number, got {value!r}", PARAM
            )
        out["max_tokens" if name == "max_new_tokens" else name] = value
    return out
