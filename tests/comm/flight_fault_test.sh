#!/bin/bash
# Usage: flight_fault_test.sh TOOL NP FAULT MPIEXEC [MPIEXEC FLAGS...]
# Runs flight_tool.cpp on NP ranks with a 2 s collective timeout and checks what the flight
# records and the errors say. FAULT stop, kill or skip: `TOOL run FAULT 1 5 DIR`, rank 1 is
# stopped, killed or skips collective 5 (all_reduce #3 on the world). Passes when
#   - the job ends non-zero within 30 s (never hangs) and leaves no process behind,
#   - every other rank's flight record exists, is valid JSON, its entries in order (serials
#     rising by one, sequences rising per group), the last on the world all_reduce #3,
#   - the error on stderr or the records compared after the fact (`TOOL report DIR`) name
#     rank 1 and all_reduce #3 on the world, as each fault truly leaves them:
#     stop: a survivor's timeout error says rank 1 wrote no record (it is stopped while they
#           wait) and that rank 1 is the root of the wait; mpirun then sends it SIGCONT and
#           SIGTERM, and its record (written on SIGTERM) shows all_reduce #2 as its last,
#           which the report names, with rank 1 as the root;
#     kill: Open MPI ends the others with SIGTERM as soon as rank 1 dies (before any
#           timeout); their records are written on SIGTERM and the report names rank 1 as
#           without a record while they are in all_reduce #3, and as the root;
#     skip: rank 1 waits in the next collective (on the tp axis) and times out too; the
#           report names rank 1 as never having entered all_reduce #3 (its last #2), and the
#           error on stderr names whichever side aborted first; both say that ranks 0 and 1
#           wait on each other in a cycle, with no root (a program that runs collectives in
#           different orders on different ranks).
# FAULT stop_fsdp or stop_tp (NP 4): `TOOL grid stop 3 K DIR` on a (fsdp=2, tp=2) mesh, world
# rank 3 stopped before the fsdp all-gather #3 (K 5) or the tp all-gather #3 (K 6): its
# partner on that axis waits on it directly, and rank 0 waits on that partner in the next
# collective, on the other axis (a chain of length 2); rank 3's partner on the other axis
# waits on it there. The timeout error and the report both follow the chain to its root:
# "rank 3 is the root: ranks 0, 1, 2 wait on it directly or through another rank".
tool=$1 np=$2 fault=$3
shift 3
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
export MESHTRAIN_COLLECTIVE_TIMEOUT=2
# Open MPI ends the ranks of an aborted job with SIGCONT and SIGTERM, then SIGKILL 1 s later
# (odls_base_sigkill_timeout): a stopped rank, continued on a loaded machine, could be killed
# before its SIGTERM handler has written its record (seen once in CI). mpirun waits out the
# whole delay before it returns, so 3 s (the test takes 2 s longer). Other MPIs ignore it.
export OMPI_MCA_odls_base_sigkill_timeout=3
fail() {
  echo "FAIL ($fault, np $np): $*" >&2
  exit 1
}

case "$fault" in
  stop_fsdp) run=(grid stop 3 5) faulty=3 ;;
  stop_tp) run=(grid stop 3 6) faulty=3 ;;
  *) run=(run "$fault" 1 5) faulty=1 ;;
esac

start=$(date +%s)
timeout -s KILL 45 "$@" -n "$np" "$tool" "${run[@]}" "$dir" >"$dir/stdout" 2>"$dir/stderr"
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
  [ "$r" -eq "$faulty" ] || survivors+=("$r")
done
python3 - "$dir/flight" "${run[0]}" "${survivors[@]}" <<'EOF' || fail "the survivors' flight records are not as expected"
import json, sys
folder, mode, ranks = sys.argv[1], sys.argv[2], [int(r) for r in sys.argv[3:]]
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
    if mode == "run":
        world = [e for e in entries if e["group"] == "world"]
        assert (world[-1]["op"], world[-1]["sequence"]) == ("all_reduce", 3), (path, world[-1])
        assert world[-1]["state"] in ("entered", "failed"), (path, world[-1])
    else:  # waiting in an all-gather on one axis, after #2 or #3 on the other
        assert entries[-1]["op"] == "all_gather", (path, entries[-1])
        assert entries[-1]["state"] in ("entered", "failed"), (path, entries[-1])
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
# Every root named on stderr (each rank's timeout error) or in the report, but `rank ROOT is
# the root` (ROOT none: every one): none may be another (a victim taken for the root).
expect_no_other_root() {
  local others
  others=$(grep -ohE "rank [0-9]+ is (the|a) root" "$dir/stderr" <(echo "$report") |
    grep -vx "rank $1 is the root" || true)
  [ -z "$others" ] || fail "a wrong root is named: $others"
}
# The ranks that wait on rank 1 (run) when it is the root.
others=$([ "$np" -eq 2 ] && echo "rank 0 waits" || echo "ranks 0, 2, 3 wait")
case "$fault" in
  stop)
    expect_stderr "all_reduce #3 on world: rank 1 wrote no flight record"
    expect_stderr "rank 1 is the root: $others on it directly or through another rank"
    expect_report "all_reduce #3 on world: rank 1 never entered it (its last on that group: all_reduce #2)"
    expect_report "rank 1 is the root: $others on it directly or through another rank"
    expect_no_other_root 1
    ;;
  kill)
    [ ! -e "$dir/flight/rank-1.json" ] || fail "the killed rank wrote a record"
    expect_report "all_reduce #3 on world: rank 1 wrote no flight record"
    expect_report "rank 1 is the root: $others on it directly or through another rank (it wrote no flight record)"
    expect_no_other_root 1
    ;;
  skip)
    expect_stderr "(all_reduce #3 on world: rank 1|all_gather #3 on axis \(tp\): rank 0) never entered it"
    expect_stderr "no rank is at the root of the wait of ranks 0, 1.*: ranks 0, 1 wait on each other in a cycle"
    expect_report "all_reduce #3 on world: rank 1 never entered it (its last on that group: all_reduce #2)"
    expect_report "ranks 0, 1 wait on each other in a cycle"
    expect_no_other_root none  # a cycle has no root: none is invented
    ;;
  stop_fsdp | stop_tp)
    expect_stderr "rank 3 is the root: ranks 0, 1, 2 wait on it directly or through another rank"
    expect_report "rank 3 is the root: ranks 0, 1, 2 wait on it directly or through another rank"
    expect_no_other_root 3
    ;;
  *)
    fail "unknown fault"
    ;;
esac
echo "PASS"
