#!/bin/bash
# Usage: expect_abort.sh TOOL MODE STATUS MESSAGE MPIEXEC [MPIEXEC FLAGS...]
# Runs `TOOL MODE` on 2 ranks; rank 1 fails while rank 0 waits in a barrier. Passes when the
# job ends within 30 s (the collective timeout is set to 120 s, so only an abort ends it that
# soon) with exit status STATUS and rank 1's MESSAGE on stderr: no rank was left hanging.
tool=$1 mode=$2 expected_status=$3 message=$4
shift 4
stderr_file=$(mktemp)
trap 'rm -f "$stderr_file"' EXIT
export MESHTRAIN_COLLECTIVE_TIMEOUT=120
timeout 30 "$@" -n 2 "$tool" "$mode" 2>"$stderr_file"
status=$?
cat "$stderr_file" >&2
if [ "$status" -eq 124 ]; then
  echo "FAIL: the job did not end within 30 s (rank 0 waited for rank 1)" >&2
  exit 1
fi
if [ "$status" -ne "$expected_status" ]; then
  echo "FAIL: exit status $status, expected $expected_status" >&2
  exit 1
fi
if ! grep -qF "error on rank 1: $message" "$stderr_file"; then
  echo "FAIL: rank 1's message '$message' is missing from stderr" >&2
  exit 1
fi
echo "PASS"
