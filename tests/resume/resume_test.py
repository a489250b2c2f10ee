#!/usr/bin/env python3
"""End-to-end resume tests of `meshtrain train` under mpirun (docs/design.md, "Checkpoints (HDF5)" and "The command").

    resume_test.py CASE --meshtrain BIN --configs DIR --work DIR [--h5dump BIN] [--h5ls BIN]
                   [--optimizer adamw|sgd] [--preset fsdp] -- MPIEXEC [FLAGS...]

CASE is one of
  same_mesh     12 uninterrupted steps against 6 steps + a resumed run to step 12 on the
                same mesh: the losses of steps 7..12 and the final checkpoint's parameters
                and optimizer state are bit for bit the same.
  other_mesh    save at step 6 on np 4 (fsdp=2 x tp=2), resume on np 2 (dp) and np 1 (dp):
                the losses of steps 7..12 and the final parameters match the uninterrupted
                run to the stated tolerances.
  interrupted   a save killed half-way (MESHTRAIN_TEST_FAULT=after_dataset:2, through the
                test-only meshtrain_with_faults; on every rank or, with --fault-rank, on one) exits
                non-zero without hanging, leaves step 6 as `latest` and verifiable, and a
                third run resumes from it to the same losses as the uninterrupted run.
  inspect       `meshtrain inspect` prints a trainer checkpoint's step, mesh and config; a
                flipped byte in a parameter's data makes `inspect --verify` and a resuming
                `train` exit 2 naming the dataset.
  compatibility resuming with another run.seed, data.batch_size, data.shuffle, data.source,
                model.sizes or train.accumulation_steps exits 2 naming the key; a
                checkpoint at the run's last step has nothing to train, one past it exits
                2 naming train.steps.
  precision     [mixed_precision] changed across a resume: 6 steps in bf16 resumed in fp32 to
                step 12, and 6 in fp32 resumed in bf16: both resume (the checkpoint holds
                fp32 masters in either case) and their losses stay within 2% of the
                uninterrupted run in the first run's precision.
  moe_reshard   a model with an MoE layer (4 experts, top-2) saved at step 4 on np 4 with
                ep=4, resumed on np 2 (ep=2) to step 8 and saved, resumed on np 1 to step 12:
                every step's loss and the final parameters match the uninterrupted np-1 run
                to the stated tolerances (expert tensors are global arrays like the others).
  best          checkpoint.keep_best = "test_loss" with keep = 1 (--np N ranks): the save
                of a new best (step 12) dies at each fault point, aborting on every rank
                (--best-mode abort, synchronous) or with one rank SIGKILLed (--best-mode
                kill, asynchronous): `best` names a complete checkpoint that verifies and
                evaluates through the pointer to that file's numbers, `latest` a complete
                one, rotation removed neither; the resumed run ends with best = step 12
                beside latest = step 14 and nothing else. --points P1,P2 runs only those.
  best_metric   the checkpoint names its best's metric (h5dump); resumed under another
                checkpoint.keep_best the resume line says the best starts afresh, and the
                first evaluation after it becomes `best`.
  best_pointer  predict, evaluate and export given <dir>/best use the best checkpoint's
                file and step (12), not the latest's (14).
  schedule      a cosine schedule with warm-up and 2 accumulated micro-batches per step:
                resumed from step 2 (warm-up) and step 8 (decay) of one 12-step run, the
                rates, losses of the remaining steps and the final checkpoint are bit for
                bit those of the uninterrupted run.

--moe runs a case with that MoE model on a mesh of ep ranks (dp = 1, ep = -1; use it
with --preset dp).
--precision bf16|fp16 runs every case with param_dtype = reduce_dtype = that dtype (fp16:
its loss scale and clean-step count are part of the bit-exact resume).

Every run uses a small model (784-64-10), logs every step (metrics.jsonl holds each step's
loss) and writes under --work, which is emptied first. Exit status: 0 pass, 1 fail, 77 skip
(a needed HDF5 tool is missing).
"""

import argparse
import array
import json
import os
import re
import shutil
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
import script_test  # noqa: E402
from script_test import Failure  # noqa: E402  (multihost_test uses it as resume_test.Failure)

# A constant rate: the cases compare runs of different lengths (6 steps resumed to 12 against
# 12), and a decaying schedule is stretched to each run's length (the cosine case sets its own).
SMALL = ["--set", "model.sizes=[784, 64, 10]", "--set", "train.log_every=1",
         "--set", 'optimizer.schedule="constant"']
MOE = ["--set", "model.sizes=[784, 64, 64, 10]", "--set", "model.moe_layers=[1]",
       "--set", "model.experts=4", "--set", "model.top_k=2"]
# A run that hangs fails the test here (and ctest's TIMEOUT backs this up).
RUN_TIMEOUT_S = 60
# Other meshes reduce in another order: float32 rounding differs, the function does not.
LOSS_RTOL = 1e-4
PARAM_ATOL = 1e-5  # |a - b| <= PARAM_ATOL + PARAM_RTOL * |b| for every element
PARAM_RTOL = 1e-4


class Context(script_test.Checks):
    def __init__(self, args):
        super().__init__(args)
        self.configs = args.configs
        self.h5dump = args.h5dump
        self.h5ls = args.h5ls
        self.optimizer = args.optimizer
        self.sync = args.sync
        self.meshtrain_with_faults = args.meshtrain_with_faults or args.meshtrain
        self.fault_rank = args.fault_rank
        self.fault_action = args.fault_action
        self.precision = args.precision
        self.moe = getattr(args, "moe", False)  # other scripts build a Context too

    def config(self, preset):
        return os.path.join(self.configs, "fashion_mnist_%s.toml" % preset)

    def optimizer_sets(self):
        if self.optimizer == "sgd":
            return ["--set", 'optimizer.kind="sgd"', "--set", "optimizer.lr=0.05",
                    "--set", "optimizer.momentum=0.9"]
        return ["--set", 'optimizer.kind="adamw"']

    def async_sets(self):
        return ["--set", "checkpoint.async=false"] if self.sync else []

    def precision_sets(self):
        return precision_sets(self.precision)

    def moe_sets(self):
        return MOE + ["--set", "mesh.dp=1", "--set", "mesh.ep=-1"] if self.moe else []



def precision_sets(dtype):
    return ["--set", 'mixed_precision.param_dtype="%s"' % dtype,
            "--set", 'mixed_precision.reduce_dtype="%s"' % dtype]


