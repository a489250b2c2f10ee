#include "layers/sparse_optimizer.hpp"

#include <Kokkos_Core.hpp>
#include <cmath>
#include <utility>

#include "base/error.hpp"
#include "framework/core/exec_space.hpp"
#include "framework/core/kernel_label.hpp"
#include "framework/core/kokkos_math.hpp"
#include "framework/core/stochastic_rounding.hpp"
#include "framework/train/adamw_math.hpp"

namespace meshtrain {
// Named, not anonymous: template arguments of the kernels below (nvcc's extended lambdas).
namespace sparse_optimizer_detail {

// A table's local block as the update kernels read and write it: fp32 elements, or bf16 bits
// (a table stored as bf16: what value_to_store gives is a bf16 value, so its bits are exact).
struct Fp32Weights {
  MatrixView m;
  KOKKOS_INLINE_FUNCTION float operator()(int64_t r, int64_t c) const { return m(r, c); }
  KOKKOS_INLINE_FUNCTION void put(int64_t r, int64_t c, float value) const { m(r, c) = value; }
};
struct Bf16Weights {
  HalfMatrixView m;
  KOKKOS_INLINE_FUNCTION float operator()(int64_t r, int64_t c) const {
    return bf16_to_float(m(r, c));
  }
  KOKKOS_INLINE_FUNCTION void put(int64_t r, int64_t c, float value) const {
    m(r, c) = float_to_bf16(value);
  }
};

}  // namespace sparse_optimizer_detail

namespace {

using sparse_optimizer_detail::Bf16Weights;
using sparse_optimizer_detail::Fp32Weights;

// The kernels, as free functions: nvcc rejects a device lambda inside a private member.

// What an update writes into element (row, column) of the local block: `value`, or it
// stochastically rounded to bf16 (TableRounding).
KOKKOS_INLINE_FUNCTION float value_to_store(const TableRounding& r, float value, int64_t row,
                                            int64_t column) {
  if (!r.bf16) return value;
  return round_bf16_stochastic(
      value, stochastic_rounding_bits(r.seed, r.first_row + row, r.first_column + column, r.step));
}

// Calls kernel(weights) with the table's block as the kernels take it.
template <class Kernel>
void with_weights(const ShardedTensor& w, const Kernel& kernel) {
  if (w.stored_16bit()) {
    kernel(Bf16Weights{w.bits_matrix()});
  } else {
    kernel(Fp32Weights{w.matrix()});
  }
}

// One thread per touched row: its mean squared gradient (columns in order), the accumulator,
// then the row.
template <class Weights>
void rowwise_adagrad_rows(Kokkos::View<const int64_t*> rows, ConstMatrixView grads, Weights weight,
                          VectorView state, float lr, float eps, const TableRounding rounding) {
  const int64_t dim = static_cast<int64_t>(grads.extent(1));
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::rowwise_adagrad"),
      device_range(0, static_cast<int64_t>(rows.extent(0))), KOKKOS_LAMBDA(const int64_t r) {
        const int64_t row = rows(r);
        float squares = 0.0f;
        for (int64_t c = 0; c < dim; ++c) squares += grads(r, c) * grads(r, c);
        const float sum = state(row) + squares / static_cast<float>(dim);
        state(row) = sum;
        const float multiplier = lr / (kmath::sqrt(sum) + eps);
        for (int64_t c = 0; c < dim; ++c) {
          weight.put(row, c,
                     value_to_store(rounding, weight(row, c) - multiplier * grads(r, c), row, c));
        }
      });
}

// Column-wise tables: each touched row's sum of squares over this rank's columns (in order).
void rowwise_partial_squares(ConstMatrixView grads, VectorView squares) {
  const int64_t columns = static_cast<int64_t>(grads.extent(1));
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::rowwise_adagrad_squares"),
      device_range(0, static_cast<int64_t>(grads.extent(0))), KOKKOS_LAMBDA(const int64_t r) {
        float squares_here = 0.0f;
        for (int64_t c = 0; c < columns; ++c) squares_here += grads(r, c) * grads(r, c);
        squares(r) = squares_here;
      });
}

// Column-wise tables: as rowwise_adagrad_rows, the row's squares being the slices' partial sums
// (gathered [slices x touched], slice-major) added in slice order, so that every rank of the
// slices' group computes the same accumulator; the mean is over the whole row's `dim`.
template <class Weights>
void rowwise_adagrad_sliced_rows(Kokkos::View<const int64_t*> rows, ConstMatrixView grads,
                                 ConstVectorView gathered, int64_t slices, int64_t dim,
                                 Weights weight, VectorView state, float lr, float eps,
                                 const TableRounding rounding) {
  const int64_t touched = static_cast<int64_t>(rows.extent(0));
  const int64_t columns = static_cast<int64_t>(grads.extent(1));
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::rowwise_adagrad_sliced"), device_range(0, touched),
      KOKKOS_LAMBDA(const int64_t r) {
        const int64_t row = rows(r);
        float squares = 0.0f;
        for (int64_t k = 0; k < slices; ++k) squares += gathered(k * touched + r);
        const float sum = state(row) + squares / static_cast<float>(dim);
        state(row) = sum;
        const float multiplier = lr / (kmath::sqrt(sum) + eps);
        for (int64_t c = 0; c < columns; ++c) {
          weight.put(row, c,
                     value_to_store(rounding, weight(row, c) - multiplier * grads(r, c), row, c));
        }
      });
}

