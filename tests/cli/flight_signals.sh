#!/bin/bash
# Usage: flight_signals.sh MESHTRAIN MPIEXEC [MPIEXEC FLAGS...]
# The flight recorder in a real run (docs/running.md, "When a run hangs"): `meshtrain train`
# on 2 ranks with a long synthetic run; once it is stepping, SIGUSR1 to both ranks writes
# runs/<dir>/flight/rank-{0,1}.json (reason SIGUSR1, all_gather/reduce_scatter entries of the
# fsdp axis) while the run goes on; SIGTERM then writes them again (reason SIGTERM) and ends
# the job; `meshtrain flight-report DIR` reads both; a folder without records is bad input.
meshtrain=$1
shift
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
# When the first rank ends on SIGTERM, Open MPI SIGKILLs the others 1 s after signalling them
# (odls_base_sigkill_timeout); on a loaded machine that can cut a record short. (mpirun waits
# out the whole delay before it returns: 3 s, not more.)
export OMPI_MCA_odls_base_sigkill_timeout=3
fail() {
  echo "FAIL: $*" >&2
  # What the run said, so that a failure under load can be told from a wrong recorder.
  [ -s "$dir/stderr" ] && { echo "the run's stderr (last lines):" >&2; tail -n 60 "$dir/stderr" >&2; }
  [ -n "${ranks:-}" ] && kill -KILL $ranks 2>/dev/null
  exit 1
}
# The ranks: meshtrain processes whose command line names this run's folder.
rank_pids() {
  local found=""
  for p in $(pgrep -f -- "$dir"); do
    [ "$(cat /proc/$p/comm 2>/dev/null)" = meshtrain ] && found="$found $p"
  done
  echo $found
}
timeout -s KILL 60 "$@" -n 2 "$meshtrain" train "$(dirname "$0")/../../configs/fashion_mnist_fsdp.toml" \
  --set 'data.source="synthetic"' --set 'model.loss="mse"' --set 'checkpoint.keep_best="test_loss"' \
  --set 'model.sizes=[784, 64, 10]' --set train.steps=100000000 --set train.eval_every=0 \
  --set checkpoint.every_steps=0 --set train.log_every=100000000 \
  --set "run.output_dir=\"$dir/run\"" >"$dir/stdout" 2>"$dir/stderr" &
job=$!
for _ in $(seq 100); do
  [ -e "$dir/run/metrics.jsonl" ] && break
  sleep 0.2
done
[ -e "$dir/run/metrics.jsonl" ] || fail "the run did not start within 20 s"
sleep 1
ranks=$(rank_pids)
[ "$(wc -w <<<"$ranks")" -eq 2 ] || fail "expected 2 ranks, found '$ranks'"
kill -USR1 $ranks
check_records() {  # REASON: both files, valid, in order, written on REASON
  python3 - "$dir/run/flight" "$1" <<'PY'
import json, sys, time
folder, reason = sys.argv[1], sys.argv[2]
for rank in (0, 1):
    path = f"{folder}/rank-{rank}.json"
    for _ in range(50):
        try:
            record = json.load(open(path))
            if record["reason"] == reason:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    assert record["reason"] == reason, (path, record["reason"])
    entries = record["entries"]
    assert len(entries) == 64, (path, len(entries))  # the default capacity, full
    serials = [e["serial"] for e in entries]
    assert serials == list(range(serials[0], serials[0] + 64)), path
    fsdp = [e for e in entries if e["group"] == "axis (fsdp)"]
    assert {e["op"] for e in fsdp} >= {"all_gather", "reduce_scatter"}, path
    assert all(b["sequence"] == a["sequence"] + 1 for a, b in zip(fsdp, fsdp[1:])), path
    print(f"{path}: {reason}, {record['recorded']} collectives recorded")
PY
}
check_records SIGUSR1 || fail "the SIGUSR1 records are not as expected"
sleep 0.5
[ "$(rank_pids)" = "$ranks" ] || fail "the run did not go on after SIGUSR1"
kill -TERM $ranks
wait $job
status=$?
[ "$status" -ne 0 ] || fail "the job exited 0 after SIGTERM"
check_records SIGTERM || fail "the SIGTERM records are not as expected"
report=$("$meshtrain" flight-report "$dir/run") || fail "flight-report failed"
echo "$report"
grep -q "^2 flight records in $dir/run/flight/ (rank 0: SIGTERM, rank 1: SIGTERM)" <<<"$report" ||
  fail "flight-report did not read both records"
"$meshtrain" flight-report "$dir/nowhere" 2>"$dir/bad"
bad=$?
[ "$bad" -eq 2 ] || fail "flight-report of a missing folder exited $bad, expected 2"
grep -q "nowhere/flight' is not a directory of flight records" "$dir/bad" ||
  fail "flight-report of a missing folder said: $(cat "$dir/bad")"
mkdir -p "$dir/empty/flight"
"$meshtrain" flight-report "$dir/empty" 2>"$dir/bad"
bad=$?
[ "$bad" -eq 2 ] || fail "flight-report of a folder without records exited $bad, expected 2"
grep -q "empty/flight' holds no flight records" "$dir/bad" ||
  fail "flight-report of a folder without records said: $(cat "$dir/bad")"
echo PASS
