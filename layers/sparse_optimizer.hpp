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
//
// bf16 tables (docs/recsys.md, "bf16 tables"; keep_tables_in_bf16; model.table_dtype = "bf16"
// through DlrmRun). A table is either stored as bf16 (ShardedTensor::storage, 2 bytes an
// element: what DlrmRun builds) or held in fp32 (tests), whose blocks are first rounded to the
// nearest bf16. Then every element an update writes is stochastically rounded to bf16
// (framework/core/stochastic_rounding.hpp) with the draw of (table_rounding_seed(seed, table's
// index), its global row, its global column, the update's index), so the table holds bf16
// values and the draw is the same on every mesh (the fp32 value it rounds may differ where a
// gradient's sum changes order with the layout); the update is computed in fp32 from the bf16
// value, the state stays fp32 and there is no fp32 copy of the table (TorchRec's fused
// optimizers with bf16 weights: the memory of a table is what bf16 is for, and an fp32 master
// would take 4 bytes an element more than the table it replaces). Stochastic rather than
// nearest: an update under half a bf16 step (2^-9 of the value) would be lost every time by
// nearest rounding, and a table row is updated only when its ids come, so such small steps are
// common; stochastic rounding keeps them in expectation. A table stored as bf16 without
// keep_tables_in_bf16 is refused at step() (the optimizer would write fp32 values).

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
  // bf16 tables (above): make_sparse_table_optimizer calls keep_tables_in_bf16(rounding_seed,
  // tables). DlrmRun sets it for model.table_dtype = "bf16" (the seed: run.seed).
  bool bf16_tables = false;
  uint64_t rounding_seed = 0;
};

// How an update writes a table's elements (device-copyable): as computed, or stochastically
// rounded to bf16 with the draw of (seed, first_row + local row, first_column + local column,
// step).
struct TableRounding {
  bool bf16 = false;
  uint64_t seed = 0;
  int64_t first_row = 0, first_column = 0, step = 0;
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

  // Rounds each of `tables`' local blocks held in fp32 to the nearest bf16 (one labelled kernel
  // per table; a table stored as bf16 holds bf16 values already), and from now on every element an
  // update writes is stochastically rounded to bf16 (above). Table t's draws are keyed by
  // table_rounding_seed(seed, t).
  void keep_tables_in_bf16(uint64_t seed, const std::vector<EmbeddingBag>& tables);
  bool bf16_tables() const { return bf16_; }
  // The updates made so far: the draw's step index of the next one (step() adds 1). DlrmRun's
  // resume sets it to the steps the checkpoint had done (one update per step), so that a
  // resumed run draws as the uninterrupted one; the checkpoint does not store it.
  int64_t updates() const { return updates_; }
  void set_updates(int64_t updates) { updates_ = updates; }

 protected:
  // A table stored as bf16 needs bf16 rounding (keep_tables_in_bf16) before a step.
  void require_rounding_for(const std::vector<EmbeddingBag>& tables) const;
  // How step() writes table t (of `table`'s block) in the current update.
  TableRounding rounding(const EmbeddingBag& table, size_t t) const;
  bool bf16_ = false;
  uint64_t seed_ = 0;
  int64_t updates_ = 0;
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
