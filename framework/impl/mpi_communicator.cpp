#include "framework/impl/mpi_communicator.hpp"

#include <sched.h>

#include <ctime>
#include <sstream>
#include <string>
#include <vector>

namespace meshtrain {

void check_mpi(int code, const char* what) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {0};
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) {
    MESHTRAIN_FAIL(what, " failed with MPI error code ", code);
  }
  MESHTRAIN_FAIL(what, " failed: ", std::string(text, static_cast<std::size_t>(length)));
}

struct MpiCommunicator::State {
  MPI_Comm comm = MPI_COMM_NULL;
  std::string description;
  std::string broken;  // non-empty after a timeout: why the communicator is unusable
  // Requests given up on after a timeout. They cannot be freed (MPI forbids freeing a
  // collective's request), so they are kept and tested once more when the state goes.
  std::vector<MPI_Request> abandoned;

  ~State() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    for (MPI_Request& r : abandoned) {
      int done = 0;
      MPI_Test(&r, &done, MPI_STATUS_IGNORE);
    }
    if (comm != MPI_COMM_NULL && comm != MPI_COMM_WORLD && comm != MPI_COMM_SELF) {
      MPI_Comm_free(&comm);  // deferred by MPI until pending operations finish
    }
  }

  void require_usable(const char* op) const {
    if (!broken.empty()) {
      MESHTRAIN_FAIL(op, " on ", description, " refused: the communicator is unusable after ",
                     broken);
    }
  }
};

namespace {

// Polls `requests` until all complete or `timeout` seconds pass. MPI_Testall also drives
// MPI's progress (non-blocking collectives advance only inside MPI calls), so it is called
// back to back, yielding the core in between as Open MPI's mpi_yield_when_idle does: short
// waits stay fast and oversubscribed ranks share cores. After half a second of waiting
// (a rank is late, latency no longer matters) it sleeps 200 us between polls.
bool wait_all_until(MPI_Request* requests, int count, double timeout, const char* op) {
  const double start = MPI_Wtime();
  for (;;) {
    int done = 0;
    check_mpi(MPI_Testall(count, requests, &done, MPI_STATUSES_IGNORE), op);
    if (done) return true;
    const double waited = MPI_Wtime() - start;
    if (waited > timeout) return false;
    if (waited > 0.5) {
      const timespec pause{0, 200000};
      nanosleep(&pause, nullptr);
    } else {
      sched_yield();
    }
  }
}

std::string timeout_text(double seconds) {
  std::ostringstream out;
  out << seconds;
  return out.str();
}

[[noreturn]] void throw_timeout(MpiCommunicator::State& state, MPI_Request* requests, int count,
                                double timeout, const char* op) {
  for (int k = 0; k < count; ++k) {
    if (requests[k] != MPI_REQUEST_NULL) state.abandoned.push_back(requests[k]);
  }
  const std::string message = std::string(op) + " on " + state.description +
                              " did not complete within " + timeout_text(timeout) +
                              " s: a rank did not join";
  state.broken = "an earlier timeout (" + message + ")";
  MESHTRAIN_FAIL(message);
}

std::string name_op(const char* op, const char* mpi_call) {
  return std::string(op) + " (" + mpi_call + ")";
}

// The two requests of one shift, completed against the deadline taken at wait().
class MpiShiftRequest final : public Request::Impl {
 public:
  MpiShiftRequest(std::shared_ptr<MpiCommunicator::State> state, double timeout, const char* op)
      : state_(std::move(state)), timeout_(timeout), op_(op) {}
  MPI_Request* requests() { return requests_; }

  bool test() override {
    int done = 0;
    check_mpi(MPI_Testall(2, requests_, &done, MPI_STATUSES_IGNORE), op_);
    return done != 0;
  }
  void wait() override {
    if (!wait_all_until(requests_, 2, timeout_, op_)) {
      throw_timeout(*state_, requests_, 2, timeout_, op_);
    }
  }
  ~MpiShiftRequest() override = default;

