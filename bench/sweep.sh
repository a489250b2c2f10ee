#!/usr/bin/env bash
# `meshtrain sweep` side by side against one after another (issue 40 item 5): the same 8 runs
# of a small config (configs/fashion_mnist_dp.toml with a 784-128-10 MLP, 300 steps, one
# evaluation at the end; grid optimizer.lr x run.seed) on 2 ranks, as
#   --ranks-per-run 1   two groups of one rank, 4 runs each, side by side, and
#   --ranks-per-run 2   one group of both ranks (dp = 2), the 8 runs one after another,
# alternated ROUNDS times so both see the same machine load. One JSON line per sweep, then a
# summary line with the medians and their ratio (side by side / one after another; the issue
# asks for at most 0.6).
#
#   bench/sweep.sh BUILD_DIR [ROUNDS]      (default 3 rounds)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh  # one BLAS thread per rank; Open MPI may run as root
build=$(cd "$1" && pwd) rounds=${2:-3}
meshtrain=$build/bin/meshtrain
[[ -x $meshtrain ]] || { echo "sweep.sh: $meshtrain is not built" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mpirun=(mpirun -np 2 --oversubscribe --bind-to none)
config=(configs/fashion_mnist_dp.toml --set "model.sizes=[784, 128, 10]" --set train.steps=300
        --set train.log_every=100 --set train.eval_every=0 --set checkpoint.keep_best=test_loss
        --set checkpoint.async=false
        --grid optimizer.lr=1e-3,2e-3,3e-3,5e-3 --grid run.seed=0,1)
times=$(mktemp -p "$work")
for round in $(seq "$rounds"); do
  for per_run in 1 2; do
    start=$(date +%s.%N)
    "${mpirun[@]}" "$meshtrain" sweep "${config[@]}" --ranks-per-run "$per_run" \
      --set run.output_dir="$work/r$round-$per_run" >"$work/log" 2>&1 ||
      { cat "$work/log" >&2; exit 1; }
    end=$(date +%s.%N)
    ok=$(grep -c '"status":"ok"' "$work/r$round-$per_run/sweep/sweep.jsonl")
    seconds=$(python3 -c "print(round($end - $start, 3))")
    echo "$per_run $seconds" >>"$times"
    echo "{\"bench\": \"sweep\", \"round\": $round, \"ranks\": 2, \"ranks_per_run\": $per_run," \
         "\"runs\": 8, \"runs_ok\": $ok, \"wall_s\": $seconds}"
  done
done
python3 - "$times" <<'EOF'
import json, statistics, sys
times = {1: [], 2: []}
for line in open(sys.argv[1]):
    per_run, seconds = line.split()
    times[int(per_run)].append(float(seconds))
side, sequential = statistics.median(times[1]), statistics.median(times[2])
print(json.dumps({"bench": "sweep_summary", "ranks": 2, "runs": 8, "rounds": len(times[1]),
                  "side_by_side_s": side, "one_after_another_s": sequential,
                  "ratio": round(side / sequential, 3)}))
EOF
