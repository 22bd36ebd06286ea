"""GGUF files of a real model's widths with random weights, for benchmarks.

    python benchmarks/shape_model.py qwen2.5-1.5b [--type Q4_K_M[,Q8_0]] [--hf] [--out DIR]

Writes ``DIR/<shape>-f16.gguf`` (gguf's writer: float16 matmul weights, float32 norms and
biases, SmolLM2's tokenizer so that pagekv and llama.cpp both load it) and, with ``--type``
other than F16, quantizes it with llama.cpp's ``llama-quantize`` (benchmarks/setup_llama_cpp.sh
builds it) to ``DIR/<shape>-<type>.gguf``. ``--hf`` also writes ``DIR/<shape>-<type>-hf/``: that
file's weights as transformers dequantizes them, saved as a bf16 HF directory (safetensors,
config, tokenizer) for vLLM (``compare.py --vllm-model``): the same weights in every engine.
Prints the path of each file. Only the widths
are the model's: the vocabulary is SmolLM2's 49,152 pieces (a benchmark of prefill computes
logits for one position per request), the weights normal with std 0.02, so the tokens mean
nothing. Each file is kept and reused when it exists.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagekv.models.gguf_file import GGUFFile
from pagekv.models.loader import default_model_path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import LLAMA_CPP_BIN

DEFAULT_DIR = Path(__file__).resolve().parent / ".models"


@dataclass(frozen=True)
class Shape:
    arch: str  # a GGUF architecture both engines load
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rope_theta: float
    bias: bool  # q/k/v biases (Qwen2)


SHAPES = {
    "qwen2.5-1.5b": Shape("qwen2", 1536, 28, 12, 2, 128, 8960, 1_000_000.0, True),
    "qwen2.5-7b": Shape("qwen2", 3584, 28, 28, 4, 128, 18944, 1_000_000.0, True),
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 64, 8192, 500_000.0, False),
    "llama-3.1-8b": Shape("llama", 4096, 32, 32, 8, 128, 14336, 500_000.0, False),
}
TOKENIZER_KEYS = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
)


def write_f16(shape: Shape, path: Path, seed: int = 0) -> None:
    import gguf

    tokenizer = GGUFFile(default_model_path()).metadata
    vocab = len(tokenizer["tokenizer.ggml.tokens"])  # type: ignore[arg-type]
    rng = np.random.default_rng(seed)
    arch, s = shape.arch, shape
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.embedding_length", s.hidden)
    writer.add_uint32(f"{arch}.feed_forward_length", s.intermediate)
    writer.add_uint32(f"{arch}.block_count", s.layers)
    writer.add_uint32(f"{arch}.attention.head_count", s.heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", s.kv_heads)
    writer.add_uint32(f"{arch}.attention.key_length", s.head_dim)
    writer.add_uint32(f"{arch}.attention.value_length", s.head_dim)
    writer.add_uint32(f"{arch}.rope.dimension_count", s.head_dim)
    writer.add_uint32(f"{arch}.context_length", 32768)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32(f"{arch}.rope.freq_base", s.rope_theta)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key in TOKENIZER_KEYS:
        value = tokenizer[key]
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_uint32(key, int(value))  # type: ignore[arg-type]

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    def vector(n: int, around: float) -> np.ndarray:
        return (around + 0.02 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    writer.add_tensor("token_embd.weight", matrix(vocab, s.hidden))
    writer.add_tensor("output_norm.weight", vector(s.hidden, 1.0))
    for i in range(s.layers):
        blk = f"blk.{i}"
        writer.add_tensor(f"{blk}.attn_norm.weight", vector(s.hidden, 1.0))
        for name, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            writer.add_tensor(f"{blk}.{name}.weight", matrix(rows, s.hidden))
            if s.bias:
                writer.add_tensor(f"{blk}.{name}.bias", vector(rows, 0.0))
        writer.add_tensor(f"{blk}.attn_output.weight", matrix(s.hidden, q))
        writer.add_tensor(f"{blk}.ffn_norm.weight", vector(s.hidden, 1.0))
        writer.add_tensor(f"{blk}.ffn_gate.weight", matrix(s.intermediate, s.hidden))
        writer.add_tensor(f"{blk}.ffn_up.weight", matrix(s.intermediate, s.hidden))
        writer.add_tensor(f"{blk}.ffn_down.weight", matrix(s.hidden, s.intermediate))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def build(name: str, quant_type: str = "Q4_K_M", out: Path = DEFAULT_DIR) -> Path:
    """The GGUF file of shape ``name`` in ``quant_type`` (written, or found from before)."""
    out.mkdir(parents=True, exist_ok=True)
    f16 = out / f"{name}-f16.gguf"
    if not f16.exists():
        partial = f16.with_suffix(".partial")
        write_f16(SHAPES[name], partial)
        partial.rename(f16)
    if quant_type.upper() == "F16":
        return f16
    target = out / f"{name}-{quant_type}.gguf"
    if not target.exists():
        quantize = LLAMA_CPP_BIN / "llama-quantize"
        if not quantize.exists():
            raise SystemExit(f"{quantize} missing: run benchmarks/setup_llama_cpp.sh")
        subprocess.run([str(quantize), str(f16), str(target), quant_type], check=True)
    return target


def hf_directory(gguf_path: Path) -> Path:
    """``<file>-hf/``: the GGUF file dequantized by transformers, saved as a bf16 HF directory
    (written, or found from before)."""
    out = gguf_path.with_name(gguf_path.stem + "-hf")
    if (out / "config.json").exists():
        return out
    import torch
    import transformers

    kwargs = {"gguf_file": gguf_path.name}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), dtype=torch.bfloat16, **kwargs
    )
    # a GGUF-loaded model refuses save_pretrained ("quantized with gguf"), though its weights
    # are already dequantized: move them into a plain model built from the same config
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    plain.load_state_dict(model.state_dict())
    partial = out.with_name(out.name + ".partial")
    plain.save_pretrained(partial)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), **kwargs)
    tokenizer.save_pretrained(partial)
    partial.rename(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument(
        "--type", default="Q4_K_M", help="llama-quantize's types, comma-separated, or F16"
    )
    parser.add_argument("--hf", action="store_true", help="an HF directory of each file too")
    parser.add_argument("--out", type=Path, default=DEFAULT_DIR)
    args = parser.parse_args()
    for quant_type in args.type.split(","):
        path = build(args.shape, quant_type, args.out)
        print(path)
        if args.hf:
            print(hf_directory(path))


if __name__ == "__main__":
    main()
