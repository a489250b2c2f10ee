#!/usr/bin/env bash
# A table set that does not fit replicated (issue 39, "Measured"): configs/dlrm_synthetic.toml
# with its three largest tables (t23, t24, t25) grown to ROWS rows each (dim 16; default
# 67,108,864 = 2^26, i.e. 3 x 4 GiB = 12 GiB of tables, 24 GiB replicated on 2 ranks), row-wise
# over fsdp on 2 ranks (the config's preset), `optimizer.embeddings = "rowwise_adagrad"`:
# trains STEPS steps on scripts/make_recsys_data's default set (its ids reach the first 100,000
# rows of a table; the model's rows are the config's, initialized and held whole), saves a
# checkpoint (checkpoint.async = false: each rank pwrites its blocks from the tensors
# themselves, no staging copy), reads it back with h5py (shapes, a row range of t25 and its
# Adagrad accumulators), then resumes from it for RESUME_STEPS more steps (the load reads into
# the tensors in place).
#
#   [ROWS=67108864] [STEPS=10] [RESUME_STEPS=5] [TABLE_DTYPE=fp32] bench/dlrm_big_tables.sh
#   [DATA_DIR]
#
# TABLE_DTYPE=bf16: model.table_dtype = "bf16" (the tables 2 bytes an element, their Adagrad
# state fp32; docs/recsys.md, "bf16 tables"); the checkpoint's tables are then uint16 bits,
# widened here to read them.
#
# Each run under a watchdog: `timeout` (TIMEOUT, default 900 s) and a loop that kills the job
# when /proc/meminfo's MemAvailable falls below 2 GiB (the machine is shared). Each rank runs
# under /usr/bin/time -v, whose "Maximum resident set size" is its peak RSS.
# One JSON line per phase (train, resume): the plan's bytes per rank (`meshtrain plan --json`,
# totals.bytes_per_rank) and each rank's peak RSS, their ratio, the seconds of the run; then
# the checkpoint's size and what h5py read.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
cmake --build build --target meshtrain >&2
rows=${ROWS:-67108864}
steps=${STEPS:-10}
resume_steps=${RESUME_STEPS:-5}
table_dtype=${TABLE_DTYPE:-fp32}
element_bytes=$([[ $table_dtype == bf16 ]] && echo 2 || echo 4)
limit=${TIMEOUT:-900}
mpirun=${MPIRUN:-mpirun --oversubscribe}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
data=${1:-$work/data}
if [[ ! -f $data/train.h5 ]]; then scripts/make_recsys_data --out "$data" >&2; fi

config=$work/big.toml
/usr/bin/python3 - "$rows" "$config" <<'PY'
import sys
rows, out = sys.argv[1], sys.argv[2]
src = open("configs/dlrm_synthetic.toml").read()
for t, r in [("t23", 47863), ("t24", 69183), ("t25", 100000)]:
    old = f'name = "{t}"\nrows = {r}\n'
    assert old in src, t
    src = src.replace(old, f'name = "{t}"\nrows = {rows}\n')
open(out, "w").write(src)
PY
sets=(--set data.path="$data/train.h5" --set data.test_path="$data/test.h5"
      --set run.output_dir="$work/run" --set optimizer.embeddings=rowwise_adagrad
      --set optimizer.embeddings_lr=0.05 --set checkpoint.async=false --set train.log_every=5
      --set model.table_dtype="\"$table_dtype\"")
plan_bytes=$(build/bin/meshtrain plan "$config" --world 2 --json "${sets[@]}" |
  /usr/bin/python3 -c 'import json, sys; print(json.load(sys.stdin)["totals"]["bytes_per_rank"])')

watch_memory() {  # PID: kills the process group of PID when MemAvailable < 2 GiB
  while kill -0 "$1" 2> /dev/null; do
    avail=$(awk '/^MemAvailable/ {print $2}' /proc/meminfo)
    if ((avail < 2 * 1024 * 1024)); then
      echo "watchdog: MemAvailable ${avail} kB < 2 GiB: stopping the run" >&2
      kill -TERM -- "-$1" 2> /dev/null || kill -TERM "$1"
      return
    fi
    sleep 0.5
  done
}

