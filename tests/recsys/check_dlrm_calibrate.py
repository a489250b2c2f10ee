#!/usr/bin/env python3
"""`meshtrain calibrate CONFIG` of a DLRM (docs/cost_model.md, "The hardware profile"): on the
config's own training file it measures the data read and writes hdf5_row_seconds,
sparse_row_seconds and sparse_id_seconds with a [measured] line naming the file; `meshtrain
plan --hardware` reads the profile back and charges the read at those figures.

  check_dlrm_calibrate.py MAKE_RECSYS_DATA CONFIG WORK NP -- MPIEXEC [FLAGS...] MESHTRAIN

What it checks, at NP ranks:
  - the three keys are present; sparse_row_seconds above 0, sparse_id_seconds 0 or more (a
    fit's slope, floored at 0); hdf5_row_seconds is the [measured] data_read line's dense time
    over its rows (both printed: 4 significant digits there, 6 in the key, so within 6e-4
    relative: half a unit of the 4th digit is at most 5e-4 of the value);
  - [measured] data_read names the training file, the rank's rows of a batch (256 / NP), the
    config's data.shuffle and the 26 tables;
  - [elementwise] dlrm_dot_forward and dlrm_dot_backward are written (the dot interaction, above
    0);
  - plan --json --hardware at world NP: cost.data_read_s less its agreement (data_agree_s) is
    rows * (hdf5_row_seconds + 26 * sparse_row_seconds + ids * sparse_id_seconds), ids the
    file's ids per row rounded as the plan rounds them, plus at most the one other term, the
    rows' bytes twice at the profile's memory_bandwidth (a row of 13 floats and a label: under
    128 bytes, so at most 256 B / memory_bandwidth a row), within 1e-4 relative more (the
    profile's 6 significant digits); with NP > 1 the agreement is above 0;
  - a dense row that one rank cannot read (a copy of the file with a NaN in /dense row 200,
    data.shuffle = false: at NP 2 only rank 1 reads it, in the first batch) ends calibrate on
    every rank with exit status 1 and ONE "meshtrain: error" line naming the file and the row,
    within the timeout (no rank left in another collective);
  - at NP 1 only (each rank refuses alone, the same way; the NaN case covers the agreement at
    NP 2): a file that does not fit the config is exit status 2 and one error line naming what:
    model.bottom[0] against the dense width, the sparse against the dense rows, a file table
    larger than model.tables'.
Timeouts: each calibrate 50 s, the plan 10 s, within ctest's 120 (a calibrate takes 2-3 s quiet,
4-12 s at load average 7).
"""
import json
import os
import re
import shutil
import subprocess
import sys

import h5py


def fail(message):
    sys.exit(f"check_dlrm_calibrate: {message}")


def check_bad_input(mpiexec, meshtrain, config, work, train):
    """The data file against the config, as DlrmRun checks it (run/dlrm_data.hpp): exit 2 and one
    error line naming what does not fit."""
    short = os.path.join(work, "short.h5")  # dense rows one fewer than the tables'
    shutil.copyfile(train, short)
    with h5py.File(short, "r+") as f:
        for key in ("dense", "label"):
            f[key].resize(f[key].shape[0] - 1, axis=0)
    big = os.path.join(work, "big.h5")  # t00 of 11 rows, more than the model's 10
    shutil.copyfile(train, big)
    with h5py.File(big, "r+") as f:
        f["sparse"]["t00"].attrs["rows"] = 11
    cases = [(train, ["--set", "model.bottom=[12, 16, 8]"], "model.bottom[0] = 12"),
             (short, [], "its tables describe 4000 rows, but /dense holds 3999"),
             (big, [], "table 't00': the file's table has 11 rows, more than the 10")]
    for path, extra, want in cases:
        argv = [*mpiexec, "-np", "1", meshtrain, "calibrate", config,
                "--set", f"data.path=\"{path}\"", *extra, "--out", os.path.join(work, "x.toml")]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=50)
        errors = [line for line in done.stderr.splitlines() if line.startswith("meshtrain:")]
        if done.returncode != 2 or len(errors) != 1 or want not in errors[0]:
            fail(f"{' '.join(argv)} exited {done.returncode}, want 2 and one error line with "
                 f"{want!r}:\n{done.stderr}")


