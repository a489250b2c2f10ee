#!/usr/bin/env python3
"""The step-time arithmetic of the overhead benchmarks (bench/trace_overhead.sh,
bench/flight_overhead.sh): one JSON line per run, then one summary line per variant.

  step_times.py run BENCH METRICS_JSONL VARIANT ROUND NP BATCH SIZES FIRST LAST
      the median step time of steps FIRST..LAST (inclusive) of a run's metrics.jsonl (log
      lines with log_every = 1: the slowest rank's interval), as one JSON line
  step_times.py summary BENCH LINES_JSONL
      per variant, the median over the rounds of those medians and its ratio to "off"
"""
import json
import statistics
import sys


def run(bench, path, variant, rnd, np_, batch, sizes, first, last):
    rates = {}
    for line in open(path):
        e = json.loads(line)
        if e.get("event") == "log":
            rates[e["step"]] = e["samples_per_s"]
    times = [int(batch) / rates[s] for s in range(int(first), int(last) + 1) if s in rates]
    print(json.dumps({"bench": bench, "variant": variant, "round": int(rnd), "np": int(np_),
                      "sizes": [int(s) for s in sizes.split(",")], "batch": int(batch),
                      "steps_measured": len(times),
                      "step_time_median_s": statistics.median(times)}))


def summary(bench, path):
    lines = [json.loads(l) for l in open(path)]
    medians = {}
    for v in dict.fromkeys(l["variant"] for l in lines):
        medians[v] = statistics.median(l["step_time_median_s"] for l in lines
                                       if l["variant"] == v)
    for v, m in medians.items():
        print(json.dumps({"bench": bench, "summary": True, "variant": v,
                          "step_time_median_s": m, "ratio_to_off": m / medians["off"]}))


if __name__ == "__main__":
    {"run": run, "summary": summary}[sys.argv[1]](*sys.argv[2:])
