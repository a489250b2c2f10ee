#!/usr/bin/env python3
"""`meshtrain export --format pytorch` end to end (docs/export.md), one case per ctest test:

  pytorch_export_test.py CASE --meshtrain BIN --source-dir DIR --work DIR -- MPIEXEC [FLAGS...]

Each case trains tiny models with `meshtrain train` under MPIEXEC (export_test.py's data,
configs, meshes and float64 forward, imported from it), exports each to a folder and checks:

  1. without PyTorch: model.safetensors read with plain Python (struct, json, numpy): the
     format (an 8-byte little-endian header length, a JSON header padded to a multiple of 8,
     data offsets consecutive from 0 to the end of the file, each tensor at a multiple of its
     element size) and its content: exactly the tensors docs/export.md's table names, each
     equal bit for bit to its checkpoint dataset in PyTorch's layout (Linear weights
     transposed), the normalization statistics in float64, and the metadata; model.py imports
     nothing but the standard library and torch; export_test.py's float64 forward of the
     checkpoint against `meshtrain predict` (1e-5 relative: the reference below);
  2. with PyTorch (Debian's python3-torch): in a fresh, isolated interpreter started in another
     folder (tests/export/run_torch_model.py), `import model; m = model.load()` with the folder
     on sys.path: m is in eval mode and m(x) on float32 rows in the user's units is float32
     and within 1e-5 relative (export_test.relative_error: floored at 0.1 of the largest
     output) of `meshtrain predict` and of the float64 forward; m(x, x) is a TypeError naming
     the extra argument (a DLRM's m(dense, indices, offsets): one argument too many is a
     TypeError, indices by a key that is no table a ValueError naming it).

Without PyTorch (python3 cannot import torch) part 2 is left out: the case exits 77 (ctest:
skipped) saying so when everything else passed, 1 otherwise.
"""

import ast
import json
import os
import shutil
import struct
import sys
import tempfile
import tomllib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import export_test as et  # noqa: E402  (its train, data, forward and predict helpers)
from export_test import np  # noqa: E402

RTOL = et.FP32_RTOL  # 1e-5
# model.py may import these and nothing else (no meshtrain, no numpy).
ALLOWED_IMPORTS = {"json", "math", "os", "struct", "sys", "torch"}
SAFETENSORS_DTYPES = {"F64": "<f8", "F32": "<f4"}


class Context(et.Context):
    def __init__(self, args):
        super().__init__(args)
        self.torch_missing = None  # why PyTorch cannot run here (None: it can, or untried)
        self._torch_checked = False

    def torch_available(self):
        if not self._torch_checked:
            self._torch_checked = True
            status, out, err = et.run([sys.executable, "-c",
                                       "import torch; print(torch.__version__)"])
            if status != 0:
                lines = err.strip().splitlines() or ["(no message)"]
                self.torch_missing = "%s cannot import torch: %s" % (sys.executable, lines[-1])
                print("without PyTorch: " + self.torch_missing)
            else:
                print("PyTorch %s" % out.strip())
        return self.torch_missing is None


# --- the export, read without PyTorch ------------------------------------------------------

def export(ctx, checkpoint, folder, extra=()):
    et.run_ok([ctx.meshtrain, "export", checkpoint, "--format", "pytorch", "--output", folder] +
              list(extra))
    return folder


def read_safetensors(ctx, path):
    """({name: numpy array}, metadata) of a safetensors file, checking its layout."""
    with open(path, "rb") as f:
        data = f.read()
    (length,) = struct.unpack("<Q", data[:8])
    ctx.check((8 + length) % 8 == 0, "%s: the data starts at byte %d, not a multiple of 8" %
              (path, 8 + length))
    header = json.loads(data[8:8 + length].decode("utf-8"))
    metadata = header.pop("__metadata__", {})
    ctx.check(all(isinstance(v, str) for v in metadata.values()),
              "%s: __metadata__ holds values that are not strings" % path)
    start, offset, tensors = 8 + length, 0, {}
    for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
        begin, end = info["data_offsets"]
        dtype = np.dtype(SAFETENSORS_DTYPES[info["dtype"]])
        ctx.check(begin == offset, "%s: %s starts at %d, not where the previous tensor ended (%d)"
                  % (path, name, begin, offset))
        ctx.check(begin % dtype.itemsize == 0, "%s: %s starts at %d, not a multiple of %d" %
                  (path, name, begin, dtype.itemsize))
        count = int(np.prod(info["shape"], dtype=np.int64))
        ctx.check(end - begin == count * dtype.itemsize, "%s: %s holds %d bytes for shape %s" %
                  (path, name, end - begin, info["shape"]))
        tensors[name] = np.frombuffer(data, dtype, count, start + begin).reshape(info["shape"])
        offset = end
    ctx.check(start + offset == len(data), "%s: %d bytes after the last tensor" %
              (path, len(data) - start - offset))
    return tensors, metadata


