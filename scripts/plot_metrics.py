#!/usr/bin/env python3
"""Plots meshtrain metrics.jsonl files (see scripts/plot): training loss, evaluation
accuracy and test loss, and the learning rate, against steps. Prints the PNG's path."""
import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt  # noqa: E402


def read_events(path):
    logs, evals = [], []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError as e:
                sys.exit(f"plot: {path}:{number}: not a JSON line ({e.msg})")
            if event.get("event") == "log":
                logs.append(event)
            elif event.get("event") == "eval":
                evals.append(event)
    if not logs and not evals:
        sys.exit(f"plot: {path} holds no log or eval events")
    return logs, evals


def run_name(path):
    # runs/<name>/metrics.jsonl -> <name>
    parent = os.path.basename(os.path.dirname(os.path.abspath(path)))
    return parent or path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", nargs="+", help="metrics.jsonl files")
    parser.add_argument("-o", "--output", help="PNG path (default: next to the first file)")
    args = parser.parse_args()
    for path in args.metrics:
        if not os.path.isfile(path):
            sys.exit(f"plot: {path} does not exist")
    output = args.output or os.path.join(os.path.dirname(os.path.abspath(args.metrics[0])),
                                         "metrics.png")

    fig, (loss_ax, eval_ax, lr_ax) = plt.subplots(3, 1, figsize=(8, 10), sharex=True)
    test_loss_ax = eval_ax.twinx()
    for path in args.metrics:
        logs, evals = read_events(path)
        name = run_name(path)
        if logs:
            line, = loss_ax.plot([e["step"] for e in logs], [e["loss"] for e in logs], label=name)
            rates = [(e["step"], e["lr"]) for e in logs if "lr" in e]
            if rates:
                lr_ax.plot(*zip(*rates), color=line.get_color(), label=name)
        accuracy = [(e["step"], e["test_accuracy"]) for e in evals if "test_accuracy" in e]
        if accuracy:
            eval_ax.plot(*zip(*accuracy), marker="o", label=f"{name} accuracy")
        test_loss = [(e["step"], e["test_loss"]) for e in evals if "test_loss" in e]
        if test_loss:
            test_loss_ax.plot(*zip(*test_loss), marker="x", linestyle="--",
                              label=f"{name} test loss")
    loss_ax.set_ylabel("training loss")
    loss_ax.set_yscale("log")
    loss_ax.legend()
    loss_ax.grid(True, alpha=0.3)
    eval_ax.set_ylabel("test accuracy")
    test_loss_ax.set_ylabel("test loss")
    handles = eval_ax.get_legend_handles_labels()
    more = test_loss_ax.get_legend_handles_labels()
    if handles[0] or more[0]:
        eval_ax.legend(handles[0] + more[0], handles[1] + more[1], loc="best")
    eval_ax.grid(True, alpha=0.3)
    lr_ax.set_ylabel("learning rate")
    lr_ax.set_xlabel("step")
    lr_ax.grid(True, alpha=0.3)
    if lr_ax.lines:
        lr_ax.legend()
    fig.suptitle("meshtrain: " + ", ".join(run_name(p) for p in args.metrics))
    fig.tight_layout()
    fig.savefig(output, dpi=100)
    print(output)


if __name__ == "__main__":
    main()
