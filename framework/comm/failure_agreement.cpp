#include "framework/comm/failure_agreement.hpp"

#include <exception>
#include <memory>
#include <sstream>
#include <string>

#include "framework/comm/communicator.hpp"
#include "framework/comm/mpi_util.hpp"

namespace meshtrain {
namespace {

// The buffers of one agreement. MPI writes into them until its requests complete; when a
// rank never joins, the requests cannot be freed (MPI forbids freeing a collective's
// request), so the buffers are deliberately leaked rather than released under a transfer
// that a late rank may still complete. The job is expected to end after that error.
struct Exchange {
  int candidate = 0;
  int first = 0;
  int header[2] = {0, 0};  // error kind, message length
  std::string message;
  MPI_Request request = MPI_REQUEST_NULL;
};

// Completes `x.request` (started by the caller) under the timeout; on a timeout the
// exchange is given up (leaked, see above) and a runtime Error names what was agreed on.
void complete(std::unique_ptr<Exchange>& x, double timeout, const char* what) {
  if (wait_all_until(&x->request, 1, timeout, what)) return;
  static_cast<void>(x.release());  // leaked on purpose: MPI may still write into it
  std::ostringstream seconds;
  seconds << timeout;
  MESHTRAIN_FAIL(what, " did not complete within ", seconds.str(),
                 " s: a rank did not join (it failed or hangs elsewhere)");
}

}  // namespace

std::optional<AgreedError> run_agreed(MPI_Comm comm, const std::function<void()>& phase,
                                      double timeout_seconds) {
  const double timeout = timeout_seconds > 0 ? timeout_seconds : collective_timeout_from_env();
  bool failed = false;
  ErrorKind kind = ErrorKind::runtime;
  std::string message;
  std::optional<Error> mine;
  try {
    phase();
  } catch (const Error& e) {
    failed = true;
    kind = e.kind();
    message = e.what();
    mine = e;
  } catch (const std::exception& e) {
    failed = true;
    message = std::string("unexpected failure: ") + e.what();
  } catch (...) {
    failed = true;
    message = "unexpected failure: an exception that is not a std::exception";
  }
  int rank = 0, size = 1;
  check_mpi(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank (agreeing on a phase's outcome)");
  check_mpi(MPI_Comm_size(comm, &size), "MPI_Comm_size (agreeing on a phase's outcome)");

  auto x = std::make_unique<Exchange>();
  // The lowest failing rank, or size when none failed.
  x->candidate = failed ? rank : size;
  x->first = size;
  check_mpi(MPI_Iallreduce(&x->candidate, &x->first, 1, MPI_INT, MPI_MIN, comm, &x->request),
            "MPI_Iallreduce (agreeing on a phase's outcome)");
  complete(x, timeout, "agreeing on a phase's outcome (MPI_Iallreduce)");
  const int first = x->first;
  if (first == size) return std::nullopt;
  x->header[0] = static_cast<int>(kind);
  if (rank == first) {
    x->header[1] = checked_int(message.size(), "the length of an error message");
    x->message = message;
  }
  check_mpi(MPI_Ibcast(x->header, 2, MPI_INT, first, comm, &x->request),
            "MPI_Ibcast (the failing rank's error kind)");
  complete(x, timeout, "agreeing on a phase's outcome (MPI_Ibcast of the error kind)");
  if (rank != first) x->message.assign(static_cast<std::size_t>(x->header[1]), '\0');
  if (x->header[1] > 0) {
    check_mpi(MPI_Ibcast(x->message.data(), x->header[1], MPI_CHAR, first, comm, &x->request),
              "MPI_Ibcast (the failing rank's error message)");
    complete(x, timeout, "agreeing on a phase's outcome (MPI_Ibcast of the error message)");
  }
  const Error agreed(static_cast<ErrorKind>(x->header[0]), x->message, __FILE__, __LINE__);
  if (rank == first && mine) return AgreedError(*mine);  // keeps where it was thrown
  return AgreedError(agreed);
}

void on_every_rank(MPI_Comm comm, const std::function<void()>& phase) {
  if (std::optional<AgreedError> error = run_agreed(comm, phase)) throw *error;
}

}  // namespace meshtrain
