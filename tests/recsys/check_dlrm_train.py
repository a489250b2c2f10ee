#!/usr/bin/env python3
"""`meshtrain train` and `meshtrain evaluate` of a DLRM (issue 39, docs/recsys.md) on a small
synthetic click set that scripts/make_recsys_data writes (20,000 training and 4,000 test rows,
tables of up to 2,000 rows), with tests/recsys/dlrm_small.toml (26 tables, t24 and t25 row-wise
where their rows divide, the rest replicated). Modes:

  train   np 1, 2 and 4 train 40 steps: every step's loss of np 2 and np 4 within 1e-5
          (relative) of np 1's, the one-rank reference (sums reorder across ranks: a bag spread
          over a row-wise table's owners, the gradients' all-reduce), and the final evaluation's
          AUC and log loss within 1e-4; the final AUC above 0.66, above what the dense features
          alone reach (about 0.6), below the teacher's own AUC on the file (about 0.8); then
          `meshtrain evaluate --json -` of np 2's checkpoint on np 1 and np 4 (t25 row-wise
          over 2 ranks resharded onto 1 and 4, t24 row-wise onto replicated) reports the
          training run's final auc and log_loss within 1e-4; a --data file of 301 rows (fewer
          than data.batch_size) evaluates alike on 1 and 2 ranks.
  resume  np 2: 20 steps, then resumed to 40 (checkpoint.resume): every logged loss of steps
          21 to 40 and every parameter and optimizer state of the step-40 checkpoint equal an
          uninterrupted run's bit for bit (both read their batches ahead, data.prefetch = 2), as
          do every loss of a run that reads them in the step (data.prefetch = 0); the step-20 checkpoint of 2 ranks resumed on 4 (t24
          row-wise to replicated, t25 row-wise over 2 to over 4, with their optimizer state):
          the losses of steps 21 to 40 within 1e-5 (relative) of the uninterrupted run's.
  bad_id  an id outside its table in one row of the training file: exit 2 with one sentence
          naming the table, the file and the global row, the same error on every rank (one
          "meshtrain: error" line, no rank left hanging); the tables moved to another group
          are read through data.sparse_key, and without it the missing table is named;
          optimizer.clip_norm with optimizer.embeddings = "rowwise_adagrad" is refused (exit 2,
          one sentence naming both keys).

  columns t23, t24 and t25 column-wise (P(None, tp): each rank of tp a slice of their 8
          columns): 40 steps in four resumed legs of 10, each on another mesh and layout, against
          an uninterrupted run on 1 rank: column-wise on 2 ranks (tp 2), row-wise on 4 (the
          preset's rules: t25 over fsdp 4, t23 and t24 replicated), one rank (replicated),
          column-wise on 4 (fsdp 2 x tp 2); every leg's losses within 1e-5 (relative) of the
          one-rank run's, and the first leg's (column-wise tables, the dense layers replicated
          over tp, the whole batch on every rank: the one-rank sums in the one-rank order)
          bit for bit with the dense optimizer; the step-10 checkpoint of the column-wise leg
          holds every table whole ([rows, 8], h5py), each equal to the one-rank run's step-10
          table (bit for bit with the dense optimizer, else within 1e-6).

  tablewise  t22 .. t25 table-wise (P(fsdp@table): the plan places them, largest first onto
          the least loaded member of fsdp); 30 steps in three resumed legs of 10: row-wise on 4
          ranks (the preset: t25 over fsdp 4), table-wise on 2 (t25, t22 on fsdp member 0, t24,
          t23 on member 1), one rank; every leg's losses within 1e-5 (relative) of an
          uninterrupted one-rank run's, and the table-wise leg's step-20 checkpoint holds each
          table and its AdamW moments whole ([rows, 8], h5py) within 2e-4 of the one-rank run's
          (measured 5.5e-5). tablewise_rowwise_adagrad: the same with the tables' row-wise
          Adagrad accumulators ([rows]) resharded through the table-wise leg.

  train_rowwise_adagrad, resume_rowwise_adagrad, resume_sparse_adamw, columns_rowwise_adagrad
          train and resume with optimizer.embeddings = "rowwise_adagrad" or "sparse_adamw" (the
          tables updated in the rows a step touched; the linear layers by AdamW): the same
          checks (the resume: bit for bit on 2 ranks, the state resharded 2 -> 4 with its
          table), and also: the checkpoints hold each table's state under the optimizer's slots
          (/opt_state/rowwise_adagrad/embeddings/<t>/weight [rows], or sparse_adamw_m and _v
          [rows, dim] and sparse_adamw_steps [rows]), not all zero, and no AdamW moments of a
          table; train: every table of np 2's and np 4's step-40 checkpoint within 1e-4
          (absolute) of np 1's.

  preset  partition.preset = "dlrm" (TorchRec's default plan, simply: every table of at least
          min_sharding_size (8000) elements row-wise over the mesh's batch axes where its rows
          divide, the rest and every linear layer replicated): `meshtrain plan` at world 1, 2
          and 4 shows the preset's two rules and gives every parameter that spec (t24 row-wise
          over fsdp 2, replicated on 4: 1618 rows; t25 over fsdp 2 and 4; t22 and t23 replicated
          with a note: odd rows; t21 and smaller by size); np 1, 2 and 4 train 20 steps, every
          loss of np 2 and 4 within 1e-5 (relative) of np 1's and the final AUC and log loss
          within 1e-4.

  flight  the flight recorder in a DLRM run (docs/running.md, "When a run hangs"): np 2 trains
          without end; once it steps, SIGUSR1 to both ranks writes <run.output_dir>/flight/
          rank-{0,1}.json (reason SIGUSR1, with the row-wise t25's all_to_all_v on fsdp) while
          the run goes on; SIGTERM writes them again (reason SIGTERM) and ends the job.

  trace   [runtime] trace_steps in a DLRM run (docs/recsys.md, "Training it"): np 1, 2 and 4
          train 6 steps with rowwise_adagrad tracing steps 3 to 5: <run.output_dir>/trace/
          holds rank-<k>.json for every rank, all-ranks.json and config.toml; every rank has the
          3 step spans (numbered 3, 4, 5), each holding the phases data read, forward, loss,
          backward and optimizer; the all-to-all spans per step are 4 per group of tables
          `meshtrain plan --json` places row-wise over the same axes (the counts, the ids, the
          partial sums, the dy, each for the group's tables together; none at np 1), and each
          group's first (the counts) moves the sum of its tables' counts_all_to_all_bytes; the
          traced run's losses equal an untraced run's bit for bit. And np 2 tracing steps 5 to 9
          of 6: the trace is written at the end of the run (steps 5 and 6).

  bf16    model.table_dtype = "bf16" (tables stored as 2 bytes an element, sparse_adamw with
          stochastic rounding; docs/recsys.md, "bf16 tables"), 20 steps: np 1, np 2 (tp 2) and
          np 4 (tp 4) with t23, t24 and t25 column-wise (P(None, tp)), the dense layers and the
          other tables replicated over tp (the whole batch on every rank: the one-rank sums in
          the one-rank order): every loss and every table of the step-20 checkpoint equal np 1's
          bit for bit (the same stochastic draws on every mesh, keyed by global row and
          column); the checkpoint's tables are uint16 [rows, dim] with attribute dtype = "bf16"
          (h5py), their values (bits << 16 as float32) finite and not all zero, the AdamW state
          float32; `meshtrain evaluate` of np 1's checkpoint on 2 ranks gives its final AUC
          (within 1e-4). np 1, 40 steps of row-wise Adagrad (lr 0.05), bf16 tables and fp32
          tables: the final test AUC of the bf16 run above 0.66 and within BF16_AUC_TOLERANCE of
          the fp32 run's. And the refusals: table_dtype =
          "fp16" (one sentence naming the file, the key and the value), "bf16" with
          optimizer.embeddings = "dense". `meshtrain plan --json` at world 2: every table's bytes
          per rank half the fp32 table's (parameters and embedding_tables), the optimizer
          state's unchanged.
  bf16_resume  bf16 tables with rowwise_adagrad on np 2 (t24 and t25 row-wise): 10 steps, then
          resumed to 20: steps 11 to 20 and every dataset of the step-20 checkpoint equal an
          uninterrupted run's bit for bit; the step-10 checkpoint resumed on 4 ranks (t25
          row-wise over 4, t24 replicated): losses within 1e-5 (relative); resumed with
          model.table_dtype = "fp32" (the bf16 tables widened exactly on load): step 11's loss
          equal the bf16 run's bit for bit and the step-20 checkpoint's tables float32; an fp32
          run's step-10 checkpoint resumed with bf16 tables (rounded to the nearest bf16 on
          load): step 11's loss within 1e-4 (relative; measured 1.5e-5: the tables' rounding to
          bf16 is a relative change of at most 2^-9 per element, averaged over a batch's ids),
          the step-20 tables uint16.

  check_dlrm_train.py MODE SCRIPT CONFIG WORK_DIR -- MPIEXEC... MESHTRAIN
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import h5py
import numpy as np

try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib

# `--set`s every training run of the mode gets (the modes ending in a sparse optimizer's name),
# and the checkpoint slots of that optimizer with their shape per table ("rows" or "rows, dim").
EXTRA_SETS = []
SPARSE = {
    "rowwise_adagrad": {"rowwise_adagrad": "rows"},
    "sparse_adamw": {"sparse_adamw_m": "rows, dim", "sparse_adamw_v": "rows, dim",
                     "sparse_adamw_steps": "rows"},
}
SPARSE_LR = {"rowwise_adagrad": 0.05, "sparse_adamw": 0.01}
SLOTS = {}


def fail(message):
    sys.exit(f"check_dlrm_train: {message}")


def make_data(script, work):
    out = os.path.join(work, "data")
    args = [sys.executable, script, "--rows", "20000", "--test-rows", "4000",
            "--max-table-rows", "2000", "--out", out]
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        fail(f"{' '.join(args)} failed: {done.stderr.strip()}")


def run(launcher, np_, command, work, *args, expect=0):
    mpiexec, meshtrain = launcher[:-1], launcher[-1]
    argv = [*mpiexec, "-np", str(np_), meshtrain, command, *args]
    done = subprocess.run(argv, cwd=work, capture_output=True, text=True, timeout=300)
    if done.returncode != expect:
        fail(f"{' '.join(argv)} exited {done.returncode}, not {expect}:\n{done.stdout}\n"
             f"{done.stderr}")
    return done


def train(launcher, np_, config, work, out, *sets):
    run(launcher, np_, "train", work, config, "--set", f'run.output_dir="{out}"', *EXTRA_SETS,
        *sets)
    losses, evals = {}, []
    with open(os.path.join(work, out, "metrics.jsonl")) as f:
        for line in f:
            event = json.loads(line)
            if "test_auc" in event:
                evals.append(event)
            elif "loss" in event:
                losses[event["step"]] = event["loss"]
    return losses, evals


def close(a, b, rel):
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


def mode_train(launcher, config, work):
    runs = {np_: train(launcher, np_, config, work, f"np{np_}") for np_ in (1, 2, 4)}
    ref_losses, ref_evals = runs[1]
    if sorted(ref_losses) != list(range(1, 41)) or [e["step"] for e in ref_evals] != [20, 40]:
        fail(f"np 1 logged steps {sorted(ref_losses)} and evaluations at "
             f"{[e['step'] for e in ref_evals]}, not steps 1..40 and evaluations at 20, 40")
    for np_ in (2, 4):
        losses, evals = runs[np_]
        for step, loss in ref_losses.items():
            if not close(losses.get(step, float("nan")), loss, 1e-5):
                fail(f"np {np_}: the loss of step {step} is {losses.get(step)}, np 1's {loss}")
        if [e["step"] for e in evals] != [e["step"] for e in ref_evals]:
            fail(f"np {np_} evaluated at steps {[e['step'] for e in evals]}, np 1 at "
                 f"{[e['step'] for e in ref_evals]}")
        for mine, ref in zip(evals, ref_evals):
            for key in ("test_auc", "test_log_loss"):
                if abs(mine[key] - ref[key]) > 1e-4:
                    fail(f"np {np_}: {key} at step {mine['step']} is {mine[key]}, np 1's {ref[key]}")
    if EXTRA_SETS:
        check_sparse_tables(work)
    final = runs[2][1][-1]
    with h5py.File(os.path.join(work, "data", "test.h5"), "r") as f:
        teacher = float(f.attrs["teacher_auc"])
    if not 0.66 < final["test_auc"] < teacher:
        fail(f"the final test AUC {final['test_auc']} is not between 0.66 and the teacher's "
             f"{teacher}")
    for np_ in (1, 4):
        done = run(launcher, np_, "evaluate", work, "np2/checkpoints", "--data",
                   "data/test.h5", "--json", "-")
        report = json.loads(done.stdout.strip().splitlines()[-1])
        for key in ("test_auc", "test_log_loss"):
            if not abs(report[key] - final[key]) <= 1e-4:
                fail(f"evaluate on np {np_}: {key} {report[key]}, the training run's {final[key]}")
    # A --data file with fewer rows than data.batch_size: evaluated in whole shards, on 1 and 2
    # ranks alike (the first 301 test rows).
    small_reports = []
    write_first_rows(os.path.join(work, "data", "test.h5"), os.path.join(work, "small.h5"), 301)
    for np_ in (1, 2):
        done = run(launcher, np_, "evaluate", work, "np2/checkpoints", "--data", "small.h5",
                   "--json", "-")
        small_reports.append(json.loads(done.stdout.strip().splitlines()[-1]))
    for key in ("test_auc", "test_log_loss"):
        one, two = small_reports[0][key], small_reports[1][key]
        if not (np.isfinite(one) and abs(one - two) <= 1e-4):
            fail(f"evaluate of 301 rows: {key} {one} on 1 rank, {two} on 2")
    print(f"dlrm train: np 2 and 4 match np 1; AUC {final['test_auc']:.4f} (teacher {teacher:.4f})")


def write_first_rows(source, target, rows):
    """The first `rows` rows of a recsys file: dense and label rows, each table's CSR cut."""
    with h5py.File(source, "r") as f, h5py.File(target, "w") as g:
        for key, value in f.attrs.items():
            g.attrs[key] = value
        def visit(name, item):
            if not isinstance(item, h5py.Dataset):
                for key, value in item.attrs.items():  # a table's rows
                    g.require_group(name).attrs[key] = value
                return
            if name.endswith("/offsets"):
                offsets = item[: rows + 1]
                g[name] = offsets
                values = name[: -len("offsets")] + "values"
                g[values] = f[values][: offsets[-1]]
            elif not name.endswith("/values"):
                g[name] = item[:rows]
            for key, value in item.attrs.items():
                g[name].attrs[key] = value
        f.visititems(visit)


