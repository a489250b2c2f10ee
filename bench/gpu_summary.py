#!/usr/bin/env python3
"""The table scripts/gpu-check ends its benchmarks with: for each model and precision of
bench_train_step (meshtrain, one rank) and bench/pytorch_train_step.py (eager and torch.compile)
in one bench.jsonl, samples/s and meshtrain's ratio to each PyTorch variant, and each 16-bit
step's ratio to meshtrain's own fp32 step (issue 37's targets: bf16 at least 1.8x meshtrain's
fp32 at 8192 wide, at least 1.2x PyTorch eager autocast and 1.0x torch.compile). Markdown on
stdout, for docs/gpu.md.

  gpu_summary.py BENCH_JSONL
"""
import json
import sys


def variant(line):
    """fp32, tf32, bf16 or fp16: the precision a line ran in."""
    dtype = line.get("param_dtype", "fp32")
    return dtype if dtype != "fp32" else line.get("precision", "fp32")


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    meshtrain, eager, compiled = {}, {}, {}
    for text in open(sys.argv[1]):
        text = text.strip()
        if not text.startswith("{"):
            continue
        line = json.loads(text)
        if line.get("residual_mlp") or line.get("bench") not in ("train_step", "pytorch_train_step"):
            continue
        if line["bench"] == "train_step" and (line.get("ranks") != 1 or "moe_layers" in line):
            continue
        key = (",".join(str(s) for s in line["sizes"]), line["batch"], variant(line))
        if line["bench"] == "train_step":
            meshtrain[key] = line["samples_per_s"]
        elif line.get("compile"):
            compiled[key] = line["samples_per_s"]
        else:
            eager[key] = line["samples_per_s"]

    def ratio(a, b):
        return f"{a / b:.2f}x" if a and b else "-"

    def rate(v):
        return f"{v:,.0f}" if v else "-"

    print("| model, batch | precision | meshtrain samples/s | PyTorch eager | torch.compile | "
          "meshtrain / eager | meshtrain / compile | meshtrain / its fp32 |")
    print("|---|---|---|---|---|---|---|---|")
    for key in sorted(set(meshtrain) | set(eager) | set(compiled)):
        sizes, batch, precision = key
        m = meshtrain.get(key)
        fp32 = meshtrain.get((sizes, batch, "fp32"))
        print(f"| {sizes}, {batch} | {precision} | {rate(m)} | {rate(eager.get(key))} | "
              f"{rate(compiled.get(key))} | {ratio(m, eager.get(key))} | "
              f"{ratio(m, compiled.get(key))} | "
              f"{ratio(m, fp32) if precision != 'fp32' else '-'} |")


if __name__ == "__main__":
    main()
