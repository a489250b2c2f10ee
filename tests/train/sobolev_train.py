#!/usr/bin/env python3
"""Sobolev training from `meshtrain train` (data.dy_key, docs/derivatives.md), one case per
ctest test:

  sobolev_train.py CASE --meshtrain BIN --source-dir DIR --work DIR -- MPIEXEC [FLAGS...]

Case `train`: a smooth function of 3 inputs at different scales (x2 ten times x0's) with 2
outputs, its exact Jacobian as /dy [rows, 2, 3] and the columns [2, 0] alone as /dy_sub
[rows, 2, 2]; 48 training rows (so few that the values alone leave the derivatives loose),
inputs and targets standardized by the run, 3-32-32-2 tanh, AdamW 1e-2, 1000 steps of 16 rows,
model.derivative_loss_weight = 4 with dy. Trained with the same seed:
  plain       np 1, dp, no dy_key
  dy_np1      np 1, dp, dy_key = "dy"
  dy_dp_np2   np 2, dp = 2, the same config
  dy_overlap_np2  np 2, dp = 2, runtime.overlap = true (no DP buckets in the backward through
                the tangents: each layer all-reduces its gradients as it returns)
  dy_tp_np2   np 2, tp = 2, the same config
  dy_accum_np2  np 2, dp = 2, 2 micro-batches of 8 rows (train.accumulation_steps = 2)
  dy_zero1_np2  np 2, dp = 2, optimizer.zero_stage = 1
  dy_fsdp_np2   np 2, fsdp = 2, runtime.overlap = true (DP buckets and FSDP prefetch not used
                by the backward through the tangents)
  dy_sub      np 1, dy_key = "dy_sub", dy_inputs = [2, 0]
  dy_chunked  np 1, dy_key = "dy_chunked": /dy's values chunked and gzip-compressed
Checked:
  1. step 1's logged loss of every dy run is the plain run's plus its logged derivative_loss
     (the same first forward: the derivative term joins the loss), that term positive;
  2. the np 2 runs log the same first loss and derivative_loss as dy_np1 (1e-5), and
     dy_chunked every loss of dy_np1 bit for bit;
  3. `meshtrain predict --jacobian` on 256 held-out rows: the Jacobian's error against the
     exact one (Frobenius, relative) of every dy run is below half of the plain run's, and
     dy_sub's on the columns it was given likewise.

Case `residual`: the same data and derivative weight with a residual_mlp (3 -> 16, 2 pre-norm
blocks of LayerNorm + silu with hidden 32, -> 2), 1000 steps: plain (np 1), dy_np1 (np 1),
dy_fsdp_np2 (fsdp = 2) and dy_tp_np2 (tp = 2, the split norms included). Checked: step 1's loss
is the plain run's plus derivative_loss; the np 2 runs' first loss and derivative_loss equal
dy_np1's (1e-5); every dy run's logged derivative_loss falls below a tenth of its step 1's
(mean of the last 20 steps) and its held-out Jacobian error is below half the plain run's.

Case `dropout`: the same data with model.dropout = 0.1, an mlp (3-32-32-2 tanh) and the
residual_mlp above, each plain and dy_np1 (np 1, 1000 steps), dy_dp_np2 (dp = 2) and dy_tp_np2
(tp = 2) for 2 steps. The mask of a training step is keyed by the step and the global row and
feature, so it is the same with and without dy_key and on every mesh, and the tangents take it
too. Checked: step 1's loss of every dy run is the plain run's plus derivative_loss; the np 2
runs' first loss and derivative_loss equal dy_np1's (1e-5); dy_np1's derivative_loss falls below
a fifth of its step 1's (mean of the last 20 steps) and its held-out Jacobian error (predict:
no dropout) below 0.6 of the plain run's (dropout's noise: measured 0.088 and 0.48 for the mlp).

Case `moe`: the same data and derivative weight through MoE layers (4 experts, top 2,
aux_loss_coef 0.01): the mlp 3-32-32-2 tanh with layer 1 an MoE layer, and the residual_mlp
above with block 1 an MoE block. Each: plain and dy_np1 (np 1, 1000 steps), dy_ep2 (np 2, the
experts split over ep = 2, 3 steps) and, for the mlp, dy_dp2_ep2_zero1 (np 4, dp = 2 x ep = 2,
optimizer.zero_stage = 1, 3 steps). Checked: step 1's loss of every dy run is the plain run's plus derivative_loss (1e-5);
each logged loss and derivative_loss of the multi-rank runs equals dy_np1's of the same step
(1e-5 relative: float32 sums in another order, the routing the same); after training, the
derivative term on the training rows (lambda times the mean square of `predict --jacobian`
minus /dy, the logged term's definition) of dy_np1 is below a tenth of the plain run's, and
its held-out Jacobian error below half the plain run's.

Case `refusals`: data.dy_key with what it is not built for (exit 2, one sentence naming both
keys): mixed_precision.param_dtype = "bf16", model.loss = "cross_entropy", data.source = "synthetic", data.dy_inputs out of
range, repeated and set without dy_key, dy_key naming y_key's dataset; and from the data:
dy_key missing in the file, of the wrong rank or shape (naming the file, the key and both
shapes), and of another row count than /x.
"""

