#!/bin/sh
# A short run, then scripts/plot on its metrics.jsonl: the plot script must exit 0, print
# the PNG's path, and that file must be a PNG (its 8-byte signature) of some size; then what
# the figure holds is checked against the run's kind (tests/train/plot_check.py): the losses
# on a log scale, and test accuracy for a classifier or per-output R^2 for a regression run
# (no empty accuracy axis). The run uses a cosine schedule with warm-up, so metrics.jsonl
# holds a changing "lr".
#
#   plot_run.sh REPO_DIR OUTPUT_DIR classification|regression -- COMMAND [ARGS...]
#
# COMMAND must write to OUTPUT_DIR (--set run.output_dir=OUTPUT_DIR); it is emptied first.
# Exit 77 (skip) when python3 cannot import matplotlib (scripts/setup installs it).
set -u
if [ $# -lt 5 ] || [ "$4" != "--" ]; then
  echo "usage: $0 REPO_DIR OUTPUT_DIR classification|regression -- COMMAND [ARGS...]" >&2
  exit 64
fi
repo=$1
output_dir=$2
kind=$3
shift 4
# The Python scripts/plot uses: the first that imports matplotlib.
python=
for candidate in python3 /usr/bin/python3; do
  if "$candidate" -c "import matplotlib" 2>/dev/null; then
    python=$candidate
    break
  fi
done
if [ -z "$python" ]; then
  echo "SKIP: python3 cannot import matplotlib (scripts/setup installs python3-matplotlib)"
  exit 77
fi
rm -rf "$output_dir"
mkdir -p "$(dirname "$output_dir")" || exit 70
"$@" >"$output_dir.log" 2>&1 || { cat "$output_dir.log"; echo "FAIL: the run failed" >&2; exit 1; }
metrics=$output_dir/metrics.jsonl
grep -q '"lr":' "$metrics" || { echo "FAIL: no \"lr\" in $metrics" >&2; exit 1; }
png=$output_dir/plot.png
printed=$(bash "$repo/scripts/plot" "$metrics" -o "$png") || {
  echo "FAIL: scripts/plot exited non-zero" >&2
  exit 1
}
echo "$printed"
case "$printed" in
  *"$png"*) ;;
  *) echo "FAIL: scripts/plot did not print the PNG's path $png" >&2; exit 1 ;;
esac
[ -s "$png" ] || { echo "FAIL: $png was not written" >&2; exit 1; }
signature=$(head -c 8 "$png" | od -An -tx1 | tr -d ' \n')
[ "$signature" = "89504e470d0a1a0a" ] || { echo "FAIL: $png is not a PNG ($signature)" >&2; exit 1; }
size=$(wc -c <"$png")
[ "$size" -gt 10000 ] || { echo "FAIL: $png has only $size bytes" >&2; exit 1; }
"$python" "$(dirname "$0")/plot_check.py" "$repo" "$metrics" "$kind" || {
  echo "FAIL: the figure does not show what the $kind run recorded" >&2
  exit 1
}
echo "PASS: $png ($size bytes)"
