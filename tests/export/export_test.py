#!/usr/bin/env python3
"""`meshtrain export --format onnx` end to end (docs/export.md), one case per ctest test:

  export_test.py CASE --meshtrain BIN --source-dir DIR --work DIR [--predict] -- MPIEXEC [FLAGS...]

Each case trains a tiny model with `meshtrain train` under MPIEXEC (or edits such a
checkpoint with h5py, keeping its CRC-32s right), exports it, checks the file with
onnx.checker (full_check), runs it in ONNX Runtime (the npm package onnxruntime-node, through
tests/export/run_onnx.js) and compares every output with the references:

  1. a float64 numpy forward computed here from the checkpoint's datasets (h5py) and its
     stored config, following docs/export.md (and docs' model math): the test's own;
  2. with --predict, `meshtrain predict` of the same checkpoint on the same rows (its HDF5
     output: /prediction, /probability, /class; its `model` attribute is the export's `model`
     metadata), for when that command exists.

Tolerances (per output array, |got - ref| / max(|ref|, 0.1 * max|ref|)): fp32 weights 1e-5;
fp16 and bf16 weights 1e-5 against the forward with the weights rounded as the export rounds
them (to nearest even), and against the unrounded one max|error| / max|output| at most
4 * 2^-11 (fp16) or 4 * 2^-8 (bf16).
"class" must equal the reference's argmax except on rows whose two largest logits lie within
1e-5 of each other (relative).

ONNX Runtime comes from scripts/install-onnxruntime (installed by scripts/setup, or here when
missing). When it cannot be installed, a case still runs everything that does not need it
(training, the export, onnx.checker, the metadata, and with --predict `meshtrain predict`
against the float64 forward in fp32), then exits 77 (ctest: skipped) saying what was left
out, or 1 when one of those checks failed.
"""

import json
import os
import shutil
import sys
import tempfile
import tomllib
import zlib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
import script_test  # noqa: E402
from script_test import Failure  # noqa: E402

try:
    import h5py
    import numpy as np
    import numpy_reference  # noqa: E402
except ImportError as e:
    print("FAIL: %s lacks a module the export tests need (%s); scripts/setup installs "
          "python3-numpy python3-h5py python3-onnx" % (sys.executable, e), file=sys.stderr)
    sys.exit(1)

RUN_TIMEOUT_S = 60
FP32_RTOL = 1e-5
# Errors are relative to max(|ref|, FLOOR * max|ref|): an output that a sum cancels to near
# zero carries float32's rounding of the terms, not its own (a plain numpy float32 forward of
# the classification model is 2.3e-5 off its float64 one on an output at 1.6e-3 of the largest,
# 2.4e-7 of the largest).
FLOOR = 0.1
CLASS_MARGIN = 1e-5
ROUNDED_BOUND = {"fp16": 4 * 2.0**-11, "bf16": 4 * 2.0**-8}


# --- running things ----------------------------------------------------------------------

def run(cmd, timeout=RUN_TIMEOUT_S, cwd=None):
    """Runs a command; returns (status, stdout, stderr). A hang is a failure."""
    return script_test.run(cmd, timeout, cwd=cwd)


def run_ok(cmd, timeout=RUN_TIMEOUT_S, cwd=None):
    return script_test.run_ok(cmd, timeout, cwd=cwd)


class Context(script_test.Checks):
    def __init__(self, args):
        super().__init__(args)
        self.source_dir = args.source_dir
        self.predict = args.predict
        self._ort = None
        self.ort_missing = None  # why ONNX Runtime cannot run here (None: it can, or untried)

    def ort_module(self):
        """The onnxruntime-node package's directory; None (and ort_missing says why) when it
        cannot be installed."""
        if self._ort is None and self.ort_missing is None:
            script = os.path.join(self.source_dir, "scripts", "install-onnxruntime")
            status, out, err = run(["bash", script], timeout=300)
            if status != 0:
                lines = err.strip().splitlines() or ["(no message)"]
                self.ort_missing = ("ONNX Runtime (npm onnxruntime-node) cannot be installed: " +
                                    lines[-1])
                print("without ONNX Runtime: " + self.ort_missing)
            else:
                self._ort = out.strip().splitlines()[-1]
        return self._ort


# --- data, configs, training ---------------------------------------------------------------

FEATURES = 8


def write_data(path, kind, rows=256, seed=0):
    """Inputs at scales from 1e-3 to 1e4, some far from zero (feature 3: 1000 +- 0.01, the case
    where a float32 mean would lose the float64 mean's digits); class labels (4 classes) or
    2 regression targets."""
    rng = np.random.default_rng(seed)
    scale = np.array([1e-3, 1, 10, 1e-2, 1e3, 1e4, 0.5, 2], np.float64)
    offset = np.array([5, 0, -3, 1000, 0, 2e4, 1, -1], np.float64)
    x = (rng.normal(size=(rows, FEATURES)) * scale + offset).astype(np.float32)
    z = rng.normal(size=(rows, FEATURES))
    with h5py.File(path, "w") as f:
        f["x"] = x
        if kind == "classification":
            f["y"] = ((z[:, 1] > 0).astype(np.int64) + 2 * (z[:, 2] > 0).astype(np.int64))
        else:
            f["y"] = np.stack([z[:, 1] * 2 + z[:, 2] * 0.1, np.sin(z[:, 1])], 1).astype(np.float32)
    return x


