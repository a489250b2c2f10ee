#!/usr/bin/env bash
# Predictor against ONNX Runtime and PyTorch (issue 37 item 7, "Measured"): one
# Predictor::predict call on ROWS rows, one rank, one thread (Serial Kokkos, one OpenBLAS
# thread), against ONNX Runtime's CPU execution of `meshtrain export`'s ONNX file of the same
# checkpoint (onnxruntime-node, one intra-op and one inter-op thread; bench/
# predictor_vs_onnxruntime.js) and PyTorch 1.13 on its `--format pytorch` export
# (torch.set_num_threads(1); bench/predictor_vs_torch.py), on the same rows, in fp32.
#
#   [ROWS=1000] [CALLS=200] [ROUNDS=3] [STEPS=100] [MODELS="residual mlp"] [KEEP=1] \
#       bench/predictor_vs_onnxruntime.sh [BUILD_DIR]
#
# The models: `residual`, residual_mlp 12 inputs (scales 1e-3 to 1e4, standardized), 4 outputs
# (standardized targets), width 128, hidden 256, 4 LayerNorm + SiLU blocks (bench/
# jacobian_speed.sh's); `mlp`, 784-512-512-10 relu on Fashion-MNIST (classification: ONNX
# Runtime's graph and Predictor also compute the softmax and the argmax; PyTorch's module returns
# the logits only). Each is trained STEPS steps (so the weights are not their initial ones) and
# exported both ways. Then ROUNDS rounds, each running the three sides one after the other
# (CALLS timed calls each, after one warm-up call): on a shared machine a slow moment then hits
# one round of every side, not one side. JSON lines: each side's per round, then one summary
# per model: every side's best and median ms per call (the best over the rounds of each), the
# ratios onnxruntime_ms / meshtrain_ms and torch_ms / meshtrain_ms of both (above 1: meshtrain
# is faster), and the largest difference of meshtrain's outputs from ONNX Runtime's, relative
# to the largest output.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
build=${1:-build}
# The benchmarks are not in `all` after scripts/test (MESHTRAIN_BUILD_BENCHMARKS=OFF).
cmake --build "$build" --target meshtrain bench_predictor_call >&2
rows=${ROWS:-1000}
calls=${CALLS:-200}
rounds=${ROUNDS:-3}
steps=${STEPS:-100}
models=${MODELS:-residual mlp}
python=${PYTHON:-/usr/bin/python3}
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
ort=$(bash scripts/install-onnxruntime)
work=$(mktemp -d /tmp/meshtrain-predictor-bench-XXXXXX)
# KEEP=1 keeps the work folder (checkpoints, exports, rows) and says where.
if [[ -n ${KEEP:-} ]]; then echo "work folder: $work" >&2; else trap 'rm -rf "$work"' EXIT; fi

# Data: the residual model's regression rows (HDF5), and ROWS rows of each model's inputs as raw
# float32 (the residual's from its data, the mlp's the first Fashion-MNIST test images).
"$python" - "$work" "$rows" <<'PY'
import gzip
import sys
import h5py
import numpy as np
work, rows = sys.argv[1], int(sys.argv[2])
rng = np.random.default_rng(0)
n, inputs = 20000, 12
scale = np.logspace(-3, 4, inputs)
x = rng.normal(size=(n, inputs)) * scale + np.linspace(-5, 5, inputs) * scale
z = (x - x.mean(0)) / x.std(0)
y = np.stack([np.sin(z[:, 0]) + z[:, 1] * z[:, 2], np.tanh(z[:, 3] - z[:, 4]) * 10,
              z[:, 5] ** 2 + 0.1 * z[:, 6:].sum(1), 100 * np.cos(z[:, 7] * z[:, 8])], 1)
with h5py.File(work + "/residual.h5", "w") as f:
    f["x"] = x.astype(np.float32)
    f["y"] = y.astype(np.float32)
np.resize(x.astype(np.float32), (rows, inputs)).tofile(work + "/residual.f32")
with gzip.open("/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz") as f:
    images = np.frombuffer(f.read(), dtype=np.uint8, offset=16).reshape(-1, 784)
images = images.astype(np.float32) * np.float32(1.0 / 255.0)
np.resize(images, (rows, 784)).astype(np.float32).tofile(work + "/mlp.f32")
PY

