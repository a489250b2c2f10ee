#!/usr/bin/env python3
"""Plots meshtrain metrics.jsonl files (see scripts/plot): what the runs recorded, against
steps. Prints the PNG's path.

Panels, each only when some run has its data:
  loss           training loss (solid) and test loss (dashed, markers), log scale
  test accuracy  classification runs
  test R^2       regression runs: per output (thin) and their mean (thick)
  test MSE       regression runs without R^2 (a constant target): per output, log scale
  learning rate

describe(figure) returns what each panel holds (its title, y label, scale and lines), which
tests/train/plot_run.sh checks."""
import argparse
import json
import math
import os
import sys

import matplotlib

matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt  # noqa: E402

# Per-output lines are labelled up to this many outputs; beyond it only the mean is.
MAX_LABELLED_OUTPUTS = 8


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


def finite(value):
    return isinstance(value, (int, float)) and math.isfinite(value)


def series(events, key):
    """(steps, values) of the events with a finite `key`."""
    points = [(e["step"], e[key]) for e in events if finite(e.get(key))]
    return tuple(zip(*points)) if points else ((), ())


def per_output(evals, key):
    """{output j: (steps, values)} of the per-output arrays `key` (null entries skipped)."""
    outputs = {}
    for e in evals:
        for j, value in enumerate(e.get(key) or []):
            if finite(value):
                outputs.setdefault(j, []).append((e["step"], value))
    return {j: tuple(zip(*points)) for j, points in sorted(outputs.items())}


class Run:
    def __init__(self, path):
        self.path = path
        self.name = run_name(path)
        self.logs, self.evals = read_events(path)
        self.loss = series(self.logs, "loss")
        self.lr = series(self.logs, "lr")
        self.test_loss = series(self.evals, "test_loss")
        self.accuracy = series(self.evals, "test_accuracy")
        self.r2 = series(self.evals, "test_r2")
        self.r2_per_output = per_output(self.evals, "test_r2_per_output")
        self.mse_per_output = per_output(self.evals, "test_mse_per_output")
        if not self.mse_per_output and self.evals:
            mse = series(self.evals, "test_mse")
            if mse[0]:
                self.mse_per_output = {0: mse}


def plot_per_output(ax, run, color, outputs, mean, what, output_colors=None):
    """One thin line per output (in `output_colors` when given, else the run's color) and the
    mean, thick in the run's color."""
    labelled = len(outputs) <= MAX_LABELLED_OUTPUTS
    for j, (steps, values) in outputs.items():
        ax.plot(steps, values, color=output_colors[j % len(output_colors)] if output_colors
                else color, linewidth=0.9, alpha=0.7,
                label=f"{run.name} output {j}" if labelled else None)
    if mean and mean[0]:
        ax.plot(*mean, color=color, linewidth=2, marker="o", label=f"{run.name} mean {what}")


def make_figure(paths):
    """The figure of the runs in `paths` (metrics.jsonl files)."""
    runs = [Run(p) for p in paths]
    panels = ["loss"]
    if any(r.accuracy[0] for r in runs):
        panels.append("accuracy")
    if any(r.r2_per_output or r.r2[0] for r in runs):
        panels.append("r2")
    # MSE per output where a regression run has no R^2 (every target constant).
    if any(r.mse_per_output and not (r.r2_per_output or r.r2[0]) for r in runs):
        panels.append("mse")
    if any(r.lr[0] for r in runs):
        panels.append("lr")
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 3.3 * len(panels)), sharex=True,
                             squeeze=False)
    ax = {name: axes[i][0] for i, name in enumerate(panels)}
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    # One run: each output a color of its own (the run's first color stays for its mean).
    output_colors = colors[1:] if len(runs) == 1 else None
    for i, run in enumerate(runs):
        color = colors[i % len(colors)]
        if run.loss[0]:
            ax["loss"].plot(*run.loss, color=color, label=f"{run.name} training loss")
        if run.test_loss[0]:
            ax["loss"].plot(*run.test_loss, color=color, linestyle="--", marker="x",
                            label=f"{run.name} test loss")
        if "accuracy" in ax and run.accuracy[0]:
            ax["accuracy"].plot(*run.accuracy, color=color, marker="o",
                                label=f"{run.name} test accuracy")
        if "r2" in ax and (run.r2_per_output or run.r2[0]):
            plot_per_output(ax["r2"], run, color, run.r2_per_output, run.r2, "R^2", output_colors)
        elif "mse" in ax and run.mse_per_output:
            plot_per_output(ax["mse"], run, color, run.mse_per_output, None, "MSE",
                            output_colors)
        if "lr" in ax and run.lr[0]:
            ax["lr"].plot(*run.lr, color=color, label=run.name)
    titles = {"loss": ("loss", "loss (training solid, test dashed)", "log"),
              "accuracy": ("test accuracy", "test accuracy", "linear"),
              "r2": ("test R^2", "test R^2 per output", "linear"),
              "mse": ("test MSE", "test MSE per output", "log"),
              "lr": ("learning rate", "learning rate", "linear")}
    for name, a in ax.items():
        title, label, scale = titles[name]
        a.set_title(title, loc="left", fontsize="medium")
        a.set_ylabel(label)
        # A log axis needs a positive value to draw; a loss is never negative.
        if scale == "log" and any(y > 0 for line in a.lines for y in line.get_ydata()):
            a.set_yscale("log")
        a.grid(True, alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(loc="best", fontsize="small")
    axes[-1][0].set_xlabel("step")
    fig.suptitle("meshtrain: " + ", ".join(r.name for r in runs))
    fig.tight_layout()
    return fig


def describe(fig):
    """[{"title", "ylabel", "yscale", "lines": [label, ...]}] of the figure's panels."""
    return [{"title": a.get_title(loc="left"), "ylabel": a.get_ylabel(), "yscale": a.get_yscale(),
             "lines": [line.get_label() for line in a.lines]} for a in fig.axes]


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
    fig = make_figure(args.metrics)
    fig.savefig(output, dpi=100)
    print(output)


if __name__ == "__main__":
    main()