def write_standardized_data(path, kind):
    """write_data's rows standardized (what a user trains on without [data] normalization): a
    well-conditioned float32 forward, so that float32 rounding stays near 1e-7."""
    x = write_data(path, kind)
    x = ((x - x.mean(axis=0)) / x.std(axis=0)).astype(np.float32)
    with h5py.File(path, "r+") as f:
        f["x"][...] = x
    return x


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


MESHES = {  # name: (ranks, [mesh], partition preset)
    "dp_np1": (1, {"dp": 1}, "dp"),
    "fsdp_np2": (2, {"fsdp": 2}, "fsdp"),
    "tp_np2": (2, {"tp": 2}, "tp"),
    "fsdp_tp_np4": (4, {"fsdp": 2, "tp": 2}, "fsdp_tp"),
    "ep_np2": (2, {"ep": 2}, "dp"),
}


def train(ctx, name, data, sizes, activation, loss, mesh="dp_np1", lr=1e-2, steps=4,
          moe=None, seed=1, residual=None):
    """Trains a tiny model; returns its checkpoint directory. residual: the keys of a
    kind = "residual_mlp" model (inputs, outputs, width, hidden, depth, norm); sizes is then
    unused."""
    ranks, mesh_keys, preset = MESHES[mesh]
    out = os.path.join(ctx.work, name)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    if residual:
        model = dict(kind="residual_mlp", activation=activation, loss=loss, **residual)
    else:
        model = {"kind": "mlp", "sizes": sizes, "activation": activation, "loss": loss}
    if moe:
        model.update(moe)
    config = write_config(os.path.join(out, "config.toml"), {
        "run": {"name": name, "seed": seed, "output_dir": out},
        "mesh": mesh_keys,
        "partition": {"preset": preset, "min_sharding_size": 0},
        "model": model,
        "data": {"source": "hdf5", "path": data, "batch_size": 32},
        "optimizer": {"kind": "sgd" if lr == 0 else "adamw", "lr": lr},
        "train": {"steps": steps, "log_every": steps},
        "checkpoint": {"keep": 1},
    })
    cmd = ctx.mpiexec[:1] + ["-n", str(ranks)] + ctx.mpiexec[1:] + [ctx.meshtrain, "train", config]
    run_ok(cmd)
    return os.path.join(out, "checkpoints")


def latest_file(ckpt_dir):
    with open(os.path.join(ckpt_dir, "latest")) as f:
        return os.path.join(ckpt_dir, f.read().strip())


def export(ctx, checkpoint, output, dtype=None, extra=()):
    cmd = [ctx.meshtrain, "export", checkpoint, "--format", "onnx", "--output", output]
    if dtype:
        cmd += ["--dtype", dtype]
    run_ok(cmd + list(extra))
    return output


# --- the checkpoint, read as a user would --------------------------------------------------

