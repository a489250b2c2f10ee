#include "framework/io/checkpoint_comm.hpp"

#include "framework/comm/mpi_util.hpp"

namespace meshtrain::checkpoint_format {

PrivateComm::PrivateComm(MPI_Comm comm) {
  check_mpi(MPI_Comm_dup(comm, &comm_), "MPI_Comm_dup (checkpoint)");
  check_mpi(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  check_mpi(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
}

PrivateComm::~PrivateComm() {
  MPI_Comm_free(&comm_);
}

}  // namespace meshtrain::checkpoint_format
