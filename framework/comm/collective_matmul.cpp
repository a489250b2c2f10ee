#include "framework/comm/collective_matmul.hpp"

#include <algorithm>
#include <array>
#include <type_traits>
#include <utility>

#include "framework/comm/collective_matmul_16bit.hpp"
#include "framework/comm/column_blocks.hpp"
#include "framework/core/exec_space.hpp"
#include "framework/core/kernel_label.hpp"
#include "framework/core/view_ops.hpp"
#include "partition/gathered_product.hpp"

namespace meshtrain {

namespace {

using Range = std::pair<std::size_t, std::size_t>;  // [first, second)

std::size_t length(const Range& r) {
  return r.second - r.first;
}

// op(X)[rows, :] and op(X)[:, cols] as the stored sub-block of X (no copy).
GemmOperand op_row_block(const GemmOperand& x, const Range& rows) {
  GemmOperand block = x;
  if (x.sixteen_bit) {
    block.half = x.transpose ? Kokkos::subview(x.half, Kokkos::ALL, rows)
                             : Kokkos::subview(x.half, rows, Kokkos::ALL);
  } else {
    block.matrix = x.transpose ? Kokkos::subview(x.matrix, Kokkos::ALL, rows)
                               : Kokkos::subview(x.matrix, rows, Kokkos::ALL);
  }
  return block;
}
GemmOperand op_col_block(const GemmOperand& x, const Range& cols) {
  GemmOperand block = x;
  if (x.sixteen_bit) {
    block.half = x.transpose ? Kokkos::subview(x.half, cols, Kokkos::ALL)
                             : Kokkos::subview(x.half, Kokkos::ALL, cols);
  } else {
    block.matrix = x.transpose ? Kokkos::subview(x.matrix, cols, Kokkos::ALL)
                               : Kokkos::subview(x.matrix, Kokkos::ALL, cols);
  }
  return block;
}

void add_into(float* target, const float* source, std::size_t count) {
  const VectorView t(target, count);
  const ConstVectorView s(source, count);
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::collective_matmul_accumulate"), device_range(0, count),
      KOKKOS_LAMBDA(const std::size_t k) { t(k) += s(k); });
}

template <class View>
void require_contiguous_block(const View& m, const Communicator& comm, const char* op,
                              const char* which) {
  if (!m.span_is_contiguous()) {
    MESHTRAIN_BAD_INPUT(op, " on ", comm.description(), ": the ", which,
                        " block must be contiguous (not a column block)");
  }
}

std::size_t block_floats(std::size_t rows, std::size_t cols) {
  return rows * cols;
}

// `count` elements of T (float, or uint16_t: 16-bit blocks) from the workspace.
template <class T>
T* acquire_elements(CollectiveMatmulWorkspace& ws, std::size_t count) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, uint16_t>);
  const std::size_t floats = (count * sizeof(T) + sizeof(float) - 1) / sizeof(float);
  return reinterpret_cast<T*>(ws.acquire(floats));
}

// The travelling blocks' moves: fp32 buffers through the wire dtype (rounded to it on the way,
// widened on arrival), 16-bit ones as they are (half the bytes, nothing packed or widened).
void gather_blocks(Communicator& comm, const float* send, float* recv, std::size_t count,
                   Dtype wire) {
  comm.all_gather(ConstVectorView(send, count),
                  VectorView(recv, count * static_cast<std::size_t>(comm.size())), wire);
}
void gather_blocks(Communicator& comm, const uint16_t* send, uint16_t* recv, std::size_t count,
                   Dtype wire) {
  comm.all_gather_16bit(send, recv, count, wire);
}
Request shift_block(Communicator& comm, const float* send, float* recv, std::size_t count,
                    int offset, Dtype wire) {
  return comm.shift(ConstVectorView(send, count), VectorView(recv, count), offset, wire);
}
Request shift_block(Communicator& comm, const uint16_t* send, uint16_t* recv, std::size_t count,
                    int offset, Dtype wire) {
  return comm.shift_16bit(send, recv, count, offset, wire);
}

}  // namespace

// ------------------------------------------------------------------------------ names

namespace {
HardwareProfile& process_hardware() {
  static HardwareProfile profile = default_hardware_profile();
  return profile;
}
}  // namespace

void set_collective_matmul_hardware(const HardwareProfile& hardware) {
  check_hardware_profile(hardware);
  process_hardware() = hardware;
}

const HardwareProfile& collective_matmul_hardware() {
  return process_hardware();
}

