#!/usr/bin/env bash
# Online training against offline at equal wall clock (issue 38, "Measured"; docs/online.md
# "Figures"). bench_online_vs_offline (bench/online_vs_offline.cpp) runs examples/online_heat's
# simulation on SIM_RANKS ranks, a GRID x GRID grid, OUTPUTS output steps of SUBSTEPS substeps
# each (the rows of every cell once per output step), and the same 8-64-64-1 tanh MLP (mse,
# standard normalization, AdamW 3e-3 on a cosine schedule over the run's steps after 100 of
# warm-up, batch 256) is trained on one rank:
#   online    the simulation streams its rows (backpressure drop) to `meshtrain train` in the same
#             MPI job (a reservoir of BUFFER rows, normalization from the first 4,096), which
#             trains STEPS steps as they come (until = "steps": a trainer done before the
#             simulation drains and drops the rest; one still training when it closes trains on
#             its buffer): the pipeline's time is the job's, from mpirun's start to its end;
#   offline   the simulation writes its rows to HDF5 (one file a rank), then `meshtrain train`
#             trains on the files, (A) STEPS steps, as the online trainer did, and (B) the steps
#             that fit the online pipeline's time (A's job less its steps' time taken as fixed,
#             the rest at A's rate; B's real time is reported): the pipeline's time is the two
#             jobs', each from mpirun's start to its end.
# Both models are then evaluated (`meshtrain evaluate`) on the same held-out rows: states the
# training runs never see (bench_online_vs_offline test). JSON lines on stdout, the last one the
# summary: error ratio online / offline B (test_rel_l2; target <= 1.10), time ratio online /
# offline A (target <= 0.6), and the same for the other pairing. One run; MACHINE_NOTE (default:
# this machine's cores and load) is copied into the summary.
# The steps the cosine decays over are each run's own (online and A: STEPS; B: its steps), as
# one would run each. Pick OUTPUTS and STEPS so that the simulation and the online trainer end
# about together (the online lines say how long each took).
#   bench/online_vs_offline.sh [GRID] [SUBSTEPS] [OUTPUTS] [STEPS] [SIM_RANKS]
#     (after scripts/build with MESHTRAIN_BUILD_BENCHMARKS=ON; defaults 32, 100, 3000, 7000, 1:
#     about 2 minutes here)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
build_dir=${MESHTRAIN_BUILD_DIR:-build}
grid=${1:-32} substeps=${2:-100} outputs=${3:-3000} steps=${4:-7000} sim_ranks=${5:-1}
buffer=${BUFFER:-262144}
cmake --build "$build_dir" --target bench_online_vs_offline meshtrain > /dev/null
out=$(mktemp -d "${TMPDIR:-/tmp}/meshtrain-online-vs-offline.XXXXXX")
trap 'rm -rf "$out"' EXIT
machine=${MACHINE_NOTE:-"$(getconf _NPROCESSORS_ONLN) cores shared with other sessions, load average $(cut -d' ' -f1 /proc/loadavg) at the start"}
mpirun=(mpirun --oversubscribe --bind-to none)
bench=$build_dir/bin/bench_online_vs_offline
meshtrain=$build_dir/bin/meshtrain
now() { date +%s.%N; }
# the last value of KEY in a JSON-lines file
last() { python3 -c 'import json,sys
v=[json.loads(l)[sys.argv[2]] for l in open(sys.argv[1]) if sys.argv[2] in json.loads(l)]
print(v[-1])' "$1" "$2"; }

common="[model]
sizes = [8, 64, 64, 1]
activation = \"tanh\"
loss = \"mse\"
[partition]
preset = \"dp\"
[mesh]
dp = -1
[optimizer]
kind = \"adamw\"
lr = 0.003
schedule = \"cosine\"
warmup_steps = 100
[train]
log_every = 1000000"
cat > "$out/online.toml" <<EOF
[run]
output_dir = "$out/online"
[data]
source = "stream"
batch_size = 256
normalize_inputs = "standard"
normalize_targets = "standard"
[stream]
name = "heat-bench"
dtype = "float64"
buffer_rows = $buffer
policy = "reservoir"
min_rows = 4096
until = "steps"
$common
steps = $steps
EOF
offline_config() {  # NAME STEPS
  cat > "$out/$1.toml" <<EOF
[run]
output_dir = "$out/$1"
[data]
source = "hdf5"
path = "$out/rows/train-*.h5"
batch_size = 256
normalize_inputs = "standard"
normalize_targets = "standard"
$common
steps = $2
EOF
}
evaluate() {  # RUN: test_rel_l2 and test_mse of its last checkpoint on the held-out rows
  "${mpirun[@]}" -np 1 "$meshtrain" evaluate "$out/$1/checkpoints" --data "$out/test.h5" \
    --json "$out/$1-eval.json" > "$out/$1-eval.log" 2>&1 || { cat "$out/$1-eval.log"; exit 1; }
}

mkdir -p "$out/rows"
"${mpirun[@]}" -np 1 "$bench" test "$grid" "$substeps" 8 "$out/test.h5"

# online: the simulation and the trainer in one job
t0=$(now)
"${mpirun[@]}" -np "$sim_ranks" "$bench" online "$grid" "$substeps" "$outputs" : \
  -np 1 "$meshtrain" train "$out/online.toml" > "$out/online.log" 2>&1 ||
  { cat "$out/online.log"; exit 1; }
online_s=$(python3 -c "print($(now) - $t0)")
grep '^{"bench": "online_vs_offline"' "$out/online.log"
online_steps=$steps
made=$(last "$out/online/metrics.jsonl" step)
[[ $made == "$steps" ]] || { echo "online_vs_offline: the online trainer made $made steps, not $steps" >&2; exit 1; }
received=$(last "$out/online/metrics.jsonl" stream_rows_received)
# the trainer's own time, from its last line ("done: N steps in Xs (S s), ...")
trained() { sed -n 's/^done: .* steps in [0-9]*s (\([0-9.]*\) s).*/\1/p' "$1"; }
trainer_s=$(trained "$out/online.log")
evaluate online

# offline: simulate and write, then train (A: the online trainer's steps)
t0=$(now)
"${mpirun[@]}" -np "$sim_ranks" "$bench" write "$grid" "$substeps" "$outputs" "$out/rows" \
  > "$out/write.log" 2>&1 || { cat "$out/write.log"; exit 1; }
write_s=$(python3 -c "print($(now) - $t0)")
grep '^{"bench": "online_vs_offline"' "$out/write.log"
offline_config offline_a "$online_steps"
t0=$(now)
"${mpirun[@]}" -np 1 "$meshtrain" train "$out/offline_a.toml" > "$out/offline_a.log" 2>&1 ||
  { cat "$out/offline_a.log"; exit 1; }
train_a_s=$(python3 -c "print($(now) - $t0)")
evaluate offline_a
# B: the steps that fit the online pipeline's time: A's job less its steps' time (start-up,
# statistics pass, end) is taken as fixed, the rest at A's rate
steps_a_s=$(trained "$out/offline_a.log")
steps_b=$(python3 -c "print(max(1, round($online_steps * ($online_s - $write_s - ($train_a_s - $steps_a_s)) / $steps_a_s)))")
offline_config offline_b "$steps_b"
t0=$(now)
"${mpirun[@]}" -np 1 "$meshtrain" train "$out/offline_b.toml" > "$out/offline_b.log" 2>&1 ||
  { cat "$out/offline_b.log"; exit 1; }
train_b_s=$(python3 -c "print($(now) - $t0)")
evaluate offline_b

python3 - "$out" "$online_s" "$write_s" "$train_a_s" "$train_b_s" "$online_steps" "$steps_b" \
  "$grid" "$substeps" "$outputs" "$sim_ranks" "$buffer" "$machine" "$received" "${trainer_s:-nan}" <<'EOF'
import json, sys
out, online_s, write_s, train_a_s, train_b_s = sys.argv[1], *map(float, sys.argv[2:6])
online_steps, steps_b, grid, substeps, outputs, sim_ranks, buffer = map(int, sys.argv[6:13])
machine, received, trainer_s = sys.argv[13], int(sys.argv[14]), float(sys.argv[15])
def ev(run):
    e = json.load(open(f"{out}/{run}-eval.json"))
    return e["test_rel_l2"], e["test_mse"]
on, a, b = ev("online"), ev("offline_a"), ev("offline_b")
offline_a_s, offline_b_s = write_s + train_a_s, write_s + train_b_s
for name, steps, seconds, (rel, mse) in (("online", online_steps, online_s, on),
                                         ("offline_a", online_steps, offline_a_s, a),
                                         ("offline_b", steps_b, offline_b_s, b)):
    line = {"bench": "online_vs_offline", "part": name, "train_steps": steps,
            "pipeline_s": round(seconds, 3), "test_rel_l2": rel, "test_mse": mse}
    if name == "online":
        line.update(trainer_s=trainer_s, rows_received=received)
    print(json.dumps(line))
print(json.dumps({
    "bench": "online_vs_offline", "part": "summary", "grid": grid, "substeps": substeps,
    "outputs": outputs, "sim_ranks": sim_ranks, "trainer_ranks": 1, "buffer_rows": buffer,
    "simulate_and_write_job_s": round(write_s, 3),
    "error_ratio_equal_time": round(on[0] / b[0], 4),
    # a check, not a result: offline B's steps were chosen to fit online's time (about 1)
    "check_time_ratio_equal_time": round(online_s / offline_b_s, 4),
    "error_ratio_equal_steps": round(on[0] / a[0], 4),
    "time_ratio_equal_steps": round(online_s / offline_a_s, 4),
    "targets": "error ratio <= 1.10 at equal wall clock; time ratio <= 0.6",
    "machine": machine}))
EOF
