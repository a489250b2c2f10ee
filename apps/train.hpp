#pragma once
// `meshtrain train CONFIG [--set ...]`: trains the config's MLP on the mesh of the MPI
// world, with the progress line, metrics.jsonl, evaluation, checkpoints and a summary.

#include <string>
#include <vector>

namespace meshtrain {

class Runtime;

// Returns the exit status (0, or 2 / 1 when a setup error was reported once on rank 0).
// Errors that strike only some ranks while training propagate as exceptions: the caller
// ends every rank (run_or_abort).
int train_command(const std::string& config_path, const std::vector<std::string>& overrides,
                  Runtime& runtime);

}  // namespace meshtrain