CollectiveMatmulAlgorithm resolve_collective_matmul_algorithm(CollectiveMatmulAlgorithm algorithm,
                                                              const CollectiveMatmulShape& shape) {
  const HardwareProfile& hw = collective_matmul_hardware();
  return choose_collective_matmul(shape, algorithm, hw.link("tp"), hw);
}

// -------------------------------------------------------------------------- workspace

void CollectiveMatmulWorkspace::reserve(std::size_t bytes) {
  const std::size_t floats = (bytes + sizeof(float) - 1) / sizeof(float);
  if (buffer_.extent(0) >= floats) return;
  buffer_ = Kokkos::View<float*, Kokkos::LayoutRight>(
      Kokkos::view_alloc(Kokkos::WithoutInitializing, "meshtrain::collective_matmul_workspace"),
      floats);
}

float* CollectiveMatmulWorkspace::acquire(std::size_t floats) {
  reserve(floats * sizeof(float));
  last_call_bytes_ = floats * sizeof(float);
  return buffer_.data();
}

// -------------------------------------------------------------- all-gather matmul

namespace {

// The geometry of one all_gather_matmul call.
struct GatherPlan {
  const char* op = "all_gather_matmul";
  Dtype wire = Dtype::fp32;  // what the gathered blocks travel as
  GatherSide side = GatherSide::right;
  int gather_dim = 0;
  int n = 1;
  int i = 0;
  GemmOperand gathered;  // this rank's block (fp32, or 16-bit elements of `wire`)
  GemmOperand other;
  std::size_t block_rows = 0, block_cols = 0;  // stored block extents
  std::size_t k = 0;                           // contraction length of the full product
  MatrixView c;
  HalfMatrixView c16;  // all_gather_matmul_to_16bit: C as 16 bits of `wire` (c then has no data)

  // GEMM of one piece of the full gathered operand: stored rows [row0, row0+rows) and
  // cols [col0, col0+cols) of it, held contiguously in `piece`. beta 0 when the piece
  // spans all of K (pieces then write disjoint parts of C), 1 otherwise (C zeroed first).
  template <class T>
  void multiply_piece(const T* piece, std::size_t row0, std::size_t rows, std::size_t col0,
                      std::size_t cols) const {
    if (rows == 0 || cols == 0) return;
    GemmOperand p;
    if constexpr (std::is_same_v<T, uint16_t>) {
      p = plain(ConstHalfMatrixView(piece, rows, cols));
    } else {
      p = plain(ConstMatrixView(piece, rows, cols));
    }
    p.transpose = gathered.transpose;
    const Range stored_rows{row0, row0 + rows}, stored_cols{col0, col0 + cols};
    // op(piece) covers op rows/cols of the full operand:
    const Range op_r = gathered.transpose ? stored_cols : stored_rows;
    const Range op_c = gathered.transpose ? stored_rows : stored_cols;
    if (c16.data() != nullptr) {  // each block of C by one GEMM (checked by the caller)
      MESHTRAIN_REQUIRE(length(side == GatherSide::left ? op_c : op_r) == k, op,
                        ": a 16-bit C with a piece that splits K");
      if (side == GatherSide::left) {
        gemm_to_16bit(p, op_row_block(other, op_c), Kokkos::subview(c16, op_r, Kokkos::ALL), wire);
      } else {
        gemm_to_16bit(op_col_block(other, op_r), p, Kokkos::subview(c16, Kokkos::ALL, op_c), wire);
      }
      return;
    }
    if (side == GatherSide::left) {  // op_r in M, op_c in K
      const float beta = length(op_c) == k ? 0.0f : 1.0f;
      gemm(p, op_row_block(other, op_c), beta, Kokkos::subview(c, op_r, Kokkos::ALL), wire);
    } else {  // op_r in K, op_c in N
      const float beta = length(op_r) == k ? 0.0f : 1.0f;
      gemm(op_col_block(other, op_r), p, beta, Kokkos::subview(c, Kokkos::ALL, op_c), wire);
    }
  }

  // The GEMM multiply_piece runs for a piece of `rows` x `cols` stored elements.
  GemmShape piece_shape(std::size_t rows, std::size_t cols) const {
    const auto r = static_cast<int64_t>(gathered.transpose ? cols : rows);  // op rows
    const auto c = static_cast<int64_t>(gathered.transpose ? rows : cols);  // op cols
    if (side == GatherSide::left) {
      return {r, c, static_cast<int64_t>(op_cols(other)), gathered.transpose, other.transpose};
    }
    return {static_cast<int64_t>(op_rows(other)), r, c, other.transpose, gathered.transpose};
  }