def pytorch_state(ckpt):
    """The state dict docs/export.md's table makes of a checkpoint (read_checkpoint's):
    {name: array}, nn.Linear weights [out, in]."""
    model, p, state = ckpt["config"]["model"], ckpt["params"], {}

    def linear(name, prefix):
        state[name + ".weight"] = p[prefix + "/weight"].T
        state[name + ".bias"] = p[prefix + "/bias"]

    def experts(name, suffix, prefix):  # [E, in, out] -> one nn.Linear per expert
        weight, bias = p[prefix + "/weight"], p[prefix + "/bias"]
        for e in range(weight.shape[0]):
            state["%s.experts.%d%s.weight" % (name, e, suffix)] = weight[e].T
            state["%s.experts.%d%s.bias" % (name, e, suffix)] = bias[e]

    def norm(name, prefix):
        for ours, theirs in (("scale", "weight"), ("bias", "bias")):
            if prefix + "/" + ours in p:
                state[name + "." + theirs] = p[prefix + "/" + ours]

    for key, values in ckpt["normalization"].items():
        state[key] = values
    moe_layers = set(model.get("moe_layers", []))
    if model.get("kind") == "dlrm":
        for part in ("bottom", "top"):
            for i in range(len(model[part]) - 1):
                linear("network.%s.%d" % (part, i), "%s/%d" % (part, i))
        for t, table in enumerate(model["tables"]):  # nn.EmbeddingBag: the table as it is
            state["network.embeddings.%d.weight" % t] = p["embeddings/%s/weight" % table["name"]]
    elif model.get("kind") == "residual_mlp":
        linear("network.input", "input")
        for i in range(model["depth"]):
            name, prefix = "network.blocks.%d" % i, "blocks/%d" % i
            norm(name + ".norm", prefix + "/norm")
            ff = name + ".feed_forward"
            projections = (["gate"] if model.get("activation") == "swiglu" else []) + ["up", "down"]
            if i in moe_layers:
                state[ff + ".router.weight"] = p[prefix + "/router/weight"].T
                for projection in projections:
                    experts(ff, "." + projection, prefix + "/experts/" + projection)
            else:
                for projection in projections:
                    linear(ff + "." + projection, prefix + "/" + projection)
        norm("network.output_norm", "output_norm")
        linear("network.output", "output")
    else:
        for i in range(len(model["sizes"]) - 1):
            name, prefix = "network.layers.%d" % i, "layers/%d" % i
            if i in moe_layers:
                state[name + ".router.weight"] = p[prefix + "/router/weight"].T
                experts(name, "", prefix + "/experts")
            else:
                linear(name, prefix)
    return state


def check_tensors(ctx, label, tensors, ckpt):
    """model.safetensors holds exactly pytorch_state(ckpt), bit for bit, parameters as F32 and
    statistics as F64."""
    expected = pytorch_state(ckpt)
    ctx.check(sorted(tensors) == sorted(expected), "%s: model.safetensors holds %s, expected %s" %
              (label, sorted(tensors), sorted(expected)))
    for name in sorted(set(tensors) & set(expected)):
        got, want = tensors[name], expected[name]
        dtype = np.float64 if name in ckpt["normalization"] else np.float32
        ctx.check(got.dtype == dtype, "%s: %s is %s, expected %s" % (label, name, got.dtype, dtype))
        ctx.check(got.shape == want.shape, "%s: %s has shape %s, expected %s" %
                  (label, name, got.shape, want.shape))
        if got.shape == want.shape:
            # The checkpoint's float32 values, as float64 in read_checkpoint: exact.
            differ = int((got.astype(np.float64) != want).sum())
            ctx.check(differ == 0, "%s: %s differs from the checkpoint in %d elements" %
                      (label, name, differ))