def tensors(path):
    out = {}
    with h5py.File(path, "r") as f:
        def visit(name, item):
            if isinstance(item, h5py.Dataset) and name.split("/")[0] in ("params", "opt_state"):
                out[name] = item[...]
        f.visititems(visit)
    return out


def check_sparse_state(path):
    """The sparse optimizer's state of every table in the checkpoint at `path`, and no AdamW
    moments of a table; returns the checkpoint's tensors."""
    found = tensors(path)
    tables = [k for k in found if k.startswith("params/embeddings/")]
    if len(tables) != 26:
        fail(f"{path} holds {len(tables)} tables, not 26")
    for name in tables:
        table = name[len("params/"):]
        rows, dim = found[name].shape
        for slot, shape in SLOTS.items():
            state = f"opt_state/{slot}/{table}"
            want = (rows,) if shape == "rows" else (rows, dim)
            if state not in found or found[state].shape != want:
                fail(f"{path} has no {state} of shape {list(want)}")
            if not found[state].any():
                fail(f"{path}: {state} is all zero")
        for slot in ("m", "v"):
            if f"opt_state/{slot}/{table}" in found:
                fail(f"{path} holds AdamW's {slot} of {name}")
    return found


def check_sparse_tables(work):
    """The tables after 40 steps on 2 and 4 ranks against 1 rank's, with their state."""
    ref = check_sparse_state(os.path.join(work, "np1", "checkpoints", "ckpt-000040.h5"))
    for np_ in (2, 4):
        got = check_sparse_state(os.path.join(work, f"np{np_}", "checkpoints", "ckpt-000040.h5"))
        for name in ref:
            if not name.startswith("params/embeddings/"):
                continue
            diff = float(np.max(np.abs(got[name] - ref[name])))
            if diff > 1e-4:
                fail(f"np {np_}: {name} after 40 steps differs from np 1's by {diff}")


