#!/usr/bin/env bash
# Online training's ingest and the delay from publish to use (issue 38, "Measured";
# docs/online.md "Figures"): bench_online_ingest (bench/online_ingest.cpp) at 2 producers + 2
# trainer ranks in one MPI job of 4 processes. JSON lines on stdout:
#   online_ingest  part "stream": rows/s the trainer received (ROWS rows per producer of INPUTS
#                  float32 inputs and 1 target, sends of MESSAGE_ROWS rows, backpressure block);
#                  part "hdf5": the same rows written to HDF5 by the producers and read back by
#                  the trainer's HDF5 stream (rows / (write + read)); part "memcpy": a plain
#                  memcpy of the same bytes on the 2 trainer ranks; a summary with the ratios
#                  (targets: stream/hdf5 >= 5, stream/memcpy >= 0.5 for large sends).
#   online_publish_delay  a TrainingRun publishing every 10 steps, producers sending 256 rows,
#                  calling LiveModel::refresh() and sleeping 1 ms a step for SECONDS: the delay
#                  from the trainer's publish to the refresh that takes it (median, p90, max).
#   Ingest runs three times, one per INGEST_PATH (the "path" key): "whole" (every message whole:
#   the producer's copy into its ring, MPI's copy, the trainer's copy from its staging into its
#   buffer: the protocol before 2026-11-30), "split" (the default options: large messages split,
#   MPI receiving them straight into the trainer's buffer) and "direct" (split, and sent from
#   the caller's arrays: StreamProducerOptions::direct_sends). Each adds part "copies": the
#   producer's time in send() and in its pack, the trainer's time in MPI's receives and in
#   taking rows into its buffer, and the rows MPI received straight into the buffer.
# One run each; MACHINE_NOTE (default: this machine's cores and load) is copied into the lines.
#   bench/online_ingest.sh [ROWS] [INPUTS] [MESSAGE_ROWS] [SECONDS]
#     (after scripts/build; defaults 262144 rows, 63 inputs (256-byte rows), 4096 rows (1 MiB
#     messages), 20 s; SKIP_PUBLISH=1 runs the ingest alone, INGEST_PATHS chooses its paths)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
build_dir=${MESHTRAIN_BUILD_DIR:-build}
rows=${1:-262144} inputs=${2:-63} message_rows=${3:-4096} seconds=${4:-20}
cmake --build "$build_dir" --target bench_online_ingest > /dev/null
[[ ${SKIP_PUBLISH:-0} == 1 ]] && seconds=0
out=$(mktemp -d "${TMPDIR:-/tmp}/meshtrain-online-ingest.XXXXXX")
trap 'rm -rf "$out"' EXIT
export MACHINE_NOTE=${MACHINE_NOTE:-"$(getconf _NPROCESSORS_ONLN) cores shared with other sessions, load average $(cut -d' ' -f1 /proc/loadavg) at the start"}
mpirun=(mpirun --oversubscribe --bind-to none --mca mpi_yield_when_idle 1)
for path in ${INGEST_PATHS:-whole split direct}; do
  INGEST_PATH=$path "${mpirun[@]}" -x INGEST_PATH -np 4 "$build_dir/bin/bench_online_ingest" ingest \
    "$rows" "$inputs" "$message_rows" "$out"
done
[[ $seconds == 0 ]] && exit 0
RUN_DIR=$out/run "${mpirun[@]}" -x RUN_DIR -np 4 "$build_dir/bin/bench_online_ingest" publish \
  "$seconds"
