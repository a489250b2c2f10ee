#!/usr/bin/env bash
# Before/after on a shared machine (docs/derivatives.md, the vectorized exp/tanh rows):
# bench_laplacian and bench_jacobian of two builds interleaved round by round, with PyTorch's
# laplacian_speed_torch.py and jacobian_speed_torch.py in each round, so that every side sees
# the same load. JSON lines, each with the process's user+sys CPU seconds ("cpu"), which the
# other sessions' load moves less than wall time; a line per round with /proc/loadavg.
#
#   bench/before_after_interleaved.sh BEFORE_BUILD AFTER_BUILD CHECKPOINT TORCH_EXPORT [ROUNDS]
#
# CHECKPOINT and TORCH_EXPORT: bench/jacobian_speed.sh's model (its `meshtrain train` run and
# `meshtrain export --format pytorch`), made once with either build.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh >/dev/null
before=$1 after=$2 checkpoint=$3 torch_export=$4 rounds=${5:-3}
python=${PYTHON:-/usr/bin/python3}
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
times=$(mktemp)
trap 'rm -f "$times"' EXIT
run() { /usr/bin/time -f "%U %S" -o "$times" "$@" | tail -1; }
for round in $(seq 1 "$rounds"); do
  echo "{\"round\": $round, \"load\": \"$(cut -d' ' -f1-3 /proc/loadavg)\"}"
  for side in before after; do
    bin=$before/bin
    [[ $side == after ]] && bin=$after/bin
    line=$(run "$bin/bench_laplacian" --rows 4096 --inputs 2 --width 64 --depth 3 --steps 20 --rounds 3)
    echo "{\"side\": \"$side\", \"lap\": $line, \"cpu\": \"$(cat "$times")\"}"
    line=$(run "$bin/bench_jacobian" "$checkpoint" --rows 10000 --rounds 3 --mode reverse)
    echo "{\"side\": \"$side\", \"jac\": $line, \"cpu\": \"$(cat "$times")\"}"
  done
  line=$(run "$python" bench/laplacian_speed_torch.py 4096 2 64 3 20 3 1)
  echo "{\"side\": \"torch\", \"lap\": $line, \"cpu\": \"$(cat "$times")\"}"
  line=$(run "$python" bench/jacobian_speed_torch.py "$torch_export" --rows 10000 --threads 1 \
    --rounds 3 --per-row-rows 0 --batch-call-rows 0)
  echo "{\"side\": \"torch\", \"jac\": $line, \"cpu\": \"$(cat "$times")\"}"
done
