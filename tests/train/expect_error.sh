#!/bin/sh
# Runs `meshtrain train` (under mpirun) and checks that it failed the way a user should see:
# the exact exit status, and exactly ONE "meshtrain: error" line on stderr for the whole job
# (not one per rank), matching STDERR_REGEX (grep -E). Other stderr lines are mpirun's own
# notice about the non-zero exit, which are not counted; no other line may start with
# "meshtrain:".
#
#   expect_error.sh STATUS STDERR_REGEX -- COMMAND [ARGS...]
set -u
if [ $# -lt 4 ] || [ "$3" != "--" ]; then
  echo "usage: $0 STATUS STDERR_REGEX -- COMMAND [ARGS...]" >&2
  exit 64
fi
expected_status=$1
stderr_regex=$2
shift 3

work=$(mktemp -d) || exit 70
trap 'rm -rf "$work"' EXIT
"$@" >"$work/stdout" 2>"$work/stderr"
status=$?

failed=0
fail() {
  echo "FAIL: $*" >&2
  failed=1
}
[ "$status" = "$expected_status" ] || fail "exit status $status, expected $expected_status"
errors=$(grep -c '^meshtrain: error' "$work/stderr")
[ "$errors" -eq 1 ] || fail "$errors 'meshtrain: error' lines on stderr, expected exactly one"
others=$(grep '^meshtrain:' "$work/stderr" | grep -vc '^meshtrain: error')
[ "$others" -eq 0 ] || fail "$others other 'meshtrain:' lines on stderr"
grep '^meshtrain: error' "$work/stderr" | grep -Eq -- "$stderr_regex" ||
  fail "the error line does not match /$stderr_regex/"
if [ "$failed" != 0 ]; then
  echo "command: $*" >&2
  echo "--- stderr:" >&2; cat "$work/stderr" >&2
  echo "--- stdout (first 40 lines):" >&2; head -n 40 "$work/stdout" >&2
  exit 1
fi
echo "ok: exit $status: $(grep '^meshtrain: error' "$work/stderr")"
exit 0
