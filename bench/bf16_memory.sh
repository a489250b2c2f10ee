#!/usr/bin/env bash
# Memory per rank under bf16 against fp32 (issue 37: activations at most 0.55 of fp32's in every
# mode, FSDP's gathered weights at most 0.55, no mode's total above fp32's), planned and measured:
# an MLP 784-4096-4096-10, batch 256, np 2, in dp, fsdp, tp and fsdp_tp (fsdp_tp at np 2: fsdp 1 x
# tp 2), with the FSDP prefetch ([runtime] overlap = true), fp32 and bf16. One JSON line per run:
# the plan's bytes per rank from `meshtrain plan --json` (totals: activation_bytes,
# gathered_weight_bytes, bytes_per_rank) and the memory tracker's after STEPS steps, by plan item
# (bench_memory_items: the live Kokkos bytes matched to each item on the rank with the largest
# live total, and the shared weight scratch by label as "weight buffers"; rank 0's activations by
# label as activation_bytes_rank0), then one line per mode
# with bf16 over fp32.
#
#   [STEPS=2] [MODES="dp fsdp tp fsdp_tp"] [MESHTRAIN=build/bin/meshtrain]
#   [ITEMS=build/bin/bench_memory_items] bench/bf16_memory.sh [NP]          default NP 2
# Synthetic data (regression targets), mse, adamw. The plan is the run's only on a machine like
# the run's with its MESHTRAIN_CPU_GEMM (docs/mixed_precision.md: where gemm()'s kernel reads
# bf16, the weights have 16-bit copies and the shared weight buffer is 2 bytes an element).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
np=${1:-2}
steps=${STEPS:-2}
meshtrain=${MESHTRAIN:-build/bin/meshtrain}
items=${ITEMS:-build/bin/bench_memory_items}
mpirun=${MPIRUN:-mpirun --oversubscribe}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

mesh_of() {  # MODE
  case $1 in
    fsdp_tp) echo "tp = 2
fsdp = -1" ;;
    *) echo "$1 = -1" ;;
  esac
}

write_config() {  # NAME MODE DTYPE FILE
  cat > "$4" <<TOML
[run]
name = "$1"
seed = 0
output_dir = "$work/$1"
[mesh]
$(mesh_of "$2")
[partition]
preset = "$2"
min_sharding_size = 0
[model]
sizes = [784, 4096, 4096, 10]
activation = "relu"
init = "he_normal"
loss = "mse"
[mixed_precision]
param_dtype = "$3"
reduce_dtype = "$3"
[data]
source = "synthetic"
synthetic_samples = 512
batch_size = 256
[runtime]
overlap = true
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

lines=$work/lines.jsonl
for mode in ${MODES:-dp fsdp tp fsdp_tp}; do
  for dtype in fp32 bf16; do
    name=${mode}_${dtype}
    write_config "$name" "$mode" "$dtype" "$work/$name.toml"
    "$meshtrain" plan "$work/$name.toml" --world "$np" --json > "$work/$name.plan.json" \
      2> "$work/$name.plan.err" || { cat "$work/$name.plan.err" >&2; exit 1; }
    $mpirun -np "$np" "$items" "$work/$name.toml" > "$work/$name.items.json" 2> "$work/$name.err" ||
      { cat "$work/$name.err" >&2; exit 1; }
    python3 - "$work/$name.plan.json" "$work/$name.items.json" "$mode" "$dtype" "$np" <<'PY' | tee -a "$lines"
import json, sys
plan, items, mode, dtype, np_ = sys.argv[1:]
totals = json.load(open(plan))["totals"]
measured = json.loads(open(items).read().strip().splitlines()[-1])
print(json.dumps({"bench": "bf16_memory", "model": "784-4096-4096-10", "batch": 256,
                  "np": int(np_), "mode": mode, "dtype": dtype, "overlap": True,
                  "plan_activation_bytes": totals["activation_bytes"],
                  "plan_gathered_weight_bytes": totals["gathered_weight_bytes"],
                  "plan_sixteen_bit_copy_bytes": totals["sixteen_bit_copy_bytes"],
                  "plan_bytes_per_rank": totals["bytes_per_rank"],
                  "measured": measured["measured"], "planned_by_run": measured["planned"],
                  "unplanned_bytes_rank0": measured["unplanned_bytes_rank0"],
                  "activation_bytes_rank0": measured["activation_bytes_rank0"]}))
PY
  done
done
python3 - "$lines" <<'PY'
import json, sys
runs = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    runs[(r["mode"], r["dtype"])] = r
for mode in dict.fromkeys(m for m, _ in runs):
    f, b = runs[(mode, "fp32")], runs[(mode, "bf16")]
    ratio = lambda x, y: round(x / y, 3) if y else None
    print(json.dumps({"bench": "bf16_memory_ratio", "mode": mode, "np": f["np"],
        "activations_plan": ratio(b["plan_activation_bytes"], f["plan_activation_bytes"]),
        "activations_measured": ratio(b["measured"]["activations"], f["measured"]["activations"]),
        "gathered_weights_plan": ratio(b["plan_gathered_weight_bytes"],
                                       f["plan_gathered_weight_bytes"]),
        "gathered_weights_measured": ratio(b["measured"]["gathered weights"],
                                           f["measured"]["gathered weights"]),
        "weight_buffers_measured": ratio(b["measured"]["weight buffers"],
                                         f["measured"]["weight buffers"]),
        "total_plan": ratio(b["plan_bytes_per_rank"], f["plan_bytes_per_rank"]),
        "kokkos_measured": ratio(b["measured"]["kokkos"], f["measured"]["kokkos"])}))
PY