import json
import os
import re
import shutil
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
import script_test  # noqa: E402
from script_test import Failure  # noqa: E402

try:
    import h5py
    import numpy as np
except ImportError as e:
    print("FAIL: %s lacks a module this test needs (%s); scripts/setup installs "
          "python3-numpy python3-h5py" % (sys.executable, e), file=sys.stderr)
    sys.exit(1)

RUN_TIMEOUT_S = 240
SCALE = np.array([1.0, 2.0, 10.0])  # the inputs' scales
TRAIN_ROWS, TEST_ROWS = 48, 256
STEPS = 1000
LAMBDA = 4.0  # model.derivative_loss_weight of the dy runs


def function(x):
    """y [N, 2] and its Jacobian J [N, 2, 3] at x [N, 3] (float64)."""
    u = x / SCALE
    y = np.stack([np.sin(2 * u[:, 0]) * np.cos(u[:, 1]) + 0.5 * u[:, 2],
                  np.tanh(u[:, 0] * u[:, 2]) + u[:, 1] ** 2], 1)
    J = np.zeros((x.shape[0], 2, 3))
    J[:, 0, 0] = 2 * np.cos(2 * u[:, 0]) * np.cos(u[:, 1])
    J[:, 0, 1] = -np.sin(2 * u[:, 0]) * np.sin(u[:, 1])
    J[:, 0, 2] = 0.5
    s = 1 - np.tanh(u[:, 0] * u[:, 2]) ** 2
    J[:, 1, 0] = s * u[:, 2]
    J[:, 1, 1] = 2 * u[:, 1]
    J[:, 1, 2] = s * u[:, 0]
    return y, J / SCALE[None, None, :]  # d/dx = d/du / scale


def write_data(path, rows, seed):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1.5, 1.5, size=(rows, 3)) * SCALE
    y, J = function(x)
    with h5py.File(path, "w") as f:
        f["x"] = x.astype(np.float32)
        f["y"] = y.astype(np.float32)
        f["dy"] = J.astype(np.float32)
        f["dy_sub"] = J[:, :, [2, 0]].astype(np.float32)
        # The same values chunked and compressed: read through HDF5's hyperslabs, not pread.
        f.create_dataset("dy_chunked", data=J.astype(np.float32), chunks=(8, 2, 3),
                         compression="gzip")
    return x, J


def toml_value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"%s"' % v
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(e) for e in v) + "]"
    return repr(v)


def write_config(path, sections):
    with open(path, "w") as f:
        for section, keys in sections.items():
            f.write("[%s]\n" % section)
            for key, value in keys.items():
                f.write("%s = %s\n" % (key, toml_value(value)))
    return path


