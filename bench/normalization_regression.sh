#!/usr/bin/env bash
# Normalization kept with the model (issue 26, "Measured", third bullet): the regression case
# of the issue's trial, trained (a) on the raw data with data.normalize_inputs =
# normalize_targets = "standard", (b) on the same data standardized beforehand by this script
# (train statistics, population std), and (c) on the raw data with both "none" (the run's
# scale warning is reported).
#
#   [ROWS=200000] [EPOCHS=10] [NP=2] [PYTHON=/usr/bin/python3] bench/normalization_regression.sh
#
# Data: ROWS training and ROWS/4 test rows of 16 features z_j * s_j + c_j with z ~ N(0, 1),
# scales s_j from 1e-3 to 1e4 (log-spaced) and offsets c_j = 3 s_j on every other feature; 3
# targets, smooth nonlinear functions of z at scales 1, 10 and 100, plus noise of 5% of each
# target's own scale. Model 16-128-128-3, tanh, AdamW 1e-3 with a cosine schedule, batch 256.
# Test MSE in the user's units (summed over the 3 outputs, averaged over the rows: how
# model.loss = "mse" reduces) is computed here with numpy from each run's final checkpoint:
# the forward pass from /params, the outputs returned to the user's units with the
# checkpoint's /normalization (a) or this script's statistics (b). The same forward in the
# model's own units is checked against the run's final test loss (field forward_check:
# relative difference). Prints one JSON line per run and a summary line with the ratio a / b.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
rows=${ROWS:-200000}
epochs=${EPOCHS:-10}
np=${NP:-2}
python=${PYTHON:-/usr/bin/python3}
mpirun=${MPIRUN:-mpirun --oversubscribe}
meshtrain=${MESHTRAIN:-build/bin/meshtrain}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$python" - "$work" "$rows" <<'PY'
import sys, numpy as np, h5py
work, rows = sys.argv[1], int(sys.argv[2])
rng = np.random.default_rng(26)
scales = np.logspace(-3, 4, 16)
offsets = np.where(np.arange(16) % 2 == 0, 3.0 * scales, 0.0)
def make(n):
    z = rng.standard_normal((n, 16))
    x = z * scales + offsets
    t = np.stack([np.sin(z[:, 0] + 0.5 * z[:, 1]) + 0.5 * z[:, 2] * z[:, 3],
                  10.0 * np.tanh(z[:, 4] - z[:, 5] + 0.3 * z[:, 15]),
                  100.0 * (0.3 * z[:, 6] ** 2 + np.cos(z[:, 7] * z[:, 8]) + 0.2 * z[:, 14])], axis=1)
    t += rng.standard_normal(t.shape) * np.array([0.05, 0.5, 5.0])
    return x, t
