#include "framework/comm/runtime.hpp"

#include <mpi.h>
#include <sched.h>

#include <Kokkos_Core.hpp>
#include <string>
#include <thread>
#if defined(KOKKOS_ENABLE_CUDA)
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#endif

#include "framework/comm/backends/mpi_communicator.hpp"
#include "framework/comm/mpi_util.hpp"
#include "framework/comm/progress_thread.hpp"
#include "framework/core/exec_space.hpp"

namespace meshtrain {

namespace {
const char* thread_level_name(int level) {
  if (level == MPI_THREAD_SINGLE) return "MPI_THREAD_SINGLE";
  if (level == MPI_THREAD_FUNNELED) return "MPI_THREAD_FUNNELED";
  if (level == MPI_THREAD_SERIALIZED) return "MPI_THREAD_SERIALIZED";
  if (level == MPI_THREAD_MULTIPLE) return "MPI_THREAD_MULTIPLE";
  return "an unknown thread level";
}
}  // namespace

void require_usable_device(int /*world_rank*/) {
#if defined(KOKKOS_ENABLE_CUDA)
  int count = 0;
  const cudaError_t code = cudaGetDeviceCount(&count);
  if (code == cudaSuccess && count > 0) return;
  cudaGetLastError();
  std::string why = "cudaGetDeviceCount found no device";
  if (code != cudaSuccess) {
    why = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(code) + " (" +
          cudaGetErrorName(code) + ")";
    // cudart says "driver version is insufficient" also when there is no driver at all.
    void* driver = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
    if (driver == nullptr) {
      why = "no NVIDIA driver is installed (libcuda.so.1 cannot be loaded)";
    } else {
      dlclose(driver);
    }
  }
  MESHTRAIN_FAIL("this meshtrain was built for CUDA and needs an NVIDIA GPU, but none can be "
                 "used here: ",
                 why, "; plan and inspect need no GPU");
#endif
}

void require_thread_level(int provided, int required) {
  if (provided >= required) return;  // the levels are ordered SINGLE < ... < MULTIPLE
  MESHTRAIN_FAIL("the MPI library provides ", thread_level_name(provided), " (", provided,
                 ") but meshtrain needs ", thread_level_name(required), " (", required,
                 "): Kokkos runs threads beside the thread that calls MPI; use an MPI built "
                 "with thread support");
}

bool want_comm_thread(CommThreadChoice choice, bool overlap, MPI_Comm comm, const std::string& key,
                      std::string& note) {
  if (choice == CommThreadChoice::off) return false;
  int provided = MPI_THREAD_SINGLE;
  check_mpi(MPI_Query_thread(&provided), "MPI_Query_thread");
  if (choice == CommThreadChoice::on) {
    if (provided < MPI_THREAD_MULTIPLE) {
      MESHTRAIN_BAD_INPUT(key,
                          " = true needs an MPI library with MPI_THREAD_MULTIPLE, but this one "
                          "provides ",
                          thread_level_name(provided), "; set it to false or \"auto\"");
    }
    return true;
  }
  int ranks = 1;
  check_mpi(MPI_Comm_size(comm, &ranks), "MPI_Comm_size");
  if (!overlap || ranks < 2) return false;
  const NodePlace place = node_place(comm);  // collective: before any rank may return
  const int host_threads = Kokkos::DefaultHostExecutionSpace().concurrency();
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  const int usable = sched_getaffinity(0, sizeof cpus, &cpus) == 0 ? CPU_COUNT(&cpus) : 1;
  const int node_cores = static_cast<int>(std::thread::hardware_concurrency());
  const bool free_core = usable > host_threads && node_cores > place.local_size * host_threads;
  if (!free_core) return false;
  if (provided < MPI_THREAD_MULTIPLE) {
    note = key + " = \"auto\" leaves the communication thread off: the MPI library provides " +
           thread_level_name(provided) + ", not MPI_THREAD_MULTIPLE";
    return false;
  }
  return true;
}

Runtime::Runtime(int& argc, char**& argv, const StartupCheck& check) {
  int initialized = 0;
  check_mpi(MPI_Initialized(&initialized), "MPI_Initialized");
  if (!initialized) {
    int provided = 0;
    check_mpi(MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
    owns_mpi_ = true;
    require_thread_level(provided, MPI_THREAD_FUNNELED);
  }
  // Every MPI call of meshtrain checks its return code and reports MPI's own message.
  check_mpi(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(MPI_COMM_WORLD, &world_size_), "MPI_Comm_size");
  if (!Kokkos::is_initialized()) {
    check(world_rank_);
    Kokkos::initialize(argc, argv);
    owns_kokkos_ = true;
  }
  device_space();  // the long-lived instances (exec_space.hpp), made before any step
  host_space();
}

Runtime::~Runtime() {
  world_.reset();
  comm_progress().stop();  // no MPI call from it after MPI_Finalize
  if (owns_kokkos_ && Kokkos::is_initialized()) Kokkos::finalize();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (owns_mpi_ && !finalized) MPI_Finalize();
}

Communicator& Runtime::world() {
  if (!world_) {
    world_ = std::make_unique<MpiCommunicator>(MpiCommunicator::duplicate(MPI_COMM_WORLD, "world"));
  }
  return *world_;
}

}  // namespace meshtrain
