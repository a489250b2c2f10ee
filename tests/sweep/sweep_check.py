#!/usr/bin/env python3
"""Checks `meshtrain sweep` (docs/sweeps.md) against single runs of `meshtrain train`.

  sweep_check.py match   OUT CONFIG NP RANKS_PER_RUN -- MPIRUN... MESHTRAIN
  sweep_check.py failure OUT CONFIG NP RANKS_PER_RUN -- MPIRUN... MESHTRAIN

MPIRUN... is the launcher without its process count (mpiexec and its flags); the script adds
"-n NP" itself.

match: a 2 x 2 grid (optimizer.lr x data.batch_size) as one sweep of NP ranks in groups of
RANKS_PER_RUN; each run's metrics.jsonl (every logged loss and every evaluation's metrics)
must equal, bit for bit, those of the same config trained alone with `meshtrain train --set`
on RANKS_PER_RUN ranks (the reference, run here); the table (sweep.jsonl and stdout) must hold
each run's final loss, final evaluation and best metric as its metrics.jsonl has them.

failure: optimizer.lr = 1e-3, 1e30, 2e-3, 3e-3: run 1 diverges (a non-finite loss, which its
group's ranks agree on); the sweep must exit 1, report run 1 as failed with the error sentence,
and still train runs 0, 2 and 3 to their last step (run 3 on the failed run's group when
there are two groups).
"""
import json
import os
import shutil
import subprocess
import sys

# The fields of metrics.jsonl that depend on the numbers, not on the clock.
NUMERIC_LOG_FIELDS = ("step", "loss", "lr")


def fail(message):
    print("FAIL: " + message, file=sys.stderr)
    sys.exit(1)


def run(command, log_path):
    with open(log_path, "w") as log:
        result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
    return result.returncode


def events(path):
    if not os.path.exists(path):
        fail(path + " does not exist")
    logs, evals = [], []
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            if record.get("event") == "log":
                logs.append({k: record[k] for k in NUMERIC_LOG_FIELDS})
            elif record.get("event") == "eval":
                evals.append(record)
    return logs, evals


def show(log_path):
    with open(log_path) as f:
        print("--- " + log_path + ":\n" + f.read()[-4000:], file=sys.stderr)


def read_table(out):
    path = os.path.join(out, "sweep", "sweep.jsonl")
    if not os.path.exists(path):
        fail(path + " was not written")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main():
    if len(sys.argv) < 8 or sys.argv[6] != "--":
        print(__doc__, file=sys.stderr)
        sys.exit(64)
    mode, out, config, np, per_run = sys.argv[1:6]
    launcher, meshtrain = sys.argv[7:-1], sys.argv[-1]
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)

    if mode == "match":
        grid = [("optimizer.lr", ["1e-3", "3e-3"]), ("data.batch_size", ["32", "64"])]
    elif mode == "failure":
        grid = [("optimizer.lr", ["1e-3", "1e30", "2e-3", "3e-3"])]
    else:
        fail("unknown mode " + mode)
    grid_args = []
    for key, values in grid:
        grid_args += ["--grid", key + "=" + ",".join(values)]
    points = [[]]
    for key, values in grid:
        points = [p + [(key, v)] for p in points for v in values]

    sweep_log = os.path.join(out, "sweep.log")
    status = run(launcher + ["-n", np, meshtrain, "sweep", config] + grid_args +
                 ["--ranks-per-run", per_run, "--set", "run.output_dir=" + out], sweep_log)
    expected_status = 0 if mode == "match" else 1
    if status != expected_status:
        show(sweep_log)
        fail("meshtrain sweep exited with %d, expected %d" % (status, expected_status))
    with open(sweep_log) as f:
        stdout = f.read()
    table = read_table(out)
    if [row["index"] for row in table] != list(range(len(points))):
        fail("sweep.jsonl holds runs %s, expected 0..%d" % ([r["index"] for r in table],
                                                           len(points) - 1))

    for index, point in enumerate(points):
        row = table[index]
        if row["grid"] != {k: v for k, v in point}:
            fail("run %d's grid values are %s, expected %s" % (index, row["grid"], point))
        if not os.path.exists(os.path.join(row["dir"], "config.toml")):
            fail("run %d's folder %s has no config.toml" % (index, row["dir"]))
        diverging = mode == "failure" and dict(point)["optimizer.lr"] == "1e30"
        if diverging:
            if row["status"] != "failed" or "loss" not in row.get("error", ""):
                fail("run %d (lr 1e30) should have failed on a non-finite loss: %s" % (index, row))
            if ("run %d failed: " % index) not in stdout:
                show(sweep_log)
                fail("the sweep's output does not report run %d's failure" % index)
            continue
        if row["status"] != "ok":
            show(sweep_log)
            fail("run %d failed: %s" % (index, row.get("error")))
        logs, evals = events(os.path.join(row["dir"], "metrics.jsonl"))
        if not logs or not evals or row["steps"] != logs[-1]["step"] or row["steps"] != 24:
            fail("run %d did not train its 24 steps (logs %s)" % (index, logs))
        # The table against the run's own metrics.jsonl.
        if row["final_loss"] != logs[-1]["loss"]:
            fail("run %d: the table's final loss %r is not the last logged %r" %
                 (index, row["final_loss"], logs[-1]["loss"]))
        final = dict(evals[-1])
        final.pop("event")
        if row["final_eval"] != final:
            fail("run %d: the table's final evaluation %s is not the last one %s" %
                 (index, row["final_eval"], final))
        best = min(e["test_loss"] for e in evals)
        if row["best_metric"] != "test_loss" or row["best"] != best:
            fail("run %d: the table's best %s = %r, the evaluations' best test_loss %r" %
                 (index, row["best_metric"], row["best"], best))
        if mode != "match":
            continue
        # The same config trained alone on RANKS_PER_RUN ranks.
        reference_dir = os.path.join(out, "reference", str(index))
        sets = []
        for key, value in point:
            sets += ["--set", key + "=" + value]
        reference_log = reference_dir + ".log"
        os.makedirs(os.path.dirname(reference_dir), exist_ok=True)
        status = run(launcher + ["-n", per_run, meshtrain, "train", config] + sets +
                     ["--set", "run.output_dir=" + reference_dir], reference_log)
        if status != 0:
            show(reference_log)
            fail("the reference run %d exited with %d" % (index, status))
        reference_logs, reference_evals = events(os.path.join(reference_dir, "metrics.jsonl"))
        if logs != reference_logs:
            fail("run %d's logged losses differ from the run alone:\n  sweep %s\n  alone %s" %
                 (index, logs, reference_logs))
        if evals != reference_evals:
            fail("run %d's evaluations differ from the run alone:\n  sweep %s\n  alone %s" %
                 (index, evals, reference_evals))
    print("ok: %s, %d runs on np %s in groups of %s" % (mode, len(points), np, per_run))


if __name__ == "__main__":
    main()
