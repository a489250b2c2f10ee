#!/usr/bin/env bash
# Kills or fails checkpoint saves half-way (the fault tool's test hook) and checks that the
# previous checkpoint is still the latest, loads exactly and verifies, that no incomplete
# checkpoint is named complete, that a failure on one rank is reported once, and that the
# next save succeeds.
# Usage: crash_test.sh TOOL NP PARTS MPIEXEC [MPIEXEC FLAGS...]
# PARTS: a comma-separated list of the parts to run (sync: saves killed on every rank;
# async: one rank killed during an asynchronous save; one_rank: a save failing on one rank),
# or all. Every case starts from a copy of one checkpoint of step 1 saved at the start (a
# sync one, and an async one for the async part), not from a save of its own: each mpirun
# costs about a second, and the step-1 save is the same in every case.
set -u
tool=$1
np=$2
parts=$3
shift 3
mpi=("$@" -n "$np")
wants() { [ "$parts" = all ] || [[ ",$parts," == *",$1,"* ]]; }
last=$((np - 1))  # the rank that fails alone
work=$(mktemp -d /tmp/meshtrain-crash-XXXXXX)
trap 'rm -rf "$work"' EXIT
failures=0

fail() {
  echo "FAIL: $*" >&2
  failures=$((failures + 1))
}

# Saves step 3 and checks it loads, and that no temporary file is left.
next_save_takes_over() {
  local dir=$1 name=$2 mode=$3
  "${mpi[@]}" "$tool" save "$dir" 3 $mode >"$work/log" 2>&1 || { fail "$name: save after the crash failed"; cat "$work/log"; }
  "${mpi[@]}" "$tool" check "$dir" 3 >"$work/log" 2>&1 || { fail "$name: step 3 does not load"; cat "$work/log"; }
  ls "$dir" | grep -q '\.tmp$' && fail "$name: leftovers remain: $(ls "$dir")"
}

# The step-1 checkpoints every case starts from (copied: <case dir> holds ckpt-000001.h5 and
# latest, which names it relatively).
"${mpi[@]}" "$tool" save "$work/base_sync" 1 >"$work/log" 2>&1 || { cat "$work/log"; echo "FAIL: the first sync save failed" >&2; exit 1; }
if wants async; then
  "${mpi[@]}" "$tool" save "$work/base_async" 1 async >"$work/log" 2>&1 || { cat "$work/log"; echo "FAIL: the first async save failed" >&2; exit 1; }
fi
first_save() {  # first_save DIR sync|async
  cp -r "$work/base_$2" "$1"
}

# Synchronous saves killed (abort on every rank) at each point; the step that must be latest.
wants sync && for case in "after_dataset:1 1" "after_dataset:8 1" "before_close 1" "before_rename 1" \
            "before_latest 1" "before_cleanup 2"; do
  set -- $case
  point=$1
  expect=$2
  dir="$work/${point//:/_}"
  first_save "$dir" sync
  if MESHTRAIN_TEST_FAULT=$point "${mpi[@]}" "$tool" save "$dir" 2 >"$work/log" 2>&1; then
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
  # The next complete save takes over and removes the leftovers (two of the points).
  case $point in after_dataset:8|before_latest) next_save_takes_over "$dir" "$point" "" ;; esac
  echo "ok: sync $point"
done

# Asynchronous saves: one rank is killed (SIGKILL) while its writer thread is in the middle of
# the file and its main thread runs collectives; the job dies, the previous checkpoint stays
# latest and verifies, and a resumed job saves the next one.
wants async && for point in snapshot after_dataset:2 before_close; do
  dir="$work/async_${point//:/_}"
  first_save "$dir" async
  if MESHTRAIN_TEST_FAULT=$point MESHTRAIN_TEST_FAULT_RANK=$last MESHTRAIN_TEST_FAULT_ACTION=kill \
       "${mpi[@]}" "$tool" save "$dir" 2 async >"$work/log" 2>&1; then
    fail "async $point: the killed save did not fail"
  fi
  grep -q "fault injected" "$work/log" || { fail "async $point: no 'fault injected' message"; cat "$work/log"; }
  "${mpi[@]}" "$tool" check "$dir" 1 >"$work/log" 2>&1 || { fail "async $point: latest is not step 1"; cat "$work/log"; }
  [ -f "$dir/ckpt-000002.h5" ] && fail "async $point: an incomplete checkpoint was renamed"
  next_save_takes_over "$dir" "async $point" async
  echo "ok: async kill at $point on rank $last"
done

# A save that fails on one rank only (before the file exists, and in its writer): every rank
# stops with the same error, printed once; no checkpoint of that step, no temporary file.
wants one_rank && for case in "prepare sync" "after_dataset:1 async" "snapshot async"; do
  set -- $case
  point=$1
  mode=$2
  [ "$mode" = sync ] && mode=""
  dir="$work/fail_${point//:/_}"
  first_save "$dir" sync
  if MESHTRAIN_TEST_FAULT=$point MESHTRAIN_TEST_FAULT_RANK=$last MESHTRAIN_TEST_FAULT_ACTION=throw \
       "${mpi[@]}" "$tool" save "$dir" 2 $mode >"$work/log" 2>&1; then
    fail "fail $point: the failed save exited 0"
  fi
  errors=$(grep -c "^error: .*fault injected at ${point%%:*}" "$work/log")
  [ "$errors" = 1 ] || { fail "fail $point: the error was printed $errors times, expected once"; cat "$work/log"; }
  "${mpi[@]}" "$tool" check "$dir" 1 >"$work/log" 2>&1 || { fail "fail $point: latest is not step 1"; cat "$work/log"; }
  [ -e "$dir/ckpt-000002.h5" ] && fail "fail $point: the failed checkpoint was named complete"
  [ -e "$dir/ckpt-000002.h5.tmp" ] && fail "fail $point: the failed checkpoint's temporary file remains"
  echo "ok: one-rank failure at $point ($2)"
done

if [ "$failures" -ne 0 ]; then
  echo "$failures failure(s)" >&2
  exit 1
fi
echo "all crash cases passed"
