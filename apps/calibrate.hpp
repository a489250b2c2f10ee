#pragma once
// `mpirun -np N meshtrain calibrate [CONFIG] [--out FILE]`: measures a hardware profile
// (partition/hardware.hpp) on the ranks of this job and writes it as TOML
// (framework/train/hardware_file.hpp), for `meshtrain plan --hardware FILE`:
//   gemm_flops        a layer's three training GEMMs at [256 rows, 2048 -> 2048] (x @ W,
//                     xᵀ @ dY, dY @ Wᵀ) through gemm(), every rank at once (so ranks
//                     sharing cores see their share), median of 5, slowest rank
//   memory_bandwidth  a = b + s * c over 3 x 64 MiB (12 bytes per element), every rank at
//                     once, median of 5, slowest rank
//   per mesh axis of size > 1 (CONFIG's mesh for N ranks, or dp = N), every group at once:
//     latency, bandwidth   ping-pong between the group's ranks 0 and 1: 8 bytes (100
//                          round trips) and 8 MiB (5), half a round trip each
//     collective_bandwidth an 8 MiB all-reduce through the group's Communicator (the one
//                          the layers use): 2 (p-1)/p * bytes / (time - 2 (p-1) latency)
//   Axes the mesh does not split get the slowest measured link (or the defaults on one
//   rank) and say so in [measured].
// Must run under MPI (meshtrain::Runtime). Returns the exit status.

#include <string>
#include <vector>

namespace meshtrain {

int calibrate_command(const std::string& config_path, const std::vector<std::string>& overrides,
                      const std::string& out_path);

}  // namespace meshtrain