  // What the cost model needs to choose an algorithm (gather_naive, gather_ring and
  // gather_bidirectional below run these GEMMs).
  CollectiveMatmulShape shape() const {
    CollectiveMatmulShape s;
    s.kind = CollectiveMatmulKind::all_gather;
    s.ranks = n;
    s.block_bytes = static_cast<double>(block_rows * block_cols * bytes_of(wire));
    const std::size_t whole = static_cast<std::size_t>(n) * block_rows;
    s.naive =
        gather_dim == 0 ? piece_shape(whole, block_cols) : piece_shape(block_rows, block_cols);
    s.naive_calls = gather_dim == 0 ? 1 : n;
    s.block = piece_shape(block_rows, block_cols);
    s.half = piece_shape(block_rows - block_rows / 2, block_cols);
    return s;
  }

  // Piece `rows` [sub0, sub0+rows) of block j.
  template <class T>
  void multiply_block_rows(const T* piece, int j, std::size_t sub0, std::size_t rows) const {
    const std::size_t jj = static_cast<std::size_t>(j);
    if (gather_dim == 0) {
      multiply_piece(piece, jj * block_rows + sub0, rows, 0, block_cols);
    } else {
      multiply_piece(piece, sub0, rows, jj * block_cols, block_cols);
    }
  }

