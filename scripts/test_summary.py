#!/usr/bin/env python3
"""What a ctest run checked: how many tests passed, were skipped (and why) and failed.

  test_summary.py REPORT.xml [--log CTEST_OUTPUT] [--title TITLE]

REPORT.xml is the JUnit report of `ctest --output-junit` (scripts/test writes one per ctest
run), CTEST_OUTPUT what ctest printed (its status words, e.g. Timeout, name how each failed
test failed; the report does not). Prints one line of counts, then each skipped test with its
reason and each failed test:

  == TITLE: 301 tests: 295 passed, 4 skipped, 2 failed ==
  skipped:
    comm_nccl_ordering_nccl_np1: Kokkos' memory is host memory: NCCL needs a CUDA build
  failed:
    layers_mlp_mpi_np2: Timeout

ctest's report marks a test "notrun" both when it skipped (its SKIP_RETURN_CODE or
SKIP_REGULAR_EXPRESSION) and when it could not be started (no executable, a failed fixture),
which ctest counts as failed: the message of its <skipped> element tells them apart. A skipped
test's reason is its "SKIP: ..." lines (the GoogleTest main prints one per reason, the script
tests one), else its last line of output. A disabled test counts as skipped.
Exit status: 0, or 2 when the report cannot be read (the counts are not known).
"""
import argparse
import re
import sys
import xml.etree.ElementTree as ElementTree

# The <skipped message> of a test that skipped itself (ctest's cmCTestTestHandler).
SKIP_MESSAGES = ("SKIP_RETURN_CODE", "SKIP_REGULAR_EXPRESSION")


def skip_reason(output):
    lines = [line.strip() for line in (output or "").splitlines() if line.strip()]
    stated = [line[len("SKIP:"):].strip() for line in lines if line.startswith("SKIP:")]
    if stated:
        return "; ".join(stated)
    return lines[-1] if lines else "(no output)"


# ctest's line for a finished test: " 3/10 Test  #4: name ......***Timeout   1.00 sec".
STATUS_LINE = re.compile(r"^\s*\d+/\d+ Test\s+#\d+: (\S+) \.+\s*(?:\*\*\*)?(.*?)\s+[\d.]+ sec\s*$")


def ctest_statuses(log_path):
    """{test name: ctest's status words} from ctest's output ({} without one)."""
    statuses = {}
    if log_path:
        with open(log_path, errors="replace") as log:
            for line in log:
                match = STATUS_LINE.match(line)
                if match:
                    statuses[match.group(1)] = match.group(2)
    return statuses


def classify(report_path):
    """[(name, "passed" | "skipped" | "failed", detail)] in the report's order."""
    results = []
    for case in ElementTree.parse(report_path).getroot().iter("testcase"):
        name, status = case.get("name"), case.get("status")
        output = case.findtext("system-out")
        skipped = case.find("skipped")
        if status == "run":
            results.append((name, "passed", ""))
        elif status == "disabled":
            results.append((name, "skipped", "disabled (ctest DISABLED property)"))
        elif status == "notrun" and skipped is not None and \
                skipped.get("message", "").startswith(SKIP_MESSAGES):
            results.append((name, "skipped", skip_reason(output)))
        elif status == "notrun":
            message = skipped.get("message", "") if skipped is not None else ""
            results.append((name, "failed", message))
        else:
            failure = case.find("failure")
            message = failure.get("message", "") if failure is not None else ""
            results.append((name, "failed", message))
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report")
    parser.add_argument("--log")
    parser.add_argument("--title", default="ctest")
    args = parser.parse_args()
    try:
        results = classify(args.report)
    except (OSError, ElementTree.ParseError) as e:
        print(f"== {args.title}: no test report ({e}) ==")
        return 2
    try:
        statuses = ctest_statuses(args.log)
    except OSError:
        statuses = {}
    # A failed test: ctest's status words, then the report's message (e.g. "Not Run: Unable
    # to find executable").
    results = [(name, kind, ": ".join(filter(None, (statuses.get(name), detail)))
                if kind == "failed" else detail) for name, kind, detail in results]
    count = {kind: sum(1 for r in results if r[1] == kind)
             for kind in ("passed", "skipped", "failed")}
    tests = f"{len(results)} test" + ("" if len(results) == 1 else "s")
    print(f"== {args.title}: {tests}: {count['passed']} passed, "
          f"{count['skipped']} skipped, {count['failed']} failed ==")
    for kind in ("skipped", "failed"):
        if count[kind]:
            print(f"{kind}:")
            for name, k, detail in results:
                if k == kind:
                    print(f"  {name}: {detail}" if detail else f"  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
