#pragma once
// A trained model as a function: inputs in, outputs in the user's units out. What
// `meshtrain predict` runs, and what a simulation code calls inside its own time loop.
//
//   meshtrain::Runtime runtime(argc, argv);                  // MPI + Kokkos
//   meshtrain::Predictor predictor("runs/a/checkpoints", 256); // collective over the world
//   Kokkos::View<float**> x("x", my_rows, predictor.inputs());  // host or device memory
//   Kokkos::View<float**> y("y", my_rows, predictor.outputs());
//   each time step:  fill x;  predictor.predict(x, y);        // collective; allocates nothing
//
// Construction (collective over `comm`): the checkpoint (a file, a `latest` or `best` pointer
// file, or a checkpoint directory meaning its latest) names the model: its config text is
// parsed again (parse_config) with `overrides` ("section.key=value", as --set), which may
// change only what leaves the model as it is (mesh.*, partition.*, runtime.*,
// mixed_precision.*, and data.batch_size, eval_batch_size, x_key, y_key, path, test_path,
// prefetch); another key is bad_input naming it. The model is built on the mesh (below) and
// its parameters are read from the checkpoint, resharded onto it (no optimizer state is
// read). It computes in fp32 (matmul precision fp32) whatever the checkpoint was trained in,
// unless mixed_precision.* or runtime.matmul_precision are overridden. The normalization
// statistics stored with the model (framework/io/normalization.hpp) are applied: inputs are
// standardized before the first layer and outputs returned to the targets' units after the
// last.
//
// The mesh: the checkpoint config's [mesh] (after mesh.* overrides) when it fits the world
// (its -1 axis taking the rest, as `train` does); when it does not fit and no mesh.* key is
// overridden, dp = world: every rank holds the whole model and computes its own rows (what a
// simulation code with one rank per subdomain wants). A mesh.* override that does not fit is
// bad_input.
//
// Rows: every call maps one global batch of batch_size rows (0: the config's
// data.eval_batch_size, else data.batch_size, rounded up to a multiple of the ranks that
// split rows), split over the batch axes exactly as a training batch is (BatchSlice): each
// rank passes ITS OWN rows, at most local_rows() of them, and gets the outputs of those rows.
// Ranks that differ only on the feature axis (tensor parallelism, tp > 1) hold the same slice
// and must pass the same rows. A rank may pass fewer rows than local_rows() (even 0); the rest
// is padding, computed and ignored (the model treats each row alone: an MoE layer is
// dropless). predict() is collective: every rank calls it the same number of times.
//
// Errors: construction errors are agreed over the ranks and thrown as AgreedError, the same
// on every rank (bad checkpoint, override, mesh, batch size). predict() throws bad_input for an
// input of the wrong width or too many rows, on the rank that passed it; call it with valid
// shapes (or agree first) since the other ranks are then in the collective.

#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "base/error.hpp"
#include "framework/comm/failure_agreement.hpp"  // AgreedError
#include "framework/comm/mesh_communicators.hpp"
#include "framework/core/exec_space.hpp"
#include "framework/core/kernel_label.hpp"
#include "framework/core/views.hpp"
#include "framework/io/data.hpp"  // BatchSlice
#include "framework/io/normalization.hpp"
#include "framework/train/config.hpp"
#include "layers/context.hpp"
#include "layers/mlp.hpp"
#include "layers/whole_output_rows.hpp"
#include "partition/planner.hpp"

