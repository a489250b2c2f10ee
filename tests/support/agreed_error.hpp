#pragma once
// Expecting the AgreedError every rank throws alike when one rank fails inside an agreed phase
// (framework/comm/failure_agreement.hpp): caught on every rank, with one message.

#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdint>
#include <functional>
#include <string>

#include "base/error.hpp"
#include "framework/comm/failure_agreement.hpp"
#include "framework/comm/mpi_util.hpp"
#include "tests/support/world.hpp"

namespace meshtrain::testing {

// Runs body on every rank of MPI_COMM_WORLD (collective) and expects each to catch an
// AgreedError of `kind`, with the same message everywhere; returns this rank's message.
inline std::string expect_agreed_error(const std::function<void()>& body, ErrorKind kind) {
  std::string message;
  int caught = 0;
  try {
    body();
  } catch (const AgreedError& e) {
    caught = 1;
    message = e.what();
    EXPECT_EQ(e.kind(), kind) << message;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected an AgreedError, got: " << e.what();
  }
  EXPECT_EQ(caught, 1) << "no AgreedError on rank " << world_rank();
  int everywhere = 0;
  check_mpi(MPI_Allreduce(&caught, &everywhere, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD),
            "MPI_Allreduce");
  EXPECT_EQ(everywhere, 1) << "a rank did not get the AgreedError";
  uint64_t hash = std::hash<std::string>{}(message), lo = 0, hi = 0;
  check_mpi(MPI_Allreduce(&hash, &lo, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD), "MPI_Allreduce");
  check_mpi(MPI_Allreduce(&hash, &hi, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD), "MPI_Allreduce");
  EXPECT_EQ(lo, hi) << "ranks disagree on the error; this rank's: " << message;
  return message;
}

}  // namespace meshtrain::testing
