#!/bin/bash
# Usage: flight_fault_test.sh TOOL NP FAULT MPIEXEC [MPIEXEC FLAGS...]
# Runs `TOOL run FAULT 1 5 DIR` (flight_tool.cpp) on NP ranks with a 2 s collective timeout:
# rank 1 is stopped, killed or skips collective 5 (all_reduce #3 on the world). Passes when
#   - the job ends non-zero within 30 s (never hangs) and leaves no process behind,
#   - every other rank's flight record exists, is valid JSON, its entries in order (serials
#     rising by one, sequences rising per group), the last on the world all_reduce #3,
#   - the error on stderr or the records compared after the fact (`TOOL report DIR`) name
#     rank 1 and all_reduce #3 on the world, as each fault truly leaves them:
#     stop: a survivor's timeout error says rank 1 wrote no record (it is stopped while they
#           wait); mpirun then sends it SIGCONT and SIGTERM, and its record (written on
#           SIGTERM) shows all_reduce #2 as its last, which the report names;
#     kill: Open MPI ends the others with SIGTERM as soon as rank 1 dies (before any
#           timeout); their records are written on SIGTERM and the report names rank 1 as
#           without a record while they are in all_reduce #3;
#     skip: rank 1 waits in the next collective (on the tp axis) and times out too; the
#           report names rank 1 as never having entered all_reduce #3 (its last #2), and the
#           error on stderr names whichever side aborted first.
tool=$1 np=$2 fault=$3
shift 3
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
export MESHTRAIN_COLLECTIVE_TIMEOUT=2
fail() {
  echo "FAIL ($fault, np $np): $*" >&2
  exit 1
}

start=$(date +%s)
timeout -s KILL 45 "$@" -n "$np" "$tool" run "$fault" 1 5 "$dir" >"$dir/stdout" 2>"$dir/stderr"
status=$?
elapsed=$(($(date +%s) - start))
cat "$dir/stderr" >&2
# A rank left behind (the stopped one if nothing ended it) is killed here, and fails the test.
leftover=$(pgrep -f -- "$dir" || true)
if [ -n "$leftover" ]; then
  kill -KILL $leftover 2>/dev/null
  fail "processes $leftover were still running after mpirun returned"
fi
[ "$elapsed" -le 30 ] || fail "the job took ${elapsed} s (more than 30 s)"
[ "$status" -ne 0 ] || fail "the job exited 0"
echo "job ended with status $status after ${elapsed} s"

survivors=()
for ((r = 0; r < np; ++r)); do
  [ "$r" -eq 1 ] || survivors+=("$r")
done
python3 - "$dir/flight" "${survivors[@]}" <<'EOF' || fail "the survivors' flight records are not as expected"
import json, sys
folder, ranks = sys.argv[1], [int(r) for r in sys.argv[2:]]
for rank in ranks:
    path = f"{folder}/rank-{rank}.json"
    with open(path) as f:
        record = json.load(f)
    assert record["rank"] == rank, path
    entries = record["entries"]
    serials = [e["serial"] for e in entries]
    assert serials == list(range(serials[0], serials[0] + len(serials))), (path, serials)
    last = {}
    for e in entries:
        assert e["sequence"] == last.get(e["group_id"], e["sequence"] - 1) + 1, (path, e)
        last[e["group_id"]] = e["sequence"]
    world = [e for e in entries if e["group"] == "world"]
    assert (world[-1]["op"], world[-1]["sequence"]) == ("all_reduce", 3), (path, world[-1])
    assert world[-1]["state"] in ("entered", "failed"), (path, world[-1])
    print(f"{path}: {len(entries)} entries, written on {record['reason']}")
EOF

report=$("$tool" report "$dir") || fail "flight_tool report failed"
echo "$report"
expect_report() {
  grep -qF -- "$1" <<<"$report" || fail "the report lacks: $1"
}
expect_stderr() {
  grep -qE -- "$1" "$dir/stderr" || fail "stderr lacks: $1"
}
case "$fault" in
  stop)
    expect_stderr "all_reduce #3 on world: rank 1 wrote no flight record"
    expect_report "all_reduce #3 on world: rank 1 never entered it (its last on that group: all_reduce #2)"
    ;;
  kill)
    [ ! -e "$dir/flight/rank-1.json" ] || fail "the killed rank wrote a record"
    expect_report "all_reduce #3 on world: rank 1 wrote no flight record"
    ;;
  skip)
    expect_stderr "(all_reduce #3 on world: rank 1|all_gather #3 on axis \(tp\): rank 0) never entered it"
    expect_report "all_reduce #3 on world: rank 1 never entered it (its last on that group: all_reduce #2)"
    ;;
  *)
    fail "unknown fault"
    ;;
esac
echo "PASS"
