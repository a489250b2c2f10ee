#!/bin/sh
# Runs a command and checks its exit status and what it printed.
#
#   expect_exit.sh STATUS STDERR_REGEX [--stdout REGEX] [--any-lines | --error-line]
#                  -- COMMAND [ARGS...]
#
# STATUS is the exact exit status expected; STDERR_REGEX (grep -E) must match stderr, or
# is "-": stderr must be empty. A failing command must report its error as ONE line on stderr
# (meshtrain's "one clear sentence"), unless --any-lines is given. --stdout REGEX must
# match stdout.
# --error-line is for a whole MPI job (mpirun meshtrain train ...): stderr must hold exactly
# ONE "meshtrain: error" line (not one per rank), matching STDERR_REGEX; other lines are
# mpirun's own notices and are not counted, but none may start with "meshtrain:".
set -u
usage="usage: $0 STATUS STDERR_REGEX [--stdout REGEX] [--any-lines | --error-line] -- COMMAND [ARGS...]"
if [ $# -lt 4 ]; then
  echo "$usage" >&2
  exit 64
fi
expected_status=$1
stderr_regex=$2
shift 2
stdout_regex=""
stderr_check=one_line  # one_line | any_lines | error_line
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  case $1 in
    --stdout) stdout_regex=$2; shift 2 ;;
    --any-lines) stderr_check=any_lines; shift ;;
    --error-line) stderr_check=error_line; shift ;;
    *) echo "$0: unknown option '$1'" >&2; exit 64 ;;
  esac
done
[ "${1:-}" = "--" ] || { echo "$0: missing -- before the command" >&2; exit 64; }
shift

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
if [ "$stderr_check" = error_line ]; then
  errors=$(grep -c '^meshtrain: error' "$work/stderr")
  [ "$errors" -eq 1 ] || fail "$errors 'meshtrain: error' lines on stderr, expected exactly one"
  others=$(grep '^meshtrain:' "$work/stderr" | grep -vc '^meshtrain: error')
  [ "$others" -eq 0 ] || fail "$others other 'meshtrain:' lines on stderr"
  grep '^meshtrain: error' "$work/stderr" | grep -Eq -- "$stderr_regex" ||
    fail "the error line does not match /$stderr_regex/"
elif [ "$stderr_regex" = "-" ]; then
  [ ! -s "$work/stderr" ] || fail "stderr is not empty"
elif ! grep -Eq -- "$stderr_regex" "$work/stderr"; then
  fail "stderr does not match /$stderr_regex/"
fi
if [ "$expected_status" != 0 ] && [ "$stderr_check" = one_line ]; then
  lines=$(wc -l <"$work/stderr")
  [ "$lines" -eq 1 ] || fail "stderr has $lines lines, expected one sentence on one line"
fi
if [ -n "$stdout_regex" ] && ! grep -Eq -- "$stdout_regex" "$work/stdout"; then
  fail "stdout does not match /$stdout_regex/"
fi
if [ "$failed" != 0 ]; then
  echo "command: $*" >&2
  echo "--- stderr:" >&2; cat "$work/stderr" >&2
  echo "--- stdout (first 40 lines):" >&2; head -n 40 "$work/stdout" >&2
  exit 1
fi
echo "ok: exit $status: $*"
exit 0