  // Whether pieces split K (then C accumulates and is zeroed first). Blocks split the
  // stored gather_dim; bidirectional halves split stored dim 0.
  bool splits_k(int stored_dim) const {
    const int op_dim = gathered.transpose ? 1 - stored_dim : stored_dim;
    return side == GatherSide::left ? op_dim == 1 : op_dim == 0;
  }
};

// `op`: the public function's name, which its errors say.
GatherPlan plan_gather(const char* op, Communicator& comm, GatherSide side, int gather_dim,
                       GemmOperand a, GemmOperand b, MatrixView c, Dtype wire) {
  GatherPlan plan;
  plan.op = op;
  plan.wire = wire;
  if (gather_dim != 0 && gather_dim != 1) {
    MESHTRAIN_BAD_INPUT(op, ": gather_dim must be 0 or 1, got ", gather_dim);
  }
  plan.side = side;
  plan.gather_dim = gather_dim;
  plan.n = comm.size();
  plan.i = comm.rank();
  plan.gathered = side == GatherSide::left ? a : b;
  plan.other = side == GatherSide::left ? b : a;
  if (plan.gathered.sixteen_bit && wire == Dtype::fp32) {  // its blocks travel as they are
    MESHTRAIN_BAD_INPUT(op, " on ", comm.description(),
                        ": a 16-bit gathered operand needs a 16-bit wire dtype (bf16 or fp16, "
                        "the dtype of its elements), got ",
                        to_string(wire));
  }
  plan.block_rows = plan.gathered.extent(0);
  plan.block_cols = plan.gathered.extent(1);
  plan.c = c;
  const std::size_t n = static_cast<std::size_t>(plan.n);
  const std::size_t full_rows = gather_dim == 0 ? n * plan.block_rows : plan.block_rows;
  const std::size_t full_cols = gather_dim == 1 ? n * plan.block_cols : plan.block_cols;
  const std::size_t g_op_rows = plan.gathered.transpose ? full_cols : full_rows;
  const std::size_t g_op_cols = plan.gathered.transpose ? full_rows : full_cols;
  const std::size_t m = side == GatherSide::left ? g_op_rows : op_rows(a);
  const std::size_t k_left = side == GatherSide::left ? g_op_cols : op_cols(a);
  const std::size_t k_right = side == GatherSide::right ? g_op_rows : op_rows(b);
  const std::size_t cols = side == GatherSide::right ? g_op_cols : op_cols(b);
  const char* gathered_name = side == GatherSide::left ? "lhs" : "rhs";
  const char* other_name = side == GatherSide::left ? "rhs" : "lhs";
  if (k_left != k_right) {
    // The other operand's K must be n blocks of the gathered one.
    const std::size_t other_k = side == GatherSide::left ? k_right : k_left;
    const std::size_t gathered_k = side == GatherSide::left ? k_left : k_right;
    if (other_k % n != 0) {
      MESHTRAIN_BAD_INPUT(op, " on ", comm.description(), ": K = ", other_k, " of the ", other_name,
                          " is not divisible by the ", n, " ranks");
    }
    MESHTRAIN_BAD_INPUT(op, " on ", comm.description(), ": K = ", other_k, " of the ", other_name,
                        " does not match K = ", gathered_k, " of the gathered ", gathered_name,
                        " (", n, " ranks x its block)");
  }
  if (c.extent(0) != m || c.extent(1) != cols) {
    // Which output dim the gathered dim lands on (if it is not K).
    const int gathered_op_dim = plan.gathered.transpose ? 1 - gather_dim : gather_dim;
    const bool c_dim0_gathered = side == GatherSide::left && gathered_op_dim == 0;
    const bool c_dim1_gathered = side == GatherSide::right && gathered_op_dim == 1;
    if (c_dim0_gathered && c.extent(0) % n != 0) {
      MESHTRAIN_BAD_INPUT(op, " on ", comm.description(), ": output dim 0 (M = ", c.extent(0),
                          ") is not divisible by the ", n, " ranks");
    }
    if (c_dim1_gathered && c.extent(1) % n != 0) {
      MESHTRAIN_BAD_INPUT(op, " on ", comm.description(), ": output dim 1 (N = ", c.extent(1),
                          ") is not divisible by the ", n, " ranks");
    }
    MESHTRAIN_BAD_INPUT(op, " on ", comm.description(), ": the output is [", c.extent(0), ", ",
                        c.extent(1), "], expected [", m, ", ", cols, "]");
  }
  plan.k = k_left;
  if (plan.gathered.sixteen_bit) {
    require_contiguous_block(plan.gathered.half, comm, op, "gathered");
  } else {
    require_contiguous_block(plan.gathered.matrix, comm, op, "gathered");
  }
  return plan;
}

// The algorithms on the gathered operand's elements: T = float (an fp32 buffer) or uint16_t (16-bit
// elements of plan.wire), `mine` its data.
template <class T>
void gather_naive(const GatherPlan& plan, const T* mine, Communicator& comm,
                  CollectiveMatmulWorkspace& ws) {
  const std::size_t block = block_floats(plan.block_rows, plan.block_cols);
  const std::size_t n = static_cast<std::size_t>(plan.n);
  T* full = acquire_elements<T>(ws, n * block);
  gather_blocks(comm, mine, full, block, plan.wire);
  if (plan.gather_dim == 0) {
    plan.multiply_piece(full, 0, n * plan.block_rows, 0, plan.block_cols);
    return;
  }
  if (plan.splits_k(1)) set_zero(plan.c);
  for (int j = 0; j < plan.n; ++j)
    plan.multiply_block_rows(full + j * block, j, 0, plan.block_rows);
}

template <class T>
void gather_ring(const GatherPlan& plan, const T* mine, Communicator& comm,
                 CollectiveMatmulWorkspace& ws) {
  const std::size_t block = block_floats(plan.block_rows, plan.block_cols);
  T* buffers = acquire_elements<T>(ws, 2 * block);
  if (plan.splits_k(plan.gather_dim)) set_zero(plan.c);
  const T* in_hand = mine;
  for (int s = 0; s < plan.n; ++s) {
    T* next = buffers + (s % 2) * block;
    Request moving;
    if (s + 1 < plan.n) moving = shift_block(comm, in_hand, next, block, +1, plan.wire);
    const int source = ((plan.i - s) % plan.n + plan.n) % plan.n;
    plan.multiply_block_rows(in_hand, source, 0, plan.block_rows);
    moving.wait();
    in_hand = next;
  }
}

template <class T>
void gather_bidirectional(const GatherPlan& plan, const T* mine, Communicator& comm,
                          CollectiveMatmulWorkspace& ws) {
  const std::size_t lo_rows = plan.block_rows / 2, hi_rows = plan.block_rows - lo_rows;
  const std::size_t lo = lo_rows * plan.block_cols, hi = hi_rows * plan.block_cols;
  T* buffers = acquire_elements<T>(ws, 2 * (lo + hi));
  T* lo_buf[2] = {buffers, buffers + lo};
  T* hi_buf[2] = {buffers + 2 * lo, buffers + 2 * lo + hi};
  if (plan.splits_k(plan.gather_dim) || plan.splits_k(0)) set_zero(plan.c);
  const T* lo_in = mine;        // stored rows [0, lo_rows) of the block
  const T* hi_in = lo_in + lo;  // stored rows [lo_rows, block_rows)
  for (int s = 0; s < plan.n; ++s) {
    Request lo_moving, hi_moving;
    if (s + 1 < plan.n) {  // every rank starts lo (up) before hi (down)
      lo_moving = shift_block(comm, lo_in, lo_buf[s % 2], lo, +1, plan.wire);
      hi_moving = shift_block(comm, hi_in, hi_buf[s % 2], hi, -1, plan.wire);
    }
    const int lo_source = ((plan.i - s) % plan.n + plan.n) % plan.n;
    const int hi_source = (plan.i + s) % plan.n;
    plan.multiply_block_rows(lo_in, lo_source, 0, lo_rows);
    plan.multiply_block_rows(hi_in, hi_source, lo_rows, hi_rows);
    lo_moving.wait();
    hi_moving.wait();
    lo_in = lo_buf[s % 2];
    hi_in = hi_buf[s % 2];
  }
}

}  // namespace

