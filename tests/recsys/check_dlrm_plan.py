#!/usr/bin/env python3
"""`meshtrain plan` of a DLRM (issue 39, docs/recsys.md, "The plan"): tests/recsys/dlrm_plan.toml's
three tables (big [64, 8] row-wise over fsdp, wide [10, 8] column-wise over tp, small [6, 8]
replicated; batch 16) planned on world 1, 2 (fsdp 2; and tp 2) and 4 (fsdp 2 x tp 2), with AdamW
and with each sparse optimizer.embeddings. Every table's placement, rows and columns per rank,
bytes per rank (weights, gradient, optimizer state) and per-step bytes of `--json`'s
"embedding_tables" are checked against the figures computed here by hand from the layer's
protocol (layers/embedding_bag.hpp) and the cost model of partition/collectives.hpp, and a few of
them against literal values; the text output's section is checked for its rows and totals.
Also big and small table-wise (P(fsdp@table)) on world 2: their members, blocks, exchange and
the most loaded rank's totals (check_table_wise), and two table-wise tables of different dims
(interaction "cat") whose busiest weights and busiest optimizer state lie on different members
(check_table_wise_mixed). And the step cost's all-to-all items: 4 per group of tables that
exchange rows over the same axes, in layer "embeddings", on world 1, 2 and 4, with one group of
one table, one of two, and two groups on fsdp 2 x dp 2 (check_exchange_cost).

  check_dlrm_plan.py MESHTRAIN CONFIG
"""
import json
import os
import re
import subprocess
import sys
import tempfile

F = 4  # bytes of a float
BATCH = 16
DIM = 8
ROWS = {"big": 64, "wide": 10, "small": 6}
TABLE_KEYS = ["table", "parameter", "shape", "placement", "sharding", "row_axes",
              "table_wise_member", "column_axes",
              "rows_per_rank", "columns_per_rank", "gradient_allreduce_axes",
              "weight_bytes_per_rank", "gradient_bytes_per_rank", "optimizer_bytes_per_rank",
              "bytes_per_rank", "step", "notes"]
STEP_KEYS = ["ids", "parts", "counts_all_to_all_bytes", "ids_all_to_all_bytes",
             "partial_sums_all_to_all_bytes", "column_all_gather_bytes",
             "backward_all_to_all_bytes", "gradient_all_reduce_bytes",
             "touched_rows_all_gather_bytes", "forward_bytes", "backward_bytes", "total_bytes"]
TOTAL_KEYS = ["weight_bytes_per_rank", "gradient_bytes_per_rank", "optimizer_bytes_per_rank",
              "bytes_per_rank", "all_to_all_bytes_per_step", "column_all_gather_bytes_per_step",
              "forward_bytes_per_step", "backward_bytes_per_step", "total_bytes_per_step"]


def fail(message):
    sys.exit(f"check_dlrm_plan: {message}")


def moved(kind, full, ranks):
    """Bytes one rank moves (partition/collectives.hpp): all_to_all and all_gather
    S (n - 1) / n, all_reduce 2 S (n - 1) / n."""
    return full * (ranks - 1) * (2 if kind == "all_reduce" else 1) // ranks