def mode_resume(launcher, config, work):
    whole, _ = train(launcher, 2, config, work, "whole")
    train(launcher, 2, config, work, "parts", "--set", "train.steps=20")
    resumed, _ = train(launcher, 2, config, work, "parts", "--set", "train.steps=40",
                       "--set", "checkpoint.resume=true")
    for step in range(21, 41):
        if resumed.get(step) != whole[step]:
            fail(f"the resumed run's loss of step {step} is {resumed.get(step)}, "
                 f"the uninterrupted run's {whole[step]}")
    # Both read their batches ahead on a thread (data.prefetch = 2, the default); read in the
    # step instead, the same rows in the same order: the same losses, bit for bit.
    inline, _ = train(launcher, 2, config, work, "inline", "--set", "data.prefetch=0")
    if inline != whole:
        step = min(s for s in whole if inline.get(s) != whole[s])
        fail(f"read in the step (data.prefetch = 0), the loss of step {step} is "
             f"{inline.get(step)}, read ahead {whole[step]}")
    a = tensors(os.path.join(work, "whole", "checkpoints", "ckpt-000040.h5"))
    if SLOTS:
        check_sparse_state(os.path.join(work, "whole", "checkpoints", "ckpt-000040.h5"))
    b = tensors(os.path.join(work, "parts", "checkpoints", "ckpt-000040.h5"))
    if sorted(a) != sorted(b) or not any(k.startswith("params/embeddings/") for k in a):
        fail(f"the checkpoints hold other datasets: {sorted(a)} and {sorted(b)}")
    for name in a:
        if a[name].tobytes() != b[name].tobytes():
            fail(f"{name} of the resumed run's step-40 checkpoint differs from the "
                 "uninterrupted run's")
    # Saved on 2 ranks, resumed on 4: t24 row-wise over 2 becomes replicated (1618 rows do not
    # divide by 4), t25 row-wise over 4, its AdamW moments with it; the losses go on as the
    # uninterrupted run's, to the reordering of sums across ranks.
    train(launcher, 2, config, work, "moved", "--set", "train.steps=20")
    moved, _ = train(launcher, 4, config, work, "moved", "--set", "train.steps=40",
                     "--set", "checkpoint.resume=true")
    for step in range(21, 41):
        if not close(moved.get(step, float("nan")), whole[step], 1e-5):
            fail(f"resumed on 4 ranks, the loss of step {step} is {moved.get(step)}, the "
                 f"uninterrupted 2-rank run's {whole[step]}")
    print(f"dlrm resume: steps 21..40 and {len(a)} checkpoint datasets equal bit for bit; "
          "read in the step: every loss bit for bit; "
          "resumed on 4 ranks within 1e-5")


COLUMN_RULES = ["--set", 'partition.rules=[["embeddings/t2[345]/weight", "P(None, tp)"]]']