CollectiveMatmulShape all_gather_matmul_shape(Communicator& comm, GatherSide side, int gather_dim,
                                              GemmOperand a, GemmOperand b, MatrixView c,
                                              Dtype wire) {
  return plan_gather("all_gather_matmul", comm, side, gather_dim, a, b, c, wire).shape();
}

void all_gather_matmul(Communicator& comm, GatherSide side, int gather_dim, GemmOperand a,
                       GemmOperand b, MatrixView c, CollectiveMatmulAlgorithm algorithm,
                       CollectiveMatmulWorkspace& workspace, Dtype wire) {
  const GatherPlan plan = plan_gather("all_gather_matmul", comm, side, gather_dim, a, b, c, wire);
  const auto run = [&](const auto* mine) {
    switch (resolve_collective_matmul_algorithm(algorithm, plan.shape())) {
      case CollectiveMatmulAlgorithm::ring:
        gather_ring(plan, mine, comm, workspace);
        break;
      case CollectiveMatmulAlgorithm::bidirectional:
        gather_bidirectional(plan, mine, comm, workspace);
        break;
      default:
        gather_naive(plan, mine, comm, workspace);
        break;
    }
  };
  if (plan.gathered.sixteen_bit) {
    run(plan.gathered.half.data());
  } else {
    run(plan.gathered.matrix.data());
  }
  fence_all(MESHTRAIN_LABEL("meshtrain::all_gather_matmul"));
}

namespace {

// all_gather_matmul_to_16bit's naive algorithm where the gathered blocks are column blocks of the
// full operand (stored gather_dim 1, not transposed): the blocks gathered into the workspace, laid
// side by side into one dense [block_rows, n * block_cols] operand after them, and one GEMM into
// the whole (dense) C. Per block, each GEMM would write a column block of C, a row-strided 16-bit
// dst, for which oneDNN 2.6 takes its gemm:jit kernel with an fp32 accumulator of C's block in its
// scratchpad (16 MiB for the 784-4096-4096-10 step's second layer at tp 2): the dense product
// takes the bf16 matmul that writes the 16 bits itself, and the workspace holds 2n blocks.
template <class T>
void gather_unpacked_naive(const GatherPlan& plan, const T* mine, Communicator& comm,
                           CollectiveMatmulWorkspace& ws) {
  const std::size_t block = block_floats(plan.block_rows, plan.block_cols);
  const std::size_t n = static_cast<std::size_t>(plan.n);
  T* blocks = acquire_elements<T>(ws, 2 * n * block);
  T* dense = blocks + n * block;
  gather_blocks(comm, mine, blocks, block, plan.wire);
  const int64_t rows = static_cast<int64_t>(plan.block_rows);
  const int64_t cols = static_cast<int64_t>(plan.block_cols);
  place_column_blocks(static_cast<const T*>(blocks), dense, static_cast<int64_t>(n) * cols,
                      static_cast<int64_t>(n), rows, cols,
                      MESHTRAIN_LABEL("meshtrain::all_gather_matmul_unpack"));
  fence_all(MESHTRAIN_LABEL("meshtrain::all_gather_matmul_unpack"));
  plan.multiply_piece(static_cast<const T*>(dense), 0, plan.block_rows, 0, n * plan.block_cols);
}

}  // namespace

bool all_gather_matmul_writes_16bit(GatherSide side, int gather_dim, bool gathered_transposed,
                                    CollectiveMatmulAlgorithm algorithm) {
  const int op_dim = gathered_transposed ? 1 - gather_dim : gather_dim;
  GatheredProductDim gathered = GatheredProductDim::k;
  if (side == GatherSide::left && op_dim == 0) gathered = GatheredProductDim::m;
  if (side == GatherSide::right && op_dim == 1) gathered = GatheredProductDim::n;
  return gathered_product_writes_16bit(gathered, algorithm);
}

