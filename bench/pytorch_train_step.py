#!/usr/bin/env python3
"""The training step of bench_train_step, in PyTorch eager: the same MLP (Linear + ReLU,
y = x W + b), cross-entropy, AdamW, batch and sizes, timed over full steps (forward, loss,
backward, optimizer step) on one device. Prints ONE JSON line, like bench_train_step, so
the two can be compared in one run:

    python3 bench/pytorch_train_step.py --sizes 784,4096,4096,10 --batch 256 --precision fp32

--precision tf32 sets torch.backends.cuda.matmul.allow_tf32 (PyTorch's default is fp32).
--param-dtype bf16|fp16 runs forward and backward under torch.autocast in that dtype, the
fp32 master weights and AdamW as they are (meshtrain's [mixed_precision] param_dtype; one
device, so there is no reduction for reduce_dtype); fp16 with a GradScaler.
--compile runs the model through torch.compile (PyTorch 2; the first warm-up step compiles).
Also reports the GEMM rate of torch.mm on the widest layer's shape at the batch
(gemm_tflops), the rate the step's GEMM FLOPs are compared with.

--ranks R (CPU) runs R processes instead, DistributedDataParallel over gloo on localhost, each
with --threads intra-op threads (default 1: one core per rank, as meshtrain's Serial backend)
and batch / R rows (as meshtrain's dp splits the global batch); bf16 is torch.autocast("cpu",
dtype=torch.bfloat16) around forward, the gradients all-reduced in fp32 (DDP's default; PyTorch
1.13 has no bf16 reduction over gloo). Each timed step is timed as bench_train_step times its
steps: a barrier, the step, a barrier; wall time of the whole, and the CPU time of the step in
each process (all its threads: gloo's too), the largest over ranks. Prints ONE JSON line with the
medians over the timed steps (step_time_median_s, step_cpu_time_median_s) and the dtype the first
Linear's output had under autocast (first_linear_output_dtype: torch.bfloat16 when it is real):

    python3 bench/pytorch_train_step.py --ranks 2 --sizes 784,4096,4096,10 --batch 256 \
        --param-dtype bf16 --steps 5 --warmup 1
"""
import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch


