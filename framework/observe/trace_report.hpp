#pragma once
// What a traced run's steps spent their time on, from the files [runtime] trace_steps writes
// (framework/observe/trace.hpp), beside the cost model's prediction: `meshtrain trace-report`.
//
// Per rank, each traced step splits into
//   data wait      the "data wait" spans;
//   exposed comm.  the time the step's thread spent inside communication: blocking
//                  collectives, the starts of non-blocking ones and the waits for them;
//   idle           the step outside all of its phases (bookkeeping between them);
//   compute        the rest: step - data wait - exposed communication - idle.
// A non-blocking operation is in flight from the end of its start to the start of its wait:
// that time is communication overlapped with (hidden under) the rank's other work, and
// communication = exposed + overlapped. Figures are seconds per step, averaged over the
// traced steps.

#include <cstdint>
#include <iosfwd>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "partition/cost_model.hpp"

namespace meshtrain {

// One span of a rank's trace file ("X" events), times in seconds on rank 0's clock.
struct TracedSpan {
  std::string name;
  // step, phase, layer, gemm, collective, wait; on the device track "device " + the kind
  std::string category;
  double start = 0.0, duration = 0.0;
  int64_t step = 0;       // a step span's number
  int64_t operation = 0;  // a non-blocking operation's flow id (its start and its wait)
  double flops = 0.0;     // a GEMM's 2 m n k
  double end() const { return start + duration; }
};

struct RankTrace {
  int rank = 0;
  std::vector<TracedSpan> spans;  // in the file's order (by start)
};

// Reads <trace_dir>/rank-0.json, rank-1.json, ...: as many as rank-0.json says were traced
// (files beyond them, left by an earlier run of more ranks, are not read; files of an older
// meshtrain, which do not say, as many as there are from 0 on). Throws bad_input naming the
// file when one is missing, unreadable, not a trace of meshtrain, or of another trace window
// than rank-0.json.
std::vector<RankTrace> read_trace_dir(const std::string& trace_dir);

struct StepSplit {
  int rank = 0;
  double step = 0.0, compute = 0.0, exposed_communication = 0.0, overlapped_communication = 0.0,
         data_wait = 0.0, idle = 0.0;
};

// A collective kind in a layer (or in a phase outside the layers: "optimizer", "loss", ...),
// seconds per step: measured, what the operations took (a blocking one its span; a started
// one from its start to the end of its wait, an upper bound), the mean over ranks and the
// slowest rank's; exposed, the part the step's thread spent in them (the started ones'
// starts and waits); predicted, the cost model's (negative when it predicts none).
struct CollectiveRow {
  std::string where, kind;
  double count_per_step = 0.0;  // on each rank
  double measured = 0.0, slowest = 0.0, exposed = 0.0, predicted = -1.0;
};

// The GEMMs of a layer (or of a phase outside the layers), per step, at the device's times
// where the trace has a device track (a GPU build), else at the host's: their count on each
// rank, seconds (the mean over ranks and the slowest rank's), the rate they ran at (floating
// point operations over the mean seconds), and the cost model's seconds for that layer's
// GEMMs (negative when it predicts none).
struct GemmRow {
  std::string where;
  double count_per_step = 0.0;
  double measured = 0.0, slowest = 0.0, flop_per_s = 0.0, predicted = -1.0;
};

struct PhaseRow {
  std::string phase;
  double mean = 0.0;     // over ranks
  double slowest = 0.0;  // the slowest rank's
  int slowest_rank = 0;
};

struct TraceReport {
  int ranks = 0;
  int64_t steps = 0;                 // traced steps (each rank has the same)
  std::vector<StepSplit> split;      // one per rank
  double overlapped_fraction = 0.0;  // overlapped / all communication, over every rank
  std::vector<CollectiveRow> collectives;
  std::vector<GemmRow> gemms;
  bool gemms_on_device = false;  // the GEMM rows timed from the device track (its spans)
  std::vector<PhaseRow> phases;
  double predicted_step = -1.0;  // the cost model's step (negative: no prediction)
};

// The report of `ranks`; `predicted` (may be null) is the cost model's step for the run's
// config and world size.
TraceReport summarize_trace(const std::vector<RankTrace>& ranks, const StepCost* predicted);

nlohmann::ordered_json trace_report_json(const TraceReport& report);
void print_trace_report(const TraceReport& report, std::ostream& out);

}  // namespace meshtrain