def expected(table, fsdp, tp, optimizer):
    """The hand-computed plan of one table on fsdp x tp ranks (1 id per bag)."""
    rows, bags = ROWS[table], BATCH // fsdp
    owners = fsdp if table == "big" else 1
    slices = tp if table == "wide" else 1
    local_rows, cols = rows // owners, DIM // slices
    block = local_rows * cols * F
    # Sparse updates: no dense gradient (released), and a 4-byte row-to-slot map per local row.
    slot_map = 0 if optimizer == "dense" else local_rows * 4
    gradient_bytes = block if optimizer == "dense" else 0
    optimizer_bytes = {"dense": 2 * block, "rowwise_adagrad": local_rows * F + slot_map,
                       "sparse_adamw": 2 * block + local_rows * F + slot_map}[optimizer]
    step = dict.fromkeys(STEP_KEYS, 0)
    step["ids"] = bags
    if owners > 1:
        step["parts"] = bags  # one id per bag: one part per bag
        step["counts_all_to_all_bytes"] = moved("all_to_all", owners * 4 * F, owners)
        step["ids_all_to_all_bytes"] = moved("all_to_all", bags * 3 * F, owners)
        step["partial_sums_all_to_all_bytes"] = moved("all_to_all", bags * cols * F, owners)
        step["backward_all_to_all_bytes"] = step["partial_sums_all_to_all_bytes"]
    if slices > 1:
        step["column_all_gather_bytes"] = moved("all_gather", bags * DIM * F, slices)
    # The gradient is summed over the batch axis (fsdp) unless the rows are split over it.
    holders = 1 if owners > 1 else fsdp
    if holders > 1:
        reduced_rows = local_rows
        if optimizer != "dense":
            touch = min(local_rows, bags)  # replicated: this rank's ids
            reduced_rows = min(local_rows, holders * touch)
            step["touched_rows_all_gather_bytes"] = moved(
                "all_gather", holders * (touch + 1) * 2 * F, holders)
        step["gradient_all_reduce_bytes"] = moved("all_reduce", reduced_rows * cols * F, holders)
    step["forward_bytes"] = (step["counts_all_to_all_bytes"] + step["ids_all_to_all_bytes"] +
                             step["partial_sums_all_to_all_bytes"] +
                             step["column_all_gather_bytes"])
    step["backward_bytes"] = (step["backward_all_to_all_bytes"] +
                              step["gradient_all_reduce_bytes"] +
                              step["touched_rows_all_gather_bytes"])
    step["total_bytes"] = step["forward_bytes"] + step["backward_bytes"]
    if owners > 1:
        placement = "row-wise over (fsdp)"
    elif slices > 1:
        placement = "column-wise over (tp)"
    else:
        placement = "replicated"
    return {"placement": placement, "table_wise_member": -1,
            "rows_per_rank": local_rows, "columns_per_rank": cols,
            "weight_bytes_per_rank": block, "gradient_bytes_per_rank": gradient_bytes,
            "optimizer_bytes_per_rank": optimizer_bytes,
            "bytes_per_rank": block + gradient_bytes + optimizer_bytes, "step": step}


def plan(meshtrain, config, world, tp, optimizer, json_out):
    sets = ["--set", f"mesh.tp={tp}", "--set", f'optimizer.embeddings="{optimizer}"']
    argv = [meshtrain, "plan", config, "--world", str(world), *sets] + (["--json"] if json_out
                                                                          else [])
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        fail(f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout}{done.stderr}")
    return json.loads(done.stdout) if json_out else done.stdout


def check_json(meshtrain, config, world, tp, optimizer):
    fsdp = world // tp
    what = f"world {world} (fsdp {fsdp} x tp {tp}), optimizer.embeddings = {optimizer}"
    doc = plan(meshtrain, config, world, tp, optimizer, True)
    section = doc.get("embedding_tables")
    if section is None:
        fail(f"{what}: the JSON plan has no \"embedding_tables\": {sorted(doc)}")
    if list(section) != ["bags_per_rank", "ids_per_bag", "optimizer_state", "tables", "totals"]:
        fail(f"{what}: embedding_tables' keys are {list(section)}")
    if section["bags_per_rank"] != BATCH // fsdp or section["ids_per_bag"] != 1:
        fail(f"{what}: bags_per_rank {section['bags_per_rank']}, ids_per_bag "
             f"{section['ids_per_bag']}, not {BATCH // fsdp} and 1")
    tables = section["tables"]
    if [t["table"] for t in tables] != list(ROWS):
        fail(f"{what}: tables {[t['table'] for t in tables]}, not {list(ROWS)}")
    totals = dict.fromkeys(TOTAL_KEYS, 0)
    for t in tables:
        if list(t) != TABLE_KEYS or list(t["step"]) != STEP_KEYS:
            fail(f"{what}: table {t['table']}'s keys are {list(t)}, step {list(t['step'])}")
        want = expected(t["table"], fsdp, tp, optimizer)
        for key, value in want.items():
            if t[key] != value:
                fail(f"{what}: table {t['table']}'s {key} is {t[key]}, expected {value}")
        if t["shape"] != [ROWS[t["table"]], DIM] or t["parameter"] != (
                f"embeddings/{t['table']}/weight"):
            fail(f"{what}: table {t['table']} is {t['parameter']} {t['shape']}")
        # The table's parameter row agrees (its bytes per rank are the weights').
        param = next(p for p in doc["parameters"] if p["name"] == t["parameter"])
        if param["bytes_per_rank"] != t["weight_bytes_per_rank"]:
            fail(f"{what}: {t['parameter']} holds {param['bytes_per_rank']} bytes per rank in "
                 f"the parameters, {t['weight_bytes_per_rank']} in embedding_tables")
        s = t["step"]
        totals["weight_bytes_per_rank"] += t["weight_bytes_per_rank"]
        totals["gradient_bytes_per_rank"] += t["gradient_bytes_per_rank"]
        totals["optimizer_bytes_per_rank"] += t["optimizer_bytes_per_rank"]
        totals["bytes_per_rank"] += t["bytes_per_rank"]
        totals["all_to_all_bytes_per_step"] += (
            s["counts_all_to_all_bytes"] + s["ids_all_to_all_bytes"] +
            s["partial_sums_all_to_all_bytes"] + s["backward_all_to_all_bytes"])
        totals["column_all_gather_bytes_per_step"] += s["column_all_gather_bytes"]
        totals["forward_bytes_per_step"] += s["forward_bytes"]
        totals["backward_bytes_per_step"] += s["backward_bytes"]
        totals["total_bytes_per_step"] += s["total_bytes"]
    if section["totals"] != totals:
        fail(f"{what}: totals {section['totals']}, expected {totals}")
    return section


