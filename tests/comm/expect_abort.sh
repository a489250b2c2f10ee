#!/bin/bash
# Usage: expect_abort.sh TOOL MPIEXEC [MPIEXEC FLAGS...]
# Runs TOOL on 2 ranks; rank 1 fails while rank 0 waits in a barrier. Passes when the job
# ends quickly with exit status 2 and the error on stderr, i.e. no rank was left hanging.
tool=$1
shift
stderr_file=$(mktemp)
trap 'rm -f "$stderr_file"' EXIT
timeout 60 "$@" -n 2 "$tool" 2>"$stderr_file"
status=$?
cat "$stderr_file" >&2
if [ "$status" -eq 124 ]; then
  echo "FAIL: the job hung (killed after 60 s)" >&2
  exit 1
fi
if [ "$status" -ne 2 ]; then
  echo "FAIL: exit status $status, expected 2 (bad input)" >&2
  exit 1
fi
if ! grep -q "error on rank 1: config key 'mesh.tp' = 3" "$stderr_file"; then
  echo "FAIL: the error message of rank 1 is missing from stderr" >&2
  exit 1
fi
echo "PASS"
