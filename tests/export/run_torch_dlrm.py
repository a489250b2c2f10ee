#!/usr/bin/env python3
"""Runs an exported DLRM as a PyTorch user would (pytorch_export_test.py, case dlrm):

  python3 -I run_torch_dlrm.py FOLDER INPUT.npz Y.npy

puts FOLDER (meshtrain export --format pytorch's output) on sys.path, `import model;
m = model.load()`, and writes to Y.npy the logits m(dense, indices, offsets) of INPUT.npz's
`dense` (float32 [rows, features]) and, per table t in the model's order, `indices_<t>` (the
int64 ids of every bag one after the other) and `offsets_<t>` (each bag's first position,
[rows]: nn.EmbeddingBag's convention); the same with the tables given as dicts by name must
agree. Prints one JSON line: the torch version, whether m is in training mode, the output's
dtype and shape, the tables' names and module types, and what m did with indices by a key that
is no table and with one argument too many ("ValueError: ..." / "TypeError: ...").
"""

import json
import sys

import numpy as np
import torch


def main():
    folder, input_file, y_file = sys.argv[1:4]
    sys.path.insert(0, folder)
    sys.dont_write_bytecode = True  # leave the export's folder as it was
    import model  # the export's model.py

    m = model.load()
    data = np.load(input_file)
    tables = m.network.tables
    dense = torch.from_numpy(data["dense"])
    indices = [torch.from_numpy(data["indices_%d" % t]) for t in range(len(tables))]
    offsets = [torch.from_numpy(data["offsets_%d" % t]) for t in range(len(tables))]
    with torch.no_grad():
        y = m(dense, indices, offsets)
        by_name = m(dense, dict(zip(tables, indices)), dict(zip(tables, offsets)))
        refusals = []
        wrong = dict(zip(tables, indices))
        wrong["not_a_table"] = wrong.pop(tables[0])
        for args in ((dense, wrong, dict(zip(tables, offsets))),  # a key that is no table
                     (dense, indices, offsets, offsets)):  # one argument too many
            try:
                m(*args)
                refusals.append("accepted")
            except (TypeError, ValueError) as e:
                refusals.append("%s: %s" % (type(e).__name__, e))
    np.save(y_file, y.numpy())
    print(json.dumps({"torch": torch.__version__, "training": m.training, "dtype": str(y.dtype),
                      "shape": list(y.shape), "tables": tables,
                      "dict_equal": bool(torch.equal(y, by_name)),
                      "modules": sorted({type(b).__name__ for b in m.network.embeddings}),
                      "modes": [b.mode for b in m.network.embeddings], "refusals": refusals}))


if __name__ == "__main__":
    main()
