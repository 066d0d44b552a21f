#!/usr/bin/env bash
# Measurements on the lent GPU machine, one mode a call (scripts/device/README.md says what each
# measures and its knobs):  bash scripts/device/run.sh MODE [ARGS...]
#   cuda-tests [SECONDS [FIRST]]   the CUDA test suite in four parts (short name V)
#   cuda-tests-k PATTERN [SECONDS]  the CUDA tests matching -k PATTERN (T)
#   bench-dense ["0 4"]            omnia-bench, qwen3-4b bf16 and/or 4-bit (E)
#   bench-moe                      omnia-bench, qwen3-30b-a3b 4-bit written quantized (C)
#   bench-long-prompt              prefill at 4096 tokens, qwen3-4b bf16 and 4-bit (L)
#   bench-paired ["BENCH ARGS"]    omnia-bench paired against the tree in .bench-ref (R)
#   kernel-ab [VARIANTS]           kernel variants against the tree in one process (X)
#   layer-timeline                 each chained launch's blocks on the GPU clock; launch costs (W)
#   kernel-times                   ncu GPU time per kernel of one decode step (K)
#   kernel-occupancy               ncu occupancy, waves and warp states of the chained launches (O)
#   host-overhead                  a decode step's host vs GPU time, omnia and mlx-lm (D)
#   moe-host-overhead              the same for the MoE step (M)
#   ops-per-token                  MLX primitives per decode token (G)
#   qmv-sweep                      every qmv launch configuration, timed (S)
#   qmv-stalls                     ncu stall reasons of the 4-bit gate/up GEMV (N)
#   nsys-host                      nsys host profile of the MoE and 4-bit step (P)
#   graph-knobs                    host time under MLX's CUDA graph settings (H)
#   allocator                      glibc malloc against jemalloc (A; needs .device-tools)
#   pyspy-host                     py-spy native profile of the 4-bit step (Y; needs .device-tools)
#   profile-and-bench              kernel-times for bf16 and 4-bit, then both dense benches (B)
# The letters are the same modes' short names.
declare -A MODE_LETTER=(
  [cuda-tests]=V [cuda-tests-k]=T [bench-dense]=E [bench-moe]=C [bench-long-prompt]=L
  [bench-paired]=R [kernel-ab]=X [layer-timeline]=W [kernel-times]=K [kernel-occupancy]=O
  [host-overhead]=D [moe-host-overhead]=M [ops-per-token]=G [qmv-sweep]=S [qmv-stalls]=N
  [nsys-host]=P [graph-knobs]=H [allocator]=A [pyspy-host]=Y [profile-and-bench]=B
)
if [ -n "${1:-}" ] && [ -n "${MODE_LETTER[$1]:-}" ]; then
  set -- "${MODE_LETTER[$1]}" "${@:2}"