def dataset_values(d):
    """A checkpoint dataset's values in float64; a bf16 one (uint16 bits with attribute
    dtype = "bf16", docs/recsys.md "bf16 tables") widened."""
    if d.dtype == np.uint16 and d.attrs.get("dtype") in ("bf16", b"bf16"):
        return (d[()].astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return d[()].astype(np.float64)


def read_checkpoint(path):
    """{params: {name: float64 array}, config: dict, normalization: {name: array}, step}."""
    params, normalization = {}, {}
    with h5py.File(path, "r") as f:
        text = f.attrs["config"]
        config = tomllib.loads(text.decode() if isinstance(text, bytes) else text)
        step = int(f.attrs["step"])
        f["params"].visititems(lambda name, obj: params.__setitem__(name, dataset_values(obj))
                               if isinstance(obj, h5py.Dataset) else None)
        if "normalization" in f:
            for name in f["normalization"]:
                normalization[name] = f["normalization"][name][()]
    return {"params": params, "config": config, "normalization": normalization, "step": step}


def set_dataset(f, name, values):
    """Writes a dataset's values in place (or creates it) with the crc32 attribute a
    checkpoint keeps (zlib.crc32 of its little-endian bytes, stored as uint64)."""
    values = np.ascontiguousarray(values)
    if name in f:
        f[name][...] = values
    else:
        f.create_dataset(name, data=values)
    f[name].attrs.create("crc32", np.uint64(zlib.crc32(values.astype(values.dtype.newbyteorder("<")).tobytes())))


def round_weights(params, dtype):
    if dtype == "fp32":
        return params
    out = {}
    for name, w in params.items():
        w32 = w.astype(np.float32)
        if dtype == "fp16":
            out[name] = w32.astype(np.float16).astype(np.float64)
        else:  # bf16, round to nearest even as framework/core/precision.hpp
            u = w32.view(np.uint32).astype(np.uint64)
            r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
            out[name] = r.astype(np.uint32).view(np.float32).astype(np.float64)
    return out


activation = numpy_reference.activation
softmax = numpy_reference.softmax


def moe_forward(h, p, prefix, top_k, ties_to_higher=False, expert=None):
    """Training's routing (layers/moe.hpp): softmax of x Wr, the k largest probabilities (ties:
    the lower expert index), gates renormalized over them, the gated sum of the experts.
    Equal router columns give exactly equal logits (computed once per distinct column).
    ties_to_higher: break ties the other way (to show that the test would notice).
    expert(e, row): expert e's output for one row (default: the linear expert)."""
    router = p[prefix + "/router/weight"]
    logits = h @ router
    for j in range(router.shape[1]):
        for i in range(j):
            if np.array_equal(router[:, i], router[:, j]):
                logits[:, j] = logits[:, i]
                break
    probs = softmax(logits)
    if expert is None:
        weight, bias = p[prefix + "/experts/weight"], p[prefix + "/experts/bias"]
        expert = lambda e, row: row @ weight[e] + bias[e]
    y = None
    ties = 0
    for r in range(h.shape[0]):
        q = probs[r].copy()
        chosen = []
        for _ in range(top_k):
            candidates = [e for e in range(len(q)) if e not in chosen]
            top = max(q[e] for e in candidates)
            equal = [e for e in candidates if q[e] == top]
            ties += len(equal) > 1
            chosen.append(equal[-1] if ties_to_higher else equal[0])
        gates = q[chosen] / q[chosen].sum()
        for g, e in zip(gates, chosen):
            out = g * expert(e, h[r])
            if y is None:
                y = np.zeros((h.shape[0], out.shape[0]))
            y[r] += out
    return y, ties


LAYERNORM_EPS = 1e-5  # docs/models.md: LayerNorm's eps (PyTorch's default)
RMSNORM_EPS = 2.0**-23  # RMSNorm's: torch.finfo(torch.float32).eps


def norm_forward(kind, h, p, prefix):
    """docs/models.md's norms over the features of a row: LayerNorm with the biased variance,
    RMSNorm with the mean of squares."""
    if kind == "layernorm":
        mean = h.mean(axis=1, keepdims=True)
        var = ((h - mean) ** 2).mean(axis=1, keepdims=True)
        return (h - mean) / np.sqrt(var + LAYERNORM_EPS) * p[prefix + "/scale"] + p[prefix + "/bias"]
    if kind == "rmsnorm":
        ms = (h * h).mean(axis=1, keepdims=True)
        return h / np.sqrt(ms + RMSNORM_EPS) * p[prefix + "/scale"]
    if kind == "none":
        return h
    raise Failure("unknown norm " + kind)


def residual_forward(model, p, h):
    """kind = "residual_mlp" (docs/models.md): input projection, pre-norm blocks (activation
    or SwiGLU), output norm and projection."""
    kind = model.get("norm", "rmsnorm")
    act = model.get("activation", "relu")
    h = h @ p["input/weight"] + p["input/bias"]
    moe_blocks = set(model.get("moe_layers", []))
    for i in range(model["depth"]):
        prefix = "blocks/%d" % i
        u = norm_forward(kind, h, p, prefix + "/norm")
        if i in moe_blocks:  # a mixture of feed-forward experts (docs/models.md, MoE blocks)
            def expert(e, row, q=prefix + "/experts/"):
                up = row @ p[q + "up/weight"][e] + p[q + "up/bias"][e]
                if act == "swiglu":
                    a = activation("silu", row @ p[q + "gate/weight"][e] + p[q + "gate/bias"][e]) * up
                else:
                    a = activation(act, up)
                return a @ p[q + "down/weight"][e] + p[q + "down/bias"][e]
            y, _ = moe_forward(u, p, prefix, model.get("top_k", 2), expert=expert)
            h = h + y
            continue
        up = u @ p[prefix + "/up/weight"] + p[prefix + "/up/bias"]
        if act == "swiglu":
            a = activation("silu", u @ p[prefix + "/gate/weight"] + p[prefix + "/gate/bias"]) * up
        else:
            a = activation(act, up)
        h = h + a @ p[prefix + "/down/weight"] + p[prefix + "/down/bias"]
    h = norm_forward(kind, h, p, "output_norm")
    return h @ p["output/weight"] + p["output/bias"]


def reference_forward(ckpt, x, dtype="fp32", ties_to_higher=False):
    """The float64 forward of docs/export.md: {output, [probability, class]} and the count of
    tied choices met in MoE routing."""
    model = ckpt["config"]["model"]
    p = round_weights(ckpt["params"], dtype)
    norm = ckpt["normalization"]
    residual = model.get("kind") == "residual_mlp"
    sizes = [] if residual else model["sizes"]
    moe_layers = set(model.get("moe_layers", []))
    h = x.astype(np.float64)
    if "input_mean" in norm:
        h = (h - norm["input_mean"]) / norm["input_std"]
    ties = 0
    if residual:
        h = residual_forward(model, p, h)
    for i in range(len(sizes) - 1):
        prefix = "layers/%d" % i
        if i in moe_layers:
            h, t = moe_forward(h, p, prefix, model.get("top_k", 2), ties_to_higher)
            ties += t
        else:
            h = h @ p[prefix + "/weight"] + p[prefix + "/bias"]
        if i < len(sizes) - 2:
            h = activation(model.get("activation", "relu"), h)
    if "target_mean" in norm:
        h = h * norm["target_std"] + norm["target_mean"]
    out = {"output": h}
    if model.get("loss") == "cross_entropy":
        out["probability"] = softmax(h)
        out["class"] = h.argmax(axis=1)
    return out, ties


# --- running the export --------------------------------------------------------------------

def check_onnx(ctx, path):
    import onnx
    model = onnx.load(path)
    onnx.checker.check_model(model, full_check=True)
    ctx.check(model.ir_version == 8, "%s: ir_version %d, expected 8" % (path, model.ir_version))
    opsets = {o.domain: o.version for o in model.opset_import}
    ctx.check(opsets == {"": 17}, "%s: opset_import %s, expected {'': 17}" % (path, opsets))
    ctx.check(model.producer_name == "meshtrain", "%s: producer_name %r" % (path, model.producer_name))
    return model


def run_ort(ctx, model_path, x):
    """ORT's outputs {name: array}; None when ONNX Runtime cannot be installed."""
    module = ctx.ort_module()
    if module is None:
        return None
    out_dir = tempfile.mkdtemp(dir=ctx.work)
    x_file = os.path.join(out_dir, "input.f32")
    np.ascontiguousarray(x, dtype="<f4").tofile(x_file)
    script = os.path.join(ctx.source_dir, "tests", "export", "run_onnx.js")
    run_ok(["node", script, module, model_path, x_file, str(x.shape[0]), str(x.shape[1]), out_dir])
    with open(os.path.join(out_dir, "outputs.json")) as f:
        listing = json.load(f)
    print("ONNX Runtime %s" % listing["onnxruntime_version"])
    types = {"float32": "<f4", "int64": "<i8"}
    outputs = {}
    for name, info in listing["outputs"].items():
        outputs[name] = np.fromfile(os.path.join(out_dir, name + ".bin"),
                                    dtype=types[info["type"]]).reshape(info["dims"])
    shutil.rmtree(out_dir)
    return outputs


def relative_error(got, ref):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    floor = FLOOR * max(np.abs(ref).max(), 1e-30)
    return float((np.abs(got - ref) / np.maximum(np.abs(ref), floor)).max())


def normwise_error(got, ref):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))


