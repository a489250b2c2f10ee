#!/usr/bin/env python3
"""scripts/make_recsys_data (issue 39, docs/recsys.md) on a small set, written twice: the files
hold what docs/recsys.md says (shapes, dtypes, CSR offsets from 0, monotone, ending at the ids'
count; ids inside their tables; one id per row in t00..t22, 0 to 4 in t23..t25 with empty bags
and repeated ids present), about 25% clicks, power-law ids (the 1% most used rows of the largest
table take more than 20% of its lookups), a label that the dense features alone predict better
than chance on the test file (AUC of a least-squares fit on train > 0.55), the same bytes from
the same arguments, and a bad argument refused in one sentence naming it.

  check_recsys_data.py SCRIPT WORK_DIR
"""
import os
import shutil
import subprocess
import sys

import h5py
import numpy as np


def fail(message):
    sys.exit(f"check_recsys_data: {message}")


def auc(scores, labels):
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    pos = labels > 0.5
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return (ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


def generate(script, out, *extra):
    args = [sys.executable, script, "--rows", "6000", "--test-rows", "3000",
            "--max-table-rows", "20000", "--chunk-rows", "2500", "--out", out, *extra]
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        fail(f"{' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def check_file(path, rows):
    with h5py.File(path, "r") as f:
        dense, label = f["dense"][...], f["label"][...]
        if dense.shape != (rows, 13) or dense.dtype != np.float32:
            fail(f"{path}: /dense is {dense.shape} {dense.dtype}, want ({rows}, 13) float32")
        if not np.all(np.isfinite(dense)) or dense.min() < 0:
            fail(f"{path}: /dense holds negative or non-finite values")
        if label.shape != (rows, 1) or not np.all((label == 0) | (label == 1)):
            fail(f"{path}: /label is not [{rows}, 1] of zeros and ones")
        rate = label.mean()
        if not 0.2 <= rate <= 0.3:
            fail(f"{path}: click rate {rate:.3f}, want about 0.25")
        tables = list(f.attrs["tables"])
        if len(tables) != 26:
            fail(f"{path}: {len(tables)} tables named, want 26")
        empty_bags = repeats = 0
        for t, name in enumerate(tables):
            g = f[f"sparse/{name}"]
            values, offsets = g["values"][...], g["offsets"][...]
            table_rows = int(g.attrs["rows"])
            if offsets.shape != (rows + 1,) or offsets[0] != 0 or offsets[-1] != values.size:
                fail(f"{path}: /sparse/{name}/offsets does not run from 0 to the ids' count")
            sizes = np.diff(offsets)
            if np.any(sizes < 0):
                fail(f"{path}: /sparse/{name}/offsets decreases")
            if values.size and (values.min() < 0 or values.max() >= table_rows):
                fail(f"{path}: /sparse/{name} holds an id outside [0, {table_rows})")
            if t < 23 and not np.all(sizes == 1):
                fail(f"{path}: /sparse/{name} should hold one id per row")
            if t >= 23:
                if sizes.max() > 4:
                    fail(f"{path}: /sparse/{name} has a bag of {sizes.max()} ids, at most 4")
                empty_bags += int(np.sum(sizes == 0))
                for r in range(rows):
                    bag = values[offsets[r]:offsets[r + 1]]
                    repeats += bag.size - np.unique(bag).size
        if empty_bags == 0 or repeats == 0:
            fail(f"{path}: the multi-hot tables have {empty_bags} empty bags and {repeats} "
                 f"repeated ids, want both")
        largest = f[f"sparse/{tables[-1]}/values"][...]
        counts = np.sort(np.bincount(largest))[::-1]
        top = counts[:max(1, counts.size // 100)].sum() / largest.size
        if top <= 0.2:
            fail(f"{path}: the top 1% rows of {tables[-1]} take {top:.2%} of its lookups, "
                 f"want a power law (> 20%)")
        return dense, label[:, 0]


def main():
    script, work = sys.argv[1], sys.argv[2]
    shutil.rmtree(work, ignore_errors=True)
    a, b = os.path.join(work, "a"), os.path.join(work, "b")
    generate(script, a)
    generate(script, b)
    dense, label = check_file(os.path.join(a, "train.h5"), 6000)
    test_dense, test_label = check_file(os.path.join(a, "test.h5"), 3000)
    design = np.c_[dense, np.ones(len(dense))]
    w, *_ = np.linalg.lstsq(design, label, rcond=None)
    dense_auc = auc(np.c_[test_dense, np.ones(len(test_dense))] @ w, test_label)
    if dense_auc <= 0.55:
        fail(f"the dense features alone reach AUC {dense_auc:.3f} on the test file, want > 0.55")
    for name in ("train.h5", "test.h5"):
        with h5py.File(os.path.join(a, name)) as fa, h5py.File(os.path.join(b, name)) as fb:
            paths = []
            fa.visititems(lambda p, o: paths.append(p) if isinstance(o, h5py.Dataset) else None)
            for p in paths:
                if not np.array_equal(fa[p][...], fb[p][...]):
                    fail(f"{name}:/{p} differs between two runs with the same arguments")
    bad = subprocess.run([sys.executable, script, "--rows", "0", "--out", os.path.join(work, "c")],
                         capture_output=True, text=True)
    if bad.returncode == 0 or "--rows must be at least 1, got 0" not in bad.stderr:
        fail(f"--rows 0 was not refused in one sentence: status {bad.returncode}, {bad.stderr!r}")
    shutil.rmtree(work, ignore_errors=True)
    print(f"check_recsys_data: both files as documented, dense-only AUC {dense_auc:.3f}, "
          f"the same bytes twice, --rows 0 refused")


if __name__ == "__main__":
    main()
