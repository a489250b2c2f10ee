#!/usr/bin/env python3
"""`meshtrain train` across two simulated hosts (scripts/simhosts, Open MPI over TCP) against
the same config on one host (issue 11).

    scripts/simhosts shell --hosts 2 --slots 2 -- \\
        multihost_test.py --meshtrain BIN --configs DIR --work DIR [--h5dump BIN] \\
                          -- MPIEXEC [FLAGS...]

Runs under `simhosts shell`, which sets SIMHOSTS_MPIRUN (mpirun inside host 0 with the hosts'
hostfile); MPIEXEC is the plain single-host mpirun. The config is fashion_mnist_fsdp_tp at
np 4 (fsdp=2 x tp=2): tp is the fastest-varying mesh axis, so the tp pairs are ranks {0,1}
and {2,3}, which mpirun places on host 0 and host 1 (checked first); fsdp spans the hosts.

  1. one host:   mpirun -np 4, 12 steps, a checkpoint every 6 steps (the reference);
  2. two hosts:  the same run; every step's loss and the final checkpoint are bit for bit the
                 reference's, and the run sent data over the simulated link;
  3. resume:     the step-6 checkpoint written across the hosts, resumed on one host
                 (mpirun -np 4) to step 12: losses 7..12 and the final checkpoint are bit for
                 bit the reference's.

Exit status: 0 pass, 1 fail, 77 skip (h5dump missing). The skip where namespaces cannot be
made (not root, no `ip`) comes from simhosts itself, before this script starts.
"""

import argparse
import copy
import os
import re
import shutil
import subprocess
import sys
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "resume"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
import resume_test as rt  # noqa: E402  (runs, losses and checkpoint comparison)
import script_test  # noqa: E402

PRESET = "fsdp_tp"
NP = 4
STEPS = 12
SAVE = ["--set", "checkpoint.every_steps=6"]
# The smallest traffic the two-host run must put on host 1's link: the fsdp all-gathers of
# the 784x64 weight alone move 100 KB per step.
MIN_LINK_BYTES = 1 << 20


def placement(mpirun):
    """{rank: host name} of an np-4 job of the multi-host mpirun."""
    status, out, err = rt.run(mpirun[:1] + ["-n", str(NP)] + mpirun[1:] +
                              ["sh", "-c", 'echo "rank $OMPI_COMM_WORLD_RANK $(hostname)"'])
    if status != 0:
        raise rt.Failure("the placement probe exited %d:\n%s%s" % (status, out, err))
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^rank (\d+) (\S+)$", out, re.M)}


def link_bytes(namespace):
    """Bytes sent plus received on the simulated link of the host in `namespace`."""
    total = 0
    for counter in ("tx_bytes", "rx_bytes"):
        out = subprocess.check_output(
            ["ip", "netns", "exec", namespace, "sh", "-c",
             "cat /sys/class/net/simh*/statistics/%s" % counter], universal_newlines=True)
        total += sum(int(v) for v in out.split())
    return total


