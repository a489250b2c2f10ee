#!/usr/bin/env python3
"""The rooms of the source tree and the includes between them, checked against docs/layout.md.

Each room (a folder of the library or the command) may include only rooms below it in
ROOMS; an include that runs back up fails the check with the file and the line. The picture
of the rooms in docs/layout.md (between its "rooms:begin" and "rooms:end" markers) is drawn
from the includes found here: when a change adds an arrow between rooms, the check fails
until the page is regenerated (`dependencies.py ROOT --write-docs`).

usage: dependencies.py ROOT [--write-docs]   (or --self-test)
"""
import os
import re
import sys

# Top to bottom: a room includes only rooms after it.
ROOMS = [
    "apps",
    "run",
    "layers",
    "framework/export",
    "framework/train",
    "framework/io",
    "framework/comm",
    "framework/core",
    "framework/observe",
    "partition",
    "base",
]
INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"', re.M)
BEGIN, END = "<!-- rooms:begin -->", "<!-- rooms:end -->"


def room_of(path):
    for room in ROOMS:
        if path == room or path.startswith(room + "/"):
            return room
    return None


def includes(root):
    """(room, file, line, included room, included path) for every include across rooms."""
    out = []
    for room in ROOMS:
        for folder, _, files in os.walk(os.path.join(root, room)):
            for name in sorted(files):
                if not name.endswith((".cpp", ".hpp", ".h")):
                    continue
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, root)
                if room_of(rel) != room:  # a nested room (framework/core in framework) is its own
                    continue
                text = open(path, encoding="utf-8", errors="replace").read()
                for match in INCLUDE.finditer(text):
                    target = room_of(match.group(1))
                    if target and target != room:
                        line = text.count("\n", 0, match.start()) + 1
                        out.append((room, rel, line, target, match.group(1)))
    return out


def back_arrows(found):
    rank = {room: i for i, room in enumerate(ROOMS)}
    return [f for f in found if rank[f[3]] < rank[f[0]]]


def picture(found):
    arrows = {}
    for room, _, _, target, _ in found:
        arrows.setdefault(room, set()).add(target)
    width = max(len(r) for r in ROOMS)
    lines = ["```"]
    for room in ROOMS:
        targets = [r for r in ROOMS if r in arrows.get(room, ())]
        lines.append(f"{room.ljust(width)} -> {', '.join(targets) if targets else '(nothing)'}")
    lines.append("```")
    return "\n".join(lines)


def check(root, write_docs):
    found = includes(root)
    failures = [f"{file}:{line}: {room} includes {path}, a room above it ({target})"
                for room, file, line, target, path in back_arrows(found)]
    docs = os.path.join(root, "docs", "layout.md")
    text = open(docs, encoding="utf-8").read()
    if BEGIN not in text or END not in text:
        failures.append(f"{docs}: no {BEGIN} ... {END} block for the rooms' picture")
    else:
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        wanted = head + BEGIN + "\n" + picture(found) + "\n" + END + tail
        if wanted != text:
            if write_docs:
                open(docs, "w", encoding="utf-8").write(wanted)
                print(f"rewrote the rooms' picture in {docs}")
            else:
                failures.append(f"{docs}: the rooms' picture differs from the includes; run "
                                f"{sys.argv[0]} {root} --write-docs")
    for failure in failures:
        print("FAIL: " + failure)
    if not failures:
        print(f"{len(found)} includes across {len(ROOMS)} rooms, none runs back up; "
              "docs/layout.md's picture matches")
    return 1 if failures else 0


def self_test():
    import tempfile
    with tempfile.TemporaryDirectory() as root:
        def write(path, text):
            os.makedirs(os.path.dirname(os.path.join(root, path)), exist_ok=True)
            open(os.path.join(root, path), "w").write(text)
        write("run/a.cpp", '#include "layers/b.hpp"\n#include "base/c.hpp"\n')
        write("layers/b.hpp", '#pragma once\n#include "framework/core/d.hpp"\n')
        write("framework/core/d.hpp", '#pragma once\n#include "base/c.hpp"\n')
        write("docs/layout.md", f"x\n{BEGIN}\n{END}\ny\n")
        assert not back_arrows(includes(root))
        assert check(root, write_docs=False) == 1, "a stale picture must fail"
        assert check(root, write_docs=True) == 0 and check(root, write_docs=False) == 0
        write("framework/core/e.cpp", '\n#include "run/a.hpp"\n')
        back = back_arrows(includes(root))
        assert [(f[1], f[2]) for f in back] == [("framework/core/e.cpp", 2)], back
        assert check(root, write_docs=True) == 1, "a back arrow must fail"
    print("self-test passed")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--self-test"]:
        sys.exit(self_test())
    if len(sys.argv) not in (2, 3) or (len(sys.argv) == 3 and sys.argv[2] != "--write-docs"):
        print(__doc__)
        sys.exit(64)
    sys.exit(check(sys.argv[1], len(sys.argv) == 3))