def main():
    make_data, config, work, np_ = sys.argv[1:5]
    launcher = sys.argv[sys.argv.index("--") + 1:]
    mpiexec, meshtrain = launcher[:-1], launcher[-1]
    np_ = int(np_)
    os.makedirs(work, exist_ok=True)
    data = os.path.join(work, "data")
    if not os.path.exists(os.path.join(data, "train.h5")):
        done = subprocess.run([sys.executable, make_data, "--rows", "4000", "--test-rows", "1000",
                               "--max-table-rows", "2000", "--out", data],
                              capture_output=True, text=True)
        if done.returncode != 0:
            fail(f"make_recsys_data failed: {done.stderr.strip()}")
    train = os.path.join(data, "train.h5")
    sets = ["--set", f"data.path=\"{train}\"",
            "--set", f"data.test_path=\"{os.path.join(data, 'test.h5')}\""]
    hw = os.path.join(work, f"hw{np_}.toml")
    argv = [*mpiexec, "-np", str(np_), meshtrain, "calibrate", config, *sets, "--out", hw]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=50)
    if done.returncode != 0:
        fail(f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    text = open(hw).read()
    keys = {}
    for key in ("hdf5_row_seconds", "sparse_row_seconds", "sparse_id_seconds"):
        m = re.search(rf"^{key} = ([0-9.eE+-]+)", text, re.M)
        if not m:
            fail(f"no {key} in {hw}:\n{text}")
        keys[key] = float(m.group(1))
    if not (keys["sparse_row_seconds"] > 0 and keys["sparse_id_seconds"] >= 0):
        fail(f"data-read figures not positive: {keys}")
    rows = 256 // np_
    m = re.search(r'^data_read = "(.*)"$', text, re.M)
    if not m or train not in m.group(1) or f"{rows} rows a batch (data.shuffle rows" \
            not in m.group(1) or "(26 tables" not in m.group(1):
        fail(f"[measured] data_read missing or wrong (want {train}, {rows} rows, shuffle rows, "
             f"26 tables):\n{text}")
    dense = re.search(r"dense rows ([0-9.eE+-]+) s", m.group(1))
    if not dense:
        fail(f"[measured] data_read has no dense time: {m.group(1)}")
    per_row = float(dense.group(1)) / rows
    if not (per_row > 0 and abs(keys["hdf5_row_seconds"] - per_row) <= 6e-4 * per_row):
        fail(f"hdf5_row_seconds {keys['hdf5_row_seconds']} is not the dense time "
             f"{dense.group(1)} s / {rows} rows = {per_row}")
    for kernel in ("dlrm_dot_forward", "dlrm_dot_backward"):
        k = re.search(rf"^{kernel} = ([0-9.eE+-]+)", text.split("[elementwise]", 1)[-1], re.M)
        if "[elementwise]" not in text or not k or not float(k.group(1)) > 0:
            fail(f"no [elementwise] {kernel} above 0 in {hw}:\n{text}")
    argv = [meshtrain, "plan", config, "--world", str(np_), "--json", "--hardware", hw, *sets]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        fail(f"{' '.join(argv)} exited {done.returncode}:\n{done.stderr}")
    cost = json.loads(done.stdout)["cost"]
    with h5py.File(train, "r") as f:
        tables = list(f["sparse"].keys())
        n = f["sparse"][tables[0]]["offsets"].shape[0] - 1
        ids = round(sum(f["sparse"][t]["values"].shape[0] / n for t in tables))
    want = rows * (keys["hdf5_row_seconds"] + len(tables) * keys["sparse_row_seconds"]
                   + ids * keys["sparse_id_seconds"])
    got = cost["data_read_s"] - cost["data_agree_s"]
    bandwidth = float(re.search(r"^memory_bandwidth = ([0-9.eE+-]+)", text, re.M).group(1))
    if not (want * (1 - 1e-4) <= got <= want * (1 + 1e-4) + rows * 256.0 / bandwidth):
        fail(f"plan's data read {got} s, not {want} s from the profile ({keys}, {rows} rows, "
             f"{len(tables)} tables, {ids} ids a row)")
    if np_ > 1 and not cost["data_agree_s"] > 0:
        fail(f"no agreement charged at {np_} ranks: {cost['data_agree_s']}")
    # A NaN in dense row 200: in file order rank 1 of 2 reads rows 128-255 of the first batch.
    bad = os.path.join(work, "nan.h5")
    shutil.copyfile(train, bad)
    with h5py.File(bad, "r+") as f:
        f["dense"][200, 0] = float("nan")
    argv = [*mpiexec, "-np", str(np_), meshtrain, "calibrate", config,
            "--set", f"data.path=\"{bad}\"", "--set", "data.shuffle=false",
            "--out", os.path.join(work, "bad.toml")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=50)
    errors = [line for line in done.stderr.splitlines() if line.startswith("meshtrain:")]
    if done.returncode != 1 or len(errors) != 1 or bad not in errors[0] \
            or "[200, 0]" not in errors[0] or "finite" not in errors[0]:
        fail(f"{' '.join(argv)} exited {done.returncode}, want 1 and one error line naming "
             f"{bad} and row 200:\n{done.stderr}")
    if np_ == 1:
        check_bad_input(mpiexec, meshtrain, config, work, train)
    print(f"ok: calibrate on {np_} ranks: {keys}; plan's read {got:.4g} s = the profile's; "
          f"a NaN row: {errors[0]}")


main()