void all_gather_matmul_to_16bit(Communicator& comm, GatherSide side, int gather_dim, GemmOperand a,
                                GemmOperand b, HalfMatrixView c,
                                CollectiveMatmulAlgorithm algorithm,
                                CollectiveMatmulWorkspace& workspace, Dtype wire) {
  MESHTRAIN_REQUIRE(wire != Dtype::fp32, "all_gather_matmul_to_16bit on ", comm.description(),
                    ": a 16-bit C needs a 16-bit wire dtype (the format of its bits)");
  MESHTRAIN_REQUIRE(c.span_is_contiguous(), "all_gather_matmul_to_16bit on ", comm.description(),
                    ": C must be contiguous");
  // The fp32 plan's checks on C's extents, with a C of no data.
  GatherPlan plan = plan_gather("all_gather_matmul_to_16bit", comm, side, gather_dim, a, b,
                                MatrixView(nullptr, c.extent(0), c.extent(1)), wire);
  plan.c16 = c;
  MESHTRAIN_REQUIRE(
      all_gather_matmul_writes_16bit(side, gather_dim, plan.gathered.transpose, algorithm),
      "all_gather_matmul_to_16bit on ", comm.description(), ": algorithm ", to_string(algorithm),
      " would accumulate blocks of C or write row-strided blocks of it (see "
      "all_gather_matmul_writes_16bit)");
  const auto run = [&](const auto* mine) {
    if (algorithm == CollectiveMatmulAlgorithm::ring) {
      gather_ring(plan, mine, comm, workspace);
    } else if (gather_dim == 1 && !plan.gathered.transpose) {
      gather_unpacked_naive(plan, mine, comm, workspace);
    } else {
      gather_naive(plan, mine, comm, workspace);
    }
  };
  if (plan.gathered.sixteen_bit) {
    run(plan.gathered.half.data());
  } else {
    run(plan.gathered.matrix.data());
  }
  fence_all(MESHTRAIN_LABEL("meshtrain::all_gather_matmul_to_16bit"));
}

// ----------------------------------------------------------- matmul reduce-scatter

namespace {

struct ScatterPlan {
  Dtype wire = Dtype::fp32;  // what the partial sums travel (and are summed) as
  int scatter_dim = 0;
  int n = 1;
  int i = 0;
  GemmOperand a, b;
  std::size_t m = 0, cols = 0;                 // the full product is [m, cols]
  std::size_t block_rows = 0, block_cols = 0;  // C's extents

  // op(A)[rows] @ op(B)[:, cols] of block t's stored rows [sub0, sub0+rows) into `out`.
  void compute(int t, std::size_t sub0, std::size_t rows, float* out) const {
    if (rows == 0 || block_cols == 0) return;
    const std::size_t tt = static_cast<std::size_t>(t);
    Range r{sub0, sub0 + rows}, col_range{0, cols};
    if (scatter_dim == 0) {
      r = Range{tt * block_rows + sub0, tt * block_rows + sub0 + rows};
    } else {
      col_range = Range{tt * block_cols, (tt + 1) * block_cols};
    }
    gemm(op_row_block(a, r), op_col_block(b, col_range), 0.0f, MatrixView(out, rows, block_cols),
         wire);
  }

