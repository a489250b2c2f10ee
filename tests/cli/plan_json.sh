#!/bin/sh
# Checks that `meshtrain plan --json` prints one JSON document in which PARAMETER has
# LOCAL_SHAPE (a JSON list, e.g. "[392, 256]"). Arguments after LOCAL_SHAPE go to
# `meshtrain plan` (e.g. --set 'model.moe_layers=[1]'). Every MoE layer of the plan
# ("moe": true) must carry its "moe_layout" (experts per rank = experts / ep, its buffers),
# all-to-alls over the expert axes marked "at_uniform_routing", and the totals
# "moe_buffer_bytes" (the sum of the layers' buffers).
#
#   plan_json.sh MESHTRAIN CONFIG WORLD PARAMETER LOCAL_SHAPE [PLAN ARGUMENTS...]
set -u
[ $# -ge 5 ] || {
  echo "usage: $0 MESHTRAIN CONFIG WORLD PARAMETER LOCAL_SHAPE [PLAN ARGUMENTS...]" >&2
  exit 64
}
meshtrain=$1 config=$2 world=$3 parameter=$4 local_shape=$5
shift 5
"$meshtrain" plan "$config" --world "$world" --json "$@" | python3 -c '
import json, sys
name, expected = sys.argv[1], json.loads(sys.argv[2])
plan = json.load(sys.stdin)
found = [p for p in plan["parameters"] if p["name"] == name]
if len(found) != 1:
    sys.exit("FAIL: parameter %r appears %d times in the plan" % (name, len(found)))
if found[0]["local_shape"] != expected:
    sys.exit("FAIL: %s local_shape %s, expected %s" % (name, found[0]["local_shape"], expected))
print("ok: %s local_shape %s on %d ranks" % (name, expected, plan["mesh"]["world_size"]))
buffers = 0
for layer in plan["layers"]:
    if not layer.get("moe", False):
        if "moe_layout" in layer:
            sys.exit("FAIL: dense layer %s has a moe_layout" % layer["name"])
        continue
    m = layer.get("moe_layout")
    if m is None:
        sys.exit("FAIL: MoE layer %s has no moe_layout" % layer["name"])
    for key in ("in", "out", "experts", "top_k", "experts_per_rank", "expert_axes", "ep",
                "router", "experts_weight", "experts_bias", "buffer_bytes_per_rank"):
        if key not in m:
            sys.exit("FAIL: MoE layer %s: moe_layout has no %r" % (layer["name"], key))
    if m["experts_per_rank"] * m["ep"] != m["experts"]:
        sys.exit("FAIL: MoE layer %s: %d experts per rank x ep %d != %d experts"
                 % (layer["name"], m["experts_per_rank"], m["ep"], m["experts"]))
    if layer["output_layout"] != "replicated":
        sys.exit("FAIL: MoE layer %s output %s, expected replicated"
                 % (layer["name"], layer["output_layout"]))
    all_to_alls = [c for c in layer["collectives"] if c["kind"] == "all-to-all"]
    for c in all_to_alls:
        if c.get("at_uniform_routing") is not True or c["axes"] != m["expert_axes"]:
            sys.exit("FAIL: MoE layer %s: all-to-all %s: %s" % (layer["name"], c["operand"], c))
    if m["ep"] > 1 and plan["local_batch_rows"] > 0 and len(all_to_alls) < 3:
        sys.exit("FAIL: MoE layer %s has %d all-to-alls" % (layer["name"], len(all_to_alls)))
    buffers += m["buffer_bytes_per_rank"]
    print("ok: MoE layer %s: %d of %d experts per rank over %s, %d all-to-alls"
          % (layer["name"], m["experts_per_rank"], m["experts"], m["expert_axes"],
             len(all_to_alls)))
if plan["totals"].get("moe_buffer_bytes") != buffers:
    sys.exit("FAIL: totals moe_buffer_bytes %s, the layers buffers %d"
             % (plan["totals"].get("moe_buffer_bytes"), buffers))
' "$parameter" "$local_shape"
