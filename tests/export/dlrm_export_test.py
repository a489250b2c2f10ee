#!/usr/bin/env python3
"""`meshtrain export --format onnx` of a DLRM checkpoint (docs/export.md, "DLRM"), one case per
ctest test:

  dlrm_export_test.py CASE --meshtrain BIN --source-dir DIR --work DIR -- MPIEXEC [FLAGS...]

Each case trains a tiny DLRM (`[model] kind = "dlrm"`, docs/recsys.md) with `meshtrain train`
under MPIEXEC on a click file written here (4 dense features; table `one`: one id per row, 11
rows, replicated; `bags`: 0 to 4 ids per row with repeats and empty bags, 12 rows, sum; `avg`:
0 to 3 ids, 8 rows, mean; on 2 and 4 ranks the fsdp preset makes `bags` and `avg` row-wise), exports
it, checks the file with onnx.checker (full_check), runs it in ONNX Runtime (onnxruntime-node,
through tests/export/run_onnx_inputs.js) on rows with repeated ids, empty bags (in every table,
and a row of nothing but padding), padding between ids and bags wider than any in training, and
compares `logit` and `probability` with a float64 forward computed here from the checkpoint's
datasets (h5py) following docs/model_math.md ("DLRM").

  dot   interaction dot, trained on 1 rank and on 2 (fsdp 2: two tables row-wise); fp32, and
        on the 2-rank checkpoint fp16 and bf16 weights; the graph's ops (Gather, ReduceSum, no
        op outside the expected set) and inputs. (--format pytorch: pytorch_export_test.py.)
  cat   interaction cat with tables of dims 3, 5 and 2 (cat allows any), 2 ranks; fp32, fp16.

Tolerances (export_test.py's, per output, |got - ref| / max(|ref|, 0.1 max|ref|)): 1e-5 against
the forward with the weights as exported (fp16 / bf16: rounded to nearest even as the export
rounds them). Exit status 77 (skipped) when ONNX Runtime cannot be installed, after the checks
that need none of it (training, the export, onnx.checker, the metadata) passed.
"""

import json
import os
import shutil
import sys
import tempfile
import tomllib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import export_test as et  # noqa: E402  (its Context, checkpoint reader, checks and tolerances)
from export_test import np, h5py, script_test  # noqa: E402

DENSE = 4
TABLES = {  # name: (rows, largest bag, pooling)
    "one": (11, 1, "sum"),
    "bags": (12, 4, "sum"),  # rows divisible by 4: row-wise at fsdp 2 and 4
    "avg": (8, 3, "mean"),
}
BOTTOM = [DENSE, 8, 4]  # d = 4


def write_dlrm_data(path, rows=128, seed=0):
    """Dense features, clicks from a random teacher, and per table a CSR of ids (docs/recsys.md's
    layout): bags of 0 to `largest` ids drawn with repeats (one id per row for `one`)."""
    rng = np.random.default_rng(seed)
    dense = rng.normal(size=(rows, DENSE)).astype(np.float32)
    logit = dense @ rng.normal(size=DENSE)
    with h5py.File(path, "w") as f:
        f["dense"] = dense
        for name, (table_rows, largest, _) in TABLES.items():
            lengths = (np.ones(rows, np.int64) if largest == 1
                       else rng.integers(0, largest + 1, size=rows))
            values = rng.integers(0, table_rows, size=int(lengths.sum())).astype(np.int64)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            group = f.create_group("sparse/" + name)
            group["values"], group["offsets"] = values, offsets
            group.attrs["rows"] = np.int64(table_rows)
            effect = rng.normal(size=table_rows)
            logit += np.array([effect[values[offsets[r]:offsets[r + 1]]].sum() for r in range(rows)])
        f["label"] = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(np.float32)[:, None]
    return path


def read_csr(path):
    with h5py.File(path, "r") as f:
        dense = f["dense"][()]
        bags = {name: [f["sparse/%s/values" % name][()], f["sparse/%s/offsets" % name][()]]
                for name in TABLES}
    return dense, {name: [values[offsets[r]:offsets[r + 1]] for r in range(len(offsets) - 1)]
                   for name, (values, offsets) in bags.items()}


def test_rows(path):
    """The first 40 training rows and crafted ones: every table's bag empty; a repeated id;
    padding between the ids; the padding ids -1 and -7 (any negative id is padding). Returns
    (dense [rows, DENSE] float32, {table: list of bags}) with the bags as lists of ids, padding
    included (the reference skips it)."""
    dense, bags = read_csr(path)
    rows = 40
    dense = dense[:rows]
    out = {name: [list(b) for b in bags[name][:rows]] for name in TABLES}
    crafted = {
        "one": [[], [3], [-1, 10], [0], [-7]],
        "bags": [[], [2, 2, 2], [-1, 5, -1, 5, 9], [], [1, 8, 3, 0, 4, 7]],  # 6 > 4 ids: wider
        "avg": [[], [1, 1, 4], [5], [-1, -1, 2, -7, 2], []],
    }
    rng = np.random.default_rng(11)
    extra = rng.normal(size=(len(crafted["one"]), DENSE)).astype(np.float32)
    extra[0] = 0.0  # an all-zero dense row and empty bags everywhere
    for name in TABLES:
        out[name] += crafted[name]
    return np.concatenate([dense, extra]), out


