#!/usr/bin/env bash
# Overlap on vs off across two simulated hosts (scripts/simhosts): bench_train_step with
# [runtime] overlap = false and = true, alternated ROUNDS times on one set of hosts so both
# see the same machine load; one JSON line per run on stdout (bench_train_step's, which
# carries "overlap"), then a summary line with the medians and their ratio.
#
#   bench/overlap_simhosts.sh BUILD_DIR MODE RATE [ROUNDS] [-- BENCH_ARGS...]
#   e.g. bench/overlap_simhosts.sh build fsdp 1gbit 3 -- --sizes 784,2048,2048,2048,10 --batch 2048
#
# MODE is bench_train_step's --mode (fsdp: weight prefetch); RATE the link rate (tc tbf).
# One rank per host, so every byte between ranks crosses the limited link.
set -euo pipefail
cd "$(dirname "$0")/.."
build=$1 mode=$2 rate=$3 rounds=${4:-3}
# The benchmarks are not in `all` after scripts/test (MESHTRAIN_BUILD_BENCHMARKS=OFF).
cmake --build "$build" --target meshtrain bench_train_step >&2
shift 3
[[ $# -gt 0 && $1 != -- ]] && shift
[[ ${1:-} == -- ]] && shift
bench=$(cd "$build" && pwd)/bin/bench_train_step
[[ -x $bench ]] || { echo "overlap_simhosts: $bench is not built" >&2; exit 2; }
export OVERLAP_BENCH=$bench OVERLAP_MODE=$mode OVERLAP_ROUNDS=$rounds
exec scripts/simhosts shell --hosts 2 --slots 1 --rate "$rate" -- bash -c '
  set -euo pipefail
  results=$(mktemp)
  for round in $(seq "$OVERLAP_ROUNDS"); do
    for overlap in 0 1; do
      "$SIMHOSTS_MPIRUN" -np 2 "$OVERLAP_BENCH" --mode "$OVERLAP_MODE" --overlap $overlap "$@" \
        | tail -n 1 | tee -a "$results"
    done
  done
  python3 - "$results" <<PY
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
med = {o: statistics.median(r["step_time_median_s"] for r in runs if r["overlap"] == o)
       for o in (False, True)}
print(json.dumps({"bench": "overlap_simhosts", "mode": runs[0]["mode"], "rounds": len(runs) // 2,
                  "step_s_overlap_off": med[False], "step_s_overlap_on": med[True],
                  "on_over_off": med[True] / med[False]}))
PY
  rm -f "$results"' overlap "$@"
