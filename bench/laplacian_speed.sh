#!/usr/bin/env bash
# A training step with a physics loss (issue 40 item 2b, "Measured"): meshtrain's forward
# Laplacian (build/bin/bench_laplacian) against PyTorch 1.13's double backward
# (bench/laplacian_speed_torch.py), each beside its own plain step of the same model and batch,
# on one core each (1 BLAS thread; 1 PyTorch thread). JSON lines: meshtrain's, PyTorch's, and a
# summary (meshtrain's physics step over its plain step, the target <= 5; PyTorch's physics step
# over meshtrain's).
#
#   [ROWS=4096] [INPUTS=2] [WIDTH=64] [DEPTH=3] [STEPS=20] [ROUNDS=5] bench/laplacian_speed.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
build=${1:-build}
# The benchmarks are not in `all` after scripts/test (MESHTRAIN_BUILD_BENCHMARKS=OFF).
cmake --build "$build" --target bench_laplacian >&2
rows=${ROWS:-4096}
inputs=${INPUTS:-2}
width=${WIDTH:-64}
depth=${DEPTH:-3}
steps=${STEPS:-20}
rounds=${ROUNDS:-5}
python=${PYTHON:-/usr/bin/python3}
mesh_line=$(OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 "$build/bin/bench_laplacian" --rows "$rows" \
  --inputs "$inputs" --width "$width" --depth "$depth" --steps "$steps" --rounds "$rounds" | tail -1)
echo "$mesh_line"
torch_line=$(OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 "$python" bench/laplacian_speed_torch.py \
  "$rows" "$inputs" "$width" "$depth" "$steps" "$rounds" 1 | tail -1)
echo "$torch_line"
"$python" - "$mesh_line" "$torch_line" <<'PY'
import json
import sys
m, t = json.loads(sys.argv[1]), json.loads(sys.argv[2])
print(json.dumps({"bench": "laplacian_summary", "meshtrain_physics_over_plain": m["ratio"],
                  "torch_physics_over_plain": t["ratio"],
                  "speedup_over_torch": t["physics_step_s"] / m["physics_step_s"],
                  "target_ratio_met": m["ratio"] <= 5.0}))
PY
