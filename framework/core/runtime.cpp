#include "framework/core/runtime.hpp"

#include <Kokkos_Core.hpp>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <sstream>

#include "framework/comm/backends/mpi_communicator.hpp"
#include "partition/text.hpp"

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

namespace {
const char* thread_level_name(int level) {
  if (level == MPI_THREAD_SINGLE) return "MPI_THREAD_SINGLE";
  if (level == MPI_THREAD_FUNNELED) return "MPI_THREAD_FUNNELED";
  if (level == MPI_THREAD_SERIALIZED) return "MPI_THREAD_SERIALIZED";
  if (level == MPI_THREAD_MULTIPLE) return "MPI_THREAD_MULTIPLE";
  return "an unknown thread level";
}
}  // namespace

void require_thread_level(int provided, int required) {
  if (provided >= required) return;  // the levels are ordered SINGLE < ... < MULTIPLE
  MESHTRAIN_FAIL("the MPI library provides ", thread_level_name(provided), " (", provided,
                 ") but meshtrain needs ", thread_level_name(required), " (", required,
                 "): Kokkos runs threads beside the thread that calls MPI; use an MPI built "
                 "with thread support");
}

Runtime::Runtime(int& argc, char**& argv) {
  int initialized = 0;
  check_mpi(MPI_Initialized(&initialized), "MPI_Initialized");
  if (!initialized) {
    int provided = 0;
    check_mpi(MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
    owns_mpi_ = true;
    try {
      require_thread_level(provided, MPI_THREAD_FUNNELED);
    } catch (...) {
      MPI_Finalize();
      throw;
    }
  }
  // Every MPI call of meshtrain checks its return code and reports MPI's own message.
  check_mpi(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(MPI_COMM_WORLD, &world_size_), "MPI_Comm_size");
  if (!Kokkos::is_initialized()) {
    Kokkos::initialize(argc, argv);
    owns_kokkos_ = true;
  }
}

Runtime::~Runtime() {
  world_.reset();
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

std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm group,
                                                    const std::string& description) {
  return std::make_unique<MpiCommunicator>(MpiCommunicator::adopt(group, description));
}

std::string describe_axes(const std::vector<std::string>& axes) {
  if (axes.empty()) return "no axis";
  return (axes.size() == 1 ? "axis (" : "axes (") + join(axes) + ")";
}

MeshCommunicators::MeshCommunicators(Mesh mesh, MPI_Comm parent, CommunicatorFactory factory)
    : mesh_(std::move(mesh)), factory_(std::move(factory)) {
  if (!factory_) factory_ = make_mpi_communicator;
  // A private duplicate: the splits below never interleave with the caller's traffic.
  check_mpi(MPI_Comm_dup(parent, &parent_), "MPI_Comm_dup of the mesh's parent communicator");
  check_mpi(MPI_Comm_set_errhandler(parent_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  int size = 0;
  check_mpi(MPI_Comm_rank(parent_, &rank_), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(parent_, &size), "MPI_Comm_size");
  if (size != mesh_.world_size()) {
    MPI_Comm_free(&parent_);
    MESHTRAIN_BAD_INPUT("mesh ", mesh_.describe(), " needs ", mesh_.world_size(),
                        " ranks but the job has ", size);
  }
}

MeshCommunicators::~MeshCommunicators() {
  comms_.clear();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && parent_ != MPI_COMM_NULL) MPI_Comm_free(&parent_);
}

Communicator& MeshCommunicators::get(const std::vector<std::string>& axes) {
  auto found = comms_.find(axes);
  if (found != comms_.end()) return *found->second;
  for (const auto& axis : axes) {
    if (!mesh_.has_axis(axis)) {
      MESHTRAIN_BAD_INPUT("mesh axis '", axis, "' in ", describe_axes(axes),
                          " is not an axis of the mesh ", mesh_.describe());
    }
  }
  const int color = mesh_.group_color(rank_, axes);
  const int key = mesh_.group_index(rank_, axes);
  MPI_Comm group = MPI_COMM_NULL;
  const std::string description = describe_axes(axes);
  check_mpi(MPI_Comm_split(parent_, color, key, &group),
            ("MPI_Comm_split for " + description).c_str());
  std::unique_ptr<Communicator> comm;
  try {
    comm = factory_(group, description);
  } catch (...) {
    // The factory owns `group` only when it returns.
    MPI_Comm_free(&group);
    throw;
  }
  MESHTRAIN_REQUIRE(comm && comm->size() == mesh_.size_of(axes) && comm->rank() == key,
                    "the communicator of ", description, " has rank ", comm ? comm->rank() : -1,
                    " of ", comm ? comm->size() : -1, ", expected ", key, " of ",
                    mesh_.size_of(axes));
  Communicator& result = *comm;
  comms_.emplace(axes, std::move(comm));
  return result;
}

void MeshCommunicators::create(const std::vector<std::vector<std::string>>& tuples) {
  for (const auto& axes : tuples) get(axes);
}

std::optional<Error> run_agreed(MPI_Comm comm, const std::function<void()>& phase) {
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
  // The lowest failing rank, or size when none failed.
  const int candidate = failed ? rank : size;
  int first = size;
  check_mpi(MPI_Allreduce(&candidate, &first, 1, MPI_INT, MPI_MIN, comm),
            "MPI_Allreduce (agreeing on a phase's outcome)");
  if (first == size) return std::nullopt;
  int header[2] = {static_cast<int>(kind), 0};
  if (rank == first) header[1] = checked_int(message.size(), "the length of an error message");
  check_mpi(MPI_Bcast(header, 2, MPI_INT, first, comm),
            "MPI_Bcast (the failing rank's error kind)");
  if (rank != first) message.assign(static_cast<std::size_t>(header[1]), '\0');
  if (header[1] > 0) {
    check_mpi(MPI_Bcast(message.data(), header[1], MPI_CHAR, first, comm),
              "MPI_Bcast (the failing rank's error message)");
  }
  if (rank == first && mine) return mine;  // keeps where it was thrown
  return Error(static_cast<ErrorKind>(header[0]), message, __FILE__, __LINE__);
}

int exit_status_for(const std::exception& error) {
  const auto* e = dynamic_cast<const Error*>(&error);
  return e != nullptr && e->kind() == ErrorKind::bad_input ? 2 : 1;
}

void abort_all_ranks(const std::string& message, int exit_status) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) {
    std::fprintf(stderr, "meshtrain: error: %s\n", message.c_str());
    std::fflush(stderr);
    std::exit(exit_status);
  }
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::fprintf(stderr, "meshtrain: error on rank %d: %s\n", rank, message.c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, exit_status);
  std::exit(exit_status);  // MPI_Abort does not return; this keeps [[noreturn]] honest
}

int run_or_abort(const std::function<int()>& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    abort_all_ranks(e.what(), exit_status_for(e));
  }
}

}  // namespace meshtrain
