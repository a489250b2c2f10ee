#!/usr/bin/env bash
# DP gradient buckets on meshtrain's started ring ([runtime] overlap = true, reductions =
# "ring": start_all_reduce runs the ring, framework/comm/backends/mpi_ring.hpp) against the
# MPI library's MPI_Iallreduce (reductions = "mpi"), and both with overlap off for reference:
# bench_train_step of 784-4096-4096-10, batch 256, np 2 (dp), 10 timed steps after 2, the
# settings alternated ROUNDS times in one run so all see the same machine load. One JSON line
# per run on stdout (bench_train_step's, "bench": "train_step"), then a summary line
# ("bench": "started_ring") with the median step time and samples/s of each setting, the
# median of each run's fastest step, and the ratios ring / mpi (> 1: the ring is faster).
#
#   bench/started_ring.sh BUILD_DIR [ROUNDS] [COMM_THREAD]
#   e.g. bench/started_ring.sh build 5        (about a minute per round)
#   COMM_THREAD: runtime.comm_thread for every run, 0 (default) or 1 (the ring then moves on
#   the communication thread while the rank computes).
#
# BUILD_DIR must be configured with -DMESHTRAIN_ENABLE_BENCHMARKS=ON (bench_train_step).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh  # one BLAS thread per rank; Open MPI may run as root
build=$(cd "$1" && pwd) rounds=${2:-5} thread=${3:-0}
# The benchmarks are not in `all` after scripts/test (MESHTRAIN_BUILD_BENCHMARKS=OFF).
cmake --build "$build" --target bench_train_step >&2
bench=$build/bin/bench_train_step
[[ -x $bench ]] || { echo "started_ring.sh: $bench is not built" >&2; exit 2; }
mpirun=(mpirun --oversubscribe --bind-to none)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for round in $(seq "$rounds"); do
  for setting in "ring 1" "mpi 1" "ring 0" "mpi 0"; do
    reductions=${setting% *} overlap=${setting#* }
    "${mpirun[@]}" -np 2 "$bench" --sizes 784,4096,4096,10 --batch 256 --mode dp \
      --reductions "$reductions" --overlap "$overlap" --comm-thread "$thread" --steps 10 \
      --warmup 2 | tail -n 1 | tee -a "$work/steps.jsonl"
  done
done
python3 - "$work/steps.jsonl" "$thread" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
out = {"bench": "started_ring", "mode": "dp", "sizes": [784, 4096, 4096, 10], "batch": 256,
       "ranks": 2, "comm_thread": sys.argv[2], "rounds": len(runs) // 4}
for reductions in ("ring", "mpi"):
    for overlap in (True, False):
        name = f'{reductions}_{"overlap" if overlap else "no_overlap"}'
        mine = [r for r in runs if r["reductions"] == reductions and r["overlap"] == overlap]
        out["step_s_" + name] = statistics.median(r["step_time_median_s"] for r in mine)
        out["samples_per_s_" + name] = statistics.median(r["samples_per_s"] for r in mine)
        # The fastest step of each run, medianed: steadier than the medians where other jobs
        # share the cores.
        out["step_min_s_" + name] = statistics.median(r["step_time_min_s"] for r in mine)
        out["allocations_in_timed_steps_" + name] = max(
            r["heap_allocations_in_timed_steps"] + r["kokkos_allocations_in_timed_steps"]
            for r in mine)
out["ring_over_mpi_overlap"] = out["samples_per_s_ring_overlap"] / out["samples_per_s_mpi_overlap"]
out["ring_over_mpi_no_overlap"] = (out["samples_per_s_ring_no_overlap"] /
                                   out["samples_per_s_mpi_no_overlap"])
out["ring_overlap_over_ring_no_overlap"] = (out["samples_per_s_ring_overlap"] /
                                            out["samples_per_s_ring_no_overlap"])
out["ring_over_mpi_overlap_by_min_step"] = out["step_min_s_mpi_overlap"] / out["step_min_s_ring_overlap"]
out["ring_over_mpi_no_overlap_by_min_step"] = (out["step_min_s_mpi_no_overlap"] /
                                               out["step_min_s_ring_no_overlap"])
out["loadavg"] = [runs[0]["loadavg_start"], runs[-1]["loadavg_end"]]
print(json.dumps(out))
PY
