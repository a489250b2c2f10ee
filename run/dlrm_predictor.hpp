#pragma once
// A DLRM checkpoint (`[model] kind = "dlrm"`, docs/recsys.md) as a function, for a program's own
// loop: dense features and bags of ids in, click probabilities and logits out, on one rank.
// Predictor's sibling (run/predictor.hpp), as DlrmRun is TrainingRun's: Predictor is written
// around an Mlp's one input matrix (normalization, classes, Jacobians, tp output gathering), a
// DLRM takes bags of ids beside its dense rows.
//
//   meshtrain::Runtime runtime(argc, argv);                   // MPI + Kokkos
//   meshtrain::DlrmPredictor clicks("runs/dlrm/checkpoints", 256, 1024);  // rows, ids per table
//   Kokkos::View<float**, Kokkos::HostSpace> dense("dense", 256, clicks.dense_features());
//   std::vector<meshtrain::DlrmBags> bags(clicks.tables().size());         // made once
//   each call:  fill dense rows [0, rows) and per table t offsets[t] [rows + 1], ids[t];
//               bags[t] = {HostIds(offsets[t].data(), rows + 1), HostIds(ids[t].data(), n_t)};
//               p = clicks.predict(Kokkos::subview(dense, std::make_pair(0, rows), ALL), bags);
//
// One rank: the model is built on this process alone (MPI_COMM_SELF), every table whole on it,
// whatever mesh trained it: the checkpoint config's mesh axes are kept (its partition rules may
// name them) at size 1, and the parameters are read from the checkpoint resharded onto it (a
// checkpoint written by any number of ranks, tables row-, column- or table-wise). Several ranks
// of a program may each hold their own. Planned once: the plan, the model and every buffer are
// made at construction, for batch_size rows and max_ids ids per table and call, then one call on
// empty input sets up whatever a layer makes at its first use; predict() allocates nothing of
// meshtrain's (oneDNN's matmul, where the build uses it, allocates a few small blocks inside each
// execution, as for Predictor).
//
// predict(dense, bags): dense [rows <= batch_size(), dense_features()] (any 2-D Kokkos view of
// a numeric type, any layout, host memory or memory the default execution space reaches); bags:
// one DlrmBags per table in the config's order (tables()), each in host memory: offsets
// [>= rows + 1], starting at 0 and non-decreasing, bag r being ids[offsets[r], offsets[r + 1]); a
// bag may be empty (its pooled row is 0 with either pooling) and may repeat an id. Returns the
// logits and probabilities (sigmoid evaluated in float64 and rounded once, as `meshtrain
// predict` writes /prediction) of rows [0, rows), views valid until the next call. fp32 (the
// model trains in fp32 only).
//
// Errors, all bad_input in one sentence, thrown by the call that meets them: the constructor's
// (a checkpoint that is not a DLRM's, naming its model.kind; an override that changes the model
// or sets mesh.* or mixed_precision.*;
// a negative batch_size or max_ids) and predict()'s (a dense view of the wrong width or too many
// rows; a bags list of the wrong length; offsets too short, not starting at 0 or decreasing;
// more ids in a table than max_ids(); an id outside its table, naming the table, the row and the
// id; ids[] shorter than offsets[rows]). predict() checks everything before it computes: a
// refused call leaves the predictor as it was.

#include <Kokkos_Core.hpp>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "framework/comm/mesh_communicators.hpp"
#include "framework/core/view_ops.hpp"  // copy_view
#include "framework/core/views.hpp"
#include "framework/train/config.hpp"
#include "layers/context.hpp"
#include "layers/dlrm.hpp"
#include "partition/planner.hpp"
#include "run/predictor.hpp"  // predictor_detail's copies, ConstMatrixView

namespace meshtrain {

using HostIds =
    Kokkos::View<const int64_t*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;

// One table's bags of a call, as CSR in host memory (see the top of this file).
struct DlrmBags {
  HostIds offsets;  // [>= rows + 1]
  HostIds ids;      // [>= offsets[rows]]
};

// The result of one DlrmPredictor::predict call, in the default memory space, valid until the
// next call: the call's rows [0, rows), as Prediction's (run/predictor.hpp).
struct DlrmPrediction {
  int64_t rows = 0;
  ConstMatrixView logits;         // [rows, 1]
  ConstMatrixView probabilities;  // [rows, 1]: sigmoid(logit)
};

class DlrmPredictor {
 public:
  // checkpoint: a file, a `latest`/`best` pointer file or a checkpoint directory (its latest).
  // batch_size: the most rows per call (0: the config's data.eval_batch_size, else
  // data.batch_size). max_ids: the most ids one table's bags hold in a call (0: batch_size, one
  // id per bag). overrides: "section.key=value" as Predictor's (those that leave the model as
  // it is; runtime.matmul_precision honoured as there, fp32 without it), but none of mesh.* or
  // mixed_precision.* (the mesh is this rank's, the model fp32: refused naming the key). A
  // Runtime must exist. Not collective.
  explicit DlrmPredictor(const std::string& checkpoint, int64_t batch_size = 0, int64_t max_ids = 0,
                         const std::vector<std::string>& overrides = {});
  ~DlrmPredictor();
  DlrmPredictor(const DlrmPredictor&) = delete;
  DlrmPredictor& operator=(const DlrmPredictor&) = delete;

