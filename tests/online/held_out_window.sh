#!/usr/bin/env bash
# Runs a `meshtrain train` command (MPMD with its producers) whose run.output_dir is OUTPUT_DIR,
# then checks that its last evaluation took TEST_ROWS held-out rows (metrics.jsonl): what
# stream.held_out_rows sets, which the default window (ceil(buffer_rows x test_fraction))
# would not give. Prints one line saying so (the registration's regular expression needs it,
# after the run's own summary line), or fails.
#   held_out_window.sh OUTPUT_DIR TEST_ROWS COMMAND...
set -uo pipefail
out=$1 rows=$2
shift 2
rm -f "$out/metrics.jsonl"
"$@"
rc=$?
[[ $rc == 0 ]] || { echo "held_out_window: the run exited $rc" >&2; exit 1; }
last=$(grep '"event":"eval"' "$out/metrics.jsonl" | tail -1)
[[ -n $last ]] || { echo "held_out_window: no evaluation in $out/metrics.jsonl" >&2; exit 1; }
[[ $last =~ \"test_rows\":$rows[,}] ]] ||
  { echo "held_out_window: the last evaluation did not take $rows rows: $last" >&2; exit 1; }
echo "held_out_window: the last evaluation took $rows held-out rows"