def config_sections(out, data, mesh, preset, data_extra=None, model_extra=None, steps=STEPS,
                    other=None):
    data_keys = {"source": "hdf5", "path": data, "batch_size": 16,
                 "normalize_inputs": "standard", "normalize_targets": "standard"}
    data_keys.update(data_extra or {})
    model = {"kind": "mlp", "sizes": [3, 32, 32, 2], "activation": "tanh", "loss": "mse"}
    if data_keys.get("dy_key"):
        model["derivative_loss_weight"] = LAMBDA
    model.update(model_extra or {})
    sections = {
        "run": {"name": os.path.basename(out), "seed": 3, "output_dir": out},
        "mesh": mesh,
        "partition": {"preset": preset, "min_sharding_size": 0},
        "model": model,
        "data": data_keys,
        "optimizer": {"kind": "adamw", "lr": 1e-2},
        "train": {"steps": steps, "log_every": 1, "eval_every": 0},
        "checkpoint": {"keep": 1},
    }
    for section, keys in (other or {}).items():
        sections.setdefault(section, {}).update(keys)
    for keys in sections.values():  # None: the key left out
        for key in [k for k, v in keys.items() if v is None]:
            del keys[key]
    return sections


def launch(ctx, ranks):
    return ctx.mpiexec[:1] + ["-n", str(ranks)] + ctx.mpiexec[1:]


def train(ctx, name, data, ranks=1, mesh=None, preset="dp", data_extra=None, other=None,
          model_extra=None):
    out = os.path.join(ctx.work, name)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    config = write_config(os.path.join(out, "config.toml"),
                          config_sections(out, data, mesh or {"dp": ranks}, preset, data_extra,
                                          model_extra, other=other))
    stdout = script_test.run_ok(launch(ctx, ranks) + [ctx.meshtrain, "train", config],
                                RUN_TIMEOUT_S)
    with open(os.path.join(out, "stdout.txt"), "w") as f:  # the layers' layouts among it
        f.write(stdout)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        logs = [e for e in map(json.loads, f) if e.get("event") == "log"]
    if not logs or logs[0]["step"] != 1:
        raise Failure("%s: metrics.jsonl has no log event of step 1" % name)
    return out, logs


def jacobian(ctx, out, test_data, result="prediction.h5"):
    result = os.path.join(out, result)
    script_test.run_ok([ctx.meshtrain, "predict", os.path.join(out, "checkpoints"), "--input",
                        test_data, "--output", result, "--jacobian"], RUN_TIMEOUT_S)
    with h5py.File(result, "r") as f:
        return np.asarray(f["jacobian"], dtype=np.float64)


def relative_error(J, exact):
    return float(np.linalg.norm(J - exact) / np.linalg.norm(exact))