// One thread per touched row: its step count, then AdamW's update of its elements, written as
// Optimizer's adamw_update (framework/train/optimizer.cpp) so that a row touched by every step
// gets the same floats.
template <class Weights>
void sparse_adamw_rows(Kokkos::View<const int64_t*> rows, ConstMatrixView grads, Weights weight,
                       MatrixView m, MatrixView v, VectorView steps, float lr,
                       const SparseOptimizerSettings s, const TableRounding rounding) {
  const int64_t dim = static_cast<int64_t>(grads.extent(1));
  const float decay = 1.0f - lr * s.weight_decay;
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::sparse_adamw"),
      device_range(0, static_cast<int64_t>(rows.extent(0))), KOKKOS_LAMBDA(const int64_t r) {
        const int64_t row = rows(r);
        const float k = steps(row) + 1.0f;
        steps(row) = k;
        const double t = static_cast<double>(k);
        const float step_size = lr / adamw_bias_correction(s.beta1, t);
        const float inv_correction2 = 1.0f / adamw_bias_correction(s.beta2, t);
        for (int64_t c = 0; c < dim; ++c) {
          const float value =
              adamw_element(weight(row, c), grads(r, c), m(row, c), v(row, c), s.beta1, s.beta2,
                            decay, step_size, inv_correction2, s.eps);
          weight.put(row, c, value_to_store(rounding, value, row, c));
        }
      });
}

// bf16 tables at setup: every element of a table's local block to its nearest bf16.
void round_block_to_bf16(VectorView block) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::round_table_to_bf16"),
      device_range(0, static_cast<int64_t>(block.extent(0))),
      KOKKOS_LAMBDA(const int64_t i) { block(i) = bf16_to_float(float_to_bf16(block(i))); });
}

void require_sparse(const EmbeddingBag& table, const char* optimizer) {
  MESHTRAIN_REQUIRE(table.sparse_gradient(), "embedding table '", table.table(), "': ", optimizer,
                    " needs its sparse gradient (EmbeddingBag::use_sparse_gradient)");
}

// A tensor named and sharded like the table's rows: [rows] (per_row) or [rows, dim].
ShardedTensor like_table(const EmbeddingBag& table, bool per_row, const Mesh& mesh, int rank) {
  const ShardedTensor& w = table.weight();
  ShardedTensor t = per_row ? ShardedTensor::allocate(w.name, {w.global_shape[0]},
                                                      w.spec.with_rank(1), mesh, rank)
                            : ShardedTensor::allocate(w.name, w.global_shape, w.spec, mesh, rank);
  MESHTRAIN_REQUIRE(t.box.elements() == table.local_rows() * (per_row ? 1 : table.local_dim()),
                    "embedding table '", table.table(),
                    "': its optimizer state does not match its rows here");
  return t;
}

void require_same_tables(const std::vector<EmbeddingBag>& tables, size_t built) {
  MESHTRAIN_REQUIRE(tables.size() == built, "sparse table optimizer: ", tables.size(),
                    " tables, built for ", built);
}

}  // namespace

void SparseTableOptimizer::require_rounding_for(const std::vector<EmbeddingBag>& tables) const {
  for (const EmbeddingBag& table : tables) {
    MESHTRAIN_REQUIRE(bf16_ || !table.weight().stored_16bit(), "embedding table '", table.table(),
                      "' is stored as bf16, but its sparse optimizer writes fp32 values ",
                      "(keep_tables_in_bf16 was not called)");
  }
}

void SparseTableOptimizer::keep_tables_in_bf16(uint64_t seed,
                                               const std::vector<EmbeddingBag>& tables) {
  // A table stored as bf16 holds bf16 values already.
  for (const EmbeddingBag& table : tables) {
    if (!table.weight().stored_16bit()) round_block_to_bf16(table.weight().local);
  }
  bf16_ = true;
  seed_ = seed;
}

TableRounding SparseTableOptimizer::rounding(const EmbeddingBag& table, size_t t) const {
  TableRounding r;
  r.bf16 = bf16_;
  r.seed = table_rounding_seed(seed_, static_cast<uint64_t>(t));  // each table its own draws
  r.first_row = table.first_row();
  r.first_column = table.first_column();
  r.step = updates_;
  return r;
}

