#!/usr/bin/env bash
# Activation and gathered-weight memory and step time of 16-bit storage (docs/mixed_precision.md,
# "Compute and memory on this build"): an MLP 784-1024-1024-10, batch 512, FSDP (PRESET=dp: DP),
# in fp32, bf16 and fp16, on np 1 and 2 (JSON lines, one per run).
#
#   [STEPS=12] [ROUNDS=1] [OVERLAP=false] [PRESET=fsdp] [MESHTRAIN=build/bin/meshtrain]
#   [BEFORE=other/bin/meshtrain] bench/bf16_storage.sh [NPS]          default NPS "1 2"
# With BEFORE, each (np, dtype) runs that binary too ("build": "before", this one "this"),
# the two one after the other, so that a noisy neighbour spoils both or neither. Each line has
# the plan's activation bytes per rank (`meshtrain plan --json`, totals.activation_bytes: what
# the memory tracker measures, to the byte, as train_memory_plan_test checks on dp and fsdp in
# bf16), its gathered-weight bytes (the shared scratch, and the weights' 16-bit compute copies
# of which sixteen_bit_copy_bytes says how much) and total bytes per rank, with OVERLAP=true the
# FSDP prefetch ([runtime] overlap), the Kokkos peak per rank at the end (max over ranks, from
# metrics.jsonl's last memory event), and the median step time over steps 2..STEPS (from metrics.jsonl's samples_per_s, the
# slowest rank's interval). Synthetic data, mse, adamw.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
nps=${1:-"1 2"}
steps=${STEPS:-12}
meshtrain=${MESHTRAIN:-build/bin/meshtrain}
builds="this=$meshtrain"
[[ -n ${BEFORE:-} ]] && builds="$builds before=$BEFORE"
mpirun=${MPIRUN:-mpirun --oversubscribe}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

write_config() {  # NAME DTYPE FILE
  cat > "$3" <<TOML
[run]
name = "$1"
seed = 0
output_dir = "$work/$1"
[mesh]
${PRESET:-fsdp} = -1
[partition]
preset = "${PRESET:-fsdp}"
min_sharding_size = 0
[model]
sizes = [784, 1024, 1024, 10]
activation = "relu"
init = "he_normal"
loss = "mse"
[mixed_precision]
param_dtype = "$2"
reduce_dtype = "$2"
[data]
source = "synthetic"
synthetic_samples = 4096
batch_size = 512
[runtime]
overlap = ${OVERLAP:-false}
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

for round in $(seq 1 "${ROUNDS:-1}"); do
  for np in $nps; do
    for dtype in fp32 bf16 fp16; do
      for build in $builds; do
        label=${build%%=*} binary=${build#*=}
        name=${label}_${dtype}_np$np
        write_config "$name" "$dtype" "$work/$name.toml"
        rm -rf "${work:?}/$name"
        "$binary" plan "$work/$name.toml" --world "$np" --json > "$work/$name.plan.json" \
          2> "$work/$name.plan.err" || { cat "$work/$name.plan.err" >&2; exit 1; }
        $mpirun -np "$np" "$binary" train "$work/$name.toml" > "$work/$name.log" 2>&1 ||
          { cat "$work/$name.log" >&2; exit 1; }
        python3 - "$work/$name/metrics.jsonl" "$work/$name.plan.json" "$label" "$dtype" "$np" \
          "$round" "${OVERLAP:-false}" "${PRESET:-fsdp}" <<'PY'
import json, statistics, sys
metrics, plan, label, dtype, np_, round_, overlap, mode = sys.argv[1:]
records = [json.loads(line) for line in open(metrics)]
rates = [r["samples_per_s"] for r in records if r.get("event") == "log" and r["step"] >= 2]
if not rates:
    sys.exit(f"{metrics}: no log record after the first step")
memory = [r for r in records if r.get("event") == "memory"]
step = statistics.median(512 / r for r in rates)
totals = json.load(open(plan))["totals"]
planned = totals["activation_bytes"]
print(json.dumps({"bench": "bf16_storage", "build": label, "round": int(round_),
                  "model": "784-1024-1024-10", "mode": mode, "np": int(np_), "batch": 512,
                  "dtype": dtype, "overlap": overlap == "true",
                  "activation_bytes": planned,
                  "gathered_weight_bytes": totals["gathered_weight_bytes"],
                  "sixteen_bit_copy_bytes": totals.get("sixteen_bit_copy_bytes", 0),
                  "bytes_per_rank": totals["bytes_per_rank"],
                  "kokkos_peak_bytes": max(memory[-1]["kokkos_peak_bytes"]) if memory else None,
                  "steps_timed": len(rates), "step_time_median_s": round(step, 4)}))
PY
      done
    done
  done
done
