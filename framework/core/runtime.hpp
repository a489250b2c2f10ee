#pragma once
// Process-wide setup: MPI, then Kokkos; torn down in reverse. And the communicators of a
// mesh: one per axis and per axis tuple a spec uses, built on first use and cached.
//
//   int main(int argc, char** argv) {
//     meshtrain::Runtime runtime(argc, argv);
//     meshtrain::MeshCommunicators comms(mesh);            // destroyed before runtime
//     meshtrain::Communicator& tp = comms.get({"tp"});
//     meshtrain::Communicator& batch = comms.get({"fsdp", "dp"});
//   }

#include <mpi.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "framework/comm/communicator.hpp"
#include "partition/error.hpp"
#include "partition/mesh.hpp"

namespace meshtrain {

// Throws a runtime Error naming both levels when MPI_Init_thread `provided` less thread
// support than `required` (e.g. MPI_THREAD_SINGLE for MPI_THREAD_FUNNELED).
void require_thread_level(int provided, int required);

class Runtime {
 public:
  // MPI_Init_thread (MPI_THREAD_FUNNELED; a runtime Error when MPI provides less) then
  // Kokkos::initialize. Either step is skipped when already done by someone else, who then
  // also owns the matching finalize.
  Runtime(int& argc, char**& argv);
  ~Runtime();  // Kokkos::finalize, then MPI_Finalize (only what this object initialized)
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  int world_rank() const { return world_rank_; }
  int world_size() const { return world_size_; }
  // All ranks (a private duplicate of MPI_COMM_WORLD), described as "world".
  Communicator& world();

 private:
  bool owns_mpi_ = false;
  bool owns_kokkos_ = false;
  int world_rank_ = 0;
  int world_size_ = 1;
  std::unique_ptr<Communicator> world_;
};

// Builds the backend communicator of one group from the MPI communicator of that group
// (obtained by MPI_Comm_split) and its description. Ownership of `group` passes to the
// factory when it returns; when it throws, `group` is still the caller's, who frees it.
using CommunicatorFactory =
    std::function<std::unique_ptr<Communicator>(MPI_Comm group, const std::string& description)>;
// The MPI backend (the default factory).
std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm group, const std::string& description);

// "axis (tp)", "axes (fsdp, dp)", "no axis" for the empty tuple.
std::string describe_axes(const std::vector<std::string>& axes);

class MeshCommunicators {
 public:
  // `parent` must hold mesh.world_size() ranks (bad_input otherwise); rank r of parent is
  // mesh rank r. The factory defaults to make_mpi_communicator.
  explicit MeshCommunicators(Mesh mesh, MPI_Comm parent = MPI_COMM_WORLD,
                             CommunicatorFactory factory = {});
  ~MeshCommunicators();
  MeshCommunicators(const MeshCommunicators&) = delete;
  MeshCommunicators& operator=(const MeshCommunicators&) = delete;

  const Mesh& mesh() const { return mesh_; }
  int rank() const { return rank_; }  // this process's rank in the mesh

  // The communicator of this rank's group over `axes` (a tuple read major to minor, as in
  // a PartitionSpec entry): its rank is mesh.group_index(rank, axes). The first call for a
  // tuple is COLLECTIVE over `parent` (MPI_Comm_split): every rank must ask for new tuples
  // in the same order; create() builds a list of them up front. Unknown axis names are
  // bad_input.
  Communicator& get(const std::vector<std::string>& axes);
  void create(const std::vector<std::vector<std::string>>& tuples);
  bool has(const std::vector<std::string>& axes) const { return comms_.count(axes) != 0; }

 private:
  Mesh mesh_;
  MPI_Comm parent_ = MPI_COMM_NULL;
  int rank_ = 0;
  CommunicatorFactory factory_;
  std::map<std::vector<std::string>, std::unique_ptr<Communicator>> comms_;
};

// Runs `phase` on this rank, then agrees with every rank of `comm` on the outcome
// (collective over `comm`: every rank must call it). Returns nullopt when the phase
// succeeded on every rank; otherwise the error of the lowest failing rank, the same kind
// and message on every rank, so that all ranks take the same path (for example all throw
// it) and none goes on into a collective call alone. An exception that is not a
// meshtrain::Error becomes a runtime Error "unexpected failure: <what()>".
// Throws a runtime Error (with MPI_Error_string) when an MPI call of the agreement itself
// fails; `comm` should use MPI_ERRORS_RETURN for that to be reported instead of aborting.
//
//   if (auto error = run_agreed(comm, [&] { write_my_part(); })) throw *error;
std::optional<Error> run_agreed(MPI_Comm comm, const std::function<void()>& phase);

// Throws a runtime Error "<what> failed: <MPI_Error_string>" when code is not MPI_SUCCESS.
void check_mpi(int code, const char* what);

// Exit status for an error: 2 for bad_input, 1 for anything else.
int exit_status_for(const std::exception& error);

// Prints "meshtrain: error on rank R: <message>" to stderr and ends every rank of the job
// with MPI_Abort(MPI_COMM_WORLD, exit_status), so no rank waits forever on one that
// failed. Without MPI initialized it calls std::exit. Never returns.
[[noreturn]] void abort_all_ranks(const std::string& message, int exit_status);

// Runs `body`; an exception escaping it on any rank goes to abort_all_ranks with
// exit_status_for(it). Returns body's value otherwise. For the main of an MPI program.
int run_or_abort(const std::function<int()>& body);

}  // namespace meshtrain
