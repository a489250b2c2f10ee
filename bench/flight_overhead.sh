#!/usr/bin/env bash
# What the flight recorder costs ([runtime] flight_records, issue 28): FSDP steps on NP ranks
# (synthetic data, mse) with the recorder off (flight_records = 0) and on (the default 64),
# interleaved in each round (the order alternates between rounds). The default model is small (784-256-256-10, batch 64) so that
# the step is short and its collectives (an all-gather and a reduce-scatter per layer, the
# loss's all-reduce) weigh the most. JSON lines: one per run and round with the median step
# time of steps 4..STEPS-1 (metrics.jsonl, log_every = 1), then one summary line per variant
# with the median over the rounds and its ratio to "off".
#
#   [STEPS=40] [ROUNDS=5] [SIZES="784, 256, 256, 10"] [BATCH=64] bench/flight_overhead.sh [NP]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
np=${1:-2}
steps=${STEPS:-40}
rounds=${ROUNDS:-5}
sizes=${SIZES:-784, 256, 256, 10}
batch=${BATCH:-64}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
common=(--set "model.sizes=[$sizes]" --set 'data.source="synthetic"'
  --set "data.batch_size=$batch" --set "train.steps=$steps" --set train.log_every=1
  --set train.eval_every=0 --set checkpoint.every_steps=0 --set 'model.loss="mse"'
  --set 'checkpoint.keep_best="test_loss"')
for round in $(seq 1 "$rounds"); do
  order="off on"
  (( round % 2 == 0 )) && order="on off"  # alternate: neither side always runs first
  for variant in $order; do
    records=0
    [[ $variant == on ]] && records=64
    out=$work/$variant-$round
    mpirun --oversubscribe --bind-to none -np "$np" build/bin/meshtrain train \
      configs/fashion_mnist_fsdp.toml "${common[@]}" --set "runtime.flight_records=$records" \
      --set "run.output_dir=\"$out\"" >/dev/null
    python3 bench/step_times.py run flight_overhead "$out/metrics.jsonl" "$variant" "$round" "$np" \
      "$batch" "${sizes// /}" 4 $((steps - 1))
  done
done | tee "$work/lines.jsonl"
python3 bench/step_times.py summary flight_overhead "$work/lines.jsonl"