def check_gradient_buckets(meshtrain):
    """The DLRM's linear layers all-reduce their gradients in buckets (layers/dlrm.cpp, runtime.
    bucket_mb; plan_options switches the plan to them for model.kind = "dlrm"): the step cost of
    configs/dlrm_synthetic.toml holds one "gradient buckets" item for its one group (the MLPs
    are replicated, their gradients summed over fsdp: fsdp=2 on world 2, fsdp=4 on world 4) and
    no per-layer gradient all-reduce of a linear layer. Its 8 gradients (top/1, top/0, bottom/1,
    bottom/0, weight and bias each) are 25,553 floats: one bucket at the default 25 MiB, two at
    runtime.bucket_mb = 0.05 (13,107 floats, as layers/gradient_buckets.cpp floors it)."""
    config = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "configs",
                          "dlrm_synthetic.toml")
    layers = ["top/1", "top/0", "bottom/1", "bottom/0"]
    cases = [(2, [], 1), (4, [], 1), (2, ["--set", "runtime.bucket_mb=0.05"], 2)]
    for world, sets, buckets in cases:
        argv = [meshtrain, "plan", config, "--world", str(world), *sets, "--json"]
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            fail(f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout}{done.stderr}")
        what = " ".join(argv[2:])
        doc = json.loads(done.stdout)
        floats = sum(p["shape"][0] * (p["shape"][1] if len(p["shape"]) > 1 else 1)
                     for p in doc["parameters"] if not p["name"].startswith("embeddings/"))
        if floats != 25553:
            fail(f"{what}: the linear layers hold {floats} floats, not 25553")
        items = doc["cost"]["items"]
        bucketed = [i for i in items if i["layer"] == "gradient buckets"]
        want = [{"phase": "backward", "category": "collective", "group": f"fsdp={world}",
                 "what": f"all-reduce gradients in {buckets} bucket{'s' if buckets > 1 else ''} "
                         f"(8 gradients of 4 layers: {', '.join(layers)})"}]
        got = [{k: i[k] for k in want[0]} for i in bucketed]
        if got != want or not bucketed[0]["seconds"] > 0:
            fail(f"{what}: the gradient buckets items are {bucketed}, expected {want}")
        own = [i for i in items if i["layer"] in layers and i["category"] == "collective"]
        if own:
            fail(f"{what}: linear layers with their own collectives besides the buckets: {own}")


TABLE_RULES = ('partition.rules=[["embeddings/(big|small)/weight", "P(fsdp@table)"], '
               '["embeddings/wide/weight", "P(None, tp)"], [".*", "P()"]]')


