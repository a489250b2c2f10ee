#include "framework/comm/mesh_communicators.hpp"

#include "framework/comm/backends/mpi_communicator.hpp"
#include "framework/comm/mpi_util.hpp"
#include "base/text.hpp"

namespace meshtrain {

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
  if (configure_) configure_(*comm, axes);
  Communicator& result = *comm;
  comms_.emplace(axes, std::move(comm));
  return result;
}

}  // namespace meshtrain