def compare_hosts(args, one_host, two_hosts, namespaces):
    """The three runs of the header: the one-host reference, the two-host run and the resume on
    one host of its checkpoint, and their checks."""
    ctx = one_host
    where = placement(two_hosts.mpiexec)
    hosts = [where.get(r) for r in range(NP)]
    ctx.check(hosts[0] == hosts[1] and hosts[2] == hosts[3] and hosts[0] != hosts[2] and
              None not in hosts,
              "ranks are not placed two per host, {0,1} and {2,3}: %s" % where)

    ref = os.path.join(args.work, "one_host")
    rt.train(one_host, NP, PRESET, ref, STEPS, SAVE)
    ref_losses = rt.losses(ref)
    ctx.check(sorted(ref_losses) == list(range(1, STEPS + 1)),
              "the one-host run logged steps %s" % sorted(ref_losses))

    multi = os.path.join(args.work, "two_hosts")
    before = link_bytes(namespaces[1])
    _, out, _ = rt.train(two_hosts, NP, PRESET, multi, STEPS, SAVE)
    sent = link_bytes(namespaces[1]) - before
    ctx.check("fsdp=2" in out and "tp=2" in out, "the run is not fsdp=2 x tp=2:\n" + out)
    print("two-host run: %d bytes over host 1's link" % sent)
    ctx.check(sent >= MIN_LINK_BYTES, "the two-host run moved only %d bytes over host 1's "
              "link (expected at least %d)" % (sent, MIN_LINK_BYTES))
    rt.expect_losses(ctx, "two hosts", rt.losses(multi), ref_losses, range(1, STEPS + 1))
    final = "ckpt-%06d.h5" % STEPS
    rt.compare_checkpoints(ctx, "two hosts, final checkpoint",
                           os.path.join(multi, "checkpoints", final),
                           os.path.join(ref, "checkpoints", final), exact=True)

    # Resume the step-6 checkpoint written across the hosts on one host.
    resumed = os.path.join(args.work, "resumed_on_one_host")
    ckpt = os.path.join(resumed, "checkpoints")
    os.makedirs(ckpt)
    shutil.copy(os.path.join(multi, "checkpoints", "ckpt-000006.h5"), ckpt)
    with open(os.path.join(ckpt, "latest"), "w") as f:
        f.write("ckpt-000006.h5\n")
    _, out, _ = rt.train(one_host, NP, PRESET, resumed, STEPS,
                         SAVE + ["--set", "checkpoint.resume=true"])
    ctx.check(re.search(r"resumed from \S*ckpt-000006\.h5 at step 6", out),
              "the one-host run does not say it resumed from step 6:\n" + out)
    got = rt.losses(resumed)
    ctx.check(sorted(got) == list(range(7, STEPS + 1)),
              "the resumed run logged steps %s, expected 7..%d" % (sorted(got), STEPS))
    rt.expect_losses(ctx, "resumed on one host", got, ref_losses, range(7, STEPS + 1))
    rt.compare_checkpoints(ctx, "resumed on one host, final checkpoint",
                           os.path.join(ckpt, final),
                           os.path.join(ref, "checkpoints", final), exact=True)


def main():
    own, mpiexec = script_test.split_at_launcher(sys.argv[1:])
    if mpiexec is None:
        print(__doc__, file=sys.stderr)
        return 64
    parser = argparse.ArgumentParser()
    parser.add_argument("--meshtrain", required=True)
    parser.add_argument("--configs", required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--h5dump", default="")
    args = parser.parse_args(own)
    simhosts_mpirun = os.environ.get("SIMHOSTS_MPIRUN")
    namespaces = os.environ.get("SIMHOSTS_NAMESPACES", "").split()
    if not mpiexec or not simhosts_mpirun or len(namespaces) != 2:
        parser.error("run under `scripts/simhosts shell --hosts 2 --slots 2`, with the "
                     "single-host mpiexec after --")
    if not args.h5dump:
        print("SKIP: h5dump not found (Debian: hdf5-tools)")
        return script_test.SKIP

    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    one_host = rt.Context(types.SimpleNamespace(
        meshtrain=args.meshtrain, configs=args.configs, work=args.work, h5dump=args.h5dump,
        h5ls="", mpiexec=mpiexec, optimizer="adamw", sync=False, meshtrain_with_faults="",
        fault_rank=None, fault_action="abort", precision="fp32"))
    two_hosts = copy.copy(one_host)  # shares the list of failures
    two_hosts.mpiexec = [simhosts_mpirun] + mpiexec[1:]
    status = script_test.outcome(one_host,
                                 lambda: compare_hosts(args, one_host, two_hosts, namespaces))
    if status != 0:
        return status
    print("ok: fsdp=2 x tp=2 on 2 hosts x 2 ranks: losses and checkpoint equal one host's; "
          "its step-6 checkpoint resumed on one host to the same losses and checkpoint")
    return 0


if __name__ == "__main__":
    sys.exit(main())
