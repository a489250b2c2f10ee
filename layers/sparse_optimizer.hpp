#pragma once
// Sparse updates of embedding tables (issue 39 item 4; docs/recsys.md, "Sparse updates"): only
// the rows a step touched change, from the compact gradients an EmbeddingBag in sparse mode
// leaves after backward (EmbeddingBag::use_sparse_gradient: the touched local rows, each once,
// and their summed gradients, already reduced over every rank that holds the rows).
//
// RowwiseAdagrad is TorchRec's fused default, FBGEMM's EXACT_ROWWISE_ADAGRAD: one fp32
// accumulator per table row (zero at the start), and for every touched row r with gradient g:
//   state[r] += mean over the row of g^2;   W[r] -= lr * g / (sqrt(state[r]) + eps)
// (no weight decay). Slot "rowwise_adagrad": per table [rows]. A column-wise table (each rank a
// slice of dim) takes the mean over the whole row: the slices' sums of squares are all-gathered
// over the column axis and added in slice order (one float per touched row and slice), so every
// slice's rank holds the same accumulator; the sum's order differs from one rank's, so the
// accumulator matches it to rounding, not bit for bit.
//
// SparseAdamW is AdamW with lazy moments (as torch.optim.SparseAdam): a touched row r with
// gradient g, touched for the k-th time (k counted per row, from 1):
//   W[r] *= 1 - lr wd;  m[r] = b1 m[r] + (1 - b1) g;  v[r] = b2 v[r] + (1 - b2) g^2;
//   W[r] -= lr (m[r] / (1 - b1^k)) / (sqrt(v[r] / (1 - b2^k)) + eps)
// Untouched rows keep their weights and moments (dense AdamW would decay the moments and move
// the row by them). The bias correction counts the row's own steps, not the run's: the lazy
// moments hold exactly k decayed terms, so this is the correction that makes them unbiased
// (torch.optim.SparseAdam counts the parameter's steps instead); a row touched by every step
// gets dense AdamW's update, bit for bit. Slots "sparse_adamw_m", "sparse_adamw_v" ([rows, dim]
// per table) and "sparse_adamw_steps" ([rows], the count k as fp32: exact to 2^24 steps).
//
// The state of a table is named like the table (`embeddings/<t>/weight`) and sharded over its
// row axes (a [rows] state: the table's spec without its dim entry; the [rows, dim] moments: the
// table's spec, columns included), so the checkpoint saves it
// as /opt_state/<slot>/embeddings/<t>/weight and a load reshards it with the table. Everything
// is allocated at construction: step() allocates nothing.

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "framework/core/choices.hpp"  // EmbeddingOptimizer
#include "framework/core/sharded_tensor.hpp"
#include "layers/embedding_bag.hpp"
#include "partition/mesh.hpp"

namespace meshtrain {

struct SparseOptimizerSettings {
  float eps = 1e-8f;
  float beta1 = 0.9f, beta2 = 0.999f;  // sparse_adamw
  float weight_decay = 0.0f;           // sparse_adamw (decoupled)
};

// A state slot for the checkpoint: its name and one tensor per table.
struct SparseOptimizerSlot {
  std::string name;
  std::vector<ShardedTensor> tensors;
};

class SparseTableOptimizer {
 public:
  virtual ~SparseTableOptimizer() = default;
  // Updates the rows each table's last backward touched (the tables given at construction, in
  // the same order), at rate `lr`.
  virtual void step(const std::vector<EmbeddingBag>& tables, float lr) = 0;
  // The state (views of the live tensors: a checkpoint load writes into them).
  virtual std::vector<SparseOptimizerSlot> slots() const = 0;
};

class RowwiseAdagrad : public SparseTableOptimizer {
 public:
  static constexpr const char* kSlot = "rowwise_adagrad";

  // One accumulator per row of each table (each in sparse mode), on `mesh` for `rank`.
  RowwiseAdagrad(const std::vector<EmbeddingBag>& tables, float eps, const Mesh& mesh, int rank);

  void step(const std::vector<EmbeddingBag>& tables, float lr) override;
  std::vector<SparseOptimizerSlot> slots() const override { return {{kSlot, state_}}; }

  float eps() const { return eps_; }
  // Per table, [rows] (this rank's block of it).
  std::vector<ShardedTensor>& state() { return state_; }
  const std::vector<ShardedTensor>& state() const { return state_; }

 private:
  float eps_ = 1e-8f;
  std::vector<ShardedTensor> state_;
  // Per table, column-wise ones only (else empty): the touched rows' sums of squares over this
  // rank's columns [touch capacity] and every slice's, gathered [slices x touch capacity].
  std::vector<Kokkos::View<float*>> squares_, gathered_;
};

class SparseAdamW : public SparseTableOptimizer {
 public:
  SparseAdamW(const std::vector<EmbeddingBag>& tables, const SparseOptimizerSettings& settings,
              const Mesh& mesh, int rank);

  void step(const std::vector<EmbeddingBag>& tables, float lr) override;
  std::vector<SparseOptimizerSlot> slots() const override {
    return {{"sparse_adamw_m", m_}, {"sparse_adamw_v", v_}, {"sparse_adamw_steps", steps_}};
  }

  const std::vector<ShardedTensor>& m() const { return m_; }
  const std::vector<ShardedTensor>& v() const { return v_; }
  const std::vector<ShardedTensor>& steps() const { return steps_; }

 private:
  SparseOptimizerSettings settings_;
  std::vector<ShardedTensor> m_, v_, steps_;
};

// The optimizer of `kind` (not dense) over `tables` (each in sparse mode).
std::unique_ptr<SparseTableOptimizer> make_sparse_table_optimizer(
    EmbeddingOptimizer kind, const SparseOptimizerSettings& settings,
    const std::vector<EmbeddingBag>& tables, const Mesh& mesh, int rank);

}  // namespace meshtrain
