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
// predict() runs the model's inference forward (Mlp::infer, layers/inference.hpp): per Linear
// layer one GEMM with its bias and activation fused (oneDNN's post-ops where the build has
// oneDNN, framework/core/gemm.hpp inference_gemm; else the bias in C before an OpenBLAS GEMM and
// one vectorized pass), a LayerNorm in one pass per row, a residual sum inside the block's last
// GEMM; its outputs equal forward()'s within rounding. "Allocates nothing": nothing of
// meshtrain's; oneDNN's matmul allocates a few small blocks inside each execution, which its API
// cannot avoid (MESHTRAIN_CPU_GEMM=openblas: none at all).
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
//
// Jacobians (docs/derivatives.md): jacobian(x, J) writes J(r, o, i) = d output_o / d input_i at
// each of this rank's rows, in the user's units (J = diag(target_std) J' diag(1 / input_std)
// with J' the model's own, normalized, derivative; a classifier's outputs are its logits), and
// returns the prediction of the same rows. Forward mode pushes tangents of the inputs through
// the layers, reverse mode cotangents of the outputs back through them; either stacks
// jacobian_directions() of them per row as extra rows of the same GEMMs and collective
// matmuls, so a pass of k directions costs about k forwards' GEMMs: forward mode needs the
// inputs' worth, reverse mode the outputs'. `automatic` takes forward mode when inputs() <=
// outputs() and reverse mode otherwise. The first call of each mode allocates its buffers and
// runs once on zeros (collective); later calls allocate nothing. fp32 only (bad_input under a
// mixed_precision override). Every rank must pass the same mode.

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

// How Predictor::jacobian differentiates (see the top of this file).
enum class JacobianMode {
  automatic,  // forward when inputs() <= outputs(), else reverse
  forward,    // tangents of the inputs pushed through the layers
  reverse,    // cotangents of the outputs pulled back through them
};
// "auto" | "forward" | "reverse"; parse: bad_input naming `what` and the choices otherwise.
const char* to_string(JacobianMode mode);
JacobianMode parse_jacobian_mode(const std::string& text, const std::string& what);