  // What the cost model needs to choose an algorithm (the GEMMs of scatter_naive,
  // compute() for a whole block, and for half of one).
  CollectiveMatmulShape shape() const {
    const auto k = static_cast<int64_t>(op_cols(a));
    auto rows_of = [&](std::size_t rows) {
      return GemmShape{static_cast<int64_t>(rows), k, static_cast<int64_t>(block_cols), a.transpose,
                       b.transpose};
    };
    CollectiveMatmulShape s;
    s.kind = CollectiveMatmulKind::reduce_scatter;
    s.ranks = n;
    s.block_bytes = static_cast<double>(block_rows * block_cols * bytes_of(wire));
    s.naive = scatter_dim == 0 ? GemmShape{static_cast<int64_t>(m), k, static_cast<int64_t>(cols),
                                           a.transpose, b.transpose}
                               : rows_of(block_rows);
    s.naive_calls = scatter_dim == 0 ? 1 : n;
    s.block = rows_of(block_rows);
    s.half = rows_of(block_rows - block_rows / 2);
    return s;
  }
};

ScatterPlan plan_scatter(Communicator& comm, int scatter_dim, GemmOperand a, GemmOperand b,
                         MatrixView c, Dtype wire) {
  const char* op = "matmul_reduce_scatter";
  if (scatter_dim != 0 && scatter_dim != 1) {
    MESHTRAIN_BAD_INPUT(op, ": scatter_dim must be 0 or 1, got ", scatter_dim);
  }
  ScatterPlan plan;
  plan.wire = wire;
  plan.scatter_dim = scatter_dim;
  plan.n = comm.size();
  plan.i = comm.rank();
  plan.a = a;
  plan.b = b;
  plan.m = op_rows(a);
  plan.cols = op_cols(b);
  if (op_cols(a) != op_rows(b)) {
    MESHTRAIN_BAD_INPUT(op, " on ", comm.description(), ": K = ", op_cols(a), " of the lhs ",
                        "does not match K = ", op_rows(b), " of the rhs");
  }
  const std::size_t n = static_cast<std::size_t>(plan.n);
  const std::size_t scattered = scatter_dim == 0 ? plan.m : plan.cols;
  if (scattered % n != 0) {
    MESHTRAIN_BAD_INPUT(op, " on ", comm.description(), ": the scattered dimension ", scatter_dim,
                        " (", scatter_dim == 0 ? "M" : "N", " = ", scattered,
                        ") is not divisible by the ", n, " ranks");
  }
  plan.block_rows = scatter_dim == 0 ? plan.m / n : plan.m;
  plan.block_cols = scatter_dim == 1 ? plan.cols / n : plan.cols;
  if (c.extent(0) != plan.block_rows || c.extent(1) != plan.block_cols) {
    MESHTRAIN_BAD_INPUT(op, " on ", comm.description(), ": the output is [", c.extent(0), ", ",
                        c.extent(1), "], expected [", plan.block_rows, ", ", plan.block_cols,
                        "] (the product [", plan.m, ", ", plan.cols, "] scattered along dim ",
                        scatter_dim, " over ", n, " ranks)");
  }
  return plan;
}

void scatter_naive(const ScatterPlan& plan, Communicator& comm, MatrixView c,
                   CollectiveMatmulWorkspace& ws) {
  const std::size_t block = plan.block_rows * plan.block_cols;
  const std::size_t n = static_cast<std::size_t>(plan.n);
  const bool c_contiguous = c.span_is_contiguous();
  float* product = ws.acquire((n + (c_contiguous ? 0 : 1)) * block);
  if (plan.scatter_dim == 0) {
    gemm(plan.a, plan.b, 0.0f, MatrixView(product, plan.m, plan.cols), plan.wire);
  } else {  // the product as n stacked column blocks: block t at product + t * block
    for (int t = 0; t < plan.n; ++t) plan.compute(t, 0, plan.block_rows, product + t * block);
  }
  float* result = c_contiguous ? c.data() : product + n * block;
  comm.reduce_scatter(ConstVectorView(product, n * block), VectorView(result, block), plan.wire);
  if (!c_contiguous) {
    copy_into(c, ConstMatrixView(result, plan.block_rows, plan.block_cols));
  }
}

// One travelling stream of partial sums (a whole block for ring, a half for bidirectional):
// rows [sub0, sub0+rows) of each block, moving by `offset` each step, starting at block
// first_block and visiting first_block + step * direction... and ending at this rank.
struct PartialStream {
  std::size_t sub0 = 0, rows = 0, floats = 0;
  int offset = 0;                 // +1 or -1
  std::array<float*, 3> buffers;  // rotation: step s computes into buffers[s % 3]
  Request moving;
  float* acc = nullptr;

