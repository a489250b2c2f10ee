#pragma once
#include <cstddef>
#include <cstdint>

namespace meshtrain {

// precision.hpp's add_16bit for one dtype fixed where it is called, with nothing to throw
// (add_16bit throws for fp32): for callers that an exception must not leave, such as the MPI
// user operation (comm/backends/mpi_communicator.cpp), which MPI, a C library, calls. The same
// per-ISA clones and bits as add_16bit (precision.cpp).
void add_bf16(uint16_t* out, const uint16_t* a, const uint16_t* b, std::size_t count) noexcept;
void add_fp16(uint16_t* out, const uint16_t* a, const uint16_t* b, std::size_t count) noexcept;

}  // namespace meshtrain