def check_table_wise(meshtrain, config):
    """big and small table-wise over fsdp 2 (world 2): the planner puts big (64 rows) on member
    0 and small (6) on member 1; each row shows its holder's block and row-wise's exchange with
    one owner (one part per bag); the totals are the most loaded rank's: member 0's big plus
    the replicated wide (tp 1), not big + small + wide."""
    argv = [meshtrain, "plan", config, "--world", "2", "--set", TABLE_RULES, "--json"]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        fail(f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout}{done.stderr}")
    doc = json.loads(done.stdout)
    tables = {t["table"]: t for t in doc["embedding_tables"]["tables"]}
    bags = BATCH // 2
    for table, member in (("big", 0), ("small", 1)):
        t = tables[table]
        rows = ROWS[table]
        want = {"placement": f"table-wise on member {member} of (fsdp)",
                "sharding": "table-wise", "table_wise_member": member, "row_axes": ["fsdp"],
                "rows_per_rank": rows, "weight_bytes_per_rank": rows * DIM * F}
        for key, value in want.items():
            if t[key] != value:
                fail(f"table-wise {table}: {key} is {t[key]}, expected {value}")
        step = {"parts": bags, "counts_all_to_all_bytes": moved("all_to_all", 2 * 4 * F, 2),
                "ids_all_to_all_bytes": moved("all_to_all", bags * 3 * F, 2),
                "partial_sums_all_to_all_bytes": moved("all_to_all", bags * DIM * F, 2),
                "backward_all_to_all_bytes": moved("all_to_all", bags * DIM * F, 2),
                "gradient_all_reduce_bytes": 0}
        for key, value in step.items():
            if t["step"][key] != value:
                fail(f"table-wise {table}: step {key} is {t['step'][key]}, expected {value}")
        param = next(p for p in doc["parameters"] if p["name"] == t["parameter"])
        if param["spec"] != [f"fsdp@{member}"] or param["bytes_per_rank"] != rows * DIM * F:
            fail(f"table-wise {table}: the parameter row is {param}")
    busiest = ROWS["big"] * DIM * F + ROWS["wide"] * DIM * F
    totals = doc["embedding_tables"]["totals"]
    if totals["weight_bytes_per_rank"] != busiest:
        fail(f"table-wise: weights on the most loaded rank {totals['weight_bytes_per_rank']}, "
             f"expected {busiest}")
    text = subprocess.run(argv[:-1], capture_output=True, text=True).stdout
    for needle in ("big    table-wise on member 0 of (fsdp)  64 x 8 (others: 0)",
                   "small  table-wise on member 1 of (fsdp)  6 x 8 (others: 0)",
                   "on the most loaded rank"):
        if needle not in text:
            fail(f"the table-wise text plan lacks {needle!r}:\n{text}")


