#include "run/communicator_backend.hpp"

#include "framework/comm/backends/mpi_communicator.hpp"

namespace meshtrain {

CommunicatorFactory communicator_factory(const RunConfig& /*config*/) {
  return make_mpi_communicator;
}

}  // namespace meshtrain
