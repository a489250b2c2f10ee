#pragma once
// The hardware profile's TOML file (partition/hardware.hpp has the fields), as `meshtrain
// calibrate` writes it and `meshtrain plan --hardware` reads it:
//
//   gemm_flops = 9.1e10          # FLOP/s per rank
//   memory_bandwidth = 6.2e9     # B/s per rank, bytes read + written
//   overlap = 0.1                # 0..1, transfer hidden under a GEMM (optional: 0)
//   storage_read_bandwidth = 2e9 # B/s reading data files (optional: 2e9; not measured)
//   storage_read_latency = 1e-4  # s per random read (optional: 1e-4; not measured)
//   hdf5_row_seconds = 8e-6      # s per random row from an HDF5 file's cached chunks
//                                # (optional: kHdf5RowSeconds; calibrate CONFIG of a DLRM)
//   sparse_row_seconds = 2e-7    # s of the sparse reader per row and table, and per id
//   sparse_id_seconds = 5e-8     # (optional, calibrate CONFIG writes both: sparse_row_seconds
//                                # missing or 0 means not measured, both then charged at
//                                # memory_bandwidth, and sparse_id_seconds above 0 is refused;
//                                # with sparse_row_seconds set, sparse_id_seconds 0 or missing
//                                # is a measured 0)
//   [links.tp]                   # one table per mesh axis: dp, fsdp, ep, tp, sp
//   bandwidth = 4.1e9            # B/s point to point
//   latency = 1.9e-6             # s
//   collective_overhead = 1.5e-4 # s a small collective costs a step (optional: = latency)
//   collective_bandwidth = 2.2e9 # B/s per rank in an all-gather (optional: = bandwidth)
//   reduce_scatter_bandwidth = 1e9  # B/s per rank in a reduce-scatter
//                                   # (optional: = collective_bandwidth)
//   all_reduce_bandwidth = 1.5e9    # B/s per rank in an all-reduce (2 (p-1)/p bytes moved;
//                                   # optional: = collective_bandwidth)
//   exchange_bandwidth = 2e9     # B/s per rank of a ring hop (optional: = bandwidth)
//   bidirectional_bandwidth = 2e9  # B/s per rank of a bidirectional hop
//                                  # (optional: = exchange_bandwidth)
//   ring_reduce_scatter_bandwidth = 3e9  # the same for meshtrain's ring (optional: not measured)
//   ring_all_reduce_bandwidth = 3e9      # (optional, both or neither)
//   ring_reduce_scatter_from = 65536     # bytes per rank from which the ring measured faster
//   ring_all_reduce_from = 65536         # (optional: never); [runtime] reductions = "auto"
//   [[gemm]]                     # optional, any number: one GEMM shape's measured rate
//   shape = [128, 2048, 2048]    # m, k, n of op(A) [m x k] @ op(B) [k x n]
//   transpose = "NT"             # whether A, B are transposed (N or T each)
//   flops = 8.1e10               # FLOP/s
//   [elementwise]                # optional: measured rates of elementwise kernels
//   swiglu_forward = 1.2e8       # elements/s (elementwise_kernel_names(): relu_forward,
//                                # silu_backward, swiglu_forward, ...)
//   [measured]                   # optional, free-form: how it was measured (not read back)
//
// Every key is required except overlap, storage_*, hdf5_row_seconds, sparse_*, [[gemm]],
// [elementwise], collective_overhead, collective_bandwidth, reduce_scatter_bandwidth,
// all_reduce_bandwidth, exchange_bandwidth, bidirectional_bandwidth and [measured]; unknown keys
// are rejected. Kokkos-free (compiled by the host compiler alone in CUDA builds).

#include <string>

#include "partition/hardware.hpp"

namespace meshtrain {

// Reads `path`; bad_input (one sentence naming the file and the key) for a missing file,
// invalid TOML, a missing, unknown or wrongly typed key or a value that is not positive.
HardwareProfile read_hardware_profile(const std::string& path);
HardwareProfile parse_hardware_profile(const std::string& text, const std::string& source);

// The TOML text of `profile`; `measured` (TOML lines of key = value) goes into [measured].
std::string hardware_profile_to_toml(const HardwareProfile& profile,
                                     const std::string& measured = "");

}  // namespace meshtrain
