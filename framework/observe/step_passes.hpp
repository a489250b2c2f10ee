#pragma once
// The passes of a traced run's steps (framework/observe/pass_counter.hpp): while
// [runtime] trace_steps records, the run counts rank 0's kernels, copies and fences per step
// and writes them beside the trace as <trace_dir>/passes.json, with the labels of the last
// traced step (a steady-state step when the window starts after the first two);
// `meshtrain trace-report` prints them.

#include <cstdint>
#include <iosfwd>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "framework/observe/pass_counter.hpp"

namespace meshtrain {

struct StepPasses {
  int64_t step = 0;
  PassTotals totals;
};

struct TracedPasses {
  int rank = 0;
  std::vector<StepPasses> steps;
  int64_t labels_step = 0;  // the step `labels` belong to (the last traced one)
  PassCounts labels;        // its totals and counts by label
};

// Counts by label as JSON: {"kernels": n, "copies": n, "copy_bytes": n, "fences": n,
// "complete": bool, "labels": {"<kind> <label>": count, ...}} (the budget test's format too).
nlohmann::ordered_json pass_counts_json(const PassCounts& counts);
// The same back; throws Error when `doc` is not of that shape.
PassCounts pass_counts_from_json(const nlohmann::json& doc);

// The key of a label in pass_counts_json's "labels": "<kind> <label>".
std::string pass_label_key(const LabelPasses& label);

nlohmann::ordered_json traced_passes_json(const TracedPasses& passes);
// Reads <trace_dir>/passes.json; nullopt when there is none (a trace of an older meshtrain).
// Throws bad_input naming the file when it is not readable JSON of that shape.
std::optional<TracedPasses> read_traced_passes(const std::string& trace_dir);
void print_traced_passes(const TracedPasses& passes, std::ostream& out);

}  // namespace meshtrain