// At most this many floats in one stacked derivative matrix of the widest layer: a pass stacks
// k = min(inputs (forward) or outputs (reverse), max(1, kTangentElements / (local rows x widest
// layer))) directions; more directions take more passes.
constexpr int64_t kTangentElements = int64_t{1} << 24;

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

  // The Jacobian of this rank's rows x [rows <= local_rows(), inputs()] into J [>= rows,
  // outputs(), inputs()] (any 3-D Kokkos view of a numeric type, any layout, in host memory or
  // in memory the default execution space reaches); returns the prediction of the same rows,
  // as predict(x). Collective; allocates nothing after the first call of each mode.
  template <class InputView, class JacobianView>
  Prediction jacobian(const InputView& x, const JacobianView& J,
                      JacobianMode mode = JacobianMode::automatic);
  // What `automatic` resolves to for this model (other modes are returned as they are).
  JacobianMode jacobian_mode(JacobianMode mode = JacobianMode::automatic) const;
  // Directions per pass of `mode` (kTangentElements' rule, within the limit below).
  int64_t jacobian_directions(JacobianMode mode = JacobianMode::automatic) const;
  // Caps the directions per pass at k >= 1 (less memory, more passes). Only before the first
  // jacobian() (bad_input after); every rank must set the same.
  void limit_jacobian_directions(int64_t k);
  // Makes `mode`'s buffers and warms it up, as its first jacobian() call would (collective;
  // nothing when done before). Returns the mode resolved.
  JacobianMode prepare_jacobian(JacobianMode mode = JacobianMode::automatic);
  // Reverse mode's row blocks: each block of this many local rows takes its cotangents through
  // every layer before the next block (docs/derivatives.md, "Blocked reverse pass"), so that
  // they and the forward's values they read stay in cache. 0 (the default): rows chosen so that
  // a block's cotangents and values fit a quarter of the L2 (sysconf; 512 KiB where it says
  // nothing); rows >= local_rows(): one block. Only where
  // every layer takes blocks (Mlp::cotangents_by_rows: no tp, no gathered parameter, no MoE or
  // SwiGLU) on host kernels; elsewhere one block. Not collective; any time.
  void set_jacobian_row_block(int64_t rows);
  // The rows per block reverse mode uses (local_rows() when unblocked).
  int64_t jacobian_row_block() const;
  // The model, for the layers' own API (tests: Mlp::backward_cotangents's refusals). Calls on it
  // change what the Predictor's buffers hold: run jacobian() or predict() again after.
  Mlp& model() { return *model_; }

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

 protected:
  // A model whose parameters come later (LiveModel, run/live_model.hpp): built from a run's
  // config text, every rank holding the whole model (dp = the ranks of comm, each computing its
  // own rows), its normalization (when it has one) the identity until set; predict() and
  // jacobian() throw bad_input `not_ready` until the weights are set. Collective over comm.
  struct NoWeightsYet {
    std::string config_text;
    std::string source;     // what the model is, in messages (checkpoint_path())
    std::string not_ready;  // the sentence predict() throws until the weights are set
    bool input_stats = false, target_stats = false;
  };
  Predictor(const NoWeightsYet& model, int64_t batch_size, MPI_Comm comm);
  // The model's parameters (each whole on this rank when built from NoWeightsYet).
  std::vector<ShardedTensor>& parameters() { return model_->parameters(); }
  // Copies the statistics (each as long as this model's) where they apply; allocates nothing.
  void set_normalization(const double* input_mean, const double* input_std,
                         const double* target_mean, const double* target_std);
  void set_ready(int64_t step) {
    step_ = step;
    not_ready_.clear();
  }

 private:
  using HostMatrix = Matrix::HostMirror;
  // The model's config (parsed from config_text, `where` naming it in messages), the mesh, the
  // plan and the model on it (its parameters zero). Collective.
  void build(const std::string& config_text, const std::string& where,
             const std::vector<std::string>& overrides, int64_t batch_size,
             bool whole_model_on_every_rank);
  // The buffers, allocated once, and a pass on zeros.
  void finish_construction();
  void check_input(int64_t rows, int64_t width) const;
  // x_ rows [0, rows) hold the input: pads, normalizes, forwards, gathers, de-normalizes.
  // for_derivatives: the model's forward(), which keeps what the tangent and cotangent passes
  // need; otherwise its infer() (the inference kernels, layers/inference.hpp).
  Prediction run(int64_t rows, bool for_derivatives = false);
  // Rows [0, rows) of x_host_ to x_ (a no-op where host and default memory are one).
  void upload_input();
  // output_ to output_host_ (a no-op where host and default memory are one).
  void download_output();
  void check_jacobian_shape(int64_t rows, int64_t j0, int64_t j1, int64_t j2) const;
  // x_ rows [0, rows) hold the input: run(rows), then the derivative passes into jacobian_.
  Prediction run_jacobian(int64_t rows, JacobianMode mode);
  // jacobian_ to jacobian_host_ (a no-op where host and default memory are one).
  void download_jacobian();

  std::string path_;
  int64_t step_ = 0;
  std::string not_ready_;  // non-empty: predict() throws it (a LiveModel before its weights)
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

  // Jacobians, made by prepare_jacobian (both modes: the scales and the result; each mode its
  // seeds). The seeds carry the normalization: 1 / input_std per input direction (forward),
  // target_std per output (reverse).
  bool forward_ready_ = false, reverse_ready_ = false;
  int64_t directions_limit_ = 0;  // limit_jacobian_directions (0: none)
  int64_t row_block_ = 0;         // set_jacobian_row_block (0: automatic)
  Vector inverse_input_std_;      // [inputs] (1 without input statistics)
  Vector target_scale_;           // [outputs] target_std (1 without target statistics)
  Kokkos::View<float***, Kokkos::LayoutRight> jacobian_;  // [local_rows, outputs, inputs]
  Kokkos::View<float***, Kokkos::LayoutRight>::HostMirror jacobian_host_;
  Matrix tangent_seed_;   // [local_rows * k, inputs]
  Matrix tangent_whole_;  // [local_rows * k, outputs]: the output tangents' whole rows (tp)
  Communicator* output_columns_comm_ = nullptr;  // the feature axis' when the output is split
  Matrix cotangent_seed_;                        // [local_rows * k, the model's output columns]
};

