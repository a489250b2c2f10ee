#!/usr/bin/env bash
# meshtrain's bf16 step against PyTorch 1.13's CPU bf16 autocast under DDP on the same cores
# (issue 37, "Measured"; docs/mixed_precision.md, "Against PyTorch's bf16 autocast under DDP"):
# 784-4096-4096-10, batch 256, 2 ranks, one thread each. Round by round, for fp32 and then bf16:
# PyTorch DDP (bench/pytorch_train_step.py --ranks 2: gloo on localhost, 128 rows a rank,
# torch.autocast("cpu", dtype=torch.bfloat16) for bf16, gradients all-reduced in fp32), then
# meshtrain's bench_train_step at np 2 in each mode (dp, fsdp, tp; oneDNN; param_dtype and
# reduce_dtype both the dtype), so that the load slows neighbours alike. One JSON line per run,
# and one per round with /proc/loadavg at its start. Compare step_cpu_time_median_s (both sides:
# the slowest rank's CPU time per step, all its threads, median over the timed steps) and
# step_time_median_s (wall, barrier to barrier).
#
#   [ROUNDS=3] [STEPS=5] [MODES="dp fsdp tp"] bench/bf16_vs_torch_ddp.sh [BIN]
#   (BIN: the bin directory holding bench_train_step, default build/bin)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh >/dev/null
bin=${1:-build/bin}
rounds=${ROUNDS:-3}
steps=${STEPS:-5}
mpirun=${MPIRUN:-mpirun --oversubscribe}
python=${PYTHON:-/usr/bin/python3}
for round in $(seq 1 "$rounds"); do
  echo "{\"round\": $round, \"load\": \"$(cut -d' ' -f1-3 /proc/loadavg)\", \"date\": \"$(date -u +%FT%TZ)\"}"
  for dtype in fp32 bf16; do
    line=$("$python" bench/pytorch_train_step.py --ranks 2 --threads 1 --sizes 784,4096,4096,10 \
      --batch 256 --param-dtype "$dtype" --steps "$steps" --warmup 1 | tail -1)
    echo "{\"side\": \"pytorch_ddp\", \"dtype\": \"$dtype\", \"round\": $round, \"result\": $line}"
    for mode in ${MODES:-dp fsdp tp}; do
      line=$(MESHTRAIN_CPU_GEMM=onednn $mpirun -np 2 "$bin/bench_train_step" \
        --sizes 784,4096,4096,10 --batch 256 --mode "$mode" --steps "$steps" --warmup 1 \
        --sgemm-size 512 --param-dtype "$dtype" --reduce-dtype "$dtype" | tail -1)
      echo "{\"side\": \"meshtrain\", \"mode\": \"$mode\", \"dtype\": \"$dtype\", \"round\": $round, \"result\": $line}"
    done
  done
done