fi
export PYTHONPATH=$PWD/src:$PWD PYTHONUNBUFFERED=1
# MLX keeps each JIT-compiled kernel (cubin) under MLX_PTX_CACHE_DIR, named by a hash of its
# source. Here it is .mlx-ptx in the checkout: carry it (`carry: [..., ".mlx-ptx"]`) and NVRTC
# compiles only what changed. PACK_PTX=1 sends it back as $OUT/mlx-ptx.tar.xz (the sources left
# out); unpack it here with `mkdir -p .mlx-ptx && tar xJf FILE -C .mlx-ptx`.
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-$PWD/.mlx-ptx}
mkdir -p "$MLX_PTX_CACHE_DIR"
pack_ptx() {
  [ "${PACK_PTX:-0}" = 1 ] || return 0
  (cd "$MLX_PTX_CACHE_DIR" && find . -name '*.cu' -delete && tar cf - . | xz -T0 -6 > $OUT/mlx-ptx.tar.xz)
  echo "ptx cache: $(ls "$MLX_PTX_CACHE_DIR" | wc -l) files, $(du -sh $OUT/mlx-ptx.tar.xz | cut -f1) packed"
}
trap pack_ptx EXIT
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
# The CUDA tests, in JOBS pytest-xdist workers (default 12: NVRTC compiles on the CPU, one kernel
# a second or so, and the GPU work of these tests is small); each worker's kernel cache starts
# as a copy of $MLX_PTX_CACHE_DIR and is merged back into it after (tests/conftest.py).
cuda_tests() {  # SECONDS OUTFILE PYTEST-ARGS...
  local limit=$1 out=$2; shift 2
  local base=$MLX_PTX_CACHE_DIR jobs=${JOBS:-12}
  for w in $(seq 0 $((jobs - 1))); do
    mkdir -p $base/gw$w && find $base -maxdepth 1 -type f -print0 | xargs -0 -r cp --update=none -t $base/gw$w/
  done
  OMNIA_TEST_PTX_CACHE=$base timeout $limit python3 -m pytest -q -m cuda -p no:cacheprovider -n $jobs -rf \
    tests/test_kernels_cuda.py "$@" > $out 2>&1
  local rc=$?
  for w in $(seq 0 $((jobs - 1))); do
    find $base/gw$w -maxdepth 1 -type f -print0 | xargs -0 -r cp --update=none -t $base/; rm -rf $base/gw$w
  done
  return $rc
}
moe_bench() {  # the MoE bench against mlx-lm (CT: time limit, RUNS, EXTRA: more arguments)
  local B="python3 ${BENCH_PY:--m mlx_omnia.bench.main} interleaved --model qwen3-30b-a3b --quantize 4 --prequantize"
  timeout ${CT:-400} $B --runs ${RUNS:-3} ${EXTRA:-} --json $OUT/moe.json 2>&1 | grep -v '^\[omnia-bench\] run' | tee $OUT/moe.txt
}
if [ "$1" = V ]; then
  end=$(( $(date +%s) + ${2:-540} )); n=0
  parts=("chain or project_route or project_attend" "model_greedy" "(experts or routed or route_matches or bind_only) and not chain and not project_route"
         "(qmv or linear or projections or attention) and not chain and not project_route and not project_attend")
  for part in "${parts[@]}"; do
    n=$((n + 1)); [ $n -lt ${3:-1} ] && continue
    left=$(( end - $(date +%s) )); [ $left -lt 30 ] && break
    cuda_tests $((left - 10)) $OUT/cuda_part$n.txt -k "$part"
    echo "== part $n: $part"; grep -E "passed|failed|skipped|FAILED|Error" $OUT/cuda_part$n.txt | tail -6
  done
elif [ "$1" = T ]; then
  cuda_tests "${3:-400}" $OUT/cuda_tests.txt --durations=8 -k "$2"
  tail -30 $OUT/cuda_tests.txt
elif [ "$1" = D ]; then
  export OVERHEAD_CKPT=/tmp/ovck
  P="python3 scripts/device/host_overhead.py qwen3-4b"
  timeout 240 $P 0 2>&1 | tee $OUT/overhead_bf16.txt
  for ops in 60 120 250; do
    MLX_MAX_OPS_PER_BUFFER=$ops OVERHEAD_SKIP_CHAIN=1 OVERHEAD_ARMS=omnia timeout 90 $P 0 2>&1 \
      | tee -a $OUT/overhead_bf16.txt
  done
  OVERHEAD_SKIP_CHAIN=1 timeout 150 $P 4 2>&1 | tee $OUT/overhead_q4.txt
elif [ "$1" = G ]; then
  export OVERHEAD_CKPT=/tmp/ovck
  OVERHEAD_ARMS=none timeout 60 python3 scripts/device/host_overhead.py qwen3-4b 0 2>&1 | grep chain | tee $OUT/chain.txt
  timeout 150 python3 scripts/device/ops_per_token.py qwen3-4b 0 2>&1 | tee $OUT/graph.txt
  timeout 100 python3 scripts/device/ops_per_token.py qwen3-4b 4 2>&1 | tee -a $OUT/graph.txt
  OVERHEAD_CKPT= timeout 150 python3 scripts/device/ops_per_token.py qwen3-30b-a3b 4 4 2>&1 | tee -a $OUT/graph.txt
elif [ "$1" = S ]; then
  SWEEP_FMTS=${2:-q4} timeout 300 $NCU --clock-control none --metrics gpu__time_duration.sum --csv \
    python3 scripts/device/qmv_sweep.py run $OUT/sweep.json > $OUT/sweep.csv 2>$OUT/sweep.err
  python3 scripts/device/qmv_sweep.py report $OUT/sweep.csv $OUT/sweep.json 2>&1 | tee $OUT/sweep.txt
  tail -3 $OUT/sweep.err