def compare(ctx, what, got, ref, rtol):
    """Compares ORT's outputs with one reference's; returns the largest relative error."""
    worst = 0.0
    ctx.check(set(got) == set(ref), "%s: outputs %s, expected %s" % (what, sorted(got), sorted(ref)))
    for name in sorted(set(got) & set(ref)):
        if name == "class":
            logits = np.sort(ref["output"], axis=1)
            margin = (logits[:, -1] - logits[:, -2]) / np.maximum(np.abs(logits[:, -1]), 1e-30)
            clear = margin > CLASS_MARGIN
            ctx.check(got[name].shape == ref[name].shape, "%s: class shape %s, expected %s" %
                      (what, got[name].shape, ref[name].shape))
            wrong = int((got[name][clear] != ref[name][clear]).sum())
            ctx.check(wrong == 0, "%s: class differs on %d of %d clear rows" %
                      (what, wrong, int(clear.sum())))
            continue
        ctx.check(got[name].shape == ref[name].shape, "%s: %s shape %s, expected %s" %
                  (what, name, got[name].shape, ref[name].shape))
        err = relative_error(got[name], ref[name])
        worst = max(worst, err)
        ctx.check(err <= rtol, "%s: %s relative error %.3g > %.3g" % (what, name, err, rtol))
    print("%s: largest relative error %.3g (tolerance %.3g)" % (what, worst, rtol))
    return worst


def predict_reference(ctx, checkpoint, x, model_summary):
    """`meshtrain predict` on the same rows, read from its HDF5 output (docs/design.md: /prediction
    [N, outputs], and for classification /probability and /class). Its `model` attribute must be
    the export's `model` metadata (one summary of the model for both)."""
    work = tempfile.mkdtemp(dir=ctx.work)
    inputs, output = os.path.join(work, "x.h5"), os.path.join(work, "prediction.h5")
    with h5py.File(inputs, "w") as f:
        f["x"] = x
    run_ok([ctx.meshtrain, "predict", checkpoint, "--input", inputs, "--output", output])
    names = {"prediction": "output", "probability": "probability", "class": "class"}
    with h5py.File(output, "r") as f:
        result = {names[k]: f[k][()] for k in names if k in f}
        model = f.attrs["model"]
        model = model.decode() if isinstance(model, bytes) else str(model)
    ctx.check(model == model_summary, "meshtrain predict's model attribute %r is not the export's "
              "model metadata %r" % (model, model_summary))
    shutil.rmtree(work)
    return result


def export_and_compare(ctx, checkpoint, x, label, dtypes=("fp32",), min_ties=0):
    """Exports `checkpoint` in each dtype and compares ORT's outputs with the references."""
    ckpt = read_checkpoint(latest_file(checkpoint) if os.path.isdir(checkpoint) else checkpoint)
    for dtype in dtypes:
        path = export(ctx, checkpoint, os.path.join(ctx.work, "%s_%s.onnx" % (label, dtype)), dtype)
        model = check_onnx(ctx, path)
        meta = {p.key: p.value for p in model.metadata_props}
        ctx.check(meta.get("step") == str(ckpt["step"]), "%s: metadata step %r, expected %d" %
                  (path, meta.get("step"), ckpt["step"]))
        ctx.check(meta.get("weights_dtype") == dtype, "%s: metadata weights_dtype %r" %
                  (path, meta.get("weights_dtype")))
        ctx.check(tomllib.loads(meta.get("config", "")) == ckpt["config"],
                  "%s: metadata config is not the checkpoint's" % path)
        got = run_ort(ctx, path, x)
        rounded, ties = reference_forward(ckpt, x, dtype)
        ctx.check(ties >= min_ties, "%s: %d tied routing choices met, expected at least %d" %
                  (label, ties, min_ties))
        if got is None:
            # Without ONNX Runtime the graph cannot run; `meshtrain predict` of the same
            # checkpoint can still be held to the float64 forward.
            if dtype == "fp32" and ctx.predict:
                compare(ctx, "%s meshtrain predict vs float64 forward" % label,
                        predict_reference(ctx, checkpoint, x, meta.get("model")), rounded,
                        FP32_RTOL)
            continue
        compare(ctx, "%s %s vs float64 forward (weights as exported)" % (label, dtype), got,
                rounded, FP32_RTOL)
        if dtype != "fp32":
            exact, _ = reference_forward(ckpt, x, "fp32")
            err = normwise_error(got["output"], exact["output"])
            print("%s %s vs float64 forward (fp32 weights): max|error| / max|output| %.3g "
                  "(bound %.3g)" % (label, dtype, err, ROUNDED_BOUND[dtype]))
            ctx.check(err <= ROUNDED_BOUND[dtype], "%s %s: rounding the weights moved the outputs "
                      "by %.3g of their largest value, more than %.3g" %
                      (label, dtype, err, ROUNDED_BOUND[dtype]))
        elif ctx.predict:
            compare(ctx, "%s vs meshtrain predict" % label, got,
                    predict_reference(ctx, checkpoint, x, meta.get("model")), FP32_RTOL)
    return ckpt


