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

The fourth: a device lambda inside a private or protected member function of any class ("The
enclosing parent function ... for an extended __host__ __device__ lambda cannot have private or
protected access within its class"), the first kind's rule outside tests. The check reads the
access of each member function from its class body (across every file given) and looks for
device lambdas in that function's bodies, in the class or out of line (`Class::name(...) {`).
A name declared public in the class anywhere counts as public (overloads are not told apart).
The fix is making the function public (saying why) or moving the kernel into a free function.

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


CLASS_HEAD = re.compile(r"\b(class|struct)\s+(\w+)\s*(final\s*)?(:[^;{()]*)?\{")
ACCESS_LABEL = re.compile(r"\b(public|private|protected)\s*:(?!:)")
MEMBER_NAME = re.compile(r"~?\b(\w+)\s*\($")
OUT_OF_LINE_DEFINITION = re.compile(r"\b(\w+)\s*::\s*(~?\w+)\s*\(")


def matching_brace(code, open_brace):
    """Index just past the brace that closes the one at open_brace."""
    depth, j = 0, open_brace
    while j < len(code):
        depth += {"{": 1, "}": -1}.get(code[j], 0)
        j += 1
        if depth == 0:
            break
    return j


def class_members(code):
    """[(class, member, access, inline body or None)] for the member functions declared at
    the top level of each class or struct body in code (nested classes found on their own)."""
    members = []
    for head in CLASS_HEAD.finditer(code):
        open_brace = head.end() - 1
        end = matching_brace(code, open_brace)
        access = "private" if head.group(1) == "class" else "public"
        statement_start, i = open_brace + 1, open_brace + 1
        while i < end - 1:
            label = ACCESS_LABEL.match(code, i)
            if label and not code[statement_start:i].strip():
                access, i = label.group(1), label.end()
                statement_start = i
                continue
            ch = code[i]
            if ch == ";":
                statement_start = i + 1
            elif ch == "{":
                close = matching_brace(code, i)
                statement = code[statement_start:i]
                if not CLASS_HEAD.search(statement + "{"):
                    name = member_name(statement)
                    if name:
                        members.append((head.group(2), name, access, (i, close)))
                i = close
                statement_start = i
                continue
            elif ch == "(":
                name = MEMBER_NAME.search(code[statement_start:i + 1])
                prefix = code[statement_start:i]
                if name and "=" not in prefix and "{" not in prefix:
                    members.append((head.group(2), name.group(1), access, None))
                depth = 0
                while i < end:
                    depth += {"(": 1, ")": -1}.get(code[i], 0)
                    i += 1
                    if depth == 0:
                        break
                continue
            i += 1
    return members


def member_name(statement):
    """The function a member definition's head names (`void f(int) const`), or None."""
    paren = statement.find("(")
    if paren < 0 or "=" in statement[:paren]:
        return None
    name = MEMBER_NAME.search(statement[:paren + 1])
    return name.group(1) if name else None


def private_member_findings(texts):
    """Device lambdas inside private or protected member functions, over {path: text}."""
    codes = {path: strip_comments_and_strings(text) for path, text in texts.items()}
    access_of = {}
    inline_bodies = []
    for path, code in codes.items():
        for cls, name, access, body in class_members(code):
            key = (cls, name)
            if access == "public" or access_of.get(key) == "public":
                access_of[key] = "public"
            else:
                access_of[key] = access
            if body is not None:
                inline_bodies.append((path, code, cls, name, body))
    out = []
    for path, code, cls, name, body in inline_bodies:
        if access_of[(cls, name)] != "public":
            out += lambdas_in(path, code, body, cls, name, access_of[(cls, name)])
    for path, code in codes.items():
        for definition in OUT_OF_LINE_DEFINITION.finditer(code):
            key = (definition.group(1), definition.group(2))
            if access_of.get(key, "public") == "public":
                continue
            block = block_after(code, definition.end() - 1)
            if block is None or code[definition.end() - 1:block[0]].count(";"):
                continue
            out += lambdas_in(path, code, block, *key, access_of[key])
    return out


def lambdas_in(path, code, block, cls, name, access):
    out = []
    for lam in KOKKOS_LAMBDA.finditer(code, *block):
        line = code.count("\n", 0, lam.start()) + 1
        out.append(f"{path}:{line}: {lam.group(0)} inside {cls}::{name}, a {access} member "
                   "function; nvcc rejects it (make it public, saying why, or launch the "
                   "kernel from a free function)")
    return out


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
    header = 'class N : public L {\n public:\n  void open(V v);\n  void both(V v);\n' \
             '  void inl(V v) { Kokkos::parallel_for("a", 4, KOKKOS_LAMBDA(int i) { v(i) = 0; }); }\n' \
             ' private:\n  void hidden(V v, const P& p);\n  void both(V v, int n);\n' \
             '  int count_ = f(2);\n  void quiet(V v);\n' \
             '  void inl_hidden(V v) {\n    Kokkos::parallel_for("b", 4, KOKKOS_LAMBDA(int i) ' \
             '{ v(i) = 1; });\n  }\n};\nstruct S {\n  void open_too(V v);\n};\n'
    source = 'void N::open(V v) {\n  Kokkos::parallel_for("c", 4, KOKKOS_LAMBDA(int i) ' \
             '{ v(i) = 2; });\n}\nvoid N::hidden(V v, const P& p) {\n  Kokkos::parallel_for(\n' \
             '      "d", 4, KOKKOS_LAMBDA(int i) { v(i) = 3; });\n}\n' \
             'void N::both(V v, int n) {\n  Kokkos::parallel_for("e", n, KOKKOS_LAMBDA(int i) ' \
             '{ v(i) = 4; });\n}\nvoid N::quiet(V v) { launch(v); }\n' \
             'void S::open_too(V v) {\n  Kokkos::parallel_for("f", 4, KOKKOS_LAMBDA(int i) ' \
             '{ v(i) = 5; });\n}\n'
    found = sorted(private_member_findings({"n.hpp": header, "n.cpp": source}))
    assert len(found) == 2, found
    assert found[0].startswith("n.cpp:6: KOKKOS_LAMBDA inside N::hidden, a private"), found
    assert found[1].startswith("n.hpp:12: KOKKOS_LAMBDA inside N::inl_hidden"), found
    print("self-test: a lambda in a TEST body is found, one in a free function is not; an "
          "`if constexpr` inside a device lambda is found, one around it is not; a device "
          "lambda inside a generic lambda is found, one in a template it calls or in a "
          "non-generic lambda is not; a device lambda in a private member function is found, in the "
          "class or out of line, one in a public member (or one overload public) is not")


def main(argv):
    if argv[1:] == ["--self-test"]:
        self_test()
        return 0
    problems, texts = [], {}
    for root in argv[1:]:
        for dirpath, _, names in os.walk(root):
            for name in sorted(names):
                if name.endswith((".cpp", ".hpp", ".cu")):
                    path = os.path.join(dirpath, name)
                    with open(path, encoding="utf-8") as f:
                        texts[path] = f.read()
                    problems += findings(texts[path], path)
    problems += private_member_findings(texts)
    files = len(texts)
    for p in problems:
        print(p)
    print(f"{files} files checked, {len(problems)} device lambda(s) nvcc would reject")
    return 1 if problems or files == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