def case_train(ctx):
    data = os.path.join(ctx.work, "train.h5")
    test = os.path.join(ctx.work, "test.h5")
    write_data(data, TRAIN_ROWS, seed=1)
    _, exact = write_data(test, TEST_ROWS, seed=2)
    dy = {"dy_key": "dy"}
    runs = {
        "plain": train(ctx, "plain", data),
        "dy_np1": train(ctx, "dy_np1", data, data_extra=dy),
        "dy_dp_np2": train(ctx, "dy_dp_np2", data, ranks=2, data_extra=dy),
        "dy_overlap_np2": train(ctx, "dy_overlap_np2", data, ranks=2, data_extra=dy,
                                other={"runtime": {"overlap": True}}),
        "dy_tp_np2": train(ctx, "dy_tp_np2", data, ranks=2, mesh={"tp": 2}, preset="tp",
                           data_extra=dy),
        "dy_accum_np2": train(ctx, "dy_accum_np2", data, ranks=2,
                              data_extra={"dy_key": "dy", "batch_size": 8},
                              other={"train": {"accumulation_steps": 2}}),
        "dy_zero1_np2": train(ctx, "dy_zero1_np2", data, ranks=2, data_extra=dy,
                              other={"optimizer": {"zero_stage": 1}}),
        "dy_fsdp_np2": train(ctx, "dy_fsdp_np2", data, ranks=2, mesh={"fsdp": 2}, preset="fsdp",
                             data_extra=dy, other={"runtime": {"overlap": True}}),
        "dy_chunked": train(ctx, "dy_chunked", data, data_extra={"dy_key": "dy_chunked"}),
        "dy_sub": train(ctx, "dy_sub", data,
                        data_extra={"dy_key": "dy_sub", "dy_inputs": [2, 0]}),
    }
    plain_first = runs["plain"][1][0]
    ctx.check("derivative_loss" not in plain_first,
              "the plain run logged a derivative_loss: %s" % plain_first)
    for name, (_, logs) in runs.items():
        if name == "plain":
            continue
        first = logs[0]
        if not ctx.check("derivative_loss" in first, "%s logged no derivative_loss: %s"
                         % (name, first)):
            continue
        d = first["derivative_loss"]
        print("%s: step 1 loss %.8g = data %.8g + derivative %.8g" %
              (name, first["loss"], plain_first["loss"], d))
        ctx.check(d > 0, "%s: derivative_loss %g at step 1 is not positive" % (name, d))
        ctx.check(abs(first["loss"] - (plain_first["loss"] + d)) <= 1e-5 * first["loss"],
                  "%s: step 1's loss %.8g is not the plain run's %.8g plus derivative_loss %.8g"
                  % (name, first["loss"], plain_first["loss"], d))
    one = runs["dy_np1"][1][0]
    for name in ("dy_dp_np2", "dy_overlap_np2", "dy_tp_np2", "dy_accum_np2", "dy_zero1_np2", "dy_fsdp_np2"):
        first = runs[name][1][0]
        for key in ("loss", "derivative_loss"):
            ctx.check(abs(first.get(key, float("nan")) - one[key]) <= 1e-5 * abs(one[key]),
                      "%s's first %s %r differs from dy_np1's %r beyond 1e-5" %
                      (name, key, first.get(key), one[key]))
    chunked = [(e["loss"], e["derivative_loss"]) for e in runs["dy_chunked"][1]]
    contiguous = [(e["loss"], e["derivative_loss"]) for e in runs["dy_np1"][1]]
    ctx.check(chunked == contiguous,
              "dy_chunked's logged losses differ from dy_np1's (the same values, chunked)")
    J = {name: jacobian(ctx, out, test) for name, (out, _) in runs.items()}
    errors = {name: relative_error(J[name], exact) for name in runs if name != "dy_sub"}
    sub, plain_J = J["dy_sub"], J["plain"]
    columns = [2, 0]
    sub_error = relative_error(sub[:, :, columns], exact[:, :, columns])
    plain_sub_error = relative_error(plain_J[:, :, columns], exact[:, :, columns])
    for name, err in errors.items():
        print("%s: held-out Jacobian error %.4g" % (name, err))
    print("dy_sub: held-out Jacobian error on columns [2, 0] %.4g (plain: %.4g)" %
          (sub_error, plain_sub_error))
    for name, err in errors.items():
        if name != "plain":
            ctx.check(err < 0.5 * errors["plain"],
                      "%s: held-out Jacobian error %.4g is not below half the plain run's %.4g"
                      % (name, err, errors["plain"]))
    ctx.check(sub_error < 0.5 * plain_sub_error,
              "dy_sub: held-out Jacobian error on columns [2, 0] %.4g is not below half the "
              "plain run's %.4g" % (sub_error, plain_sub_error))


RESIDUAL = {"kind": "residual_mlp", "sizes": None, "inputs": 3, "outputs": 2, "width": 16,
            "hidden": 32, "depth": 2, "norm": "layernorm", "activation": "silu"}


