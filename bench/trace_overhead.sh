#!/usr/bin/env bash
# What tracing costs ([runtime] trace_steps, issue 28): FSDP steps of 784-4096-4096-10 at batch
# 256 on NP ranks (synthetic data, mse), with tracing off and with steps 4..STEPS-1 traced, and,
# when BASE names a meshtrain built without tracing, that build too. JSON lines: one per run
# and round with the median step time of steps 4..STEPS-2 (metrics.jsonl, log_every = 1: the
# slowest rank's interval; the last traced step is left out, it also writes the files), then
# one summary line per variant with the median over the rounds and its ratio to "off". Even
# rounds run the variants in reverse order, so that the order within a round (which moved the
# ratio by 5% in one measurement) cancels out over an even number of rounds.
#
#   [STEPS=14] [ROUNDS=4] [BASE=path/to/old/meshtrain] [VARIANTS="on off base"] \
#       bench/trace_overhead.sh [NP]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
np=${1:-2}
steps=${STEPS:-14}
rounds=${ROUNDS:-4}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
variants="off on"
[[ -n ${BASE:-} ]] && variants="base $variants"
variants=${VARIANTS:-$variants}  # the order within a round, e.g. VARIANTS="on off base"
common=(--set 'model.sizes=[784, 4096, 4096, 10]' --set 'data.source="synthetic"'
  --set data.batch_size=256 --set "train.steps=$steps" --set train.log_every=1
  --set train.eval_every=0 --set checkpoint.every_steps=0 --set 'model.loss="mse"'
  --set 'checkpoint.keep_best="test_loss"')
for round in $(seq 1 "$rounds"); do
  order=$variants
  ((round % 2 == 0)) && order=$(echo "$variants" | tr ' ' '\n' | tac | tr '\n' ' ')
  for variant in $order; do
    binary=build/bin/meshtrain
    extra=()
    [[ $variant == base ]] && binary=$BASE
    [[ $variant == on ]] && extra=(--set "runtime.trace_steps=[4, $((steps - 1))]")
    out=$work/$variant-$round
    mpirun --oversubscribe --bind-to none -np "$np" "$binary" train configs/fashion_mnist_fsdp.toml \
      "${common[@]}" "${extra[@]}" --set "run.output_dir=\"$out\"" >/dev/null
    python3 bench/step_times.py run trace_overhead "$out/metrics.jsonl" "$variant" "$round" "$np" \
      256 "784,4096,4096,10" 4 $((steps - 2))
  done
done | tee "$work/lines.jsonl"
python3 bench/step_times.py summary trace_overhead "$work/lines.jsonl"