run_phase() {  # PHASE TOTAL_STEPS [--set ...]
  local phase=$1 total=$2
  shift 2
  local start end rc=0
  start=$(date +%s.%N)
  setsid timeout "$limit" $mpirun -np 2 bash -c \
    'exec /usr/bin/time -v -o "$0.$OMPI_COMM_WORLD_RANK" "$@"' "$work/time.$phase" \
    build/bin/meshtrain train "$config" "${sets[@]}" --set train.steps="$total" "$@" \
    > "$work/$phase.log" 2>&1 &
  local job=$!
  watch_memory "$job" &
  local watcher=$!
  wait "$job" || rc=$?
  kill "$watcher" 2> /dev/null || true
  end=$(date +%s.%N)
  if ((rc != 0)); then
    cat "$work/$phase.log" >&2
    echo "$phase: exit $rc" >&2
    exit 1
  fi
  /usr/bin/python3 - "$phase" "$rows" "$plan_bytes" "$start" "$end" "$work" "$table_dtype" \
    "$element_bytes" <<'PY'
import json, re, sys
phase, rows, plan, start, end, work, dtype, element_bytes = sys.argv[1:9]
rss = []
for r in (0, 1):
    text = open(f"{work}/time.{phase}.{r}").read()
    rss.append(int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1)) * 1024)
log = open(f"{work}/{phase}.log").read()
steps = re.findall(r"^step +(\d+)/\d+ .*?loss ([0-9.]+)", log, re.M)
plan = int(plan)
print(json.dumps({"bench": "dlrm_big_tables", "phase": phase, "ranks": 2,
                  "table_dtype": dtype,
                  "table_rows": [int(rows)] * 3,
                  "table_bytes": 3 * int(rows) * 16 * int(element_bytes),
                  "plan_bytes_per_rank": plan, "peak_rss_bytes": rss,
                  "rss_over_plan": [round(x / plan, 4) for x in rss],
                  "wall_s": round(float(end) - float(start), 1),
                  "last_step": int(steps[-1][0]) if steps else None,
                  "last_loss": float(steps[-1][1]) if steps else None,
                  "resumed": "resumed from" in log}))
PY
}

run_phase train "$steps"
ckpt=$(ls "$work"/run/checkpoints/ckpt-*.h5 | tail -1)
/usr/bin/python3 - "$ckpt" "$rows" <<'PY'
import json, os, sys
import h5py
import numpy as np
path, rows = sys.argv[1], int(sys.argv[2])
with h5py.File(path, "r") as f:
    w = f["params/embeddings/t25/weight"]
    acc = f["opt_state/rowwise_adagrad/embeddings/t25/weight"]
    assert w.shape == (rows, 16) and acc.shape == (rows,), (w.shape, acc.shape)
    # A bf16 table: uint16 bits with attribute dtype = "bf16", widened to float32.
    bf16 = w.attrs.get("dtype") in ("bf16", b"bf16")
    read = lambda x: (x.astype(np.uint32) << 16).view(np.float32) if bf16 else x
    lo = read(w[:100000])           # the rows the data's ids reach (rank 0's block)
    hi = read(w[rows // 2: rows // 2 + 1000])  # rank 1's first rows
    bound = (1.0 / rows) ** 0.5
    touched = int(np.count_nonzero(acc[:100000]))
    dtype = "bf16" if bf16 else str(w.dtype)
print(json.dumps({"bench": "dlrm_big_tables", "phase": "h5py", "checkpoint_bytes":
                  os.path.getsize(path), "t25_shape": list(w.shape),
                  "t25_dtype": dtype,
                  "t25_rows_with_adagrad_state": touched,
                  # (a bf16 table: the bound's nearest bf16, up to 2^-8 above it)
                  "untouched_rows_within_init_bound":
                      bool(np.all(np.abs(hi) <= bound * (1 + 2.0**-8 if bf16 else 1))),
                  "finite": bool(np.isfinite(lo).all())}))
PY
run_phase resume $((steps + resume_steps)) --set checkpoint.resume=true