def check_table_wise_mixed(meshtrain, config):
    """Tables a [100, 8] and b [300, 2] (interaction "cat"), table-wise over fsdp 2 with
    rowwise_adagrad: the planner puts a (800 floats) on member 0 and b (600) on member 1. Member
    0 holds weights 3200 + no gradient (sparse updates release it) + state 400 + row-to-slot map
    400 = 4000 bytes, member 1 2400 + 0 + 1200 + 1200 = 4800: the most loaded rank holds 4800,
    split as member 1's (taking each figure's maximum separately would give 3200 + 0 + 2400 =
    5600, on no rank). The plan's top-level totals are the linear layers' plus member 1's."""
    with open(config) as f:
        text = f.read()
    text = re.sub(r"\[partition\].*?\n\n", "[partition]\nmin_sharding_size = 0\n"
                  "rules = [[\"embeddings/(a|b)/weight\", \"P(fsdp@table)\"], [\".*\", \"P()\"]]"
                  "\n\n", text, flags=re.S)
    text = re.sub(r"top = .*?\n", "top = [18, 4, 1]\n", text)  # 8 + 8 + 2
    text = text.replace('interaction = "dot"', 'interaction = "cat"')
    text = re.sub(r"\[\[model\.tables\]\].*?(?=\n\[data\])",
                  '[[model.tables]]\nname = "a"\nrows = 100\ndim = 8\n'
                  '[[model.tables]]\nname = "b"\nrows = 300\ndim = 2\n', text, flags=re.S)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "dlrm_mixed.toml")
        with open(path, "w") as f:
            f.write(text)
        argv = [meshtrain, "plan", path, "--world", "2", "--set",
                'optimizer.embeddings="rowwise_adagrad"', "--json"]
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            fail(f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout}{done.stderr}")
        whole = json.loads(done.stdout)
        section = whole["embedding_tables"]
        text_plan = subprocess.run(argv[:-1], capture_output=True, text=True).stdout
    tables = {t["table"]: t for t in section["tables"]}
    members = {}
    for name, rows, dim in (("a", 100, 8), ("b", 300, 2)):
        t = tables[name]
        block = rows * dim * F
        want = {"weight_bytes_per_rank": block, "gradient_bytes_per_rank": 0,
                "optimizer_bytes_per_rank": rows * F + rows * 4}
        for key, value in want.items():
            if t[key] != value:
                fail(f"mixed table-wise {name}: {key} is {t[key]}, expected {value}")
        members[t["table_wise_member"]] = want
    if sorted(members) != [0, 1] or tables["a"]["table_wise_member"] != 0:
        fail(f"mixed table-wise: members {[(n, t['table_wise_member']) for n, t in tables.items()]}"
             ", expected a on 0 and b on 1")
    busiest = max(members.values(), key=lambda m: sum(m.values()))
    totals = section["totals"]
    got = [totals["weight_bytes_per_rank"], totals["gradient_bytes_per_rank"],
           totals["optimizer_bytes_per_rank"], totals["bytes_per_rank"]]
    want = [busiest["weight_bytes_per_rank"], busiest["gradient_bytes_per_rank"],
            busiest["optimizer_bytes_per_rank"], sum(busiest.values())]
    if got != want or want[3] != 4800:
        fail(f"mixed table-wise: the most loaded rank's weights, gradients, state and total are "
             f"{got}, expected {want} (4800)")
    # The plan's top-level totals: the linear layers' (replicated: whole on each rank, a
    # gradient and AdamW's m and v each) plus the same member's tables, not a mix of members.
    slots = whole["options"]["optimizer_slots"]
    linear = sum(p["bytes_per_rank"] for p in whole["parameters"]
                 if not p["name"].startswith("embeddings/"))
    top = whole["totals"]
    got = [top["parameter_bytes"], top["gradient_bytes"], top["optimizer_bytes"]]
    want = [linear + busiest["weight_bytes_per_rank"], linear + busiest["gradient_bytes_per_rank"],
            slots * linear + busiest["optimizer_bytes_per_rank"]]
    if slots != 2 or linear <= 0 or got != want:
        fail(f"mixed table-wise: the plan's totals (parameters, gradients, optimizer) are {got}, "
             f"expected {want} (the linear layers' {linear} bytes with {slots} slots, and member "
             f"1's tables)")
    if "= 4.69 KiB on the most loaded rank" not in text_plan:  # 4800 / 1024
        line = next((l for l in text_plan.splitlines() if l.startswith("  total: weights")), "")
        fail(f"mixed table-wise: the text plan's total line is {line!r}, expected 4800 bytes")


TWO_GROUP_RULES = ('partition.rules=[["embeddings/(big|small)/weight", "P(fsdp, None)"], '
                   '["embeddings/wide/weight", "P(dp, None)"], [".*", "P()"]]')


