#pragma once
// `meshtrain train CONFIG [--set ...]`: a TrainingRun (run/training_run.hpp) of the config
// on the MPI world, printing its progress, evaluations, checkpoints and a summary on rank 0.

#include <string>
#include <vector>

namespace meshtrain {

// Returns the exit status: 0, or 2 / 1 when an error that every rank agreed on (bad input
// at set-up, a non-finite loss) was printed once on rank 0. Errors that strike only some
// ranks propagate as exceptions: the caller ends every rank (run_or_abort).
// `hardware`: a hardware profile file for collective_matmul = auto ("" = the defaults).
int train_command(const std::string& config_path, const std::vector<std::string>& overrides,
                  const std::string& hardware = "");

}  // namespace meshtrain