def run(cmd, env_extra=None, timeout=RUN_TIMEOUT_S):
    """Runs a command; returns (status, stdout, stderr). A timeout is a failure. The fault
    hook's variables come from env_extra alone."""
    return script_test.run(cmd, timeout, env_extra, env_drop=(
        "MESHTRAIN_TEST_FAULT", "MESHTRAIN_TEST_FAULT_RANK", "MESHTRAIN_TEST_FAULT_ACTION"))


def train(ctx, np, preset, output_dir, steps, extra=(), env_extra=None, expect_status=0,
          program=None):
    """mpirun -np NP meshtrain train CONFIG ...; checks the exit status."""
    cmd = (ctx.mpiexec[:1] + ["-n", str(np)] + ctx.mpiexec[1:] +
           [program or ctx.meshtrain, "train", ctx.config(preset)] + SMALL +
           ctx.optimizer_sets() + ctx.async_sets() + ctx.precision_sets() + ctx.moe_sets() +
           ["--set", "train.steps=%d" % steps, "--set", 'run.output_dir="%s"' % output_dir] +
           list(extra))
    status, out, err = run(cmd, env_extra)
    ok = (status == expect_status if expect_status is not None else status != 0)
    if not ok:
        raise Failure("exit status %d, expected %s: %s\n--- stdout:\n%s\n--- stderr:\n%s" %
                      (status, expect_status if expect_status is not None else "non-zero",
                       " ".join(cmd), out[-4000:], err[-4000:]))
    return status, out, err


def losses(output_dir):
    """{step: loss as the JSON text} of the log events in OUTPUT_DIR/metrics.jsonl. A step
    logged twice (a run that crashed after it, then resumed, in an appended log) keeps the
    last value, the one of the run that continued."""
    result = {}
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        for line in f:
            # parse_float=str keeps the number's text: equal text <=> equal double.
            event = json.loads(line, parse_float=str)
            if event.get("event") != "log":
                continue
            result[event["step"]] = event["loss"]
    return result


def expect_losses(ctx, what, got, reference, steps, rtol=None):
    """The losses of `steps` in `got` equal `reference`'s (exactly, or to rtol relative)."""
    for step in steps:
        if not ctx.check(step in got, "%s: no loss logged for step %d" % (what, step)):
            continue
        a, b = got[step], reference[step]
        if rtol is None:
            ctx.check(a == b and float(a) == float(b),
                      "%s: step %d loss %s, uninterrupted run %s (must be identical)" %
                      (what, step, a, b))
        else:
            ctx.check(abs(float(a) - float(b)) <= rtol * abs(float(b)),
                      "%s: step %d loss %s differs from the uninterrupted run's %s by more "
                      "than %g relative" % (what, step, a, b, rtol))


def inspect(ctx, path, verify=False):
    cmd = [ctx.meshtrain, "inspect", path] + (["--verify"] if verify else [])
    return run(cmd)


def dataset_names(ctx, path, prefixes=("/params/", "/opt_state/")):
    """The datasets `meshtrain inspect` lists under the given groups."""
    status, out, err = inspect(ctx, path)
    if status != 0:
        raise Failure("meshtrain inspect %s exited %d: %s" % (path, status, err))
    names = [m.group(1) for m in re.finditer(r"^  (/\S+) +float32", out, re.M)]
    names = [n for n in names if n.startswith(prefixes)]
    if not names or not any(n.startswith("/params/") for n in names):
        raise Failure("meshtrain inspect %s lists no parameter datasets:\n%s" % (path, out))
    return names


def raw_dataset(ctx, path, name):
    """The bytes of one dataset as little-endian float32 (h5dump -b LE)."""
    out = os.path.join(ctx.work, "dump.bin")
    if os.path.exists(out):
        os.remove(out)
    status, _, err = run([ctx.h5dump, "-d", name, "-b", "LE", "-o", out, path])
    if status != 0 or not os.path.exists(out):
        raise Failure("h5dump -d %s %s failed (%d): %s" % (name, path, status, err))
    with open(out, "rb") as f:
        return f.read()


def floats(data):
    values = array.array("f")
    values.frombytes(data)
    if sys.byteorder != "little":
        values.byteswap()
    return values


def compare_checkpoints(ctx, what, got, reference, exact, prefixes=("/params/", "/opt_state/")):
    """Every dataset under `prefixes` of `reference` is in `got`, bit for bit or to tolerance."""
    names = dataset_names(ctx, reference, prefixes)
    ctx.check(dataset_names(ctx, got, prefixes) == names,
              "%s: %s and %s hold different datasets" % (what, got, reference))
    for name in names:
        a, b = raw_dataset(ctx, got, name), raw_dataset(ctx, reference, name)
        if exact:
            ctx.check(a == b, "%s: %s of %s differs from the uninterrupted run's (%s)" %
                      (what, name, got, reference))
            continue
        fa, fb = floats(a), floats(b)
        if not ctx.check(len(fa) == len(fb), "%s: %s has %d values, expected %d" %
                         (what, name, len(fa), len(fb))):
            continue
        worst = max(range(len(fa)), key=lambda i: abs(fa[i] - fb[i]) - PARAM_RTOL * abs(fb[i]))
        ctx.check(abs(fa[worst] - fb[worst]) <= PARAM_ATOL + PARAM_RTOL * abs(fb[worst]),
                  "%s: %s[%d] = %r, uninterrupted run %r (tolerance %g + %g relative)" %
                  (what, name, worst, fa[worst], fb[worst], PARAM_ATOL, PARAM_RTOL))


def read_latest(ckpt_dir):
    with open(os.path.join(ckpt_dir, "latest")) as f:
        return f.read().strip()


def need_tools(ctx, *tools):
    for tool in tools:
        if not getattr(ctx, tool):
            print("SKIP: %s not found (Debian: hdf5-tools)" % tool)
            sys.exit(77)


# --- The cases ----------------------------------------------------------------------------

