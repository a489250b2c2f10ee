#!/usr/bin/env python3
"""docs/model_math.md as code: reproduce a trained run's evaluation and `meshtrain predict`'s
outputs from the checkpoint alone, in float64 with numpy and h5py.

  reproduce.py WORKDIR CASE -- MPIRUN... MESHTRAIN

CASE: "classification" (gelu, 7 classes, an MoE layer), "regression" (silu, 3 outputs),
"residual_classification" (kind = "residual_mlp", layernorm, swiglu, 7 classes, on fsdp x tp)
or "residual_regression" (residual_mlp, rmsnorm, silu, 3 outputs, normalized targets;
docs/models.md).
Writes HDF5 data and a config into WORKDIR, trains there with the given launcher
(`mpirun -np 2 .../meshtrain` or just `.../meshtrain`), then:
  - recomputes the last evaluation's test loss (and accuracy) from the checkpoint's
    /params, /normalization and config, following the page, and compares it with the last
    eval line of metrics.jsonl to 1e-5 relative;
  - runs `meshtrain predict` on the test inputs and compares /prediction (and /class,
    /probability) with the same forward to 1e-5 relative.
Exit 0 when everything agrees, 1 with the first difference (or the first command that fails,
`meshtrain predict` included) otherwise, 77 (skip) when numpy or h5py is missing.
"""
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
try:
    import h5py
    import numpy as np
    import numpy_reference  # the activations and softmax (tests/support/numpy_reference.py)
except ImportError as missing:  # scripts/setup installs python3-numpy and python3-h5py
    print(f"SKIP: {missing}")
    sys.exit(77)

TOLERANCE = 1e-5  # relative, float32 computation against float64


def fail(message):
    print(f"FAIL: {message}")
    sys.exit(1)


def close(a, b, what):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    scale = max(np.max(np.abs(b)), 1e-30)
    err = np.max(np.abs(a - b)) / scale
    if not err <= TOLERANCE:
        fail(f"{what}: relative difference {err:.3g} > {TOLERANCE}")
    print(f"ok: {what} (relative difference {err:.2g})")


# --- the page ------------------------------------------------------------------------------
activation = numpy_reference.activation
softmax = numpy_reference.softmax


def moe(params, i, top_k, h):
    p = softmax(h @ params[f"layers/{i}/router/weight"])
    # top_k largest, ties to the lower expert index: a stable sort of -p
    chosen = np.argsort(-p, axis=1, kind="stable")[:, :top_k]
    w = params[f"layers/{i}/experts/weight"]
    b = params[f"layers/{i}/experts/bias"]
    out = np.zeros((h.shape[0], w.shape[2]))
    for row in range(h.shape[0]):
        gates = p[row, chosen[row]] / p[row, chosen[row]].sum()
        for g, e in zip(gates, chosen[row]):
            out[row] += g * (h[row] @ w[e] + b[e])
    return out


def norm_layer(kind, params, name, h):
    """docs/models.md: LayerNorm (eps 1e-5) or RMSNorm (eps 2^-23) over the features."""
    scale = params[f"{name}/scale"]
    if kind == "layernorm":
        mean = h.mean(axis=1, keepdims=True)
        var = ((h - mean) ** 2).mean(axis=1, keepdims=True)
        return (h - mean) / np.sqrt(var + 1e-5) * scale + params[f"{name}/bias"]
    return h / np.sqrt((h ** 2).mean(axis=1, keepdims=True) + 2.0 ** -23) * scale


