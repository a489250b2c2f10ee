#!/usr/bin/env python3
"""No FMA instruction in the per-ISA clones that must keep the baseline's bits.

framework/core/host_clones.hpp's MESHTRAIN_HOST_CLONES_EXACT compiles a function once per
instruction set (GCC target_clones: x86-64-v4 = AVX-512, x86-64-v3 = AVX2, default) with
fp-contract off, so that each element is the same IEEE operations in every clone: a * b + c
contracted into one FMA (one rounding instead of two) would move the AVX2 and AVX-512 clones'
results off the baseline's and off the Kokkos kernels they stand for. This check disassembles
the built library's clones (objdump -d) and fails if any of them holds a vfmadd, vfmsub,
vfnmadd or vfnmsub instruction, naming the function and the instruction.

The members checked hold only EXACT clones (the optimizer's, precision's, the MPI ring's, the
activations' training kernels (activation.cpp.o), the Linear's bias gradient (linear.cpp.o)):
see MEMBERS in tests/core.cmake's registration. Both the v4 and
the v3 clones are checked (both ISAs have FMA).

Exit status 77 (skipped, with a line saying why) when objdump is not found or when the library
holds no clone of these members (a build by clang or nvcc, GCC before 12, not x86-64: the
baseline only, host_clones.hpp). With --expect-clones (CMake passes it where host_clones.hpp's
#if makes clones) a library without clones fails instead. Clones of some members and not others
fail: the build would have changed under the check. --objdump and --ar name the tools (CMake's
CMAKE_OBJDUMP, CMAKE_AR); empty or absent, they are looked up on PATH.

usage: host_clones_fma.py [--expect-clones] [--objdump=PATH] [--ar=PATH] ARCHIVE MEMBER... [-- ARCHIVE MEMBER...]   (or --self-test)
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

SKIP = 77
CLONE = re.compile(r"\.arch_x86_64_v[34]\b")
FMA = re.compile(r"^\s*[0-9a-f]+:\s+(v(?:fn?madd|fn?msub|fmaddsub|fmsubadd)\w*)\b")
FUNCTION = re.compile(r"^[0-9a-f]+ <(.+)>:$")


def clone_fmas(disassembly):
    """{clone symbol: [FMA mnemonics]} for every x86-64-v3/v4 clone in objdump -d text."""
    found = {}
    current = None
    for line in disassembly.splitlines():
        head = FUNCTION.match(line)
        if head:
            current = head.group(1) if CLONE.search(head.group(1)) else None
            if current is not None:
                found.setdefault(current, [])
            continue
        if current is None:
            continue
        fma = FMA.match(line)
        if fma:
            found[current].append(fma.group(1))
    return found


def self_test():
    sample = """
0000000000000000 <_ZN9meshtrain12_GLOBAL__N_19adamw_hostEPfPKf.arch_x86_64_v4>:
   0:\tvmulps %zmm1,%zmm2,%zmm3
   6:\tvaddps %zmm3,%zmm4,%zmm4
0000000000000040 <_ZN9meshtrain12_GLOBAL__N_18sgd_hostEPfPKf.arch_x86_64_v3>:
  40:\tvfmadd231ps %ymm1,%ymm2,%ymm3
  46:\tvfnmsub132ss %xmm1,%xmm2,%xmm3
0000000000000080 <_ZN9meshtrain12_GLOBAL__N_18sgd_hostEPfPKf.default>:
  80:\tvfmadd231ps %xmm1,%xmm2,%xmm3
"""
    got = clone_fmas(sample)
    want = {
        "_ZN9meshtrain12_GLOBAL__N_19adamw_hostEPfPKf.arch_x86_64_v4": [],
        "_ZN9meshtrain12_GLOBAL__N_18sgd_hostEPfPKf.arch_x86_64_v3": ["vfmadd231ps", "vfnmsub132ss"],
    }
    if got != want:
        print(f"self-test: parsed {got}, expected {want}")
        return 1
    print("self-test: passed")
    return 0


def main(argv):
    if argv == ["--self-test"]:
        return self_test()
    expect_clones = False
    tools = {"objdump": "", "ar": ""}
    while argv and argv[0].startswith("--") and argv[0] != "--":
        option = argv.pop(0)
        name, _, value = option[2:].partition("=")
        if option == "--expect-clones":
            expect_clones = True
        elif name in tools and "=" in option:
            tools[name] = value
        else:
            print(f"unknown option {option}; {__doc__.strip().splitlines()[-1]}")
            return 2
    objdump = tools["objdump"] or shutil.which("objdump")
    ar = tools["ar"] or shutil.which("ar")
    if not objdump or not ar:
        print("SKIP: objdump or ar (binutils) not found: the clones cannot be disassembled")
        return SKIP
    groups, words = [], []
    for arg in argv + ["--"]:
        if arg != "--":
            words.append(arg)
            continue
        if len(words) < 2:
            print(__doc__.strip().splitlines()[-1])
            return 2
        groups.append((words[0], words[1:]))
        words = []

    failures = []
    with_clones, without_clones = [], []
    with tempfile.TemporaryDirectory() as work:
        for archive, members in groups:
            for member in members:
                # `ar p`: the one member, without reading the others (the archive is ~10 MB).
                out = os.path.join(work, member)
                with open(out, "wb") as f:
                    done = subprocess.run([ar, "p", archive, member], stdout=f)
                if done.returncode != 0 or os.path.getsize(out) == 0:
                    failures.append(f"{archive} has no member {member}")
                    continue
                text = subprocess.run([objdump, "-d", "--no-show-raw-insn", out],
                                      capture_output=True, text=True, check=True).stdout
                clones = clone_fmas(text)
                (with_clones if clones else without_clones).append(member)
                for symbol, fmas in sorted(clones.items()):
                    if fmas:
                        failures.append(
                            f"{member}: {symbol} holds {len(fmas)} FMA instruction(s) "
                            f"({', '.join(sorted(set(fmas)))}): MESHTRAIN_HOST_CLONES_EXACT "
                            "must compile without contraction")
                print(f"{member}: {len(clones)} x86-64-v3/v4 clone(s), "
                      f"{sum(len(f) for f in clones.values())} FMA instruction(s)")
    if failures:
        for failure in failures:
            print(f"FAIL: {failure}")
        return 1
    if not with_clones and expect_clones:
        print("FAIL: no x86-64-v3/v4 clone in " + ", ".join(without_clones) + ", but this "
              "compiler and target make clones (framework/core/host_clones.hpp's #if; CMake "
              "passed --expect-clones): MESHTRAIN_HOST_CLONES_EXACT no longer takes effect")
        return 1
    if not with_clones:
        print("SKIP: no x86-64-v3/v4 clone in " + ", ".join(without_clones) +
              " (this build compiles the baseline only: framework/core/host_clones.hpp)")
        return SKIP
    if without_clones:
        print("FAIL: clones in " + ", ".join(with_clones) + " but none in " +
              ", ".join(without_clones) + ": each member checked holds EXACT clones")
        return 1
    print("passed: no FMA instruction in the EXACT clones")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