def case_residual(ctx):
    data = os.path.join(ctx.work, "train.h5")
    test = os.path.join(ctx.work, "test.h5")
    write_data(data, TRAIN_ROWS, seed=1)
    _, exact = write_data(test, TEST_ROWS, seed=2)
    dy = {"dy_key": "dy"}
    runs = {
        "plain": train(ctx, "plain", data, model_extra=RESIDUAL),
        "dy_np1": train(ctx, "dy_np1", data, data_extra=dy, model_extra=RESIDUAL),
        "dy_fsdp_np2": train(ctx, "dy_fsdp_np2", data, ranks=2, mesh={"fsdp": 2},
                             preset="fsdp", data_extra=dy, model_extra=RESIDUAL),
        "dy_tp_np2": train(ctx, "dy_tp_np2", data, ranks=2, mesh={"tp": 2}, preset="tp",
                           data_extra=dy, model_extra=RESIDUAL),
    }
    plain_first = runs["plain"][1][0]
    one = runs["dy_np1"][1][0]
    for name, (_, logs) in runs.items():
        if name == "plain":
            continue
        first = logs[0]
        if not ctx.check("derivative_loss" in first, "%s logged no derivative_loss: %s"
                         % (name, first)):
            continue
        d = first["derivative_loss"]
        ctx.check(abs(first["loss"] - (plain_first["loss"] + d)) <= 1e-5 * first["loss"],
                  "%s: step 1's loss %.8g is not the plain run's %.8g plus derivative_loss %.8g"
                  % (name, first["loss"], plain_first["loss"], d))
        for key in ("loss", "derivative_loss"):
            ctx.check(abs(first[key] - one[key]) <= 1e-5 * abs(one[key]),
                      "%s's first %s %r differs from dy_np1's %r beyond 1e-5" %
                      (name, key, first[key], one[key]))
        last = float(np.mean([e["derivative_loss"] for e in logs[-20:]]))
        print("%s: derivative_loss %.4g at step 1, %.4g over the last 20 steps" % (name, d, last))
        ctx.check(last < 0.1 * d, "%s: derivative_loss %.4g over the last 20 steps is not below "
                  "a tenth of step 1's %.4g" % (name, last, d))
    errors = {name: relative_error(jacobian(ctx, out, test), exact)
              for name, (out, _) in runs.items()}
    for name, err in errors.items():
        print("%s: held-out Jacobian error %.4g" % (name, err))
        if name != "plain":
            ctx.check(err < 0.5 * errors["plain"],
                      "%s: held-out Jacobian error %.4g is not below half the plain run's %.4g"
                      % (name, err, errors["plain"]))