  template <class DenseView>
  DlrmPrediction predict(const DenseView& dense, const std::vector<DlrmBags>& bags);
  // The same, writing the probabilities into y [>= rows, 1] (host or default memory, any numeric
  // type and layout). Returns rows.
  template <class DenseView, class OutputView>
  int64_t predict(const DenseView& dense, const std::vector<DlrmBags>& bags, const OutputView& y);

  int64_t dense_features() const { return shape_.bottom.front(); }
  const std::vector<DlrmTable>& tables() const { return shape_.tables; }
  int64_t batch_size() const { return batch_size_; }
  int64_t max_ids() const { return max_ids_; }
  const RunConfig& config() const { return config_; }  // the checkpoint's, overrides applied
  const ShardingPlan& plan() const { return *plan_; }
  const std::string& checkpoint_path() const { return path_; }  // the file read
  int64_t step() const { return step_; }                        // the checkpoint's step
  // "dlrm bottom 4-8-4, 3 tables, dot, top 10-8-1 relu" (framework/train/model_summary.hpp).
  std::string model_description() const;
  // Lines describing the predictor: checkpoint, model, batch, capacity, the layers.
  std::vector<std::string> describe() const;

 private:
  void check_input(int64_t rows, int64_t width, const std::vector<DlrmBags>& bags) const;
  // dense_ rows [0, rows) hold the input: the bags into the model's buffers, padding, forward,
  // probabilities.
  DlrmPrediction run(int64_t rows, const std::vector<DlrmBags>& bags);

  std::string path_;
  int64_t step_ = 0;
  RunConfig config_;
  DlrmShape shape_;
  int64_t batch_size_ = 0, max_ids_ = 0;
  std::optional<Mesh> mesh_;
  std::optional<ShardingPlan> plan_;

  // Declared in dependency order: destroyed in reverse, the communicators last.
  std::unique_ptr<MeshCommunicators> comms_;
  std::optional<ParallelContext> context_;
  std::unique_ptr<Dlrm> model_;

  Matrix dense_;                   // [batch_size, dense_features]
  Matrix::HostMirror dense_host_;  // its host copy (dense_ itself where memory is shared)
  Matrix probabilities_;           // [batch_size, 1]
  Matrix::HostMirror probabilities_host_;
  // Per table: the CSR in the model's memory and its host copies, and the bags viewing them.
  std::vector<Kokkos::View<int64_t*>> offsets_, ids_;
  std::vector<Kokkos::View<int64_t*>::HostMirror> offsets_host_, ids_host_;
  std::vector<SparseBags> model_bags_;
};

// --- implementation -------------------------------------------------------------------------

template <class DenseView>
DlrmPrediction DlrmPredictor::predict(const DenseView& dense, const std::vector<DlrmBags>& bags) {
  predictor_detail::check_view_type<DenseView>();
  const auto rows = static_cast<int64_t>(dense.extent(0));
  check_input(rows, static_cast<int64_t>(dense.extent(1)), bags);
  const int64_t cols = dense_features();
  if constexpr (predictor_detail::on_device<DenseView>()) {
    predictor_detail::copy_rows<Kokkos::DefaultExecutionSpace>(MatrixView(dense_), dense, rows,
                                                               cols);
  } else {
    predictor_detail::copy_rows<Kokkos::DefaultHostExecutionSpace>(dense_host_, dense, rows, cols);
    if (device_memory_is_separate()) {
      // Only the rows given: the padding rows are zeroed on the model's side.
      copy_view(Kokkos::subview(dense_, std::make_pair(int64_t{0}, rows), Kokkos::ALL),
                Kokkos::subview(dense_host_, std::make_pair(int64_t{0}, rows), Kokkos::ALL));
    }
  }
  return run(rows, bags);
}

template <class DenseView, class OutputView>
int64_t DlrmPredictor::predict(const DenseView& dense, const std::vector<DlrmBags>& bags,
                               const OutputView& y) {
  predictor_detail::check_view_type<OutputView>();
  if (static_cast<int64_t>(y.extent(0)) < static_cast<int64_t>(dense.extent(0)) ||
      y.extent(1) != 1) {
    MESHTRAIN_BAD_INPUT("DlrmPredictor::predict: the output view is [", y.extent(0), ", ",
                        y.extent(1), "] but ", dense.extent(0), " rows of 1 output are asked for");
  }
  const DlrmPrediction result = predict(dense, bags);
  if constexpr (predictor_detail::on_device<OutputView>()) {
    predictor_detail::copy_rows<Kokkos::DefaultExecutionSpace>(y, result.probabilities, result.rows,
                                                               1);
  } else {
    if (device_memory_is_separate()) copy_view(probabilities_host_, probabilities_);
    predictor_detail::copy_rows<Kokkos::DefaultHostExecutionSpace>(y, probabilities_host_,
                                                                   result.rows, 1);
  }
  return result.rows;
}

}  // namespace meshtrain
