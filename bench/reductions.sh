#!/usr/bin/env bash
# The MPI library's reduce-scatter and all-reduce against meshtrain's ring ([runtime]
# reductions), one command, JSON lines on stdout:
#   1. `meshtrain calibrate` at np 2 for the memory bandwidth (the bound's B/s);
#   2. bench_reductions at np 2 and 4: 1 KiB .. MAX_BYTES per rank, fp32 and bf16, ring and
#      library interleaved round by round (ring / library and the ring against the bound);
#   3. bench_train_step of 784-4096-4096-10, batch 256, np 2: fsdp and dp with reductions =
#      "ring" and "mpi" (and tp for reference), alternated ROUNDS times, then a summary line
#      with the median samples/s of each.
#
#   bench/reductions.sh BUILD_DIR [ROUNDS] [MAX_BYTES]
#   e.g. bench/reductions.sh build 3 268435456     (a few minutes on an idle machine)
#
# BUILD_DIR must be configured with -DMESHTRAIN_ENABLE_BENCHMARKS=ON (bench_reductions,
# bench_train_step, meshtrain).
set -euo pipefail
cd "$(dirname "$0")/.."
build=$(cd "$1" && pwd) rounds=${2:-3} max_bytes=${3:-268435456}
# The benchmarks are not in `all` after scripts/test (MESHTRAIN_BUILD_BENCHMARKS=OFF).
cmake --build "$build" --target meshtrain bench_reductions bench_train_step >&2
for tool in meshtrain bench_reductions bench_train_step; do
  [[ -x $build/bin/$tool ]] || { echo "reductions.sh: $build/bin/$tool is not built" >&2; exit 2; }
done
mpirun=(mpirun --oversubscribe --bind-to none)
export OPENBLAS_NUM_THREADS=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"${mpirun[@]}" -np 2 "$build/bin/meshtrain" calibrate --out "$work/hw.toml" >&2
for np in 2 4; do
  "${mpirun[@]}" -np "$np" "$build/bin/bench_reductions" --hardware "$work/hw.toml" \
    --max-bytes "$max_bytes"
done
for round in $(seq "$rounds"); do
  for run in fsdp:ring fsdp:mpi dp:ring dp:mpi tp:mpi; do
    "${mpirun[@]}" -np 2 "$build/bin/bench_train_step" --sizes 784,4096,4096,10 --batch 256 \
      --mode "${run%%:*}" --reductions "${run##*:}" --steps 10 --warmup 2 | tail -n 1 |
      tee -a "$work/steps.jsonl"
  done
done
python3 - "$work/steps.jsonl" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
summary = {"bench": "reductions_train_steps", "rounds": len(runs) // 5}
for r in runs:
    summary.setdefault(f'{r["mode"]}_{r["reductions"]}_samples_per_s', []).append(r["samples_per_s"])
for k, v in list(summary.items()):
    if isinstance(v, list):
        summary[k] = statistics.median(v)
print(json.dumps(summary))
PY
