#!/bin/sh
# `meshtrain evaluate` end to end (registered by tests/evaluate.cmake).
#
#   evaluate_test.sh CASE MESHTRAIN WRITE_DATA PYTHON EXPECT_EXIT WORK MPIEXEC ARGS...
#
# CASE matches_training: for each mesh of the world size (np 1: dp; np 2: tp, fsdp, and an
#   MoE model on ep = 2 (classification only); np 4: fsdp x tp, dp), a classification run (12 classes: top-5, per class; 100 test rows, so the
#   last batch is padded) and a regression run (4 outputs, targets near 100; an evaluation
#   batch of its own, normalized inputs and targets, and a test file of 20 rows, fewer than
#   the training batch) are trained
#   to their end with `meshtrain train`; `meshtrain evaluate` of the checkpoint (the
#   directory, the file, the latest pointer) on the test file then prints JSON (--json FILE,
#   --json -) equal to the run's last eval line of metrics.jsonl in every field; on another
#   mesh of the same ranks (np 2: fsdp instead of tp; np 4: tp = 4 instead of fsdp x tp) to
#   float rounding. At np 1 also a run fine-tuned from the first (checkpoint.init_from),
#   evaluated after its origin was deleted.
# CASE bad_input: an unknown checkpoint, data of another feature count, float labels under
#   cross_entropy and a --set that changes the model each end with one "meshtrain: error"
#   sentence and exit 2, leaving no --json file behind; a --json naming the checkpoint
#   (spelled another way) is refused and the checkpoint left as it was.
# CASE leaves_run_folder: a trained run's folder with flight records and a trace in it (what
#   a hung run leaves) is the same, file by file, after `meshtrain evaluate` and `meshtrain
#   predict` of its checkpoint; with --flight-dir DIR each keeps its flight records in
#   DIR/flight (the recorder clears an earlier run's records there when it starts).
set -eu
case_name=$1 meshtrain=$2 write_data=$3 python=$4 expect_exit=$5 work=$6
shift 6
# The rest is the mpirun prefix: MPIEXEC -n NP FLAGS...
np=$3

rm -rf "$work"
mkdir -p "$work"

fail() {
  echo "evaluate_test: $*" >&2
  exit 1
}

# config KIND PRESET MESH(toml lines) DIR: a tiny run on the HDF5 files of KIND (its variables
# are c_*: sh has no locals).
config() {
  c_kind=$1 c_preset=$2 c_mesh=$3 c_dir=$4
  if [ "$c_kind" = classification ]; then
    sizes="[16, 24, 12]" loss=cross_entropy eval_batch=""
  else
    sizes="[16, 24, 4]" loss=mse eval_batch="eval_batch_size = 24
normalize_inputs = \"standard\"
normalize_targets = \"standard\""
  fi
  moe=""
  if [ "$c_preset" = moe ]; then  # an MoE layer (4 experts, top 2) with its experts on ep
    c_preset=dp moe="moe_layers = [0]
experts = 4
top_k = 2"
  fi
  cat <<EOF
[run]
name = "evaluate_test"
seed = 5
output_dir = "$c_dir"
[mesh]
$c_mesh
[partition]
preset = "$c_preset"
min_sharding_size = 0
[model]
sizes = $sizes
activation = "tanh"
loss = "$loss"
$moe
[data]
source = "hdf5"
path = "$work/train_$c_kind.h5"
test_path = "$work/test_$c_kind.h5"
batch_size = 32
$eval_batch
[optimizer]
kind = "adamw"
lr = 1e-2
[train]
steps = 16
log_every = 8
eval_every = 8
[checkpoint]
every_steps = 0
async = false
EOF
}

"$write_data" "$work/train_classification.h5" 512 16 1 --classes 12
"$write_data" "$work/test_classification.h5" 100 16 2 --classes 12
"$write_data" "$work/train_regression.h5" 512 16 3 --targets 4
"$write_data" "$work/test_regression.h5" 20 16 4 --targets 4

