#!/usr/bin/env bash
# examples/online_c built against an installed meshtrain alone (find_package(meshtrain)) and
# run as its README line says, beside the installed `meshtrain train` in one MPI job (2 + 2
# ranks): every row the C simulation sent is counted by the trainer, nothing is dropped
# (backpressure block), the loss falls at least 50-fold from the first progress line to the
# last, and the run saves its checkpoint.
#   online_example.sh SOURCE_DIR BUILD_DIR MPIEXEC [MPIEXEC FLAGS...]
set -euo pipefail
source_dir=$1
build_dir=$2
shift 2
work=$(mktemp -d "${TMPDIR:-/tmp}/meshtrain-online-example.XXXXXX")
trap 'rm -rf "$work"' EXIT

cmake --install "$build_dir" --prefix "$work/prefix" > "$work/install.log"
cmake -S "$source_dir/examples/online_c" -B "$work/build" -DCMAKE_PREFIX_PATH="$work/prefix" \
      -DCMAKE_BUILD_TYPE=Release > "$work/configure.log" 2>&1 || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/build" > "$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }

"$@" -np 2 "$work/build/online_c" : -np 2 "$work/prefix/bin/meshtrain" train \
  "$source_dir/examples/online_c/online.toml" --set run.output_dir="$work/run" | tee "$work/run.log"

fail() {
  echo "online_example: $1" >&2
  exit 1
}
grep -q '^online_c: 400 steps of 64 cells on 2 ranks, .* sent 25600 rows, dropped 0$' "$work/run.log" ||
  fail "the simulation did not report 25600 rows sent and none dropped"
last=$(grep '^step  *2000/2000 ' "$work/run.log") || fail "no progress line for step 2000"
[[ $last == *"stream 25600 rows"* ]] || fail "the trainer did not count the 25600 rows sent: $last"
first_loss=$(grep -m1 '^step ' "$work/run.log" | sed -E 's/.* loss ([0-9.eE+-]+) .*/\1/')
last_loss=$(sed -E 's/.* loss ([0-9.eE+-]+) .*/\1/' <<< "$last")
python3 -c "import sys; f, l = float(sys.argv[1]), float(sys.argv[2]); sys.exit(0 if l * 50 < f else 1)" \
  "$first_loss" "$last_loss" || fail "the loss fell from $first_loss to $last_loss only (want 50-fold)"
test -f "$work/run/checkpoints/ckpt-002000.h5" || fail "no checkpoint at step 2000"
echo "online_example: the C simulation sent 25600 rows, the trainer counted them and its loss fell from $first_loss to $last_loss"
