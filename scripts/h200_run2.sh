#!/usr/bin/env bash
# Second probe: prototype step with the attention kernel, then per-kernel GPU times under ncu.
set -x
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
python3 scripts/h200_probe.py step 2>&1 | tee $OUT/step.txt
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for fmt in bf16 q4; do
  timeout 200 $NCU --clock-control none --metrics gpu__time_duration.sum --csv \
    python3 scripts/h200_probe.py ncu-child $fmt > $OUT/ncu_$fmt.csv 2>&1
  python3 scripts/h200_probe.py ncu-report $OUT/ncu_$fmt.csv 2>&1 | tee $OUT/ncu_$fmt.txt
done
tail -5 $OUT/ncu_bf16.csv