 private:
  std::shared_ptr<MpiCommunicator::State> state_;
  MPI_Request requests_[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  double timeout_;
  const char* op_;
};

int rank_of(MPI_Comm comm) {
  int rank = 0;
  check_mpi(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
  return rank;
}

int size_of(MPI_Comm comm) {
  int size = 0;
  check_mpi(MPI_Comm_size(comm, &size), "MPI_Comm_size");
  return size;
}

// Tag of the shift messages: by offset, so shifts in opposite directions on rings larger
// than 2 never match each other. (On 2 ranks both directions reach the same peer with the
// same tag; MPI's in-order matching keeps them apart as long as every rank starts its
// shifts in the same order, which the Communicator contract requires.)
constexpr int kShiftTagBase = 1000;

}  // namespace

MpiCommunicator::MpiCommunicator(std::shared_ptr<State> state, int size, int rank,
                                 std::string description)
    : Communicator(size, rank, std::move(description)), state_(std::move(state)) {}

MpiCommunicator MpiCommunicator::adopt(MPI_Comm comm, std::string description) {
  MESHTRAIN_REQUIRE(comm != MPI_COMM_NULL, "cannot build a communicator for ", description,
                    " from MPI_COMM_NULL");
  auto state = std::make_shared<State>();
  state->comm = comm;
  state->description = description;
  check_mpi(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  const int size = size_of(comm);
  const int rank = rank_of(comm);
  return MpiCommunicator(std::move(state), size, rank, std::move(description));
}

MpiCommunicator MpiCommunicator::duplicate(MPI_Comm comm, std::string description) {
  MPI_Comm copy = MPI_COMM_NULL;
  check_mpi(MPI_Comm_dup(comm, &copy), "MPI_Comm_dup");
  return adopt(copy, std::move(description));
}

MPI_Comm MpiCommunicator::native() const {
  return state_ ? state_->comm : MPI_COMM_NULL;
}

void MpiCommunicator::complete(MPI_Request request, const char* op) {
  if (!wait_all_until(&request, 1, timeout_seconds(), op)) {
    throw_timeout(*state_, &request, 1, timeout_seconds(), op);
  }
}

void MpiCommunicator::raw_all_gather(const float* send, float* recv, std::size_t count_per_rank,
                                     const char* op) {
  state_->require_usable(op);
  const int count = checked_int(count_per_rank, "all_gather count per rank");
  Kokkos::fence();
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Iallgather(send, count, MPI_FLOAT, recv, count, MPI_FLOAT, state_->comm, &request),
            name_op(op, "MPI_Iallgather").c_str());
  complete(request, op);
}

void MpiCommunicator::raw_reduce_scatter_sum(const float* send, float* recv,
                                             std::size_t count_per_rank, const char* op) {
  state_->require_usable(op);
  const int count = checked_int(count_per_rank, "reduce_scatter count per rank");
  Kokkos::fence();
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(
      MPI_Ireduce_scatter_block(send, recv, count, MPI_FLOAT, MPI_SUM, state_->comm, &request),
      name_op(op, "MPI_Ireduce_scatter_block").c_str());
  complete(request, op);
}

void MpiCommunicator::raw_all_reduce_sum(float* data, std::size_t count, const char* op) {
  state_->require_usable(op);
  const int n = checked_int(count, "all_reduce count");
  Kokkos::fence();
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Iallreduce(MPI_IN_PLACE, data, n, MPI_FLOAT, MPI_SUM, state_->comm, &request),
            name_op(op, "MPI_Iallreduce").c_str());
  complete(request, op);
}

void MpiCommunicator::raw_broadcast(float* data, std::size_t count, int root, const char* op) {
  state_->require_usable(op);
  const int n = checked_int(count, "broadcast count");
  Kokkos::fence();
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Ibcast(data, n, MPI_FLOAT, root, state_->comm, &request),
            name_op(op, "MPI_Ibcast").c_str());
  complete(request, op);
}

Request MpiCommunicator::raw_shift(const float* send, float* recv, std::size_t count, int offset,
                                   const char* op) {
  state_->require_usable(op);
  const int n = checked_int(count, "shift count");
  const int size = this->size();
  const int k = ((offset % size) + size) % size;
  const int to = (rank() + k) % size;
  const int from = (rank() - k + size) % size;
  const int tag = kShiftTagBase + k % 30000;
  Kokkos::fence();
  auto pending = std::make_unique<MpiShiftRequest>(state_, timeout_seconds(), op);
  check_mpi(MPI_Irecv(recv, n, MPI_FLOAT, from, tag, state_->comm, &pending->requests()[0]),
            name_op(op, "MPI_Irecv").c_str());
  check_mpi(MPI_Isend(send, n, MPI_FLOAT, to, tag, state_->comm, &pending->requests()[1]),
            name_op(op, "MPI_Isend").c_str());
  return Request(std::move(pending));
}

void MpiCommunicator::raw_all_to_all(const float* send, float* recv, std::size_t count_per_rank,
                                     const char* op) {
  state_->require_usable(op);
  const int count = checked_int(count_per_rank, "all_to_all count per rank");
  Kokkos::fence();
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Ialltoall(send, count, MPI_FLOAT, recv, count, MPI_FLOAT, state_->comm, &request),
            name_op(op, "MPI_Ialltoall").c_str());
  complete(request, op);
}

void MpiCommunicator::raw_barrier(const char* op) {
  state_->require_usable(op);
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Ibarrier(state_->comm, &request), name_op(op, "MPI_Ibarrier").c_str());
  complete(request, op);
}

}  // namespace meshtrain
