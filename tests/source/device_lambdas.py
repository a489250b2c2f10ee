#!/usr/bin/env python3
"""Fails on two kinds of Kokkos device lambda that a host compiler accepts and nvcc rejects.

nvcc rejects an extended __host__ __device__ lambda whose enclosing function is a private or
protected member of a class, and the body of TEST(...) is the private TestBody() of a
generated class: "The enclosing parent function ("TestBody") for an extended __host__
__device__ lambda cannot have private or protected access within its class". A host-only
build compiles such a test without complaint, so this check keeps the CUDA build compiling
on machines that never run nvcc. The fix is a free function that launches the kernel.

The second: an `if constexpr` inside a device lambda. nvcc refuses a lambda whose first use of
a captured variable is inside one ("An extended __host__ __device__ lambda cannot
first-capture variable in constexpr-if context"). The fix is a plain `if` on the constant,
which the compiler folds just the same.

The third: a device lambda defined inside a generic lambda (one with an `auto` parameter, such
as a dispatch over functor types: `with_functor(kind, [&](auto f) { parallel_for(...,
KOKKOS_LAMBDA ...); })`): "An extended __host__ __device__ lambda cannot be defined inside a
generic lambda expression". The fix is a function template that launches the kernel, called
from the generic lambda.

usage: device_lambdas.py ROOT_DIR...   (or --self-test)
"""
import os
import re
import sys

TEST_MACRO = re.compile(r"^\s*(TEST|TEST_F|TEST_P|TYPED_TEST|TYPED_TEST_P)\s*\(", re.M)
DEVICE_LAMBDA = re.compile(r"\bKOKKOS_(CLASS_)?LAMBDA\b|__device__")
KOKKOS_LAMBDA = re.compile(r"\bKOKKOS_(CLASS_)?LAMBDA\b")
CONSTEXPR_IF = re.compile(r"\bif\s+constexpr\b")
GENERIC_LAMBDA = re.compile(r"\[[^\[\]]*\]\s*\([^()]*\bauto\b[^()]*\)\s*(mutable\s*)?(->[^{;]*)?\{")


def strip_comments_and_strings(text):
    """Blanks comments and literals, keeping newlines so line numbers stay right."""
    pattern = re.compile(r'//[^\n]*|/\*.*?\*/|"(\\.|[^"\\\n])*"|\'(\\.|[^\'\\\n])*\'', re.S)
    return pattern.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def block_after(code, i):
    """(start, end) of the brace block that follows the parenthesised list opening at or
    after code[i] (a TEST's name, a lambda's parameters); None when there is none."""
    i = code.find("(", i)
    if i < 0:
        return None
    depth = 0
    while i < len(code):
        depth += {"(": 1, ")": -1}.get(code[i], 0)
        i += 1
        if depth == 0:
            break
    open_brace = code.find("{", i)
    if open_brace < 0:
        return None
    depth, j = 0, open_brace
    while j < len(code):
        depth += {"{": 1, "}": -1}.get(code[j], 0)
        j += 1
        if depth == 0:
            break
    return open_brace, j


def findings(text, path):
    code = strip_comments_and_strings(text)
    out = []
    for match in TEST_MACRO.finditer(code):
        block = block_after(code, match.end() - 1)
        if block is None:
            continue
        open_brace, j = block
        for lam in DEVICE_LAMBDA.finditer(code, open_brace, j):
            line = code.count("\n", 0, lam.start()) + 1
            out.append(f"{path}:{line}: {lam.group(0)} inside a {match.group(1)} body; "
                       "nvcc rejects it (move the kernel into a free function)")
    for lam in KOKKOS_LAMBDA.finditer(code):
        block = block_after(code, lam.end())
        if block is None:
            continue
        for cif in CONSTEXPR_IF.finditer(code, *block):
            line = code.count("\n", 0, cif.start()) + 1
            out.append(f"{path}:{line}: `if constexpr` inside a device lambda; nvcc rejects a "
                       "capture first used there (use a plain `if` on the constant)")
    for generic in GENERIC_LAMBDA.finditer(code):
        block = block_after(code, generic.start() + code[generic.start():].find("("))
        if block is None:
            continue
        for lam in KOKKOS_LAMBDA.finditer(code, *block):
            line = code.count("\n", 0, lam.start()) + 1
            out.append(f"{path}:{line}: {lam.group(0)} inside a generic lambda; nvcc rejects it "
                       "(launch the kernel from a function template the generic lambda calls)")
    return out


