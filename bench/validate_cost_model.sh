#!/usr/bin/env bash
# Cost model vs measured step time (JSON lines, one per run, from bench_train_step with
# --hardware): for each process count and mode, `meshtrain calibrate` of a config with that
# mode's mesh, model and batch first (so the profile holds its GEMM shapes' rates), then the
# mode's training step timed and predicted from that profile.
#
#   [STEPS=5] bench/validate_cost_model.sh [NPS] [MODES] [SIZES] [BATCH]
#       defaults: "1 2 4" "dp fsdp tp fsdp_tp" 784,2048,2048,10 128
#       a mode may end in ":overlap" ([runtime] overlap = true, the FSDP weight prefetch),
#       e.g. "fsdp fsdp:overlap zero1"
#   Across simulated hosts (one rank per host, links limited to 300 Mbit/s):
#   scripts/simhosts shell --hosts 2 --slots 1 --rate 300mbit -- \
#       bash -c 'MPIRUN="$SIMHOSTS_MPIRUN" bench/validate_cost_model.sh 2'
# Each line is bench_train_step's (step_time_median_s and step_cpu_time_median_s, the
# slowest rank's; predicted_step_time_s, predicted_over_measured;
# predicted_cpu_s from a profile calibrated with --clock cpu and
# predicted_cpu_over_measured_cpu; predicted_parts_s) plus "np" and "round". With ROUNDS=R
# (default 1) every (np, mode) is calibrated and measured R times, the rounds one after the
# other (a noisy neighbour then spoils one round, not one mode's every figure), and a last
# line per (np, mode) has "summary": true and the median over the rounds of each ratio.
# The profiles are kept in $KEEP_PROFILES when set.
# RESIDUAL=WIDTH,HIDDEN,DEPTH measures a residual_mlp instead (inputs and outputs: the first
# and last of SIZES; NORM=rmsnorm and ACTIVATION=swiglu unless set), e.g. issue 27's model:
#   RESIDUAL=1024,4096,4 ROUNDS=3 bench/validate_cost_model.sh 2 "dp fsdp tp" 1024,10 256
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
# The benchmarks are not in `all` after scripts/test (MESHTRAIN_BUILD_BENCHMARKS=OFF).
cmake --build build --target meshtrain bench_train_step >&2
nps=${1:-"1 2 4"}
modes=${2:-"dp fsdp tp fsdp_tp"}
sizes=${3:-784,2048,2048,10}
batch=${4:-128}
mpirun=${MPIRUN:-mpirun --oversubscribe}
hw=${KEEP_PROFILES:-$(mktemp -d)}
mkdir -p "$hw"
[[ -n ${KEEP_PROFILES:-} ]] || trap 'rm -rf "$hw"' EXIT
# The config bench_train_step --mode builds (bench/train_step.cpp: axes_for_mode).
write_config() {  # MODE NP FILE
  local mode=$1 np=$2 mesh preset=$1 zero=0
  case $mode in
    dp | fsdp | tp) mesh="$mode = $np" ;;
    zero1) mesh="dp = $np" preset=dp zero=1 ;;
    fsdp_tp) mesh=$'fsdp = -1\ntp = 2' ;;
    dp_tp) mesh=$'dp = -1\ntp = 2' ;;
    dp_fsdp) mesh=$'dp = -1\nfsdp = 2' ;;
  esac
  cat > "$3" <<TOML
[mesh]
$mesh
[partition]
preset = "$preset"
min_sharding_size = 0
[model]
$model_section
[data]
source = "synthetic"
batch_size = $batch
[optimizer]
zero_stage = $zero
TOML
}
residual_args=()
if [[ -n ${RESIDUAL:-} ]]; then
  IFS=, read -r width hidden depth <<< "$RESIDUAL"
  IFS=, read -r -a size_list <<< "$sizes"
  model_section="kind = \"residual_mlp\"
inputs = ${size_list[0]}
outputs = ${size_list[-1]}
width = $width
hidden = $hidden
depth = $depth
norm = \"${NORM:-rmsnorm}\"
activation = \"${ACTIVATION:-swiglu}\""
  residual_args=(--residual "$RESIDUAL" --norm "${NORM:-rmsnorm}" --activation "${ACTIVATION:-swiglu}")
else
  model_section="kind = \"mlp\"
sizes = [$sizes]"
fi
results=$hw/results.jsonl
: > "$results"
for round in $(seq 1 "${ROUNDS:-1}"); do
for np in $nps; do
  for entry in $modes; do
    mode=${entry%:overlap}
    overlap=0
    [[ $entry == *:overlap ]] && overlap=1
    if [[ $mode == *_tp && $np -lt 2 ]]; then continue; fi
    profile=$hw/np$np-$mode
    write_config "$mode" "$np" "$profile.config.toml"
    $mpirun -np "$np" build/bin/meshtrain calibrate "$profile.config.toml" --out "$profile.toml" > /dev/null
    $mpirun -np "$np" build/bin/meshtrain calibrate "$profile.config.toml" --clock cpu \
      --out "$profile-cpu.toml" > /dev/null
    $mpirun -np "$np" build/bin/bench_train_step --sizes "$sizes" --batch "$batch" --mode "$mode" \
      --overlap "$overlap" --steps "${STEPS:-5}" --warmup 1 --sgemm-size 512 --hardware "$profile.toml" \
      --hardware-cpu "$profile-cpu.toml" "${residual_args[@]}" |
      python3 -c 'import json,sys
for l in sys.stdin:
  d=json.loads(l); d["np"]='"$np"'; d["round"]='"$round"'; print(json.dumps(d))' |
      tee -a "$results"
  done
done
done
[[ ${ROUNDS:-1} -gt 1 ]] && python3 - "$results" <<'PY'
import json, statistics, sys
runs = {}
for line in open(sys.argv[1]):
    d = json.loads(line)
    runs.setdefault((d["np"], d["mode"], d["overlap"]), []).append(d)
for (np, mode, overlap), rs in runs.items():
    med = lambda key: statistics.median(r[key] for r in rs)
    print(json.dumps({"summary": True, "np": np, "mode": mode, "overlap": overlap,
                      "rounds": len(rs), "step_time_median_s": med("step_time_median_s"),
                      "predicted_step_time_s": med("predicted_step_time_s"),
                      "predicted_over_measured": med("predicted_over_measured"),
                      "predicted_cpu_over_measured_cpu": med("predicted_cpu_over_measured_cpu")}))
PY