  // Block whose partial sum this rank adds at step s. What rank i holds at step s reaches
  // rank i + offset at step s + 1 and must end, at step n-1, on its own block's rank:
  // block (i + offset * (n - 1 - s)) mod n (offset -1: i + s + 1, as in the notebook).
  int block_at(int s, int i, int n) const {
    const int t = (i + offset * (n - 1 - s)) % n;
    return t < 0 ? t + n : t;
  }
};

void scatter_streams(const ScatterPlan& plan, Communicator& comm, MatrixView c,
                     CollectiveMatmulWorkspace& ws, PartialStream* streams, int count) {
  const int n = plan.n;
  const bool c_contiguous = c.span_is_contiguous();
  std::size_t need = 0;
  for (int k = 0; k < count; ++k) need += streams[k].floats * (c_contiguous ? 2 : 3);
  // (3 per stream when C is not contiguous: two rotating buffers and its share of C's copy)
  float* free_memory = ws.acquire(need);
  // The streams' final buffers are consecutive rows of C (or of a staging block).
  float* c_data = c.data();
  if (!c_contiguous) {
    c_data = free_memory;
    free_memory += plan.block_rows * plan.block_cols;
  }
  std::size_t c_offset = 0;
  for (int k = 0; k < count; ++k) {
    PartialStream& st = streams[k];
    // The last step computes into buffers[(n-1) % 3]: make that C's rows of this stream.
    float* final_buffer = c_data + c_offset;
    c_offset += st.floats;
    int w = 0;
    for (int slot = 0; slot < 3; ++slot) {
      if (slot == (n - 1) % 3) {
        st.buffers[static_cast<std::size_t>(slot)] = final_buffer;
      } else {
        st.buffers[static_cast<std::size_t>(slot)] = free_memory + w * st.floats;
        ++w;
      }
    }
    free_memory += 2 * st.floats;
  }
  for (int s = 0; s < n; ++s) {
    for (int k = 0; k < count; ++k) {  // start every stream's hop first (same order everywhere)
      PartialStream& st = streams[k];
      if (s == 0) continue;
      float* incoming = st.buffers[static_cast<std::size_t>((s + 1) % 3)];
      st.moving = comm.shift(ConstVectorView(st.acc, st.floats), VectorView(incoming, st.floats),
                             st.offset, plan.wire);
    }
    for (int k = 0; k < count; ++k) {  // overlap: this rank's contribution to the next block
      PartialStream& st = streams[k];
      plan.compute(st.block_at(s, plan.i, n), st.sub0, st.rows,
                   st.buffers[static_cast<std::size_t>(s % 3)]);
    }
    for (int k = 0; k < count; ++k) {
      PartialStream& st = streams[k];
      float* mine = st.buffers[static_cast<std::size_t>(s % 3)];
      if (s > 0) {
        st.moving.wait();
        add_into(mine, st.buffers[static_cast<std::size_t>((s + 1) % 3)], st.floats);
      }
      st.acc = mine;
    }
  }
  if (!c_contiguous) {
    fence_all(MESHTRAIN_LABEL("meshtrain::scatter_streams"));
    copy_into(c, ConstMatrixView(c_data, plan.block_rows, plan.block_cols));
  }
}

}  // namespace

CollectiveMatmulShape matmul_reduce_scatter_shape(Communicator& comm, int scatter_dim,
                                                  GemmOperand a, GemmOperand b, MatrixView c,
                                                  Dtype wire) {
  return plan_scatter(comm, scatter_dim, a, b, c, wire).shape();
}

void matmul_reduce_scatter(Communicator& comm, int scatter_dim, GemmOperand a, GemmOperand b,
                           MatrixView c, CollectiveMatmulAlgorithm algorithm,
                           CollectiveMatmulWorkspace& workspace, Dtype wire) {
  const ScatterPlan plan = plan_scatter(comm, scatter_dim, a, b, c, wire);
  const std::size_t block = plan.block_rows * plan.block_cols;
  const auto chosen = resolve_collective_matmul_algorithm(algorithm, plan.shape());
  if (chosen == CollectiveMatmulAlgorithm::ring) {
    PartialStream stream;
    stream.sub0 = 0;
    stream.rows = plan.block_rows;
    stream.floats = block;
    stream.offset = -1;  // partial sums move to rank i-1, as in the notebook
    scatter_streams(plan, comm, c, workspace, &stream, 1);
  } else if (chosen == CollectiveMatmulAlgorithm::bidirectional) {
    PartialStream streams[2];
    const std::size_t lo_rows = plan.block_rows / 2;
    streams[0].sub0 = 0;
    streams[0].rows = lo_rows;
    streams[0].floats = lo_rows * plan.block_cols;
    streams[0].offset = +1;
    streams[1].sub0 = lo_rows;
    streams[1].rows = plan.block_rows - lo_rows;
    streams[1].floats = streams[1].rows * plan.block_cols;
    streams[1].offset = -1;
    scatter_streams(plan, comm, c, workspace, streams, 2);
  } else {
    scatter_naive(plan, comm, c, workspace);
  }
  fence_all(MESHTRAIN_LABEL("meshtrain::matmul_reduce_scatter"));
}

}  // namespace meshtrain