def fixed_width(bags, pad=-1):
    """The bags as an int64 [rows, k] array padded with `pad`, k one more than the largest bag
    (every row has padding), at least 1."""
    width = max(len(b) for b in bags) + 1
    ids = np.full((len(bags), width), pad, np.int64)
    for r, b in enumerate(bags):
        ids[r, :len(b)] = b
    return ids


# --- the float64 reference (docs/model_math.md, "DLRM") -------------------------------------

def pooled(table, bags, pooling):
    """EmbeddingBag: the sum of the rows of each bag's ids (negative ids skipped), mean: / the
    count of real ids; an empty bag is 0."""
    out = np.zeros((len(bags), table.shape[1]))
    for r, bag in enumerate(bags):
        real = [i for i in bag if i >= 0]
        if real:
            out[r] = table[real].sum(axis=0)
            if pooling == "mean":
                out[r] /= len(real)
    return out


def dlrm_forward(ckpt, dense, bags, dtype="fp32"):
    """{logit, probability} in float64 from the checkpoint's parameters (rounded as the export
    rounds them for fp16 / bf16)."""
    model = ckpt["config"]["model"]
    p = et.round_weights(ckpt["params"], dtype)
    act = model.get("activation", "relu")
    z = dense.astype(np.float64)
    for i in range(len(model["bottom"]) - 1):
        z = et.activation(act, z @ p["bottom/%d/weight" % i] + p["bottom/%d/bias" % i])
    features = [z]
    for t in model["tables"]:
        features.append(pooled(p["embeddings/%s/weight" % t["name"]], bags[t["name"]],
                               t.get("pooling", "sum")))
    if model.get("interaction", "dot") == "cat":
        h = np.concatenate(features, axis=1)
    else:
        pairs = [np.sum(features[i] * features[j], axis=1)
                 for i in range(1, len(features)) for j in range(i)]
        h = np.concatenate([z, np.stack(pairs, axis=1)], axis=1)
    top = model["top"]
    for i in range(len(top) - 1):
        h = h @ p["top/%d/weight" % i] + p["top/%d/bias" % i]
        if i < len(top) - 2:
            h = et.activation(act, h)
    return {"logit": h, "probability": et.numpy_reference.sigmoid(h)}


# --- training, export, ONNX Runtime ----------------------------------------------------------

def train(ctx, name, data, ranks, tables, interaction="dot", top_hidden=8, steps=6,
          data_lines=(), partition_lines=(), mesh_lines=None, model_lines=(),
          optimizer_lines=()):
    out = os.path.join(ctx.work, name)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    dims = sum(t.get("dim", BOTTOM[-1]) for t in tables)
    width = (BOTTOM[-1] + len(tables) * (len(tables) + 1) // 2 if interaction == "dot"
             else BOTTOM[-1] + dims)
    lines = [
        "[run]", 'name = "%s"' % name, "seed = 5", 'output_dir = "%s"' % out,
        "[mesh]", *(mesh_lines or ["fsdp = %d" % ranks]),
        "[partition]", 'preset = "fsdp"', "min_sharding_size = 0", *partition_lines,
        "[model]", 'kind = "dlrm"', "bottom = %s" % BOTTOM,
        "top = [%d, %d, 1]" % (width, top_hidden), 'interaction = "%s"' % interaction,
        *model_lines,
    ]
    for t in tables:
        lines.append("[[model.tables]]")
        lines += ["%s = %s" % (k, et.toml_value(v)) for k, v in t.items()]
    lines += [
        "[data]", 'source = "hdf5"', 'path = "%s"' % data, 'x_key = "/dense"',
        'y_key = "/label"', "batch_size = 32", *data_lines,
        "[optimizer]", 'kind = "adamw"', "lr = 0.05", *optimizer_lines,
        "[train]", "steps = %d" % steps, "log_every = %d" % steps,
        "[checkpoint]", "keep = 1",
    ]
    config = os.path.join(out, "config.toml")
    with open(config, "w") as f:
        f.write("\n".join(lines) + "\n")
    et.run_ok(ctx.mpiexec[:1] + ["-n", str(ranks)] + ctx.mpiexec[1:] +
              [ctx.meshtrain, "train", config], timeout=90)
    return os.path.join(out, "checkpoints")