def case_same_mesh(ctx, preset):
    need_tools(ctx, "h5dump")
    np = 2
    a = os.path.join(ctx.work, "uninterrupted")
    b = os.path.join(ctx.work, "resumed")
    train(ctx, np, preset, a, 12)
    train(ctx, np, preset, b, 6, ["--set", "checkpoint.every_steps=6"])
    ref = losses(a)
    ctx.check(sorted(ref) == list(range(1, 13)), "uninterrupted run logged steps %s" % sorted(ref))
    expect_losses(ctx, "first 6 steps", losses(b), ref, range(1, 7))
    _, out, _ = train(ctx, np, preset, b, 12,
                      ["--set", "checkpoint.every_steps=6", "--set", "checkpoint.resume=true"])
    ctx.check(re.search(r"resumed from \S*ckpt-000006\.h5 at step 6", out),
              "the second run does not say it resumed from step 6:\n" + out)
    expect_losses(ctx, "resumed run", losses(b), ref, range(7, 13))

    final_a = os.path.join(a, "checkpoints", "ckpt-000012.h5")
    final_b = os.path.join(b, "checkpoints", "ckpt-000012.h5")
    for path in (final_a, final_b):
        status, out, err = inspect(ctx, path, verify=True)
        ctx.check(status == 0, "meshtrain inspect --verify %s exited %d: %s" % (path, status, err))
        ctx.check("step: 12\n" in out and "optimizer_step=12" in out,
                  "%s is not at step 12 / optimizer step 12:\n%s" % (path, out))
        if ctx.precision == "fp16":
            ctx.check("loss scale: " in out, "%s records no loss scale:\n%s" % (path, out))
    ctx.check(read_latest(os.path.join(b, "checkpoints")) == "ckpt-000012.h5",
              "latest does not name ckpt-000012.h5 after the resumed run")
    compare_checkpoints(ctx, "final checkpoint", final_b, final_a, exact=True)


def case_schedule(ctx, preset):
    """A cosine schedule with 4 warm-up steps over 12 steps (and 2 accumulated
    micro-batches per step): runs resumed from the checkpoint of step 2 (in the warm-up) and
    of step 8 (in the cosine decay) of the same run log the rates and losses of the
    uninterrupted run bit for bit, and end with its final checkpoint."""
    need_tools(ctx, "h5dump")
    np = 2
    schedule = ["--set", 'optimizer.schedule="cosine"', "--set", "optimizer.warmup_steps=4",
                "--set", "optimizer.min_lr=1e-4", "--set", "train.accumulation_steps=2",
                "--set", "data.batch_size=64", "--set", "data.eval_batch_size=500"]
    a = os.path.join(ctx.work, "uninterrupted")
    train(ctx, np, preset, a, 12,
          schedule + ["--set", "checkpoint.every_steps=2", "--set", "checkpoint.keep=6"])
    ref = losses(a)
    rates = learning_rates(a)
    ctx.check(sorted(ref) == list(range(1, 13)), "uninterrupted run logged steps %s" % sorted(ref))
    ctx.check(len(set(rates.values())) == 12, "the rate does not change every step: %s" % rates)
    for step in (2, 8):
        b = os.path.join(ctx.work, "resumed_at_%d" % step)
        ckpt = os.path.join(b, "checkpoints")
        os.makedirs(ckpt)
        name = "ckpt-%06d.h5" % step
        shutil.copy(os.path.join(a, "checkpoints", name), os.path.join(ckpt, name))
        with open(os.path.join(ckpt, "latest"), "w") as f:
            f.write(name + "\n")
        _, out, _ = train(ctx, np, preset, b, 12, schedule + ["--set", "checkpoint.resume=true"])
        what = "resumed at step %d" % step
        ctx.check(re.search(r"resumed from \S*%s at step %d" % (re.escape(name), step), out),
                  "%s: the run does not say it resumed:\n%s" % (what, out))
        expect_losses(ctx, what, losses(b), ref, range(step + 1, 13))
        got = learning_rates(b)
        for s in range(step + 1, 13):
            ctx.check(got.get(s) == rates[s], "%s: step %d rate %s, uninterrupted run %s" %
                      (what, s, got.get(s), rates[s]))
        compare_checkpoints(ctx, what + ", final checkpoint",
                            os.path.join(ckpt, "ckpt-000012.h5"),
                            os.path.join(a, "checkpoints", "ckpt-000012.h5"), exact=True)


def case_precision(ctx, preset):
    np = 2
    for first, then in (("bf16", "fp32"), ("fp32", "bf16")):
        a = os.path.join(ctx.work, "uninterrupted_" + first)
        b = os.path.join(ctx.work, first + "_then_" + then)
        train(ctx, np, preset, a, 12, precision_sets(first))
        train(ctx, np, preset, b, 6, ["--set", "checkpoint.every_steps=6"] + precision_sets(first))
        _, out, _ = train(ctx, np, preset, b, 12,
                          ["--set", "checkpoint.every_steps=6", "--set", "checkpoint.resume=true"] +
                          precision_sets(then))
        ctx.check(re.search(r"resumed from \S*ckpt-000006\.h5 at step 6", out),
                  "%s then %s: the second run does not say it resumed from step 6:\n%s" %
                  (first, then, out))
        expect_losses(ctx, "%s resumed in %s" % (first, then), losses(b), losses(a), range(7, 13),
                      rtol=2e-2)


def learning_rates(output_dir):
    """{step: "lr" as the JSON text} of the log events in OUTPUT_DIR/metrics.jsonl."""
    result = {}
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        for line in f:
            event = json.loads(line, parse_float=str)
            if event.get("event") == "log" and "lr" in event:
                result[event["step"]] = event["lr"]
    return result