def check_metadata(ctx, label, metadata, ckpt):
    ctx.check(metadata.get("format") == "pt", "%s: metadata format %r, expected 'pt'" %
              (label, metadata.get("format")))
    ctx.check(metadata.get("step") == str(ckpt["step"]), "%s: metadata step %r, expected %d" %
              (label, metadata.get("step"), ckpt["step"]))
    ctx.check(tomllib.loads(metadata.get("config", "")) == ckpt["config"],
              "%s: metadata config is not the checkpoint's" % label)
    ctx.check(metadata.get("producer", "").startswith("meshtrain "),
              "%s: metadata producer %r" % (label, metadata.get("producer")))


def check_imports(ctx, label, path):
    """model.py imports the standard library's json, math, os, struct, sys and torch only."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    ctx.check(imported <= ALLOWED_IMPORTS, "%s: model.py imports %s beyond %s" %
              (label, sorted(imported - ALLOWED_IMPORTS), sorted(ALLOWED_IMPORTS)))
    ctx.check("torch" in imported, "%s: model.py does not import torch" % label)


# --- the export, run in PyTorch ------------------------------------------------------------

def run_torch(ctx, folder, x):
    """m(x) of `import model; m = model.load()` from `folder`, in a fresh isolated interpreter
    started elsewhere; None without PyTorch."""
    if not ctx.torch_available():
        return None
    work = tempfile.mkdtemp(dir=ctx.work)
    x_file, y_file = os.path.join(work, "x.npy"), os.path.join(work, "y.npy")
    np.save(x_file, np.ascontiguousarray(x, np.float32))
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "run_torch_model.py")
    out = et.run_ok([sys.executable, "-I", script, os.path.abspath(folder), x_file, y_file],
                    cwd=work)
    info = json.loads(out.strip().splitlines()[-1])
    ctx.check(info["training"] is False, "%s: model.load() returned a module in training mode" %
              folder)
    ctx.check(info["dtype"] == "torch.float32", "%s: m(x) is %s, expected torch.float32" %
              (folder, info["dtype"]))
    ctx.check(info["model_file"] == os.path.join(os.path.abspath(folder), "model.py"),
              "%s: `import model` found %s" % (folder, info["model_file"]))
    ctx.check(info["extra_args"].startswith("TypeError: this ") and
              "model is called m(x), got 1 more arguments (Tensor)" in info["extra_args"],
              "%s: m(x, x) gave %r, expected a TypeError naming the extra argument" %
              (folder, info["extra_args"]))
    y = np.load(y_file)
    shutil.rmtree(work)
    return y


def export_and_compare(ctx, checkpoint, x, label, min_ties=0):
    """Exports `checkpoint` into <work>/<label> and checks it (the module's docstring)."""
    path = et.latest_file(checkpoint) if os.path.isdir(checkpoint) else checkpoint
    ckpt = et.read_checkpoint(path)
    folder = export(ctx, checkpoint, os.path.join(ctx.work, label + "_pytorch"))
    ctx.check(sorted(os.listdir(folder)) == ["model.py", "model.safetensors"],
              "%s: the folder holds %s" % (label, sorted(os.listdir(folder))))
    tensors, metadata = read_safetensors(ctx, os.path.join(folder, "model.safetensors"))
    check_tensors(ctx, label, tensors, ckpt)
    check_metadata(ctx, label, metadata, ckpt)
    check_imports(ctx, label, os.path.join(folder, "model.py"))

    reference, ties = et.reference_forward(ckpt, x)
    ctx.check(ties >= min_ties, "%s: %d tied routing choices met, expected at least %d" %
              (label, ties, min_ties))
    predicted = et.predict_reference(ctx, checkpoint, x, metadata.get("model"))
    et.compare(ctx, "%s meshtrain predict vs float64 forward" % label,
               {"output": predicted["output"]}, {"output": reference["output"]}, RTOL)
    got = run_torch(ctx, folder, x)
    if got is None:
        return ckpt
    et.compare(ctx, "%s PyTorch vs meshtrain predict" % label, {"output": got},
               {"output": predicted["output"]}, RTOL)
    et.compare(ctx, "%s PyTorch vs float64 forward" % label, {"output": got},
               {"output": reference["output"]}, RTOL)
    return ckpt


# --- DLRM ----------------------------------------------------------------------------------

def run_torch_dlrm(ctx, folder, dense, bags, tables):
    """The logits of `import model; m = model.load(); m(dense, indices, offsets)` from `folder`
    (run_torch_dlrm.py, a fresh isolated interpreter) for bags {table: list of id lists}
    (negative ids dropped: a PyTorch bag holds its ids only); None without PyTorch."""
    if not ctx.torch_available():
        return None
    work = tempfile.mkdtemp(dir=ctx.work)
    arrays = {"dense": np.ascontiguousarray(dense, np.float32)}
    for t, name in enumerate(tables):
        rows = [[i for i in bag if i >= 0] for bag in bags[name]]
        arrays["indices_%d" % t] = np.array([i for r in rows for i in r], np.int64)
        arrays["offsets_%d" % t] = np.cumsum([0] + [len(r) for r in rows[:-1]]).astype(np.int64)
    input_file, y_file = os.path.join(work, "input.npz"), os.path.join(work, "y.npy")
    np.savez(input_file, **arrays)
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "run_torch_dlrm.py")
    out = et.run_ok([sys.executable, "-I", script, os.path.abspath(folder), input_file, y_file],
                    cwd=work)
    info = json.loads(out.strip().splitlines()[-1])
    ctx.check(info["training"] is False and info["dtype"] == "torch.float32" and
              info["shape"] == [len(dense), 1] and info["tables"] == list(tables) and
              info["modules"] == ["EmbeddingBag"] and info["dict_equal"],
              "%s: the module says %s" % (folder, info))
    unknown, extra = info["refusals"]
    ctx.check(unknown.startswith("ValueError: indices: the keys ") and
              "unknown: ['not_a_table'], missing: ['%s']" % tables[0] in unknown,
              "%s: indices by a key that is no table gave %r" % (folder, unknown))
    ctx.check(extra == "TypeError: a DLRM is called m(dense, indices, offsets), got 3 "
              "arguments after dense", "%s: one argument too many gave %r" % (folder, extra))
    y = np.load(y_file)
    shutil.rmtree(work)
    return y, info


