#pragma once
// The communication backend of a run ([runtime] backend): which Communicator moves the
// tensors of every mesh group. MPI stays the control plane either way (failure agreement,
// small host broadcasts, parallel HDF5).
//
//   mpi   MpiCommunicator; with device memory (a CUDA Kokkos) it stages each transfer
//         through pinned host buffers, so several ranks may share one GPU.
//   nccl  NcclCommunicator, one per mesh group; needs a CUDA Kokkos, NCCL, and one GPU per
//         rank (NCCL refuses two ranks of one communicator on one GPU).
//   auto  nccl when the build has both (CUDA Kokkos and NCCL), mpi otherwise.

#include <mpi.h>

#include <string>

#include "framework/comm/mesh_communicators.hpp"
#include "framework/core/choices.hpp"

namespace meshtrain {

enum class CommBackend { mpi, nccl };

const char* to_string(CommBackend backend);

// True when this build can run the NCCL backend on Kokkos' memory: Kokkos with CUDA and
// NCCL found at configure time.
bool build_supports_nccl();

// The [runtime] backend choice resolved for this build: automatic -> nccl or mpi; nccl on a
// build that cannot run it is bad_input naming runtime.backend.
CommBackend resolve_comm_backend(CommBackendChoice requested);
// The same from its name (parse_comm_backend: bad_input for an unknown one).
CommBackend resolve_comm_backend(const std::string& requested);

// Readies the process for `backend` and returns the factory MeshCommunicators builds each
// group's communicator with. Collective over `world` (every rank must call it; all throw
// the same Error when one fails). For nccl it checks that no node runs more ranks than it
// has GPUs (bad_input naming runtime.backend otherwise; skipped when NCCL_HOSTID is set,
// which makes each rank its own host to NCCL) and binds each rank to its GPU.
CommunicatorFactory prepare_comm_backend(CommBackend backend, MPI_Comm world);

}  // namespace meshtrain