def case_other_mesh(ctx):
    need_tools(ctx, "h5dump")
    ref_dir = os.path.join(ctx.work, "uninterrupted_np1")
    saved = os.path.join(ctx.work, "fsdp_tp_np4")
    train(ctx, 1, "dp", ref_dir, 12)
    _, out, _ = train(ctx, 4, "fsdp_tp", saved, 6, ["--set", "checkpoint.every_steps=6"])
    ctx.check("fsdp=2" in out and "tp=2" in out, "np 4 fsdp_tp is not fsdp=2 x tp=2:\n" + out)
    ref = losses(ref_dir)
    expect_losses(ctx, "np 4 fsdp x tp, first 6 steps", losses(saved), ref, range(1, 7),
                  LOSS_RTOL)
    status, out, _ = inspect(ctx, os.path.join(saved, "checkpoints", "ckpt-000006.h5"))
    ctx.check(re.search(r"^mesh: dp=1 fsdp=2 ep=1 tp=2 sp=1 \(4 ranks\)$", out, re.M),
              "the checkpoint's mesh is not fsdp=2 x tp=2 on 4 ranks:\n" + out)
    final_ref = os.path.join(ref_dir, "checkpoints", "ckpt-000012.h5")
    for np in (2, 1):
        what = "resumed on np %d (dp)" % np
        out_dir = os.path.join(ctx.work, "resumed_dp_np%d" % np)
        ckpt_dir = os.path.join(out_dir, "checkpoints")
        shutil.copytree(os.path.join(saved, "checkpoints"), ckpt_dir)
        _, out, _ = train(ctx, np, "dp", out_dir, 12,
                          ["--set", 'checkpoint.dir="%s"' % ckpt_dir,
                           "--set", "checkpoint.resume=true"])
        ctx.check(re.search(r"resumed from \S*ckpt-000006\.h5 at step 6 \(saved on "
                            r"dp=1 fsdp=2 ep=1 tp=2 sp=1\)", out),
                  "%s: does not say it resumed from the np 4 step-6 checkpoint:\n%s" % (what, out))
        got = losses(out_dir)
        ctx.check(sorted(got) == list(range(7, 13)),
                  "%s: logged steps %s, expected 7..12" % (what, sorted(got)))
        expect_losses(ctx, what, got, ref, range(7, 13), LOSS_RTOL)
        compare_checkpoints(ctx, what + ", final parameters",
                            os.path.join(ckpt_dir, "ckpt-000012.h5"), final_ref, exact=False,
                            prefixes=("/params/",))


def case_moe_reshard(ctx):
    need_tools(ctx, "h5dump")
    ctx.moe = True
    ref_dir = os.path.join(ctx.work, "uninterrupted_np1")
    train(ctx, 1, "dp", ref_dir, 12)
    ref = losses(ref_dir)
    ckpt_dir = os.path.join(ctx.work, "checkpoints")
    every = ["--set", "checkpoint.every_steps=4", "--set", 'checkpoint.dir="%s"' % ckpt_dir]
    resume = ["--set", "checkpoint.resume=true"]
    previous = None
    for np, steps in ((4, 4), (2, 8), (1, 12)):
        what = "ep=%d (np %d)" % (np, np)
        out_dir = os.path.join(ctx.work, "ep%d" % np)
        _, out, _ = train(ctx, np, "dp", out_dir, steps, every + (resume if previous else []))
        if np > 1:
            ctx.check("ep=%d" % np in out and "MoE in 64 -> out 64" in out,
                      "%s: not an MoE run over ep=%d:\n%s" % (what, np, out))
        if previous:
            ctx.check(re.search(r"resumed from \S*ckpt-%06d\.h5 at step %d \(saved on "
                                r"dp=1 fsdp=1 ep=%d tp=1 sp=1\)" % (previous[1], previous[1],
                                                                     previous[0]), out),
                      "%s: does not say it resumed from the ep=%d step-%d checkpoint:\n%s" %
                      (what, previous[0], previous[1], out))
        first = previous[1] + 1 if previous else 1
        got = losses(out_dir)
        ctx.check(sorted(got) == list(range(first, steps + 1)),
                  "%s: logged steps %s, expected %d..%d" % (what, sorted(got), first, steps))
        expect_losses(ctx, what, got, ref, range(first, steps + 1), LOSS_RTOL)
        previous = (np, steps)
    compare_checkpoints(ctx, "final parameters after ep 4 -> 2 -> 1",
                        os.path.join(ckpt_dir, "ckpt-000012.h5"),
                        os.path.join(ref_dir, "checkpoints", "ckpt-000012.h5"), exact=False,
                        prefixes=("/params/",))


def case_interrupted(ctx, preset):
    np = 2
    a = os.path.join(ctx.work, "uninterrupted")
    b = os.path.join(ctx.work, "interrupted")
    ckpt_dir = os.path.join(b, "checkpoints")
    resume = ["--set", "checkpoint.every_steps=6", "--set", "checkpoint.resume=true"]
    train(ctx, np, preset, a, 12)
    train(ctx, np, preset, b, 6, ["--set", "checkpoint.every_steps=6"])
    ctx.check(read_latest(ckpt_dir) == "ckpt-000006.h5", "latest does not name step 6")
    # The second run trains 7..12, then dies while writing step 12's second dataset.
    fault = {"MESHTRAIN_TEST_FAULT": "after_dataset:2",
             "MESHTRAIN_TEST_FAULT_ACTION": ctx.fault_action}
    if ctx.fault_rank is not None:
        fault["MESHTRAIN_TEST_FAULT_RANK"] = str(ctx.fault_rank)
    status, out, err = train(ctx, np, preset, b, 12, resume, env_extra=fault,
                             expect_status=None, program=ctx.meshtrain_with_faults)
    print("the save killed at after_dataset:2 ended the job with exit status %d" % status)
    ctx.check("fault injected" in out + err, "no 'fault injected' message:\n" + out + err)
    ctx.check(read_latest(ckpt_dir) == "ckpt-000006.h5",
              "after the interrupted save latest names %r, expected ckpt-000006.h5" %
              read_latest(ckpt_dir))
    ctx.check(not os.path.exists(os.path.join(ckpt_dir, "ckpt-000012.h5")),
              "the interrupted save left a complete-looking ckpt-000012.h5")
    status, out, err = inspect(ctx, os.path.join(ckpt_dir, "ckpt-000006.h5"), verify=True)
    ctx.check(status == 0 and "step: 6\n" in out,
              "inspect --verify of step 6 after the crash exited %d:\n%s%s" % (status, out, err))
    # The third run resumes from step 6 and ends where the uninterrupted run ended.
    _, out, _ = train(ctx, np, preset, b, 12, resume)
    ctx.check(re.search(r"resumed from \S*ckpt-000006\.h5 at step 6", out),
              "the third run does not say it resumed from step 6:\n" + out)
    expect_losses(ctx, "run after the crash", losses(b), losses(a), range(7, 13))
    ctx.check(read_latest(ckpt_dir) == "ckpt-000012.h5", "latest does not name step 12 at the end")
    leftovers = [n for n in os.listdir(ckpt_dir) if n.endswith(".tmp")]
    ctx.check(not leftovers, "the crashed save's temporary files remain: %s" % leftovers)
    status, _, err = inspect(ctx, os.path.join(ckpt_dir, "ckpt-000012.h5"), verify=True)
    ctx.check(status == 0, "inspect --verify of step 12 exited %d: %s" % (status, err))
    if ctx.h5dump:
        compare_checkpoints(ctx, "final checkpoint", os.path.join(ckpt_dir, "ckpt-000012.h5"),
                            os.path.join(a, "checkpoints", "ckpt-000012.h5"), exact=True)


