"""vLLM's spellings of engine arguments, read into this engine's values. No torch.

Owns nothing: pure functions that ``EngineConfig`` calls while it validates, so ``LLM(...)``,
the command line and the server read ``max_model_len="4k"`` or
``dtype="half"`` the same way vLLM 0.x does. Each bad value raises ``InvalidRequestError``
naming its parameter.

    human-readable ints   "4k" = 4000, "25.6k" = 25600, "1M" = 1048576 (decimal suffixes in
                          lower case may carry a fraction; binary ones in upper case may not)
    dtype                 "auto" is this engine's default (float32); "float" is float32; "half"
                          and "float16" run as bfloat16 (as vLLM's CPU backend does), with a
                          warning
"""

from __future__ import annotations

import logging
import re

from pagekv.errors import InvalidRequestError

logger = logging.getLogger("pagekv")

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}

ENGINE_DTYPES = ("float32", "bfloat16")
DEFAULT_DTYPE = "float32"
_DTYPE_ALIASES = {"auto": DEFAULT_DTYPE, "float": "float32", "float32": "float32"}
_DTYPE_ALIASES |= {"bfloat16": "bfloat16", "half": "bfloat16", "float16": "bfloat16"}
KV_CACHE_DTYPES = ("auto", *ENGINE_DTYPES)
EIGHT_BIT_KV = ("int8", "fp8", "fp8_e4m3")  # 8-bit blocks with scales (runner/kv_cache.py)


def human_readable_int(value: int | str, param: str) -> int:
    """``"4k"`` -> 4000, ``"1K"`` -> 1024, ``"25.6k"`` -> 25600, ``"2048"`` -> 2048."""
    if isinstance(value, bool):
        raise InvalidRequestError(f"{param}: expected an integer, got {value!r}", param)
    if isinstance(value, int):
        return value
    if not isinstance(value, str):
        raise InvalidRequestError(
            f"{param}: expected an integer or a string like '4k', got {value!r:.80}", param
        )
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)([kKmMgGtT])\s*", value)
    if match is not None:
        number, suffix = match.groups()
        if suffix in _DECIMAL:
            return int(float(number) * _DECIMAL[suffix])
        if "." not in number:
            return int(number) * _BINARY[suffix]
        raise InvalidRequestError(
            f"{param}: no fractions with the binary suffix {suffix} in {value!r}; did you mean "
            f"{number}{suffix.lower()}?",
            param,
        )
    try:
        return int(value.strip())
    except ValueError:
        raise InvalidRequestError(
            f"{param}: cannot read {value!r} as an integer like 2048, '4k' (4000) or '4K' (4096)",
            param,
        ) from None


def context_length(value: int | str | None) -> int | None:
    """``max_model_len``: None, -1 or "auto" leave the model's context; else a positive int."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    tokens = human_readable_int(value, "max_model_len")
    if tokens == -1:
        return None
    if tokens < 1:
        raise InvalidRequestError(f"max_model_len must be >= 1, got {value!r}", "max_model_len")
    return tokens


def engine_dtype(value: object) -> str:
    """The engine's dtype for one of vLLM's names (see the module docstring)."""
    resolved = _DTYPE_ALIASES.get(value) if isinstance(value, str) else None
    if resolved is None:
        raise InvalidRequestError(
            f"dtype must be one of {sorted(_DTYPE_ALIASES)}, got {value!r:.80}", "dtype"
        )
    if value in ("half", "float16"):
        logger.warning("dtype %s: float16 is not run here; using bfloat16 (as vLLM on CPU)", value)
    return resolved


def check_kv_cache_dtype(value: object, dtype: str) -> None:
    """The KV cache is kept in the model's dtype ("auto", or that dtype by name) or in 8 bits
    ("int8"; "fp8" or "fp8_e4m3": e4m3), a float16 scale per token and KV head."""
    if value in ("auto", dtype, *EIGHT_BIT_KV):
        return
    if value in KV_CACHE_DTYPES:
        reason = f"a float KV cache is kept in the model's dtype, {dtype}"
    else:
        reason = "not a KV cache dtype here"
    raise InvalidRequestError(
        f"kv_cache_dtype {value!r:.80}: {reason}; use 'auto' ({dtype!r}), 'int8' or 'fp8'",
        "kv_cache_dtype",
    )
