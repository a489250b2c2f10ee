#!/bin/sh
# Runs a command and checks its exit status and what it printed.
#
#   expect_exit.sh STATUS STDERR_REGEX [--stdout REGEX] [--any-lines] -- COMMAND [ARGS...]
#
# STATUS is the exact exit status expected; STDERR_REGEX (grep -E) must match stderr, or
# is "-": stderr must be empty. A failing command must report its error as ONE line on stderr
# (meshtrain's "one clear sentence"), unless --any-lines is given. --stdout REGEX must
# match stdout.
set -u
if [ $# -lt 4 ]; then
  echo "usage: $0 STATUS STDERR_REGEX [--stdout REGEX] [--any-lines] -- COMMAND [ARGS...]" >&2
  exit 64
fi
expected_status=$1
stderr_regex=$2
shift 2
stdout_regex=""
one_line=yes
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  case $1 in
    --stdout) stdout_regex=$2; shift 2 ;;
    --any-lines) one_line=no; shift ;;
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
if [ "$stderr_regex" = "-" ]; then
  [ ! -s "$work/stderr" ] || fail "stderr is not empty"
elif ! grep -Eq -- "$stderr_regex" "$work/stderr"; then
  fail "stderr does not match /$stderr_regex/"
fi
if [ "$expected_status" != 0 ] && [ "$one_line" = yes ]; then
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
