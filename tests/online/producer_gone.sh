#!/usr/bin/env bash
# A producer that ends without close() (docs/online.md, "Failures"): two C producers stream to
# a trainer on one rank, the last one returns from main without mt_stream_close; the trainer
# (stream.producer_timeout = 2, until = "closed") must name it in one warning, go on, count
# every row both sent and end by itself (ctest's timeout ends a hang). Twice: with steps enough
# that only the producers' ends end the run (the pulls' vote takes producer 1 for gone), and
# with 50 steps, done before the timeout comes due (the trainer's end applies it).
# With STREAM_MERGE=round_robin in the environment the trainer merges the two producers round
# robin (stream.merge): once producer 0 closed, the merge waits at producer 1's turn until it
# is taken for gone, then ends the same.
#   producer_gone.sh PRODUCER MESHTRAIN TOML OUTPUT_DIR MPIEXEC [MPIEXEC FLAGS...]
set -uo pipefail
producer=$1 meshtrain=$2 toml=$3 out=$4
shift 4
fail() {
  echo "producer_gone: $1" >&2
  exit 1
}
for steps in 100000000 50; do
  log=$out/log-$steps
  mkdir -p "$out"
  "$@" -np 2 "$producer" 4 no-close : -np 1 "$meshtrain" train "$toml" \
    --set run.output_dir="$out/run-$steps" --set stream.producer_timeout=2 \
    --set train.steps=$steps --set train.log_every=1000 \
    --set stream.merge="${STREAM_MERGE:-arrival}" > "$log" 2> "$log.stderr"
  rc=$?
  cat "$log" "$log.stderr"
  # The warning is read from stderr alone: in one file it may land inside a progress line.
  [[ $rc == 0 ]] || fail "train.steps = $steps: the job exited $rc"
  grep -q 'producer 1: sent 800 rows and ends without closing' "$log" ||
    fail "train.steps = $steps: producer 1 did not end unclosed after 800 rows"
  [[ $(grep -c 'warning: stream "c-demo": producer' "$log.stderr") == 1 ]] ||
    fail "train.steps = $steps: not one warning"
  grep -q '^warning: stream "c-demo": producer 1 (world rank 1) sent nothing for 2 s and has not closed (did it end without close()?); the trainer goes on with the [01] producers still open' "$log.stderr" ||
    fail "train.steps = $steps: no warning naming producer 1"
  if [[ $steps != 50 ]]; then
    grep -q 'stream 1600 rows' "$log" || fail "the trainer did not count the 1600 rows sent"
    grep -q '^done: [0-9]* steps' "$log" && ! grep -q '^done: 100000000 steps' "$log" ||
      fail "the run did not end when producer 1 was taken for gone"
  fi
done
echo "producer_gone: the trainer named producer 1, counted every row and ended, in the run and at its end"