def residual_forward(model, params, h):
    """kind = "residual_mlp" (docs/models.md), pre-norm."""
    norm = model.get("norm", "rmsnorm")
    act = model["activation"]
    h = h @ params["input/weight"] + params["input/bias"]
    for i in range(model["depth"]):
        b = f"blocks/{i}"
        u = norm_layer(norm, params, f"{b}/norm", h) if norm != "none" else h
        value = u @ params[f"{b}/up/weight"] + params[f"{b}/up/bias"]
        if act == "swiglu":
            gate = u @ params[f"{b}/gate/weight"] + params[f"{b}/gate/bias"]
            a = activation("silu", gate) * value
        else:
            a = activation(act, value)
        h = h + a @ params[f"{b}/down/weight"] + params[f"{b}/down/bias"]
    if norm != "none":
        h = norm_layer(norm, params, "output_norm", h)
    return h @ params["output/weight"] + params["output/bias"]


def forward(checkpoint, x):
    """The model's output in normalized units, and the normalization (or None)."""
    with h5py.File(checkpoint, "r") as f:
        config = parse_toml(f.attrs["config"])
        params = {}
        f["params"].visititems(
            lambda name, obj: params.__setitem__(name, obj[()].astype(np.float64))
            if isinstance(obj, h5py.Dataset) else None)
        norm = {k: f["normalization"][k][()] for k in f["normalization"]} \
            if "normalization" in f else {}
    model = config["model"]
    h = x.astype(np.float64)
    if "input_mean" in norm:
        h = (h - norm["input_mean"]) / norm["input_std"]
    if model.get("kind", "mlp") == "residual_mlp":
        return residual_forward(model, params, h), norm
    sizes = model["sizes"]
    moe_layers = set(model.get("moe_layers", []))
    for i in range(len(sizes) - 1):
        if i in moe_layers:
            z = moe(params, i, model.get("top_k", 2), h)
        else:
            z = h @ params[f"layers/{i}/weight"] + params[f"layers/{i}/bias"]
        h = activation(model["activation"], z) if i < len(sizes) - 2 else z
    return h, norm


def parse_toml(text):
    if isinstance(text, bytes):
        text = text.decode()
    try:
        import tomllib
    except ImportError:
        import tomli as tomllib  # Python < 3.11
    return tomllib.loads(text)


# --- the run -------------------------------------------------------------------------------
def write_data(workdir, case, rng):
    classification = case.endswith("classification")
    features = 12 if classification else 6
    rows = {"train": 512, "test": 203}  # 203: not a multiple of any batch
    files = {}
    for split, n in rows.items():
        x = rng.normal(size=(n, features)) * np.linspace(0.5, 3.0, features) + 1.5
        if classification:
            y = (np.abs(x[:, :7]).argmax(axis=1)).astype(np.int64)
        else:
            y = np.stack([np.sin(x[:, 0]) + x[:, 1], x[:, 2] * x[:, 3], 10.0 + x[:, 4]], axis=1)
        path = os.path.join(workdir, f"{split}.h5")
        with h5py.File(path, "w") as f:
            f["x"] = x.astype(np.float32)
            f["y"] = y if classification else y.astype(np.float32)
        files[split] = path
    return files


CONFIGS = {
    "classification": """
[model]
sizes = [12, 16, 16, 7]
activation = "gelu"
loss = "cross_entropy"
moe_layers = [1]
experts = 4
top_k = 2
""",
    "regression": """
[model]
sizes = [6, 16, 3]
activation = "silu"
loss = "mse"
""",
    "residual_classification": """
[model]
kind = "residual_mlp"
inputs = 12
outputs = 7
width = 16
hidden = 32
depth = 2
norm = "layernorm"
activation = "swiglu"
loss = "cross_entropy"
""",
    "residual_regression": """
[model]
kind = "residual_mlp"
inputs = 6
outputs = 3
width = 16
hidden = 24
depth = 3
norm = "rmsnorm"
activation = "silu"
loss = "mse"
""",
}

# The mesh and preset of each case (the residual classification runs on fsdp x tp at np 4).
MESHES = {
    "residual_classification": ("fsdp = -1\ntp = 2", "fsdp_tp"),
}