// --- the templates ------------------------------------------------------------------------

namespace predictor_detail {

// Shared by Predictor and DlrmPredictor (run/dlrm_predictor.hpp), defined in predictor.cpp.
// x rows [first, end) = 0 (the padding of a partial call).
void zero_rows(const Matrix& x, int64_t first);
// Whether an override ("section.key=value") sets `key`.
bool overrides_key(const std::vector<std::string>& overrides, const char* key);
// The mesh of a model whole on every one of world_size ranks: every axis of `mesh` stays (the
// partition rules may name them) at size 1, but dp, which takes every rank (added when absent).
Mesh whole_model_mesh(MeshSection& mesh, int world_size);

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

// Whether the host or the default execution space reaches a view's memory.
template <class View>
constexpr bool reachable() {
  return on_device<View>() || Kokkos::SpaceAccessibility<Kokkos::DefaultHostExecutionSpace,
                                                         typename View::memory_space>::accessible;
}

template <class View>
constexpr void check_view_type() {
  static_assert(View::rank == 2, "Predictor: inputs and outputs are 2-D views [rows, columns]");
  static_assert(std::is_arithmetic<typename View::non_const_value_type>::value,
                "Predictor: views must hold numbers");
  static_assert(reachable<View>(),
                "Predictor: views must be in host memory or in the default memory space");
}

// J(i, o, c) = src(i, o, c) for i < rows, on `Space` (which reaches both views).
template <class Space, class Dst, class Src>
void copy_jacobian_rows(const Dst& dst, const Src& src, int64_t rows) {
  if (rows == 0 || src.extent(1) == 0 || src.extent(2) == 0) return;
  using Value = typename Dst::non_const_value_type;
  Kokkos::parallel_for(
      copy_rows_label(),
      Kokkos::MDRangePolicy<Space, Kokkos::Rank<3>>(
          space_instance<Space>(), {0, 0, 0},
          {rows, static_cast<int64_t>(src.extent(1)), static_cast<int64_t>(src.extent(2))}),
      KOKKOS_LAMBDA(const int64_t i, const int64_t o, const int64_t c) {
        dst(i, o, c) = static_cast<Value>(src(i, o, c));
      });
  fence_space(space_instance<Space>(), copy_rows_label());
}

template <class View>
constexpr void check_jacobian_view_type() {
  static_assert(View::rank == 3, "Predictor::jacobian: J is a 3-D view [rows, outputs, inputs]");
  static_assert(std::is_arithmetic<typename View::non_const_value_type>::value,
                "Predictor::jacobian: J must hold numbers");
  static_assert(reachable<View>(),
                "Predictor::jacobian: J must be in host memory or in the default memory space");
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

template <class InputView, class JacobianView>
Prediction Predictor::jacobian(const InputView& x, const JacobianView& J, JacobianMode mode) {
  predictor_detail::check_view_type<InputView>();
  predictor_detail::check_jacobian_view_type<JacobianView>();
  const auto rows = static_cast<int64_t>(x.extent(0));
  check_input(rows, static_cast<int64_t>(x.extent(1)));
  check_jacobian_shape(rows, static_cast<int64_t>(J.extent(0)), static_cast<int64_t>(J.extent(1)),
                       static_cast<int64_t>(J.extent(2)));
  const JacobianMode used = prepare_jacobian(mode);  // the first call of a mode: collective
  const int64_t cols = inputs();
  if constexpr (predictor_detail::on_device<InputView>()) {
    predictor_detail::copy_rows<Kokkos::DefaultExecutionSpace>(MatrixView(x_), x, rows, cols);
  } else {
    predictor_detail::copy_rows<Kokkos::DefaultHostExecutionSpace>(x_host_, x, rows, cols);
    upload_input();
  }
  const Prediction result = run_jacobian(rows, used);
  if constexpr (predictor_detail::on_device<JacobianView>()) {
    predictor_detail::copy_jacobian_rows<Kokkos::DefaultExecutionSpace>(J, jacobian_, rows);
  } else {
    download_jacobian();
    predictor_detail::copy_jacobian_rows<Kokkos::DefaultHostExecutionSpace>(J, jacobian_host_,
                                                                            rows);
  }
  return result;
}

}  // namespace meshtrain