write_config() {  # MODEL
  local model=$1
  cat <<TOML
[run]
name = "predictor_bench_$model"
seed = 0
output_dir = "$work/run_$model"
[mesh]
dp = -1
[partition]
preset = "dp"
[optimizer]
kind = "adamw"
lr = 1e-3
[train]
steps = $steps
log_every = $steps
[checkpoint]
keep = 1
TOML
  if [[ $model == residual ]]; then
    cat <<TOML
[model]
kind = "residual_mlp"
inputs = 12
outputs = 4
width = 128
hidden = 256
depth = 4
norm = "layernorm"
activation = "silu"
init = "xavier_uniform"
loss = "mse"
[data]
source = "hdf5"
path = "$work/residual.h5"
normalize_inputs = "standard"
normalize_targets = "standard"
batch_size = 256
TOML
  else
    cat <<TOML
[model]
kind = "mlp"
sizes = [784, 512, 512, 10]
activation = "relu"
init = "he_normal"
loss = "cross_entropy"
[data]
source = "fashion_mnist"
path = "/usr/share/datasets/fashion-mnist"
batch_size = 128
TOML
  fi
}

for model in $models; do
  write_config "$model" > "$work/$model.toml"
  "$build/bin/meshtrain" train "$work/$model.toml" > "$work/train_$model.log"
  checkpoint="$work/run_$model/checkpoints"
  "$build/bin/meshtrain" export "$checkpoint" --format onnx --output "$work/$model.onnx" > /dev/null
  "$build/bin/meshtrain" export "$checkpoint" --format pytorch --output "$work/torch_$model" \
      > /dev/null
  width=$([[ $model == residual ]] && echo 12 || echo 784)
  for ((round = 1; round <= rounds; ++round)); do
    "$build/bin/bench_predictor_call" "$checkpoint" --input "$work/$model.f32" --rows "$rows" \
        --calls "$calls" --output "$work/${model}_meshtrain.out" | tee -a "$work/$model.jsonl"
    node bench/predictor_vs_onnxruntime.js "$ort" "$work/$model.onnx" "$work/$model.f32" "$rows" \
        "$width" "$calls" "$work/${model}_ort.out" | tee -a "$work/$model.jsonl"
    "$python" bench/predictor_vs_torch.py "$work/torch_$model" "$work/$model.f32" "$rows" \
        "$width" "$calls" | tee -a "$work/$model.jsonl"
  done
  "$python" - "$work" "$model" <<'PY'
import json
import sys
import numpy as np
work, model = sys.argv[1:3]
lines = [json.loads(l) for l in open("%s/%s.jsonl" % (work, model)) if l.strip()]
side = {}
for l in lines:
    s = side.setdefault(l["runtime"], {"best_ms": float("inf"), "median_ms": float("inf")})
    s["best_ms"] = min(s["best_ms"], l["best_ms"])
    s["median_ms"] = min(s["median_ms"], l["median_ms"])
    s["cpu_ms_per_call"] = min(s.get("cpu_ms_per_call", float("inf")), l["cpu_ms_per_call"])
mine = np.fromfile("%s/%s_meshtrain.out" % (work, model), dtype=np.float32)
theirs = np.fromfile("%s/%s_ort.out" % (work, model), dtype=np.float32)
mt = next(l for l in lines if l["runtime"] == "meshtrain")
summary = {"bench": "predictor_vs_onnxruntime", "model": mt["model"], "rows": mt["rows"],
           "calls": mt["calls"], "rounds": len(lines) // 3, "gemm": mt["gemm"],
           "onnxruntime": next(l["version"] for l in lines if l["runtime"] == "onnxruntime"),
           "torch": next(l["version"] for l in lines if l["runtime"] == "torch")}
for name, s in side.items():
    for key, value in s.items():
        summary["%s_%s" % (name, key)] = value
for other in ("onnxruntime", "torch"):
    for key in ("best_ms", "median_ms", "cpu_ms_per_call"):
        summary["%s_over_meshtrain_%s" % (other, key)] = side[other][key] / side["meshtrain"][key]
assert mine.size == theirs.size > 0, (mine.size, theirs.size)
summary["max_difference_from_onnxruntime"] = float(
    np.abs(mine.astype(np.float64) - theirs).max() / max(np.abs(theirs).max(), 1e-30))
print(json.dumps(summary))
PY
done
