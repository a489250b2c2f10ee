#!/usr/bin/env python3
"""A regression run with the losses and metrics of issue 40, item 3 (mpirun -np 2): synthetic
regression data, model.loss = "huber" with huber_delta and per-output loss_weights,
checkpoint.keep_best = "test_r2[0]" (one output's R^2) and train.early_stopping. Checks:

- the run exits 0 and every eval event of metrics.jsonl has test_rel_l2 (a finite positive
  number) and test_rel_l2_per_output (one per output, finite, and the overall one between the
  smallest and largest of them: a ratio of sums);
- the checkpoint `best` names is the step whose eval has the highest test_r2_per_output[0]
  (the first such step: a tie does not improve); the run stopped early after exactly
  early_stopping evaluations without a better one, saying so by the metric's name.
The large constant learning rate (0.1) makes the metrics jump about: the run stops early at
step 33, and its best test_r2[0] (step 24) is not the step of its lowest test loss (30), so
a run that kept the best by the loss (or stopped by it) fails; both are asserted.

    loss_metrics_test.py --meshtrain BIN --configs DIR --work DIR -- MPIEXEC [FLAGS...]
"""

import argparse
import json
import math
import os
import shutil
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from script_test import Checks, outcome, run_ok, split_at_launcher  # noqa: E402

OUTPUTS = 10  # the synthetic set's targets
EARLY_STOPPING = 3
RUN_TIMEOUT_S = 240


def evals(output_dir):
    """The eval events of a run's metrics.jsonl, in order."""
    result = []
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        for line in f:
            event = json.loads(line)
            if event.get("event") == "eval":
                result.append(event)
    return result


def case(ctx):
    output_dir = os.path.join(ctx.work, "run")
    weights = "[" + ", ".join(["2.0"] + ["1.0"] * (OUTPUTS - 2) + ["0.5"]) + "]"
    cmd = (ctx.mpiexec[:1] + ["-n", "2"] + ctx.mpiexec[1:] + [
        ctx.meshtrain, "train", os.path.join(ctx.configs, "fashion_mnist_dp.toml"),
        "--set", "data.source=synthetic", "--set", "data.synthetic_samples=512",
        "--set", "data.batch_size=32", "--set", "model.sizes=[784, 32, %d]" % OUTPUTS,
        "--set", 'model.loss="huber"', "--set", "model.huber_delta=0.5",
        "--set", "model.loss_weights=" + weights,
        "--set", "optimizer.lr=0.1", "--set", 'optimizer.schedule="constant"',
        "--set", "train.steps=60", "--set", "train.log_every=10", "--set", "train.eval_every=3",
        "--set", "train.early_stopping=%d" % EARLY_STOPPING,
        "--set", 'checkpoint.keep_best="test_r2[0]"', "--set", "checkpoint.keep=1",
        "--set", "run.output_dir=" + output_dir])
    out = run_ok(cmd, RUN_TIMEOUT_S)
    events = evals(output_dir)
    if not ctx.check(len(events) >= 2, "the run evaluated %d times, expected several" %
                     len(events)):
        return
    for e in events:
        rel = e.get("test_rel_l2")
        per_output = e.get("test_rel_l2_per_output")
        where = "the eval at step %s" % e.get("step")
        if not ctx.check(isinstance(rel, float) and math.isfinite(rel) and rel > 0,
                         "%s has no finite positive test_rel_l2: %r" % (where, rel)):
            continue
        if not ctx.check(isinstance(per_output, list) and len(per_output) == OUTPUTS and
                         all(isinstance(v, float) and math.isfinite(v) for v in per_output),
                         "%s: test_rel_l2_per_output is %r, expected %d finite numbers" %
                         (where, per_output, OUTPUTS)):
            continue
        ctx.check(min(per_output) <= rel * (1 + 1e-12) and rel <= max(per_output) * (1 + 1e-12),
                  "%s: test_rel_l2 %r is not between its outputs' %r" % (where, rel, per_output))
        ctx.check(len(e.get("test_r2_per_output", [])) == OUTPUTS,
                  "%s has no test_r2_per_output of %d outputs" % (where, OUTPUTS))

    # The best by output 0's R^2 (higher is better; the first of equals).
    best = None
    for e in events:
        value = e["test_r2_per_output"][0]
        if best is None or value > best["test_r2_per_output"][0]:
            best = e
    ckpt = os.path.join(output_dir, "checkpoints")
    pointer = None
    if os.path.exists(os.path.join(ckpt, "best")):
        with open(os.path.join(ckpt, "best")) as f:
            pointer = f.read().strip()
    expected = "ckpt-%06d.h5" % best["step"]
    ctx.check(pointer == expected,
              "best names %r, expected %s (the highest test_r2[0], %r at step %d; by step: %s)" %
              (pointer, expected, best["test_r2_per_output"][0], best["step"],
               [(e["step"], e["test_r2_per_output"][0]) for e in events]))
    ctx.check(os.path.exists(os.path.join(ckpt, expected)), "%s is missing" % expected)
    lowest_loss = min(events, key=lambda e: e["test_loss"])
    ctx.check(lowest_loss["step"] != best["step"],
              "the case does not tell the metrics apart: the lowest test loss is at step %d, "
              "the highest test_r2[0] too" % best["step"])
    after = [e for e in events if e["step"] > best["step"]]
    if ctx.check("stopped early" in out, "the run did not stop early:\n" + out[-2000:]):
        ctx.check(len(after) == EARLY_STOPPING,
                  "stopped early after %d evaluations without a better test_r2[0], expected %d" %
                  (len(after), EARLY_STOPPING))
        ctx.check("test_r2[0] did not improve in %d evaluations" % EARLY_STOPPING in out,
                  "the early-stopping line does not name test_r2[0]:\n" + out)


def main():
    own, launcher = split_at_launcher(sys.argv[1:])
    if not launcher:
        print(__doc__, file=sys.stderr)
        return 64
    parser = argparse.ArgumentParser()
    parser.add_argument("--meshtrain", required=True)
    parser.add_argument("--configs", required=True)
    parser.add_argument("--work", required=True)
    args = parser.parse_args(own)
    args.mpiexec = launcher
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    ctx = Checks(args)
    ctx.configs = args.configs
    return outcome(ctx, lambda: case(ctx))


if __name__ == "__main__":
    sys.exit(main())
