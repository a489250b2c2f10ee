#!/usr/bin/env bash
# model.loss = "binary_cross_entropy" end to end (docs/model_math.md, docs/running.md): two
# yes/no targets drawn from known logistic models of 8 features (4,000 training rows, 2,000
# test rows, written here), trained at np 1 and 2 (dp; keep_best = "test_auc"); then
# `meshtrain evaluate --json -` on each run's best checkpoint, on 2 ranks: per output AUC above
# 0.75 (0.5 is chance) and within 0.05 of the generating model's own (about 0.96 and 0.93), the two
# runs' AUC within 0.02 of each other, the log loss at least 0.1 below
# always answering each output's click rate, and the record's fields. Then targets outside
# [0, 1] (the synthetic source's regression targets) end the run in one sentence, exit 2.
#   binary_cross_entropy.sh MESHTRAIN PYTHON SOURCE_DIR MPIEXEC [MPIEXEC FLAGS...]
set -euo pipefail
meshtrain=$1
python=$2
source_dir=$3
shift 3
work=$(mktemp -d "${TMPDIR:-/tmp}/meshtrain-bce.XXXXXX")
trap 'rm -rf "$work"' EXIT
fail() {
  echo "binary_cross_entropy: $1" >&2
  exit 1
}

"$python" - "$work" <<'PY'
import json, sys
import h5py, numpy as np
rng = np.random.default_rng(7)
def logits(x):
    return np.stack([2.0 * x[:, 0] - 1.5 * x[:, 1] + x[:, 2] * x[:, 3],
                     1.5 * np.sin(2.0 * x[:, 4]) + x[:, 5] - 0.5], axis=1)
def auc(s, l):
    o = np.argsort(s, kind="mergesort"); r = np.empty(len(s)); r[o] = np.arange(1, len(s) + 1)
    pos = l > 0.5; n1, n0 = pos.sum(), (~pos).sum()
    return (r[pos].sum() - n1 * (n1 + 1) / 2) / (n1 * n0)
stats = {}
for name, rows in (("train", 4000), ("test", 2000)):
    x = rng.standard_normal((rows, 8)) * np.array([1, 2, 0.5, 1, 1, 3, 1, 1]) + 1.0
    z = logits(x)
    y = (rng.random(z.shape) < 1 / (1 + np.exp(-z))).astype(np.float32)
    with h5py.File(f"{sys.argv[1]}/{name}.h5", "w") as f:
        f["x"] = x.astype(np.float32)
        f["y"] = y
    if name == "test":
        rate = y.mean(axis=0)
        stats = {"teacher_auc": [auc(z[:, j], y[:, j]) for j in range(2)],
                 "constant_log_loss": float(np.mean(-(rate * np.log(rate) + (1 - rate) * np.log(1 - rate))))}
json.dump(stats, open(f"{sys.argv[1]}/stats.json", "w"))
PY
config=$source_dir/tests/train/binary_cross_entropy.toml
data=(--set "data.path=\"$work/train.h5\"" --set "data.test_path=\"$work/test.h5\"")
for np in 1 2; do
  "$@" -np $np "$meshtrain" train "$config" "${data[@]}" --set "run.output_dir=\"$work/run$np\"" \
    > "$work/train$np.log" 2>&1 || { cat "$work/train$np.log"; fail "training at np $np failed"; }
  grep -q 'AUC 0\.[0-9]*  log loss' "$work/train$np.log" ||
    { cat "$work/train$np.log"; fail "no AUC in the evaluation line at np $np"; }
  "$@" -np 2 "$meshtrain" evaluate "$work/run$np/checkpoints/best" --data "$work/test.h5" \
    --json - > "$work/eval$np.json" 2> "$work/eval$np.log" ||
    { cat "$work/eval$np.log"; fail "evaluate of the np $np run failed"; }
done
"$python" - "$work/stats.json" "$work/eval1.json" "$work/eval2.json" <<'PY' ||
import json, sys
stats = json.load(open(sys.argv[1]))
records = [json.load(open(path)) for path in sys.argv[2:]]
for r in records:
    for key in ("test_auc", "test_log_loss", "test_accuracy", "test_auc_per_output",
                "test_log_loss_per_output", "test_loss", "test_rows"):
        assert key in r, f"no {key} in {r}"
    assert "test_mse" not in r and "test_class_accuracy" not in r, r
    assert r["test_rows"] == 2000, r
    for j, (auc, teacher) in enumerate(zip(r["test_auc_per_output"], stats["teacher_auc"])):
        assert auc > 0.75 and abs(auc - teacher) < 0.05, f"output {j}: AUC {auc}, teacher {teacher}"
    assert abs(r["test_auc"] - sum(r["test_auc_per_output"]) / 2) < 1e-12, r
    assert r["test_log_loss"] < stats["constant_log_loss"] - 0.1, (r, stats)
assert abs(records[0]["test_auc"] - records[1]["test_auc"]) < 0.02, records
print("binary_cross_entropy: AUC %.4f (np 1) and %.4f (np 2) against the generator's %.4f, "
      "log loss %.4f against %.4f for a constant" % (
          records[0]["test_auc"], records[1]["test_auc"], sum(stats["teacher_auc"]) / 2,
          records[0]["test_log_loss"], stats["constant_log_loss"]))
PY
  fail "the evaluations are off"

# Targets that are not in [0, 1]: the synthetic source's regression targets.
status=0
"$@" -np 2 "$meshtrain" train "$config" --set data.source=synthetic --set train.steps=3 \
  --set "model.sizes=[8, 32, 32, 2]" --set "run.output_dir=\"$work/bad\"" > "$work/bad.log" 2>&1 ||
  status=$?
[[ $status -eq 2 ]] || { cat "$work/bad.log"; fail "targets outside [0, 1]: exit $status, want 2"; }
grep -q 'model.loss = "binary_cross_entropy" needs targets in \[0, 1\], but [0-9]* of a batch.s targets are outside (the training data, data.source = "synthetic")' "$work/bad.log" ||
  { cat "$work/bad.log"; fail "targets outside [0, 1]: not the one sentence"; }
echo "binary_cross_entropy: targets outside [0, 1] refused in one sentence"