def test_rows(x, extra=16, seed=7):
    """The first 64 training rows and `extra` new ones around them."""
    rng = np.random.default_rng(seed)
    new = x[:extra] * (1 + 0.01 * rng.normal(size=(extra, x.shape[1])))
    return np.concatenate([x[:64], new]).astype(np.float32)


# --- cases -----------------------------------------------------------------------------------

def case_classification(ctx):
    """Dense classifier (gelu): output, probability, class, in fp32, fp16 and bf16."""
    data = os.path.join(ctx.work, "classification.h5")
    x = write_standardized_data(data, "classification")
    ckpt = train(ctx, "classification", data, [FEATURES, 16, 12, 4], "gelu", "cross_entropy")
    export_and_compare(ctx, ckpt, test_rows(x), "classification_gelu", ("fp32", "fp16", "bf16"))


def write_normalization(path, x, targets):
    """/normalization as framework/io/normalization.hpp documents it (float64, per feature)."""
    with h5py.File(path, "r+") as f:
        set_dataset(f, "normalization/input_mean", x.astype(np.float64).mean(axis=0))
        set_dataset(f, "normalization/input_std", x.astype(np.float64).std(axis=0))
        set_dataset(f, "normalization/target_mean", np.array([100.0, -3.5]))
        set_dataset(f, "normalization/target_std", np.array([12.5, 0.02]))
        del targets


def case_regression_normalized(ctx):
    """Regression (tanh) with input and target statistics in the checkpoint: normalization
    and de-normalization inside the graph, fp32 and bf16."""
    data = os.path.join(ctx.work, "regression.h5")
    x = write_data(data, "regression")
    ckpt_dir = train(ctx, "regression", data, [FEATURES, 16, 2], "tanh", "mse")
    path = latest_file(ckpt_dir)
    write_normalization(path, x, 2)
    ckpt = export_and_compare(ctx, path, test_rows(x), "regression_normalized", ("fp32", "bf16"))
    # The statistics matter: without them the outputs would be far off.
    plain = dict(ckpt, normalization={})
    off = relative_error(reference_forward(plain, test_rows(x))[0]["output"],
                         reference_forward(ckpt, test_rows(x))[0]["output"])
    ctx.check(off > 1e-2, "normalization changes the outputs by only %.3g" % off)


def case_activation(ctx, kind):
    """A regression model with activation `kind` between its layers."""
    data = os.path.join(ctx.work, "regression.h5")
    scaled = write_standardized_data(data, "regression")
    ckpt = train(ctx, "activation_" + kind, data, [FEATURES, 16, 12, 2], kind, "mse")
    export_and_compare(ctx, ckpt, test_rows(scaled), "activation_" + kind)


def residual_keys(norm, depth=2, width=16, hidden=24, outputs=2):
    return {"inputs": FEATURES, "outputs": outputs, "width": width, "hidden": hidden,
            "depth": depth, "norm": norm}


def check_graph_ops(ctx, label, path, expected, absent=()):
    """The exported graph has each op of `expected` and none of `absent`."""
    import onnx
    ops = {n.op_type for n in onnx.load(path).graph.node}
    for op in expected:
        ctx.check(op in ops, "%s: no %s node in the graph (ops: %s)" % (label, op, sorted(ops)))
    for op in absent:
        ctx.check(op not in ops, "%s: a %s node in the graph" % (label, op))


def case_residual_layernorm_silu(ctx):
    """A residual_mlp (LayerNorm, SiLU, 2 blocks) trained on tp = 2, with input and target
    statistics in the checkpoint: fp32 and fp16."""
    data = os.path.join(ctx.work, "regression.h5")
    x = write_data(data, "regression")
    ckpt_dir = train(ctx, "residual_layernorm_silu", data, None, "silu", "mse", mesh="tp_np2",
                     residual=residual_keys("layernorm"))
    path = latest_file(ckpt_dir)
    write_normalization(path, x, 2)
    ckpt = export_and_compare(ctx, path, test_rows(x), "residual_layernorm_silu", ("fp32", "fp16"))
    check_graph_ops(ctx, "residual_layernorm_silu", os.path.join(
        ctx.work, "residual_layernorm_silu_fp32.onnx"), ["LayerNormalization", "Sigmoid"],
        ["Dropout", "Sqrt"])
    # Training moved the norms' parameters off their initial 1 and 0, so the test sees them.
    moved = max(float(np.abs(ckpt["params"]["blocks/0/norm/scale"] - 1).max()),
                float(np.abs(ckpt["params"]["output_norm/bias"]).max()))
    ctx.check(moved > 1e-3, "training left the norms' parameters at 1 and 0 (moved %.3g)" % moved)