def case_dlrm(ctx):
    """DLRMs (dlrm_export_test.py's data, rows and float64 forward): interaction dot trained on
    2 ranks (fsdp 2: tables `bags` and `avg` row-wise, `one` replicated), cat with tables of
    dims 3, 5 and 2 trained on 4 ranks (all three row-wise where their rows divide); both with
    sum and mean pooling, empty bags (in every table, and a row of nothing but empty bags) and
    repeated ids. The tensors bit for bit; m(dense, indices, offsets) within 1e-5 of the float64
    forward and of `meshtrain predict` on one rank; nn.EmbeddingBag modules of the tables'
    pooling."""
    import dlrm_export_test as dt
    data = dt.write_dlrm_data(os.path.join(ctx.work, "train.h5"))
    dense, bags = dt.test_rows(data)
    dims = {"one": 3, "bags": 5, "avg": 2}
    for label, ranks, interaction in (("dlrm_dot_np2", 2, "dot"), ("dlrm_cat_np4", 4, "cat")):
        tables = [{"name": n, "rows": rows, "pooling": pooling}
                  for n, (rows, _, pooling) in dt.TABLES.items()]
        if interaction == "cat":
            for t in tables:
                t["dim"] = dims[t["name"]]
        checkpoint = dt.train(ctx, label, data, ranks, tables, interaction=interaction)
        ckpt = et.read_checkpoint(et.latest_file(checkpoint))
        folder = export(ctx, checkpoint, os.path.join(ctx.work, label + "_pytorch"))
        ctx.check(sorted(os.listdir(folder)) == ["model.py", "model.safetensors"],
                  "%s: the folder holds %s" % (label, sorted(os.listdir(folder))))
        tensors, metadata = read_safetensors(ctx, os.path.join(folder, "model.safetensors"))
        check_tensors(ctx, label, tensors, ckpt)
        check_metadata(ctx, label, metadata, ckpt)
        check_imports(ctx, label, os.path.join(folder, "model.py"))
        reference = dt.dlrm_forward(ckpt, dense, bags)
        input_path = dt.write_predict_input(os.path.join(ctx.work, label + "_input.h5"), dense,
                                            bags)
        output = os.path.join(ctx.work, label + "_prediction.h5")
        status, out, err = dt.predict(ctx, checkpoint, input_path, output, 1)
        if not ctx.check(status == 0, "%s: predict: status %d, %s" % (label, status, err)):
            continue
        with et.h5py.File(output, "r") as f:
            predicted = {"logit": f["logit"][()]}
        et.compare(ctx, "%s meshtrain predict vs float64 forward" % label, predicted,
                   {"logit": reference["logit"]}, RTOL)
        result = run_torch_dlrm(ctx, folder, dense, bags, [t["name"] for t in tables])
        if result is None:
            continue
        got, info = result
        pooling = [t["pooling"] for t in tables]
        ctx.check(info["modes"] == pooling, "%s: EmbeddingBag modes %s, expected %s" %
                  (label, info["modes"], pooling))
        et.compare(ctx, "%s PyTorch vs meshtrain predict" % label, {"logit": got}, predicted,
                   RTOL)
        et.compare(ctx, "%s PyTorch vs float64 forward" % label, {"logit": got},
                   {"logit": reference["logit"]}, RTOL)


