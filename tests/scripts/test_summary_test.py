#!/usr/bin/env python3
"""scripts/test_summary.py on a real ctest run of stand-in tests.

  test_summary_test.py CMAKE CTEST WORKDIR

Configures a project of one-line tests into WORKDIR (emptied first): two that pass (one of them
WILL_FAIL), one that fails, one that times out, one whose executable is missing (ctest: Not
Run, a failure), a GoogleTest-style skip (exit 77 with SKIP_RETURN_CODE 77 after two "SKIP:"
lines), a script skip whose reason is its last line on stderr (simhosts' style), a skip by
SKIP_REGULAR_EXPRESSION after 300 lines of output, and a disabled test. Runs ctest as
scripts/test does (JUnit report and output kept), then the summary, and checks: ctest's exit
status is non-zero, the count line is "9 tests: 2 passed, 4 skipped, 3 failed" (the missing
executable counted as failed although ctest's report marks it "notrun" like the skips), each
skipped test is listed with its reason, each failed one with ctest's status word (Timeout,
Not Run), and a run of the passing tests alone says "2 passed, 0 skipped, 0 failed".
Exit 0 when all of that holds, 1 naming the first difference.
"""
import os
import shutil
import subprocess
import sys

SUMMARY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts",
                       "test_summary.py")

PROJECT = r"""cmake_minimum_required(VERSION 3.20)
project(summary_stand_ins NONE)
enable_testing()
add_test(NAME passes COMMAND sh -c "echo fine")
add_test(NAME fails_as_expected COMMAND sh -c "exit 3")
set_tests_properties(fails_as_expected PROPERTIES WILL_FAIL TRUE)
add_test(NAME fails COMMAND sh -c "echo broken; exit 1")
add_test(NAME hangs COMMAND sleep 30)
set_tests_properties(hangs PROPERTIES TIMEOUT 1)
add_test(NAME missing COMMAND /nonexistent/meshtrain_stand_in)
add_test(NAME gtest_skip COMMAND sh -c "echo '[  SKIPPED ] 3 tests'; echo 'SKIP: no CUDA device'; echo 'SKIP: needs two ranks'; exit 77")
set_tests_properties(gtest_skip PROPERTIES SKIP_RETURN_CODE 77)
add_test(NAME script_skip COMMAND sh -c "echo starting; echo 'not root: network namespaces need root' >&2; exit 77")
set_tests_properties(script_skip PROPERTIES SKIP_RETURN_CODE 77)
add_test(NAME regex_skip COMMAND sh -c "i=0; while [ $i -lt 300 ]; do echo padding $i; i=$((i+1)); done; echo 'SKIP: matched by regex'")
set_tests_properties(regex_skip PROPERTIES SKIP_REGULAR_EXPRESSION "SKIP: matched")
add_test(NAME switched_off COMMAND true)
set_tests_properties(switched_off PROPERTIES DISABLED TRUE)
"""

EXPECTED_LINES = [
    "== stand-ins: 9 tests: 2 passed, 4 skipped, 3 failed ==",
    "skipped:",
    "  gtest_skip: no CUDA device; needs two ranks",
    "  script_skip: not root: network namespaces need root",
    "  regex_skip: matched by regex",
    "  switched_off: disabled (ctest DISABLED property)",
    "failed:",
    "  fails: Failed",
    "  hangs: Timeout",
    "  missing: Not Run: Unable to find executable",
]


def fail(message):
    print(f"FAIL: {message}")
    sys.exit(1)


def run_ctest(ctest, build, out, *args):
    """ctest as scripts/test runs it; returns (exit status, summary lines)."""
    report, log = os.path.join(out, "junit.xml"), os.path.join(out, "ctest.log")
    with open(log, "w") as f:
        code = subprocess.run([ctest, "--test-dir", build, "--output-on-failure",
                               "--no-label-summary", "-j", "2", "--output-junit", report,
                               *args], stdout=f, stderr=subprocess.STDOUT).returncode
    summary = subprocess.run([sys.executable, SUMMARY, report, "--log", log, "--title",
                              "stand-ins"], capture_output=True, text=True)
    if summary.returncode != 0:
        fail(f"test_summary.py exited with {summary.returncode}: {summary.stdout}"
             f"{summary.stderr}")
    return code, summary.stdout.splitlines()


def main():
    if len(sys.argv) != 4:
        print(__doc__)
        return 2
    cmake, ctest, work = sys.argv[1], sys.argv[2], os.path.abspath(sys.argv[3])
    shutil.rmtree(work, ignore_errors=True)
    source, build, out = (os.path.join(work, d) for d in ("source", "build", "out"))
    for d in (source, out):
        os.makedirs(d)
    with open(os.path.join(source, "CMakeLists.txt"), "w") as f:
        f.write(PROJECT)
    subprocess.run([cmake, "-S", source, "-B", build], check=True, stdout=subprocess.DEVNULL)

    code, lines = run_ctest(ctest, build, out)
    print("\n".join(lines))
    if code == 0:
        fail("ctest exited 0 with failed tests")
    for i in range(max(len(lines), len(EXPECTED_LINES))):
        want = EXPECTED_LINES[i] if i < len(EXPECTED_LINES) else "(no line)"
        got = lines[i] if i < len(lines) else "(no line)"
        if want != got:
            fail(f"summary line {i + 1}: expected {want!r}, got {got!r}")

    code, lines = run_ctest(ctest, build, out, "-R", "^(passes|fails_as_expected)$")
    if code != 0 or lines != ["== stand-ins: 2 tests: 2 passed, 0 skipped, 0 failed =="]:
        fail(f"the passing tests alone: ctest exit {code}, summary {lines}")
    print("ok: counts, reasons and failure kinds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