def mode_columns(launcher, config, work):
    # The rules do make the three tables column-wise on the first leg's mesh (the plan says so:
    # a slice of 4 of the 8 columns per rank).
    plan = subprocess.run([launcher[-1], "plan", config, "--world", "2", "--set", "mesh.tp=2",
                           *COLUMN_RULES], capture_output=True, text=True, cwd=work)
    for table, rows in (("t23", 1309), ("t24", 1618), ("t25", 2000)):
        line = next((l for l in plan.stdout.splitlines()
                     if l.startswith(f"embeddings/{table}/weight ")), "")
        if "P(None, tp)" not in line or f"[{rows}, 4]" not in line:
            fail(f"meshtrain plan does not show {table} column-wise [{rows}, 4]: {line!r}\n"
                 f"{plan.stdout}{plan.stderr}")
    whole, _ = train(launcher, 1, config, work, "whole")
    legs = [  # (ranks, the leg's sets, what the tables are)
        (2, ["--set", "mesh.tp=2", *COLUMN_RULES], "column-wise on 2 ranks"),
        (4, [], "row-wise on 4 ranks"),
        (1, [], "on 1 rank"),
        (4, ["--set", "mesh.tp=2", *COLUMN_RULES], "column-wise on 4 ranks (fsdp 2 x tp 2)"),
    ]
    for leg, (np_, sets, what) in enumerate(legs):
        last = 10 * (leg + 1)
        resume = ["--set", "checkpoint.resume=true"] if leg else []
        losses, _ = train(launcher, np_, config, work, "moved", "--set", f"train.steps={last}",
                          *resume, *sets)
        bitwise = leg == 0 and not SLOTS
        for step in range(last - 9, last + 1):
            got, want = losses.get(step, float("nan")), whole[step]
            if (got != want) if bitwise else not close(got, want, 1e-5):
                fail(f"tables {what}: the loss of step {step} is {got}, the one-rank run's "
                     f"{want}" + (" (bit for bit)" if bitwise else ""))
    # The column-wise leg's checkpoint: whole tables, readable as any other.
    got = tensors(os.path.join(work, "moved", "checkpoints", "ckpt-000010.h5"))
    ref = tensors(os.path.join(work, "whole", "checkpoints", "ckpt-000010.h5"))
    for table in ("t23", "t24", "t25"):
        name = f"params/embeddings/{table}/weight"
        if name not in got or got[name].shape != ref[name].shape or got[name].shape[1] != 8:
            fail(f"the column-wise checkpoint's {name} is "
                 f"{got[name].shape if name in got else 'missing'}, not {ref[name].shape}")
        diff = float(np.max(np.abs(got[name] - ref[name])))
        if (diff != 0.0) if not SLOTS else diff > 1e-6:
            fail(f"the column-wise checkpoint's {name} differs from the one-rank run's by {diff}")
        for slot in SLOTS:
            state = f"opt_state/{slot}/embeddings/{table}/weight"
            if state not in got or got[state].shape != ref[state].shape:
                fail(f"the column-wise checkpoint has no {state} of shape {ref[state].shape}")
            diff = float(np.max(np.abs(got[state] - ref[state])))
            if diff > 1e-6 * max(1.0, float(np.max(np.abs(ref[state])))):
                fail(f"the column-wise checkpoint's {state} differs from one rank's by {diff}")
    print("dlrm columns: column-wise on 2 -> row-wise on 4 -> 1 rank -> column-wise on 4 "
          "follows the one-rank run")


TABLE_RULES = ["--set", 'partition.rules=[["embeddings/t2[2345]/weight", "P(fsdp@table)"]]']


def mode_tablewise(launcher, config, work):
    # The plan places the four tables on the two members of fsdp, largest first onto the least
    # loaded: t25 (2000 rows) -> 0, t24 (1618) -> 1, t23 (1309) -> 1, t22 (1059) -> 0.
    plan = subprocess.run([launcher[-1], "plan", config, "--world", "2", *TABLE_RULES],
                          capture_output=True, text=True, cwd=work)
    for table, rows, member in (("t22", 1059, 0), ("t23", 1309, 1), ("t24", 1618, 1),
                                ("t25", 2000, 0)):
        line = next((l for l in plan.stdout.splitlines()
                     if l.startswith(f"embeddings/{table}/weight ")), "")
        section = next((l for l in plan.stdout.splitlines() if l.strip().startswith(f"{table} ")),
                       "")
        if f"P(fsdp@{member})" not in line or f"table-wise on member {member} of (fsdp)" not in \
                section or f"{rows} x 8 (others: 0)" not in section:
            fail(f"meshtrain plan does not place {table} [{rows}, 8] on fsdp member {member}: "
                 f"{line!r} {section!r}\n{plan.stdout}{plan.stderr}")
    whole, _ = train(launcher, 1, config, work, "whole", "--set", "train.steps=30")
    legs = [  # (ranks, the leg's sets, what the tables are)
        (4, [], "row-wise on 4 ranks"),
        (2, TABLE_RULES, "table-wise on 2 ranks"),
        (1, [], "on 1 rank"),
    ]
    for leg, (np_, sets, what) in enumerate(legs):
        last = 10 * (leg + 1)
        resume = ["--set", "checkpoint.resume=true"] if leg else []
        losses, _ = train(launcher, np_, config, work, "moved", "--set", f"train.steps={last}",
                          *resume, *sets)
        for step in range(last - 9, last + 1):
            got, want = losses.get(step, float("nan")), whole[step]
            if not close(got, want, 1e-5):
                fail(f"tables {what}: the loss of step {step} is {got}, the one-rank run's {want}")
    # The table-wise leg's checkpoint: whole tables (each written by its holder), readable as
    # any other and equal to the one-rank run's within 2e-4 (absolute; measured 5.5e-5: the
    # first leg's sums reorder across ranks, which AdamW's normalized steps amplify in rows
    # with tiny second moments).
    got = tensors(os.path.join(work, "moved", "checkpoints", "ckpt-000020.h5"))
    ref = tensors(os.path.join(work, "whole", "checkpoints", "ckpt-000020.h5"))
    for table in ("t22", "t23", "t24", "t25"):
        for name in [f"params/embeddings/{table}/weight"] + [
                f"opt_state/{slot}/embeddings/{table}/weight" for slot in (SLOTS or ("m", "v"))]:
            if name not in ref:
                fail(f"the one-rank checkpoint has no {name}")
            if name not in got or got[name].shape != ref[name].shape:
                fail(f"the table-wise checkpoint's {name} is "
                     f"{got[name].shape if name in got else 'missing'}, not {ref[name].shape}")
            diff = float(np.max(np.abs(got[name] - ref[name])))
            if diff > 2e-4:
                fail(f"the table-wise checkpoint's {name} differs from one rank's by {diff}")
    print("dlrm tablewise: row-wise on 4 -> table-wise on 2 -> 1 rank follows the one-rank run")


PRESET_SETS = ["--set", 'partition.preset="dlrm"', "--set", "train.steps=20",
               "--set", "train.eval_every=0", "--set", "checkpoint.every_steps=0"]


def preset_specs(config, world):
    """The specs the dlrm preset should give on `world` ranks (fsdp = world): a table of at
    least min_sharding_size elements whose rows divide row-wise, everything else replicated.
    The tables' rows and dims and the threshold are read from the config."""
    with open(config, "rb") as f:
        doc = tomllib.load(f)
    model = doc["model"]
    threshold = doc["partition"]["min_sharding_size"]
    specs = {}
    for table in model["tables"]:
        n = table["rows"]
        dim = table.get("dim", model["bottom"][-1])  # the default: bottom's last size
        split = n * dim >= threshold and n % world == 0  # fsdp = -1: P(fsdp, None) at world 1 too
        specs[f"embeddings/{table['name']}/weight"] = "P(fsdp, None)" if split else "P()"
    return specs


