#pragma once
// The communicators of a mesh: one per axis and per axis tuple a spec uses, built on first
// use and cached, with a backend chosen by a CommunicatorFactory.
//
//   meshtrain::Runtime runtime(argc, argv);
//   meshtrain::MeshCommunicators comms(mesh);            // destroyed before runtime
//   meshtrain::Communicator& tp = comms.get({"tp"});
//   meshtrain::Communicator& batch = comms.get({"fsdp", "dp"});

#include <mpi.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "framework/comm/communicator.hpp"
#include "partition/mesh.hpp"

namespace meshtrain {

// Builds the backend communicator of one group from the MPI communicator of that group
// (obtained by MPI_Comm_split) and its description. Ownership of `group` passes to the
// factory when it returns; when it throws, `group` is still the caller's, who frees it.
// make_mpi_communicator (backends/mpi_communicator.hpp) and make_nccl_communicator
// (backends/nccl_communicator.hpp) are the two backends.
using CommunicatorFactory =
    std::function<std::unique_ptr<Communicator>(MPI_Comm group, const std::string& description)>;

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
  // in the same order. Unknown axis names are bad_input.
  Communicator& get(const std::vector<std::string>& axes);
  bool has(const std::vector<std::string>& axes) const { return comms_.count(axes) != 0; }

  // Called on every communicator built from here on, right after the factory made it (inside
  // get(), so collective over the group as the build is): e.g. to choose its reductions.
  using Configure = std::function<void(Communicator&, const std::vector<std::string>& axes)>;
  void set_configure(Configure configure) { configure_ = std::move(configure); }

 private:
  Mesh mesh_;
  MPI_Comm parent_ = MPI_COMM_NULL;
  int rank_ = 0;
  CommunicatorFactory factory_;
  Configure configure_;
  std::map<std::vector<std::string>, std::unique_ptr<Communicator>> comms_;
};

}  // namespace meshtrain
