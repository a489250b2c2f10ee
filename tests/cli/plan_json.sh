#!/bin/sh
# Checks that `meshtrain plan --json` prints one JSON document in which PARAMETER has
# LOCAL_SHAPE (a JSON list, e.g. "[392, 256]").
#
#   plan_json.sh MESHTRAIN CONFIG WORLD PARAMETER LOCAL_SHAPE
set -u
[ $# -eq 5 ] || { echo "usage: $0 MESHTRAIN CONFIG WORLD PARAMETER LOCAL_SHAPE" >&2; exit 64; }
"$1" plan "$2" --world "$3" --json | python3 -c '
import json, sys
name, expected = sys.argv[1], json.loads(sys.argv[2])
plan = json.load(sys.stdin)
found = [p for p in plan["parameters"] if p["name"] == name]
if len(found) != 1:
    sys.exit("FAIL: parameter %r appears %d times in the plan" % (name, len(found)))
if found[0]["local_shape"] != expected:
    sys.exit("FAIL: %s local_shape %s, expected %s" % (name, found[0]["local_shape"], expected))
print("ok: %s local_shape %s on %d ranks" % (name, expected, plan["mesh"]["world_size"]))
' "$4" "$5"
