#pragma once
// What TrainingRun and DlrmRun both need from their config at set-up (run/ internal).

#include <mpi.h>

#include <cstdint>
#include <functional>
#include <string>

#include "framework/train/config.hpp"
#include "framework/train/optimizer.hpp"

namespace meshtrain {

// The optimizer's settings from [optimizer].
OptimizerSettings optimizer_settings(const OptimizerSection& section);

// Creates `dir` (and its parents) and checks that a file can be made in it; bad_input naming
// the config key otherwise.
void ensure_writable_directory(const std::string& dir, const char* key);

// run.output_dir, or runs/<run.name>: where a run writes its metrics, traces and reports.
std::string run_directory(const RunConfig& config);

// [runtime] trace_steps (docs/running.md, "Traces"): the clock a run's traced steps are written
// on (every rank's timestamps on rank 0's clock, from a common origin).
struct TraceClock {
  int64_t offset_ns = 0;  // this rank's clock to rank 0's
  int64_t origin_ns = 0;  // the trace's time 0, on rank 0's clock
};
// Before the first traced step: rank 0 removes an earlier run's trace files from `dir` (of more
// ranks, they must not be read as this run's), the ranks agree on the clock, and the tracer
// starts with room for 64 Ki events a step (more are counted as dropped). Collective.
TraceClock start_trace(MPI_Comm comm, int rank, const RuntimeSection& runtime,
                       const std::string& dir);
// After the last traced step (the tracer stopped): each rank writes <dir>/rank-<k>.json, then
// rank 0 merges them into all-ranks.json, writes the run's config.toml and runs
// `more_on_rank0` (may be empty) for its own files. Collective; errors are agreed.
void write_traces(MPI_Comm comm, int rank, const TraceClock& clock, const std::string& dir,
                  const RunConfig& config, const std::function<void()>& more_on_rank0 = {});

}  // namespace meshtrain