# close_json EXPECTED_LINE ACTUAL_FILE: another mesh, the same metrics to float rounding:
# losses and regression metrics to 1e-5 relative, rows exactly, accuracies to one row in 100.
close_json() {
  "$python" - "$1" "$2" <<'EOF'
import json, math, sys
expected = json.loads(sys.argv[1])
actual = json.load(open(sys.argv[2]))
if set(expected) != set(actual):
    sys.exit(f"other fields: {sorted(expected)} vs {sorted(actual)}")
def close(key, e, a):
    if isinstance(e, list):
        return len(e) == len(a) and all(close(key, x, y) for x, y in zip(e, a))
    if e is None or a is None or isinstance(e, str):
        return e == a
    if key in ("step", "test_rows", "test_class_rows"):
        return e == a
    if "accuracy" in key:
        return abs(e - a) <= 0.0101
    return abs(e - a) <= 1e-5 * max(1.0, abs(e))
bad = [k for k in expected if not close(k, expected[k], actual[k])]
if bad:
    sys.exit("on another mesh: " + "; ".join(f"{k}: {expected[k]} vs {actual[k]}" for k in bad))
print("another mesh: the same metrics to rounding")
EOF
}

# same_json EXPECTED_LINE ACTUAL_FILE KIND: equal objects, every field, bit for bit.
same_json() {
  "$python" - "$1" "$2" "$3" <<'EOF'
import json, sys
expected = json.loads(sys.argv[1])
actual = json.load(open(sys.argv[2]))
kind = sys.argv[3]
if expected != actual:
    keys = sorted(set(expected) | set(actual))
    diff = [f"{k}: run {expected.get(k)!r} evaluate {actual.get(k)!r}" for k in keys
            if expected.get(k) != actual.get(k)]
    sys.exit("evaluate differs from the run's last evaluation: " + "; ".join(diff))
need = {"classification": ["test_accuracy", "test_top5_accuracy", "test_class_accuracy"],
        "regression": ["test_mse", "test_mae", "test_r2", "test_r2_per_output", "test_rel_l2",
                       "test_rel_l2_per_output"]}[kind]
missing = [k for k in need if k not in actual]
if missing:
    sys.exit(f"the {kind} evaluation lacks {missing}")
width = len(actual.get("test_class_accuracy") or actual.get("test_r2_per_output"))
if width != (12 if kind == "classification" else 4):
    sys.exit(f"per-class / per-output arrays have {width} entries")
print(f"{kind}: evaluate equals the last eval line ({len(actual)} fields): {json.dumps(actual)[:160]}")
EOF
}

train() {
  "$@" "$meshtrain" train "$config_file" >"$run/train.log" 2>&1 || {
    cat "$run/train.log" >&2
    fail "training failed"
  }
}

matches_training() {
  case $np in
    1) meshes="dp:dp=1" other="" ;;
    2) meshes="tp:tp=2 fsdp:fsdp=2 moe:ep=2" other="--set mesh.tp=1 --set mesh.fsdp=-1" ;;
    4) meshes="fsdp_tp:fsdp=2,tp=2 dp:dp=4" other="--set mesh.fsdp=1 --set mesh.tp=4" ;;
    *) fail "no meshes for np $np" ;;
  esac
  for entry in $meshes; do
    preset=${entry%%:*}
    mesh=$(echo "${entry#*:}" | tr ',' '\n' | sed 's/=/ = /')
    kinds="classification regression"
    [ "$preset" != moe ] || kinds=classification
    for kind in $kinds; do
      run="$work/$kind-$preset"
      mkdir -p "$run"
      config_file="$run/config.toml"
      config "$kind" "$preset" "$mesh" "$run" >"$config_file"
      train "$@"
      last_eval=$(grep '"event":"eval"' "$run/metrics.jsonl" | tail -n 1)
      [ -n "$last_eval" ] || fail "no eval line in $run/metrics.jsonl"
      grep -q '"step":16' <<EOF || fail "the last eval line is not at step 16: $last_eval"