def case_residual_rmsnorm_swiglu(ctx):
    """A residual_mlp (RMSNorm, SwiGLU, 1 block) trained on fsdp x tp = 2 x 2: fp32 and bf16.
    (With 2 blocks, rounding the weights to fp16 or bf16 moves this model's outputs by 93% of
    ROUNDED_BOUND, too near it for a stable test; residual_layernorm_silu has 2 blocks.)"""
    data = os.path.join(ctx.work, "regression.h5")
    scaled = write_standardized_data(data, "regression")
    ckpt = train(ctx, "residual_rmsnorm_swiglu", data, None, "swiglu", "mse",
                 mesh="fsdp_tp_np4", residual=residual_keys("rmsnorm", depth=1))
    export_and_compare(ctx, ckpt, test_rows(scaled), "residual_rmsnorm_swiglu", ("fp32", "bf16"))
    check_graph_ops(ctx, "residual_rmsnorm_swiglu", os.path.join(
        ctx.work, "residual_rmsnorm_swiglu_fp32.onnx"), ["Sqrt", "ReduceSum", "Sigmoid"],
        ["LayerNormalization", "Dropout"])


def case_residual_activations(ctx):
    """residual_mlp blocks with each other activation (relu, tanh, gelu, sigmoid, none;
    RMSNorm, 1 block, one rank): fp32 against the float64 forward and predict."""
    data = os.path.join(ctx.work, "regression.h5")
    scaled = write_standardized_data(data, "regression")
    for kind in ("relu", "tanh", "gelu", "sigmoid", "none"):
        ckpt = train(ctx, "residual_" + kind, data, None, kind, "mse",
                     residual=residual_keys("rmsnorm", depth=1))
        export_and_compare(ctx, ckpt, test_rows(scaled), "residual_" + kind)


def case_residual_classification(ctx):
    """A residual_mlp classifier without norms (gelu_erf, 1 block): output, probability,
    class, in fp32, fp16 and bf16."""
    data = os.path.join(ctx.work, "classification.h5")
    x = write_standardized_data(data, "classification")
    ckpt = train(ctx, "residual_classification", data, None, "gelu_erf", "cross_entropy",
                 residual=residual_keys("none", depth=1, outputs=4))
    export_and_compare(ctx, ckpt, test_rows(x), "residual_classification", ("fp32", "fp16", "bf16"))
    check_graph_ops(ctx, "residual_classification", os.path.join(
        ctx.work, "residual_classification_fp32.onnx"), ["Erf", "Softmax", "ArgMax"],
        ["LayerNormalization", "Sqrt"])


def case_moe(ctx):
    """An MoE layer (4 experts, top 2) trained on ep = 2: fp32 and fp16."""
    data = os.path.join(ctx.work, "classification.h5")
    x = write_standardized_data(data, "classification")
    ckpt = train(ctx, "moe", data, [FEATURES, 16, 12, 4], "relu", "cross_entropy", mesh="ep_np2",
                 moe={"moe_layers": [1], "experts": 4, "top_k": 2})
    export_and_compare(ctx, ckpt, test_rows(x), "moe", ("fp32", "fp16"))


def case_residual_moe(ctx):
    """An MoE block (1 block: 4 SwiGLU expert feed-forwards, top 2) in a residual_mlp trained
    on ep = 2: fp32 and fp16 (one block, as residual_rmsnorm_swiglu: with two, rounding the
    weights to fp16 moved the outputs by 104% of ROUNDED_BOUND); and block 0 of 2 with gelu
    experts before a dense block, a classifier on one rank: fp32."""
    data = os.path.join(ctx.work, "regression.h5")
    scaled = write_standardized_data(data, "regression")
    moe = {"moe_layers": [0], "experts": 4, "top_k": 2}
    ckpt = train(ctx, "residual_moe_swiglu", data, None, "swiglu", "mse", mesh="ep_np2", moe=moe,
                 residual=residual_keys("rmsnorm", depth=1))
    export_and_compare(ctx, ckpt, test_rows(scaled), "residual_moe_swiglu", ("fp32", "fp16"))
    check_graph_ops(ctx, "residual_moe_swiglu", os.path.join(
        ctx.work, "residual_moe_swiglu_fp32.onnx"), ["TopK", "ScatterElements", "Sigmoid"])
    data = os.path.join(ctx.work, "classification.h5")
    x = write_standardized_data(data, "classification")
    ckpt = train(ctx, "residual_moe_gelu", data, None, "gelu", "cross_entropy",
                 moe={"moe_layers": [0], "experts": 4, "top_k": 2},
                 residual=residual_keys("layernorm", outputs=4))
    export_and_compare(ctx, ckpt, test_rows(x), "residual_moe_gelu")


def tied_router_checkpoint(ctx):
    """An MoE checkpoint whose router columns 1, 2 and 3 are equal and column 0 their negative,
    so that on every row three experts tie, and whose experts lie far apart (another choice
    would show): (checkpoint file, test rows). Also used by pytorch_export_test.py."""
    data = os.path.join(ctx.work, "classification.h5")
    x = write_standardized_data(data, "classification")
    ckpt_dir = train(ctx, "moe_ties", data, [FEATURES, 16, 12, 4], "relu", "cross_entropy",
                     moe={"moe_layers": [1], "experts": 4, "top_k": 2})
    path = latest_file(ckpt_dir)
    with h5py.File(path, "r+") as f:
        router = f["params/layers/1/router/weight"][()]
        v = router[:, 1]
        router[:, 1] = router[:, 2] = router[:, 3] = v
        router[:, 0] = -v
        set_dataset(f, "params/layers/1/router/weight", router)
        # Experts far apart, so that another choice would show.
        w = f["params/layers/1/experts/weight"][()]
        for e in range(w.shape[0]):
            w[e] *= 1 + e
        set_dataset(f, "params/layers/1/experts/weight", w)
    return path, test_rows(x)