def timed(fn, steps, sync):
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times), max(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="784,4096,4096,10")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--precision", choices=["fp32", "tf32"], default="fp32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--param-dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--ranks", type=int, default=0,
                        help="CPU: R processes under DistributedDataParallel over gloo (0: one "
                        "process, no DDP)")
    parser.add_argument("--threads", type=int, default=1,
                        help="with --ranks: torch.set_num_threads in every process")
    args = parser.parse_args()
    if args.ranks:
        if args.ranks < 1 or args.batch % args.ranks:
            sys.exit(f"pytorch_train_step.py: --ranks {args.ranks} must be positive and divide "
                     f"--batch {args.batch}")
        if args.device != "cpu" or args.param_dtype == "fp16" or args.compile:
            sys.exit("pytorch_train_step.py: --ranks runs on the CPU, in fp32 or bf16, eager only")
        run_ddp(args)
        return

    sizes = [int(s) for s in args.sizes.split(",")]
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = args.precision == "tf32"
    torch.backends.cudnn.allow_tf32 = args.precision == "tf32"
    torch.manual_seed(0)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    layers = []
    for i in range(len(sizes) - 1):
        layers.append(torch.nn.Linear(sizes[i], sizes[i + 1]))
        if i + 2 < len(sizes):
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers).to(device)
    if args.compile:
        if not hasattr(torch, "compile"):
            sys.exit(f"pytorch_train_step.py: --compile needs PyTorch 2, this is {torch.__version__}")
        model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999),
                                  eps=1e-8, weight_decay=0.0)
    x = torch.randn(args.batch, sizes[0], device=device)
    labels = torch.arange(args.batch, device=device) % sizes[-1]
    loss_fn = torch.nn.CrossEntropyLoss()
    losses = []
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.param_dtype)
    # torch.amp.GradScaler is PyTorch >= 2.3's; Debian's 1.13 has the CUDA one only.
    if hasattr(torch.amp, "GradScaler"):
        scaler = torch.amp.GradScaler(device.type, enabled=args.param_dtype == "fp16")
    else:
        scaler = torch.cuda.amp.GradScaler(enabled=args.param_dtype == "fp16")

    def step():
        optimizer.zero_grad(set_to_none=False)
        # No autocast at all in fp32 (1.13's CPU autocast refuses float32 even when disabled).
        autocast = (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype
                    else contextlib.nullcontext())
        with autocast:
            logits = model(x)
        loss = loss_fn(logits.float(), labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss)

    for _ in range(args.warmup):
        step()
    median, fastest, slowest = timed(step, args.steps, sync)

    # The GEMM rate on the widest layer at the batch (forward shape), same precision.
    widest = max(range(len(sizes) - 1), key=lambda i: sizes[i] * sizes[i + 1])
    a = torch.randn(args.batch, sizes[widest], device=device)
    b = torch.randn(sizes[widest], sizes[widest + 1], device=device)
    for _ in range(3):
        torch.mm(a, b)
    gemm_time, _, _ = timed(lambda: torch.mm(a, b), 20, sync)
    gemm_tflops = 2.0 * args.batch * sizes[widest] * sizes[widest + 1] / gemm_time * 1e-12

    multiply_adds = sum(sizes[i] * sizes[i + 1] for i in range(len(sizes) - 1))
    flops_per_step = 6.0 * args.batch * multiply_adds
    line = {
        "bench": "pytorch_train_step",
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "sizes": sizes,
        "batch": args.batch,
        "precision": args.precision,
        "param_dtype": args.param_dtype,
        "compile": args.compile,
        "steps": args.steps,
        "warmup": args.warmup,
        "step_time_median_s": median,
        "step_time_min_s": fastest,
        "step_time_max_s": slowest,
        "samples_per_s": args.batch / median,
        "flops_per_step": flops_per_step,
        "tflops": flops_per_step / median * 1e-12,
        "layer_gemm_shape": [args.batch, sizes[widest], sizes[widest + 1]],
        "layer_gemm_tflops": gemm_tflops,
        "fraction_of_gemm_rate": flops_per_step / median * 1e-12 / gemm_tflops,
        "first_loss": float(losses[0]),
        "last_loss": float(losses[-1]),
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    print(json.dumps(line), flush=True)


def ddp_rank(rank, args, port):
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    sizes = [int(s) for s in args.sizes.split(",")]
    torch.manual_seed(0)  # the same initial weights on every rank (DDP broadcasts rank 0's too)
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(torch.nn.Linear(sizes[i], sizes[i + 1]))
        if i + 2 < len(sizes):
            layers.append(torch.nn.ReLU())
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999),
                                  eps=1e-8, weight_decay=0.0)
    rows = args.batch // args.ranks
    generator = torch.Generator().manual_seed(1 + rank)  # each rank its own rows
    x = torch.randn(rows, sizes[0], generator=generator)
    labels = (torch.arange(rows) + rank * rows) % sizes[-1]
    loss_fn = torch.nn.CrossEntropyLoss()
    bf16 = args.param_dtype == "bf16"
    seen = {}

    def note_dtype(module, inputs, output):  # returns None: the output is left as it is
        seen.setdefault("dtype", str(output.dtype))

    hook = layers[0].register_forward_hook(note_dtype)

    def step():
        optimizer.zero_grad(set_to_none=False)
        if bf16:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(x)
        else:
            logits = model(x)
        loss = loss_fn(logits.float(), labels)
        loss.backward()
        optimizer.step()
        return float(loss)

    losses = [step() for _ in range(args.warmup)]
    walls, cpus = [], []
    for _ in range(args.steps):
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        losses.append(step())
        cpu = time.process_time() - cpu_start
        dist.barrier()
        walls.append(time.perf_counter() - start)
        cpus.append(cpu)
        # Off after the first step that ran, timed or not (with --warmup 0 the dtype is still
        # seen; the hook's call is microseconds of a step's milliseconds).
        hook.remove()
    # The largest rank's figures per step, as bench_train_step's MPI_MAX.
    per_step = torch.tensor([walls, cpus], dtype=torch.float64)
    dist.all_reduce(per_step, op=dist.ReduceOp.MAX)
    if rank == 0:
        walls, cpus = per_step.tolist()
        multiply_adds = sum(sizes[i] * sizes[i + 1] for i in range(len(sizes) - 1))
        line = {
            "bench": "pytorch_train_step",
            "torch": torch.__version__,
            "device": "cpu",
            "ddp": True,
            "backend": "gloo",
            "ranks": args.ranks,
            "threads_per_rank": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "sizes": sizes,
            "batch": args.batch,
            "rows_per_rank": rows,
            "param_dtype": args.param_dtype,
            "autocast": "torch.autocast('cpu', dtype=torch.bfloat16)" if bf16 else None,
            "first_linear_output_dtype": seen.get("dtype"),
            "gradient_allreduce_dtype": "fp32",
            "steps": args.steps,
            "warmup": args.warmup,
            "step_time_median_s": statistics.median(walls),
            "step_cpu_time_median_s": statistics.median(cpus),
            "step_times_s": walls,
            "step_cpu_times_s": cpus,
            "samples_per_s": args.batch / statistics.median(walls),
            "flops_per_step": 6.0 * args.batch * multiply_adds,
            "first_loss": losses[0],
            "last_loss": losses[-1],
        }
        print(json.dumps(line), flush=True)
    dist.destroy_process_group()


def run_ddp(args):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(ddp_rank, args=(args, port), nprocs=args.ranks)


if __name__ == "__main__":
    main()