# --- cases ---------------------------------------------------------------------------------

def case_mlp_classification(ctx):
    """A dense classifier (gelu, 4 classes) trained on tp = 2: the logits."""
    data = os.path.join(ctx.work, "classification.h5")
    x = et.write_standardized_data(data, "classification")
    ckpt = et.train(ctx, "classification", data, [et.FEATURES, 16, 12, 4], "gelu",
                    "cross_entropy", mesh="tp_np2")
    export_and_compare(ctx, ckpt, et.test_rows(x), "mlp_classification")


def case_mlp_regression_normalized(ctx):
    """A regression (tanh) on raw inputs at scales 1e-3 to 1e4 (one feature at 1000 +- 0.01),
    with input and target statistics in the checkpoint: standardized and returned to the
    targets' units inside the module."""
    data = os.path.join(ctx.work, "regression.h5")
    x = et.write_data(data, "regression")
    path = et.latest_file(et.train(ctx, "regression", data, [et.FEATURES, 16, 2], "tanh", "mse"))
    et.write_normalization(path, x, 2)
    export_and_compare(ctx, path, et.test_rows(x), "mlp_regression_normalized")


def case_mlp_activations(ctx):
    """A regression mlp with each other activation between its layers (relu, tanh, gelu_erf,
    silu, sigmoid, none; gelu is the classifier's)."""
    data = os.path.join(ctx.work, "regression.h5")
    x = et.write_standardized_data(data, "regression")
    for kind in ("relu", "tanh", "gelu_erf", "silu", "sigmoid", "none"):
        ckpt = et.train(ctx, "activation_" + kind, data, [et.FEATURES, 16, 12, 2], kind, "mse")
        export_and_compare(ctx, ckpt, et.test_rows(x), "mlp_" + kind)


def case_residual_layernorm_silu(ctx):
    """A residual_mlp (LayerNorm, SiLU, 2 blocks) trained on tp = 2 on raw inputs, with input
    and target statistics in the checkpoint."""
    data = os.path.join(ctx.work, "regression.h5")
    x = et.write_data(data, "regression")
    path = et.latest_file(et.train(ctx, "residual_layernorm_silu", data, None, "silu", "mse",
                                   mesh="tp_np2", residual=et.residual_keys("layernorm")))
    et.write_normalization(path, x, 2)
    export_and_compare(ctx, path, et.test_rows(x), "residual_layernorm_silu")


def case_residual_rmsnorm_swiglu(ctx):
    """A residual_mlp (RMSNorm, SwiGLU, 1 block: with 2, float32's rounding of outputs a sum
    cancels put predict and PyTorch 4.9e-6 and 6.1e-6 from the float64 forward, too near 1e-5
    for a stable test; residual_layernorm_silu has 2 blocks) trained on fsdp x tp = 2 x 2; and
    a classifier without norms (gelu, 1 block) on one rank."""
    data = os.path.join(ctx.work, "regression.h5")
    x = et.write_standardized_data(data, "regression")
    ckpt = et.train(ctx, "residual_rmsnorm_swiglu", data, None, "swiglu", "mse",
                    mesh="fsdp_tp_np4", residual=et.residual_keys("rmsnorm", depth=1))
    export_and_compare(ctx, ckpt, et.test_rows(x), "residual_rmsnorm_swiglu")
    data = os.path.join(ctx.work, "classification.h5")
    x = et.write_standardized_data(data, "classification")
    ckpt = et.train(ctx, "residual_classification", data, None, "gelu", "cross_entropy",
                    residual=et.residual_keys("none", depth=1, outputs=4))
    export_and_compare(ctx, ckpt, et.test_rows(x), "residual_classification")


