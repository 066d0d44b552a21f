#!/usr/bin/env bash
# Issue 31's long-context checks on a lent GPU, one call (each step under its own limit):
#   bash scripts/device/long_context.sh [STEPS]   (default: tests,attention,paired,kv)
#   tests      the CUDA tests of attention (walking slices, codes, rows, batch steps)
#   attention  attention_bench.py: kernel / wide (640 slices) / core at 512 to 64k rows
#   paired     omnia-bench paired against .bench-ref at prompts 512 and 16384 (qwen3-4b bf16)
#   kv         omnia-bench interleaved --kv-bits 8 --kv-bits 4 at 16k (qwen3-4b bf16)
# Results under $OUT/bench-results; set OMNIA_BENCH_REVISION to the tree's commit.
set -uo pipefail
bash .device-wheels/install.sh > /dev/null 2>&1 || { echo "install.sh failed"; exit 1; }
export PYTHONPATH=$PWD/src:$PWD/scripts/device PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/bench-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
steps=${1:-tests,attention,paired,kv}
for step in ${steps//,/ }; do
  echo "== $step $(date +%T)"
  case $step in
    tests) timeout "${T_TESTS:-300}" python3 -m pytest -q -m cuda -p no:cacheprovider -n 8 \
             --tb=line -rf -W ignore tests/test_kernels_cuda.py \
             -k "attention or project_attend or rows or batch_step or codes" 2>&1 | tail -30 ;;
    attention) timeout "${T_ATT:-150}" python3 scripts/device/attention_bench.py kernel,wide,core \
                 512,4000,16000,40000,64000 2>&1 | grep -v Warning ;;
    paired) for prompt in 512 16384; do
              timeout "${T_PAIRED:-200}" python3 -m mlx_omnia.bench.main paired --ref .bench-ref \
                --model qwen3-4b --prompt $prompt --runs "${RUNS:-3}" --results "$OUT/bench-results" \
                2>&1 | grep -v '^\[omnia-bench\] run ' | tail -12
            done ;;
    kv) timeout "${T_KV:-300}" python3 -m mlx_omnia.bench.main interleaved --model qwen3-4b \
          --prompt 16384 --kv-bits 8 --kv-bits 4 --runs "${RUNS:-3}" --results "$OUT/bench-results" \
          2>&1 | grep -v '^\[omnia-bench\] run ' | tail -25 ;;
    *) echo "unknown step: $step" ;;
  esac
done