namespace meshtrain {

using ClassView = Kokkos::View<int64_t*, Kokkos::LayoutRight>;
using ConstClassView =
    Kokkos::View<const int64_t*, Kokkos::LayoutRight, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;

// The result of one predict() call on this rank, in the default memory space (device memory in
// a CUDA build), valid until the next call: rows [0, rows) of this rank.
struct Prediction {
  int64_t rows = 0;
  ConstMatrixView outputs;        // [rows, outputs()]: regression outputs in the targets' units, or
                                  // the logits of a classifier
  ConstClassView classes;         // [rows] argmax class (lowest index on ties); classification only
  ConstMatrixView probabilities;  // [rows, outputs()] softmax of the logits; classification only
};

// The keys an override may set in Predictor (and `meshtrain predict --set`): those that do not
// change the model. Throws bad_input naming the key of the first other one.
void check_prediction_overrides(const std::vector<std::string>& overrides);

class Predictor {
 public:
  // Collective over `comm` (a Runtime must exist). See the top of this file.
  Predictor(const std::string& checkpoint, int64_t batch_size = 0,
            const std::vector<std::string>& overrides = {}, MPI_Comm comm = MPI_COMM_WORLD);
  ~Predictor();
  Predictor(const Predictor&) = delete;
  Predictor& operator=(const Predictor&) = delete;

  // Maps this rank's rows x [rows <= local_rows(), inputs()] (any 2-D Kokkos view of a numeric
  // type, any layout, in host memory or in memory the default execution space reaches) to
  // their outputs. Collective; allocates nothing.
  template <class InputView>
  Prediction predict(const InputView& x);
  // The same, writing the outputs (user units; logits for a classifier) into
  // y [>= rows, outputs()] (host or default memory, any numeric type and layout). Returns rows.
  template <class InputView, class OutputView>
  int64_t predict(const InputView& x, const OutputView& y);

  int64_t inputs() const { return config_.model.input_width(); }
  int64_t outputs() const { return config_.model.output_width(); }
  bool classification() const { return classification_; }
  int64_t batch_size() const { return slice_.global_batch; }  // global rows per call
  int64_t local_rows() const { return slice_.rows; }          // this rank's rows per call
  // Which rows of a global batch this rank holds: [slice().begin(), + local_rows()).
  const BatchSlice& slice() const { return slice_; }
  const RunConfig& config() const { return config_; }  // the checkpoint's, overrides applied
  const Mesh& mesh() const { return *mesh_; }
  const ShardingPlan& plan() const { return *plan_; }
  const std::string& checkpoint_path() const { return path_; }  // the file read
  int64_t step() const { return step_; }                        // the checkpoint's step
  const Normalization& normalization() const { return normalization_; }
  // The model's one-line summary, the one an ONNX export of the checkpoint names it by
  // (framework/train/model_summary.hpp): "mlp 784-512-512-10 gelu, loss cross_entropy".
  std::string model_description() const;
  // Why this mesh: "" when the checkpoint config's mesh fit the world, else a sentence.
  const std::string& mesh_note() const { return mesh_note_; }
  // Lines describing the predictor: checkpoint, model, mesh, batch, normalization.
  std::vector<std::string> describe() const;

 private:
  using HostMatrix = Matrix::HostMirror;
  void check_input(int64_t rows, int64_t width) const;
  // x_ rows [0, rows) hold the input: pads, normalizes, forwards, gathers, de-normalizes.
  Prediction run(int64_t rows);
  // Rows [0, rows) of x_host_ to x_ (a no-op where host and default memory are one).
  void upload_input();
  // output_ to output_host_ (a no-op where host and default memory are one).
  void download_output();

  std::string path_;
  int64_t step_ = 0;
  RunConfig config_;
  bool classification_ = false;
  std::string mesh_note_;
  Normalization normalization_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  std::optional<Mesh> mesh_;
  std::optional<ShardingPlan> plan_;
  BatchSlice slice_;

  // Declared in dependency order: destroyed in reverse, the communicators last.
  std::unique_ptr<MeshCommunicators> comms_;
  std::optional<ParallelContext> context_;
  std::unique_ptr<Mlp> model_;
  std::unique_ptr<WholeOutputRows> whole_rows_;

