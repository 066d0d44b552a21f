#!/usr/bin/env bash
export PYTHONPATH=$PWD/src:$PWD PYTHONUNBUFFERED=1
timeout 260 python3 -m pytest -q -m cuda -p no:cacheprovider -rf tests/test_kernels_cuda.py > $OUT/cuda_tests.txt 2>&1
tail -15 $OUT/cuda_tests.txt
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
timeout 120 $NCU --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \
  --section WarpStateStats --section MemoryWorkloadAnalysis \
  -k regex:"attention_split|q4g64_k2560_n9728|attention_combine" -c 3 \
  python3 scripts/h200_profile.py run q4 > $OUT/ncu_detail.txt 2>&1
grep -E "custom_kernel|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Warp Cycles Per Issued|Stall|Compute \(SM\)" $OUT/ncu_detail.txt | head -60
