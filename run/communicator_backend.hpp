#pragma once
// Which communicator backend a run uses: the one place a TrainingRun gets its
// CommunicatorFactory from (framework/comm/mesh_communicators.hpp).

#include "framework/comm/mesh_communicators.hpp"
#include "framework/train/config.hpp"

namespace meshtrain {

// The backend for `config`. Today the MPI backend (make_mpi_communicator); the place for a
// `[runtime] backend = auto | mpi | nccl` choice.
CommunicatorFactory communicator_factory(const RunConfig& config);

}  // namespace meshtrain
