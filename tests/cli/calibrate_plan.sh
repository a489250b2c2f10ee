#!/bin/sh
# `meshtrain calibrate` under mpiexec writes a profile, with the rate of every GEMM shape of
# the config's step, that `meshtrain plan --hardware` reads back: the plan names the file,
# predicts a step time and prints the scaling table.
#
#   calibrate_plan.sh MESHTRAIN CONFIG NP MPIEXEC [MPIEXEC_FLAGS...]
set -u
[ $# -ge 4 ] || { echo "usage: $0 MESHTRAIN CONFIG NP MPIEXEC [FLAGS...]" >&2; exit 64; }
meshtrain=$1 config=$2 np=$3 mpiexec=$4
shift 4
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$mpiexec" -n "$np" "$@" "$meshtrain" calibrate "$config" --out "$dir/hw.toml" || exit 1
grep -q '^gemm_flops = ' "$dir/hw.toml" || { echo "FAIL: no gemm_flops in:"; cat "$dir/hw.toml"; exit 1; }
# The config's GEMM shapes, each measured ([[gemm]] tables).
grep -q '^\[\[gemm\]\]' "$dir/hw.toml" || { echo "FAIL: no [[gemm]] in:"; cat "$dir/hw.toml"; exit 1; }
# With a link to measure: meshtrain's ring against the library ([runtime] reductions).
if [ "$np" -ge 2 ]; then
  for key in ring_reduce_scatter_bandwidth ring_all_reduce_bandwidth; do
    grep -q "^$key = " "$dir/hw.toml" || { echo "FAIL: no $key in:"; cat "$dir/hw.toml"; exit 1; }
  done
  # What a small collective costs after compute on every rank: in every [links.*] table,
  # positive and at least that table's latency (calibrate raises it to the latency).
  awk '/^\[/ { links = ($0 ~ /^\[links\./); latency = ""; next }
       links && /^latency = / { latency = $3 + 0 }
       links && /^collective_overhead = / {
         n++; if (!($3 + 0 > 0) || latency == "" || $3 + 0 < latency) bad = 1 }
       END { exit !(n == 5 && !bad) }' "$dir/hw.toml" ||
    { echo "FAIL: collective_overhead missing, not positive or below its latency in:"; cat "$dir/hw.toml"; exit 1; }
  grep -q '_collective_overhead = "after a ' "$dir/hw.toml" ||
    { echo "FAIL: no collective_overhead figures in [measured]:"; cat "$dir/hw.toml"; exit 1; }
  grep -q '_reductions_1048576_bytes = "reduce-scatter library' "$dir/hw.toml" ||
    { echo "FAIL: no per-size reduction timings in [measured]:"; cat "$dir/hw.toml"; exit 1; }
fi
"$meshtrain" plan "$config" --world "$np" --hardware "$dir/hw.toml" > "$dir/plan.txt" || exit 1
for want in "hardware: $dir/hw.toml" "predicted " "scaling (cost model" "  1024  "; do
  grep -qF -- "$want" "$dir/plan.txt" || { echo "FAIL: '$want' missing from:"; cat "$dir/plan.txt"; exit 1; }
done
echo "ok: calibrate on $np ranks -> plan --hardware"
