#!/usr/bin/env bash
# fp32 vs 16-bit steps across two simulated hosts (scripts/simhosts, one rank per host, so
# every byte between ranks crosses the limited link): bench_train_step in fp32 and with the
# mode's 16-bit policy, alternated ROUNDS times on one set of hosts so both see the same
# machine load, each predicted by the cost model from a profile calibrated first on those
# hosts with the mode's config. One JSON line per run (bench_train_step's), then a summary
# line with the medians, their ratio and the predicted/measured ratio of each.
#
#   bench/mixed_precision_simhosts.sh BUILD_DIR MODE RATE [ROUNDS] [-- BENCH_ARGS...]
#   e.g. bench/mixed_precision_simhosts.sh build dp 300mbit 3 -- --sizes 784,2048,2048,10 --batch 128
#
# MODE: dp (16-bit: reduce_dtype bf16, the gradient all-reduce) or fsdp (param_dtype and
# reduce_dtype bf16: weight gathers and gradient reduce-scatters). RATE: tc tbf rate.
set -euo pipefail
cd "$(dirname "$0")/.."
build=$1 mode=$2 rate=$3 rounds=${4:-3}
# The benchmarks are not in `all` after scripts/test (MESHTRAIN_BUILD_BENCHMARKS=OFF).
cmake --build "$build" --target meshtrain bench_train_step >&2
shift 3
[[ $# -gt 0 && $1 != -- ]] && shift
[[ ${1:-} == -- ]] && shift
bin=$(cd "$build" && pwd)/bin
[[ -x $bin/bench_train_step ]] || { echo "mixed_precision_simhosts: $bin/bench_train_step is not built" >&2; exit 2; }
case $mode in
  dp) sixteen="--param-dtype fp32 --reduce-dtype bf16" ;;
  fsdp) sixteen="--param-dtype bf16 --reduce-dtype bf16" ;;
  *) echo "mixed_precision_simhosts: MODE must be dp or fsdp, got $mode" >&2; exit 2 ;;
esac
export MP_BIN=$bin MP_MODE=$mode MP_ROUNDS=$rounds MP_SIXTEEN=$sixteen
exec scripts/simhosts shell --hosts 2 --slots 1 --rate "$rate" -- bash -c '
  set -euo pipefail
  work=$(mktemp -d)
  trap "rm -rf $work" EXIT
  # The config bench_train_step builds for the mode, for calibrate to measure its GEMMs.
  sizes=784,2048,2048,10 batch=128
  args=("$@")
  for ((k = 0; k < ${#args[@]}; k++)); do
    [[ ${args[k]} == --sizes ]] && sizes=${args[k + 1]}
    [[ ${args[k]} == --batch ]] && batch=${args[k + 1]}
  done
  printf "[mesh]\n%s = 2\n[partition]\npreset = \"%s\"\nmin_sharding_size = 0\n[model]\nkind = \"mlp\"\nsizes = [%s]\n[data]\nsource = \"synthetic\"\nbatch_size = %s\n" \
    "$MP_MODE" "$MP_MODE" "$sizes" "$batch" > "$work/config.toml"
  "$SIMHOSTS_MPIRUN" -np 2 "$MP_BIN/meshtrain" calibrate "$work/config.toml" --out "$work/hw.toml" > /dev/null
  for round in $(seq "$MP_ROUNDS"); do
    for policy in fp32 sixteen; do
      flags="--param-dtype fp32 --reduce-dtype fp32"
      [[ $policy == sixteen ]] && flags=$MP_SIXTEEN
      "$SIMHOSTS_MPIRUN" -np 2 "$MP_BIN/bench_train_step" --mode "$MP_MODE" $flags \
        --hardware "$work/hw.toml" "$@" | tail -n 1 | tee -a "$work/results.jsonl"
    done
  done
  python3 - "$work/results.jsonl" <<PY
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
def key(r): return "fp32" if r["param_dtype"] == r["reduce_dtype"] == "fp32" else "16bit"
med = lambda k, f: statistics.median(f(r) for r in runs if key(r) == k)
s32, s16 = med("fp32", lambda r: r["step_time_median_s"]), med("16bit", lambda r: r["step_time_median_s"])
sixteen = next(r for r in runs if key(r) == "16bit")
print(json.dumps({"bench": "mixed_precision_simhosts", "mode": runs[0]["mode"],
                  "param_dtype": sixteen["param_dtype"], "reduce_dtype": sixteen["reduce_dtype"],
                  "rounds": len(runs) // 2, "step_s_fp32": s32, "step_s_16bit": s16,
                  "fp32_over_16bit": s32 / s16,
                  "predicted_over_measured_fp32": med("fp32", lambda r: r["predicted_over_measured"]),
                  "predicted_over_measured_16bit": med("16bit", lambda r: r["predicted_over_measured"]),
                  "peak_rss_fp32": med("fp32", lambda r: r["peak_rss_bytes_max_rank"]),
                  "peak_rss_16bit": med("16bit", lambda r: r["peak_rss_bytes_max_rank"])}))
PY' mixed_precision "$@"