def case_moe(ctx):
    """An mlp's MoE layer (4 experts, top 2) trained on ep = 2; and a router whose columns tie
    on every row (export_test.tied_router_checkpoint): the lower experts are chosen, as in
    training and predict."""
    data = os.path.join(ctx.work, "classification.h5")
    x = et.write_standardized_data(data, "classification")
    ckpt = et.train(ctx, "moe", data, [et.FEATURES, 16, 12, 4], "relu", "cross_entropy",
                    mesh="ep_np2", moe={"moe_layers": [1], "experts": 4, "top_k": 2})
    export_and_compare(ctx, ckpt, et.test_rows(x), "moe")
    path, rows = et.tied_router_checkpoint(ctx)
    export_and_compare(ctx, path, rows, "moe_ties", min_ties=len(rows))


def case_residual_moe(ctx):
    """MoE blocks of a residual_mlp: SwiGLU experts (RMSNorm) trained on ep = 2, and gelu
    experts (LayerNorm) in block 0 of 2 of a classifier."""
    data = os.path.join(ctx.work, "regression.h5")
    x = et.write_standardized_data(data, "regression")
    moe = {"moe_layers": [0], "experts": 4, "top_k": 2}
    ckpt = et.train(ctx, "residual_moe_swiglu", data, None, "swiglu", "mse", mesh="ep_np2",
                    moe=moe, residual=et.residual_keys("rmsnorm", depth=1))
    export_and_compare(ctx, ckpt, et.test_rows(x), "residual_moe_swiglu")
    data = os.path.join(ctx.work, "classification.h5")
    x = et.write_standardized_data(data, "classification")
    ckpt = et.train(ctx, "residual_moe_gelu", data, None, "gelu", "cross_entropy", moe=moe,
                    residual=et.residual_keys("layernorm", outputs=4))
    export_and_compare(ctx, ckpt, et.test_rows(x), "residual_moe_gelu")


