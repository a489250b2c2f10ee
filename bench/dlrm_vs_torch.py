#!/usr/bin/env python3
"""PyTorch's side of bench/dlrm_vs_torch.sh: the DLRM of configs/dlrm_synthetic.toml trained with
torch 1.13 under DistributedDataParallel (gloo, WORLD processes, one thread each), its tables
nn.EmbeddingBag(sparse=True) replicated on every process:

  /usr/bin/python3 bench/dlrm_vs_torch.py TRAIN.h5 TEST.h5 STEPS [WORLD] [WARMUP]

The model is meshtrain's (docs/recsys.md, "The model"): bottom MLP [13, 64, 16] with ReLU after
every layer, 26 tables of dim 16 (rows from the file's /sparse/<t> attribute `rows`, sum
pooling), the dot interaction ([z, F_i . F_j for i = 1..26, j < i], row by row: 367 features),
top MLP [367, 64, 1] with ReLU between, binary cross-entropy on the logit. Initialized as
meshtrain does (he_normal weights, zero biases, tables uniform in [-sqrt(1/rows), sqrt(1/rows))),
not with the same numbers.

Optimizers, the closest pair torch has to meshtrain's `optimizer.embeddings = "rowwise_adagrad"`:
the linear layers AdamW (lr 3e-3, betas (0.9, 0.999), eps 1e-8, no weight decay: the same as
meshtrain's), the tables torch.optim.Adagrad on their sparse gradients (lr 0.05, eps 1e-8,
accumulators from 0). torch's Adagrad keeps one accumulator per element (the squares of each
column), meshtrain's row-wise Adagrad one per row (the mean of the row's squares); both update
only the rows a step touched. torch has no row-wise Adagrad (FBGEMM's is TorchRec's); its
sparse SGD would have no accumulator at all, so element-wise Adagrad is the closer of the two.

Data: the whole train file is read into memory first (not timed), then each step takes a global
batch of `batch` rows from a shuffled order (seeded, another order than meshtrain's), each process
its contiguous half, and builds each table's CSR (indices, offsets) with numpy (timed: it is
part of the step, as meshtrain's HDF5 reads are of its). Timed: steps WARMUP+1 .. STEPS, from a
barrier to a barrier. After the last step, process 0 evaluates the whole test file (logits in
batches of 4096): AUC (ties averaged) and log loss. One JSON line on stdout.
"""
import json
import os
import sys
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

BATCH = 512
BOTTOM = [13, 64, 16]
TOP = [367, 64, 1]
LR, TABLE_LR, EPS = 3e-3, 0.05, 1e-8


def load(path):
    with h5py.File(path, "r") as f:
        tables = [t.decode() if isinstance(t, bytes) else str(t) for t in f.attrs["tables"]]
        data = {"dense": f["/dense"][...], "label": f["/label"][...].reshape(-1),
                "tables": tables, "rows": [], "offsets": [], "values": []}
        for t in tables:
            g = f["/sparse/" + t]
            data["rows"].append(int(g.attrs["rows"]))
            data["offsets"].append(g["offsets"][...])
            data["values"].append(g["values"][...])
    return data


def bags(offsets, values, idx):
    """CSR of rows `idx`: (indices, offsets) for nn.EmbeddingBag."""
    starts, ends = offsets[idx], offsets[idx + 1]
    lens = ends - starts
    out_offsets = np.zeros(len(idx), dtype=np.int64)
    np.cumsum(lens[:-1], out=out_offsets[1:])
    total = int(lens.sum())
    pos = np.repeat(starts - out_offsets, lens) + np.arange(total, dtype=np.int64)
    return torch.from_numpy(values[pos]), torch.from_numpy(out_offsets)


class Dlrm(nn.Module):
    def __init__(self, rows):
        super().__init__()
        self.bottom = nn.ModuleList(nn.Linear(a, b) for a, b in zip(BOTTOM, BOTTOM[1:]))
        self.top = nn.ModuleList(nn.Linear(a, b) for a, b in zip(TOP, TOP[1:]))
        self.tables = nn.ModuleList(
            nn.EmbeddingBag(r, BOTTOM[-1], mode="sum", sparse=True) for r in rows)
        for lin in list(self.bottom) + list(self.top):
            nn.init.normal_(lin.weight, 0.0, (2.0 / lin.in_features) ** 0.5)
            nn.init.zeros_(lin.bias)
        for r, t in zip(rows, self.tables):
            nn.init.uniform_(t.weight, -(1.0 / r) ** 0.5, (1.0 / r) ** 0.5)
        n = len(rows) + 1
        li, lj = torch.tril_indices(n, n, offset=-1)  # row by row: i ascending, j < i
        self.register_buffer("li", li, persistent=False)
        self.register_buffer("lj", lj, persistent=False)

    def forward(self, dense, sparse):
        z = dense
        for lin in self.bottom:
            z = torch.relu(lin(z))
        feats = [z] + [t(i, o) for t, (i, o) in zip(self.tables, sparse)]
        f = torch.stack(feats, dim=1)  # [B, 27, 16]
        inter = torch.bmm(f, f.transpose(1, 2))[:, self.li, self.lj]
        h = torch.cat([z, inter], dim=1)
        for k, lin in enumerate(self.top):
            h = lin(h)
            if k + 1 < len(self.top):
                h = torch.relu(h)
        return h.squeeze(1)