elif [ "$1" = E ]; then
  B="python3 -m mlx_omnia.bench.main interleaved --model qwen3-4b"
  for q in ${2:-0 4}; do
    QA=""; [ "$q" != 0 ] && QA="--quantize $q"
    timeout ${ET:-220} $B --runs ${RUNS:-3} $QA ${EXTRA:-} --json $OUT/bench_$q.json 2>&1 | grep -v '^\[omnia-bench\] run' | tee $OUT/bench_$q.txt
  done
elif [ "$1" = M ]; then
  # the MoE step's host and GPU time (48 layers, written 4-bit: the bf16 checkpoint would not fit)
  OVERHEAD_PREQUANTIZE=1 OVERHEAD_SKIP_CHAIN=1 timeout 300 python3 scripts/device/host_overhead.py \
    qwen3-30b-a3b 4 2>&1 | tee $OUT/overhead_moe.txt
elif [ "$1" = N ]; then
  # why the 4-bit gate/up GEMV runs at ~1.4 TB/s: stall reasons and source counters
  SWEEP_DEFAULTS=1 SWEEP_FMTS=q4 timeout 300 $NCU --clock-control none \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section SourceCounters \
    --section LaunchStats --kernel-name regex:'omnia_qmv_.*k2560_n9728_9728' \
    python3 scripts/device/qmv_sweep.py run $OUT/n.json > $OUT/ncu_gate_up_q4.txt 2>&1
  grep -v '^==PROF==' $OUT/ncu_gate_up_q4.txt | head -150
elif [ "$1" = P ]; then
  # host profile (nsys: MLX's NVTX ranges per primitive, CUDA API calls) of the MoE and the 4-bit
  # dense decode step, 8 layers each
  NSYS=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems*/*/bin/nsys /usr/local/cuda*/nsight-systems*/bin/nsys 2>/dev/null | head -1)
  echo "nsys: $NSYS"; ls /usr/local/cuda/bin | tr '\n' ' '; echo
  export OVERHEAD_SKIP_CHAIN=1 OVERHEAD_ARMS=omnia
  for m in "qwen3-30b-a3b 4 8" "qwen3-4b 4 8"; do
    tag=$(echo $m | tr ' ' _)
    OVERHEAD_PREQUANTIZE=1 timeout 200 $NSYS profile -t cuda,nvtx --sample=none --cpuctxsw=none \
      -o $OUT/$tag --force-overwrite true python3 scripts/device/host_overhead.py $m 48 2>&1 | grep -v "^Collecting\|^Generat\|^Processing" | tail -8
    $NSYS stats -q -r nvtx_sum,cuda_api_sum -f csv -o $OUT/$tag $OUT/$tag.nsys-rep > /dev/null 2>&1
    $NSYS stats -q -r nvtx_sum,cuda_api_sum $OUT/$tag.nsys-rep 2>&1 | cut -c1-170 | head -70
    rm -f $OUT/$tag.nsys-rep $OUT/$tag.sqlite
  done
