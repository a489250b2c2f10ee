#!/bin/sh
# `meshtrain predict` from the command line: trains a tiny model (3 steps, HDF5 data), then
#  - predicts at NP ranks over two input files: exit 0, FILE written, no FILE.tmp left;
#  - refuses an existing output (exit 2, naming it) unless --overwrite (exit 0), and an output
#    that is the checkpoint, its pointer or an input even with --overwrite (however spelled);
#  - an input of the wrong width: exit 2 naming the file, the dataset and both widths, and
#    neither FILE nor FILE.tmp left; a NaN input row met while predicting: exit 1 naming it,
#    nothing left either;
#  - a model-changing --set: exit 2 naming the key; an unknown checkpoint: exit 2 naming it;
#  - an output directory that does not exist: exit 2 before any work, naming the output.
#
#   predict_cli.sh MESHTRAIN WRITE_HDF5 NP MPIEXEC [MPIEXEC_FLAGS...]
set -u
[ $# -ge 4 ] || { echo "usage: $0 MESHTRAIN WRITE_HDF5 NP MPIEXEC [FLAGS...]" >&2; exit 64; }
meshtrain=$1 write=$2 np=$3 mpiexec=$4
shift 4
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*"; [ -f "$dir/err" ] && cat "$dir/err"; exit 1; }
run() { "$mpiexec" -n "$np" "$@"; }

"$write" "$dir/train.h5" 64 8 4 && "$write" "$dir/in-1.h5" 10 8 4 && "$write" "$dir/in-2.h5" 27 8 4 \
  && "$write" "$dir/wide.h5" 5 9 4 || fail "writing the data files"
cat > "$dir/tiny.toml" <<TOML
[run]
name = "tiny"
output_dir = "$dir/run"
[mesh]
dp = -1
[partition]
preset = "dp"
[model]
sizes = [8, 16, 4]
activation = "gelu"
[data]
source = "hdf5"
path = ["$dir/train.h5"]
batch_size = 8
[train]
steps = 3
TOML
run "$@" "$meshtrain" train "$dir/tiny.toml" > "$dir/train.log" 2>&1 || { cat "$dir/train.log"; fail "training"; }
ckpt="$dir/run/checkpoints"
out="$dir/out.h5"

# A prediction over two files (a glob), at NP ranks.
run "$@" "$meshtrain" predict "$ckpt" --input "$dir/in-*.h5" --output "$out" --batch-size 8 \
  > "$dir/log" 2> "$dir/err" || fail "predict exited $?"
[ -f "$out" ] || fail "no $out"
[ -e "$out.tmp" ] && fail "$out.tmp left behind"
grep -q "^predict: 37/37 rows (100.0%), .* rows/s, ETA" "$dir/log" || { cat "$dir/log"; fail "no progress line"; }

# An existing output: refused, then replaced with --overwrite.
"$meshtrain" predict "$ckpt" --input "$dir/in-1.h5" --output "$out" > /dev/null 2> "$dir/err"
[ $? -eq 2 ] || fail "an existing output was not refused with exit 2"
grep -q "output '$out' exists; pass --overwrite" "$dir/err" || fail "the refusal does not name the output"
"$meshtrain" predict "$ckpt" --input "$dir/in-1.h5" --output "$out" --overwrite > /dev/null 2> "$dir/err" \
  || fail "--overwrite exited $?"

# An output that is a file predict reads is refused (exit 2) even with --overwrite, whatever
# its spelling (compared as files, not as text), and the file is left as it was: the
# checkpoint (else `latest` would name a predictions file), the pointer naming it, an input.
ckpt_file=$(ls "$ckpt"/ckpt-*.h5 | tail -n 1)
cp "$ckpt_file" "$dir/ckpt.orig" && cp "$ckpt/latest" "$dir/latest.orig" && cp "$dir/in-1.h5" "$dir/in-1.orig" \
  || fail "copying the files predict reads"
refused() {  # refused OUTPUT ROLE MPIEXEC_FLAGS...
  r_out=$1 r_role=$2
  shift 2
  run "$@" "$meshtrain" predict "$ckpt" --input "$dir/in-1.h5" --output "$r_out" --overwrite \
    > /dev/null 2> "$dir/err"
  [ $? -eq 2 ] || fail "--output $r_out --overwrite was not refused with exit 2"
  grep -q "^meshtrain: error: --output '$r_out' is $r_role" "$dir/err" \
    || fail "the refusal of --output $r_out does not say it is $r_role"
}
refused "$ckpt/./$(basename "$ckpt_file")" "the checkpoint being read" "$@"
refused "$ckpt/latest" "the checkpoint pointer file being read" "$@"
refused "$dir/../$(basename "$dir")/in-1.h5" "an --input file" "$@"
cmp -s "$ckpt_file" "$dir/ckpt.orig" || fail "a refused predict changed the checkpoint"
cmp -s "$ckpt/latest" "$dir/latest.orig" || fail "a refused predict changed the latest pointer"
cmp -s "$dir/in-1.h5" "$dir/in-1.orig" || fail "a refused predict changed the input"
[ -e "$ckpt_file.tmp" ] && fail "$ckpt_file.tmp left behind"

# A wrong feature count: exit 2, one sentence, nothing left behind.
bad="$dir/bad.h5"
run "$@" "$meshtrain" predict "$ckpt" --input "$dir/wide.h5" --output "$bad" > /dev/null 2> "$dir/err"
[ $? -eq 2 ] || fail "a wrong feature count did not exit 2"
grep -q "input file '$dir/wide.h5': dataset /x has 9 features per row but the model .* takes 8" "$dir/err" \
  || fail "the width error does not name the file, the dataset and both widths"
[ -e "$bad" ] && fail "$bad left behind after a failure"
[ -e "$bad.tmp" ] && fail "$bad.tmp left behind after a failure"

# A row that cannot be read (a NaN in the second file) while predicting: exit 1 naming the
# file and the row, and neither FILE nor FILE.tmp left.
"$write" "$dir/nan.h5" 27 8 4 --nan 20 3 || fail "writing nan.h5"
run "$@" "$meshtrain" predict "$ckpt" --input "$dir/in-1.h5" "$dir/nan.h5" --output "$bad" --batch-size 8 \
  > /dev/null 2> "$dir/err"
[ $? -eq 1 ] || fail "a NaN input did not exit 1"
grep -q "nan.h5': /x\[20, 3\] is nan; inputs must be finite" "$dir/err" || fail "the error does not name the row"
[ -e "$bad" ] && fail "$bad left behind after a failure while predicting"
[ -e "$bad.tmp" ] && fail "$bad.tmp left behind after a failure while predicting"

# A model-changing --set, an unknown checkpoint, an unwritable output directory.
"$meshtrain" predict "$ckpt" --input "$dir/in-1.h5" --output "$bad" --set 'model.sizes=[8, 4]' > /dev/null 2> "$dir/err"
[ $? -eq 2 ] || fail "--set model.sizes was not refused with exit 2"
grep -q "model.sizes cannot be changed" "$dir/err" || fail "the refusal does not name model.sizes"
"$meshtrain" predict "$dir/no-such-ckpt" --input "$dir/in-1.h5" --output "$bad" > /dev/null 2> "$dir/err"
[ $? -eq 2 ] || fail "an unknown checkpoint did not exit 2"
grep -q "checkpoint '$dir/no-such-ckpt' does not exist" "$dir/err" || fail "the error does not name the checkpoint"
"$meshtrain" predict "$ckpt" --input "$dir/in-1.h5" --output "$dir/no/such/dir/o.h5" > /dev/null 2> "$dir/err"
[ $? -eq 2 ] || fail "an unwritable output directory did not exit 2"
grep -q "cannot write the output '$dir/no/such/dir/o.h5'" "$dir/err" || fail "the error does not name the output"
[ -e "$bad" ] && fail "$bad left behind"
echo "ok: meshtrain predict at $np ranks, its refusals and no partial output"
