"""What the script tests (tests/*/*_test.py: export, resume, multihost) share: running a
command with a timeout (a hang is a failure, never a block), the checks a case collects, the
launcher after `--` on their command line, and their exit status (0 pass, 1 fail, 77 skip).

Imported by path: sys.path.insert(0, <tests/support>); import script_test.
"""

import argparse
import os
import shutil
import subprocess
import sys

SKIP = 77  # every registration's SKIP_RETURN_CODE (cmake/MeshtrainTesting.cmake)


class Failure(Exception):
    """A case cannot go on: the message says why."""


def run(cmd, timeout, env_extra=None, env_drop=(), cwd=None):
    """Runs a command; returns (status, stdout, stderr). A command still running after
    `timeout` seconds is a Failure. env_extra is added to the environment, env_drop's names
    removed from it."""
    env = None
    if env_extra or env_drop:
        env = dict(os.environ)
        for name in env_drop:
            env.pop(name, None)
        env.update(env_extra or {})
    try:
        p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd,
                           timeout=timeout, universal_newlines=True)
    except subprocess.TimeoutExpired as e:
        raise Failure("command hung (no exit in %d s): %s\n--- stdout:\n%s\n--- stderr:\n%s" %
                      (timeout, " ".join(cmd), e.stdout, e.stderr))
    return p.returncode, p.stdout, p.stderr


def run_ok(cmd, timeout, **kw):
    """run(), and a Failure naming the command and its output unless it exits 0; returns its
    standard output."""
    status, out, err = run(cmd, timeout, **kw)
    if status != 0:
        raise Failure("exit status %d: %s\n--- stdout:\n%s\n--- stderr:\n%s" %
                      (status, " ".join(cmd), out[-4000:], err[-4000:]))
    return out


class Checks:
    """A case's context: the command under test (meshtrain), the MPI launcher, the work
    directory, and the checks that failed so far (each printed as it fails)."""

    def __init__(self, args):
        self.meshtrain = args.meshtrain
        self.work = args.work
        self.mpiexec = args.mpiexec
        self.failures = []

    def check(self, condition, message):
        if not condition:
            print("FAIL: " + message, file=sys.stderr)
            self.failures.append(message)
        return condition


def split_at_launcher(argv):
    """(own arguments, launcher): argv split at its first `--`; launcher is None when argv has
    no `--` and empty when nothing follows it."""
    if "--" not in argv:
        return argv, None
    split = argv.index("--")
    return argv[:split], argv[split + 1:]


def outcome(ctx, case):
    """Runs case(); returns 1 after saying why when it raised a Failure or a check of ctx
    failed, else 0."""
    try:
        case()
    except Failure as e:
        print("FAIL: %s" % e, file=sys.stderr)
        return 1
    if ctx.failures:
        print("%d check(s) failed" % len(ctx.failures), file=sys.stderr)
        return 1
    return 0


def case_main(cases, make_context, add_arguments=None, skip_reason=None, skip_needs=None):
    """The main() of a script test with named cases. Parses `CASE --meshtrain M --source-dir S
    --work W [own options] -- LAUNCHER...` (add_arguments(parser) adds the own options), makes
    the case's context with make_context(args), runs the case in an emptied work folder and
    returns the exit status: 1 after a failure, else SKIP when skip_reason(ctx) says why the
    checks that need `skip_needs` (a tool: "ONNX Runtime") could not run (the others passed),
    else 0."""
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=sorted(cases))
    parser.add_argument("--meshtrain", required=True)
    parser.add_argument("--source-dir", required=True)
    parser.add_argument("--work", required=True)
    if add_arguments:
        add_arguments(parser)
    own, launcher = split_at_launcher(sys.argv[1:])
    if not launcher:
        parser.error("the MPI launcher is missing after --")
    args = parser.parse_args(own)
    args.mpiexec = launcher
    ctx = make_context(args)
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    status = outcome(ctx, lambda: cases[args.case](ctx))
    if status != 0:
        return status
    missing = skip_reason(ctx) if skip_reason else None
    if missing:
        print("SKIP: %s (the checks that need no %s passed)" % (missing, skip_needs))
        return SKIP
    print("ok: %s" % args.case)
    return 0