def case_dropout(ctx):
    data = os.path.join(ctx.work, "train.h5")
    test = os.path.join(ctx.work, "test.h5")
    write_data(data, TRAIN_ROWS, seed=1)
    _, exact = write_data(test, TEST_ROWS, seed=2)
    dy = {"dy_key": "dy"}
    short = {"train": {"steps": 2}}  # the np 2 runs: their first step is what is compared
    for model, extra in (("mlp", {"dropout": 0.1}), ("residual", dict(RESIDUAL, dropout=0.1))):
        runs = {
            "plain": train(ctx, model + "_plain", data, model_extra=extra),
            "dy_np1": train(ctx, model + "_dy_np1", data, data_extra=dy, model_extra=extra),
            "dy_dp_np2": train(ctx, model + "_dy_dp_np2", data, ranks=2, data_extra=dy,
                               model_extra=extra, other=short),
            "dy_tp_np2": train(ctx, model + "_dy_tp_np2", data, ranks=2, mesh={"tp": 2},
                               preset="tp", data_extra=dy, model_extra=extra, other=short),
        }
        plain_first = runs["plain"][1][0]
        one = runs["dy_np1"][1][0]
        for name, (_, logs) in runs.items():
            if name == "plain":
                continue
            name = model + " " + name
            first = logs[0]
            if not ctx.check("derivative_loss" in first, "%s logged no derivative_loss: %s"
                             % (name, first)):
                continue
            d = first["derivative_loss"]
            ctx.check(abs(first["loss"] - (plain_first["loss"] + d)) <= 1e-5 * first["loss"],
                      "%s: step 1's loss %.8g is not the plain run's %.8g plus derivative_loss "
                      "%.8g" % (name, first["loss"], plain_first["loss"], d))
            for key in ("loss", "derivative_loss"):
                ctx.check(abs(first[key] - one[key]) <= 1e-5 * abs(one[key]),
                          "%s's first %s %r differs from dy_np1's %r beyond 1e-5" %
                          (name, key, first[key], one[key]))
        # Trained: dy_np1 against plain. Dropout's noise leaves the mlp's derivative loss at 0.088
        # of its start and its Jacobian error at 0.48 of the plain run's (the residual_mlp's
        # 0.008 and 0.33), hence a fifth and 0.6 here.
        logs = runs["dy_np1"][1]
        d, last = logs[0]["derivative_loss"], float(np.mean(
            [e["derivative_loss"] for e in logs[-20:]]))
        print("%s dy_np1: derivative_loss %.4g at step 1, %.4g over the last 20 steps" %
              (model, d, last))
        ctx.check(last < 0.2 * d, "%s dy_np1: derivative_loss %.4g over the last 20 steps is not "
                  "below a fifth of step 1's %.4g" % (model, last, d))
        errors = {name: relative_error(jacobian(ctx, runs[name][0], test), exact)
                  for name in ("plain", "dy_np1")}
        print("%s: held-out Jacobian error %.4g (plain %.4g)" %
              (model, errors["dy_np1"], errors["plain"]))
        ctx.check(errors["dy_np1"] < 0.6 * errors["plain"],
                  "%s dy_np1: held-out Jacobian error %.4g is not below 0.6 of the plain run's "
                  "%.4g" % (model, errors["dy_np1"], errors["plain"]))


MOE = {"moe_layers": [1], "experts": 4, "top_k": 2, "aux_loss_coef": 0.01}
MOE_MESHES = {  # the multi-rank runs of case_moe: name -> (ranks, mesh, other sections)
    "dy_ep2": (2, {"ep": 2}, {}),
    "dy_dp2_ep2_zero1": (4, {"dp": 2, "ep": 2}, {"optimizer": {"zero_stage": 1}}),
}
MOE_SHORT = 3  # steps of the multi-rank runs: each logged loss is compared with dy_np1's


def derivative_error(J, dy):
    """The derivative term's mean square in the user's units, times lambda (as logged)."""
    return float(LAMBDA * np.mean((J - dy) ** 2))


