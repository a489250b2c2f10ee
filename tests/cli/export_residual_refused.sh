#!/bin/sh
# `meshtrain export` of a residual_mlp checkpoint (not supported yet, docs/export.md) exits 2
# with one sentence naming the checkpoint and model.kind, and writes no file.
#
#   export_residual_refused.sh MESHTRAIN CONFIG WORKDIR
set -u
meshtrain=$1 config=$2 work=$3
rm -rf "$work" && mkdir -p "$work" || exit 1
sed -e 's/^epochs = .*/steps = 2/' -e 's/^keep_best = .*//' -e 's/^eval_every = .*/eval_every = 0/' \
  "$config" > "$work/run.toml"
"$meshtrain" train "$work/run.toml" --set data.source=synthetic --set data.synthetic_samples=64 \
  --set data.batch_size=16 --set model.inputs=8 --set model.outputs=4 --set model.width=8 \
  --set model.hidden=8 --set model.depth=1 --set mesh.tp=1 --set model.loss=mse \
  --set "run.output_dir=$work/out" > "$work/train.log" 2>&1 || {
  cat "$work/train.log"
  echo "FAIL: training the residual model exited with $?"
  exit 1
}
"$meshtrain" export "$work/out/checkpoints" --format onnx --output "$work/model.onnx" \
  > "$work/export.out" 2> "$work/export.err"
rc=$?
if [ $rc -ne 2 ]; then
  cat "$work/export.err"
  echo "FAIL: export exited with $rc, expected 2"
  exit 1
fi
if ! grep -q '^meshtrain: error: checkpoint .*export does not support model.kind = "residual_mlp"' "$work/export.err"; then
  cat "$work/export.err"
  echo "FAIL: the error does not name model.kind = \"residual_mlp\""
  exit 1
fi
if [ -e "$work/model.onnx" ]; then
  echo "FAIL: export wrote $work/model.onnx"
  exit 1
fi
echo "ok: export refuses a residual_mlp checkpoint"
rm -rf "$work"
