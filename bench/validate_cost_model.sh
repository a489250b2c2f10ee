#!/usr/bin/env bash
# Cost model vs measured step time (JSON lines, one per run, from bench_train_step with
# --hardware): for each process count, `meshtrain calibrate` at that count first, then each
# mode's training step timed and predicted from the same profile.
#
#   bench/validate_cost_model.sh [NPS] [MODES] [SIZES] [BATCH]
#       defaults: "1 2 4" "dp fsdp tp fsdp_tp" 784,2048,2048,10 128
#       a mode may end in ":overlap" ([runtime] overlap = true, the FSDP weight prefetch),
#       e.g. "fsdp fsdp:overlap zero1"
#   Across simulated hosts (one rank per host, links limited to 300 Mbit/s):
#   scripts/simhosts shell --hosts 2 --slots 1 --rate 300mbit -- \
#       bash -c 'MPIRUN="$SIMHOSTS_MPIRUN" bench/validate_cost_model.sh 2'
# Each line is bench_train_step's (step_time_median_s and step_cpu_time_median_s, the
# slowest rank's; predicted_step_time_s, predicted_over_measured;
# predicted_cpu_s from a profile calibrated with --clock cpu and
# predicted_cpu_over_measured_cpu; predicted_parts_s) plus "np". The profiles are kept in $KEEP_PROFILES when set.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
nps=${1:-"1 2 4"}
modes=${2:-"dp fsdp tp fsdp_tp"}
sizes=${3:-784,2048,2048,10}
batch=${4:-128}
mpirun=${MPIRUN:-mpirun --oversubscribe}
hw=${KEEP_PROFILES:-$(mktemp -d)}
mkdir -p "$hw"
[[ -n ${KEEP_PROFILES:-} ]] || trap 'rm -rf "$hw"' EXIT
for np in $nps; do
  $mpirun -np "$np" build/bin/meshtrain calibrate --out "$hw/np$np.toml" > /dev/null
  $mpirun -np "$np" build/bin/meshtrain calibrate --clock cpu --out "$hw/np$np-cpu.toml" > /dev/null
  for entry in $modes; do
    mode=${entry%:overlap}
    overlap=0
    [[ $entry == *:overlap ]] && overlap=1
    if [[ $mode == *_tp && $np -lt 2 ]]; then continue; fi
    $mpirun -np "$np" build/bin/bench_train_step --sizes "$sizes" --batch "$batch" --mode "$mode" \
      --overlap "$overlap" --steps 5 --warmup 1 --sgemm-size 512 --hardware "$hw/np$np.toml" \
      --hardware-cpu "$hw/np$np-cpu.toml" |
      python3 -c 'import json,sys
for l in sys.stdin:
  d=json.loads(l); d["np"]='"$np"'; print(json.dumps(d))'
  done
done
