#!/usr/bin/env bash
# What scripts/run and scripts/test build (issue 36): scripts/run builds only the targets its
# job uses (the `meshtrain` command and write_hdf5_dataset for the README's tour), not the test
# programs and benchmarks; scripts/test builds everything but the benchmarks (configured with
# MESHTRAIN_BUILD_BENCHMARKS=OFF, which a plain scripts/build turns back on). Runs copies of
# scripts/run, scripts/build, scripts/test and scripts/env.sh in a scratch tree with cmake, ctest, mpirun
# and scripts/setup replaced by stubs that log their arguments; then checks that the targets
# scripts/run names exist in the real build. scripts/test builds once and runs the emulated
# tests from that build (a second ctest run, -L emulated).
#   script_targets.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
source_dir=$1
build_dir=$2
work=$(mktemp -d "${TMPDIR:-/tmp}/meshtrain-script-targets.XXXXXX")
trap 'rm -rf "$work"' EXIT

real_cmake=$(command -v cmake)
mkdir -p "$work/repo/scripts" "$work/stubs"
cp "$source_dir"/scripts/{run,build,test,env.sh} "$work/repo/scripts/"
printf '#!/usr/bin/env bash\nexit 0\n' > "$work/repo/scripts/setup"
for tool in cmake ctest mpirun; do
  printf '#!/usr/bin/env bash\necho "%s $*" >> "%s/calls.log"\n' "$tool" "$work" \
    > "$work/stubs/$tool"
  chmod +x "$work/stubs/$tool"
done
export PATH="$work/stubs:$PATH"
unset MESHTRAIN_TARGETS MESHTRAIN_BUILD_DIR MESHTRAIN_JOBS

fail() {
  echo "script_targets: $1" >&2
  echo "calls:" >&2
  cat "$work/calls.log" >&2
  exit 1
}

# scripts/run: one build, of exactly its targets, then the training run.
bash "$work/repo/scripts/run" > "$work/run.log"
builds=$(grep '^cmake --build' "$work/calls.log" || true)
[[ $(wc -l <<< "$builds") -eq 1 ]] || fail "scripts/run should build once, built: $builds"
[[ $builds == "cmake --build build -j 2 --target meshtrain write_hdf5_dataset" ]] ||
  fail "scripts/run should build only meshtrain and write_hdf5_dataset, ran: $builds"
grep -q '^mpirun .* build/bin/meshtrain train configs/fashion_mnist_fsdp_tp.toml$' \
  "$work/calls.log" || fail "scripts/run did not train with build/bin/meshtrain"

# scripts/test: everything (no --target), then ctest.
: > "$work/calls.log"
MESHTRAIN_EMULATED_TESTS=0 bash "$work/repo/scripts/test" > "$work/test.log"
builds=$(grep '^cmake --build' "$work/calls.log" || true)
[[ $builds == "cmake --build build -j 2" ]] ||
  fail "scripts/test should build every target, ran: $builds"
grep -q '^ctest --test-dir build' "$work/calls.log" || fail "scripts/test ran no ctest"
# ... but not the benchmarks, which no test runs (CI's time): they leave `all`.
grep -q '^cmake -S .* -DMESHTRAIN_BUILD_BENCHMARKS=OFF' "$work/calls.log" ||
  fail "scripts/test should configure with -DMESHTRAIN_BUILD_BENCHMARKS=OFF"
# A plain scripts/build (what a developer runs) builds them again.
: > "$work/calls.log"
bash "$work/repo/scripts/build" > "$work/build.log"
grep -q '^cmake -S .* -DMESHTRAIN_BUILD_BENCHMARKS=ON' "$work/calls.log" ||
  fail "scripts/build should configure with -DMESHTRAIN_BUILD_BENCHMARKS=ON"

# scripts/test with the emulated-device-memory tests (the default): still one build (the
# emulation is an environment variable of the same programs, not a second build of the code),
# then ctest twice in it: everything but the emulated tests, then those.
: > "$work/calls.log"
bash "$work/repo/scripts/test" > "$work/test.log"
builds=$(grep '^cmake --build' "$work/calls.log" || true)
[[ $builds == "cmake --build build -j 2" ]] ||
  fail "scripts/test should build every target once, ran: $builds"
configures=$(grep -c '^cmake -S' "$work/calls.log" || true)
[[ $configures == 1 ]] || fail "scripts/test should configure one build, configured $configures"
ctests=$(grep '^ctest' "$work/calls.log" || true)
[[ $(wc -l <<< "$ctests") -eq 2 ]] || fail "scripts/test should run ctest twice, ran: $ctests"
grep -q '^ctest --test-dir build .* -LE emulated$' <<< "$ctests" ||
  fail "scripts/test's first ctest should leave out the emulated tests, ran: $ctests"
grep -q '^ctest --test-dir build .* -L emulated$' <<< "$ctests" ||
  fail "scripts/test's second ctest should run the emulated tests in build, ran: $ctests"

# The targets scripts/run names are targets of the real build, and so are the benchmarks when
# it defines them (MESHTRAIN_ENABLE_BENCHMARKS), even outside `all`: the bench scripts build
# them by name.
targets=$("$real_cmake" --build "$build_dir" --target help 2>/dev/null || true)
wanted="meshtrain write_hdf5_dataset"
if grep -q '^MESHTRAIN_ENABLE_BENCHMARKS:BOOL=ON$' "$build_dir/CMakeCache.txt"; then
  wanted+=" bench_train_step bench_collective_matmul"
fi
for target in $wanted; do
  grep -qw -- "$target" <<< "$targets" || {
    echo "script_targets: the build in $build_dir has no target $target" >&2
    exit 1
  }
done
echo "script_targets: scripts/run builds meshtrain and write_hdf5_dataset only; scripts/test builds all but the benchmarks, once"