def data_address(ctx, path, dataset):
    """File offset and size of the stored data of a contiguous `dataset` (h5ls -v -a)."""
    status, out, err = run([ctx.h5ls, "-v", "-a", path + dataset])
    if status != 0:
        raise Failure("h5ls -v -a %s%s failed (%d): %s" % (path, dataset, status, err))
    address = re.search(r"^\s*Address:\s+(\d+)", out, re.M)
    size = re.search(r"^\s*Storage:\s+(\d+) logical bytes", out, re.M)
    if not address or not size:
        raise Failure("cannot find the data address in h5ls' output:\n" + out)
    return int(address.group(1)), int(size.group(1))


def case_inspect(ctx, preset):
    need_tools(ctx, "h5ls")
    np = 2
    run_dir = os.path.join(ctx.work, "run")
    train(ctx, np, preset, run_dir, 6, ["--set", "run.name=resume-inspect"])
    path = os.path.join(run_dir, "checkpoints", "ckpt-000006.h5")
    status, out, err = inspect(ctx, path, verify=True)
    ctx.check(status == 0, "inspect --verify exited %d: %s" % (status, err))
    for pattern in [r"^step: 6$",
                    r"^mesh: dp=1 fsdp=2 ep=1 tp=1 sp=1 \(2 ranks\)$",
                    r"^  /params/layers/0/weight +float32  \[784, 64\]  P\(fsdp, None\)",
                    r"^  /opt_state/\w+/layers/1/bias +float32  \[10\]",
                    r"^config:$",
                    r"^  +name = [\"']resume-inspect[\"']$",
                    r"^  +sizes = \[ 784, 64, 10 \]$|^  +sizes = \[784, 64, 10\]$",
                    r"^  +steps = 6$",
                    r"^verify: \d+ datasets read, all checksums match$"]:
        ctx.check(re.search(pattern, out, re.M),
                  "inspect output does not match /%s/:\n%s" % (pattern, out))

    # Flip one byte in the middle of the weight's stored data, in a copy.
    bad_dir = os.path.join(ctx.work, "corrupt")
    shutil.copytree(os.path.join(run_dir, "checkpoints"), bad_dir)
    bad = os.path.join(bad_dir, "ckpt-000006.h5")
    dataset = "/params/layers/0/weight"
    address, size = data_address(ctx, bad, dataset)
    with open(bad, "r+b") as f:
        f.seek(address + size // 2)
        byte = f.read(1)
        f.seek(address + size // 2)
        f.write(bytes([byte[0] ^ 0x5A]))

    status, out, err = inspect(ctx, bad, verify=True)
    ctx.check(status == 2, "inspect --verify of a corrupt checkpoint exited %d, expected 2" %
              status)
    ctx.check(re.search(r"^meshtrain: error: .*" + re.escape(dataset), err) and
              err.count("\n") == 1,
              "inspect --verify does not report the corrupt dataset in one line:\n" + err)

    status, out, err = train(ctx, np, preset, os.path.join(ctx.work, "resume_corrupt"), 12,
                             ["--set", 'checkpoint.dir="%s"' % bad_dir,
                              "--set", "checkpoint.resume=true"], expect_status=2)
    # The load fails on every rank alike; the message may name the rank that printed it.
    ctx.check(re.search(r"^meshtrain: error( on rank \d+)?: .*" + re.escape(dataset) +
                        r".*corrupt", err, re.M),
              "train does not name the corrupt dataset:\n" + err)
    errors = [l for l in err.splitlines() if l.startswith("meshtrain: error")]
    ctx.check(len(errors) == 1, "train printed %d error lines, expected one sentence for the "
              "job:\n%s" % (len(errors), err))
    ctx.check("resumed from" not in out, "train resumed from a corrupt checkpoint:\n" + out)
    ctx.check(not os.path.exists(os.path.join(ctx.work, "resume_corrupt", "metrics.jsonl")) or
              not losses(os.path.join(ctx.work, "resume_corrupt")),
              "train logged steps after failing to load the corrupt checkpoint")

    # Resuming a model of another shape is bad input naming model.sizes and both values.
    status, out, err = train(ctx, np, preset, os.path.join(ctx.work, "resume_other_shape"), 12,
                             ["--set", 'checkpoint.dir="%s"' % os.path.dirname(path),
                              "--set", "checkpoint.resume=true",
                              "--set", "model.sizes=[784, 32, 10]"], expect_status=2)
    ctx.check(re.search(r"^meshtrain: error( on rank \d+)?: .*model\.sizes = \[784, 64, 10\].*"
                        r"model\.sizes = \[784, 32, 10\]", err, re.M),
              "train does not name model.sizes and both values:\n" + err)
    errors = [l for l in err.splitlines() if l.startswith("meshtrain: error")]
    ctx.check(len(errors) == 1, "train printed %d error lines for a shape mismatch, expected "
              "one sentence for the job:\n%s" % (len(errors), err))


def case_compatibility(ctx, preset):
    """A resumed run keeps the saved run's data order and model (issue 9, bug 3)."""
    np = 2
    saved = os.path.join(ctx.work, "saved")
    train(ctx, np, preset, saved, 6)
    ckpt = os.path.join(saved, "checkpoints")
    resume = ["--set", 'checkpoint.dir="%s"' % ckpt, "--set", "checkpoint.resume=true"]
    changes = [("run.seed", ["--set", "run.seed=1"], "0", "1"),
               ("data.batch_size", ["--set", "data.batch_size=64"], "128", "64"),
               ("data.shuffle", ["--set", "data.shuffle=false"], "true", "false"),
               ("data.source", ["--set", 'data.source="synthetic"', "--set", 'model.loss="mse"',
                                 "--set", 'checkpoint.keep_best="test_loss"'],
                '"fashion_mnist"', '"synthetic"'),
               ("model.sizes", ["--set", "model.sizes=[784, 32, 10]"], "[784, 64, 10]",
                "[784, 32, 10]"),
               ("train.accumulation_steps", ["--set", "train.accumulation_steps=2"], "1", "2")]
    for key, sets, was, now in changes:
        status, out, err = train(ctx, np, preset, os.path.join(ctx.work, "changed_" + key), 12,
                                 resume + sets, expect_status=None)
        ctx.check(status == 2, "resuming with another %s exited %d, expected 2" % (key, status))
        errors = [l for l in err.splitlines() if l.startswith("meshtrain: error")]
        pattern = (r"^meshtrain: error: checkpoint '\S*ckpt-000006\.h5' was saved by a run with " +
                   re.escape("%s = %s" % (key, was)) + r" but \S+ has " +
                   re.escape("%s = %s" % (key, now)))
        ctx.check(len(errors) == 1 and re.search(pattern, errors[0]),
                  "resuming with another %s: expected one error line matching /%s/:\n%s" %
                  (key, pattern, err))
        ctx.check("resumed from" not in out, "resumed despite another %s:\n%s" % (key, out))

    # At the run's last step there is nothing to train (not "done: -N steps")...
    _, out, _ = train(ctx, np, preset, os.path.join(ctx.work, "at_end"), 6, resume)
    ctx.check(re.search(r"^done: the checkpoint is at step 6, the last step of the run: "
                        r"nothing to train$", out, re.M) and "done: -" not in out,
              "resuming at the last step does not say there is nothing to train:\n" + out)
    # ...and past it the run is refused naming train.steps.
    _, out, err = train(ctx, np, preset, os.path.join(ctx.work, "past_end"), 4, resume,
                        expect_status=2)
    errors = [l for l in err.splitlines() if l.startswith("meshtrain: error")]
    ctx.check(len(errors) == 1 and re.search(r"is at step 6, past the last step 4 .*"
                                             r"train\.steps = 4", errors[0]),
              "resuming past the last step is not one error naming train.steps:\n" + err)
    ctx.check("done: -" not in out, "resuming past the last step printed:\n" + out)


# --- checkpoint.keep_best (issue 26, item 5) ----------------------------------------------
# A constant lr of 0.03 makes the test loss fall until step 12 and rise at step 14 (asserted):
# evaluations every 2 steps, a save every 3 and at each new best, keep = 1.
BEST = ["--set", "optimizer.lr=0.03", "--set", "train.eval_every=2",
        "--set", "checkpoint.every_steps=3", "--set", "checkpoint.keep=1",
        "--set", 'checkpoint.keep_best="test_loss"', "--set", "checkpoint.resume=true"]


def eval_losses(output_dir):
    """{step: test loss} of the eval events (a step evaluated twice keeps the last)."""
    result = {}
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        for line in f:
            event = json.loads(line)
            if event.get("event") == "eval":
                result[event["step"]] = event["test_loss"]
    return result


def read_pointer(ckpt_dir, name):
    path = os.path.join(ckpt_dir, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read().strip()


def checkpoint_files(ckpt_dir):
    return sorted(n for n in os.listdir(ckpt_dir) if n.endswith(".h5"))


def evaluate_json(ctx, np, checkpoint, data):
    """mpirun -np NP meshtrain evaluate CHECKPOINT --data DATA --json -: the JSON object."""
    cmd = (ctx.mpiexec[:1] + ["-n", str(np)] + ctx.mpiexec[1:] +
           [ctx.meshtrain, "evaluate", checkpoint, "--data", data, "--json", "-"])
    status, out, err = run(cmd)
    if status != 0:
        raise Failure("meshtrain evaluate %s exited %d:\n%s" % (checkpoint, status, err))
    return json.loads(out)


def expect_best(ctx, what, np, ckpt_dir, step, data):
    """`best` names ckpt-<step>.h5, which exists, verifies, and evaluates (through the
    pointer) to exactly the numbers of that file."""
    name = "ckpt-%06d.h5" % step
    best = read_pointer(ckpt_dir, "best")
    if not ctx.check(best == name, "%s: best names %r, expected %s" % (what, best, name)):
        return
    path = os.path.join(ckpt_dir, name)
    if not ctx.check(os.path.exists(path), "%s: %s, named by best, is missing" % (what, name)):
        return
    status, out, err = inspect(ctx, path, verify=True)
    ctx.check(status == 0 and ("step: %d\n" % step) in out,
              "%s: inspect --verify of best (%s) exited %d:\n%s%s" % (what, name, status, out, err))
    by_pointer = evaluate_json(ctx, np, os.path.join(ckpt_dir, "best"), data)
    # Runs are deterministic: the file of a step evaluates alike in every case (once each).
    if step not in ctx.evaluated:
        ctx.evaluated[step] = evaluate_json(ctx, np, path, data)
    by_file = ctx.evaluated[step]
    ctx.check(by_pointer.get("step") == step,
              "%s: evaluate on best reports step %s, expected %d" %
              (what, by_pointer.get("step"), step))
    ctx.check(by_pointer == by_file,
              "%s: evaluate on best gives %s, on %s %s" % (what, by_pointer, name, by_file))


def best_data(ctx, write_hdf5):
    """An HDF5 file of 200 rows of 784 features and labels of 10 classes, for evaluate and
    predict."""
    if not write_hdf5:
        raise Failure("the best cases need --write-hdf5")
    path = os.path.join(ctx.work, "data.h5")
    status, _, err = run([write_hdf5, path, "200", "784", "10"])
    if status != 0:
        raise Failure("%s failed (%d): %s" % (write_hdf5, status, err))
    return path


def case_best(ctx, preset, np, mode, data, points):
    """A save that would become the new best (step 12, the run's best test loss) dies at
    each fault point: synchronous saves aborting on every rank (mode "abort"), or
    asynchronous saves with one rank SIGKILLed (mode "kill"). `best` then names a complete,
    verified checkpoint that evaluates to its own numbers (step 10, or step 12 once its
    pointer was written), `latest` a complete one, and rotation (keep = 1) has removed
    neither; the resumed run ends with best = step 12 and latest = step 14, the only files."""
    need_tools(ctx, "h5dump")
    last = np - 1
    ctx.evaluated = {}
    if mode == "abort":
        ctx.sync = True
        # (point, rank, (best, latest) after the fault)
        faults = [("after_dataset:1", None, (10, 10)), ("before_close", None, (10, 10)),
                  ("before_rename", None, (10, 10)), ("before_best", None, (10, 10)),
                  ("before_latest", None, (12, 10)), ("before_cleanup", None, (12, 12))]
    else:
        # The writer threads write the file; rank 0's finisher renames and writes pointers.
        faults = [("after_dataset:2", last, (10, 10)), ("before_rename", 0, (10, 10)),
                  ("before_best", 0, (10, 10)), ("before_latest", 0, (12, 10))]
    if points:
        faults = [f for f in faults if f[0] in points]
        if len(faults) != len(points):
            raise Failure("--points %s: not all are fault points of mode %s" % (points, mode))
    base = os.path.join(ctx.work, "to_step_10")
    train(ctx, np, preset, base, 10, BEST)
    for point, rank, (best_step, latest_step) in faults:
        failures = len(ctx.failures)
        what = "%s at %s%s" % (mode, point, "" if rank is None else " on rank %d" % rank)
        out_dir = os.path.join(ctx.work, point.replace(":", "_"))
        shutil.copytree(base, out_dir)
        ckpt = os.path.join(out_dir, "checkpoints")
        fault = {"MESHTRAIN_TEST_FAULT": point,
                 "MESHTRAIN_TEST_FAULT_ACTION": "abort" if mode == "abort" else "kill"}
        if rank is not None:
            fault["MESHTRAIN_TEST_FAULT_RANK"] = str(rank)
        _, out, err = train(ctx, np, preset, out_dir, 14, BEST, env_extra=fault,
                            expect_status=None, program=ctx.meshtrain_with_faults)
        ctx.check("fault injected at %s" % point.split(":")[0] in out + err,
                  "%s: no 'fault injected' message:\n%s%s" % (what, out, err))
        ctx.check(not os.path.exists(os.path.join(ckpt, "ckpt-000014.h5")),
                  "%s: the run went on past the fault" % what)
        expect_best(ctx, what, np, ckpt, best_step, data)
        latest = "ckpt-%06d.h5" % latest_step
        ctx.check(read_pointer(ckpt, "latest") == latest,
                  "%s: latest names %r, expected %s" % (what, read_pointer(ckpt, "latest"), latest))
        status, _, err = inspect(ctx, os.path.join(ckpt, latest), verify=True)
        ctx.check(status == 0, "%s: inspect --verify of latest exited %d: %s" % (what, status, err))
        ctx.check("ckpt-000010.h5" in checkpoint_files(ckpt),
                  "%s: the previous best ckpt-000010.h5 was removed: %s" %
                  (what, checkpoint_files(ckpt)))
        # The resumed run completes; step 12 is the best again and survives the step-14 save.
        train(ctx, np, preset, out_dir, 14, BEST)
        evals = eval_losses(out_dir)
        ctx.check(min(evals, key=evals.get) == 12 and evals[14] > evals[12],
                  "%s: the test losses %s do not have their minimum at step 12 and rise at "
                  "step 14: best and latest are not told apart" % (what, evals))
        expect_best(ctx, what + ", resumed", np, ckpt, 12, data)
        ctx.check(read_pointer(ckpt, "latest") == "ckpt-000014.h5",
                  "%s, resumed: latest names %r" % (what, read_pointer(ckpt, "latest")))
        ctx.check(checkpoint_files(ckpt) == ["ckpt-000012.h5", "ckpt-000014.h5"],
                  "%s, resumed: keep = 1 with best left %s, expected ckpt-000012.h5 (best) and "
                  "ckpt-000014.h5" % (what, checkpoint_files(ckpt)))
        leftovers = [n for n in os.listdir(ckpt) if n.endswith(".tmp")]
        ctx.check(not leftovers, "%s, resumed: temporary files remain: %s" % (what, leftovers))
        if len(ctx.failures) == failures:
            print("ok: best at %s" % what)


def h5_attribute(ctx, path, name):
    """The value text of the root attribute NAME of PATH (h5dump -a)."""
    status, out, err = run([ctx.h5dump, "-a", "/" + name, path])
    if status != 0:
        raise Failure("h5dump -a /%s %s failed (%d): %s" % (name, path, status, err))
    m = re.search(r"\(0\): (.*)$", out, re.M)
    if not m:
        raise Failure("h5dump shows no value of /%s:\n%s" % (name, out))
    return m.group(1).strip().strip('"')


def case_best_pointer(ctx, preset, np, data):
    """`predict`, `evaluate` and `export` given <dir>/best use the best checkpoint (step 12),
    not the latest (step 14): predict's attributes step and checkpoint, evaluate's JSON (equal
    to evaluating ckpt-000012.h5 itself), the ONNX model's metadata step and checkpoint."""
    need_tools(ctx, "h5dump")
    out_dir = os.path.join(ctx.work, "run")
    train(ctx, np, preset, out_dir, 14, BEST)
    ckpt = os.path.join(out_dir, "checkpoints")
    evals = eval_losses(out_dir)
    ctx.check(min(evals, key=evals.get) == 12 and evals[14] > evals[12],
              "the test losses %s do not have their minimum at step 12 and rise at step 14: "
              "best and latest are not told apart" % evals)
    ctx.check(read_pointer(ckpt, "best") == "ckpt-000012.h5" and
              read_pointer(ckpt, "latest") == "ckpt-000014.h5",
              "best names %r and latest %r, expected ckpt-000012.h5 and ckpt-000014.h5" %
              (read_pointer(ckpt, "best"), read_pointer(ckpt, "latest")))
    best = os.path.join(ckpt, "best")
    best_file = os.path.join(ckpt, "ckpt-000012.h5")
    mpi = ctx.mpiexec[:1] + ["-n", str(np)] + ctx.mpiexec[1:]

    by_pointer = evaluate_json(ctx, np, best, data)
    ctx.check(by_pointer.get("step") == 12,
              "evaluate on best reports step %s, expected 12" % by_pointer.get("step"))
    by_file = evaluate_json(ctx, np, best_file, data)
    ctx.check(by_pointer == by_file,
              "evaluate on best gives %s, on ckpt-000012.h5 %s" % (by_pointer, by_file))

    prediction = os.path.join(ctx.work, "prediction.h5")
    status, out, err = run(mpi + [ctx.meshtrain, "predict", best, "--input", data,
                                  "--output", prediction])
    if ctx.check(status == 0, "predict on best exited %d:\n%s" % (status, err)):
        ctx.check(h5_attribute(ctx, prediction, "step") == "12",
                  "predict on best wrote step %s, expected 12" %
                  h5_attribute(ctx, prediction, "step"))
        ctx.check(os.path.basename(h5_attribute(ctx, prediction, "checkpoint")) ==
                  "ckpt-000012.h5", "predict on best names checkpoint %s" %
                  h5_attribute(ctx, prediction, "checkpoint"))

    model = os.path.join(ctx.work, "model.onnx")
    # export is a one-process command (no MPI launch).
    status, out, err = run([ctx.meshtrain, "export", best, "--format", "onnx",
                            "--output", model])
    if ctx.check(status == 0, "export of best exited %d:\n%s" % (status, err)):
        with open(model, "rb") as f:
            onnx = f.read()
        # metadata_props entries: key (field 1) and value (field 2), length-prefixed strings.
        ctx.check(b"\x0a\x04step\x12\x0212" in onnx,
                  "the ONNX model's metadata does not say step 12")
        ctx.check(b"ckpt-000012.h5" in onnx and b"ckpt-000014.h5" not in onnx,
                  "the ONNX model's metadata does not name ckpt-000012.h5")


def case_best_metric(ctx, preset):
    """The checkpoint names the metric of its best (/train_state attribute best_metric_name,
    read with h5dump); resumed under another checkpoint.keep_best, the run's resume line says
    the best starts afresh and why, and the first evaluation after the resume (step 8) becomes
    `best`; resumed under the same keep_best, the line says nothing more."""
    need_tools(ctx, "h5dump")
    np = 2
    sets = ["--set", "train.eval_every=2", "--set", "checkpoint.resume=true"]
    accuracy = ["--set", 'checkpoint.keep_best="test_accuracy"']
    loss = ["--set", 'checkpoint.keep_best="test_loss"']
    base = os.path.join(ctx.work, "to_step_6")
    train(ctx, np, preset, base, 6, sets + accuracy)
    saved = os.path.join(base, "checkpoints", "ckpt-000006.h5")
    status, out, err = run([ctx.h5dump, "-a", "/train_state/best_metric_name", saved])
    ctx.check(status == 0 and '"test_accuracy"' in out,
              "h5dump does not show best_metric_name = \"test_accuracy\" in %s (%d):\n%s%s" %
              (saved, status, out, err))

    same = os.path.join(ctx.work, "same")
    shutil.copytree(base, same)
    _, out, _ = train(ctx, np, preset, same, 8, sets + accuracy)
    line = re.search(r"^resumed from .*$", out, re.M)
    ctx.check(line and re.search(r"ckpt-000006\.h5 at step 6 \(saved on [^)]*\)$", line.group(0)),
              "same keep_best: the resume line says more than where it resumed from:\n" + out)

    changed = os.path.join(ctx.work, "changed")
    shutil.copytree(base, changed)
    _, out, _ = train(ctx, np, preset, changed, 8, sets + loss)
    ctx.check(re.search(r"^resumed from \S*ckpt-000006\.h5 at step 6 \(saved on [^)]*\); the best "
                        r"test_loss starts afresh: the checkpoint's best \([0-9.e+-]+\) is a "
                        r"test_accuracy \(checkpoint\.keep_best changed\)$", out, re.M),
              "keep_best changed: the resume line does not say the best starts afresh:\n" + out)
    ckpt = os.path.join(changed, "checkpoints")
    ctx.check(read_pointer(ckpt, "best") == "ckpt-000008.h5",
              "keep_best changed: best names %r, expected ckpt-000008.h5 (the first test loss "
              "after the resume)" % read_pointer(ckpt, "best"))


def main():
    argv = sys.argv[1:]
    if "--" not in argv:
        print(__doc__, file=sys.stderr)
        return 64
    split = argv.index("--")
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=["same_mesh", "other_mesh", "interrupted", "inspect",
                                         "compatibility", "schedule", "precision",
                                         "moe_reshard", "best", "best_pointer",
                                         "best_metric"])
    parser.add_argument("--meshtrain", required=True)
    parser.add_argument("--configs", required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--h5dump", default="")
    parser.add_argument("--h5ls", default="")
    parser.add_argument("--meshtrain-with-faults", default="")
    parser.add_argument("--sync", action="store_true", help="checkpoint.async = false")
    parser.add_argument("--fault-rank", type=int, default=None)
    parser.add_argument("--fault-action", choices=["abort", "kill"], default="abort")
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    parser.add_argument("--preset", default="fsdp")
    parser.add_argument("--np", type=int, default=2, help="ranks of the best case")
    parser.add_argument("--best-mode", choices=["abort", "kill"], default="abort")
    parser.add_argument("--points", default="",
                        help="the best case's fault points, comma-separated (default: all)")
    parser.add_argument("--write-hdf5", default="",
                        help="data_write_hdf5 (tests/data): writes the best cases' HDF5 data")
    parser.add_argument("--moe", action="store_true",
                        help="an MoE model on a mesh of ep ranks (with --preset dp)")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                        help="mixed_precision.param_dtype and reduce_dtype of every run")
    args = parser.parse_args(argv[:split])
    args.mpiexec = argv[split + 1:]
    if not args.mpiexec:
        parser.error("no mpiexec command after --")
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    ctx = Context(args)

    def run_case():
        if args.case == "same_mesh":
            case_same_mesh(ctx, args.preset)
        elif args.case == "other_mesh":
            case_other_mesh(ctx)
        elif args.case == "interrupted":
            case_interrupted(ctx, args.preset)
        elif args.case == "compatibility":
            case_compatibility(ctx, args.preset)
        elif args.case == "schedule":
            case_schedule(ctx, args.preset)
        elif args.case == "precision":
            case_precision(ctx, args.preset)
        elif args.case == "moe_reshard":
            case_moe_reshard(ctx)
        elif args.case == "best_metric":
            case_best_metric(ctx, args.preset)
        elif args.case == "best_pointer":
            case_best_pointer(ctx, args.preset, args.np, best_data(ctx, args.write_hdf5))
        elif args.case == "best":
            case_best(ctx, args.preset, args.np, args.best_mode, best_data(ctx, args.write_hdf5),
                      [p for p in args.points.split(",") if p])
        else:
            case_inspect(ctx, args.preset)

    status = script_test.outcome(ctx, run_case)
    if status != 0:
        return status
    print("ok: %s (%s, %s, %s%s)" % (args.case, args.preset, args.optimizer, args.precision,
                                     ", MoE" if args.moe else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
