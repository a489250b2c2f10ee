#!/usr/bin/env bash
# bf16 against fp32 on this CPU (docs/mixed_precision.md, "Measured on a CPU with AVX512_BF16"):
# the training step of 784-4096-4096-10, batch 256, np 2, in dp, fsdp and tp, in fp32 (OpenBLAS,
# the default, and oneDNN) and bf16 (param_dtype and reduce_dtype bf16, on oneDNN: its bf16
# matmul where the CPU has AVX512_BF16), bench_train_step's JSON line for each, one variant after
# the other round by round so that other processes' load slows them alike; with BEFORE (a
# directory holding another build's bench_train_step), that build runs each variant too, right
# before this one. A line per round with /proc/loadavg. Compare step_cpu_time_median_s (the
# slowest rank's thread CPU time: the neighbours' load moves it less than wall time). OVERLAP=1
# runs every step with [runtime] overlap (DP's gradient buckets, FSDP's prefetch; default off: the
# blocking reductions).
#
#   [ROUNDS=2] [STEPS=5] [MODES="dp fsdp tp"] [OVERLAP=0|1] [BEFORE=/tmp/before/bin]
#   bench/bf16_step.sh [BIN]
#   (BIN: this build's bin directory, default build/bin)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh >/dev/null
this=${1:-build/bin}
rounds=${ROUNDS:-2}
steps=${STEPS:-5}
mpirun=${MPIRUN:-mpirun --oversubscribe}
builds="this=$this"
[[ -n ${BEFORE:-} ]] && builds="before=$BEFORE $builds"
for round in $(seq 1 "$rounds"); do
  echo "{\"round\": $round, \"load\": \"$(cut -d' ' -f1-3 /proc/loadavg)\"}"
  for mode in ${MODES:-dp fsdp tp}; do
    for variant in fp32:openblas fp32:onednn bf16:onednn; do
      dtype=${variant%%:*} library=${variant##*:}
      for build in $builds; do
        name=${build%%=*} bin=${build#*=}
        line=$(MESHTRAIN_CPU_GEMM=$library $mpirun -np 2 "$bin/bench_train_step" \
          --sizes 784,4096,4096,10 --batch 256 --mode "$mode" --steps "$steps" --warmup 1 \
          --sgemm-size 512 --param-dtype "$dtype" --reduce-dtype "$dtype" \
          --overlap "${OVERLAP:-0}" | tail -1)
        echo "{\"build\": \"$name\", \"gemm\": \"$library\", \"round\": $round, \"result\": $line}"
      done
    done
  done
done
