#!/usr/bin/env bash
# Jacobians (issue 40, "Measured"): meshtrain's Predictor::jacobian (bench_jacobian, both modes)
# against PyTorch 1.13's torch.autograd.functional.jacobian(..., vectorize=True) on the same
# model and cores (bench/jacobian_speed_torch.py on the checkpoint's PyTorch export), each beside
# one plain forward of the same rows. JSON lines: meshtrain's per mode, PyTorch's, a check that
# both compute the same Jacobian (on 512 rows), and a summary line.
#
#   [ROWS=10000] [ROUNDS=5] [RANKS=1] [THREADS=1] [STEPS=200] bench/jacobian_speed.sh [BUILD_DIR]
#
# The model: residual_mlp, 12 inputs (scales 1e-3 to 1e4, standardized by the run), 4 outputs
# (standardized targets), width 128, hidden 256, 4 LayerNorm + SiLU blocks (WIDTH, HIDDEN, DEPTH,
# NORM, ACTIVATION override), trained STEPS steps on RANKS ranks so the weights are not their
# initial ones. meshtrain runs on RANKS ranks (dp, one BLAS thread each), PyTorch with THREADS
# threads: RANKS = THREADS for the same cores. The summary's speedup_over_torch is PyTorch's
# best Jacobian time (the summed-rows call, its fastest use) over meshtrain's (automatic
# mode), each the best of ROUNDS rounds; speedup_over_torch_per_row_s and _batch_call_s set
# meshtrain against the two other ways of calling it (see jacobian_speed_torch.py).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
build=${1:-build}
# The benchmarks are not in `all` after scripts/test (MESHTRAIN_BUILD_BENCHMARKS=OFF).
cmake --build "$build" --target meshtrain bench_jacobian >&2
rows=${ROWS:-10000}
rounds=${ROUNDS:-5}
ranks=${RANKS:-1}
threads=${THREADS:-1}
steps=${STEPS:-200}
mpirun=${MPIRUN:-mpirun --oversubscribe}
python=${PYTHON:-/usr/bin/python3}
work=$(mktemp -d /tmp/meshtrain-jacobian-bench-XXXXXX)
trap 'rm -rf "$work"' EXIT

"$python" - "$work" <<'EOF'
import sys
import h5py
import numpy as np
rng = np.random.default_rng(0)
rows, inputs = 20000, 12
scale = np.logspace(-3, 4, inputs)
x = rng.normal(size=(rows, inputs)) * scale + np.linspace(-5, 5, inputs) * scale
z = (x - x.mean(0)) / x.std(0)
y = np.stack([np.sin(z[:, 0]) + z[:, 1] * z[:, 2], np.tanh(z[:, 3] - z[:, 4]) * 10,
              z[:, 5] ** 2 + 0.1 * z[:, 6:].sum(1), 100 * np.cos(z[:, 7] * z[:, 8])], 1)
with h5py.File(sys.argv[1] + "/train.h5", "w") as f:
    f["x"] = x.astype(np.float32)
    f["y"] = y.astype(np.float32)
with h5py.File(sys.argv[1] + "/check.h5", "w") as f:
    f["x"] = x[:512].astype(np.float32)
EOF

cat > "$work/config.toml" <<EOF
[run]
name = "jacobian_bench"
seed = 0
output_dir = "$work/run"
[mesh]
dp = -1
[partition]
preset = "dp"
[model]
kind = "residual_mlp"
inputs = 12
outputs = 4
width = ${WIDTH:-128}
hidden = ${HIDDEN:-256}
depth = ${DEPTH:-4}
norm = "${NORM:-layernorm}"
activation = "${ACTIVATION:-silu}"
init = "xavier_uniform"
loss = "mse"
[data]
source = "hdf5"
path = "$work/train.h5"
normalize_inputs = "standard"
normalize_targets = "standard"
batch_size = 256
[optimizer]
kind = "adamw"
lr = 1e-3
[train]
steps = $steps
log_every = $steps
[checkpoint]
keep = 1
EOF
$mpirun -np "$ranks" "$build/bin/meshtrain" train "$work/config.toml" > "$work/train.log"
checkpoint="$work/run/checkpoints"
"$build/bin/meshtrain" export "$checkpoint" --format pytorch --output "$work/torch" > /dev/null

# The same Jacobian on both sides: meshtrain predict's /jacobian of 512 rows against PyTorch's.
$mpirun -np "$ranks" "$build/bin/meshtrain" predict "$checkpoint" --input "$work/check.h5" \
    --output "$work/check_out.h5" --jacobian > /dev/null
"$python" - "$work" <<'EOF'
import sys
import h5py
with h5py.File(sys.argv[1] + "/check_out.h5", "r") as out, \
        h5py.File(sys.argv[1] + "/check.h5", "r+") as f:
    f["jacobian"] = out["jacobian"][()]
EOF

$mpirun -np "$ranks" "$build/bin/bench_jacobian" "$checkpoint" --rows "$rows" --rounds "$rounds" \
    --mode all | tee "$work/meshtrain.jsonl"
# PyTorch's GEMMs are OpenBLAS's too (Debian's libblas): as many BLAS threads as its own.
OPENBLAS_NUM_THREADS=$threads "$python" bench/jacobian_speed_torch.py "$work/torch" --rows "$rows" \
    --threads "$threads" --rounds "$rounds" --compare "$work/check.h5" | tee "$work/torch.jsonl"

"$python" - "$work" <<'EOF'
import json
import sys
work = sys.argv[1]
mine = [json.loads(l) for l in open(work + "/meshtrain.jsonl") if l.strip()]
torch = [json.loads(l) for l in open(work + "/torch.jsonl") if l.strip()]
timing = next(l for l in torch if l["bench"] == "torch_jacobian")
check = next(l for l in torch if l["bench"] == "torch_jacobian_check")
auto = next(l for l in mine if l["mode"] == l["automatic_mode"])
summary = {
    "bench": "jacobian_summary", "rows": auto["rows"], "ranks": auto["ranks"],
    "torch_threads": timing["threads"], "model": auto["model"],
    "meshtrain_mode": auto["mode"], "meshtrain_jacobian_s": auto["jacobian_s"],
    "meshtrain_forward_s": auto["forward_s"],
    "meshtrain_jacobian_over_forward": auto["jacobian_over_forward"],
    "torch_jacobian_s": timing["jacobian_s"], "torch_forward_s": timing["forward_s"],
    "torch_jacobian_over_forward": timing["jacobian_over_forward"],
    "speedup_over_torch": timing["jacobian_s"] / auto["jacobian_s"],
    "same_jacobian_max_error": check["max_error_over_column_max"],
}
for l in mine:
    summary["meshtrain_%s_jacobian_s" % l["mode"]] = l["jacobian_s"]
for key in ("per_row_s", "batch_call_s"):
    if key in timing:
        summary["torch_%s" % key] = timing[key]
        summary["speedup_over_torch_%s" % key] = timing[key] / auto["jacobian_s"]
print(json.dumps(summary))
EOF