def auc(labels, scores):
    order = np.argsort(scores, kind="mergesort")
    s = scores[order]
    ranks = np.empty(len(s), dtype=np.float64)
    i = 0
    while i < len(s):  # ties: their mean rank
        j = i
        while j + 1 < len(s) and s[j + 1] == s[i]:
            j += 1
        ranks[i:j + 1] = 0.5 * (i + j) + 1.0
        i = j + 1
    r = np.empty(len(s), dtype=np.float64)
    r[order] = ranks
    pos = labels > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return (r[pos].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


def worker(rank, world, train_path, test_path, steps, warmup, port):
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    data = load(train_path)
    model = Dlrm(data["rows"])
    ddp = DDP(model)  # broadcasts rank 0's parameters
    dense_params = [p for n, p in model.named_parameters() if not n.startswith("tables.")]
    table_params = [p for n, p in model.named_parameters() if n.startswith("tables.")]
    opt_dense = torch.optim.AdamW(dense_params, lr=LR, betas=(0.9, 0.999), eps=EPS,
                                  weight_decay=0.0)
    opt_tables = torch.optim.Adagrad(table_params, lr=TABLE_LR, eps=EPS,
                                     initial_accumulator_value=0.0)
    loss_fn = nn.BCEWithLogitsLoss()
    n = data["dense"].shape[0]
    per_epoch = n // BATCH
    rng = np.random.default_rng(0)
    order = rng.permutation(n)
    local = BATCH // world
    losses = []
    start = None
    for step in range(steps):
        if step == warmup:
            dist.barrier()
            start = time.perf_counter()
        b = step % per_epoch
        if b == 0 and step > 0:
            order = rng.permutation(n)
        idx = np.sort(order[b * BATCH + rank * local:b * BATCH + (rank + 1) * local])
        dense = torch.from_numpy(data["dense"][idx])
        label = torch.from_numpy(data["label"][idx])
        sparse = [bags(o, v, idx) for o, v in zip(data["offsets"], data["values"])]
        opt_dense.zero_grad(set_to_none=True)
        opt_tables.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(dense, sparse), label)
        loss.backward()
        opt_dense.step()
        opt_tables.step()
        losses.append(loss.item())
    dist.barrier()
    elapsed = time.perf_counter() - start
    result = None
    if rank == 0:
        test = load(test_path)
        model.eval()
        logits = []
        with torch.no_grad():
            for s in range(0, test["dense"].shape[0], 4096):
                idx = np.arange(s, min(s + 4096, test["dense"].shape[0]))
                sparse = [bags(o, v, idx) for o, v in zip(test["offsets"], test["values"])]
                logits.append(model(torch.from_numpy(test["dense"][idx]), sparse).numpy())
        logit = np.concatenate(logits).astype(np.float64)
        y = test["label"].astype(np.float64)
        log_loss = float(np.mean(np.logaddexp(0.0, logit) - y * logit))
        result = {"bench": "dlrm_vs_torch", "framework": "torch", "version": torch.__version__,
                  "ranks": world, "threads_per_rank": 1, "tables": "replicated (DDP, sparse)",
                  "optimizer": "AdamW + sparse Adagrad (element-wise)", "batch": BATCH,
                  "steps": steps, "timed_steps": steps - warmup, "timed_s": elapsed,
                  "samples_per_s": (steps - warmup) * BATCH / elapsed,
                  "last_loss": losses[-1], "test_auc": float(auc(y, logit)),
                  "test_log_loss": log_loss}
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()


def main():
    train_path, test_path, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    world = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    warmup = int(sys.argv[5]) if len(sys.argv) > 5 else 10
    port = 29500 + os.getpid() % 1000
    mp.spawn(worker, args=(world, train_path, test_path, steps, warmup, port), nprocs=world)


if __name__ == "__main__":
    main()