def check_exchange_cost(meshtrain, config):
    """The step cost charges the row-wise (and table-wise) tables' all-to-alls as the run makes
    them, one EmbeddingExchange per communicator of row axes of size > 1: exactly 4 items whose
    `what` starts with "all-to-all" per group (id counts, ids and partial sums in forward, the
    parts' dy in backward), all in layer "embeddings", named "(N tables)" with N the group's
    tables, and none in a table's own layer. World 1: no group; world 2 and 4 (fsdp 2, and x tp
    2): big alone over fsdp; world 2 with big and small table-wise over fsdp: one group of 2;
    world 4 as fsdp 2 x dp 2 with big and small over fsdp and wide over dp: two groups."""
    cases = [(1, ["--set", "mesh.tp=1"], {}),
             (2, ["--set", "mesh.tp=1"], {"fsdp=2": 1}),
             (4, ["--set", "mesh.tp=2"], {"fsdp=2": 1}),
             (2, ["--set", TABLE_RULES], {"fsdp=2": 2}),
             (4, ["--set", "mesh.dp=2", "--set", TWO_GROUP_RULES], {"fsdp=2": 2, "dp=2": 1})]
    for world, sets, want in cases:
        argv = [meshtrain, "plan", config, "--world", str(world), *sets, "--json"]
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            fail(f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout}{done.stderr}")
        what = " ".join(argv[3:])
        items = [i for i in json.loads(done.stdout)["cost"]["items"]
                 if i["what"].startswith("all-to-all")]
        stray = [i for i in items if i["layer"] != "embeddings"]
        if stray:
            fail(f"{what}: all-to-all cost items outside layer \"embeddings\": {stray}")
        groups = {}
        for i in items:
            groups.setdefault(i["group"], []).append(i)
        if sorted(groups) != sorted(want):
            fail(f"{what}: all-to-all items in groups {sorted(groups)}, expected {sorted(want)}: "
                 f"{items}")
        for group, tables in want.items():
            named = f"({tables} table{'s' if tables > 1 else ''})"
            got = [(i["phase"], i["what"]) for i in groups[group]]
            expect = [("forward", f"all-to-all id counts {named}"),
                      ("forward", f"all-to-all ids {named}"),
                      ("forward", f"all-to-all partial sums {named}"),
                      ("backward", f"all-to-all dy of the parts {named}")]
            if got != expect:
                fail(f"{what}: group {group}'s all-to-all items are {got}, expected {expect}")


def main():
    if len(sys.argv) != 3:
        fail("usage: check_dlrm_plan.py MESHTRAIN CONFIG")
    meshtrain, config = sys.argv[1:]
    for world, tp in ((1, 1), (2, 1), (2, 2), (4, 2)):
        for optimizer in ("dense", "rowwise_adagrad", "sparse_adamw"):
            section = check_json(meshtrain, config, world, tp, optimizer)
            if (world, tp, optimizer) == (4, 2, "dense"):
                # Literal figures (8 bags per rank): big's ids all-to-all 8 ids x 12 bytes / 2
                # and its partial sums 8 x 8 floats / 2; wide's gathered [8, 8] / 2; small's
                # gradient [6, 8] all-reduced over fsdp 2: 2 x 192 / 2.
                big, wide, small = section["tables"]
                literal = [(big["step"]["ids_all_to_all_bytes"], 48),
                           (big["step"]["partial_sums_all_to_all_bytes"], 128),
                           (big["step"]["counts_all_to_all_bytes"], 16),
                           (big["weight_bytes_per_rank"], 1024),
                           (wide["step"]["column_all_gather_bytes"], 128),
                           (wide["columns_per_rank"], 4),
                           (small["step"]["gradient_all_reduce_bytes"], 192),
                           (section["totals"]["all_to_all_bytes_per_step"], 16 + 48 + 128 + 128)]
                for got, want in literal:
                    if got != want:
                        fail(f"world 4: a literal figure is {got}, not {want}: {section}")
    check_gradient_buckets(meshtrain)
    # The text: the section's header, a row per table with its placement and block, the totals.
    text = plan(meshtrain, config, 4, 2, "dense", False)
    lines = text.splitlines()
    try:
        start = next(i for i, l in enumerate(lines) if l.startswith("embedding tables (per rank;"))
    except StopIteration:
        fail(f"the text plan has no embedding tables section:\n{text}")
    if "8 bags of 1 id each" not in lines[start]:
        fail(f"the section's header does not say 8 bags of 1 id: {lines[start]!r}")
    body = "\n".join(lines[start:start + 8])
    for needle in ("big    row-wise over (fsdp)", "wide   column-wise over (tp)",
                   "small  replicated", "32 x 8", "10 x 4", "6 x 8", "  total: weights",
                   "  per step: forward ids all-to-all"):
        if needle not in body:
            fail(f"the text plan's embedding tables section lacks {needle!r}:\n{body}")
    check_table_wise(meshtrain, config)
    check_table_wise_mixed(meshtrain, config)
    check_exchange_cost(meshtrain, config)
    print("PASS")


if __name__ == "__main__":
    main()
