#!/usr/bin/env bash
# Installs meshtrain from the build tree into a temporary prefix, checks that the `meshtrain`
# command is there and plans a config from it, builds
# examples/train_mlp against the installed package alone (find_package(meshtrain)), runs
# it at np 2 and checks that it trained and saved a checkpoint; then builds
# examples/predict_surrogate (beside it) the same way and runs it at np 2 on that checkpoint.
#   install_example.sh BUILD_DIR EXAMPLE_SOURCE_DIR MPIEXEC [MPIEXEC FLAGS...]
set -euo pipefail
build_dir=$1
example_dir=$2
shift 2
work=$(mktemp -d "${TMPDIR:-/tmp}/meshtrain-install-test.XXXXXX")
trap 'rm -rf "$work"' EXIT

cmake --install "$build_dir" --prefix "$work/prefix" > "$work/install.log"
test -f "$work/prefix/include/meshtrain/meshtrain.hpp"
# The command is installed too and runs from the prefix (no build tree needed): it plans the
# repository's default config for 4 ranks.
configs_dir=$(dirname "$(dirname "$example_dir")")/configs
if [[ ! -x "$work/prefix/bin/meshtrain" ]]; then
  echo "install_example: cmake --install put no bin/meshtrain in the prefix" >&2
  exit 1
fi
"$work/prefix/bin/meshtrain" plan "$configs_dir/fashion_mnist_fsdp_tp.toml" --world 4 \
  > "$work/plan.log" || { cat "$work/plan.log"; exit 1; }
grep -q '^mesh: 2x2 (fsdp=2, tp=2)' "$work/plan.log" || { cat "$work/plan.log"; exit 1; }
cmake -S "$example_dir" -B "$work/build" -DCMAKE_PREFIX_PATH="$work/prefix" \
      -DCMAKE_BUILD_TYPE=Release > "$work/configure.log" || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/build" -j 2 > "$work/build.log" || { cat "$work/build.log"; exit 1; }

"$@" -np 2 "$work/build/train_mlp" "$work/run" | tee "$work/run.log"
grep -q '^step 40/40 loss' "$work/run.log"
grep -q '^checkpoint .*ckpt-000040\.h5 (step 40)' "$work/run.log"
test -f "$work/run/checkpoints/ckpt-000040.h5"
test -s "$work/run/metrics.jsonl"

surrogate_dir=$(dirname "$example_dir")/predict_surrogate
cmake -S "$surrogate_dir" -B "$work/build-surrogate" -DCMAKE_PREFIX_PATH="$work/prefix" \
      -DCMAKE_BUILD_TYPE=Release > "$work/configure-surrogate.log" \
  || { cat "$work/configure-surrogate.log"; exit 1; }
cmake --build "$work/build-surrogate" -j 2 > "$work/build-surrogate.log" \
  || { cat "$work/build-surrogate.log"; exit 1; }
"$@" -np 2 "$work/build-surrogate/predict_surrogate" "$work/run/checkpoints" 20 | tee "$work/surrogate.log"
grep -q '^predict_surrogate: 20 time steps of 32 cells per rank, mean |output| [0-9]' "$work/surrogate.log"
echo "install_example: installed (bin/meshtrain plans), built against the package, trained and saved a checkpoint, predicted from it"