  Matrix x_;           // [local_rows, inputs]: the model's input
  HostMatrix x_host_;  // its host copy (x_ itself where memory is shared)
  Matrix output_;      // [local_rows, outputs]: user units / logits
  HostMatrix output_host_;
  ClassView classes_;     // [local_rows] (classification)
  Matrix probabilities_;  // [local_rows, outputs] (classification)
  Kokkos::View<double*, Kokkos::LayoutRight> input_mean_, input_std_;    // empty: none
  Kokkos::View<double*, Kokkos::LayoutRight> target_mean_, target_std_;  // empty: none
};

// --- the templates ------------------------------------------------------------------------

namespace predictor_detail {

// The copy kernels' label, made once by the Predictor's constructor (a label made at a
// template's first call would be a heap allocation inside a predict() call).
const std::string& copy_rows_label();

// dst(i, j) = src(i, j) for i < rows, j < cols, on `Space` (which reaches both views).
template <class Space, class Dst, class Src>
void copy_rows(const Dst& dst, const Src& src, int64_t rows, int64_t cols) {
  if (rows == 0 || cols == 0) return;
  using Value = typename Dst::non_const_value_type;
  Kokkos::parallel_for(
      copy_rows_label(),
      Kokkos::MDRangePolicy<Space, Kokkos::Rank<2>>(space_instance<Space>(), {0, 0}, {rows, cols}),
      KOKKOS_LAMBDA(const int64_t i, const int64_t j) {
        dst(i, j) = static_cast<Value>(src(i, j));
      });
  fence_space(space_instance<Space>(), copy_rows_label());
}

// Whether the default execution space reaches a view's memory (else it must be the host's).
template <class View>
constexpr bool on_device() {
  return Kokkos::SpaceAccessibility<Kokkos::DefaultExecutionSpace,
                                    typename View::memory_space>::accessible;
}

template <class View>
constexpr void check_view_type() {
  static_assert(View::rank == 2, "Predictor: inputs and outputs are 2-D views [rows, columns]");
  static_assert(std::is_arithmetic<typename View::non_const_value_type>::value,
                "Predictor: views must hold numbers");
  static_assert(
      on_device<View>() || Kokkos::SpaceAccessibility<Kokkos::DefaultHostExecutionSpace,
                                                      typename View::memory_space>::accessible,
      "Predictor: views must be in host memory or in the default memory space");
}

}  // namespace predictor_detail

template <class InputView>
Prediction Predictor::predict(const InputView& x) {
  predictor_detail::check_view_type<InputView>();
  const auto rows = static_cast<int64_t>(x.extent(0));
  check_input(rows, static_cast<int64_t>(x.extent(1)));
  const int64_t cols = inputs();
  if constexpr (predictor_detail::on_device<InputView>()) {
    predictor_detail::copy_rows<Kokkos::DefaultExecutionSpace>(MatrixView(x_), x, rows, cols);
  } else {
    predictor_detail::copy_rows<Kokkos::DefaultHostExecutionSpace>(x_host_, x, rows, cols);
    upload_input();
  }
  return run(rows);
}

template <class InputView, class OutputView>
int64_t Predictor::predict(const InputView& x, const OutputView& y) {
  predictor_detail::check_view_type<OutputView>();
  if (static_cast<int64_t>(y.extent(0)) < static_cast<int64_t>(x.extent(0)) ||
      static_cast<int64_t>(y.extent(1)) != outputs()) {
    MESHTRAIN_BAD_INPUT("Predictor::predict: the output view is [", y.extent(0), ", ", y.extent(1),
                        "] but ", x.extent(0), " rows of ", outputs(), " outputs are asked for");
  }
  const Prediction result = predict(x);
  if constexpr (predictor_detail::on_device<OutputView>()) {
    predictor_detail::copy_rows<Kokkos::DefaultExecutionSpace>(y, result.outputs, result.rows,
                                                               outputs());
  } else {
    download_output();
    predictor_detail::copy_rows<Kokkos::DefaultHostExecutionSpace>(y, output_host_, result.rows,
                                                                   outputs());
  }
  return result.rows;
}

}  // namespace meshtrain
