#!/bin/sh
# Runs a short `meshtrain train` (under mpirun) that writes OUTPUT_DIR and checks its
# metrics: exit status 0, OUTPUT_DIR/metrics.jsonl with exactly LOG_LINES log events
# ("event":"log"; eval events are not counted) and, when REFERENCE_DIR is not "-", that
# the first logged loss equals the reference run's to 1e-4 relative (every mesh computes
# the same function from the same weights and batches).
#
#   expect_run.sh OUTPUT_DIR LOG_LINES REFERENCE_DIR -- COMMAND [ARGS...]
#
# COMMAND must write to OUTPUT_DIR (--set run.output_dir=OUTPUT_DIR); it is emptied first.
set -u
if [ $# -lt 5 ] || [ "$4" != "--" ]; then
  echo "usage: $0 OUTPUT_DIR LOG_LINES REFERENCE_DIR -- COMMAND [ARGS...]" >&2
  exit 64
fi
output_dir=$1
log_lines=$2
reference_dir=$3
reference=""
shift 4
rm -rf "$output_dir"
mkdir -p "$(dirname "$output_dir")" || exit 70
log=$output_dir.log
"$@" >"$log" 2>&1
status=$?

failed=0
fail() {
  echo "FAIL: $*" >&2
  failed=1
}
# The "loss" value of the first log event of a metrics.jsonl (empty when there is none).
first_loss() {
  grep '"event":"log"' "$1" 2>/dev/null | head -n 1 |
    sed -n 's/.*"loss":\([-+0-9.eE]*\).*/\1/p'
}

metrics=$output_dir/metrics.jsonl
[ "$status" = 0 ] || fail "exit status $status, expected 0"
if [ ! -f "$metrics" ]; then
  fail "$metrics was not written"
else
  lines=$(grep -c '"event":"log"' "$metrics")
  [ "$lines" -eq "$log_lines" ] || fail "$metrics has $lines log events, expected $log_lines"
  loss=$(first_loss "$metrics")
  [ -n "$loss" ] || fail "no loss in the first log event of $metrics"
  if [ -n "$loss" ] && [ "$reference_dir" != "-" ]; then
    reference=$(first_loss "$reference_dir/metrics.jsonl")
    if [ -z "$reference" ]; then
      fail "no reference loss in $reference_dir/metrics.jsonl"
    elif ! awk -v a="$loss" -v b="$reference" 'BEGIN {
          d = a - b; if (d < 0) d = -d; m = b < 0 ? -b : b;
          exit !(d <= 1e-4 * m) }'; then
      fail "first logged loss $loss differs from the reference's $reference by more than 1e-4 relative"
    fi
  fi
fi
if [ "$failed" != 0 ]; then
  echo "command: $*" >&2
  echo "--- output (last 40 lines):" >&2; tail -n 40 "$log" >&2
  [ -f "$metrics" ] && { echo "--- $metrics:" >&2; cat "$metrics" >&2; }
  exit 1
fi
echo "ok: $lines log events, first loss $loss${reference:+ (reference $reference)}: $*"
exit 0
