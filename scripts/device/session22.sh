# One short run on the lent GPU (development): where a batched step goes, and the concurrency
# bench at 1, 2 and 8 greedy streams.
bash .device-wheels/install.sh > /dev/null 2>&1 || { echo "install.sh failed"; exit 1; }
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 60 python3 scripts/device/batch_ops.py 2>&1 | tail -14
timeout 110 python3 -m mlx_omnia.bench.main concurrency --model qwen3-4b --quantize 4 --prequantize \
  --streams 1,2,8 --runs 1 --temperature 0 --against none --json $OUT/conc.json 2>&1 | grep -v '^\[omnia-bench\]' | tail -8
