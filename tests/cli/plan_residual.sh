#!/bin/sh
# `meshtrain plan` of a residual_mlp config (docs/models.md): the plan lists exactly the
# parameters the model keys give (input, blocks/<i>/norm (+ bias for layernorm), gate (swiglu),
# up, down, output_norm, output; an MoE block of moe_layers: router and experts/(gate,) up,
# down [experts, ...] instead of gate, up, down) with their shapes, and its bytes add up: each parameter's
# bytes per rank = 4 x its local elements, totals.parameter_bytes = their sum, and
# totals.global_parameter_bytes = 4 x the model's elements computed here from the keys.
#
#   plan_residual.sh MESHTRAIN PYTHON CONFIG WORLD [PLAN ARGUMENTS...]
set -u
[ $# -ge 4 ] || {
  echo "usage: $0 MESHTRAIN PYTHON CONFIG WORLD [PLAN ARGUMENTS...]" >&2
  exit 64
}
meshtrain=$1 python=$2 config=$3 world=$4
shift 4
plan=$("$meshtrain" plan "$config" --world "$world" --json "$@") || {
  echo "FAIL: meshtrain plan $config --world $world exited with $?"
  exit 1
}
printf '%s' "$plan" | "$python" -c '
import json, sys
try:
    import tomllib
except ImportError:
    import tomli as tomllib
plan = json.load(sys.stdin)
with open(sys.argv[1], "rb") as f:
    m = tomllib.load(f)["model"]
for a in sys.argv[2:]:  # --set model.KEY=VALUE overrides
    if a.startswith("model."):
        k, v = a[len("model."):].split("=", 1)
        m[k] = int(v) if v.isdigit() else v.strip("\"")
i, o, w, h, d = m["inputs"], m["outputs"], m["width"], m["hidden"], m["depth"]
norm = m.get("norm", "rmsnorm")
want = [("input/weight", [i, w]), ("input/bias", [w])]
def add_norm(name):
    if norm != "none":
        want.append((name + "/scale", [w]))
        if norm == "layernorm":
            want.append((name + "/bias", [w]))
moe = m.get("moe_layers", [])
if isinstance(moe, str):
    moe = json.loads(moe)
experts = int(m.get("experts", 8))
for b in range(d):
    add_norm("blocks/%d/norm" % b)
    if b in moe:
        p = "blocks/%d" % b
        want.append((p + "/router/weight", [w, experts]))
        for proj in (["gate"] if m["activation"] == "swiglu" else []) + ["up"]:
            want += [("%s/experts/%s/weight" % (p, proj), [experts, w, h]),
                     ("%s/experts/%s/bias" % (p, proj), [experts, h])]
        want += [(p + "/experts/down/weight", [experts, h, w]), (p + "/experts/down/bias", [experts, w])]
        continue
    for proj in (["gate"] if m["activation"] == "swiglu" else []) + ["up"]:
        want += [("blocks/%d/%s/weight" % (b, proj), [w, h]), ("blocks/%d/%s/bias" % (b, proj), [h])]
    want += [("blocks/%d/down/weight" % b, [h, w]), ("blocks/%d/down/bias" % b, [w])]
add_norm("output_norm")
want += [("output/weight", [w, o]), ("output/bias", [o])]
got = [(p["name"], p["shape"]) for p in plan["parameters"]]
if got != want:
    sys.exit("FAIL: the plan lists %s, expected %s" % (got, want))
total_local = 0
for p in plan["parameters"]:
    local = 1
    for n in p["local_shape"]:
        local *= n
    if p["bytes_per_rank"] != 4 * local:
        sys.exit("FAIL: %s has %d bytes per rank for local shape %s" % (p["name"], p["bytes_per_rank"], p["local_shape"]))
    total_local += 4 * local
elements = 0
for _, shape in want:
    n = 1
    for s in shape:
        n *= s
    elements += n
t = plan["totals"]
if t["parameter_bytes"] != total_local:
    sys.exit("FAIL: totals.parameter_bytes %d != the parameters sum %d" % (t["parameter_bytes"], total_local))
if t["global_parameter_bytes"] != 4 * elements:
    sys.exit("FAIL: totals.global_parameter_bytes %d != 4 x %d elements" % (t["global_parameter_bytes"], elements))
if "cost" not in plan:
    sys.exit("FAIL: the plan has no step cost")
print("ok: %d parameters, %d elements, %d bytes per rank on %d ranks" % (len(want), elements, total_local, plan["mesh"]["world_size"]))
' "$config" "$@"
