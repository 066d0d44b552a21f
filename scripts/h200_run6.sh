#!/usr/bin/env bash
# H200 session 3. A: attention bench + kernel tests + qmv launch sweep. B: greedy test + benches.
export PYTHONPATH=$PWD/src:$PWD PYTHONUNBUFFERED=1
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
if [ "$1" = A ]; then
  timeout 100 python3 scripts/h200_attention_bench.py 2>&1 | tee $OUT/attention.txt
  timeout 240 python3 -m pytest -q -m cuda -p no:cacheprovider -rf -k "attention or candidate" \
    tests/test_kernels_cuda.py > $OUT/cuda_tests.txt 2>&1
  tail -12 $OUT/cuda_tests.txt
  timeout 240 $NCU --clock-control none --metrics gpu__time_duration.sum --csv \
    python3 scripts/h200_qmv_sweep.py run $OUT/sweep.json > $OUT/sweep.csv 2> $OUT/sweep.err
  tail -3 $OUT/sweep.err
  python3 scripts/h200_qmv_sweep.py report $OUT/sweep.csv $OUT/sweep.json > $OUT/sweep.txt 2>&1
  grep -A4 "==" $OUT/sweep.txt
else
  timeout 200 python3 -m pytest -q -m cuda -p no:cacheprovider -rf -k "greedy or linear or projections or head" \
    tests/test_kernels_cuda.py > $OUT/cuda_tests.txt 2>&1
  tail -8 $OUT/cuda_tests.txt
  B="python3 -m mlx_omnia.bench.main interleaved --model qwen3-4b"
  $B --runs 3 --json $OUT/bf16.json 2>&1 | grep -v '^\[omnia-bench\] run' | tee $OUT/bf16.txt
  $B --runs 3 --quantize 4 --json $OUT/q4.json 2>&1 | grep -v '^\[omnia-bench\] run' | tee $OUT/q4.txt
fi
