#!/usr/bin/env bash
# Expert parallelism against replicated experts (issue 19): the same MoE model's training
# step on NP ranks with its experts split over ep (ep = NP) and replicated (dp = NP, ep = 1:
# every rank computes every expert its rows choose), each with the cost model's prediction
# from a profile calibrated on that config just before (`meshtrain calibrate`).
#
#   [ROUNDS=3] [STEPS=5] bench/moe_ep.sh [NP] [SIZES] [BATCH] [EXPERTS] [TOP_K]
#       defaults: 2 784,1024,1024,10 256 8 2 (layer 1 is the MoE layer)
# Prints bench_train_step's JSON line per (round, mode) with "round", then one summary line:
# the medians over the rounds of each mode's step time and predicted / measured, the step
# time ratio replicated / ep and the expert bytes per rank of each. The rounds alternate
# the modes, so a noisy neighbour spoils a round, not a mode.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
# The benchmarks are not in `all` after scripts/test (MESHTRAIN_BUILD_BENCHMARKS=OFF).
cmake --build build --target meshtrain bench_train_step >&2
np=${1:-2}
sizes=${2:-784,1024,1024,10}
batch=${3:-256}
experts=${4:-8}
top_k=${5:-2}
mpirun=${MPIRUN:-mpirun --oversubscribe}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
write_config() {  # MESH FILE
  cat > "$2" <<TOML
[mesh]
$1
[partition]
preset = "dp"
min_sharding_size = 0
[model]
kind = "mlp"
sizes = [$sizes]
moe_layers = [1]
experts = $experts
top_k = $top_k
[data]
source = "synthetic"
batch_size = $batch
TOML
}
results=$work/results.jsonl
for round in $(seq 1 "${ROUNDS:-3}"); do
  for mode in ep dp; do
    if [[ $mode == ep ]]; then mesh="ep = $np"; else mesh=$'dp = '"$np"$'\nep = 1'; fi
    write_config "$mesh" "$work/$mode.toml"
    $mpirun -np "$np" build/bin/meshtrain calibrate "$work/$mode.toml" --out "$work/$mode-hw.toml" \
      > /dev/null
    OPENBLAS_NUM_THREADS=1 $mpirun -np "$np" build/bin/bench_train_step --sizes "$sizes" \
      --batch "$batch" --mode "$mode" --moe-layers 1 --experts "$experts" --top-k "$top_k" \
      --steps "${STEPS:-5}" --warmup 2 --sgemm-size 512 --hardware "$work/$mode-hw.toml" |
      python3 -c 'import json,sys
for l in sys.stdin:
  d=json.loads(l); d["round"]='"$round"'; print(json.dumps(d))' | tee -a "$results"
  done
done
python3 - "$results" <<'PY'
import json, statistics, sys
runs = {}
for line in open(sys.argv[1]):
    d = json.loads(line)
    runs.setdefault(d["mode"], []).append(d)
med = lambda mode, key: statistics.median(r[key] for r in runs[mode])
print(json.dumps({
    "summary": True, "bench": "moe_ep", "rounds": len(runs["ep"]),
    "mesh_ep": runs["ep"][0]["mesh"], "mesh_replicated": runs["dp"][0]["mesh"],
    "step_time_ep_s": med("ep", "step_time_median_s"),
    "step_time_replicated_s": med("dp", "step_time_median_s"),
    "replicated_over_ep": med("dp", "step_time_median_s") / med("ep", "step_time_median_s"),
    "expert_bytes_per_rank_ep": runs["ep"][0]["expert_bytes_per_rank"],
    "expert_bytes_per_rank_replicated": runs["dp"][0]["expert_bytes_per_rank"],
    "moe_buffer_bytes_per_rank_ep": runs["ep"][0]["moe_buffer_bytes_per_rank"],
    "predicted_over_measured_ep": med("ep", "predicted_over_measured"),
    "predicted_over_measured_replicated": med("dp", "predicted_over_measured"),
    "peak_rss_ep": med("ep", "peak_rss_bytes_max_rank"),
    "peak_rss_replicated": med("dp", "peak_rss_bytes_max_rank")}))
PY
