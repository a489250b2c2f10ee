#!/usr/bin/env python3
"""PyTorch's side of bench/predictor_vs_onnxruntime.sh: one forward of the checkpoint's PyTorch
export (meshtrain export --format pytorch) on a fixed block of rows, timed, with one thread
(torch.set_num_threads(1)), under torch.inference_mode():

  /usr/bin/python3 bench/predictor_vs_torch.py FOLDER ROWS.f32 ROWS COLUMNS CALLS [OUT.f32]

One warm-up call, then CALLS timed calls. One JSON line: the best and median milliseconds per
call and the process CPU milliseconds per call. OUT.f32 receives the last call's first output
(float32, row-major).
"""
import json
import statistics
import sys
import time

import numpy as np
import torch


def main():
    folder, input_file, rows, columns, calls = sys.argv[1:6]
    out_file = sys.argv[6] if len(sys.argv) > 6 else None
    rows, columns, calls = int(rows), int(columns), int(calls)
    torch.set_num_threads(1)
    sys.path.insert(0, folder)
    sys.dont_write_bytecode = True
    import model  # the export's model.py

    m = model.load()
    m.eval()
    x = torch.from_numpy(np.fromfile(input_file, dtype=np.float32, count=rows * columns)
                         .reshape(rows, columns))
    with torch.inference_mode():
        y = m(x)  # warm-up
        ms = []
        cpu_start = time.process_time()
        for _ in range(calls):
            start = time.perf_counter()
            y = m(x)
            ms.append(1e3 * (time.perf_counter() - start))
        cpu_ms = 1e3 * (time.process_time() - cpu_start) / calls
    if out_file:
        first = y[0] if isinstance(y, (tuple, list)) else y
        first.numpy().astype(np.float32).tofile(out_file)
    ms.sort()
    print(json.dumps({"bench": "predictor_call", "runtime": "torch", "version": torch.__version__,
                      "rows": rows, "calls": calls, "best_ms": ms[0],
                      "median_ms": statistics.median(ms), "cpu_ms_per_call": cpu_ms}))


if __name__ == "__main__":
    main()