def case_moe(ctx):
    data = os.path.join(ctx.work, "train.h5")
    test = os.path.join(ctx.work, "test.h5")
    _, train_J = write_data(data, TRAIN_ROWS, seed=1)
    _, exact = write_data(test, TEST_ROWS, seed=2)
    dy = {"dy_key": "dy"}
    short = {"train": {"steps": MOE_SHORT}}
    for model, extra in (("mlp", dict(MOE)), ("residual", dict(RESIDUAL, **MOE))):
        runs = {
            "plain": train(ctx, model + "_plain", data, model_extra=extra),
            "dy_np1": train(ctx, model + "_dy_np1", data, data_extra=dy, model_extra=extra),
        }
        for name, (ranks, mesh, other) in MOE_MESHES.items():
            if model == "residual" and ranks > 2:
                continue  # the mlp covers np 4; the residual's MoE block is the same layer
            runs[name] = train(ctx, model + "_" + name, data, ranks=ranks, mesh=mesh,
                               data_extra=dy, model_extra=extra, other=dict(short, **other))
        plain_first = runs["plain"][1][0]
        one = runs["dy_np1"][1]
        for name, (_, logs) in runs.items():
            if name == "plain":
                continue
            label = "%s %s" % (model, name)
            first = logs[0]
            if not ctx.check("derivative_loss" in first, "%s logged no derivative_loss: %s"
                             % (label, first)):
                continue
            d = first["derivative_loss"]
            ctx.check(d > 0, "%s: derivative_loss %g at step 1 is not positive" % (label, d))
            ctx.check(abs(first["loss"] - (plain_first["loss"] + d)) <= 1e-5 * first["loss"],
                      "%s: step 1's loss %.8g is not the plain run's %.8g plus derivative_loss "
                      "%.8g" % (label, first["loss"], plain_first["loss"], d))
            if name == "dy_np1":
                continue
            # The experts really are split over ep (the layout the run prints).
            with open(os.path.join(runs[name][0], "stdout.txt")) as f:
                layouts = [l.strip() for l in f if "MoE in" in l]
            ctx.check(len(layouts) == 1 and "2 per rank over (ep) by all-to-all" in layouts[0],
                      "%s: the MoE layer's experts are not split over ep: %s" % (label, layouts))
            # Every step of the short run against one rank's: the same forward, tangents and
            # losses, and (from step 2) the same update through the MoE layers' gradients.
            ctx.check(len(logs) == MOE_SHORT, "%s: %d log events, expected %d" %
                      (label, len(logs), MOE_SHORT))
            worst = 0.0
            for got, ref in zip(logs, one):
                for key in ("loss", "derivative_loss"):
                    diff = abs(got.get(key, float("nan")) - ref[key]) / abs(ref[key])
                    worst = max(worst, diff)
                    ctx.check(diff <= 1e-5, "%s step %d: %s %r differs from dy_np1's %r beyond "
                              "1e-5" % (label, got["step"], key, got.get(key), ref[key]))
            print("%s: steps 1-%d, largest relative difference from dy_np1 %.2e" %
                  (label, len(logs), worst))
        # Trained: the derivative term on the training rows (predict --jacobian, the same
        # mean square as the logged term) of the dy run against the plain run's, and the
        # held-out Jacobian error.
        train_error = {name: derivative_error(jacobian(ctx, runs[name][0], data,
                                                       "train_jacobian.h5"), train_J)
                       for name in ("plain", "dy_np1")}
        held_out = {name: relative_error(jacobian(ctx, runs[name][0], test), exact)
                    for name in ("plain", "dy_np1")}
        logs = runs["dy_np1"][1]
        print("%s: derivative term on the training rows %.4g (plain run %.4g; logged at step 1 "
              "%.4g, last 20 steps %.4g); held-out Jacobian error %.4g (plain %.4g)" %
              (model, train_error["dy_np1"], train_error["plain"], logs[0]["derivative_loss"],
               float(np.mean([e["derivative_loss"] for e in logs[-20:]])), held_out["dy_np1"],
               held_out["plain"]))
        ctx.check(train_error["dy_np1"] < 0.1 * train_error["plain"],
                  "%s dy_np1: derivative term on the training rows %.4g is not below a tenth of "
                  "the plain run's %.4g" % (model, train_error["dy_np1"], train_error["plain"]))
        ctx.check(held_out["dy_np1"] < 0.5 * held_out["plain"],
                  "%s dy_np1: held-out Jacobian error %.4g is not below half the plain run's "
                  "%.4g" % (model, held_out["dy_np1"], held_out["plain"]))


def expect_refusal(ctx, config, patterns, what, ranks=1):
    """meshtrain train refuses: exit 2, one 'meshtrain: error' line matching every pattern."""
    status, out, err = script_test.run(launch(ctx, ranks) + [ctx.meshtrain, "train", config],
                                       RUN_TIMEOUT_S)
    lines = [l for l in err.strip().splitlines() if l.startswith("meshtrain:")]
    ok = (ctx.check(status == 2, "%s: exit status %d, expected 2 (stderr: %s)" %
                    (what, status, err)) and
          ctx.check(len(lines) == 1, "%s: %d meshtrain lines on stderr, expected one: %s" %
                    (what, len(lines), err)))
    if ok:
        for p in patterns:
            ctx.check(re.search(p, lines[0]) is not None,
                      "%s: %r does not match /%s/" % (what, lines[0], p))
        print("%s: %s" % (what, lines[0]))