def mode_preset(launcher, config, work):
    for world in (1, 2, 4):
        plan = subprocess.run([launcher[-1], "plan", config, "--world", str(world), "--json",
                               *PRESET_SETS], capture_output=True, text=True, cwd=work)
        if plan.returncode != 0:
            fail(f"meshtrain plan --world {world} failed: {plan.stdout}{plan.stderr}")
        doc = json.loads(plan.stdout)
        rules = [(r["pattern"], r["spec"]) for r in doc["rules"]]
        want_rules = [("^embeddings/[^/]+/weight$", ["fsdp", None]), (".*", [])]
        if rules != want_rules:
            fail(f"world {world}: the dlrm preset's rules are {rules}, not {want_rules}")
        want = preset_specs(config, world)
        for p in doc["parameters"]:
            spec = p["spec"]
            text = "P()" if not any(spec) else "P(fsdp, None)" if spec == ["fsdp", None] else spec
            expected = want.get(p["name"], "P()")  # the linear layers: replicated
            if text != expected:
                fail(f"world {world}: {p['name']} {p['shape']} has spec {spec}, not {expected} "
                     f"(notes: {p.get('notes')})")
        # The text form lists the same two rules.
        text = subprocess.run([launcher[-1], "plan", config, "--world", str(world), *PRESET_SETS],
                              capture_output=True, text=True, cwd=work).stdout
        if "rule 0 '^embeddings/[^/]+/weight$' -> P(fsdp, None)" not in text:
            fail(f"world {world}: the plan's text does not show the table rule:\n{text}")
    runs = {np_: train(launcher, np_, config, work, f"np{np_}", *PRESET_SETS) for np_ in (1, 2, 4)}
    ref_losses, ref_evals = runs[1]
    if sorted(ref_losses) != list(range(1, 21)) or len(ref_evals) != 1:
        fail(f"np 1 logged steps {sorted(ref_losses)} and {len(ref_evals)} evaluations, not steps "
             "1..20 and one")
    for np_ in (2, 4):
        losses, evals = runs[np_]
        for step, loss in ref_losses.items():
            if not close(losses.get(step, float("nan")), loss, 1e-5):
                fail(f"np {np_}: the loss of step {step} is {losses.get(step)}, np 1's {loss}")
        for key in ("test_auc", "test_log_loss"):
            if not abs(evals[-1][key] - ref_evals[-1][key]) <= 1e-4:
                fail(f"np {np_}: {key} {evals[-1][key]}, np 1's {ref_evals[-1][key]}")
    print(f"dlrm preset: the plan's specs at world 1, 2, 4; np 2 and 4 match np 1 (AUC "
          f"{ref_evals[-1]['test_auc']:.4f})")


def mode_bad_id(launcher, config, work):
    bad = os.path.join(work, "data", "bad.h5")
    shutil.copy(os.path.join(work, "data", "train.h5"), bad)
    with h5py.File(bad, "r+") as f:
        offsets = f["sparse/t24/offsets"][...]
        row = next(r for r in range(100, 20000) if offsets[r + 1] > offsets[r])
        f["sparse/t24/values"][offsets[row]] = 1623  # the table has 1618 rows
    done = run(launcher, 2, "train", work, config, "--set", 'run.output_dir="bad"',
               "--set", 'data.path="data/bad.h5"', "--set", "data.shuffle=false", expect=2)
    want = (f"sparse data file 'data/bad.h5', table 't24', global row {row}: id 1623 is "
            "outside the table's rows [0, 1618)")
    errors = [line for line in done.stderr.splitlines() if "meshtrain: error" in line]
    if len(errors) != 1 or want not in errors[0]:
        fail(f"expected one error line with {want!r}, got {done.stderr!r}")
    print(f"dlrm bad id: {errors[0]}")
    # data.sparse_key names the tables' group: moved to /features, the run reads them there,
    # and the default key then names the missing table, the file and the group it looked in.
    moved = os.path.join(work, "data", "moved.h5")
    shutil.copy(os.path.join(work, "data", "train.h5"), moved)
    with h5py.File(moved, "r+") as f:
        f.move("sparse", "features")
    sets = ["--set", 'data.path="data/moved.h5"', "--set", 'data.test_path="data/moved.h5"',
            "--set", "train.steps=2",
            "--set", "train.eval_every=0"]
    run(launcher, 2, "train", work, config, "--set", 'run.output_dir="moved"',
        "--set", 'data.sparse_key="/features"', *sets)
    done = run(launcher, 2, "train", work, config, "--set", 'run.output_dir="moved"', *sets,
               expect=2)
    want = "table 't00' is missing from sparse data file 'data/moved.h5' (no /sparse/t00)"
    errors = [line for line in done.stderr.splitlines() if "meshtrain: error" in line]
    if len(errors) != 1 or want not in errors[0]:
        fail(f"expected one error line with {want!r}, got {done.stderr!r}")
    print(f"dlrm sparse_key: read from /features; {errors[0]}")
    # Clipping needs the tables' whole gradients, which sparse updates never make.
    done = run(launcher, 2, "train", work, config, "--set", 'run.output_dir="clip"',
               "--set", 'optimizer.embeddings="rowwise_adagrad"', "--set", "optimizer.clip_norm=1",
               expect=2)
    want = ('optimizer.clip_norm = 1 cannot be used with optimizer.embeddings = '
            '"rowwise_adagrad" yet')
    errors = [line for line in done.stderr.splitlines() if "meshtrain: error" in line]
    if len(errors) != 1 or want not in errors[0]:
        fail(f"expected one error line with {want!r}, got {done.stderr!r}")
    print(f"dlrm clip_norm with sparse tables: {errors[0]}")


def mode_flight(launcher, config, work):
    out = os.path.join(work, "flightrun")
    mpiexec, meshtrain = launcher[:-1], launcher[-1]
    argv = [*mpiexec, "-np", "2", meshtrain, "train", config, "--set", f'run.output_dir="{out}"',
            "--set", "train.steps=100000000", "--set", "train.eval_every=0",
            "--set", "checkpoint.every_steps=0", "--set", "train.log_every=100000000"]
    job = subprocess.Popen(argv, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)

    def ranks():  # the meshtrain processes whose command line names this run's folder
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/comm") as f:
                    comm = f.read().strip()
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read().decode(errors="replace")
            except OSError:
                continue
            if comm == "meshtrain" and out in cmdline:
                found.append(int(pid))
        return sorted(found)

    def stop(message):
        for pid in ranks():
            os.kill(pid, signal.SIGKILL)
        job.kill()
        stdout, stderr = job.communicate()
        fail(f"{message}\n{stdout}{stderr}")

    def check_records(reason):
        for rank in (0, 1):
            path = os.path.join(out, "flight", f"rank-{rank}.json")
            record = {}
            for _ in range(100):
                try:
                    with open(path) as f:
                        record = json.load(f)
                    if record.get("reason") == reason:
                        break
                except (OSError, ValueError):
                    pass
                time.sleep(0.1)
            if record.get("reason") != reason:
                stop(f"{path}: no record written on {reason} (got {record.get('reason')!r})")
            entries = record["entries"]
            fsdp = {e["op"] for e in entries if e["group"] == "axis (fsdp)"}
            if "all_to_all_v" not in fsdp:
                stop(f"{path}: no all_to_all_v on axis (fsdp) among {len(entries)} entries "
                     f"(ops on fsdp: {sorted(fsdp)})")
            print(f"{path}: {reason}, {record['recorded']} collectives recorded")

    metrics = os.path.join(out, "metrics.jsonl")
    for _ in range(600):
        if os.path.exists(metrics) or job.poll() is not None:
            break
        time.sleep(0.1)
    if not os.path.exists(metrics):
        stop("the DLRM run did not start stepping within 60 s")
    time.sleep(1)
    pids = ranks()
    if len(pids) != 2:
        stop(f"expected 2 ranks, found {pids}")
    for pid in pids:
        os.kill(pid, signal.SIGUSR1)
    check_records("SIGUSR1")
    time.sleep(0.5)
    if ranks() != pids:
        stop("the run did not go on after SIGUSR1")
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    try:
        job.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        stop("the job did not end within 60 s of SIGTERM")
    if job.returncode == 0:
        fail("the job exited 0 after SIGTERM")
    check_records("SIGTERM")


