#!/usr/bin/env python3
"""`meshtrain calibrate CONFIG` of a DLRM (docs/cost_model.md, "The hardware profile"): on the
config's own training file it measures the data read and writes hdf5_row_seconds,
sparse_row_seconds and sparse_id_seconds with a [measured] line naming the file; `meshtrain
plan --hardware` reads the profile back and charges the read at those figures.

  check_dlrm_calibrate.py MAKE_RECSYS_DATA CONFIG WORK NP -- MPIEXEC [FLAGS...] MESHTRAIN

What it checks, at NP ranks:
  - the three keys are present; hdf5_row_seconds and sparse_row_seconds above 0 (a read takes
    time), sparse_id_seconds 0 or more (a fit's slope, floored at 0);
  - [measured] data_read names the training file, the rank's rows of a batch (256 / NP) and the
    26 tables;
  - plan --json --hardware at world NP: cost.data_read_s less its agreement (data_agree_s) is
    rows * (hdf5_row_seconds + 26 * sparse_row_seconds + ids * sparse_id_seconds), ids the
    file's ids per row rounded as the plan rounds them, plus at most the one other term, the
    rows' bytes twice at the profile's memory_bandwidth (a row of 13 floats and a label: under
    128 bytes, so at most 256 B / memory_bandwidth a row), within 1e-4 relative more (the
    profile's 6 significant digits); with NP > 1 the agreement is above 0.
"""
import json
import os
import re
import subprocess
import sys

import h5py


def fail(message):
    sys.exit(f"check_dlrm_calibrate: {message}")


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
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        fail(f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    text = open(hw).read()
    keys = {}
    for key in ("hdf5_row_seconds", "sparse_row_seconds", "sparse_id_seconds"):
        m = re.search(rf"^{key} = ([0-9.eE+-]+)", text, re.M)
        if not m:
            fail(f"no {key} in {hw}:\n{text}")
        keys[key] = float(m.group(1))
    if not (keys["hdf5_row_seconds"] > 0 and keys["sparse_row_seconds"] > 0
            and keys["sparse_id_seconds"] >= 0):
        fail(f"data-read figures not positive: {keys}")
    rows = 256 // np_
    m = re.search(r'^data_read = "(.*)"$', text, re.M)
    if not m or train not in m.group(1) or f"{rows} rows a batch" not in m.group(1) \
            or "(26 tables" not in m.group(1):
        fail(f"[measured] data_read missing or wrong (want {train}, {rows} rows, 26 tables):\n{text}")
    argv = [meshtrain, "plan", config, "--world", str(np_), "--json", "--hardware", hw, *sets]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
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
    print(f"ok: calibrate on {np_} ranks: {keys}; plan's read {got:.4g} s = the profile's")


main()
