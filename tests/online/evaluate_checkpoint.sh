#!/usr/bin/env bash
# `meshtrain evaluate` and `meshtrain predict` of an online run's checkpoint (docs/online.md,
# "Checkpoints"): runs the MPMD training command (C producer + `meshtrain train` whose
# run.output_dir is OUT), writes 50 rows of its shape, evaluates the checkpoint on them and
# predicts them, both on NP ranks, and checks that evaluate took the 50 rows and that its
# test_mse equals the MSE of predict's outputs against the rows' targets (computed here, numpy
# in float64) to 1e-5 relative: both run the same float32 forward, the sums differ only in
# order. evaluate used to refuse such a checkpoint ("stream.name is a key of data.source =
# \"stream\""). Prints one line when it passes.
#   evaluate_checkpoint.sh OUT MESHTRAIN WRITE_DATA PYTHON NP MPIEXEC [FLAGS...] -- COMMAND...
set -uo pipefail
out=$1 meshtrain=$2 write_data=$3 python=$4 np=$5
shift 5
launch=()
while [[ $# -gt 0 && $1 != -- ]]; do launch+=("$1"); shift; done
shift
rm -rf "$out"
"$@" > /dev/null || { echo "evaluate_checkpoint: the online run exited $?" >&2; exit 1; }
"$write_data" "$out/rows.h5" 50 4 11 --targets 2 > /dev/null || exit 1
"${launch[@]}" -n "$np" "$meshtrain" evaluate "$out/checkpoints" --data "$out/rows.h5" \
  --json "$out/eval.json" > "$out/eval.log" 2>&1 ||
  { cat "$out/eval.log" >&2; echo "evaluate_checkpoint: evaluate failed" >&2; exit 1; }
"${launch[@]}" -n "$np" "$meshtrain" predict "$out/checkpoints" --input "$out/rows.h5" \
  --output "$out/predicted.h5" > "$out/predict.log" 2>&1 ||
  { cat "$out/predict.log" >&2; echo "evaluate_checkpoint: predict failed" >&2; exit 1; }
"$python" - "$out" <<'PY' || exit 1
import json, sys
import h5py, numpy as np
out = sys.argv[1]
e = json.load(open(f"{out}/eval.json"))
with h5py.File(f"{out}/rows.h5") as f:
    y = np.asarray(f["/y"], dtype=np.float64).reshape(50, -1)
with h5py.File(f"{out}/predicted.h5") as f:
    p = np.asarray(f["/prediction"], dtype=np.float64).reshape(50, -1)
mse = float(np.mean((p - y) ** 2))
if e["test_rows"] != 50:
    sys.exit(f"evaluate_checkpoint: evaluate took {e['test_rows']} rows, not 50")
if abs(e["test_mse"] - mse) > 1e-5 * mse:
    sys.exit(f"evaluate_checkpoint: evaluate's test_mse {e['test_mse']} but predict's {mse}")
print(f"evaluate_checkpoint: evaluate and predict agree on the online checkpoint (MSE {mse:.6g})")
PY
