#pragma once
// Collective matmuls over one communicator (a mesh axis or axis tuple) of size n, this
// rank i (docs/design.md, "Collective matmuls"; the shard_map notebook's matmul_allgather and
// matmul_psumscatter, generalized to either side, either dim and transposed operands).
//
// Operands are given as stored (LayoutRight, possibly row-strided column blocks) with a
// transpose flag, as for gemm() (framework/core/gemm.hpp): op(X) = transpose ? Xᵀ : X, op(A) is [M,
// K], op(B) is [K, N], C is the output.
//
// all_gather_matmul(comm, side, gather_dim, A, B, C):
//   the operand on `side` is this rank's block of a matrix split over comm along its
//   stored dim `gather_dim` (the tiled all_gather of the blocks, rank order, is the full
//   operand); C = op(A_full) @ op(B) (side left) or op(A) @ op(B_full) (side right).
//   Examples (TP Linear, W [in, out] split over tp on dim 0):
//     out = lhs @ all_gather(rhs_block, dim 0)      side right, gather_dim 0
//     dX_local = all_gather(dY, dim 1) @ W_localᵀ   side left,  gather_dim 1, B transposed
//     dW_local = X_localᵀ @ all_gather(dY, dim 1)   side right, gather_dim 1, A transposed
//   The gathered block must be contiguous.
//
// matmul_reduce_scatter(comm, scatter_dim, A, B, C):
//   C = the tiled reduce_scatter (sum) of op(A) @ op(B) [M, N] along scatter_dim: C is
//   [M/n, N] (dim 0) or [M, N/n] (dim 1), the block i of the sum over ranks.
//
// Algorithms:
//   naive          one all_gather into the workspace then the GEMM (one call when the
//                  gathered dim is the stored dim 0; one per block otherwise, which saves
//                  an unpack copy) / the product in the workspace, then one reduce_scatter.
//                  Extra memory: n blocks.
//   ring           n steps; each multiplies the block in hand while the next one moves one
//                  hop (Communicator::shift, overlapped). For the reduce-scatter the partial
//                  sums travel and each rank adds its contribution to the passing block.
//                  Extra memory: 2 blocks.
//   bidirectional  each block split in two halves (by stored rows) that travel in opposite
//                  directions (n-1 hops each, half the bytes per hop, both link directions
//                  busy). Extra memory: 2 blocks.
//   auto           the fastest of the three by the cost model (partition/cost_model.hpp)
//                  on the process's hardware profile (set_collective_matmul_hardware;
//                  the defaults of partition/hardware.hpp until set), the link of the
//                  feature axis tp. The TP layers choose with their own axis' link and
//                  pass the result (layer_matmul_algorithms), so `meshtrain plan` shows it.
// A "block" is the travelling operand: the gathered block, or the [M/n, N] / [M, N/n]
// output block of the reduce-scatter. ring/bidirectional reduce-scatter use C itself as
// the third rotating buffer; a non-contiguous C costs one more block.
//
// Wire (mixed precision): the travelling operand moves as `wire` elements (Communicator's
// wire type): gathered blocks arrive rounded to it, and the partial sums of the
// reduce-scatter are rounded to it at every hop (naive: the reduce-scatter's own 16-bit sum).
// `wire` is also the dtype gemm() is told the operands hold (its `inputs`).
//
// 16-bit operands (GemmOperand of a ConstHalfMatrixView, elements of the 16-bit `wire`): either
// operand of either function may be one, and the GEMMs read it as it is (gemm(), which widens it
// where its kernel reads fp32). A 16-bit gathered operand travels as it is: its blocks move as
// 2-byte elements (Communicator::all_gather_16bit / shift_16bit: half the bytes of an fp32
// buffer, nothing packed or widened), land in the workspace as 16-bit blocks (half the bytes)
// and are multiplied from there. The result is that of fp32 buffers holding the same values
// (the wire rounds nothing), bit for bit where the same GEMM kernel runs. A 16-bit gathered
// operand with an fp32 wire is bad_input.
//
// Shapes that do not split over n are bad_input naming the dimension, its size and n.
// Every rank of comm must call with the same algorithm and shapes.

#include <cstddef>
#include <string>

#include "framework/comm/communicator.hpp"
#include "framework/core/choices.hpp"
#include "framework/core/gemm.hpp"
#include "partition/cost_model.hpp"

namespace meshtrain {

// CollectiveMatmulAlgorithm and its names ("naive" | "ring" | "bidirectional" | "auto"):
// framework/core/choices.hpp.
// The hardware profile `automatic` chooses with (process-wide, like set_matmul_precision;
// set it before the layers are built).
void set_collective_matmul_hardware(const HardwareProfile& hardware);
const HardwareProfile& collective_matmul_hardware();

// What `automatic` becomes for a call of `shape` (other algorithms are returned as they
// are).
CollectiveMatmulAlgorithm resolve_collective_matmul_algorithm(CollectiveMatmulAlgorithm algorithm,
                                                              const CollectiveMatmulShape& shape);

enum class GatherSide { left, right };

// The shape of a call with these operands (what the two functions below would run; the
// same bad_input for operands they reject).
CollectiveMatmulShape all_gather_matmul_shape(Communicator& comm, GatherSide side, int gather_dim,
                                              GemmOperand a, GemmOperand b, MatrixView c,
                                              Dtype wire = Dtype::fp32);
CollectiveMatmulShape matmul_reduce_scatter_shape(Communicator& comm, int scatter_dim,
                                                  GemmOperand a, GemmOperand b, MatrixView c,
                                                  Dtype wire = Dtype::fp32);

// Scratch memory of the collective matmuls: one buffer, grown on first use (or by
// reserve) and reused, so later calls with the same shapes do not allocate. Not shared
// between concurrent calls.
class CollectiveMatmulWorkspace {
 public:
  void reserve(std::size_t bytes);
  std::size_t capacity_bytes() const { return buffer_.extent(0) * sizeof(float); }
  // Extra bytes the last call used (its peak workspace memory).
  std::size_t last_call_bytes() const { return last_call_bytes_; }

  // For the algorithms: `floats` contiguous floats, valid until the next acquire.
  float* acquire(std::size_t floats);

 private:
  Kokkos::View<float*, Kokkos::LayoutRight> buffer_;
  std::size_t last_call_bytes_ = 0;
};

void all_gather_matmul(Communicator& comm, GatherSide side, int gather_dim, GemmOperand a,
                       GemmOperand b, MatrixView c, CollectiveMatmulAlgorithm algorithm,
                       CollectiveMatmulWorkspace& workspace, Dtype wire = Dtype::fp32);

void matmul_reduce_scatter(Communicator& comm, int scatter_dim, GemmOperand a, GemmOperand b,
                           MatrixView c, CollectiveMatmulAlgorithm algorithm,
                           CollectiveMatmulWorkspace& workspace, Dtype wire = Dtype::fp32);

}  // namespace meshtrain
