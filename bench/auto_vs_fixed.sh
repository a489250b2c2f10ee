#!/usr/bin/env bash
# collective_matmul = auto against each fixed algorithm on one link (JSON lines from
# bench_collective_matmul, all algorithms timed interleaved round by round, each line with
# the cost model's predicted_s and what auto resolved to), after `meshtrain calibrate` on
# the same ranks. Shapes: "M,K,N" list.
#
#   scripts/simhosts shell --hosts 2 --slots 1 --rate 300mbit -- \
#       bash -c 'MPIRUN="$SIMHOSTS_MPIRUN" bench/auto_vs_fixed.sh 2'
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
np=${1:-2}
shapes=${2:-"256,4096,4096 2048,2048,2048"}
mpirun=${MPIRUN:-mpirun --oversubscribe}
# The benchmarks are not in `all` after scripts/test (MESHTRAIN_BUILD_BENCHMARKS=OFF).
cmake --build build --target meshtrain bench_collective_matmul >&2
hw=$(mktemp -d)
trap 'rm -rf "$hw"' EXIT
$mpirun -np "$np" build/bin/meshtrain calibrate --out "$hw/hw.toml" > /dev/null
for shape in $shapes; do
  IFS=, read -r m k n <<< "$shape"
  $mpirun -np "$np" build/bin/bench_collective_matmul --m "$m" --k "$k" --n "$n" --kind all \
    --algorithm all --repeats 5 --hardware "$hw/hw.toml"
done