def mode_trace(launcher, config, work):
    sets = ["--set", "train.steps=6", "--set", "train.log_every=1", "--set", "train.eval_every=0",
            "--set", 'optimizer.embeddings="rowwise_adagrad"', "--set",
            "optimizer.embeddings_lr=0.05"]
    plain, _ = train(launcher, 2, config, work, "untraced", *sets)
    for np_ in (1, 2, 4):
        out = f"traced{np_}"
        losses, _ = train(launcher, np_, config, work, out, *sets, "--set",
                          "runtime.trace_steps=[3, 5]")
        if np_ == 2 and losses != plain:
            fail(f"np 2: the traced run's losses {losses} differ from the untraced {plain}")
        folder = os.path.join(work, out, "trace")
        for name in ["all-ranks.json", "config.toml"] + [f"rank-{r}.json" for r in range(np_)]:
            if not os.path.isfile(os.path.join(folder, name)):
                fail(f"np {np_}: {folder} has no {name} ({sorted(os.listdir(folder))})")
        argv = [launcher[-1], "plan", config, "--world", str(np_), "--json", *sets]
        done = subprocess.run(argv, cwd=work, capture_output=True, text=True)
        if done.returncode != 0:
            fail(f"{' '.join(argv)} exited {done.returncode}: {done.stderr}")
        doc = json.loads(done.stdout)
        row_wise = [t for t in doc["embedding_tables"]["tables"]
                    if t["step"]["counts_all_to_all_bytes"] > 0]
        if np_ > 1 and not row_wise:
            fail(f"np {np_}: the plan places no table row-wise; the test needs one")
        # One exchange per communicator (EmbeddingExchange), in the order of its first table.
        # The communicator is that of the row axes of size > 1 (as ParallelContext::comm and the
        # plan make it): tables over (fsdp, dp) and (fsdp) share one when dp is 1.
        sizes = doc["mesh"]["axes"]
        groups = {}
        for t in row_wise:
            axes = tuple(a for a in t["row_axes"] if sizes[a] > 1)
            groups.setdefault(axes, []).append(t)
        groups = list(groups.values())
        if np_ == 2 and len(row_wise) < 2:
            fail(f"np 2: the plan places {len(row_wise)} table row-wise; the test needs two in "
                 "one group")
        with open(os.path.join(folder, "all-ranks.json")) as f:
            trace = json.load(f)
        events = trace["traceEvents"] if isinstance(trace, dict) else trace
        spans = [e for e in events if e.get("ph") == "X" and e.get("tid", 0) == 0]
        for rank in range(np_):
            mine = [e for e in spans if e["pid"] == rank]
            steps = sorted((e for e in mine if e["cat"] == "step"), key=lambda e: e["ts"])
            if [e["args"]["step"] for e in steps] != [3, 4, 5]:
                fail(f"np {np_}, rank {rank}: step spans {[e['args'] for e in steps]}, "
                     "expected steps 3, 4, 5")
            for step in steps:
                inside = sorted((e for e in mine if e is not step and
                                 step["ts"] <= e["ts"] <= step["ts"] + step["dur"]),
                                key=lambda e: e["ts"])
                phases = [e["name"] for e in inside if e["cat"] == "phase"]
                if phases != ["data read", "forward", "loss", "backward", "optimizer"]:
                    fail(f"np {np_}, rank {rank}, step {step['args']['step']}: phases {phases}")
                a2a = sorted((e for e in inside if e["cat"] == "collective" and
                              e["name"] == "all-to-all"), key=lambda e: e["ts"])
                if len(a2a) != 4 * len(groups):
                    fail(f"np {np_}, rank {rank}: {len(a2a)} all-to-all spans in a step, "
                         f"expected 4 for each of the {len(groups)} groups of the "
                         f"{len(row_wise)} row-wise tables")
                # Forward: counts, ids, sums per group in the groups' order; backward: the dy.
                for k, group in enumerate(groups):
                    got = a2a[3 * k]["args"]["bytes"]
                    want = sum(t["step"]["counts_all_to_all_bytes"] for t in group)
                    if got != want:
                        fail(f"np {np_}, rank {rank}: the counts all-to-all of tables "
                             f"{[t['table'] for t in group]} moved {got} bytes, the plan "
                             f"says {want}")
    # A run that ends inside its trace window (6 steps, steps 5 to 9 traced) still writes what
    # it recorded: steps 5 and 6.
    train(launcher, 2, config, work, "traced_past_end", *sets, "--set",
          "runtime.trace_steps=[5, 9]")
    folder = os.path.join(work, "traced_past_end", "trace")
    if not os.path.isfile(os.path.join(folder, "all-ranks.json")):
        fail(f"np 2, trace_steps [5, 9] in 6 steps: {folder} has no all-ranks.json "
             f"({sorted(os.listdir(folder)) if os.path.isdir(folder) else 'no folder'})")
    with open(os.path.join(folder, "all-ranks.json")) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    for rank in range(2):
        steps = sorted(e["args"]["step"] for e in events if e.get("ph") == "X" and
                       e.get("pid") == rank and e.get("cat") == "step")
        if steps != [5, 6]:
            fail(f"np 2, trace_steps [5, 9] in 6 steps, rank {rank}: step spans {steps}, "
                 "expected 5 and 6")


# The bf16 run's final test AUC against the fp32 run's (mode bf16: 40 steps of row-wise Adagrad
# on np 1, the same seed, data and batches; only the tables' storage differs). Measured on the
# build machine: 0.6855 (bf16) against 0.6834 (fp32), a difference of 0.0021. 0.005 allows about
# twice that for other machines' and seeds' rounding, and stays below the sampling error of an
# AUC over the 4,000 test rows (about 0.01): a difference past it is more than rounding noise,
# e.g. tables that stopped training (the AUC of the dense features alone is about 0.6).
BF16_AUC_TOLERANCE = 0.005
BF16_SETS = ["--set", 'model.table_dtype="bf16"', "--set", 'optimizer.embeddings="sparse_adamw"',
             "--set", "optimizer.embeddings_lr=0.01", "--set", "train.steps=20"]


