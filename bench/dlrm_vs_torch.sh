#!/usr/bin/env bash
# meshtrain's DLRM against PyTorch 1.13's on the same cores (issue 39, "Measured"): the model of
# configs/dlrm_synthetic.toml (13 dense features, 26 tables of 10 to 100,000 rows, dim 16, dot
# interaction, batch 512) trained STEPS steps on scripts/make_recsys_data's default set, with
# the tables updated in their touched rows only:
#   meshtrain  `optimizer.embeddings = "rowwise_adagrad"` (embeddings_lr 0.05), AdamW (3e-3) for
#              the linear layers; np 1, np 2 with t17, t18 and t25 row-wise over fsdp (the
#              config's `min_sharding_size`), np 2 with every table replicated
#   torch      bench/dlrm_vs_torch.py: DDP (gloo, 2 processes, 1 thread each),
#              nn.EmbeddingBag(sparse=True) replicated, sparse Adagrad (element-wise; the
#              closest torch has) + AdamW
#
#   [STEPS=300] bench/dlrm_vs_torch.sh [DATA_DIR]     (DATA_DIR default: a temporary folder)
#
# One JSON line per run, then a summary line: samples/s of each (training steps only, the first
# 25 steps left out as warm-up on both sides; meshtrain's from metrics.jsonl's windows, the
# evaluation and checkpoint excluded), meshtrain np 2 / torch, and the test AUC after the last
# step (meshtrain's evaluation of the 50,000 test rows; torch's on process 0, same rows).
# One run each, in turn: on a shared machine a neighbour's load spoils one of them, not all.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
cmake --build build --target meshtrain >&2
steps=${STEPS:-300}
mpirun=${MPIRUN:-mpirun --oversubscribe}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
data=${1:-$work/data}
if [[ ! -f $data/train.h5 ]]; then scripts/make_recsys_data --out "$data" >&2; fi

run_meshtrain() {  # NAME NP [--set ...]
  local name=$1 np=$2
  shift 2
  $mpirun -np "$np" build/bin/meshtrain train configs/dlrm_synthetic.toml \
    --set data.path="$data/train.h5" --set data.test_path="$data/test.h5" \
    --set run.output_dir="$work/$name" --set train.steps="$steps" --set train.log_every=25 \
    --set optimizer.embeddings=rowwise_adagrad --set optimizer.embeddings_lr=0.05 \
    --set checkpoint.async=false "$@" > "$work/$name.log" 2>&1 ||
    { cat "$work/$name.log" >&2; exit 1; }
  /usr/bin/python3 - "$work/$name/metrics.jsonl" "$name" "$np" <<'PY'
import json, os, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
logs = [l for l in lines if l["event"] == "log"][1:]  # the first 25 steps: warm-up
evals = [l for l in lines if l["event"] == "eval"]
steps = logs[-1]["step"] - (logs[0]["step"] - 25)
seconds = sum(25 * l["step_s"] for l in logs)
print(json.dumps({"bench": "dlrm_vs_torch", "framework": "meshtrain", "run": sys.argv[2],
                  "ranks": int(sys.argv[3]),
                  "threads_per_rank": int(os.environ["OMP_NUM_THREADS"]), "timed_steps": steps,
                  "timed_s": seconds, "samples_per_s": steps * 512 / seconds,
                  "last_loss": logs[-1]["loss"], "test_auc": evals[-1]["test_auc"],
                  "test_log_loss": evals[-1]["test_log_loss"]}))
PY
}

{
  run_meshtrain np2_rowwise 2
  run_meshtrain np2_replicated 2 --set partition.min_sharding_size=1000000000
  run_meshtrain np1 1
  OMP_NUM_THREADS=1 /usr/bin/python3 bench/dlrm_vs_torch.py "$data/train.h5" "$data/test.h5" \
    "$steps" 2 25 2> "$work/torch.log" || { cat "$work/torch.log" >&2; exit 1; }
} | tee "$work/lines.jsonl"
/usr/bin/python3 - "$work/lines.jsonl" <<'PY'
import json, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
by = {r.get("run", r["framework"]): r for r in runs}
torch = by["torch"]
print(json.dumps({
    "bench": "dlrm_vs_torch_summary",
    "samples_per_s": {k: round(v["samples_per_s"], 1) for k, v in by.items()},
    "ratio_np2_rowwise_over_torch": by["np2_rowwise"]["samples_per_s"] / torch["samples_per_s"],
    "ratio_np2_replicated_over_torch":
        by["np2_replicated"]["samples_per_s"] / torch["samples_per_s"],
    "test_auc": {k: round(v["test_auc"], 4) for k, v in by.items()},
    "auc_np2_rowwise_minus_np1": by["np2_rowwise"]["test_auc"] - by["np1"]["test_auc"],
    "auc_np2_rowwise_minus_torch": by["np2_rowwise"]["test_auc"] - torch["test_auc"]}))
PY
