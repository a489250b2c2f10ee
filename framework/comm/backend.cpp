#include "framework/comm/backend.hpp"

#include <cstdlib>
#include <string>

#include "framework/comm/backends/mpi_communicator.hpp"
#if MESHTRAIN_HAVE_NCCL
#include "framework/comm/backends/nccl_communicator.hpp"
#endif
#include "base/error.hpp"
#include "framework/comm/failure_agreement.hpp"
#include "framework/comm/mpi_util.hpp"

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

void require_comm_backend_available(CommBackendChoice requested) {
  if (requested != CommBackendChoice::nccl || kBuildSupportsNccl) return;
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

CommBackend resolve_comm_backend(CommBackendChoice requested, MPI_Comm world, std::string* note) {
  require_comm_backend_available(requested);
  if (requested == CommBackendChoice::mpi) return CommBackend::mpi;
  if (requested == CommBackendChoice::nccl) return CommBackend::nccl;
  if (!kBuildSupportsNccl) return CommBackend::mpi;
#if MESHTRAIN_HAVE_NCCL && defined(KOKKOS_ENABLE_CUDA)
  // automatic on an NCCL build: NCCL refuses two ranks of one communicator on one GPU, so
  // ranks that share GPUs (a one-GPU machine running np 2) take MPI, which stages through
  // host memory. NCCL_HOSTID makes each rank a host of its own (tests/nccl/share_gpu.sh).
  int ranks = 0, devices = 0;
  if (auto error = run_agreed(world, [&] {
        ranks = node_place(world).local_size;
        devices = cuda_device_count();
      })) {
    throw *error;
  }
  int shared = ranks > devices && std::getenv("NCCL_HOSTID") == nullptr ? 1 : 0;
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, &shared, 1, MPI_INT, MPI_MAX, world), "MPI_Allreduce");
  if (shared == 0) return CommBackend::nccl;
  if (note) {
    *note = "runtime.backend = \"auto\" uses mpi: a node runs more ranks than it has GPUs (here " +
            std::to_string(ranks) + " ranks, " + std::to_string(devices) +
            " GPU(s)), and NCCL needs one GPU per rank";
  }
  return CommBackend::mpi;
#else
  (void)world;
  (void)note;
  return CommBackend::mpi;
#endif
}

CommBackend resolve_comm_backend(const std::string& requested, MPI_Comm world) {
  return resolve_comm_backend(parse_comm_backend(requested), world);
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
