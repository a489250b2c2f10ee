#pragma once
// A hardware profile: what the cost model (partition/cost_model.hpp) needs to know about the
// machines a run uses. Plain data; `meshtrain calibrate` measures one and writes it as TOML
// (framework/train/hardware_file.hpp reads and writes that file).
//
//   gemm_flops         FLOP/s of one rank's float GEMM (the one gemm() of framework/core)
//   gemm_rates         FLOP/s of particular GEMM shapes, measured (calibrate CONFIG times
//                      every shape the config's step runs: a short K or N runs far below
//                      the square rate). gemm_seconds() uses the nearest one, else gemm_flops.
//   memory_bandwidth   B/s one rank streams through memory (read + write bytes counted)
//   elementwise_rates  elements/s of elementwise kernels whose arithmetic, not memory, sets
//                      their pace (an activation's or SwiGLU's exp), keyed by the kernel's
//                      name ("swiglu_forward", "silu_backward", ...: elementwise_kernel_name):
//                      calibrate CONFIG times the ones its step runs at the step's shape. The
//                      cost model charges such a kernel elements / rate, others bytes /
//                      memory_bandwidth.
//   per mesh axis (dp, fsdp, ep, tp, sp), the link between neighbours on that axis:
//     bandwidth        B/s of one point-to-point message (ping-pong, one direction)
//     latency          s of an empty message (half a round trip)
//     collective_overhead  s one small collective costs a step: the mean time of a call
//                      entered right after each rank's own compute (unsynchronised, as in a
//                      step), which holds the wait for the last rank to arrive. The cost model
//                      charges a collective max(its latency terms, this) + its bytes at the
//                      bandwidth (collective_seconds). 0 or the latency: no more than the
//                      latency terms (an idle node's).
//     collective_bandwidth  B/s an all-gather achieves per rank ((p-1)/p * bytes / time of
//                      a 16 MiB one). Defaults to `bandwidth`.
//     reduce_scatter_bandwidth  the same for a reduce-scatter (MPI libraries often run it
//                      as a reduce then a scatter, slower than a ring). Defaults to
//                      `collective_bandwidth`.
//     all_reduce_bandwidth  the same for an all-reduce: 2 (p-1)/p * bytes / time.
//                      Defaults to `collective_bandwidth`.
//     exchange_bandwidth    B/s per rank of a ring hop: every rank sends a block to its
//                      next neighbour while receiving one from its previous one
//                      (Communicator::shift), so a link carries both directions at once.
//                      The ring collective matmuls' hop. Defaults to `bandwidth`.
//     bidirectional_bandwidth  B/s per rank of a bidirectional hop: both halves of a block
//                      sent at once, one each way round the ring (two shifts), counted as
//                      the whole block over the time. Defaults to `exchange_bandwidth`.
//     ring_reduce_scatter_bandwidth, ring_all_reduce_bandwidth  the same two for the MPI
//                      backend's own ring ([runtime] reductions); 0 when not measured.
//     ring_reduce_scatter_from, ring_all_reduce_from  bytes per rank from which the ring
//                      measured faster than the library (+inf: never); what reductions =
//                      "auto" picks by. Meaningful only where the ring was measured.
//   hdf5_row_seconds   s one rank spends per row of a batch of random rows read from an HDF5
//                      file whose chunks are cached (a DLRM's dense features and label:
//                      RowSource::read's hyperslab union and H5Dread, the scatter into batch
//                      order). calibrate CONFIG measures it on the config's data.path; else
//                      kHdf5RowSeconds (an estimate).
//   sparse_row_seconds, sparse_id_seconds  s the sparse reader (SparseHdf5Reader::read_unagreed,
//                      tables held in memory) spends per row and table (its two offsets
//                      gathered and checked, its bag copied back in batch order) and per id
//                      (gathered and checked). calibrate CONFIG measures them on the config's
//                      data.path; sparse_row_seconds 0: not measured, both charged as
//                      cache lines at memory_bandwidth (128 bytes a row and table, 64 an id).
//   overlap            0..1, how much of a transfer started before a GEMM and waited for
//                      after it is hidden under the GEMM: two parts a and c run together
//                      take a + c - overlap * min(a, c) (1: max(a, c); 0: a + c). MPI on
//                      CPUs moves data only inside MPI calls, so it is near 0 there.

#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <vector>

