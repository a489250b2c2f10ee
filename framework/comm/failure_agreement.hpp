#pragma once
// Failure agreement: the one way meshtrain keeps a failure on some ranks from leaving the
// others waiting in a collective. A phase that may fail on one rank only (open a file,
// allocate, check input) runs on every rank, then the ranks agree on its outcome, under a
// timeout like every collective:
//
//   if (auto error = run_agreed(comm, [&] { write_my_part(); })) throw *error;
//
// Every rank then takes the same path (here: all throw the same AgreedError), and none
// goes on into a collective call alone. A phase must not itself contain collective calls
// that a failing rank would skip.

#include <mpi.h>

#include <functional>
#include <optional>

#include "base/error.hpp"

namespace meshtrain {

// An Error that every rank of a communicator holds and throws together, after
// run_agreed: the caller may report it once (for example on rank 0) and end every rank
// normally, instead of aborting the job.
class AgreedError : public Error {
 public:
  explicit AgreedError(const Error& error) : Error(error) {}
};

// Runs `phase` on this rank, then agrees with every rank of `comm` on the outcome
// (collective over `comm`: every rank must call it). Returns nullopt when the phase
// succeeded on every rank; otherwise the error of the lowest failing rank, the same kind
// and message on every rank. An exception that is not a meshtrain::Error becomes a
// runtime Error "unexpected failure: <what()>".
// Throws a runtime Error when the agreement itself fails: an MPI call fails (with
// MPI_Error_string; `comm` should use MPI_ERRORS_RETURN for that to be reported instead
// of aborting), or a rank does not join within `timeout_seconds` (default: the collective
// timeout, MESHTRAIN_COLLECTIVE_TIMEOUT). After such an error the job should be aborted.
std::optional<AgreedError> run_agreed(MPI_Comm comm, const std::function<void()>& phase,
                                      double timeout_seconds = -1.0);

// run_agreed that throws the agreed error (the same on every rank) instead of returning it.
void on_every_rank(MPI_Comm comm, const std::function<void()>& phase);

}  // namespace meshtrain
