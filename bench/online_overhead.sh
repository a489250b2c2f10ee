#!/usr/bin/env bash
# The producer's overhead (issue 38, "Measured"; docs/online.md "Figures"): examples/online_heat's
# simulation step (GRID x GRID cells on SIM_RANKS ranks: halo exchange, rows made, update) with
# sends on against off, the sends with backpressure drop beside `meshtrain train` on 1 rank.
# Prints one JSON line: step_us_off, step_us_on and ratio (the fastest of three alternated runs
# of STEPS steps each, after a warm-up with sends that gets the trainer training, so that it
# trains through every timed run alike), send_call_us (the send call itself, steady_clock around
# it, per step, the largest over the ranks; send_call_cpu_us: the thread's CPU time in it),
# ratio_send_call ((off + send_call) / off: the send's own share, what the ratio would be if the
# send slowed nothing else), exchange_us_off/on (the halo exchange's), and phase_step_us and
# phase_send_us (every run's, the warm-up first). Target: ratio <= 1.03. One run; on a loaded
# machine the ratio moves with the load (the runs without sends differ by more than 3% among
# themselves: compare phase_step_us).
#   bench/online_overhead.sh [STEPS] [GRID] [SIM_RANKS]     (after scripts/build; defaults 2000,
#                                                           32, 2)
# Environment: MPI_OPTIONS (default none) go to mpirun, e.g. "--mca mpi_yield_when_idle 1": Open
# MPI turns that on by itself when the job has more processes than the node has cores (here
# SIM_RANKS + 1 against nproc), and then every MPI call that finds nothing to do yields the core,
# which costs a millisecond or more when other processes wait for it (docs/online.md, "Figures").
# PIN=1 pins the simulation's ranks to CPUs 0 .. SIM_RANKS - 1 and the trainer to the next
# (taskset), which needs SIM_RANKS + 1 CPUs that other work leaves free to mean anything.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
build_dir=${MESHTRAIN_BUILD_DIR:-build}
steps=${1:-2000} grid=${2:-32} sim_ranks=${3:-2}
read -r -a mpi_options <<< "${MPI_OPTIONS:-}"
cmake --build "$build_dir" --target online_heat meshtrain > /dev/null
out=$(mktemp -d "${TMPDIR:-/tmp}/meshtrain-online-overhead.XXXXXX")
trap 'rm -rf "$out"' EXIT
sim=("$build_dir/bin/online_heat" bench "$steps" "$grid")
trainer=("$build_dir/bin/meshtrain" train examples/online_heat/online.toml
  --set run.output_dir="$out/run" --set train.log_every=100000)
if [[ ${PIN:-0} == 1 ]]; then
  # each simulation rank on its own CPU (its rank in the job picks it), the trainer on the next
  echo 'exec taskset -c "$OMPI_COMM_WORLD_RANK" "$@"' > "$out/pin"
  sim=(bash "$out/pin" "${sim[@]}")
  trainer=(taskset -c "$sim_ranks" "${trainer[@]}")
fi
mpirun --oversubscribe --bind-to none "${mpi_options[@]}" -np "$sim_ranks" "${sim[@]}" : \
  -np 1 "${trainer[@]}" > "$out/log" 2>&1 || { cat "$out/log"; exit 1; }
grep '^{"bench": "online_producer_overhead"' "$out/log"
