#!/usr/bin/env bash
# CUDA kernel tests, then omnia-bench on the Qwen3-4B shape (bf16 with the reference arm, 4-bit).
export PYTHONPATH=$PWD/src:$PWD PYTHONUNBUFFERED=1
python3 -m pytest -q -m cuda -x -p no:cacheprovider tests/test_kernels_cuda.py 2>&1 | tail -30 | tee $OUT/cuda_tests.txt
python3 -m mlx_omnia.bench.main interleaved --model qwen3-4b --reference --json $OUT/q4b-bf16.json 2>&1 | tee $OUT/q4b-bf16.txt
python3 -m mlx_omnia.bench.main interleaved --model qwen3-4b --quantize 4 --json $OUT/q4b-q4.json 2>&1 | tee $OUT/q4b-q4.txt
