#!/usr/bin/env bash
# Training step of a residual SwiGLU model against a plain MLP with the same GEMM FLOPs, per
# mode, and the cost model's prediction of each (JSON lines, one per model and mode).
#
#   [STEPS=6] [ROUNDS=1] [MESHTRAIN=build/bin/meshtrain] bench/residual_step.sh [NP] [MODES] [BATCH]
#       defaults: 2 "dp fsdp tp" 256
# With ROUNDS=R every mode is calibrated, predicted and measured R times, the rounds one after
# the other (a noisy neighbour then spoils one round, not one mode's every figure); each line
# carries "round", and a last line per (model, mode) has "summary": true with the medians
# over the rounds of the step time, the prediction and their ratio.
#
# residual: residual_mlp inputs 1024, width 1024, hidden 4096, depth 4, rmsnorm, swiglu,
#   outputs 10: GEMMs per row 1024x1024 + 4 x 3 x (1024x4096) + 1024x10 multiply-adds.
# plain: mlp sizes [1024, 1024, (4096, 1024) x 6, 10], relu: 1024x1024 + 12 x (1024x4096)
#   + 1024x10 multiply-adds, the same GEMM FLOPs per step.
# Synthetic data (mse loss), adamw. Each run trains STEPS steps with log_every = 1; the first
# step is warm-up and left out, step_time_median_s is the median of the others (from
# metrics.jsonl samples_per_s, the slowest rank's interval). Before it, `meshtrain calibrate`
# of the same config writes a hardware profile (wall clock) and `meshtrain plan --hardware`
# prints the predicted step; predicted_over_measured is their ratio. residual lines also carry
# per_flop_cost_ratio = residual step time / plain step time of the same mode (equal FLOPs).
# Mode tp_rows: the tp mesh with every weight row-parallel, P(tp, None) (the residual_mlp tp
# layout before the column-/row-parallel pair; the plain MLP's tp preset is that already), so
# `bench/residual_step.sh 2 "tp tp_rows tp tp_rows"` compares both layouts interleaved.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
np=${1:-2}
modes=${2:-"dp fsdp tp"}
batch=${3:-256}
steps=${STEPS:-6}
meshtrain=${MESHTRAIN:-build/bin/meshtrain}
mpirun=${MPIRUN:-mpirun --oversubscribe}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

residual_model='kind = "residual_mlp"
inputs = 1024
outputs = 10
width = 1024
hidden = 4096
depth = 4
norm = "rmsnorm"
activation = "swiglu"'
plain_model='kind = "mlp"
sizes = [1024, 1024, 4096, 1024, 4096, 1024, 4096, 1024, 4096, 1024, 4096, 1024, 4096, 1024, 10]
activation = "relu"'

write_config() {  # NAME MODE MODEL FILE
  local axis=$2 partition="preset = \"$2\""
  if [[ $2 == tp_rows ]]; then
    axis=tp
    partition='preset = "tp"
rules = [["weight$", "P(tp, None)"], ["(bias|scale)$", "P(tp)"]]'
  fi
  cat > "$4" <<TOML
[run]
name = "$1"
seed = 0
output_dir = "$work/$1"
[mesh]
$axis = -1
[partition]
$partition
min_sharding_size = 0
[model]
$3
init = "he_normal"
loss = "mse"
[data]
source = "synthetic"
synthetic_samples = 4096
batch_size = $batch
[optimizer]
kind = "adamw"
lr = 1e-3
[train]
steps = $steps
log_every = 1
[checkpoint]
every_steps = 0
keep = 1
TOML
}

results=$work/results.jsonl
: > "$results"
declare -A plain_step
for round in $(seq 1 "${ROUNDS:-1}"); do
for mode in $modes; do
  for model in plain residual; do
    name=${model}_$mode
    var=${model}_model
    write_config "$name" "$mode" "${!var}" "$work/$name.toml"
    rm -rf "${work:?}/$name"  # a fresh run directory each round
    $mpirun -np "$np" "$meshtrain" calibrate "$work/$name.toml" --out "$work/$name.hw.toml" \
      > "$work/$name.calibrate.log" 2>&1 || { cat "$work/$name.calibrate.log" >&2; exit 1; }
    "$meshtrain" plan "$work/$name.toml" --world "$np" --hardware "$work/$name.hw.toml" \
      > "$work/$name.plan" 2>&1 || { cat "$work/$name.plan" >&2; exit 1; }
    $mpirun -np "$np" "$meshtrain" train "$work/$name.toml" > "$work/$name.log" 2>&1 ||
      { cat "$work/$name.log" >&2; exit 1; }
    line=$(python3 - "$work/$name/metrics.jsonl" "$work/$name.plan" "$model" "$mode" "$np" \
      "$batch" "$([[ $model == residual ]] && echo "${plain_step[$mode]:-}")" "$round" <<'PY'
import json, re, statistics, sys
metrics, plan, model, mode, np_, batch, plain, round_ = sys.argv[1:]
batch = int(batch)
rates = [r["samples_per_s"] for r in map(json.loads, open(metrics))
         if r.get("event") == "log" and r["step"] >= 2]
if not rates:
    sys.exit(f"{metrics}: no log record after the first step")
step = statistics.median(batch / r for r in rates)
m = re.search(r"predicted ([0-9.]+) (us|ms|s) per step", open(plan).read())
if not m:
    sys.exit(f"{plan}: no predicted step time")
predicted = float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[m.group(2)]
macs_per_row = 1024 * 1024 + 12 * 1024 * 4096 + 1024 * 10
line = {"bench": "residual_step", "round": int(round_), "model": model, "mode": mode,
        "np": int(np_), "batch": batch,
        "gemm_macs_per_row": macs_per_row, "steps_timed": len(rates),
        "step_time_median_s": round(step, 4), "samples_per_s": round(batch / step, 1),
        "predicted_step_time_s": round(predicted, 4),
        "predicted_over_measured": round(predicted / step, 3)}
if plain:
    line["per_flop_cost_ratio"] = round(step / float(plain), 3)
print(json.dumps(line))
PY
)
    echo "$line" | tee -a "$results"
    if [[ $model == plain ]]; then
      plain_step[$mode]=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["step_time_median_s"])' "$line")
    fi
  done
done
done
if [[ ${ROUNDS:-1} -gt 1 ]]; then
  python3 - "$results" <<'PY'
import json, statistics, sys
runs = {}
for line in open(sys.argv[1]):
    d = json.loads(line)
    runs.setdefault((d["model"], d["mode"]), []).append(d)
for (model, mode), rs in runs.items():
    med = lambda key: statistics.median(r[key] for r in rs if key in r)
    out = {"summary": True, "model": model, "mode": mode, "np": rs[0]["np"], "rounds": len(rs),
           "step_time_median_s": med("step_time_median_s"),
           "predicted_step_time_s": med("predicted_step_time_s"),
           "predicted_over_measured": med("predicted_over_measured")}
    if model == "residual":
        out["per_flop_cost_ratio"] = med("per_flop_cost_ratio")
    print(json.dumps(out))
PY
fi
