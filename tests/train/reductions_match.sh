#!/bin/sh
# The same short run with [runtime] reductions = "mpi" (the MPI library's collectives) and
# "ring" (meshtrain's own ring, framework/comm/backends/mpi_ring.hpp): both exit 0, each says
# which algorithm its groups use, and every logged loss agrees to 1e-5 relative (the two sum
# in different orders, so the bits may differ in the last places).
#
#   reductions_match.sh OUTPUT_DIR -- COMMAND [ARGS...]
#
# COMMAND is `mpirun ... meshtrain train CONFIG [--set ...]`; the script adds
# run.output_dir and runtime.reductions.
set -u
if [ $# -lt 3 ] || [ "$2" != "--" ]; then
  echo "usage: $0 OUTPUT_DIR -- COMMAND [ARGS...]" >&2
  exit 64
fi
output_dir=$1
shift 2
rm -rf "$output_dir"
mkdir -p "$output_dir" || exit 70
failed=0
fail() {
  echo "FAIL: $*" >&2
  failed=1
}
for algorithm in mpi ring; do
  "$@" --set run.output_dir="$output_dir/$algorithm" --set runtime.reductions=$algorithm \
    >"$output_dir/$algorithm.log" 2>&1 || fail "reductions = $algorithm: exit status $?"
done
grep -q '^  reductions (mpi): .*library' "$output_dir/mpi.log" ||
  fail "the mpi run does not say its groups use the library"
grep '^  reductions (ring): ' "$output_dir/ring.log" | grep -q ': ring' ||
  fail "the ring run does not say its groups use the ring"
losses() {
  grep '"event":"log"' "$1/metrics.jsonl" 2>/dev/null | sed -n 's/.*"loss":\([-+0-9.eE]*\).*/\1/p'
}
losses "$output_dir/mpi" >"$output_dir/mpi.losses"
losses "$output_dir/ring" >"$output_dir/ring.losses"
count=$(wc -l <"$output_dir/mpi.losses")
[ "$count" -gt 0 ] || fail "no logged loss in $output_dir/mpi/metrics.jsonl"
[ "$count" -eq "$(wc -l <"$output_dir/ring.losses")" ] || fail "the runs logged different numbers of losses"
paste "$output_dir/mpi.losses" "$output_dir/ring.losses" | awk '{
    d = $1 - $2; if (d < 0) d = -d; m = $1 < 0 ? -$1 : $1;
    if (!(d <= 1e-5 * m)) { print "loss " NR ": mpi " $1 ", ring " $2; bad = 1 } }
    END { exit bad }' || fail "the losses differ by more than 1e-5 relative"
if [ "$failed" != 0 ]; then
  for algorithm in mpi ring; do
    echo "--- $algorithm (last 20 lines):" >&2
    tail -n 20 "$output_dir/$algorithm.log" >&2
  done
  exit 1
fi
echo "ok: $count logged losses agree (mpi: $(tr '\n' ' ' <"$output_dir/mpi.losses"))"
