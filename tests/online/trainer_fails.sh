#!/usr/bin/env bash
# A trainer that fails while the producers send (docs/online.md, "Failures"): C producers
# (c_producer.c until-stopped: 16 rows a millisecond until the trainer's stop comes, then 100
# sends more, then close) beside `meshtrain train` whose loss becomes infinite at its second step
# (optimizer.lr = 1e38). The trainer must tell the producers (its stop): every producer sees it,
# its sends keep returning (dropping their rows), close() returns and it exits 0; the simulation
# prints exactly one warning naming the stream and the trainer's sentence; every trainer process
# exits non-zero, rank 0 printing its one sentence. Without the stop the producers never stop
# (they give up after 20,000 sends and exit 1); ctest's timeout ends any hang.
# With KIND "refused" the trainer fails instead at set-up after its rendezvous (a
# checkpoint.init_from that does not exist): the same, with that sentence.
# With KIND "closed" the trainer is refused so too, but the producers close right after connect
# (c_producer.c close-at-once): their close() completes before the trainer, failing, could take
# it, the stop's last window. Each must still take the stop (its close waits for the trainer's
# last word) and the simulation print the one warning; before that handshake close() returned
# at once, the stop was left unreceived at MPI_Finalize and nothing was said.
#   trainer_fails.sh KIND PRODUCERS TRAINERS PRODUCER MESHTRAIN TOML OUTPUT_DIR MPIEXEC [FLAGS...]
#     KIND: loss | refused | closed
set -uo pipefail
kind=$1 producers=$2 trainers=$3 producer=$4 meshtrain=$5 toml=$6 out=$7
shift 7
mode=until-stopped
[[ $kind == closed ]] && mode=close-at-once
if [[ $kind == loss ]]; then
  failing=(--set optimizer.lr=1e38)
  sentence='the training loss became \(infinite\|NaN\) at step [0-9]*; lower optimizer.lr'
else
  failing=(--set checkpoint.init_from="$out/none.h5")
  sentence=".*checkpoint.init_from = '$out/none.h5': checkpoint '$out/none.h5' does not exist"
fi
fail() {
  echo "trainer_fails $kind ($producers producers, $trainers trainer ranks): $1" >&2
  exit 1
}
rm -rf "$out"
mkdir -p "$out/trainer-rc"
log=$out/log
# Each trainer process records its exit status and its wrapper exits 0, so that mpirun (which
# ends the job when a process exits non-zero) lets the producers finish: mpirun's status is
# then the producers'.
"$@" -np "$producers" "$producer" 4 "$mode" \
  : -np "$trainers" bash -c '"$1" train "$2" --set run.output_dir="$3/run" "${@:4}"
      echo $? > "$3/trainer-rc/$$"' trainer "$meshtrain" "$toml" "$out" "${failing[@]}" \
  > "$log" 2> "$log.stderr"
rc=$?
cat "$log" "$log.stderr"
[[ $rc == 0 ]] || fail "the job exited $rc: a producer did not exit 0"
[[ $(ls "$out/trainer-rc" | wc -l) == "$trainers" ]] ||
  fail "not every trainer process recorded its exit"
for f in "$out"/trainer-rc/*; do
  [[ $(cat "$f") != 0 ]] || fail "a trainer process exited 0: it did not fail"
done
# The trainer's one sentence (its rank 0).
[[ $(grep -c "^meshtrain: error: $sentence" "$log.stderr") == 1 ]] ||
  fail "not the trainer's one sentence"
# Every producer: took the stop, dropped rows after it, closed and exited 0 (mpirun's status).
for ((p = 0; p < producers; ++p)); do
  if [[ $kind == closed ]]; then
    grep -q "^producer $p: closed at once, stopped$" "$log" ||
      fail "producer $p closed without taking the stop"
    continue
  fi
  grep -q "^producer $p: stopped at send [0-9]*$" "$log" || fail "producer $p never took the stop"
  grep -q "^producer $p: sent [0-9]* rows, dropped [1-9][0-9]*$" "$log" ||
    fail "producer $p dropped no rows after the stop"
done
# The simulation's one warning, naming the stream and giving the trainer's sentence.
[[ $(grep -c 'warning: stream "c-demo"' "$log.stderr") == 1 ]] || fail "not one warning"
grep -q "^warning: stream \"c-demo\": the trainer stopped: $sentence.*; the simulation goes on without it" "$log.stderr" ||
  fail "the warning does not name the stream and the trainer's sentence"
if [[ $kind == closed ]]; then
  echo "trainer_fails: the producers that closed at once took the stop in close() and exited 0 with one warning; the trainer exited non-zero with its sentence"
else
  echo "trainer_fails: the producers took the stop, dropped their rows, closed and exited 0 with one warning; the trainer exited non-zero with its sentence"
fi