def case_moe_ties(ctx):
    """Router columns that tie on every row (tied_router_checkpoint). Training takes the lower
    indices; so must the export (TopK's tie order)."""
    path, rows = tied_router_checkpoint(ctx)
    export_and_compare(ctx, path, rows, "moe_ties", ("fp32",), min_ties=len(rows))
    # The test would see the other tie order.
    ckpt = read_checkpoint(path)
    lower, _ = reference_forward(ckpt, rows)
    higher, _ = reference_forward(ckpt, rows, ties_to_higher=True)
    diff = relative_error(higher["output"], lower["output"])
    ctx.check(diff > 1e-2, "breaking ties the other way changes the outputs by only %.3g" % diff)


def graph_bytes(path):
    import onnx
    return onnx.load(path).graph.SerializeToString()


def graph_without_weights(path):
    """The graph's bytes with the initializers' values left out (names, types, shapes kept)."""
    import onnx
    graph = onnx.load(path).graph
    for t in graph.initializer:
        t.ClearField("raw_data")
    return graph.SerializeToString()


def case_meshes(ctx):
    """The same model and data trained on 1 (dp), 2 (fsdp; tp) and 4 (fsdp x tp) ranks: each
    export matches its own float64 forward (1e-5), the graphs are byte-identical but for the
    weights' values, and the outputs agree with the 1-rank run's to within what training's
    mesh-dependent rounding leaves after 4 steps (1e-5 of the largest output; measured:
    1.1e-7)."""
    data = os.path.join(ctx.work, "classification.h5")
    x = write_standardized_data(data, "classification")
    rows = test_rows(x)
    sizes = [FEATURES, 16, 12, 4]
    graphs, outputs = {}, {}
    for mesh in ("dp_np1", "fsdp_np2", "tp_np2", "fsdp_tp_np4"):
        ckpt = train(ctx, "mesh_" + mesh, data, sizes, "relu", "cross_entropy", mesh=mesh)
        export_and_compare(ctx, ckpt, rows, mesh)
        path = os.path.join(ctx.work, "%s_fp32.onnx" % mesh)
        graphs[mesh] = graph_without_weights(path)
        got = run_ort(ctx, path, rows)
        if got is not None:
            outputs[mesh] = got["output"]
    for mesh in graphs:
        ctx.check(graphs[mesh] == graphs["dp_np1"],
                  "the graph exported from %s differs from dp_np1's beyond its weights" % mesh)
        if mesh not in outputs:  # without ONNX Runtime
            continue
        err = normwise_error(outputs[mesh], outputs["dp_np1"])
        print("%s vs dp_np1: max|difference| / max|output| %.3g" % (mesh, err))
        ctx.check(err <= 1e-5, "%s's export differs from dp_np1's by %.3g of the largest output"
                  % (mesh, err))


def expect_error(ctx, cmd, regex, what):
    """A failing export: exit 2, one 'meshtrain: error:' line matching `regex`."""
    import re
    status, out, err = run(cmd)
    lines = err.strip().splitlines()
    ok = (ctx.check(status == 2, "%s: exit status %d, expected 2 (stderr: %s)" % (what, status, err))
          and ctx.check(len(lines) == 1, "%s: %d lines on stderr, expected one: %s" %
                        (what, len(lines), err))
          and ctx.check(re.search(regex, lines[0]) is not None and
                        lines[0].startswith("meshtrain: error: "),
                        "%s: stderr %r does not match /%s/" % (what, lines[0], regex)))
    return ok


