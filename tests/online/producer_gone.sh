#!/usr/bin/env bash
# A producer that ends without close() (docs/online.md, "Failures"): two C producers stream to
# a trainer on one rank, the last one returns from main without mt_stream_close; the trainer
# (stream.producer_timeout = 2, until = "closed") must name it in one warning, go on, count
# every row both sent and end by itself (ctest's timeout ends a hang).
#   producer_gone.sh PRODUCER MESHTRAIN TOML OUTPUT_DIR MPIEXEC [MPIEXEC FLAGS...]
set -uo pipefail
producer=$1 meshtrain=$2 toml=$3 out=$4
shift 4
mkdir -p "$out"
"$@" -np 2 "$producer" 4 no-close : -np 1 "$meshtrain" train "$toml" \
  --set run.output_dir="$out/run" --set stream.producer_timeout=2 > "$out/log" 2>&1
rc=$?
cat "$out/log"
fail() {
  echo "producer_gone: $1" >&2
  exit 1
}
[[ $rc == 0 ]] || fail "the job exited $rc"
grep -q '^producer 1: sent 800 rows and ends without closing$' "$out/log" ||
  fail "producer 1 did not end unclosed after 800 rows"
[[ $(grep -c 'warning: stream "c-demo": producer' "$out/log") == 1 ]] || fail "not one warning"
grep -q '^warning: stream "c-demo": producer 1 (world rank 1) sent nothing for 2 s and has not closed (did it end without close()?); the trainer goes on with the 0 producers still open' "$out/log" ||
  fail "no warning naming producer 1"
grep -q 'stream 1600 rows' "$out/log" || fail "the trainer did not count the 1600 rows sent"
echo "producer_gone: the trainer named producer 1, counted every row and ended"
