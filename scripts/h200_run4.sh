#!/usr/bin/env bash
export PYTHONPATH=$PWD/src:$PWD PYTHONUNBUFFERED=1
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
for fmt in bf16 q4; do
  timeout 150 $NCU --clock-control none --metrics gpu__time_duration.sum --csv \
    python3 scripts/h200_profile.py run $fmt > $OUT/ncu_$fmt.csv 2>$OUT/ncu_$fmt.err
  python3 scripts/h200_profile.py report $OUT/ncu_$fmt.csv 2>&1 | tee $OUT/ncu_$fmt.txt
done
B="python3 -m mlx_omnia.bench.main interleaved --model qwen3-4b"
$B --runs 5 --json $OUT/bf16.json 2>&1 | grep -v '^\[omnia-bench\] run' | tee $OUT/bf16.txt
$B --runs 5 --quantize 4 --json $OUT/q4.json 2>&1 | grep -v '^\[omnia-bench\] run' | tee $OUT/q4.txt
$B --runs 2 --prompt 4096 --generate 32 --json $OUT/bf16-4096.json 2>&1 | grep -v '^\[omnia-bench\]' | tee $OUT/bf16-4096.txt
timeout 150 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_kernels_cuda.py 2>&1 | tail -25 | tee $OUT/cuda_tests.txt
