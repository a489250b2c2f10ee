#!/usr/bin/env bash
# The communication thread ([runtime] comm_thread) against overlap on and off: FSDP (or any
# bench_train_step --mode) steps with (overlap, comm_thread) = (0,0) (1,0) (1,1) (0,1),
# alternated ROUNDS times in one run so all four see the same machine load. One JSON line per
# run on stdout (bench_train_step's, which carries "overlap", "comm_thread" and
# "comm_thread_running"; "where" added), then one summary line per place with the medians of
# the four and the ratios to (0,0). With HARDWARE=FILE (a `meshtrain calibrate` profile of the
# same config with comm_thread = false) the runs also carry the cost model's prediction
# (predicted_step_time_s; with overlap predicted_full_overlap_s), and the summary the model's
# figures; HARDWARE_THREAD=FILE (calibrated with comm_thread = true, so its overlap is the
# thread's) is used for the runs with the thread (default: HARDWARE). The profiles must come
# from the same place (e.g. calibrated under scripts/simhosts at the same rate):
#   scripts/simhosts shell --hosts 2 --slots 1 --rate 1gbit -- bash -c \
#     '"$SIMHOSTS_MPIRUN" -np 2 build/bin/meshtrain calibrate off.toml --out hw.toml;
#      "$SIMHOSTS_MPIRUN" -np 2 build/bin/meshtrain calibrate on.toml --out hw_thread.toml'
#
#   [HARDWARE=FILE [HARDWARE_THREAD=FILE]] bench/comm_thread.sh BUILD_DIR PLACES [ROUNDS] \
#       [-- BENCH_ARGS...]
#   PLACES: "local" (mpirun -np 2 on this machine, shared memory), "simhosts:RATE" (two
#   simulated hosts, one rank each, links limited to RATE: scripts/simhosts), or both
#   e.g. bench/comm_thread.sh build "local simhosts:1gbit" 3 -- --mode fsdp \
#          --sizes 784,2048,2048,2048,10 --batch 2048
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh  # one BLAS thread per rank; Open MPI may run as root
build=$1 places=$2 rounds=${3:-3}
# The benchmarks are not in `all` after scripts/test (MESHTRAIN_BUILD_BENCHMARKS=OFF).
cmake --build "$build" --target bench_train_step >&2
shift 2
[[ $# -gt 0 && $1 != -- ]] && shift
[[ ${1:-} == -- ]] && shift
bench=$(cd "$build" && pwd)/bin/bench_train_step
[[ -x $bench ]] || { echo "comm_thread.sh: $bench is not built" >&2; exit 2; }
absolute() { echo "$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"; }
CT_HW_OFF= CT_HW_ON=
[[ -n ${HARDWARE:-} ]] && CT_HW_OFF=$(absolute "$HARDWARE") CT_HW_ON=$CT_HW_OFF
[[ -n ${HARDWARE_THREAD:-} ]] && CT_HW_ON=$(absolute "$HARDWARE_THREAD")
export CT_BENCH=$bench CT_ROUNDS=$rounds CT_HW_OFF CT_HW_ON
# Runs the four settings ROUNDS times with the mpirun in $CT_MPIRUN; tags lines with $CT_WHERE.
runs='
  set -euo pipefail
  args=("${@:3}")
  results=$(mktemp)
  for round in $(seq "$CT_ROUNDS"); do
    for setting in "0 0" "1 0" "1 1" "0 1"; do
      overlap=${setting% *} thread=${setting#* }
      hw=()
      [[ $thread == 0 && -n $CT_HW_OFF ]] && hw=(--hardware "$CT_HW_OFF")
      [[ $thread == 1 && -n $CT_HW_ON ]] && hw=(--hardware "$CT_HW_ON")
      $CT_MPIRUN -np 2 "$CT_BENCH" --overlap "$overlap" --comm-thread "$thread" "${args[@]}" "${hw[@]}" |
        tail -n 1 |
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
       "rounds": len(runs) // 4}
for o, t, name in ((False, "0", "off_off"), (True, "0", "overlap"), (True, "1", "overlap_thread"),
                   (False, "1", "thread")):
    s = med("step_time_median_s", o, t)
    out["step_s_" + name] = s
    out["over_off_off_" + name] = s / base
    running = [r["comm_thread_running"] for r in runs if r["overlap"] == o and r["comm_thread"] == t]
    out["thread_running_" + name] = all(running)
out["hardware"] = runs[0].get("hardware")
if out["hardware"] != "defaults":
    for o, t, name in ((False, "0", "off_off"), (True, "0", "overlap"),
                       (True, "1", "overlap_thread"), (False, "1", "thread")):
        p = med("predicted_step_time_s", o, t)
        out["predicted_s_" + name] = p
        out["predicted_over_measured_" + name] = p / out["step_s_" + name]
    out["predicted_s_full_overlap"] = med("predicted_full_overlap_s", True, "1")
print(json.dumps(out))
PY
  rm -f "$results"'
for place in $places; do
  case $place in
    local)
      CT_WHERE=local CT_MPIRUN="mpirun --oversubscribe" bash -c "$runs" comm_thread x x "$@"
      ;;
    simhosts:*)
      rate=${place#simhosts:}
      CT_WHERE="simhosts $rate" scripts/simhosts shell --hosts 2 --slots 1 --rate "$rate" -- \
        bash -c 'CT_MPIRUN=$SIMHOSTS_MPIRUN; '"$runs" comm_thread x x "$@"
      ;;
    *) echo "comm_thread.sh: unknown place '$place' (local or simhosts:RATE)" >&2; exit 2 ;;
  esac
done