namespace meshtrain {

// One GEMM: op(A) [m x k] @ op(B) [k x n], op = transpose or not (framework/core/gemm.hpp).
struct GemmShape {
  int64_t m = 0, k = 0, n = 0;
  bool transpose_a = false, transpose_b = false;
  double flops() const { return 2.0 * static_cast<double>(m) * k * n; }
  bool operator==(const GemmShape& o) const {
    return m == o.m && k == o.k && n == o.n && transpose_a == o.transpose_a &&
           transpose_b == o.transpose_b;
  }
  bool operator<(const GemmShape& o) const;
};
// "NT 128 x 2048 x 1024": the transposes of A and B, then m x k x n.
std::string to_string(const GemmShape& shape);

struct GemmRate {
  GemmShape shape;
  double flops = 0.0;  // FLOP/s
};

struct LinkProfile {
  double bandwidth = 0.0;                      // B/s
  double latency = 0.0;                        // s
  double collective_bandwidth = 0.0;           // B/s
  double exchange_bandwidth = 0.0;             // B/s
  double bidirectional_bandwidth = 0.0;        // B/s
  double reduce_scatter_bandwidth = 0.0;       // B/s
  double all_reduce_bandwidth = 0.0;           // B/s
  double ring_reduce_scatter_bandwidth = 0.0;  // B/s; 0: not measured
  double ring_all_reduce_bandwidth = 0.0;      // B/s; 0: not measured
  double ring_reduce_scatter_from = std::numeric_limits<double>::infinity();  // bytes per rank
  double ring_all_reduce_from = std::numeric_limits<double>::infinity();      // bytes per rank
  double collective_overhead = 0.0;  // s; 0: the latency terms alone
  bool ring_measured() const {
    return ring_reduce_scatter_bandwidth > 0.0 && ring_all_reduce_bandwidth > 0.0;
  }
};

// HDF5's time per row of a read of random rows from cached chunks, for a profile that does not
// say (hdf5_row_seconds): an estimate (the traced `data read` of a np 2 DLRM step read in the
// step, data.prefetch = 0: 21 ms for 256 rows at load average 16 on 2 cores, the sparse part
// then memory gathers; docs/recsys.md, "Where a np 2 step goes"). calibrate CONFIG measures it.
constexpr double kHdf5RowSeconds = 10e-6;

struct HardwareProfile {
  double gemm_flops = 0.0;                          // FLOP/s per rank
  std::vector<GemmRate> gemm_rates;                 // measured shapes, any order
  double memory_bandwidth = 0.0;                    // B/s per rank
  std::map<std::string, double> elementwise_rates;  // kernel name -> elements/s, measured
  double overlap = 0.0;                             // 0..1
  // The storage data files are read from: sequential read rate (B/s per rank) and the
  // latency of one random read (s); a local NVMe SSD unless set. Not measured by calibrate
  // (set them from fio or dd).
  double storage_read_bandwidth = 2e9;
  double storage_read_latency = 100e-6;
  // A DLRM's data read (see above): per dense row, per row and table, per id; the sparse
  // ones 0 when not measured.
  double hdf5_row_seconds = kHdf5RowSeconds;
  double sparse_row_seconds = 0.0;
  double sparse_id_seconds = 0.0;
  std::map<std::string, LinkProfile> links;  // one per axis of hardware_axes()
  std::string source;  // "defaults" or the file it was read from (for the plan's header)

  // The link of one axis (bad_input for an axis the profile lacks).
  const LinkProfile& link(const std::string& axis) const;
  // A group over several axes runs at its slowest axis: the smallest bandwidths and the
  // largest latency. The empty group is an infinitely fast link.
  LinkProfile group_link(const std::vector<std::string>& axes) const;
  // Seconds of one GEMM: at the rate of the same shape in gemm_rates; else of the nearest
  // measured shape with the same transposes whose m, k and n are each within a factor 2
  // (nearest: the least sum of |log| ratios); else at gemm_flops.
  double gemm_seconds(const GemmShape& shape) const;
};

// The elementwise kernels a profile may hold a rate for: "<activation>_forward" and
// "<activation>_backward" for relu, tanh, gelu, gelu_erf, silu and sigmoid (layers/
// activation.hpp), swiglu_forward, swiglu_backward, and a DLRM's dot interaction,
// dlrm_dot_forward and dlrm_dot_backward (layers/dlrm.hpp; their elements are multiply-adds,
// rows x pairs x d forward, twice that backward).
const std::vector<std::string>& elementwise_kernel_names();

// The reduce-scatter and all-reduce rates (reduce_scatter_bandwidth, all_reduce_bandwidth) of
// the algorithm a run's MPI reductions use ([runtime] reductions): the ring's (ring only),
// the library's (library only: the profile as measured), or the faster of the two at
// calibrate's size (both). Links without ring measurements keep the library's.
void select_reduction_rates(HardwareProfile& profile, bool ring, bool library);

// The mesh axes a profile describes, in mesh order: dp, fsdp, ep, tp, sp.
const std::vector<std::string>& hardware_axes();

// The profile used when no file is given: one core of a current x86 server running
// OpenBLAS sgemm (100 GFLOP/s, AVX-512 single thread), streaming 10 GB/s, and every axis
// an MPI link inside one node over shared memory (5 GB/s point to point, 2.5 GB/s per
// rank in every collective and in ring hops, 2 microseconds latency), overlap 0 (MPI on CPUs
// moves data only inside MPI calls), data files on a local NVMe SSD (2 GB/s, 100 us per
// random read). Round figures of what `meshtrain calibrate` measures
// on such a machine; calibrate for anything else (a network between hosts is 10 to 1000
// times slower).
HardwareProfile default_hardware_profile();

// bad_input naming `source` and the key when a value is not finite and positive (latency:
// not negative; overlap: 0..1), an axis is missing or an elementwise rate names no kernel of
// elementwise_kernel_names().
void check_hardware_profile(const HardwareProfile& profile);

}  // namespace meshtrain