$last_eval
EOF
      test_file="$work/test_$kind.h5"
      if [ "$kind" = classification ]; then
        "$@" "$meshtrain" evaluate "$run/checkpoints" --data "$test_file" \
          --json "$run/evaluate.json" >"$run/evaluate.log" 2>&1 ||
          { cat "$run/evaluate.log" >&2; fail "evaluate failed"; }
        grep -q "top-5" "$run/evaluate.log" || fail "no top-5 in the report"
      else
        "$@" "$meshtrain" evaluate "$run/checkpoints/latest" --data "$test_file" --json - \
          >"$run/evaluate.json" 2>"$run/evaluate.log" ||
          { cat "$run/evaluate.log" >&2; fail "evaluate failed"; }
        grep -q "output 3: MSE" "$run/evaluate.log" || fail "no per-output lines in the report"
        if [ "$entry" = "${meshes%% *}" ]; then
          # The checkpoint file itself, and data.prefetch changed: the same object again.
          "$@" "$meshtrain" evaluate "$run/checkpoints/ckpt-000016.h5" --data "$test_file" \
            --set data.prefetch=0 --json "$run/evaluate_file.json" >/dev/null 2>&1 ||
            fail "evaluate of the checkpoint file failed"
          same_json "$last_eval" "$run/evaluate_file.json" "$kind"
        fi
      fi
      cat "$run/evaluate.log"
      same_json "$last_eval" "$run/evaluate.json" "$kind"
      if [ -n "$other" ]; then
        # The first mesh's checkpoint resharded onto another mesh of the same ranks.
        # shellcheck disable=SC2086
        "$@" "$meshtrain" evaluate "$run/checkpoints" --data "$test_file" $other \
          --json "$run/evaluate_other.json" >"$run/evaluate_other.log" 2>&1 ||
          { cat "$run/evaluate_other.log" >&2; fail "evaluate on another mesh failed"; }
        grep "data:" "$run/evaluate_other.log"
        close_json "$last_eval" "$run/evaluate_other.json"
      fi
    done
    other=""
  done
  if [ "$np" = 1 ]; then
    # A fine-tuned run (checkpoint.init_from) whose origin is gone by now evaluates too: its
    # stored init_from is not read.
    origin="$work/classification-dp/checkpoints"
    run="$work/fine-tuned"
    mkdir -p "$run"
    config_file="$run/config.toml"
    {
      config classification dp "dp = 1" "$run" | sed 's/^steps = 16/steps = 4/'
      echo "init_from = \"$origin\""
    } >"$config_file"
    train "$@"
    rm -rf "$origin"
    last_eval=$(grep '"event":"eval"' "$run/metrics.jsonl" | tail -n 1)
    "$@" "$meshtrain" evaluate "$run/checkpoints" --data "$work/test_classification.h5" \
      --json "$run/evaluate.json" >"$run/evaluate.log" 2>&1 ||
      { cat "$run/evaluate.log" >&2; fail "evaluate of the fine-tuned run failed"; }
    same_json "$last_eval" "$run/evaluate.json" classification
  fi
}

bad_input() {
  run="$work/run"
  mkdir -p "$run"
  config_file="$run/config.toml"
  config classification tp "tp = 2" "$run" | sed 's/^steps = 16/steps = 2/' >"$config_file"
  train "$@"
  "$write_data" "$work/wide.h5" 40 17 1 --classes 12
  "$write_data" "$work/float_labels.h5" 40 16 1 --targets 1
  json="$work/out.json"
  sh "$expect_exit" 2 "^meshtrain: error: checkpoint '$work/none.h5' does not exist" \
    --error-line -- "$@" "$meshtrain" evaluate "$work/none.h5" \
    --data "$work/test_classification.h5" --json "$json"
  sh "$expect_exit" 2 \
    "^meshtrain: error: --data '$work/wide.h5': dataset '/x' has 17 features per row, but the model of checkpoint '.*ckpt-000002.h5' takes 16 \(model.sizes\[0\]\)" \
    --error-line -- "$@" "$meshtrain" evaluate "$run/checkpoints" --data "$work/wide.h5" \
    --json "$json"
  sh "$expect_exit" 2 \
    "^meshtrain: error: --data '$work/float_labels.h5': dataset '/y' holds floats .*store class labels as integers" \
    --error-line -- "$@" "$meshtrain" evaluate "$run/checkpoints" \
    --data "$work/float_labels.h5" --json "$json"
  sh "$expect_exit" 2 "^meshtrain: error: --set model.sizes is not allowed with evaluate" \
    --error-line -- "$@" "$meshtrain" evaluate "$run/checkpoints" \
    --data "$work/test_classification.h5" --set "model.sizes=[16, 8, 12]" --json "$json"
  [ ! -e "$json" ] && [ ! -e "$json.tmp" ] || fail "a failed evaluate left $json behind"
  # --json naming the checkpoint (spelled another way) is refused: it would be replaced.
  cp "$run/checkpoints/ckpt-000002.h5" "$work/ckpt.orig"
  sh "$expect_exit" 2 \
    "^meshtrain: error: --json '.*/checkpoints/\./ckpt-000002.h5' is the checkpoint being evaluated" \
    --error-line -- "$@" "$meshtrain" evaluate "$run/checkpoints" \
    --data "$work/test_classification.h5" --json "$run/checkpoints/./ckpt-000002.h5"
  cmp -s "$run/checkpoints/ckpt-000002.h5" "$work/ckpt.orig" ||
    fail "evaluate --json replaced the checkpoint"
  echo "bad input: five errors, one sentence each, exit 2, no --json file"
}