def run_ort(ctx, model_path, dense, ids):
    """ORT's outputs {name: array} for the inputs 'dense' and 'sparse/<t>'; None when ONNX
    Runtime cannot be installed."""
    module = ctx.ort_module()
    if module is None:
        return None
    work = tempfile.mkdtemp(dir=ctx.work)
    inputs = [{"name": "dense", "type": "float32", "dims": list(dense.shape),
               "file": os.path.join(work, "dense.bin")}]
    np.ascontiguousarray(dense, dtype="<f4").tofile(inputs[0]["file"])
    for name, array in ids.items():
        file = os.path.join(work, "ids_%s.bin" % name)
        np.ascontiguousarray(array, dtype="<i8").tofile(file)
        inputs.append({"name": "sparse/" + name, "type": "int64", "dims": list(array.shape),
                       "file": file})
    listing_file = os.path.join(work, "inputs.json")
    with open(listing_file, "w") as f:
        json.dump(inputs, f)
    script = os.path.join(ctx.source_dir, "tests", "export", "run_onnx_inputs.js")
    et.run_ok(["node", script, module, model_path, listing_file, work])
    with open(os.path.join(work, "outputs.json")) as f:
        listing = json.load(f)
    print("ONNX Runtime %s" % listing["onnxruntime_version"])
    outputs = {name: np.fromfile(os.path.join(work, info["file"]), dtype="<f4")
               .reshape(info["dims"]) for name, info in listing["outputs"].items()}
    shutil.rmtree(work)
    return outputs


def export_and_compare(ctx, checkpoint, data, label, dtypes=("fp32",)):
    """Exports the checkpoint in each dtype, checks the file and its metadata, and holds ONNX
    Runtime's logit and probability to the float64 forward. Returns the fp32 file's path."""
    ckpt = et.read_checkpoint(et.latest_file(checkpoint))
    dense, bags = test_rows(data)
    ids = {name: fixed_width(b, pad=-1) for name, b in bags.items()}
    first = None
    for dtype in dtypes:
        path = et.export(ctx, checkpoint, os.path.join(ctx.work, "%s_%s.onnx" % (label, dtype)),
                         dtype)
        first = first or path
        model = et.check_onnx(ctx, path)
        meta = {p.key: p.value for p in model.metadata_props}
        ctx.check(meta.get("step") == str(ckpt["step"]), "%s: metadata step %r, expected %d" %
                  (path, meta.get("step"), ckpt["step"]))
        ctx.check(meta.get("weights_dtype") == dtype, "%s: metadata weights_dtype %r" %
                  (path, meta.get("weights_dtype")))
        ctx.check(meta.get("outputs") == "logit, probability", "%s: metadata outputs %r" %
                  (path, meta.get("outputs")))
        ctx.check(tomllib.loads(meta.get("config", "")) == ckpt["config"],
                  "%s: metadata config is not the checkpoint's" % path)
        names = [i.name for i in model.graph.input]
        expected = ["dense"] + ["sparse/" + t["name"] for t in ckpt["config"]["model"]["tables"]]
        ctx.check(names == expected, "%s: inputs %s, expected %s" % (path, names, expected))
        got = run_ort(ctx, path, dense, ids)
        if got is None:
            continue
        ref = dlrm_forward(ckpt, dense, bags, dtype)
        et.compare(ctx, "%s %s vs float64 forward (weights as exported)" % (label, dtype), got,
                   ref, et.FP32_RTOL)
        # The test must be able to fail: a reference that pools the padding as row 0 is off.
        wrong = dlrm_forward(ckpt, dense, {n: [[max(i, 0) for i in bag] for bag in b]
                                           for n, b in bags.items()}, dtype)
        err = et.relative_error(got["logit"], wrong["logit"])
        ctx.check(err > 100 * et.FP32_RTOL, "%s %s: padding read as row 0 gives logits within "
                  "%.3g of ONNX Runtime's: the rows do not test padding" % (label, dtype, err))
        # Bags of another width give the same result (the width is a symbolic dimension).
        wider = {n: np.concatenate([a, np.full((a.shape[0], 3), -1, np.int64)], axis=1)
                 for n, a in ids.items()}
        again = run_ort(ctx, path, dense, wider)
        ctx.check(et.relative_error(again["logit"], got["logit"]) <= et.FP32_RTOL,
                  "%s %s: three more padding ids per bag changed the logits" % (label, dtype))
    return first, ckpt


