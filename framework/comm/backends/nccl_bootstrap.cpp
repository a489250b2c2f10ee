// The NCCL backend's set-up and tear-down: CUDA devices, the NCCL id sent from rank 0 of a
// group over MPI, ncclCommInitRankConfig in non-blocking mode under the deadline, the
// factory, and the finalize-or-abort of a communicator's state.

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <Kokkos_Core.hpp>

#include "framework/comm/backends/nccl_state.hpp"
#include "framework/comm/mesh_communicators.hpp"
#include "framework/comm/mpi_util.hpp"

namespace meshtrain {

using nccl_detail::check_cuda;
using nccl_detail::Clock;
using nccl_detail::cuda_text;
using nccl_detail::deadline_after;
using nccl_detail::nccl_text;
using nccl_detail::pause_poll;
using nccl_detail::seconds_text;

NcclCommunicator::State::~State() {
  if (device >= 0) cudaSetDevice(device);
  if (comm != nullptr) {
    // Finalize (flush and quiesce with the peers), bounded by the timeout; a peer that
    // is gone or an error turns it into an abort. Destructors cannot report.
    bool clean = false;
    ncclResult_t code = ncclCommFinalize(comm);
    if (code == ncclSuccess || code == ncclInProgress) {
      const Clock::time_point deadline = deadline_after(destroy_timeout);
      for (long polls = 0;; ++polls) {
        ncclResult_t state = ncclSuccess;
        if (ncclCommGetAsyncError(comm, &state) != ncclSuccess) break;
        if (state == ncclSuccess) {
          clean = true;
          break;
        }
        if (state != ncclInProgress || Clock::now() > deadline) break;
        pause_poll(polls);
      }
    }
    if (clean) {
      ncclCommDestroy(comm);
    } else {
      ncclCommAbort(comm);
    }
    comm = nullptr;
  }
  if (kokkos_ready != nullptr) cudaEventDestroy(kokkos_ready);
  if (barrier_word != nullptr) cudaFree(barrier_word);
  cudaGetLastError();
  // Then the members: the request slots (their events), and this communicator's reference
  // to the NCCL stream (the stream goes with the last one).
}

namespace {

// What rank 0 of the group sends to the others: the id, or why it has none.
struct IdMessage {
  ncclUniqueId id;
  int ok;
  char error[256];
};

// A set-up broadcast given up on (timeout or a failed MPI_Test): MPI may still write into
// its buffer and forbids freeing a collective's request, so both are kept, never freed,
// for the rest of the process.
void keep_abandoned(MPI_Request request, std::unique_ptr<IdMessage> buffer) {
  if (request == MPI_REQUEST_NULL) return;  // nothing in flight: the buffer may go
  static auto* kept = new std::vector<std::pair<MPI_Request, IdMessage*>>();
  try {
    kept->emplace_back(request, buffer.get());
  } catch (...) {
  }
  buffer.release();  // deliberately leaked: see above
}

// Rank 0's message on every rank of `comm`: MPI_Ibcast completed by polling against the
// deadline (a rank that never joins the set-up becomes an Error, as in the collectives).
// The message travels in a heap buffer that keep_abandoned() keeps alive when the wait is
// given up, so a late broadcast never writes into a dead stack frame.
IdMessage broadcast_id(const IdMessage& mine, MPI_Comm comm, double timeout,
                       const std::string& description) {
  auto buffer = std::make_unique<IdMessage>(mine);
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(
      MPI_Ibcast(buffer.get(), static_cast<int>(sizeof(IdMessage)), MPI_BYTE, 0, comm, &request),
      ("MPI_Ibcast of the NCCL id for " + description).c_str());
  const Clock::time_point deadline = deadline_after(timeout);
  for (long polls = 0;; ++polls) {
    int done = 0;
    const int code = MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    if (code != MPI_SUCCESS) {
      keep_abandoned(request, std::move(buffer));
      check_mpi(code, ("MPI_Test of the NCCL id broadcast for " + description).c_str());
    }
    if (done) return *buffer;
    if (Clock::now() > deadline) {
      keep_abandoned(request, std::move(buffer));
      MESHTRAIN_FAIL("NCCL set-up on ", description,
                     ": the broadcast of the NCCL id did not complete within ",
                     seconds_text(timeout), " s: a rank did not join");
    }
    pause_poll(polls);
  }
}

}  // namespace

// ------------------------------------------------------------------- free functions

int cuda_device_count(std::string* why) {
  int count = 0;
  const cudaError_t code = cudaGetDeviceCount(&count);
  if (code != cudaSuccess) {
    cudaGetLastError();
    if (why) *why = "cudaGetDeviceCount: " + cuda_text(code);
    return 0;
  }
  if (count <= 0 && why) *why = "cudaGetDeviceCount found no device";
  return count > 0 ? count : 0;
}

bool nccl_device_available() noexcept {
  return cuda_device_count(nullptr) > 0;
}

int select_cuda_device(MPI_Comm comm) {
  std::string why;
  const int count = cuda_device_count(&why);
  if (count == 0) MESHTRAIN_FAIL("the NCCL backend needs a CUDA device, but ", why);
#if defined(KOKKOS_ENABLE_CUDA)
  // A CUDA Kokkos has already bound this process to a device; NCCL must use the same one
  // so that Views are memory of the communicator's device.
  if (Kokkos::is_initialized()) {
    const int kokkos_device = Kokkos::Cuda().cuda_device();
    check_cuda(cudaSetDevice(kokkos_device),
               "cudaSetDevice(" + std::to_string(kokkos_device) + ") (Kokkos' device)");
    return kokkos_device;
  }
#endif
  const int device = node_place(comm).local_rank % count;
  check_cuda(cudaSetDevice(device), "cudaSetDevice(" + std::to_string(device) + ")");
  return device;
}

std::unique_ptr<Communicator> make_nccl_communicator(MPI_Comm group,
                                                     const std::string& description) {
  // The factory owns `group` once it returns (see CommunicatorFactory): NCCL does not need
  // it after set-up, so it is freed here; on failure it is still the caller's.
  auto comm = std::make_unique<NcclCommunicator>(NcclCommunicator::create(group, description));
  if (group != MPI_COMM_WORLD && group != MPI_COMM_SELF) {
    check_mpi(MPI_Comm_free(&group), ("MPI_Comm_free of the group of " + description).c_str());
  }
  return comm;
}

// ---------------------------------------------------------------- NcclCommunicator

NcclCommunicator::NcclCommunicator(std::shared_ptr<State> state, int size, int rank,
                                   std::string description)
    : Communicator(size, rank, std::move(description)), state_(std::move(state)) {}

NcclCommunicator::~NcclCommunicator() {
  if (state_) state_->destroy_timeout = timeout_seconds();
}

NcclCommunicator NcclCommunicator::create(MPI_Comm group, std::string description) {
  MESHTRAIN_REQUIRE(group != MPI_COMM_NULL, "cannot build an NCCL communicator for ", description,
                    " from MPI_COMM_NULL");
  const double timeout = collective_timeout_from_env();
  std::string why;
  if (cuda_device_count(&why) == 0) {
    MESHTRAIN_FAIL("the NCCL communicator of ", description, " needs a CUDA device, but ", why);
  }
  int size = 0, rank = 0;
  check_mpi(MPI_Comm_size(group, &size), "MPI_Comm_size");
  check_mpi(MPI_Comm_rank(group, &rank), "MPI_Comm_rank");

  auto state = std::make_shared<State>();
  state->description = description;
  state->destroy_timeout = timeout;
  check_cuda(cudaGetDevice(&state->device), "cudaGetDevice for " + description);

  // Rank 0 creates the id; a failure there is sent along so no rank waits for nothing.
  IdMessage message{};
  if (rank == 0) {
    const ncclResult_t code = ncclGetUniqueId(&message.id);
    message.ok = code == ncclSuccess ? 1 : 0;
    if (!message.ok) {
      const std::string text = nccl_text(code, nullptr);
      text.copy(message.error, sizeof(message.error) - 1);
    }
  }
  message = broadcast_id(message, group, timeout, description);
  if (!message.ok) {
    MESHTRAIN_FAIL("NCCL set-up on ", description,
                   ": ncclGetUniqueId failed on rank 0 of the group: ", std::string(message.error));
  }

  state->shared_stream = nccl_detail::shared_nccl_stream(state->device, description);
  state->stream = state->shared_stream.get();
  check_cuda(cudaEventCreateWithFlags(&state->kokkos_ready, cudaEventDisableTiming),
             "cudaEventCreateWithFlags for " + description);
  check_cuda(cudaMalloc(reinterpret_cast<void**>(&state->barrier_word), sizeof(float)),
             "cudaMalloc of the barrier word for " + description);
  check_cuda(cudaMemset(state->barrier_word, 0, sizeof(float)),
             "cudaMemset of the barrier word for " + description);

  // Non-blocking mode: the set-up (which waits for every rank) is polled, not blocking.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const ncclResult_t code = ncclCommInitRankConfig(&state->comm, size, message.id, rank, &config);
  if (code != ncclSuccess && code != ncclInProgress) {
    const std::string text = nccl_text(code, state->comm);
    state->abort("a failed set-up");
    MESHTRAIN_FAIL("NCCL set-up on ", description, ": ncclCommInitRankConfig (rank ", rank, " of ",
                   size, ", CUDA device ", state->device, ") failed: ", text);
  }
  const Clock::time_point deadline = deadline_after(timeout);
  for (long polls = 0; state->nccl_in_progress("NCCL set-up"); ++polls) {
    if (Clock::now() > deadline) state->fail_timeout("NCCL set-up", timeout);
    pause_poll(polls);
  }
  const std::vector<int> world_ranks = world_ranks_of(group);  // for the flight recorder
  NcclCommunicator made(std::move(state), size, rank, std::move(description));
  made.set_flight_world_ranks(world_ranks);
  return made;
}

int NcclCommunicator::device() const {
  return state_ ? state_->device : -1;
}

cudaStream_t NcclCommunicator::stream() const {
  return state_ ? state_->stream : nullptr;
}

}  // namespace meshtrain