def bf16_tables(path):
    """The tables of a checkpoint as uint16 bits, checked to be bf16 datasets."""
    out = {}
    with h5py.File(path, "r") as f:
        for name in f["params/embeddings"]:
            d = f[f"params/embeddings/{name}/weight"]
            if d.dtype != np.uint16 or d.attrs.get("dtype") not in ("bf16", b"bf16"):
                fail(f"{path}: {d.name} is {d.dtype} with dtype attribute "
                     f"{d.attrs.get('dtype')!r}, not uint16 with dtype = \"bf16\"")
            bits = d[...]
            values = (bits.astype(np.uint32) << 16).view(np.float32)
            if not np.all(np.isfinite(values)) or not values.any():
                fail(f"{path}: {d.name} holds non-finite or all-zero values")
            out[name] = bits
        for slot in ("sparse_adamw_m", "sparse_adamw_v", "rowwise_adagrad"):
            if f"opt_state/{slot}" in f:
                for name in f[f"opt_state/{slot}/embeddings"]:
                    d = f[f"opt_state/{slot}/embeddings/{name}/weight"]
                    if d.dtype != np.float32:
                        fail(f"{path}: {d.name} is {d.dtype}, not float32")
    if len(out) != 26:
        fail(f"{path} holds {len(out)} tables, not 26")
    return out


def mode_bf16(launcher, config, work):
    # Refusals, one sentence each: a value other than fp32 | bf16 (naming the file, the key and
    # the value), and bf16 with the dense optimizer.embeddings.
    for sets, words in ((['model.table_dtype="fp16"'], ["model.table_dtype", "fp16", "bf16"]),
                        (['model.table_dtype="bf16"', 'optimizer.embeddings="dense"'],
                         ["model.table_dtype", "optimizer.embeddings", "dense"])):
        argv = [x for s_ in sets for x in ("--set", s_)]
        done = run(launcher, 1, "train", work, config, *argv, expect=2)
        errors = [l for l in done.stderr.splitlines() if "error" in l]
        if len(errors) != 1 or not all(w in errors[0] for w in words + [os.path.basename(config)]):
            fail(f"{sets}: expected one error naming {words} and the config file, got:\n"
                 f"{done.stderr}")
    # The plan at world 2: a bf16 table is 2 bytes an element (its bytes per rank half the fp32
    # table's, in the parameters and in embedding_tables), its optimizer state and the dense
    # layers as with fp32 tables.
    plans = {}
    for dtype in ("fp32", "bf16"):
        done = subprocess.run([launcher[-1], "plan", config, "--world", "2", "--json", "--set",
                               f'model.table_dtype="{dtype}"', "--set",
                               'optimizer.embeddings="rowwise_adagrad"'],
                              capture_output=True, text=True, cwd=work)
        if done.returncode != 0:
            fail(f"meshtrain plan with table_dtype {dtype}: {done.stderr}")
        plans[dtype] = json.loads(done.stdout)
    params = {d: {p["name"]: p for p in plans[d]["parameters"]} for d in plans}
    tables = {d: {t["table"]: t for t in plans[d]["embedding_tables"]["tables"]} for d in plans}
    for name, p in params["fp32"].items():
        want = p["bytes_per_rank"] // 2 if name.startswith("embeddings/") else p["bytes_per_rank"]
        if params["bf16"][name]["bytes_per_rank"] != want:
            fail(f"plan with bf16 tables: {name} is {params['bf16'][name]['bytes_per_rank']} "
                 f"bytes per rank, not {want}")
    for table, t in tables["fp32"].items():
        b = tables["bf16"][table]
        if (b["weight_bytes_per_rank"] * 2 != t["weight_bytes_per_rank"] or
                b["optimizer_bytes_per_rank"] != t["optimizer_bytes_per_rank"]):
            fail(f"plan with bf16 tables: table {table} {b}, with fp32 tables {t}")
    if plans["bf16"]["totals"]["optimizer_bytes"] != plans["fp32"]["totals"]["optimizer_bytes"]:
        fail("plan with bf16 tables: the optimizer bytes changed")
    # The cost model's table passes: the table's rows read (lookups) and read and written (the
    # sparse optimizer's weight) at 2 bytes an element with bf16 tables, the sums, gradients and
    # optimizer state at 4: the optimizer pass of a dim-d table costs (2 * 2d + 3 * 4d + 8) /
    # (5 * 4d + 8) of fp32 tables' (each id's bytes; the ids are the same), the gradient scatter
    # the same, the lookups less.
    passes = {d: {(i["layer"], i["what"]): i["seconds"] for i in plans[d]["cost"]["items"]
                  if i["layer"].startswith("embeddings/")} for d in plans}
    dim = 8
    for (layer, what), fp32_s in passes["fp32"].items():
        bf16_s = passes["bf16"][(layer, what)]
        ok = {"sparse optimizer rows":
              lambda: abs(bf16_s / fp32_s - (16 * dim + 8) / (20 * dim + 8)) <= 1e-9,
              "gradient scatter": lambda: bf16_s == fp32_s,
              "lookups and pooling": lambda: bf16_s < fp32_s}.get(what, lambda: True)()
        if not ok:
            fail(f"plan with bf16 tables: {layer} {what} costs {bf16_s} s, {fp32_s} s with fp32")
    if not any(w == "sparse optimizer rows" for _, w in passes["fp32"]):
        fail("the plan's cost has no sparse optimizer pass")
    # The read-ahead's slots as the run makes them (dlrm_run.cpp's ReadAhead::Slot, data.prefetch
    # = 2 of them): per row its index, 13 dense floats and a label; per table the offsets
    # [rows + 1] and the ids [rows x the largest bag of the training file] (SparseHdf5Reader's
    # capacity found in the file), at the plan's local rows.
    with h5py.File(os.path.join(work, "data", "train.h5"), "r") as f:
        largest, names = 0, list(f["sparse"])
        for name in names:
            g = f["sparse"][name]
            if "ids" in g:
                largest = max(largest, g["ids"].shape[1])
            else:
                largest = max(largest, int(np.diff(g["offsets"][:]).max()))
    for dtype, doc in plans.items():
        rows = doc["local_batch_rows"]
        want = 2 * (rows * (8 + 4 * 13 + 4) + len(names) * 8 * (rows + 1) +
                    len(names) * 8 * rows * largest)
        if doc["totals"]["data_staging_bytes"] != want:
            fail(f"plan ({dtype} tables): data_staging_bytes {doc['totals']['data_staging_bytes']}, "
                 f"not {want} ({rows} rows, the largest bag {largest})")
    ref, ref_evals = train(launcher, 1, config, work, "np1", *BF16_SETS)
    ref_tables = bf16_tables(os.path.join(work, "np1", "checkpoints", "ckpt-000020.h5"))
    for np_ in (2, 4):
        losses, _ = train(launcher, np_, config, work, f"np{np_}", *BF16_SETS,
                          "--set", f"mesh.tp={np_}", *COLUMN_RULES)
        for step in range(1, 21):
            if losses.get(step) != ref[step]:
                fail(f"bf16 tables, np {np_} (tp {np_}): the loss of step {step} is "
                     f"{losses.get(step)}, np 1's {ref[step]} (not bit for bit)")
        got = bf16_tables(os.path.join(work, f"np{np_}", "checkpoints", "ckpt-000020.h5"))
        for name, bits in ref_tables.items():
            if got[name].tobytes() != bits.tobytes():
                diff = int(np.count_nonzero(got[name] != bits))
                fail(f"bf16 tables, np {np_}: table {name} after 20 steps differs from np 1's "
                     f"in {diff} elements")
    # `meshtrain evaluate` of np 1's bf16 checkpoint on 2 ranks: the training run's final AUC.
    done = run(launcher, 2, "evaluate", work, "np1/checkpoints", "--data", "data/test.h5",
               "--json", "-")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    if not abs(report["test_auc"] - ref_evals[-1]["test_auc"]) <= 1e-4:
        fail(f"evaluate of the bf16 checkpoint on np 2: test_auc {report['test_auc']}, the "
             f"training run's {ref_evals[-1]['test_auc']}")
    # The AUC with the train mode's 40 steps and row-wise Adagrad (where the model has learned
    # past what the dense features alone give), bf16 tables against fp32 ones.
    auc = {}
    for dtype in ("bf16", "fp32"):
        _, evals = train(launcher, 1, config, work, f"auc_{dtype}", "--set",
                         f'model.table_dtype="{dtype}"', "--set",
                         'optimizer.embeddings="rowwise_adagrad"', "--set",
                         "optimizer.embeddings_lr=0.05", "--set", "train.eval_every=0")
        auc[dtype] = evals[-1]["test_auc"]
    bf16_auc, fp32_auc = auc["bf16"], auc["fp32"]
    if not (bf16_auc > 0.66 and abs(bf16_auc - fp32_auc) <= BF16_AUC_TOLERANCE):
        fail(f"bf16 tables: the test AUC after 40 steps is {bf16_auc}, fp32 tables' {fp32_auc} "
             f"(within {BF16_AUC_TOLERANCE}, above 0.66)")
    print(f"dlrm bf16: np 2 and 4 (column-wise) equal np 1 bit for bit; AUC {bf16_auc:.4f} "
          f"(fp32 tables {fp32_auc:.4f})")


