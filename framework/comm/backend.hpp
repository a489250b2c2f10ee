#pragma once
// The communication backend of a run ([runtime] backend): which Communicator moves the
// tensors of every mesh group. MPI stays the control plane either way (failure agreement,
// small host broadcasts, parallel HDF5).
//
//   mpi   MpiCommunicator; with device memory (a CUDA Kokkos) it stages each transfer
//         through pinned host buffers, so several ranks may share one GPU.
//   nccl  NcclCommunicator, one per mesh group; needs a CUDA Kokkos, NCCL, and one GPU per
//         rank (NCCL refuses two ranks of one communicator on one GPU).
//   auto  nccl when the build has both (CUDA Kokkos and NCCL) and every rank has a GPU of its
//         own; mpi otherwise (a CPU build, or a node running more ranks than it has GPUs).

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

// Throws bad_input naming runtime.backend when `requested` is nccl and the build cannot run
// it. Not collective: for the config checks every rank makes alike.
void require_comm_backend_available(CommBackendChoice requested);

// The [runtime] backend choice resolved for this build and these ranks: nccl on a build that
// cannot run it is bad_input naming runtime.backend; automatic is nccl where the build can
// run it and no node of `world` runs more ranks than it has GPUs, else mpi (then `note`, when
// given, says why). Collective over `world` for automatic on an NCCL build: every rank gets
// the same answer.
CommBackend resolve_comm_backend(CommBackendChoice requested, MPI_Comm world,
                                 std::string* note = nullptr);
// The same from its name (parse_comm_backend: bad_input for an unknown one).
CommBackend resolve_comm_backend(const std::string& requested, MPI_Comm world);

// Readies the process for `backend` and returns the factory MeshCommunicators builds each
// group's communicator with. Collective over `world` (every rank must call it; all throw
// the same Error when one fails). For nccl it checks that no node runs more ranks than it
// has GPUs (bad_input naming runtime.backend otherwise; skipped when NCCL_HOSTID is set,
// which makes each rank its own host to NCCL) and binds each rank to its GPU.
CommunicatorFactory prepare_comm_backend(CommBackend backend, MPI_Comm world);

}  // namespace meshtrain
