#!/usr/bin/env python3
"""Runs an exported PyTorch model as a user would (pytorch_export_test.py):

  python3 -I run_torch_model.py FOLDER X.npy Y.npy

puts FOLDER (meshtrain export --format pytorch's output) on sys.path, `import model;
m = model.load()`, writes m(x) for the float32 rows of X.npy to Y.npy and prints one JSON line:
the torch version, whether m is in training mode, the output's dtype, the file `import
model` found and what m(x, x) did (an MLP takes one argument: "TypeError: <message>").
"""

import json
import sys

import numpy as np
import torch


def main():
    folder, x_file, y_file = sys.argv[1:4]
    sys.path.insert(0, folder)
    sys.dont_write_bytecode = True  # leave the export's folder as it was
    import model  # the export's model.py

    m = model.load()
    x = torch.from_numpy(np.load(x_file))
    with torch.no_grad():
        y = m(x)
        try:  # a DLRM's extra arguments given to this model: refused
            m(x, x)
            extra_args = "accepted"
        except TypeError as e:
            extra_args = "TypeError: %s" % e
    np.save(y_file, y.numpy())
    print(json.dumps({"torch": torch.__version__, "training": m.training, "dtype": str(y.dtype),
                      "model_file": model.__file__, "extra_args": extra_args}))


if __name__ == "__main__":
    main()
