#!/usr/bin/env bash
# The row-wise tables' all-to-alls' share of a DLRM training step (issue 39, "Measured"), traced,
# against the cost model's prediction (`meshtrain plan --json`'s `cost`, which charges each
# table's collectives: docs/recsys.md, "The plan").
#
#   [STEPS=60] [TRACED=20] [NP=2] bench/dlrm_a2a_share.sh [DATA_DIR] [-- --set KEY=VALUE ...]
#
# configs/dlrm_synthetic.toml on scripts/make_recsys_data's default set (t17, t18 and t25
# row-wise over fsdp on 2 ranks), optimizer.embeddings = "rowwise_adagrad", STEPS steps with the
# last TRACED traced ([runtime] trace_steps). Measured, per rank, over the traced steps: the
# step spans' time, the `all-to-all` collective spans' time (the row-wise tables' counts, ids,
# partial sums and dy exchanges, one of each per group of tables over the same axes: 4 a step
# here; blocking, so a span includes waiting for the slower rank), the other
# collectives' and each phase's (data read, forward, loss, backward, optimizer). Predicted, with
# the default hardware profile (or MESHTRAIN_HARDWARE=FILE, `meshtrain plan --hardware`): the
# cost items whose `what` starts with "all-to-all" and the step. One JSON line: both, per step,
# and the shares; `phases`: each traced phase (data read, forward, loss, backward, optimizer)
# measured (mean over the ranks, and per rank) against the plan's items of that phase (data read:
# its exposed read with the ids' agreement); `parts`: the model's parts (the trace's `layer`
# spans: bottom mlp, embeddings, interaction, top mlp by pass, sparse optimizer) against their
# items; per rank `all_to_all_each_ms`, each all-to-all of a step in order; `profile`: the
# hardware file's data-read figures. The phases and parts are also printed as a table on stderr.
# Extra settings go after `--` (e.g. `-- --set data.prefetch=0`: the read in the step).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
cmake --build build --target meshtrain >&2
steps=${STEPS:-60}
traced=${TRACED:-20}
np=${NP:-2}
mpirun=${MPIRUN:-mpirun --oversubscribe}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
data=$work/data
if [[ $# -gt 0 && $1 != -- ]]; then
  data=$1
  shift
fi
[[ ${1:-} == -- ]] && shift
if [[ ! -f $data/train.h5 ]]; then scripts/make_recsys_data --out "$data" >&2; fi
sets=(--set data.path="$data/train.h5" --set data.test_path="$data/test.h5"
      --set run.output_dir="$work/run" --set train.steps="$steps" --set train.log_every=20
      --set optimizer.embeddings=rowwise_adagrad --set optimizer.embeddings_lr=0.05
      --set checkpoint.async=false
      --set "runtime.trace_steps=[$((steps - traced + 1)), $steps]" "$@")
hardware=()
[[ -n ${MESHTRAIN_HARDWARE:-} ]] && hardware=(--hardware "$MESHTRAIN_HARDWARE")
build/bin/meshtrain plan configs/dlrm_synthetic.toml --world "$np" --json "${hardware[@]}" \
  "${sets[@]}" > "$work/plan.json"
$mpirun -np "$np" build/bin/meshtrain train configs/dlrm_synthetic.toml "${sets[@]}" \
  > "$work/train.log" 2>&1 || { cat "$work/train.log" >&2; exit 1; }
/usr/bin/python3 - "$work/plan.json" "$work/run/trace/all-ranks.json" "$np" "$traced" \
  "${MESHTRAIN_HARDWARE:-}" <<'PY'
import json, re, sys
from collections import defaultdict
plan = json.load(open(sys.argv[1]))
trace = json.load(open(sys.argv[2]))
np_, traced = int(sys.argv[3]), int(sys.argv[4])
events = trace["traceEvents"] if isinstance(trace, dict) else trace
spans = [e for e in events if e.get("ph") == "X" and e.get("tid", 0) == 0]
per_rank = []
for r in range(np_):
    mine = [e for e in spans if e["pid"] == r]
    steps = [e for e in mine if e["cat"] == "step"]
    step_us = sum(e["dur"] for e in steps)
    a2a = [e for e in mine if e["cat"] == "collective" and e["name"] == "all-to-all"]
    other = [e for e in mine if e["cat"] == "collective" and e["name"] != "all-to-all"]
    # Each all-to-all of a step in order (counts, ids, partial sums, dy: the k-th of every
    # step), its mean ms: the first after the data read also holds the wait for the other rank.
    per_call = defaultdict(list)
    for st in steps:
        inside = sorted((e for e in a2a if st["ts"] <= e["ts"] <= st["ts"] + st["dur"]),
                        key=lambda e: e["ts"])
        for k, e in enumerate(inside):
            per_call[k].append(e["dur"] / 1e3)
    phases = defaultdict(float)
    layers = defaultdict(float)  # the model's parts (`layer` spans), "name detail"
    for e in mine:
        if e["cat"] == "phase":
            phases[e["name"]] += e["dur"] / len(steps) / 1e3
        elif e["cat"] == "layer":
            key = e["name"] + " " + str(e.get("args", {}).get("pass", ""))
            layers[key.strip()] += e["dur"] / len(steps) / 1e3
    per_rank.append({"rank": r, "steps": len(steps), "step_ms": step_us / len(steps) / 1e3,
                     "all_to_all_ms": sum(e["dur"] for e in a2a) / len(steps) / 1e3,
                     "all_to_alls_per_step": len(a2a) / len(steps),
                     "all_to_all_each_ms": [round(sum(v) / len(v), 4) for _, v in sorted(per_call.items())],
                     "all_to_all_bytes_per_step": sum(e["args"]["bytes"] for e in a2a) / len(steps),
                     "other_collectives_ms": sum(e["dur"] for e in other) / len(steps) / 1e3,
                     "other_collectives_per_step": len(other) / len(steps),
                     "phases_ms": {k: round(v, 3) for k, v in phases.items()},
                     "layers_ms": {k: round(v, 3) for k, v in layers.items()}})
for p in per_rank:
    p["all_to_all_share"] = p["all_to_all_ms"] / p["step_ms"]
cost = plan["cost"]
items = cost["items"]
a2a_items = [i for i in items if i["what"].startswith("all-to-all")]
pred_a2a = sum(i["seconds"] for i in a2a_items)
pred_step = cost["step_s"]
# The plan's prediction per traced phase (the cost items by their layer and phase): data read
# (what the step waits for: data_exposed_s, the ids' agreement included), forward (every forward
# item but the loss's), loss (layer "loss": its pass and all-reduce), backward, optimizer (the
# update items: the dense optimizer and the tables' sparse rows). Measured: each phase span's
# mean over the ranks; the difference of the step and its phases is "other" (clip, gaps).
def phase_of(i):
    if i["layer"] == "loss":
        return "loss"
    return {"forward": "forward", "backward": "backward", "update": "optimizer"}.get(i["phase"], "other")
pred_phases = defaultdict(float)
for i in items:
    pred_phases[phase_of(i)] += i["seconds"] * 1e3
pred_phases["data read"] = cost.get("data_exposed_s", 0) * 1e3
pred_a2a_phases = defaultdict(float)
for i in a2a_items:
    pred_a2a_phases[phase_of(i)] += i["seconds"] * 1e3
phase_rows = {}
for name in ["data read", "forward", "loss", "backward", "optimizer"]:
    meas = sum(p["phases_ms"].get(name, 0.0) for p in per_rank) / np_
    pred = pred_phases.get(name, 0.0)
    phase_rows[name] = {"measured_ms": round(meas, 3),
                        "measured_per_rank_ms": [p["phases_ms"].get(name, 0.0) for p in per_rank],
                        "predicted_ms": round(pred, 3),
                        "predicted_over_measured": round(pred / meas, 3) if meas > 0 else None}
# The model's parts (the trace's `layer` spans, by pass) against the items of the same layers:
# "bottom mlp" bottom/*, "top mlp" top/*, "embeddings" embeddings* (lookups, pooling, their
# collectives; backward: scatter, dy all-to-all, touched rows, gradient all-reduce), "interaction"
# its items, "sparse optimizer" the tables' update items. The loss's and the gradient buckets'
# items are in no part (the trace's parts do not hold them either).
def part_of(i):
    layer = i["layer"]
    if layer.startswith("bottom/"):
        return "bottom mlp " + i["phase"]
    if layer.startswith("top/"):
        return "top mlp " + i["phase"]
    if layer == "interaction":
        return "interaction " + i["phase"]
    if layer.startswith("embeddings"):
        return "sparse optimizer" if i["phase"] == "update" else "embeddings " + i["phase"]
    return None
pred_parts = defaultdict(float)
for i in items:
    part = part_of(i)
    if part:
        pred_parts[part] += i["seconds"] * 1e3
part_rows = {}
for name in sorted(set(pred_parts) | {k for p in per_rank for k in p["layers_ms"]}):
    meas = sum(p["layers_ms"].get(name, 0.0) for p in per_rank) / np_
    pred = pred_parts.get(name, 0.0)
    part_rows[name] = {"measured_ms": round(meas, 3), "predicted_ms": round(pred, 3),
                       "predicted_over_measured": round(pred / meas, 3) if meas > 0 else None}
measured_a2a = sum(p["all_to_all_ms"] for p in per_rank) / np_ / 1e3
measured_step = sum(p["step_ms"] for p in per_rank) / np_ / 1e3
# The profile's data-read figures (calibrate CONFIG measures them; absent: the defaults).
profile = {}
if len(sys.argv) > 5 and sys.argv[5]:
    for line in open(sys.argv[5]):
        m = re.match(r"^(hdf5_row_seconds|sparse_row_seconds|sparse_id_seconds|memory_bandwidth) = ([0-9.eE+-]+)", line)
        if m:
            profile[m.group(1)] = float(m.group(2))
        m = re.match(r"^collective_overhead = ([0-9.eE+-]+)", line)
        if m and "collective_overhead" not in profile:
            profile["collective_overhead"] = float(m.group(1))
print("phase        measured ms (per rank)        predicted ms  pred/meas", file=sys.stderr)
for name, row in phase_rows.items():
    print(f"{name:12s} {row['measured_ms']:8.3f} ({', '.join(f'{v:.3f}' for v in row['measured_per_rank_ms'])})"
          f"  {row['predicted_ms']:10.3f}  {row['predicted_over_measured']}", file=sys.stderr)
for name, row in part_rows.items():
    print(f"  {name:24s} {row['measured_ms']:8.3f}  {row['predicted_ms']:10.3f}  {row['predicted_over_measured']}",
          file=sys.stderr)
print(json.dumps({
    "bench": "dlrm_a2a_share", "ranks": np_, "traced_steps": traced,
    "hardware": cost.get("hardware"), "profile": profile,
    "measured": {"step_ms": measured_step * 1e3, "all_to_all_ms": measured_a2a * 1e3,
                 "all_to_all_share": measured_a2a / measured_step, "per_rank": per_rank},
    "predicted": {"step_ms": pred_step * 1e3, "all_to_all_ms": pred_a2a * 1e3,
                  "all_to_all_items": len(a2a_items),
                  "all_to_all_share": pred_a2a / pred_step if pred_step > 0 else None,
                  "data_read_ms": cost.get("data_read_s", 0) * 1e3,
                  "data_exposed_ms": cost.get("data_exposed_s", 0) * 1e3,
                  "data_agree_ms": cost.get("data_agree_s", 0) * 1e3,
                  "all_to_all_ms_by_phase": {k: round(v, 4) for k, v in pred_a2a_phases.items()}},
    "phases": phase_rows, "parts": part_rows,
    "all_to_all_predicted_over_measured": pred_a2a / measured_a2a if measured_a2a > 0 else None,
    "share_predicted_over_measured":
        (pred_a2a / pred_step) / (measured_a2a / measured_step) if measured_a2a > 0 else None}))
PY
