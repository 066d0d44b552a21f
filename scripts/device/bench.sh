#!/usr/bin/env bash
# The published GPU benches (docs/benchmarks.md, "Publishing a result"), on a lent machine:
#   bash scripts/device/bench.sh dense|moe|hybrid [EXTRA omnia-bench ARGS...]
#   bash scripts/device/bench.sh paired --ref DIR --model SHAPE [ARGS...]   (this tree vs DIR's)
#   bash scripts/device/bench.sh constrained [ARGS...]   (free vs JSON/regex/Lark-constrained)
#   bash scripts/device/bench.sh concurrency [ARGS...]   (Batch vs mlx-lm's BatchGenerator)
#   bash scripts/device/bench.sh agent-replay [ARGS...]  (a 16k conversation resent, cached or not)
# dense: Qwen3-4B in bfloat16, then affine 4-bit g64; moe: Qwen3-30B-A3B 4-bit g64 written
# quantized; hybrid (issue 33): Qwen3-Next-80B-A3B 4-bit g64 written quantized, its first LAYERS
# layers (default 24: both arms on one 80 GB card; LAYERS= for all 48, ~90 GB with both arms),
# then Nemotron-H-8B and Granite-4.0-H-Tiny in bfloat16 and 4-bit. Both engines in the same format, free generation included, RUNS runs (default 3),
# each result under $OUT/bench-results. Set OMNIA_BENCH_REVISION to the commit that was copied
# (the device's tree has no git history) and T to each bench's time limit in seconds.
set -uo pipefail
bash .device-wheels/install.sh > /dev/null 2>&1 || { echo "install.sh failed"; exit 1; }
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/bench-out}
mkdir -p "$OUT"
what=${1:?dense, moe, hybrid, paired, constrained, concurrency or agent-replay}
shift
bench() {
  timeout "${T:-290}" python3 -m mlx_omnia.bench.main interleaved --runs "${RUNS:-3}" \
    --results "$OUT/bench-results" "$@" 2>&1 | grep -v '^\[omnia-bench\] run ' | tee -a "$OUT/bench.txt"
}
case $what in
  dense) bench --model qwen3-4b "$@"; bench --model qwen3-4b --quantize 4 "$@" ;;
  moe) bench --model qwen3-30b-a3b --quantize 4 --prequantize "$@" ;;
  hybrid)
    cut=(); [[ -n ${LAYERS-24} ]] && cut=(--layers "${LAYERS-24}")
    bench --model qwen3-next-80b-a3b --quantize 4 --prequantize "${cut[@]}" "$@"
    for model in nemotron-h-8b granite-4.0-h-tiny; do
      bench --model "$model" "$@"; bench --model "$model" --quantize 4 "$@"
    done ;;
  paired)
    timeout "${T:-400}" python3 -m mlx_omnia.bench.main paired --runs "${RUNS:-3}" \
      --results "$OUT/bench-results" "$@" 2>&1 | grep -v '^\[omnia-bench\] run ' | tee -a "$OUT/bench.txt" ;;
  constrained)
    constrained_bench() {
      timeout "${T:-290}" python3 -m mlx_omnia.bench.main constrained --runs "${RUNS:-3}" \
        --generate "${GENERATE:-256}" --results "$OUT/bench-results" "$@" 2>&1 \
        | grep -v '^\[omnia-bench\] run ' | tee -a "$OUT/bench.txt"
    }
    if [[ " $* " == *" --model "* ]]; then
      constrained_bench "$@"
    else
      constrained_bench --model qwen3-4b "$@"
      constrained_bench --model qwen3-4b --quantize 4 "$@"
      constrained_bench --model qwen3-30b-a3b --quantize 4 --prequantize "$@"
    fi ;;
  concurrency|agent-replay)
    # Qwen3-4B 4-bit unless --model is given (Qwen3-30B-A3B: --model qwen3-30b-a3b --quantize 4);
    # each result under $OUT/bench-results (results_file.py tables both kinds)
    model=(--model qwen3-4b --quantize 4)
    [[ $what == concurrency ]] && model+=(--prequantize)
    if [[ " $* " == *" --model "* ]]; then model=(); fi
    timeout "${T:-290}" python3 -m mlx_omnia.bench.main "$what" --json "$OUT/$what.json" \
      --results "$OUT/bench-results" "${model[@]}" "$@" 2>&1 | grep -v '^\[omnia-bench\] run ' \
      | tee -a "$OUT/bench.txt" ;;
  *) echo "unknown: $what (dense, moe, hybrid, paired, constrained, concurrency or agent-replay)"; exit 2 ;;
esac
