#!/usr/bin/env bash
# Cost model vs measured step time (JSON lines, one per run, from bench_train_step with
# --hardware): for each process count, `meshtrain calibrate` at that count first, then each
# mode's training step timed and predicted from the same profile.
#
#   bench/validate_cost_model.sh [NPS] [MODES] [SIZES] [BATCH]
#       defaults: "1 2 4" "dp fsdp tp fsdp_tp" 784,2048,2048,10 128
#   Across simulated hosts (one rank per host, links limited to 300 Mbit/s):
#   scripts/simhosts shell --hosts 2 --slots 1 --rate 300mbit -- \
#       bash -c 'MPIRUN="$SIMHOSTS_MPIRUN" bench/validate_cost_model.sh 2'
# Each line is bench_train_step's (step_time_median_s, predicted_step_time_s,
# predicted_over_measured, predicted_parts_s) plus "np".
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
nps=${1:-"1 2 4"}
modes=${2:-"dp fsdp tp fsdp_tp"}
sizes=${3:-784,2048,2048,10}
batch=${4:-128}
mpirun=${MPIRUN:-mpirun --oversubscribe}
hw=$(mktemp -d)
trap 'rm -rf "$hw"' EXIT
for np in $nps; do
  $mpirun -np "$np" build/bin/meshtrain calibrate --out "$hw/np$np.toml" > /dev/null
  for mode in $modes; do
    if [[ $mode == *_tp && $np -lt 2 ]]; then continue; fi
    $mpirun -np "$np" build/bin/bench_train_step --sizes "$sizes" --batch "$batch" --mode "$mode" \
      --steps 5 --warmup 1 --sgemm-size 512 --hardware "$hw/np$np.toml" |
      python3 -c 'import json,sys
for l in sys.stdin:
  d=json.loads(l); d["np"]='"$np"'; print(json.dumps(d))'
  done
done
