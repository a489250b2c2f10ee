#!/usr/bin/env bash
# The producer's overhead (issue 38, "Measured"; docs/online.md "Figures"): examples/online_heat's
# simulation step (32 x 32 cells on 2 ranks: halo exchange, rows made, update) with sends on
# against off, the sends with backpressure drop beside `meshtrain train` on 1 rank. Prints one
# JSON line (step_us_off, step_us_on, ratio: the fastest of three alternated runs of STEPS steps
# each). Target: ratio <= 1.03. One run; on a loaded machine the ratio moves with the load.
#   bench/online_overhead.sh [STEPS]     (after scripts/build; default 2000)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
build_dir=${MESHTRAIN_BUILD_DIR:-build}
steps=${1:-2000}
cmake --build "$build_dir" --target online_heat meshtrain > /dev/null
out=$(mktemp -d "${TMPDIR:-/tmp}/meshtrain-online-overhead.XXXXXX")
trap 'rm -rf "$out"' EXIT
mpirun --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 \
  -np 2 "$build_dir/bin/online_heat" bench "$steps" : \
  -np 1 "$build_dir/bin/meshtrain" train examples/online_heat/online.toml \
  --set run.output_dir="$out/run" --set train.log_every=100000 > "$out/log" 2>&1 ||
  { cat "$out/log"; exit 1; }
grep '^{"bench": "online_producer_overhead"' "$out/log"