def case_dot(ctx):
    data = write_dlrm_data(os.path.join(ctx.work, "train.h5"))
    tables = [{"name": n, "rows": rows, "pooling": pooling}
              for n, (rows, _, pooling) in TABLES.items()]
    checkpoints = {}
    for ranks in (1, 2):
        checkpoints[ranks] = train(ctx, "dot_np%d" % ranks, data, ranks, tables)
        dtypes = ("fp32",) if ranks == 1 else ("fp32", "fp16", "bf16")
        path, ckpt = export_and_compare(ctx, checkpoints[ranks], data, "dot_np%d" % ranks, dtypes)
    import onnx
    ops = {n.op_type for n in onnx.load(path).graph.node}
    for op in ("Gather", "ReduceSum", "MatMul", "Sigmoid", "Div"):
        ctx.check(op in ops, "dot graph has no %s node (ops: %s)" % (op, sorted(ops)))
    allowed = {"Gather", "ReduceSum", "MatMul", "Add", "Relu", "Sigmoid", "Div", "Max",
               "GreaterOrEqual", "Cast", "Unsqueeze", "Mul", "Concat", "Transpose", "Flatten"}
    ctx.check(ops <= allowed, "dot graph has unexpected ops %s" % sorted(ops - allowed))
    # The printed line names every input.
    status, out, err = et.run([ctx.meshtrain, "export", checkpoints[1], "--format", "onnx",
                               "--output", os.path.join(ctx.work, "printed.onnx")])
    ctx.check(status == 0 and "inputs 'dense', 'sparse/one', 'sparse/bags', 'sparse/avg', "
              "outputs logit, probability" in out, "export's line %r (status %d, %s)" %
              (out, status, err))


def case_cat(ctx):
    data = write_dlrm_data(os.path.join(ctx.work, "train.h5"))
    dims = {"one": 3, "bags": 5, "avg": 2}
    tables = [{"name": n, "rows": rows, "dim": dims[n], "pooling": pooling}
              for n, (rows, _, pooling) in TABLES.items()]
    checkpoint = train(ctx, "cat_np2", data, 2, tables, interaction="cat")
    export_and_compare(ctx, checkpoint, data, "cat_np2", ("fp32", "fp16"))


def write_predict_input(path, dense, bags, bad=None):
    """An input file laid out as the training data, without labels: /dense and each table's CSR
    (padding ids dropped: a CSR bag holds its ids only). bad = (table, row, id): that row's
    bag of that table gets the id too."""
    with h5py.File(path, "w") as f:
        f["dense"] = dense
        for name, (table_rows, _, _) in TABLES.items():
            rows = [[i for i in bag if i >= 0] for bag in bags[name]]
            if bad and bad[0] == name:
                rows[bad[1]] = rows[bad[1]] + [bad[2]]
            group = f.create_group("sparse/" + name)
            group["values"] = np.array([i for r in rows for i in r], np.int64)
            group["offsets"] = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)
            group.attrs["rows"] = np.int64(table_rows)
    return path


def predict(ctx, checkpoint, input_path, output, ranks, extra=None):
    """`meshtrain predict` on `ranks` ranks; `extra` replaces the default batch and mesh
    options (--batch-size 8 on fsdp = ranks)."""
    options = ["--batch-size", "8", "--set", "mesh.fsdp=%d" % ranks] if extra is None else extra
    cmd = (ctx.mpiexec[:1] + ["-n", str(ranks)] + ctx.mpiexec[1:] +
           [ctx.meshtrain, "predict", checkpoint, "--input", input_path, "--output", output] +
           list(options))
    return et.run(cmd, timeout=90)


def check_refused(ctx, label, result, expected, output):
    """Exit 2, one error line holding `expected`, no output left."""
    status, out, err = result
    lines = [l for l in err.splitlines() if l.startswith("meshtrain: error:")]
    ctx.check(status == 2 and len(lines) == 1 and expected in lines[0],
              "%s: status %d, errors %s (expected %r)" % (label, status, lines, expected))
    ctx.check(not os.path.exists(output) and not os.path.exists(output + ".tmp"),
              "%s left %s behind" % (label, output))