train, test = make(rows), make(rows // 4)
mean_x, std_x = train[0].mean(0), train[0].std(0)   # population std (ddof = 0)
mean_y, std_y = train[1].mean(0), train[1].std(0)
def write(name, x, y):
    with h5py.File(f"{work}/{name}.h5", "w") as f:
        f["x"] = x.astype(np.float32)
        f["y"] = y.astype(np.float32)
write("raw_train", *train)
write("raw_test", *test)
write("std_train", (train[0] - mean_x) / std_x, (train[1] - mean_y) / std_y)
write("std_test", (test[0] - mean_x) / std_x, (test[1] - mean_y) / std_y)
np.savez(f"{work}/stats.npz", mean_x=mean_x, std_x=std_x, mean_y=mean_y, std_y=std_y)
PY

run() {  # NAME DATA NORMALIZE
  $mpirun -np "$np" "$meshtrain" train configs/fashion_mnist_dp.toml \
    --set data.source=hdf5 --set "data.path=$work/$2_train.h5" \
    --set "data.test_path=$work/$2_test.h5" --set "model.sizes=[16, 128, 128, 3]" \
    --set model.activation=tanh --set model.loss=mse --set model.init=xavier_uniform \
    --set data.batch_size=256 --set train.epochs="$epochs" --set train.log_every=1000000 \
    --set train.eval_every=0 --set optimizer.schedule=cosine --set optimizer.lr=1e-3 \
    --set "data.normalize_inputs=$3" --set "data.normalize_targets=$3" \
    --set "run.output_dir=$work/run_$1" > "$work/$1.out" 2> "$work/$1.err" || {
    cat "$work/$1.err" >&2
    exit 1
  }
}
for spec in "a raw standard" "b std none" "c raw none"; do
  set -- $spec
  t0=$(date +%s.%N)
  run "$1" "$2" "$3"
  echo "$1 $t0 $(date +%s.%N)" >> "$work/times"
done

"$python" - "$work" "$rows" "$epochs" "$np" <<'PY'
import sys, json, re, numpy as np, h5py
work, rows, epochs, np_ranks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
times = {n: float(b) - float(a) for n, a, b in (line.split() for line in open(f"{work}/times"))}
stats = np.load(f"{work}/stats.npz")
def forward(f, x):
    layers = sorted({int(k) for k in f["params/layers"].keys()})
    for i in layers:
        x = x @ f[f"params/layers/{i}/weight"][()].astype(np.float64) + \
            f[f"params/layers/{i}/bias"][()].astype(np.float64)
        if i != layers[-1]:
            x = np.tanh(x)
    return x
with h5py.File(f"{work}/raw_test.h5") as f:
    x_raw, y_raw = f["x"][()].astype(np.float64), f["y"][()].astype(np.float64)
results = {}
for name, data in (("a", "raw"), ("b", "std"), ("c", "raw")):
    latest = open(f"{work}/run_{name}/checkpoints/latest").read().strip()
    out = open(f"{work}/{name}.out").read()
    err = open(f"{work}/{name}.err").read()
    final = float(re.findall(r"final test loss ([0-9.eE+-]+)", out)[-1])
    with h5py.File(f"{work}/run_{name}/checkpoints/{latest}") as f:
        if name == "a":
            n = f["normalization"]
            mx, sx, my, sy = (n[k][()] for k in ("input_mean", "input_std", "target_mean", "target_std"))
        elif name == "b":
            mx, sx, my, sy = stats["mean_x"], stats["std_x"], stats["mean_y"], stats["std_y"]
        else:
            mx, sx, my, sy = 0.0, 1.0, 0.0, 1.0
        x = (x_raw - mx) / sx
        if name == "b":  # the model was trained on the float32 file this script wrote
            with h5py.File(f"{work}/std_test.h5") as g:
                x = g["x"][()].astype(np.float64)
        out_model = forward(f, x)
    y_model_units = (y_raw - my) / sy
    if name == "b":
        with h5py.File(f"{work}/std_test.h5") as g:
            y_model_units = g["y"][()].astype(np.float64)
    mse_model_units = float(np.mean(np.sum((out_model - y_model_units) ** 2, axis=1)))
    prediction = out_model * sy + my
    mse = float(np.mean(np.sum((prediction - y_raw) ** 2, axis=1)))
    per_output = np.mean((prediction - y_raw) ** 2, axis=0)
    results[name] = mse
    print(json.dumps({
        "bench": "normalization_regression", "run": name,
        "data": "raw" if data == "raw" else "standardized beforehand",
        "normalize": "standard" if name == "a" else "none",
        "rows": rows, "test_rows": rows // 4, "epochs": epochs, "np": np_ranks,
        "test_mse": mse, "test_mse_per_output": [float(v) for v in per_output],
        "target_variance": [float(v) for v in stats["std_y"] ** 2],
        "final_test_loss": final,
        "forward_check": abs(mse_model_units - final) / max(abs(final), 1e-300),
        "scale_warning": "data.normalize_inputs = \"standard\"" in err,
        "wall_s": float(times[name])}))
print(json.dumps({"bench": "normalization_regression", "summary": True,
                  "test_mse_normalized_in_run": results["a"],
                  "test_mse_standardized_beforehand": results["b"],
                  "test_mse_raw": results["c"],
                  "ratio_a_over_b": results["a"] / results["b"],
                  "within_10_percent": abs(results["a"] / results["b"] - 1) <= 0.10}))
PY
