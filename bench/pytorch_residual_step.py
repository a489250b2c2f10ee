#!/usr/bin/env python3
"""PyTorch training step of bench/residual_step.sh's residual SwiGLU model, CPU, one JSON line.

The model: Linear(inputs, width); depth pre-norm blocks h + down(silu(gate(rms(h))) * up(rms(h)))
with RMSNorm (eps 1e-6, learned scale), a final RMSNorm, Linear(width, outputs); MSE loss on
random data, AdamW (lr 1e-3). --ranks R > 1 runs R processes with DistributedDataParallel over
gloo on localhost, each with batch / R rows (as meshtrain's dp splits the global batch).
torch.set_num_threads(--threads) in every process (1: one core per rank, as meshtrain's
Serial backend). The first --warmup steps are left out; step_time_median_s is the median of
the slowest rank's step times.

  /usr/bin/python3 bench/pytorch_residual_step.py [--ranks 2] [--batch 256] [--steps 6]
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale


class Block(nn.Module):
    def __init__(self, width, hidden):
        super().__init__()
        self.norm = RMSNorm(width)
        self.gate = nn.Linear(width, hidden)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, h):
        a = self.norm(h)
        return h + self.down(nn.functional.silu(self.gate(a)) * self.up(a))


class ResidualMlp(nn.Module):
    def __init__(self, inputs, width, hidden, depth, outputs):
        super().__init__()
        self.input = nn.Linear(inputs, width)
        self.blocks = nn.Sequential(*[Block(width, hidden) for _ in range(depth)])
        self.output_norm = RMSNorm(width)
        self.output = nn.Linear(width, outputs)

    def forward(self, x):
        return self.output(self.output_norm(self.blocks(self.input(x))))


def run(rank, args):
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.ranks > 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    model = ResidualMlp(args.inputs, args.width, args.hidden, args.depth, args.outputs)
    if args.ranks > 1:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rows = args.batch // args.ranks
    x = torch.randn(rows, args.inputs)
    y = torch.randn(rows, args.outputs)
    times = []
    for _ in range(args.warmup + args.steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
    times = torch.tensor(times[args.warmup:], dtype=torch.float64)
    if args.ranks > 1:
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
    if rank == 0:
        step = statistics.median(times.tolist())
        print(json.dumps({"bench": "pytorch_residual_step", "torch": torch.__version__,
                          "ranks": args.ranks, "threads_per_rank": args.threads,
                          "ddp": args.ranks > 1, "batch": args.batch, "inputs": args.inputs,
                          "width": args.width, "hidden": args.hidden, "depth": args.depth,
                          "steps_timed": args.steps, "step_time_median_s": round(step, 4),
                          "samples_per_s": round(args.batch / step, 1)}), flush=True)
    if args.ranks > 1:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--inputs", type=int, default=1024)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--outputs", type=int, default=10)
    args = p.parse_args()
    if args.ranks > 1:
        mp.spawn(run, args=(args,), nprocs=args.ranks)
    else:
        run(0, args)


if __name__ == "__main__":
    main()
