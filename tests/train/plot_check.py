#!/usr/bin/env python3
"""Checks what scripts/plot_metrics.py draws for one run's metrics.jsonl (its describe()):

    plot_check.py REPO_DIR METRICS_JSONL classification|regression

Both: a first panel "loss" on a log scale with the training loss and the test loss, and a
"learning rate" panel. Classification: a "test accuracy" panel with one line, and no R^2.
Regression: no accuracy panel (the run has no accuracy) and a "test R^2" panel with a line per
output of the run's evaluations and their mean. Exit 0 pass, 1 fail."""
import json
import sys


def main():
    repo, metrics, kind = sys.argv[1:4]
    sys.path.insert(0, repo + "/scripts")
    import plot_metrics

    panels = plot_metrics.describe(plot_metrics.make_figure([metrics]))
    print(json.dumps(panels, indent=1))
    by_title = {p["title"]: p for p in panels}
    failures = []

    def check(condition, message):
        if not condition:
            failures.append(message)

    def labelled(panel):
        return [line for line in panel["lines"] if not line.startswith("_")]

    check(panels and panels[0]["title"] == "loss", "the first panel is not the loss")
    loss = by_title.get("loss", {"lines": [], "yscale": ""})
    check(loss["yscale"] == "log", "the loss panel is on a %r scale, not log" % loss["yscale"])
    check(any(line.endswith("training loss") for line in loss["lines"]),
          "no training loss line: %s" % loss["lines"])
    check(any(line.endswith("test loss") for line in loss["lines"]),
          "no test loss line on the loss panel: %s" % loss["lines"])
    check("learning rate" in by_title, "no learning rate panel")

    with open(metrics) as f:
        events = [json.loads(line) for line in f if line.strip()]
    evals = [e for e in events if e.get("event") == "eval"]
    check(evals, "the run wrote no eval events")
    if kind == "classification":
        check(len(by_title.get("test accuracy", {"lines": []})["lines"]) == 1,
              "no single test accuracy line")
        check("test R^2" not in by_title, "a classification run has an R^2 panel")
    else:
        check("test accuracy" not in by_title,
              "a regression run has a test accuracy panel (it has no accuracy)")
        r2 = by_title.get("test R^2")
        if r2 is None:
            failures.append("no test R^2 panel")
        else:
            outputs = len(evals[-1].get("test_r2_per_output", [])) if evals else 0
            check(outputs > 0, "the run's evaluations have no test_r2_per_output")
            lines = labelled(r2)
            expected = ["%s output %d" % (lines[0].split(" output ")[0], j)
                        for j in range(outputs)] if lines else []
            check(lines[:outputs] == expected and len(lines) == outputs + 1 and
                  lines[-1].endswith("mean R^2"),
                  "the R^2 panel's lines %s are not one per output (%d) and the mean" %
                  (lines, outputs))
    for message in failures:
        print("FAIL: " + message, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
