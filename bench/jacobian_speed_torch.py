#!/usr/bin/env python3
"""PyTorch's Jacobian of a meshtrain model, the baseline of bench/jacobian_speed.sh (issue 40).

The model is the checkpoint's PyTorch export (`meshtrain export --format pytorch`: model.py, a
plain torch.nn.Module with the normalization inside, and model.safetensors), so both sides
compute the same function in the user's units. The rows are independent, so the Jacobian of
every row is the Jacobian of f(x) = m(x).sum(0) [outputs] with respect to x [rows, inputs]:

    torch.autograd.functional.jacobian(f, x, vectorize=True)       # [outputs, rows, inputs]

(reverse mode, vmapped over the outputs; eval mode, the parameters with requires_grad =
False): the fastest way to call it on a batch, the baseline. For context, two other ways a
user calls it, timed on a few rows and scaled to --rows (per_row_s, batch_call_s): once per
row, jacobian(m, x[r:r+1], vectorize=True), and on batches as they come, jacobian(m, x[c:c+B],
vectorize=True) [B, outputs, B, inputs] (every row against every row: B times the work), for
B = --batch-call-rows. (strategy="forward-mode" vmaps over every input element of the batch:
for the summed function at 10,000 rows it asks for 57.6 GB, so it is left out.) Also one plain
forward under torch.no_grad(). The inputs are bench_jacobian's (bench/jacobian_speed.cpp)
pattern around the checkpoint's input statistics. torch.set_num_threads(--threads). After one
warm-up call of each, --rounds rounds; one JSON line: best and median seconds, the ratios.

--compare FILE.h5 (x [N, inputs], jacobian [N, outputs, inputs], as `meshtrain predict
--jacobian` writes them with the inputs copied in): PyTorch's Jacobian of the same rows, and
the largest difference, relative to the largest |J| of each (output, input) column.

  /usr/bin/python3 bench/jacobian_speed_torch.py EXPORT_DIR --rows 10000 [--threads 1]
      [--rounds 5] [--compare FILE.h5]
"""
import argparse
import importlib
import json
import math
import statistics
import sys
import time

import torch


def load(export_dir):
    sys.path.insert(0, export_dir)
    model = importlib.import_module("model")
    m = model.load()
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def statistics_of(m, inputs):
    """The input mean and std the export holds (buffers named input_mean / input_std), else
    0 and 1."""
    buffers = dict(m.named_buffers())
    mean = next((v for k, v in buffers.items() if k.endswith("input_mean")), None)
    std = next((v for k, v in buffers.items() if k.endswith("input_std")), None)
    if mean is None or std is None:
        return torch.zeros(inputs, dtype=torch.float64), torch.ones(inputs, dtype=torch.float64)
    return mean.double(), std.double()


def inputs_like_bench(rows, inputs, mean, std):
    """bench_jacobian's rows: mean + 1.5 std sin(0.7071 r + 1.37 c + 0.1 r c)."""
    r = torch.arange(rows, dtype=torch.float64)[:, None]
    c = torch.arange(inputs, dtype=torch.float64)[None, :]
    z = torch.sin(0.7071 * r + 1.37 * c + 0.1 * r * c)
    return (mean + 1.5 * z * std).float()


def jacobian(m, x, strategy="reverse-mode"):
    f = lambda v: m(v).sum(0)  # noqa: E731  (rows are independent)
    return torch.autograd.functional.jacobian(f, x, vectorize=True, strategy=strategy)


# Best and median seconds of `rounds` calls; the calling thread's CPU seconds of the best call
# (time.thread_time: with one PyTorch thread and one BLAS thread the work is on this thread,
# and other processes' load moves it less than wall time) in `cpu`.
def timed(fn, rounds, cpu=None):
    times, cpus = [], []
    for _ in range(rounds):
        start_cpu = time.thread_time()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        cpus.append(time.thread_time() - start_cpu)
    if cpu is not None:
        cpu.append(cpus[times.index(min(times))])
    return min(times), statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("export_dir")
    parser.add_argument("--rows", type=int, default=10000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compare", default=None)
    parser.add_argument("--per-row-rows", type=int, default=200,
                        help="rows timed one call each (scaled to --rows); 0: none")
    parser.add_argument("--batch-call-rows", type=int, default=64,
                        help="rows per batched call (two calls timed, scaled); 0: none")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    m = load(args.export_dir)
    inputs = next(p for p in m.parameters() if p.dim() == 2).shape[1]
    mean, std = statistics_of(m, inputs)
    x = inputs_like_bench(args.rows, inputs, mean, std)

    if args.compare:
        import h5py
        import numpy as np
        with h5py.File(args.compare, "r") as f:
            xs = torch.from_numpy(f["x"][()])
            want = f["jacobian"][()].astype(np.float64)
        got = jacobian(m, xs).permute(1, 0, 2).double().numpy()  # [rows, outputs, inputs]
        scale = np.abs(want).max(axis=0, keepdims=True)
        err = float((np.abs(got - want) / np.maximum(scale, 1e-300)).max())
        print(json.dumps({"bench": "torch_jacobian_check", "rows": int(xs.shape[0]),
                          "max_error_over_column_max": err}))

    with torch.no_grad():
        m(x)
    forward_best, forward_median = timed(lambda: m(x), 1)  # warm
    forward_cpu, jacobian_cpu = [], []
    with torch.no_grad():
        forward_best, forward_median = timed(lambda: m(x), args.rounds, forward_cpu)
    jacobian(m, x)
    reverse_best, reverse_median = timed(lambda: jacobian(m, x), args.rounds, jacobian_cpu)
    line = {"bench": "torch_jacobian", "torch": torch.__version__, "threads": args.threads,
            "rows": args.rows, "inputs": inputs,
            "jacobian_s": reverse_best, "jacobian_median_s": reverse_median,
            "forward_s": forward_best, "forward_median_s": forward_median,
            "jacobian_over_forward": reverse_best / forward_best,
            "jacobian_cpu_s": jacobian_cpu[0], "forward_cpu_s": forward_cpu[0]}
    if args.per_row_rows > 0:
        n = min(args.per_row_rows, args.rows)
        full = lambda v: torch.autograd.functional.jacobian(m, v, vectorize=True)  # noqa: E731
        full(x[:1])
        start = time.perf_counter()
        for r in range(n):
            full(x[r:r + 1])
        line["per_row_s"] = (time.perf_counter() - start) * args.rows / n
        line["per_row_timed_rows"] = n
    if args.batch_call_rows > 0:
        b = min(args.batch_call_rows, args.rows)
        full = lambda v: torch.autograd.functional.jacobian(m, v, vectorize=True)  # noqa: E731
        full(x[:b])
        start = time.perf_counter()
        calls = min(2, args.rows // b)
        for c in range(calls):
            full(x[c * b:(c + 1) * b])
        line["batch_call_s"] = (time.perf_counter() - start) * args.rows / (calls * b)
        line["batch_call_rows"] = b
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