def write_config(workdir, case, files):
    path = os.path.join(workdir, "run.toml")
    mesh, preset = MESHES.get(case, ("dp = -1", "dp"))
    normalize = 'normalize_targets = "standard"\n' if case == "residual_regression" else ""
    with open(path, "w") as f:
        f.write(f"""[run]
name = "reproduce"
seed = 3
output_dir = "{workdir}/out"

[mesh]
{mesh}

[partition]
preset = "{preset}"
{CONFIGS[case]}
[data]
source = "hdf5"
path = "{files['train']}"
test_path = "{files['test']}"
batch_size = 32
shuffle = false
{normalize}
[optimizer]
kind = "adamw"
lr = 3e-3

[train]
steps = 24
log_every = 8
eval_every = 0

[checkpoint]
dir = "{workdir}/checkpoints"
""")
    return path


def run(command):
    print("+", " ".join(command), flush=True)
    result = subprocess.run(command)
    if result.returncode != 0:
        fail(f"{' '.join(command)} exited with {result.returncode}")


def main():
    args = sys.argv[1:]
    if len(args) < 4 or args[2] != "--":
        print(__doc__)
        sys.exit(2)
    workdir, case, launcher = os.path.abspath(args[0]), args[1], args[3:]
    os.makedirs(workdir, exist_ok=True)
    rng = np.random.default_rng(7)
    files = write_data(workdir, case, rng)
    config = write_config(workdir, case, files)
    run(launcher + ["train", config])

    checkpoint = os.path.join(workdir, "checkpoints")
    with open(os.path.join(checkpoint, "latest")) as f:
        checkpoint = os.path.join(checkpoint, f.read().strip())
    with h5py.File(files["test"], "r") as f:
        x_test, y_test = f["x"][()], f["y"][()]
    z, norm = forward(checkpoint, x_test)

    with open(os.path.join(workdir, "out", "metrics.jsonl")) as f:
        evals = [e for e in map(json.loads, f) if "test_loss" in e]
    if not evals:
        fail("metrics.jsonl has no evaluation")
    last = evals[-1]
    classification = case.endswith("classification")
    if classification:
        loss = np.mean(np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
                       - z[np.arange(len(y_test)), y_test])
        close(loss, last["test_loss"], "test loss (cross entropy, mean over rows)")
        accuracy = np.mean(z.argmax(axis=1) == y_test)
        # float32 and float64 may order a near-tie differently: allow two rows of 203
        if abs(accuracy - last["test_accuracy"]) > 2.5 / len(y_test):
            fail(f"test accuracy {accuracy} != {last['test_accuracy']}")
        print(f"ok: test accuracy {accuracy:.4f}")
    else:
        y = y_test.astype(np.float64)
        if "target_mean" in norm:
            y = (y - norm["target_mean"]) / norm["target_std"]
        loss = np.mean(np.sum((z - y) ** 2, axis=1))
        close(loss, last["test_loss"], "test loss (mse, summed over outputs, mean over rows)")

    # `meshtrain predict` must run: a launcher whose predict fails fails the test (run()),
    # rather than passing without the comparison.
    output = os.path.join(workdir, "prediction.h5")
    run(launcher + ["predict", checkpoint, "--input", files["test"], "--output", output,
                    "--overwrite"])
    prediction = z
    if "target_mean" in norm:
        prediction = z * norm["target_std"] + norm["target_mean"]
    with h5py.File(output, "r") as f:
        close(f["prediction"][()], prediction, "/prediction")
        if classification:
            # Rows whose two largest outputs are within float32 rounding may go either way.
            top2 = np.sort(z, axis=1)[:, -2:]
            clear = (top2[:, 1] - top2[:, 0]) > 1e-4 * np.maximum(np.abs(top2[:, 1]), 1.0)
            differ = (f["class"][()] != z.argmax(axis=1)) & clear
            if differ.any():
                fail(f"/class differs from the argmax of the reproduced outputs in rows "
                     f"{np.flatnonzero(differ)[:5]}")
            print("ok: /class")
            close(f["probability"][()], softmax(z), "/probability")


if __name__ == "__main__":
    main()
