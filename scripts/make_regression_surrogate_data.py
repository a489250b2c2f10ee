#!/usr/bin/env python3
"""Writes the data of configs/regression_surrogate.toml: data/regression_surrogate/train.h5 and
test.h5 (x [rows, 16] float32, y [rows, 3] float32), ROWS training rows and ROWS / 4 test rows.
The rows of bench/normalization_regression.sh's regression case: 16 features z_j * s_j + c_j
with z ~ N(0, 1), scales s_j log-spaced from 1e-3 to 1e4, offsets c_j = 3 s_j on every other
feature; 3 targets, smooth nonlinear functions of z at scales 1, 10 and 100, plus noise of 5%.

  /usr/bin/python3 scripts/make_regression_surrogate_data.py [ROWS] [DIR]
"""
import os
import sys

import h5py
import numpy as np


def make(rng, n, scales, offsets):
    z = rng.standard_normal((n, 16))
    x = z * scales + offsets
    t = np.stack([np.sin(z[:, 0] + 0.5 * z[:, 1]) + 0.5 * z[:, 2] * z[:, 3],
                  10.0 * np.tanh(z[:, 4] - z[:, 5] + 0.3 * z[:, 15]),
                  100.0 * (0.3 * z[:, 6] ** 2 + np.cos(z[:, 7] * z[:, 8]) + 0.2 * z[:, 14])],
                 axis=1)
    t += rng.standard_normal(t.shape) * np.array([0.05, 0.5, 5.0])
    return x, t


def main():
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 200000
    out = sys.argv[2] if len(sys.argv) > 2 else "data/regression_surrogate"
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(26)
    scales = np.logspace(-3, 4, 16)
    offsets = np.where(np.arange(16) % 2 == 0, 3.0 * scales, 0.0)
    for name, n in (("train", rows), ("test", max(rows // 4, 1))):
        x, y = make(rng, n, scales, offsets)
        with h5py.File(os.path.join(out, f"{name}.h5"), "w") as f:
            f["x"] = x.astype(np.float32)
            f["y"] = y.astype(np.float32)
        print(f"wrote {os.path.join(out, name + '.h5')}: {n} rows")


if __name__ == "__main__":
    main()