# The run's folder, file by file (names, then contents).
folder_snapshot() {
  (cd "$1" && find . | LC_ALL=C sort && find . -type f | LC_ALL=C sort | xargs md5sum)
}

leaves_run_folder() {
  run="$work/run"
  mkdir -p "$run"
  config_file="$run/config.toml"
  config classification tp "tp = 2" "$run" | sed 's/^steps = 16/steps = 2/' >"$config_file"
  train "$@"
  # What a hung run leaves: its flight records, and a trace.
  mkdir -p "$run/flight" "$run/trace"
  for k in 0 1; do
    echo "{\"rank\": $k, \"reason\": \"SIGTERM\"}" >"$run/flight/rank-$k.json"
    echo "{\"traceEvents\": [], \"rank\": $k}" >"$run/trace/rank-$k.json"
  done
  echo '{"traceEvents": []}' >"$run/trace/all-ranks.json"
  folder_snapshot "$run" >"$work/before"
  "$@" "$meshtrain" evaluate "$run/checkpoints" --data "$work/test_classification.h5" \
    --json "$work/evaluate.json" >"$work/evaluate.log" 2>&1 ||
    { cat "$work/evaluate.log" >&2; fail "evaluate failed"; }
  "$@" "$meshtrain" predict "$run/checkpoints" --input "$work/test_classification.h5" \
    --output "$work/predictions.h5" >"$work/predict.log" 2>&1 ||
    { cat "$work/predict.log" >&2; fail "predict failed"; }
  folder_snapshot "$run" >"$work/after"
  diff "$work/before" "$work/after" >&2 || fail "evaluate or predict changed the run's folder"
  # --flight-dir DIR: the recorder works there (it clears the records of an earlier run in
  # DIR/flight when it starts), and still not in the run's folder.
  for command in evaluate predict; do
    mkdir -p "$work/records-$command/flight"
    echo stale >"$work/records-$command/flight/rank-5.json"
  done
  "$@" "$meshtrain" evaluate "$run/checkpoints" --data "$work/test_classification.h5" \
    --flight-dir "$work/records-evaluate" >"$work/evaluate.log" 2>&1 ||
    { cat "$work/evaluate.log" >&2; fail "evaluate --flight-dir failed"; }
  "$@" "$meshtrain" predict "$run/checkpoints" --input "$work/test_classification.h5" \
    --output "$work/predictions.h5" --overwrite --flight-dir "$work/records-predict" \
    >"$work/predict.log" 2>&1 || { cat "$work/predict.log" >&2; fail "predict --flight-dir failed"; }
  for command in evaluate predict; do
    [ ! -e "$work/records-$command/flight/rank-5.json" ] ||
      fail "$command --flight-dir: the recorder did not start in $work/records-$command/flight"
  done
  folder_snapshot "$run" >"$work/after"
  diff "$work/before" "$work/after" >&2 || fail "evaluate or predict --flight-dir changed the run's folder"
  echo "the run's folder: unchanged by evaluate and predict; --flight-dir records elsewhere"
}

"$case_name" "$@"