def case_predict(ctx):
    """`meshtrain predict` of a DLRM checkpoint (trained on 2 ranks with data.eval_batch_size
    set, two tables row-wise) on 1, 2 and 4 ranks (row-wise over 2 and 4: their rows divide),
    in batches of --batch-size 8 (the last one partial); on 3 ranks (fsdp 3) in the default
    batch (32 rounded up to 33, a multiple of the 3 batch shards); on fsdp 2 x tp 2 (tp
    partners hold the same rows: one of each pair writes): /prediction (the probability) and
    /logit against the float64 forward to 1e-5, a progress line; --flight-dir starts the
    recorder there. A checkpoint of bf16 tables (model.table_dtype = "bf16", its tables uint16
    with dtype = "bf16") predicted on 1 and 2 ranks against the float64 forward of its widened
    values, to the same 1e-5. Refused, exit 2, one sentence, no output left: an id outside its table
    (naming the table, the file and the row), --jacobian, two --input files, a mesh that does
    not fit the ranks, a --batch-size the batch shards do not divide (naming --batch-size)."""
    data = write_dlrm_data(os.path.join(ctx.work, "train.h5"))
    tables = [{"name": n, "rows": rows, "pooling": pooling}
              for n, (rows, _, pooling) in TABLES.items()]
    checkpoint = train(ctx, "predict_np2", data, 2, tables, data_lines=["eval_batch_size = 32"])
    ckpt = et.read_checkpoint(et.latest_file(checkpoint))
    dense, bags = test_rows(data)
    ref = dlrm_forward(ckpt, dense, bags)
    input_path = write_predict_input(os.path.join(ctx.work, "input.h5"), dense, bags)
    flight = os.path.join(ctx.work, "flight_records")
    os.makedirs(os.path.join(flight, "flight"), exist_ok=True)
    stale = os.path.join(flight, "flight", "rank-5.json")
    with open(stale, "w") as f:
        f.write("stale\n")
    runs = [(ranks, "np%d" % ranks, None) for ranks in (1, 2, 4)]
    runs += [(3, "np3_default_batch", ["--set", "mesh.fsdp=3"]),
             (4, "np4_fsdp2_tp2", ["--batch-size", "8", "--set", "mesh.fsdp=2", "--set",
                                   "mesh.tp=2", "--flight-dir", flight])]
    for ranks, label, extra in runs:
        output = os.path.join(ctx.work, "prediction_%s.h5" % label)
        status, out, err = predict(ctx, checkpoint, input_path, output, ranks, extra)
        if not ctx.check(status == 0, "predict %s: status %d, %s" % (label, status, err)):
            continue
        rows = len(dense)
        ctx.check("predict: %d/%d rows (100.0%%)" % (rows, rows) in out,
                  "predict %s printed no final progress line: %r" % (label, out))
        with h5py.File(output, "r") as f:
            got = {"probability": f["prediction"][()], "logit": f["logit"][()]}
            ctx.check(int(f.attrs["step"]) == ckpt["step"], "predict: step attribute %r" %
                      f.attrs["step"])
        et.compare(ctx, "meshtrain predict %s vs float64 forward" % label, got, ref,
                   et.FP32_RTOL)
    ctx.check(not os.path.exists(stale), "predict --flight-dir: the recorder did not start in %s"
              % os.path.join(flight, "flight"))
    # bf16 tables (model.table_dtype = "bf16", row-wise Adagrad): the checkpoint's tables are
    # uint16 bits, widened for the float64 forward; predicted on 1 and 2 ranks (row-wise).
    bf16_checkpoint = train(ctx, "predict_bf16_np2", data, 2, tables,
                            model_lines=['table_dtype = "bf16"'],
                            optimizer_lines=['embeddings = "rowwise_adagrad"'])
    bf16_ckpt = et.read_checkpoint(et.latest_file(bf16_checkpoint))
    with h5py.File(et.latest_file(bf16_checkpoint), "r") as f:
        weight = f["params/embeddings/%s/weight" % next(iter(TABLES))]
        ctx.check(weight.dtype == np.uint16 and weight.attrs.get("dtype") in ("bf16", b"bf16"),
                  "bf16 tables saved as %s, dtype attribute %r" % (weight.dtype,
                                                                  weight.attrs.get("dtype")))
    bf16_ref = dlrm_forward(bf16_ckpt, dense, bags)
    for ranks in (1, 2):
        output = os.path.join(ctx.work, "prediction_bf16_np%d.h5" % ranks)
        status, out, err = predict(ctx, bf16_checkpoint, input_path, output, ranks)
        if not ctx.check(status == 0, "predict bf16 np %d: status %d, %s" % (ranks, status, err)):
            continue
        with h5py.File(output, "r") as f:
            got = {"probability": f["prediction"][()], "logit": f["logit"][()]}
        et.compare(ctx, "meshtrain predict of bf16 tables np %d vs float64 forward" % ranks, got,
                   bf16_ref, et.FP32_RTOL)
    refused = os.path.join(ctx.work, "refused.h5")
    check_refused(ctx, "predict --jacobian",
                  predict(ctx, checkpoint, input_path, refused, 1, ["--jacobian"]),
                  "--jacobian: checkpoint '", refused)
    check_refused(ctx, "predict of two --input files",
                  predict(ctx, checkpoint, input_path, refused, 1,
                          ["--input", input_path]),
                  "--input names 2 files; a model.kind = \"dlrm\" checkpoint predicts the rows "
                  "of one file", refused)
    check_refused(ctx, "predict on a mesh that does not fit",
                  predict(ctx, checkpoint, input_path, refused, 2, ["--set", "mesh.fsdp=3"]),
                  "a DLRM predicts on the checkpoint config's mesh: start it on that many ranks, "
                  "or give it another with --set mesh.AXIS=SIZE", refused)
    check_refused(ctx, "predict --batch-size 7 on 2 batch shards",
                  predict(ctx, checkpoint, input_path, refused, 2,
                          ["--batch-size", "7", "--set", "mesh.fsdp=2"]),
                  "--batch-size = 7 is not divisible by k = 2, the number of batch shards", refused)
    bad = os.path.join(ctx.work, "bad.h5")
    write_predict_input(bad, dense, bags, bad=("avg", 41, 8))
    output = os.path.join(ctx.work, "bad_prediction.h5")
    for ranks in (1, 2):
        check_refused(ctx, "predict of a bad id on %d ranks" % ranks,
                      predict(ctx, checkpoint, bad, output, ranks),
                      "sparse data file '%s', table 'avg', global row 41: id 8 is outside the "
                      "table's rows [0, 8)" % bad, output)