def self_test():
    bad = 'TEST(A, B) {\n  // KOKKOS_LAMBDA in a comment is fine\n  Kokkos::parallel_for(\n' \
          '      "x", 4, KOKKOS_LAMBDA(const int i) { v(i) = 1; });\n}\n'
    good = 'void launch(V v) {\n  Kokkos::parallel_for("x", 4, KOKKOS_LAMBDA(const int i) ' \
           '{ v(i) = 1; });\n}\nTEST(A, B) { const char* s = "KOKKOS_LAMBDA"; launch(v); }\n'
    found_bad, found_good = findings(bad, "bad.cpp"), findings(good, "good.cpp")
    assert len(found_bad) == 1 and found_bad[0].startswith("bad.cpp:4:"), found_bad
    assert not found_good, found_good
    constexpr_bad = 'template <bool W> void f(V v, float w) {\n  Kokkos::parallel_for(\n' \
                    '      "x", 4, KOKKOS_LAMBDA(const int i) {\n' \
                    '        if constexpr (W) v(i) *= w;\n      });\n}\n'
    constexpr_good = 'template <bool W> void f(V v, float w) {\n  if constexpr (W) {\n' \
                     '    Kokkos::parallel_for("x", 4, KOKKOS_LAMBDA(const int i) {\n' \
                     '      if (W) v(i) *= w;\n    });\n  }\n}\n'
    found_bad, found_good = findings(constexpr_bad, "bad.cpp"), findings(constexpr_good, "g.cpp")
    assert len(found_bad) == 1 and found_bad[0].startswith("bad.cpp:4:"), found_bad
    assert not found_good, found_good
    generic_bad = 'void f(A a, V v) {\n  dispatch(a, [&](auto g) {\n    Kokkos::parallel_for(\n' \
                  '        "x", 4, KOKKOS_LAMBDA(const int i) { v(i) = g(v(i)); });\n  });\n}\n'
    generic_good = 'template <class G> void run(V v, G g) {\n  Kokkos::parallel_for(\n' \
                   '      "x", 4, KOKKOS_LAMBDA(const int i) { v(i) = g(v(i)); });\n}\n' \
                   'void f(A a, V v) {\n  dispatch(a, [&](auto g) { run(v, g); });\n' \
                   '  auto h = [&](int n) { Kokkos::parallel_for("y", n, KOKKOS_LAMBDA(int i) ' \
                   '{ v(i) = 0; }); };\n}\n'
    found_bad, found_good = findings(generic_bad, "bad.cpp"), findings(generic_good, "g.cpp")
    assert len(found_bad) == 1 and found_bad[0].startswith("bad.cpp:4:"), found_bad
    assert not found_good, found_good
    print("self-test: a lambda in a TEST body is found, one in a free function is not; an "
          "`if constexpr` inside a device lambda is found, one around it is not; a device "
          "lambda inside a generic lambda is found, one in a template it calls or in a "
          "non-generic lambda is not")


def main(argv):
    if argv[1:] == ["--self-test"]:
        self_test()
        return 0
    problems, files = [], 0
    for root in argv[1:]:
        for dirpath, _, names in os.walk(root):
            for name in sorted(names):
                if name.endswith((".cpp", ".hpp", ".cu")):
                    path = os.path.join(dirpath, name)
                    with open(path, encoding="utf-8") as f:
                        problems += findings(f.read(), path)
                    files += 1
    for p in problems:
        print(p)
    print(f"{files} files checked, {len(problems)} device lambda(s) nvcc would reject")
    return 1 if problems or files == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