elif [ "$1" = H ]; then
  # host time per token under MLX's CUDA graph knobs (graphs off; one graph a token), 4-bit
  # dense and the MoE, omnia only; `build` is the graph building before mx.async_eval
  export OVERHEAD_SKIP_CHAIN=1 OVERHEAD_ARMS=omnia OVERHEAD_NO_GENERATE=1
  for m in "qwen3-4b 4" "qwen3-30b-a3b 4 16"; do
    for knobs in "" "MLX_USE_CUDA_GRAPHS=0" "MLX_MAX_OPS_PER_BUFFER=2000 MLX_MAX_MB_PER_BUFFER=1000000"; do
      echo "-- $knobs"
      env $knobs OVERHEAD_PREQUANTIZE=1 OVERHEAD_CKPT=/tmp/ck_${m// /_} timeout 150 \
        python3 scripts/device/host_overhead.py $m 2>&1 | grep -v "^Device" | tee -a $OUT/host_knobs.txt
    done
  done
elif [ "$1" = A ]; then
  JE=$PWD/.device-tools/libjemalloc.so.2
  export OVERHEAD_SKIP_CHAIN=1 OVERHEAD_NO_GENERATE=1 OVERHEAD_PREQUANTIZE=1 OVERHEAD_PROMPT=512
  for m in "qwen3-4b 4 36 128" "qwen3-30b-a3b 4 16 128"; do
    for pre in "" "$JE" "" "$JE"; do
      echo "-- LD_PRELOAD=${pre:-none}"
      LD_PRELOAD=$pre OVERHEAD_CKPT=/tmp/ck_${m// /_} timeout 150 python3 scripts/device/host_overhead.py $m \
        2>&1 | grep -v "^Device" | tee -a $OUT/malloc.txt
    done
  done
elif [ "$1" = Y ]; then
  # py-spy's native unwinding is slow: a low rate and a bounded run, else it
  # falls behind and is killed before it writes (2026-12-03)
  rm -rf /tmp/pyspy && mkdir -p /tmp/pyspy && (cd /tmp/pyspy && python3 -m zipfile -e $OLDPWD/.device-tools/py_spy-*.whl .)
  SPY=$(ls /tmp/pyspy/py_spy-*.data/scripts/py-spy); chmod +x $SPY
  export OVERHEAD_PREQUANTIZE=1 OVERHEAD_SKIP_CHAIN=1 OVERHEAD_NO_GENERATE=1 OVERHEAD_ARMS=omnia OVERHEAD_CKPT=/tmp/ck
  M=${YM:-qwen3-4b 4 36}
  timeout ${YT1:-120} python3 scripts/device/host_overhead.py $M 8 2>&1 | tail -1  # writes the checkpoint, compiles the kernels
  timeout ${YT2:-200} $SPY record --native -r ${RATE:-40} -f raw -o /tmp/spy_q4.txt -- \
    python3 scripts/device/host_overhead.py $M ${STEPS:-1500} 2>&1 | tail -3
  [ -f /tmp/spy_q4.txt ] && gzip -c /tmp/spy_q4.txt > $OUT/spy_q4.txt.gz
  [ -f /tmp/spy_q4.txt ] && for mk in time_feed async_eval CompiledStep.__call__; do
    python3 scripts/device/spy_report.py /tmp/spy_q4.txt $mk 45; done | tee $OUT/spy_q4_report.txt
elif [ "$1" = K ]; then
  # GPU time per kernel of one decode step (ncu, kernels serialized): the MoE's and the dense
  # 4-bit / bf16 step, 2 layers each, with the chained launches
  # KM: which of them (default all four), e.g. KM="q4_qwen3-30b-a3b_2 q4_qwen3-4b_2"
  for m in ${KM:-q4_qwen3-30b-a3b_2 q4_qwen3-30b-a3b_2_unchained q4_qwen3-4b_2 bf16_qwen3-4b_2}; do
    m=$(echo $m | tr _ ' ')
    tag=$(echo $m | tr ' ' _); set -- $m
    chained=1; [ "$4" = unchained ] && chained=0
    OMNIA_CHAINED_KERNELS=$chained timeout ${KT:-150} $NCU --clock-control none \
      --metrics gpu__time_duration.sum --csv python3 scripts/device/kernel_times.py run $1 $2 $3 \
      > /tmp/ncu_$tag.csv 2>/tmp/ncu_$tag.err
    full=36; [ "$2" = qwen3-30b-a3b ] && full=48
    { python3 scripts/device/kernel_times.py report /tmp/ncu_$tag.csv 2 $full; tail -3 /tmp/ncu_$tag.err; } 2>&1 \
      | tee $OUT/ncu_$tag.txt
  done
elif [ "$1" = O ]; then
  # occupancy, waves, warp states of the MoE's chained launches (ncu sections, 2 layers)
  timeout ${OT:-300} $NCU --clock-control none --section SpeedOfLight --section Occupancy \
    --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis --section SchedulerStats \
    --kernel-name regex:"${OK:-project_attend|experts_chain|project_route}" --launch-count 3 \
    python3 scripts/device/kernel_times.py run q4 qwen3-30b-a3b 2 > $OUT/ncu_sections.txt 2>&1
  grep -v "^==PROF==" $OUT/ncu_sections.txt | grep -E "custom_kernel|Duration|Registers Per|Occupancy|Block Limit|Eligible|Waves|Grid Size|Throughput" | cut -c1-150
elif [ "$1" = R ]; then
  # this tree against the one in .bench-ref (`mkdir -p .bench-ref && git archive REV src | tar -x
  # -C .bench-ref` here, then carry it): omnia-bench paired, each arm in its own process
  timeout ${RT:-420} python3 -m mlx_omnia.bench.main paired --ref .bench-ref ${2:---model qwen3-4b --quantize 4} \
    --runs ${RUNS:-4} --json $OUT/paired.json 2>&1 | grep -v '^\[omnia-bench\] run' | tee $OUT/paired.txt
elif [ "$1" = W ]; then
  # the step's timeline (globaltimer stamps of every chained launch's blocks) and the host time
  # to queue a step: WM="SHAPE LAYERS FMT" (default the MoE at 48 layers, 4-bit), then the
  # host cost of a launch's inputs and outputs (launch_slot_cost.py)
  timeout ${WT:-240} python3 scripts/device/layer_trace.py ${WM:-qwen3-30b-a3b 48 q4} 2>&1 | grep -v Warning | tee $OUT/trace.txt
  timeout 120 python3 scripts/device/launch_slot_cost.py 2>&1 | tee $OUT/slots.txt
elif [ "$1" = X ]; then
  # the new bit-equality tests first (a variant whose kernel is wrong would fault the A/B)
  if [ "${XTESTS:-1}" = 1 ]; then
    cuda_tests ${XT0:-120} $OUT/new_tests.txt -k "head_split or routed_by_every"
    grep -E "passed|failed|FAILED|Error" $OUT/new_tests.txt | tail -4
  fi
  TRACE=1 timeout ${XT:-230} python3 scripts/device/kernel_ab.py ${2:-qkv_prefetch_all,attention_head_split,attention_head_split+qkv_prefetch_all,local_route,project_prefetch_all} \
    qwen3-30b-a3b ${XL:-48} ${ROUNDS:-10} 2>&1 | grep -v "Warn\|^  @" > $OUT/ab_trace.txt
  grep -E "^==|step median|last logits|^B /|skipped|span  |by phase|projection |router|gate/up |down |last 8 ends|B end median|A last end|B run after|B released med" $OUT/ab_trace.txt
  [ "${XATT:-1}" = 1 ] && timeout 45 python3 scripts/device/attention_trace.py 4 600 768 chained 2>&1 | grep -v Warn | tail -16 | tee $OUT/att_trace.txt
  # the bench with the A/B's winner (the fastest arm with the tree's bits, > WIN faster), if any
  win=$(sed -n 's/^WINNER: //p' $OUT/ab_trace.txt); echo "A/B winner: ${win:-none}"
  [ "${XBENCH:-1}" = 1 ] && BENCH_PY="scripts/device/bench_variant.py ${win:-none}" \
    CT=${CT:-170} RUNS=${RUNS:-2} moe_bench
elif [ "$1" = L ]; then
  # prefill at a long prompt (4096 tokens, --runs 1), bf16 and 4-bit qwen3-4b
  for q in "" "--quantize 4"; do
    timeout 150 python3 -m mlx_omnia.bench.main interleaved --model qwen3-4b --prompt 4096 \
      --generate 32 --runs ${RUNS:-1} $q 2>&1 | grep -v '^\[omnia-bench\]' | tail -4 | tee -a $OUT/long.txt
  done
elif [ "$1" = C ]; then
  moe_bench
else
  for fmt in bf16 q4; do
    timeout 100 $NCU --clock-control none --metrics gpu__time_duration.sum --csv \
      python3 scripts/device/kernel_times.py run $fmt > $OUT/ncu_$fmt.csv 2>$OUT/ncu_$fmt.err
    python3 scripts/device/kernel_times.py report $OUT/ncu_$fmt.csv 2>&1 | tee $OUT/ncu_$fmt.txt
  done
  B="python3 -m mlx_omnia.bench.main interleaved --model qwen3-4b"
  timeout 170 $B --runs 3 --json $OUT/bf16.json 2>&1 | grep -v '^\[omnia-bench\] run' | tee $OUT/bf16.txt
  timeout 170 $B --runs 3 --quantize 4 --json $OUT/q4.json 2>&1 | grep -v '^\[omnia-bench\] run' | tee $OUT/q4.txt
fi
