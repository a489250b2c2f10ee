"""PyTorch's physics-loss step (double backward) against its plain step, the same model and batch
as build/bin/bench_laplacian (bench/laplacian_speed.sh): an mlp of INPUTS inputs, DEPTH hidden
layers of WIDTH (tanh), one output, ROWS points; the plain step is forward, mse and backward;
the physics step takes u's gradient by x with create_graph=True, then each d2u/dx_i^2 by a
second autograd.grad of that column (the usual PINN code), the residual
r = sum_i d2u/dx_i^2 - u, mean(r^2) and its backward to the parameters. Best of ROUNDS rounds of
STEPS steps; one JSON line.

    python3 bench/laplacian_speed_torch.py ROWS INPUTS WIDTH DEPTH STEPS ROUNDS THREADS
"""
import json
import math
import sys
import time

import torch

rows, inputs, width, depth, steps, rounds, threads = (int(a) for a in sys.argv[1:8])
torch.set_num_threads(threads)
torch.manual_seed(1)
layers = []
last = inputs
for _ in range(depth):
    layers += [torch.nn.Linear(last, width), torch.nn.Tanh()]
    last = width
layers.append(torch.nn.Linear(last, 1))
model = torch.nn.Sequential(*layers)
index = torch.arange(rows * inputs, dtype=torch.float64).reshape(rows, inputs)
x = torch.sin(0.37 * index).float()
t = torch.zeros(rows, 1)


def plain():
    model.zero_grad(set_to_none=True)
    loss = torch.mean((model(x) - t) ** 2)
    loss.backward()


def physics():
    model.zero_grad(set_to_none=True)
    xs = x.clone().requires_grad_(True)
    u = model(xs)
    (du,) = torch.autograd.grad(u.sum(), xs, create_graph=True)
    lap = torch.zeros_like(u[:, 0])
    for i in range(inputs):
        (d2,) = torch.autograd.grad(du[:, i].sum(), xs, create_graph=True)
        lap = lap + d2[:, i]
    r = lap - u[:, 0]
    loss = torch.mean(r * r)
    loss.backward()


# Seconds per step of the best round, and the calling thread's CPU seconds per step of that
# round (time.thread_time: one PyTorch thread, one BLAS thread).
def best(step):
    step()
    seconds, cpu = math.inf, math.inf
    for _ in range(rounds):
        start_cpu = time.thread_time()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        elapsed = time.perf_counter() - start
        if elapsed < seconds:
            seconds, cpu = elapsed, time.thread_time() - start_cpu
    return seconds / steps, cpu / steps


plain_s, plain_cpu = best(plain)
physics_s, physics_cpu = best(physics)
print(json.dumps({"bench": "laplacian_step_torch", "torch": torch.__version__, "rows": rows,
                  "inputs": inputs, "width": width, "depth": depth, "threads": threads,
                  "plain_step_s": plain_s, "physics_step_s": physics_s,
                  "ratio": physics_s / plain_s, "plain_step_cpu_s": plain_cpu,
                  "physics_step_cpu_s": physics_cpu}))
