#include "framework/comm/backend.hpp"

#include <cstdlib>

#include "framework/comm/backends/mpi_communicator.hpp"
#if MESHTRAIN_HAVE_NCCL
#include "framework/comm/backends/nccl_communicator.hpp"
#endif
#include "framework/comm/failure_agreement.hpp"
#include "framework/comm/mpi_util.hpp"
#include "base/error.hpp"

namespace meshtrain {

namespace {

#if MESHTRAIN_HAVE_NCCL && defined(KOKKOS_ENABLE_CUDA)
constexpr bool kBuildSupportsNccl = true;
#else
constexpr bool kBuildSupportsNccl = false;
#endif

}  // namespace

const char* to_string(CommBackend backend) {
  return backend == CommBackend::nccl ? "nccl" : "mpi";
}

bool build_supports_nccl() {
  return kBuildSupportsNccl;
}

CommBackend resolve_comm_backend(CommBackendChoice requested) {
  switch (requested) {
    case CommBackendChoice::mpi:
      return CommBackend::mpi;
    case CommBackendChoice::automatic:
      return kBuildSupportsNccl ? CommBackend::nccl : CommBackend::mpi;
    case CommBackendChoice::nccl:
      break;
  }
  if (kBuildSupportsNccl) return CommBackend::nccl;
#if MESHTRAIN_HAVE_NCCL
  MESHTRAIN_BAD_INPUT(
      "runtime.backend = \"nccl\" needs a build against a CUDA-enabled Kokkos; this one "
      "computes on the CPU (NCCL moves device memory only): use runtime.backend = \"mpi\"");
#else
  MESHTRAIN_BAD_INPUT(
      "runtime.backend = \"nccl\" needs a build with CUDA Kokkos and NCCL; this one has "
      "neither: use runtime.backend = \"mpi\"");
#endif
}

CommBackend resolve_comm_backend(const std::string& requested) {
  return resolve_comm_backend(parse_comm_backend(requested));
}

CommunicatorFactory prepare_comm_backend(CommBackend backend, MPI_Comm world) {
  if (backend == CommBackend::mpi) return make_mpi_communicator;
#if MESHTRAIN_HAVE_NCCL && defined(KOKKOS_ENABLE_CUDA)
  if (auto error = run_agreed(world, [&] {
        const int ranks = node_place(world).local_size;
        const int devices = cuda_device_count();
        // NCCL_HOSTID set: each rank declares a host of its own (ranks sharing a GPU over
        // sockets, an experiment NCCL may or may not accept); NCCL has the last word then.
        const bool own_hosts = std::getenv("NCCL_HOSTID") != nullptr;
        if (ranks > devices && !own_hosts) {
          MESHTRAIN_BAD_INPUT(
              "runtime.backend = \"nccl\" needs one GPU per rank, but a node runs ", ranks,
              " ranks and has ", devices,
              " GPU(s) (NCCL refuses two ranks of one communicator on one GPU): start at most ",
              devices, " ranks per node, or use runtime.backend = \"mpi\" to share GPUs");
        }
        select_cuda_device(world);
      })) {
    throw *error;
  }
  return make_nccl_communicator;
#else
  (void)world;
  MESHTRAIN_BAD_INPUT("runtime.backend = \"", to_string(backend),
                      "\" is not available in this build");
#endif
}

}  // namespace meshtrain