def write_tool_input(folder, dense, bags, bad=None):
    """DlrmPredictor's input for tests/predict/dlrm_predictor_tool.cpp: shape.txt, dense.bin and
    per table (TABLES' order) offsets_<t>.bin, ids_<t>.bin (padding ids dropped). bad = (table,
    row, id) as write_predict_input's."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "shape.txt"), "w") as f:
        f.write("%d %d %d\n" % (dense.shape[0], dense.shape[1], len(TABLES)))
    np.ascontiguousarray(dense, "<f4").tofile(os.path.join(folder, "dense.bin"))
    for t, name in enumerate(TABLES):
        rows = [[i for i in bag if i >= 0] for bag in bags[name]]
        if bad and bad[0] == name:
            rows[bad[1]] = rows[bad[1]] + [bad[2]]
        np.array([i for r in rows for i in r], "<i8").tofile(
            os.path.join(folder, "ids_%d.bin" % t))
        np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype("<i8").tofile(
            os.path.join(folder, "offsets_%d.bin" % t))
    return folder


def run_tool(ctx, checkpoint, folder, output, *options, env=None, ranks=None):
    """The tool on one process, or started on `ranks` ranks by the launcher (each rank its own
    predictor on MPI_COMM_SELF, its own OUTPUT.<rank>); env: added to the environment."""
    launch = [] if ranks is None else ctx.mpiexec[:1] + ["-n", str(ranks)] + ctx.mpiexec[1:]
    return script_test.run(launch + [ctx.predictor_tool, checkpoint, folder, output] +
                           [str(o) for o in options], 60, env_extra=env)


EMULATED = {"MESHTRAIN_EMULATE_DEVICE_MEMORY": "1"}  # host memory treated as a GPU's


def case_predictor(ctx):
    """meshtrain::DlrmPredictor (run/dlrm_predictor.hpp) on one rank, through
    tests/predict/dlrm_predictor_tool.cpp, of checkpoints trained on 2 ranks (fsdp 2: `bags`
    and `avg` row-wise) and on 4 (fsdp 4: `bags` row-wise, `one` and `avg` table-wise by a
    P(fsdp@table) rule) and on 2 (tp 2: `bags` and `avg` column-wise by a P(None, tp) rule): the
    rows of test_rows (empty bags in every table, repeated ids, a row
    of nothing but empty bags) in calls of 8 rows (the last partial; the forms predict(dense,
    bags) and predict(dense, bags, y) alternating) and in one call of the checkpoint's batch.
    The logits and probabilities within 1e-5 (export_test.py's relative error) of the float64
    forward and of `meshtrain predict` on one rank of the same rows; no heap or Kokkos
    allocation in any call, the first included; with device memory emulated
    (MESHTRAIN_EMULATE_DEVICE_MEMORY=1: the host <-> model copies run) the same values bit for
    bit and the same allocation counts; the tool started on 2 ranks (each its own predictor on
    MPI_COMM_SELF) gives each rank the values of one process bit for bit; --set
    runtime.matmul_precision="tf32" honoured. Refused in one sentence, exit 2: mesh.* and
    mixed_precision.* overrides (naming the key), a dense
    (model.kind = "mlp") checkpoint, an id outside its table (naming the table, the row and
    the id), dense rows of 5 features, more ids than max_ids, more rows than the batch, the bags
    of 2 tables of 3, decreasing offsets; and
    meshtrain::Predictor refuses the DLRM checkpoint, naming DlrmPredictor."""
    data = write_dlrm_data(os.path.join(ctx.work, "train.h5"))
    tables = [{"name": n, "rows": rows, "pooling": pooling}
              for n, (rows, _, pooling) in TABLES.items()]
    dense, bags = test_rows(data)
    rows = len(dense)
    folder = write_tool_input(os.path.join(ctx.work, "input"), dense, bags)
    input_path = write_predict_input(os.path.join(ctx.work, "input.h5"), dense, bags)
    checkpoints = {
        "np2_rowwise": train(ctx, "predictor_np2", data, 2, tables),
        "np4_tablewise": train(ctx, "predictor_np4", data, 4, tables, partition_lines=[
            'rules = [["embeddings/(one|avg)/weight", "P(fsdp@table)"]]']),
        "np2_columnwise": train(ctx, "predictor_tp2", data, 2, tables,
                                mesh_lines=["fsdp = 1", "tp = 2"], partition_lines=[
                                    'rules = [["embeddings/(bags|avg)/weight", "P(None, tp)"]]']),
    }
    with h5py.File(et.latest_file(checkpoints["np2_columnwise"]), "r") as f:
        specs = {n: f["params/embeddings/%s/weight" % n].attrs["spec"] for n in ("bags", "avg")}
    ctx.check(all(spec in (b"P(None, tp)", "P(None, tp)") for spec in specs.values()),
              "the tp 2 checkpoint's tables are not column-wise: %s" % specs)
    output = os.path.join(ctx.work, "tool.bin")

    def tool_result(what, ckpt, status, out, err, path):
        """The tool's (values, info) after its checks (rows, step, no allocation); None when
        it failed."""
        if not ctx.check(status == 0, "%s: status %d, %s" % (what, status, err)):
            return None
        info = json.loads(out.strip().splitlines()[-1])
        print("%s: %s" % (what, info))
        ctx.check(info["rows"] == rows and info["step"] == ckpt["step"], "%s: %s" % (what, info))
        ctx.check(info["heap_allocations"] == 0 and info["kokkos_allocations"] == 0,
                  "%s: allocations in the calls: %s" % (what, info))
        values = np.fromfile(path, "<f4")
        return {"logit": values[:rows, None], "probability": values[rows:, None]}, info

    for label, checkpoint in checkpoints.items():
        ckpt = et.read_checkpoint(et.latest_file(checkpoint))
        ref = dlrm_forward(ckpt, dense, bags)
        predicted = os.path.join(ctx.work, "predict_%s.h5" % label)
        one_rank = ["--batch-size", "8", "--set", "mesh.tp=1"] if label == "np2_columnwise" \
            else None
        status, out, err = predict(ctx, checkpoint, input_path, predicted, 1, one_rank)
        if not ctx.check(status == 0, "predict %s: status %d, %s" % (label, status, err)):
            continue
        with h5py.File(predicted, "r") as f:
            command = {"probability": f["prediction"][()], "logit": f["logit"][()]}
        for options in (["--batch", 8, "--max-ids", 64], ["--max-ids", 200]):
            what = "DlrmPredictor %s %s" % (label, " ".join(map(str, options)))
            result = tool_result(what, ckpt, *run_tool(ctx, checkpoint, folder, output, *options),
                                 output)
            if result is None:
                continue
            got, info = result
            et.compare(ctx, "%s vs float64 forward" % what, got, ref, et.FP32_RTOL)
            et.compare(ctx, "%s vs meshtrain predict" % what, got, command, et.FP32_RTOL)
            # Device memory emulated: the copies between the host and the model's memory run,
            # and give the same values bit for bit (the same kernels on the same inputs), with
            # the same (zero) allocations. In calls of 8 rows only (partial calls, both forms
            # of predict): the test's time.
            if options[0] != "--batch":
                continue
            emulated = tool_result(what + " (emulated device memory)", ckpt,
                                   *run_tool(ctx, checkpoint, folder, output, *options,
                                             env=EMULATED), output)
            if emulated is not None:
                ctx.check(all(np.array_equal(emulated[0][k], got[k]) for k in got),
                          "%s: the values differ with device memory emulated" % what)
                ctx.check(emulated[1]["heap_allocations"] == info["heap_allocations"] and
                          emulated[1]["kokkos_allocations"] == info["kokkos_allocations"],
                          "%s: allocations %s emulated, %s not" % (what, emulated[1], info))

    # Two ranks of one program, each with its own predictor on MPI_COMM_SELF: the same values
    # on both, bit for bit as on one process.
    checkpoint = checkpoints["np2_rowwise"]
    ckpt = et.read_checkpoint(et.latest_file(checkpoint))
    single = tool_result("DlrmPredictor on one process", ckpt,
                         *run_tool(ctx, checkpoint, folder, output, "--max-ids", 200), output)
    status, out, err = run_tool(ctx, checkpoint, folder, output, "--max-ids", 200, ranks=2)
    for rank in range(2):
        lines = [l for l in out.strip().splitlines() if l.startswith("{")]
        got = tool_result("DlrmPredictor on rank %d of 2" % rank, ckpt, status,
                          lines[rank] if len(lines) == 2 else "", err,
                          "%s.%d" % (output, rank))
        if got is not None and single is not None:
            ctx.check(all(np.array_equal(got[0][k], single[0][k]) for k in got[0]),
                      "DlrmPredictor on rank %d of 2 differs from one process" % rank)

    # Overrides: runtime.matmul_precision honoured (as by Predictor), mesh.* and
    # mixed_precision.* refused naming the key.
    matmul = tool_result("DlrmPredictor --set runtime.matmul_precision", ckpt,
                         *run_tool(ctx, checkpoint, folder, output, "--max-ids", 200, "--set",
                                   'runtime.matmul_precision="tf32"'), output)
    if matmul is not None:
        ctx.check(matmul[1]["matmul_precision"] == "tf32",
                  "runtime.matmul_precision = tf32 not honoured: %s" % matmul[1])
    if single is not None:
        ctx.check(single[1]["matmul_precision"] == "fp32",
                  "the default matmul precision is not fp32: %s" % single[1])

    def refused(what, result, expected):
        status, out, err = result
        lines = [l for l in err.splitlines() if l.startswith("error:")]
        ctx.check(status == 2 and len(lines) == 1 and expected in lines[0],
                  "%s: status %d, errors %s (expected %r)" % (what, status, lines, expected))

    output = os.path.join(ctx.work, "refused.bin")
    refused("an override of mesh.fsdp",
            run_tool(ctx, checkpoint, folder, output, "--max-ids", 200, "--set", "mesh.fsdp=2"),
            "DlrmPredictor: the override of mesh.fsdp is refused: the model is whole on this "
            "rank, every mesh axis at size 1, whatever the override says")
    refused("an override of mixed_precision.param_dtype",
            run_tool(ctx, checkpoint, folder, output, "--max-ids", 200, "--set",
                     'mixed_precision.param_dtype="bf16"'),
            "DlrmPredictor: the override of mixed_precision.param_dtype is refused: a DLRM "
            "predicts in fp32, as it trains, whatever the override says")
    bad = write_tool_input(os.path.join(ctx.work, "bad"), dense, bags, bad=("avg", 41, 8))
    refused("an id outside its table",
            run_tool(ctx, checkpoint, bad, output, "--batch", 48, "--max-ids", 200),
            "DlrmPredictor::predict: table 'avg', row 41: id 8 is outside the table's rows [0, 8)")
    wide = write_tool_input(os.path.join(ctx.work, "wide"),
                            np.concatenate([dense, dense[:, :1]], axis=1), bags)
    refused("5 dense features", run_tool(ctx, checkpoint, wide, output, "--max-ids", 200),
            "DlrmPredictor::predict: the dense view has 5 features per row but the model takes "
            "4 (model.bottom[0])")
    refused("more ids than max_ids", run_tool(ctx, checkpoint, folder, output),
            "ids in one call, more than the max_ids of 32 the predictor was made for")
    refused("more rows than the batch",
            run_tool(ctx, checkpoint, folder, output, "--batch", 8, "--call-rows", 9),
            "DlrmPredictor::predict: the dense view has 9 rows, more than the batch size of 8")
    refused("the bags of 2 tables of 3",
            run_tool(ctx, checkpoint, folder, output, "--max-ids", 200, "--tables-given", 2),
            "DlrmPredictor::predict: 2 tables' bags given but the model has 3 tables")
    decreasing = write_tool_input(os.path.join(ctx.work, "decreasing"), dense, bags)
    offsets_file = os.path.join(decreasing, "offsets_1.bin")  # table `bags`
    offsets = np.fromfile(offsets_file, "<i8")
    row = int(np.flatnonzero(np.diff(offsets) > 0)[0])  # a non-empty bag: lower its end
    offsets[row + 1] = offsets[row] - 1
    offsets.tofile(offsets_file)
    refused("decreasing offsets",
            run_tool(ctx, checkpoint, decreasing, output, "--batch", 48, "--max-ids", 200),
            "DlrmPredictor::predict: table 'bags': offsets[%d] = %d is below offsets[%d] = %d "
            "(the offsets must not decrease)" % (row + 1, offsets[row + 1], row, offsets[row]))
    refused("meshtrain::Predictor of a DLRM",
            run_tool(ctx, checkpoint, folder, output, "--dense-predictor", 1),
            "describes a model.kind = \"dlrm\" model, which meshtrain::Predictor does not build: "
            "meshtrain::DlrmPredictor (run/dlrm_predictor.hpp) predicts with it")
    mlp_data = os.path.join(ctx.work, "mlp.h5")
    et.write_data(mlp_data, "regression")
    mlp = et.train(ctx, "mlp", mlp_data, [et.FEATURES, 8, 2], "relu", "mse")
    refused("a dense checkpoint", run_tool(ctx, mlp, folder, output),
            "holds a model.kind = \"mlp\" model; DlrmPredictor reads model.kind = \"dlrm\" "
            "checkpoints only (meshtrain::Predictor reads the others)")


CASES = {"dot": case_dot, "cat": case_cat, "predict": case_predict,
         "predictor": case_predictor}
ONNX_CASES = ("dot", "cat")  # the cases that run ONNX Runtime


def main():
    # export_test.Context's --predict option (its cases' `meshtrain predict` comparison) is
    # not this script's: case_predict runs `meshtrain predict` itself.
    def no_predict(parser):
        parser.set_defaults(predict=False)
        parser.add_argument("--predictor-tool", default=None,
                            help="tests/predict/dlrm_predictor_tool.cpp's program (case predictor)")

    def make_context(args):
        ctx = et.Context(args)
        ctx.predictor_tool = args.predictor_tool
        return ctx
    # Only the ONNX cases need ONNX Runtime: the others never report skipped for its lack.
    onnx_case = sys.argv[1:2] and sys.argv[1] in ONNX_CASES
    return script_test.case_main(CASES, make_context, add_arguments=no_predict,
                                 skip_reason=lambda ctx: ctx.ort_missing if onnx_case else None,
                                 skip_needs="ONNX Runtime")


if __name__ == "__main__":
    sys.exit(main())