def case_cli_errors(ctx):
    """Bad arguments and bad checkpoints: exit 2, one sentence, no output left behind."""
    data = os.path.join(ctx.work, "classification.h5")
    write_data(data, "classification")
    ckpt_dir = train(ctx, "cli", data, [FEATURES, 16, 4], "relu", "cross_entropy")
    ckpt = latest_file(ckpt_dir)
    out = os.path.join(ctx.work, "cli.onnx")
    base = [ctx.meshtrain, "export"]

    def no_output(path, what):
        ctx.check(not os.path.exists(path) and not os.path.exists(path + ".tmp"),
                  "%s: left %s or its .tmp behind" % (what, path))

    expect_error(ctx, base + [ckpt, "--format", "tflite", "--output", out],
                 r"unknown export format 'tflite'.*onnx", "unknown format")
    no_output(out, "unknown format")
    expect_error(ctx, base + [ckpt, "--format", "onnx", "--output", out, "--dtype", "int8"],
                 r"unknown weight dtype 'int8'.*fp32, fp16 and bf16", "unknown dtype")
    no_output(out, "unknown dtype")
    expect_error(ctx, base + [os.path.join(ctx.work, "nothing.h5"), "--format", "onnx",
                              "--output", out], r"checkpoint '.*nothing\.h5' does not exist",
                 "missing checkpoint")
    expect_error(ctx, base + [ckpt, "--format", "onnx", "--output",
                              os.path.join(ctx.work, "no_dir", "m.onnx")],
                 r"cannot write the output '.*no_dir/m\.onnx\.tmp': No such file",
                 "output directory missing")

    # An existing output: refused and untouched, replaced with --overwrite.
    with open(out, "w") as f:
        f.write("precious")
    expect_error(ctx, base + [ckpt, "--format", "onnx", "--output", out],
                 r"output '.*cli\.onnx' exists; pass --overwrite", "existing output")
    with open(out) as f:
        ctx.check(f.read() == "precious", "existing output: the file was changed")
    run_ok(base + [ckpt, "--format", "onnx", "--output", out, "--overwrite"])
    check_onnx(ctx, out)
    ctx.check(not os.path.exists(out + ".tmp"), "a .tmp file is left after a successful export")
    size = os.path.getsize(ckpt)
    expect_error(ctx, base + [ckpt_dir, "--format", "onnx", "--output", ckpt, "--overwrite"],
                 r"output '.*ckpt-000004\.h5' is the checkpoint being exported",
                 "output is the checkpoint")
    ctx.check(os.path.getsize(ckpt) == size, "the checkpoint was changed by a refused export")

    # A directory, its latest pointer and the file give the same model.
    g = graph_bytes(out)
    for source in (ckpt_dir, os.path.join(ckpt_dir, "latest")):
        other = export(ctx, source, os.path.join(ctx.work, "cli_other.onnx"), extra=["--overwrite"])
        ctx.check(graph_bytes(other) == g, "export of %s differs from that of %s" % (source, ckpt))

    # A flipped byte in a parameter: the CRC-32 error names the dataset.
    bad = os.path.join(ctx.work, "corrupt.h5")
    shutil.copyfile(ckpt, bad)
    with h5py.File(bad, "r") as f:
        offset = f["params/layers/1/weight"].id.get_offset()
    with open(bad, "r+b") as f:
        f.seek(offset + 5)
        byte = f.read(1)
        f.seek(offset + 5)
        f.write(bytes([byte[0] ^ 0x10]))
    corrupt_out = os.path.join(ctx.work, "corrupt.onnx")
    expect_error(ctx, base + [bad, "--format", "onnx", "--output", corrupt_out],
                 r"dataset '/params/layers/1/weight' in checkpoint '.*corrupt\.h5' is corrupt: "
                 r"the CRC-32", "corrupted checkpoint")
    no_output(corrupt_out, "corrupted checkpoint")

    # A weight beyond fp16's range is refused for --dtype fp16 only; a NaN for every dtype.
    large = os.path.join(ctx.work, "large_weight.h5")
    shutil.copyfile(ckpt, large)
    with h5py.File(large, "r+") as f:
        w = f["params/layers/0/weight"][()]
        w[2, 3] = 1e5
        set_dataset(f, "params/layers/0/weight", w)
    expect_error(ctx, base + [large, "--format", "onnx", "--output", corrupt_out, "--dtype", "fp16"],
                 r"parameter 'layers/0/weight' in checkpoint '.*large_weight\.h5' holds 100000 at "
                 r"element 35, beyond the range of fp16", "weight beyond fp16")
    no_output(corrupt_out, "weight beyond fp16")
    export(ctx, large, corrupt_out, "bf16")
    check_onnx(ctx, corrupt_out)
    os.remove(corrupt_out)
    with h5py.File(large, "r+") as f:
        b = f["params/layers/1/bias"][()]
        b[1] = np.nan
        set_dataset(f, "params/layers/1/bias", b)
    expect_error(ctx, base + [large, "--format", "onnx", "--output", corrupt_out],
                 r"parameter 'layers/1/bias' .* holds a non-finite value \(nan\) at element 1",
                 "NaN weight")
    no_output(corrupt_out, "NaN weight")

    # A parameter the config's model does not have (a checkpoint of another model).
    other = os.path.join(ctx.work, "other_model.h5")
    shutil.copyfile(ckpt, other)
    with h5py.File(other, "r+") as f:
        set_dataset(f, "params/layers/1/norm/scale", np.ones(4, np.float32))
    expect_error(ctx, base + [other, "--format", "onnx", "--output", corrupt_out],
                 r"has parameter 'layers/1/norm/scale' \(shape \[4\]\) that its config's model "
                 r"does not have", "extra parameter")
    no_output(corrupt_out, "extra parameter")


CASES = {
    "classification": case_classification,
    "regression_normalized": case_regression_normalized,
    "activation_relu": lambda ctx: case_activation(ctx, "relu"),
    "activation_tanh": lambda ctx: case_activation(ctx, "tanh"),
    "activation_gelu": lambda ctx: case_activation(ctx, "gelu"),
    "activation_none": lambda ctx: case_activation(ctx, "none"),
    "activation_gelu_erf": lambda ctx: case_activation(ctx, "gelu_erf"),
    "activation_silu": lambda ctx: case_activation(ctx, "silu"),
    "activation_sigmoid": lambda ctx: case_activation(ctx, "sigmoid"),
    "residual_layernorm_silu": case_residual_layernorm_silu,
    "residual_rmsnorm_swiglu": case_residual_rmsnorm_swiglu,
    "residual_classification": case_residual_classification,
    "residual_activations": case_residual_activations,
    "moe": case_moe,
    "residual_moe": case_residual_moe,
    "moe_ties": case_moe_ties,
    "meshes": case_meshes,
    "cli_errors": case_cli_errors,
}


def main():
    def add_predict(parser):
        parser.add_argument("--predict", action="store_true",
                            help="also compare with `meshtrain predict` of the same checkpoints")
    return script_test.case_main(CASES, Context, add_arguments=add_predict,
                                 skip_reason=lambda ctx: ctx.ort_missing,
                                 skip_needs="ONNX Runtime")


if __name__ == "__main__":
    sys.exit(main())
