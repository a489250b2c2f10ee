#!/usr/bin/env bash
# Kills checkpoint saves half-way (MESHTRAIN_FAULT_INJECT) and checks that the previous
# checkpoint is still the latest and loads exactly, and that the next save succeeds.
# Usage: crash_test.sh TOOL NP MPIEXEC [MPIEXEC FLAGS...]
set -u
tool=$1
np=$2
shift 2
mpi=("$@" -n "$np")
work=$(mktemp -d /tmp/meshtrain-crash-XXXXXX)
trap 'rm -rf "$work"' EXIT
failures=0

fail() {
  echo "FAIL: $*" >&2
  failures=$((failures + 1))
}

# point, step that must be latest after the crash
for case in "after_dataset:1 1" "after_dataset:8 1" "before_close 1" "before_rename 1" \
            "before_latest 1" "before_cleanup 2"; do
  set -- $case
  point=$1
  expect=$2
  dir="$work/${point//:/_}"
  "${mpi[@]}" "$tool" save "$dir" 1 >"$work/log" 2>&1 || { fail "$point: first save failed"; cat "$work/log"; continue; }
  if MESHTRAIN_FAULT_INJECT=$point "${mpi[@]}" "$tool" save "$dir" 2 >"$work/log" 2>&1; then
    fail "$point: the injected save did not abort"
  fi
  grep -q "fault injected" "$work/log" || fail "$point: no 'fault injected' message"
  "${mpi[@]}" "$tool" check "$dir" "$expect" >"$work/log" 2>&1 || { fail "$point: latest is not step $expect"; cat "$work/log"; }
  case $point in
    before_latest) [ -f "$dir/ckpt-000002.h5" ] || fail "$point: the renamed checkpoint is missing" ;;
    after_dataset*|before_close|before_rename)
      [ -f "$dir/ckpt-000002.h5.tmp" ] || fail "$point: no temporary file was left"
      [ -f "$dir/ckpt-000002.h5" ] && fail "$point: an incomplete checkpoint was renamed" ;;
  esac
  # The next complete save takes over and removes the leftovers of the crash (checked for
  # two of the points, to keep the test short).
  case $point in after_dataset:8|before_latest) ;; *) echo "ok: $point"; continue ;; esac
  "${mpi[@]}" "$tool" save "$dir" 3 >"$work/log" 2>&1 || { fail "$point: save after the crash failed"; cat "$work/log"; }
  "${mpi[@]}" "$tool" check "$dir" 3 >"$work/log" 2>&1 || { fail "$point: step 3 does not load"; cat "$work/log"; }
  ls "$dir" | grep -q '\.tmp$' && fail "$point: leftovers remain: $(ls "$dir")"
  echo "ok: $point"
done

if [ "$failures" -ne 0 ]; then
  echo "$failures failure(s)" >&2
  exit 1
fi
echo "all crash cases passed"