def case_cli_errors(ctx):
    """The output folder's refusals (exit 2, one sentence, nothing left behind), --overwrite,
    a folder created with its parents, and --dtype refused."""
    data = os.path.join(ctx.work, "classification.h5")
    et.write_data(data, "classification")
    ckpt_dir = et.train(ctx, "cli", data, [et.FEATURES, 16, 4], "relu", "cross_entropy")
    ckpt = et.latest_file(ckpt_dir)
    base = [ctx.meshtrain, "export", ckpt, "--format", "pytorch", "--output"]

    def no_tmp(folder, what):
        names = os.listdir(folder) if os.path.isdir(folder) else []
        left = [f for f in names if f.endswith(".tmp")]
        ctx.check(not left, "%s: left %s behind in %s" % (what, left, folder))

    # Created with its parents; the printed line names both files.
    folder = os.path.join(ctx.work, "new", "nested")
    out = et.run_ok(base + [folder])
    ctx.check(sorted(os.listdir(folder)) == ["model.py", "model.safetensors"],
              "the new folder holds %s" % sorted(os.listdir(folder)))
    ctx.check("model.py" in out and "model.safetensors" in out and "import model" in out,
              "the export's line does not name its files: %r" % out)

    # An existing model.py or model.safetensors: refused and untouched, replaced with
    # --overwrite; other files in the folder are left alone.
    for name in ("model.py", "model.safetensors"):
        existing = os.path.join(ctx.work, "existing_" + name.replace(".", "_"))
        os.makedirs(existing)
        with open(os.path.join(existing, name), "w") as f:
            f.write("precious")
        with open(os.path.join(existing, "notes.txt"), "w") as f:
            f.write("mine")
        et.expect_error(ctx, base + [existing], r"output '.*%s' exists; pass --overwrite" %
                        name.replace(".", r"\."), "existing " + name)
        with open(os.path.join(existing, name)) as f:
            ctx.check(f.read() == "precious", "existing %s: the file was changed" % name)
        ctx.check(sorted(os.listdir(existing)) == [name, "notes.txt"],
                  "existing %s: the refused export wrote %s" % (name, sorted(os.listdir(existing))))
        et.run_ok(base + [existing, "--overwrite"])
        tensors, _ = read_safetensors(ctx, os.path.join(existing, "model.safetensors"))
        check_tensors(ctx, "overwritten " + name, tensors, et.read_checkpoint(ckpt))
        with open(os.path.join(existing, "notes.txt")) as f:
            ctx.check(f.read() == "mine", "--overwrite changed another file of the folder")
        no_tmp(existing, "--overwrite")

    # The output is a file, not a folder.
    a_file = os.path.join(ctx.work, "a_file")
    with open(a_file, "w") as f:
        f.write("x")
    et.expect_error(ctx, base + [a_file], r"output '.*a_file' is a file; --format pytorch writes "
                    r"a folder", "output is a file")

    # --dtype: the PyTorch export stores the float32 master weights.
    missing = os.path.join(ctx.work, "not_written")
    et.expect_error(ctx, base + [missing, "--dtype", "bf16"],
                    r"--dtype bf16 applies to --format onnx; --format pytorch stores the "
                    r"checkpoint's float32 weights", "--dtype bf16")
    ctx.check(not os.path.exists(missing), "--dtype bf16: the output folder was created")

    # A missing checkpoint: no folder made.
    et.expect_error(ctx, [ctx.meshtrain, "export", os.path.join(ctx.work, "nothing.h5"),
                          "--format", "pytorch", "--output", missing],
                    r"checkpoint '.*nothing\.h5' does not exist", "missing checkpoint")
    ctx.check(not os.path.exists(missing), "missing checkpoint: the output folder was created")

    # The checkpoint itself as model.safetensors: refused even with --overwrite.
    inside = os.path.join(ctx.work, "inside")
    os.makedirs(inside)
    shutil.copyfile(ckpt, os.path.join(inside, "model.safetensors"))
    size = os.path.getsize(os.path.join(inside, "model.safetensors"))
    et.expect_error(ctx, [ctx.meshtrain, "export", os.path.join(inside, "model.safetensors"),
                          "--format", "pytorch", "--output", inside, "--overwrite"],
                    r"--output '.*model\.safetensors' is the checkpoint being exported",
                    "output is the checkpoint")
    ctx.check(os.path.getsize(os.path.join(inside, "model.safetensors")) == size,
              "the checkpoint was changed by a refused export")
    ctx.check(sorted(os.listdir(inside)) == ["model.safetensors"],
              "output is the checkpoint: the folder holds %s" % sorted(os.listdir(inside)))

    # A NaN weight is refused as for ONNX, naming the parameter.
    bad = os.path.join(ctx.work, "nan_weight.h5")
    shutil.copyfile(ckpt, bad)
    with et.h5py.File(bad, "r+") as f:
        b = f["params/layers/1/bias"][()]
        b[1] = np.nan
        et.set_dataset(f, "params/layers/1/bias", b)
    et.expect_error(ctx, [ctx.meshtrain, "export", bad, "--format", "pytorch", "--output",
                          missing], r"parameter 'layers/1/bias' .* holds a non-finite value "
                    r"\(nan\) at element 1", "NaN weight")
    ctx.check(not os.path.exists(missing), "NaN weight: the output folder was created")


CASES = {
    "mlp_classification": case_mlp_classification,
    "mlp_regression_normalized": case_mlp_regression_normalized,
    "mlp_activations": case_mlp_activations,
    "residual_layernorm_silu": case_residual_layernorm_silu,
    "residual_rmsnorm_swiglu": case_residual_rmsnorm_swiglu,
    "moe": case_moe,
    "residual_moe": case_residual_moe,
    "cli_errors": case_cli_errors,
    "dlrm": case_dlrm,
}


def main():
    def make_context(args):
        args.predict = True
        return Context(args)
    return et.script_test.case_main(CASES, make_context, skip_reason=lambda ctx: ctx.torch_missing,
                                    skip_needs="PyTorch")


if __name__ == "__main__":
    sys.exit(main())