RowwiseAdagrad::RowwiseAdagrad(const std::vector<EmbeddingBag>& tables, float eps, const Mesh& mesh,
                               int rank)
    : eps_(eps) {
  for (const EmbeddingBag& table : tables) {
    require_sparse(table, "row-wise Adagrad");
    state_.push_back(like_table(table, /*per_row=*/true, mesh, rank));
    Kokkos::View<float*> squares, gathered;
    if (Communicator* slices = table.column_comm()) {
      const size_t capacity = static_cast<size_t>(table.touch_capacity());
      const size_t n = static_cast<size_t>(slices->size());
      squares = Kokkos::View<float*>(table.weight().name + "/rowwise_adagrad_squares", capacity);
      gathered =
          Kokkos::View<float*>(table.weight().name + "/rowwise_adagrad_gathered", capacity * n);
      slices->reserve_staging(capacity * sizeof(float), capacity * n * sizeof(float));
    }
    squares_.push_back(squares);
    gathered_.push_back(gathered);
  }
}

void RowwiseAdagrad::step(const std::vector<EmbeddingBag>& tables, float lr) {
  require_same_tables(tables, state_.size());
  require_rounding_for(tables);
  for (size_t t = 0; t < tables.size(); ++t) {
    const EmbeddingBag& table = tables[t];
    if (table.touched_count() == 0) continue;
    Communicator* slices = table.column_comm();
    if (!slices) {
      with_weights(table.weight(), [&](auto weights) {
        rowwise_adagrad_rows(table.touched_rows(), table.row_gradients(), weights, state_[t].local,
                             lr, eps_, rounding(table, t));
      });
      continue;
    }
    // Column-wise: the row's mean square needs every slice's columns. Every rank of the slices
    // touched the same rows (the same bags), so the partial sums line up row for row.
    const int64_t touched = table.touched_count();
    const std::pair<int64_t, int64_t> mine(0, touched), all(0, touched * slices->size());
    const VectorView squares = Kokkos::subview(squares_[t], mine);
    const VectorView gathered = Kokkos::subview(gathered_[t], all);
    rowwise_partial_squares(table.row_gradients(), squares);
    slices->all_gather(squares, gathered);
    with_weights(table.weight(), [&](auto weights) {
      rowwise_adagrad_sliced_rows(table.touched_rows(), table.row_gradients(), gathered,
                                  slices->size(), table.dim(), weights, state_[t].local, lr, eps_,
                                  rounding(table, t));
    });
  }
  ++updates_;
}

SparseAdamW::SparseAdamW(const std::vector<EmbeddingBag>& tables,
                         const SparseOptimizerSettings& settings, const Mesh& mesh, int rank)
    : settings_(settings) {
  for (const EmbeddingBag& table : tables) {
    require_sparse(table, "sparse AdamW");
    m_.push_back(like_table(table, /*per_row=*/false, mesh, rank));
    v_.push_back(like_table(table, /*per_row=*/false, mesh, rank));
    steps_.push_back(like_table(table, /*per_row=*/true, mesh, rank));
  }
}

void SparseAdamW::step(const std::vector<EmbeddingBag>& tables, float lr) {
  require_same_tables(tables, m_.size());
  require_rounding_for(tables);
  for (size_t t = 0; t < tables.size(); ++t) {
    const EmbeddingBag& table = tables[t];
    if (table.touched_count() == 0) continue;
    with_weights(table.weight(), [&](auto weights) {
      sparse_adamw_rows(table.touched_rows(), table.row_gradients(), weights, m_[t].matrix(),
                        v_[t].matrix(), steps_[t].local, lr, settings_, rounding(table, t));
    });
  }
  ++updates_;
}

std::unique_ptr<SparseTableOptimizer> make_sparse_table_optimizer(
    EmbeddingOptimizer kind, const SparseOptimizerSettings& settings,
    const std::vector<EmbeddingBag>& tables, const Mesh& mesh, int rank) {
  std::unique_ptr<SparseTableOptimizer> optimizer;
  switch (kind) {
    case EmbeddingOptimizer::rowwise_adagrad:
      optimizer = std::make_unique<RowwiseAdagrad>(tables, settings.eps, mesh, rank);
      break;
    case EmbeddingOptimizer::sparse_adamw:
      optimizer = std::make_unique<SparseAdamW>(tables, settings, mesh, rank);
      break;
    case EmbeddingOptimizer::dense:
      break;
  }
  if (optimizer) {
    if (settings.bf16_tables) optimizer->keep_tables_in_bf16(settings.rounding_seed, tables);
    return optimizer;
  }
  MESHTRAIN_REQUIRE(false, "make_sparse_table_optimizer: the dense kind has no sparse optimizer");
  return nullptr;
}

}  // namespace meshtrain
