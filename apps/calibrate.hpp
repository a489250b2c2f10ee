#pragma once
// `mpirun -np N meshtrain calibrate [CONFIG] [--out FILE]`: measures a hardware profile
// (partition/hardware.hpp) on the ranks of this job and writes it as TOML
// (framework/train/hardware_file.hpp), for `meshtrain plan --hardware FILE`:
//   gemm_flops        a layer's three training GEMMs at [256 rows, 2048 -> 2048] (x @ W,
//                     xᵀ @ dY, dY @ Wᵀ) through gemm(), every rank at once (so ranks
//                     sharing cores see their share), median of 5, slowest rank
//   [[gemm]]          with CONFIG: every GEMM shape its step runs (step_gemm_shapes: the
//                     plain layers' three GEMMs, each collective matmul's blocks and
//                     halves), each ~20 ms of calls, every rank at once, median of 5,
//                     slowest rank. The cost model costs a GEMM at its shape's rate.
//   memory_bandwidth  a = b + s * c over 3 x 64 MiB (12 bytes per element), every rank at
//                     once, median of 5, slowest rank
//   [elementwise]     with CONFIG: the elements/s of the model's activation (forward and
//                     backward) or of SwiGLU, the real kernels (layers/activation.hpp) on the
//                     step's largest [rows, out_local] block after a layer, each ~20 ms of
//                     calls, every rank at once, median of 5, slowest rank (an in-place
//                     backward timed after a copy of dY, the copy's time taken off)
//   (Computation is timed from a common start until the last rank has finished: ranks
//   that outnumber the cores take turns, and each one's own clock would time it alone.)
//   per mesh axis of size > 1 (CONFIG's mesh for N ranks, or dp = N), every group at once,
//   each figure the slowest rank's median of 5:
//     latency, bandwidth   ping-pong between the group's ranks 0 and 1: 8 bytes (100
//                          round trips) and 8 MiB (5), half the median round trip each;
//                          the latency is raised to what an 8-byte ring hop adds right after
//                          a GEMM of a few ms on every rank (median of 21) when that is
//                          more: ranks finish their compute apart, and ranks that outnumber
//                          the cores wait for their neighbour to be scheduled
//     exchange_bandwidth   an 8 MiB ring hop (Communicator::shift +1: every rank sends and
//                          receives at once): 8 MiB / (time - latency)
//     bidirectional_bandwidth  the two 4 MiB halves at once (shift +1 and -1): 8 MiB / (time
//                          - latency)
//     collective_bandwidth an all-gather and a reduce-scatter of a 16 MiB full operand
//                          through the group's Communicator (the one the layers use):
//                          (p-1)/p * 16 MiB / (their mean time - (p-1) latency); an
//                          all-reduce of 16 MiB is reported in [measured]
//     collective_overhead  what a small collective costs a step: every rank runs a GEMM
//                          [128 x 512 x 512] then enters the call, no barrier between
//                          tries, 200 each of an all-to-all of 256 floats per rank and an
//                          8-byte all-reduce, alternating; the mean call over both kinds,
//                          the tries and the ranks (spikes included), at least the latency
//   overlap              per axis: the 8 MiB hop alone (h), k forward GEMMs [256 x 2048 x
//                        2048] of about its length alone (c), and the hop started before
//                        the GEMMs and waited for after them (b): (c + h - b) / min(c, h),
//                        clamped to 0..1; the smallest over the axes (0 on one rank)
//   Axes the mesh does not split get the slowest measured link (or the defaults on one
//   rank) and say so in [measured].
// clock "cpu" (--clock cpu) times everything in process CPU time instead of wall time: on
// cores shared with other jobs, the profile of the idle machine (for comparing with
// CPU-time step times, as bench_train_step's step_cpu_time_median_s).
// Must run under MPI (meshtrain::Runtime). Returns the exit status.

#include <string>
#include <vector>

namespace meshtrain {

int calibrate_command(const std::string& config_path, const std::vector<std::string>& overrides,
                      const std::string& out_path, const std::string& clock = "wall");

}  // namespace meshtrain
