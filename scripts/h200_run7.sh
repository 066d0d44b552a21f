#!/usr/bin/env bash
# H200 session 4. A: kernel tests, attention bench, ncu detail of attention and default qmv
# launches. B: benches bf16 and 4-bit against mlx-lm.
export PYTHONPATH=$PWD/src:$PWD PYTHONUNBUFFERED=1
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
SECTIONS="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis"
KEYS="Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Warp Cycles Per Issued|Stall|Issue Slot|Eligible|Active Warps|L2 Hit|Grid Size"
if [ "$1" = A ]; then
  timeout 220 python3 -m pytest -q -m cuda -p no:cacheprovider -rf \
    -k "attention or candidate or linear or projections or head" \
    tests/test_kernels_cuda.py > $OUT/cuda_tests.txt 2>&1
  tail -6 $OUT/cuda_tests.txt
  timeout 60 python3 scripts/h200_attention_bench.py kernel,v1 512,4000 2>&1 | tee $OUT/attention.txt
  for L in 512 4000; do
    timeout 60 $NCU --clock-control none $SECTIONS -k regex:omnia_attention_step --launch-skip 72 -c 1 \
      python3 scripts/h200_attention_bench.py kernel $L > $OUT/ncu_attention_$L.txt 2>&1
    echo "== attention L=$L"; grep -E "$KEYS" $OUT/ncu_attention_$L.txt | head -40
  done
  SWEEP_DEFAULTS=1 timeout 90 $NCU --clock-control none $SECTIONS \
    -k regex:"q4g64_k2560_n9728|q4g64_k9728|bfloat16_dense_k4096" -c 3 \
    python3 scripts/h200_qmv_sweep.py run $OUT/defaults.json > $OUT/ncu_qmv.txt 2>&1
  grep -E "omnia_qmv|$KEYS" $OUT/ncu_qmv.txt | head -90
else
  B="python3 -m mlx_omnia.bench.main interleaved --model qwen3-4b"
  $B --runs 3 --json $OUT/bf16.json 2>&1 | grep -v '^\[omnia-bench\] run' | tee $OUT/bf16.txt
  $B --runs 3 --quantize 4 --json $OUT/q4.json 2>&1 | grep -v '^\[omnia-bench\] run' | tee $OUT/q4.txt
fi
