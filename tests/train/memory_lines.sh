#!/bin/sh
# Memory against the plan from the command line (docs/running.md, "Memory against the plan"):
# runs `meshtrain train` (under mpirun, NP ranks) and checks that the start lines hold the
# plan's memory per rank, that the line after the first step and the done line show the
# largest Kokkos peak, RSS peak and RSS over the ranks with the rank that holds them, the same
# numbers as metrics.jsonl's two memory records (one entry per rank each), and that stderr has
# exactly one "warning: rank R's Kokkos allocations ..." line naming LABEL when WARN is "yes"
# (with the figures of the first record over the plan; the end record says over_plan and lists
# LABEL as not in the plan), none when WARN is "no".
#
#   memory_lines.sh OUTPUT_DIR NP WARN LABEL -- COMMAND [ARGS...]
#
# COMMAND must write to OUTPUT_DIR (--set run.output_dir=OUTPUT_DIR); it is emptied first.
# Exit 77 (skip) without python3 (it reads the JSON records).
set -u
if [ $# -lt 6 ] || [ "$5" != "--" ]; then
  echo "usage: $0 OUTPUT_DIR NP WARN LABEL -- COMMAND [ARGS...]" >&2
  exit 64
fi
output_dir=$1
np=$2
warn=$3
label=$4
shift 5
command -v python3 >/dev/null 2>&1 || { echo "SKIP: no python3"; exit 77; }
rm -rf "$output_dir"
mkdir -p "$(dirname "$output_dir")" || exit 70
"$@" >"$output_dir.out" 2>"$output_dir.err"
status=$?
if [ "$status" != 0 ]; then
  cat "$output_dir.out" "$output_dir.err"
  echo "FAIL: exit status $status, expected 0" >&2
  exit 1
fi
python3 - "$output_dir" "$np" "$warn" "$label" <<'PY'
import json, re, sys

out_dir, np_, warn, label = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "yes", sys.argv[4]
stdout = open(out_dir + ".out").read().splitlines()
stderr = open(out_dir + ".err").read().splitlines()
failed = []

def fail(message):
    failed.append(message)

def fmt(b):  # format_bytes (partition/planner.cpp)
    if -1024 < b < 1024:
        return "%d B" % b
    v, unit = float(b), -1
    while (v >= 1024 or v <= -1024) and unit < 5:
        v /= 1024
        unit += 1
    return "%.2f %s" % (v, ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"][unit])

def max_at(values):
    at = max(range(len(values)), key=lambda i: (values[i], -i))
    return "%s (max, rank %d)" % (fmt(values[at]), at)

records = [json.loads(l) for l in open(out_dir + "/metrics.jsonl") if '"event":"memory"' in l]
if [r["when"] for r in records] != ["first_step", "end"]:
    fail("metrics.jsonl's memory records are %s, expected first_step and end"
         % [r["when"] for r in records])
for r in records:
    for key in ("kokkos_peak_bytes", "kokkos_live_bytes", "rss_peak_bytes", "rss_bytes"):
        if len(r[key]) != np_ or min(r[key]) <= 0:
            fail("%s record: %s = %s, expected %d positive entries" % (r["when"], key, r[key], np_))

planned = [l for l in stdout if l.startswith("  memory per rank, planned: ")]
if len(planned) != 1:
    fail("no start line with the plan's memory per rank")
elif records and ("Kokkos " + fmt(records[0]["planned_kokkos_bytes"]) + " (") not in planned[0]:
    fail("the start line '%s' does not show the record's planned_kokkos_bytes %d"
         % (planned[0], records[0]["planned_kokkos_bytes"]))

def figures(r):  # format_memory_figures (framework/io/metrics.cpp)
    peak = max(r["kokkos_peak_bytes"])
    return "Kokkos peak %s = %.0f%% of the plan's %s, RSS peak %s, RSS %s" % (
        max_at(r["kokkos_peak_bytes"]), 100.0 * peak / r["planned_kokkos_bytes"],
        fmt(r["planned_kokkos_bytes"]), max_at(r["rss_peak_bytes"]), max_at(r["rss_bytes"]))

if len(records) == 2:
    first = "memory after the first step (step 1), per rank: " + figures(records[0])
    if first not in stdout:
        fail("no line '%s'" % first)
    done = [l for l in stdout if l.startswith("done: ")]
    if len(done) != 1 or not done[0].endswith("; memory per rank: " + figures(records[1])):
        fail("the done line %s does not end with '; memory per rank: %s'"
             % (done, figures(records[1])))
    warnings = [l for l in stderr if re.match(r"warning: rank \d+'s Kokkos allocations", l)]
    end = records[1]
    if warn:
        # Warned once, at the first measurement over the plan.
        over = next((r for r in records if r["over_plan"]), end)
        expected = "warning: rank %d's Kokkos allocations peaked at %s" % (
            over["worst_rank"], fmt(over["kokkos_peak_bytes"][over["worst_rank"]]))
        if len(warnings) != 1 or not warnings[0].startswith(expected) or \
                ("'%s'" % label) not in warnings[0]:
            fail("expected one warning starting '%s' naming '%s', got %s" % (expected, label, warnings))
        if not end["over_plan"]:
            fail("the end record's over_plan is false")
        if not any(a["label"] == label and a["plan_item"] == "" for a in end["largest_allocations"]):
            fail("the end record does not list '%s' as not in the plan" % label)
    else:
        if warnings or any(r["over_plan"] for r in records):
            fail("a normal run warned: %s" % warnings)

for f in failed:
    print("FAIL: " + f, file=sys.stderr)
if failed:
    print("\n".join(stdout + stderr))
sys.exit(1 if failed else 0)
PY