def mode_bf16_resume(launcher, config, work):
    sets = ["--set", 'model.table_dtype="bf16"', "--set", 'optimizer.embeddings="rowwise_adagrad"',
            "--set", "optimizer.embeddings_lr=0.05", "--set", "train.eval_every=0"]
    whole, _ = train(launcher, 2, config, work, "whole", *sets, "--set", "train.steps=20")
    train(launcher, 2, config, work, "parts", *sets, "--set", "train.steps=10")
    resumed, _ = train(launcher, 2, config, work, "parts", *sets, "--set", "train.steps=20",
                       "--set", "checkpoint.resume=true")
    for step in range(11, 21):
        if resumed.get(step) != whole[step]:
            fail(f"bf16 tables: the resumed run's loss of step {step} is {resumed.get(step)}, "
                 f"the uninterrupted run's {whole[step]}")
    a = tensors(os.path.join(work, "whole", "checkpoints", "ckpt-000020.h5"))
    b = tensors(os.path.join(work, "parts", "checkpoints", "ckpt-000020.h5"))
    bf16_tables(os.path.join(work, "whole", "checkpoints", "ckpt-000020.h5"))
    if sorted(a) != sorted(b):
        fail(f"the checkpoints hold other datasets: {sorted(a)} and {sorted(b)}")
    for name in a:
        if a[name].tobytes() != b[name].tobytes():
            fail(f"bf16 tables: {name} of the resumed run's step-20 checkpoint differs")
    step10 = os.path.join(work, "parts", "checkpoints", "ckpt-000010.h5")

    def resume_from(out, np_, checkpoint, *more):
        os.makedirs(os.path.join(work, out, "checkpoints"))
        shutil.copy(checkpoint, os.path.join(work, out, "checkpoints"))
        with open(os.path.join(work, out, "checkpoints", "latest"), "w") as f:
            f.write(os.path.basename(checkpoint) + "\n")
        losses, _ = train(launcher, np_, config, work, out, *sets, "--set", "train.steps=20",
                          "--set", "checkpoint.resume=true", *more)
        return losses

    moved = resume_from("moved", 4, step10)
    for step in range(11, 21):
        if not close(moved.get(step, float("nan")), whole[step], 1e-5):
            fail(f"bf16 tables resumed on 4 ranks: the loss of step {step} is {moved.get(step)}, "
                 f"the 2-rank run's {whole[step]}")
    widened = resume_from("widened", 2, step10, "--set", 'model.table_dtype="fp32"')
    if widened.get(11) != whole[11]:
        fail(f"a bf16 checkpoint resumed with fp32 tables: step 11's loss is {widened.get(11)}, "
             f"the bf16 run's {whole[11]} (the tables were not widened exactly)")
    with h5py.File(os.path.join(work, "widened", "checkpoints", "ckpt-000020.h5"), "r") as f:
        if f["params/embeddings/t25/weight"].dtype != np.float32:
            fail("a bf16 checkpoint resumed with fp32 tables saved them as "
                 f"{f['params/embeddings/t25/weight'].dtype}")
    fp32_sets = ["--set", 'model.table_dtype="fp32"']
    fp32, _ = train(launcher, 2, config, work, "fp32", *sets, *fp32_sets, "--set", "train.steps=11")
    rounded = resume_from("rounded", 2, os.path.join(work, "fp32", "checkpoints",
                                                     "ckpt-000010.h5"))
    if not close(rounded.get(11, float("nan")), fp32[11], 1e-4):
        fail(f"an fp32 checkpoint resumed with bf16 tables: step 11's loss is {rounded.get(11)}, "
             f"the fp32 run's {fp32[11]}")
    bf16_tables(os.path.join(work, "rounded", "checkpoints", "ckpt-000020.h5"))
    print(f"dlrm bf16 resume: steps 11..20 and {len(a)} datasets bit for bit; on 4 ranks within "
          f"1e-5; bf16 -> fp32 exact, fp32 -> bf16 step 11 {rounded[11]} vs {fp32[11]}")


def main():
    if len(sys.argv) < 7 or sys.argv[5] != "--":
        fail("usage: check_dlrm_train.py MODE SCRIPT CONFIG WORK_DIR -- MPIEXEC... MESHTRAIN")
    mode, script, config, work = sys.argv[1:5]
    for optimizer, slots in SPARSE.items():
        if mode.endswith("_" + optimizer):
            EXTRA_SETS.extend(["--set", f'optimizer.embeddings="{optimizer}"',
                               "--set", f"optimizer.embeddings_lr={SPARSE_LR[optimizer]}"])
            SLOTS.update(slots)
            mode = mode[: -len("_" + optimizer)]
    launcher = sys.argv[6:]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    make_data(script, work)
    {"train": mode_train, "resume": mode_resume, "bad_id": mode_bad_id,
     "columns": mode_columns, "tablewise": mode_tablewise, "flight": mode_flight,
     "preset": mode_preset, "trace": mode_trace, "bf16": mode_bf16,
     "bf16_resume": mode_bf16_resume}[mode](
        launcher, os.path.abspath(config), work)


if __name__ == "__main__":
    main()
