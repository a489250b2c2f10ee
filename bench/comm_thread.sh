#!/usr/bin/env bash
# The communication thread ([runtime] comm_thread) against overlap on and off: FSDP (or any
# bench_train_step --mode) steps with (overlap, comm_thread) = (0,0) (1,0) (1,1) (0,1),
# alternated ROUNDS times in one run so all four see the same machine load. One JSON line per
# run on stdout (bench_train_step's, which carries "overlap", "comm_thread" and
# "comm_thread_running"; "where" added), then one summary line per place with the medians of
# the four and the ratios to (0,0). With HARDWARE=FILE (a `meshtrain calibrate` profile) the
# runs also carry the cost model's prediction (predicted_step_time_s, and with overlap
# predicted_full_overlap_s), and the summary its no-overlap and full-overlap figures.
#
#   [HARDWARE=FILE] bench/comm_thread.sh BUILD_DIR PLACES [ROUNDS] [-- BENCH_ARGS...]
#   PLACES: "local" (mpirun -np 2 on this machine, shared memory), "simhosts:RATE" (two
#   simulated hosts, one rank each, links limited to RATE: scripts/simhosts), or both
#   e.g. bench/comm_thread.sh build "local simhosts:1gbit" 3 -- --mode fsdp \
#          --sizes 784,2048,2048,2048,10 --batch 2048
set -euo pipefail
cd "$(dirname "$0")/.."
build=$1 places=$2 rounds=${3:-3}
shift 2
[[ $# -gt 0 && $1 != -- ]] && shift
[[ ${1:-} == -- ]] && shift
bench=$(cd "$build" && pwd)/bin/bench_train_step
[[ -x $bench ]] || { echo "comm_thread.sh: $bench is not built" >&2; exit 2; }
hardware=()
[[ -n ${HARDWARE:-} ]] && hardware=(--hardware "$(cd "$(dirname "$HARDWARE")" && pwd)/$(basename "$HARDWARE")")
export CT_BENCH=$bench CT_ROUNDS=$rounds
# Runs the four settings ROUNDS times with the mpirun in $CT_MPIRUN; tags lines with $CT_WHERE.
runs='
  set -euo pipefail
  args=("${@:3}")
  results=$(mktemp)
  for round in $(seq "$CT_ROUNDS"); do
    for setting in "0 0" "1 0" "1 1" "0 1"; do
      overlap=${setting% *} thread=${setting#* }
      $CT_MPIRUN -np 2 "$CT_BENCH" --overlap "$overlap" --comm-thread "$thread" "${args[@]}" | tail -n 1 |
        python3 -c "import json,sys; d=json.loads(sys.stdin.read()); d[\"where\"]=\"$CT_WHERE\"; print(json.dumps(d))" |
        tee -a "$results"
    done
  done
  python3 - "$results" <<PY
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
def med(key, o, t):
    xs = [r[key] for r in runs if r["overlap"] == o and r["comm_thread"] == t and key in r]
    return statistics.median(xs) if xs else None
base = med("step_time_median_s", False, "0")
out = {"bench": "comm_thread", "where": runs[0]["where"], "mode": runs[0]["mode"],
       "rounds": len(runs) // 4, "shared_machine": True}
for o, t, name in ((False, "0", "off_off"), (True, "0", "overlap"), (True, "1", "overlap_thread"),
                   (False, "1", "thread")):
    s = med("step_time_median_s", o, t)
    out["step_s_" + name] = s
    out["over_off_off_" + name] = s / base
    running = [r["comm_thread_running"] for r in runs if r["overlap"] == o and r["comm_thread"] == t]
    out["thread_running_" + name] = all(running)
p = med("predicted_step_time_s", False, "0")
if p is not None:
    out["predicted_s_no_overlap"] = p
    out["predicted_s_full_overlap"] = med("predicted_full_overlap_s", True, "1")
    out["predicted_s_overlap_profile"] = med("predicted_step_time_s", True, "1")
print(json.dumps(out))
PY
  rm -f "$results"'
for place in $places; do
  case $place in
    local)
      CT_WHERE=local CT_MPIRUN="mpirun --oversubscribe" bash -c "$runs" comm_thread x x "$@" "${hardware[@]}"
      ;;
    simhosts:*)
      rate=${place#simhosts:}
      CT_WHERE="simhosts $rate" scripts/simhosts shell --hosts 2 --slots 1 --rate "$rate" -- \
        bash -c 'CT_MPIRUN=$SIMHOSTS_MPIRUN; '"$runs" comm_thread x x "$@" "${hardware[@]}"
      ;;
    *) echo "comm_thread.sh: unknown place '$place' (local or simhosts:RATE)" >&2; exit 2 ;;
  esac
done