def case_refusals(ctx):
    data = os.path.join(ctx.work, "train.h5")
    write_data(data, TRAIN_ROWS, seed=1)
    dy = {"dy_key": "dy"}

    def config(name, data_extra=None, model_extra=None, other=None, path=data):
        out = os.path.join(ctx.work, name)
        os.makedirs(out, exist_ok=True)
        sections = config_sections(out, path, {"dp": 1}, "dp", data_extra, model_extra, steps=2,
                                   other=other)
        return write_config(os.path.join(out, "config.toml"), sections)

    key = r"data\.dy_key|\[data\] dy_key"
    expect_refusal(ctx, config("bf16", dy, other={"mixed_precision": {"param_dtype": "bf16"}}),
                   [key, r"mixed_precision\.param_dtype", "fp32"], "bf16")
    expect_refusal(ctx, config("cross_entropy", dy, model_extra={"loss": "cross_entropy"}),
                   [key, r"model\.loss", "regression"], "cross_entropy")
    expect_refusal(ctx, config("synthetic", {"source": "synthetic", "path": None, "dy_key": "dy",
                                             "normalize_targets": "none"}),
                   [key, r"(data\.)?source", "hdf5"], "synthetic data")
    expect_refusal(ctx, config("out_of_range", {"dy_key": "dy", "dy_inputs": [0, 3]}),
                   [r"dy_inputs", r"\b3\b", "inputs"], "dy_inputs out of range")
    expect_refusal(ctx, config("repeated", {"dy_key": "dy", "dy_inputs": [1, 1]}),
                   [r"dy_inputs", "twice"], "dy_inputs repeated")
    expect_refusal(ctx, config("inputs_alone", {"dy_inputs": [0]}),
                   [r"dy_inputs", r"dy_key", "not set"], "dy_inputs without dy_key")
    expect_refusal(ctx, config("missing", {"dy_key": "gradients"}),
                   [re.escape(data), r"/gradients", r"data\.dy_key"], "dy_key missing")
    expect_refusal(ctx, config("wrong_shape", {"dy_key": "dy", "dy_inputs": [2, 0]}),
                   [re.escape(data), r"/dy", r"data\.dy_key", r"\[48, 2, 2\]",
                    r"\[48, 2, 3\]"], "dy of the wrong shape")
    expect_refusal(ctx, config("names_y", {"dy_key": "y"}),
                   [key, r"(data\.)?y_key", "/y"], "dy_key naming y_key's dataset")
    flat = os.path.join(ctx.work, "flat.h5")
    shutil.copy(data, flat)
    with h5py.File(flat, "r+") as f:
        f["flat"] = np.zeros((TRAIN_ROWS, 6), np.float32)
        f["short"] = np.zeros((TRAIN_ROWS - 1, 2, 3), np.float32)
    expect_refusal(ctx, config("flat", {"dy_key": "flat"}, path=flat),
                   [re.escape(flat), r"/flat", r"data\.dy_key", r"\[48, 2, 3\]", r"\[48, 6\]"],
                   "dy of rank 2")
    expect_refusal(ctx, config("short", {"dy_key": "short"}, path=flat),
                   [re.escape(flat), r"/short", r"data\.dy_key", r"47", r"48"],
                   "dy of fewer rows than x")


CASES = {"train": case_train, "residual": case_residual, "dropout": case_dropout,
         "moe": case_moe, "refusals": case_refusals}

if __name__ == "__main__":
    sys.exit(script_test.case_main(CASES, script_test.Checks))
