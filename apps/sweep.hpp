#pragma once
// `meshtrain sweep CONFIG --grid key=v1,v2 ... [--ranks-per-run N] [--set ...]`
// (docs/sweeps.md): the runs of a grid of config values, side by side on groups of N ranks
// of one MPI job (one after another when N is the whole job), each a TrainingRun on its
// group's communicator in a folder of its own; a table of each run's final and best metrics
// printed by world rank 0 and written to <run.output_dir>/sweep/sweep.jsonl.

#include <string>
#include <vector>

namespace meshtrain {

struct SweepArgs {
  std::string config;
  std::vector<std::string> grid;       // "section.key=v1,v2,...", in the order given
  std::vector<std::string> overrides;  // --set, applied to every run before the grid's values
  int ranks_per_run = 0;               // 0: the whole world (the runs one after another)
  std::string hardware;
};

// One --grid argument: the key and each value's text, split at the commas outside brackets,
// braces and quotes ("model.sizes=[784, 64, 10],[784, 32, 10]" has two values). Throws
// bad_input naming the argument for text without '=', an unknown key, a key the sweep sets
// itself (run.output_dir, checkpoint.dir) and an empty value.
struct GridAxis {
  std::string key;  // "optimizer.lr"
  std::vector<std::string> values;
};
GridAxis parse_grid_axis(const std::string& text, const std::string& file);

// The cartesian product of the axes, the first axis varying slowest (as nested loops in the
// order given): each entry one "key=value" override per axis.
std::vector<std::vector<std::string>> grid_points(const std::vector<GridAxis>& axes);

// Collective over MPI_COMM_WORLD. Returns 0 when every run trained, 1 when some run failed
// (after the others ran and the table, which names each failure, was written), or 2 when the
// grid, the config or --ranks-per-run is refused (one sentence, printed once, before any run
// starts). An error that strikes only some
// ranks of a group (not agreed) propagates: the caller ends every rank (run_or_abort).
int sweep_command(const SweepArgs& args);

}  // namespace meshtrain
