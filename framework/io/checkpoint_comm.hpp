#pragma once
// The checkpoint code's own communicator: a duplicate of the caller's that returns MPI errors
// instead of aborting. Internal to the checkpoint code (the Checkpointer in
// checkpoint_save.cpp, load_checkpoint in checkpoint_load.cpp, and the checksum gathering in
// checkpoint_checksums.cpp); the public interface is framework/io/checkpoint.hpp.

#include <mpi.h>

namespace meshtrain::checkpoint_format {

// A private duplicate of the caller's communicator that returns MPI errors instead of
// aborting, so each can be reported with MPI_Error_string. Collective to make.
class PrivateComm {
 public:
  explicit PrivateComm(MPI_Comm comm);
  PrivateComm(const PrivateComm&) = delete;
  PrivateComm& operator=(const PrivateComm&) = delete;
  ~PrivateComm();
  MPI_Comm get() const { return comm_; }
  int rank() const { return rank_; }
  int size() const { return size_; }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace meshtrain::checkpoint_format
