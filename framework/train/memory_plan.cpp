#include "framework/train/memory_plan.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <optional>
#include <sstream>

#include "base/error.hpp"
#include "base/text.hpp"
#include "framework/comm/backend.hpp"
#include "framework/comm/reduction_choice.hpp"
#include "framework/core/activation_storage.hpp"
#include "framework/core/choices.hpp"
#include "framework/core/gemm.hpp"
#include "framework/core/views.hpp"
#include "framework/io/checkpoint.hpp"
#include "framework/io/data.hpp"
#include "framework/io/sparse_hdf5.hpp"
#include "framework/train/config.hpp"
#include "partition/cost_model.hpp"
#include "partition/embedding_layout.hpp"
#include "partition/gradient_storage.hpp"
#include "partition/sharding_picture.hpp"
#include "partition/sixteen_bit_storage.hpp"
#include "partition/zero1_layout.hpp"

namespace meshtrain {

namespace {

// Whether the run's groups are MPI communicators, whose reductions follow [runtime] reductions
// (NCCL's ignore it).
bool mpi_reductions(const RuntimeSection& runtime) {
  return runtime.backend == CommBackendChoice::mpi ||
         (runtime.backend == CommBackendChoice::automatic && !build_supports_nccl());
}

// The choice the run's group over `axes` makes (reduction_choice.hpp, the one resolution);
// "measure", decided by timing at run time, counted as the ring everywhere (an upper bound).
ReductionChoice group_choice(const RunConfig& config, const std::vector<std::string>& axes,
                             const HardwareProfile& hardware) {
  return planned_reduction_choice(config.runtime.reductions, axes, hardware)
      .value_or(ReductionChoice::ring());
}

bool is_reduction(const LayerCollective& c) {
  return c.ranks >= 2 &&
         (c.kind == CollectiveKind::reduce_scatter || c.kind == CollectiveKind::all_reduce);
}

// Every collective of the plan's layers and norms, in order.
template <class Fn>
void for_each_collective(const ShardingPlan& plan, Fn&& fn) {
  for (const LayerPlan& l : plan.layers) {
    for (const LayerCollective& c : l.collectives) fn(c);
  }
  for (const NormPlan& n : plan.norms) {
    for (const LayerCollective& c : n.collectives) fn(c);
  }
}

}  // namespace

std::vector<GroupReduction> planned_reductions(const ShardingPlan& plan, const RunConfig& config,
                                               const HardwareProfile& hardware) {
  std::vector<GroupReduction> groups;
  if (!mpi_reductions(config.runtime)) return groups;
  std::map<std::vector<std::string>, bool> seen;
  for_each_collective(plan, [&](const LayerCollective& c) {
    if (!is_reduction(c)) return;
    std::vector<std::string> key = c.axes;
    std::sort(key.begin(), key.end());
    if (seen[key]) return;
    seen[key] = true;
    groups.push_back({c.axes, c.ranks, group_choice(config, c.axes, hardware)});
  });
  return groups;
}

RingReductionBytes ring_reduction_bytes(const ShardingPlan& plan, const RunConfig& config,
                                        const HardwareProfile& hardware) {
  RingReductionBytes bytes;
  const RuntimeSection& runtime = config.runtime;
  if (!mpi_reductions(runtime)) return bytes;
  // DP buckets: overlap with the gradients reduced in backward (not ZeRO-1, not accumulated).
  const bool buckets =
      runtime.overlap && config.optimizer.zero_stage != 1 && config.train.accumulation_steps == 1;
  std::map<std::vector<std::string>, int64_t> largest;  // per group: its largest buffers
  // `evaluation`: a collective of the evaluation model (below), which reserves only its layers'
  // blocking reductions at its rows (the gradients' are the training model's sizes).
  const auto count = [&](const LayerCollective& c, bool evaluation) {
    if (!is_reduction(c)) return;
    int64_t elements = 1;
    for (int64_t d : c.shape) elements *= d;
    const std::size_t message = static_cast<std::size_t>(elements * c.element_bytes);
    const ReductionChoice choice = group_choice(config, c.axes, hardware);
    const int64_t block = (elements + c.ranks - 1) / c.ranks * c.element_bytes;
    const int64_t buffers = c.ranks == 2 ? 1 : 2;
    const bool gradient = c.operand == "weight gradient" || c.operand == "bias gradient";
    if (evaluation && gradient) return;
    if (buckets && gradient && c.kind == CollectiveKind::all_reduce) {
      // A started all-reduce keeps its own partial sums when it runs on the ring.
      if (message >= choice.all_reduce_ring_from) bytes.started += block * buffers;
      return;
    }
    // A blocking reduction reserves the ring's buffers when either kind would take the ring at
    // its size (MpiCommunicator::raw_reserve_reductions).
    if (message < std::min(choice.reduce_scatter_ring_from, choice.all_reduce_ring_from)) return;
    std::vector<std::string> group = c.axes;
    std::sort(group.begin(), group.end());
    int64_t& most = largest[group];
    most = std::max(most, block * buffers);
  };
  for_each_collective(plan, [&](const LayerCollective& c) { count(c, false); });
  // A separate evaluation model (data.eval_batch_size of other rows per rank) reserves its
  // layers' reductions at its rows on the same communicators, and under overlap builds DP
  // gradient buckets of its own, each with its started ring, though it never runs backward.
  const int64_t eval_rows = evaluation_rows(config, plan);
  if (eval_rows > 0 && eval_rows != plan.local_batch_rows) {
    PlanOptions options = plan_options(config);
    options.global_batch = eval_rows * (config.data.batch_size / plan.local_batch_rows);
    options.eval_global_batch = 0;
    // With norms when `plan` has them (a run's own plan is made without).
    const ShardingPlan evaluation = make_plan(
        model_parameter_shapes(config.model), plan.mesh, partition_rules(config), options,
        model_linear_layers(config.model),
        plan.norms.empty() ? std::vector<NormLayerParameters>{} : model_norm_layers(config.model));
    for_each_collective(evaluation, [&](const LayerCollective& c) { count(c, true); });
    bytes.started *= 2;
  }
  for (const auto& [group, most] : largest) bytes.blocking += most;
  return bytes;
}

namespace {

// The workspace of a model built for `rows` rows per rank (the training model, or the
// evaluation's forward-only copy), with each communicator's largest scratch in floats by its axes
// in `comm_scratch` (merged by maximum over models sharing the communicators).
TrainingWorkspace workspace_for_rows(const RunConfig& config, const ShardingPlan& plan,
                                     int64_t rows,
                                     std::map<std::vector<std::string>, int64_t>& comm_scratch) {
  TrainingWorkspace w;
  if (rows <= 0 || plan.layers.empty()) return w;
  constexpr int64_t kFloat = sizeof(float);
  const MixedPrecision precision = config.mixed_precision.policy();
  const bool fp32 = precision.param == Dtype::fp32;
  const bool reads_16bit = gemm_reads_16bit(precision.param);  // (layers/linear.hpp's GEMMs)
  // Whether gemm()'s kernel reads them as stored (not widened into gemm()'s own scratch).
  const bool kernel_reads_16bit = gemm_kernel_reads_16bit(precision.param);
  // Whether a gathered weight gradient is written as 16 bits (layers/linear.cpp).
  const bool wire_is_16bit_compute = !fp32 && precision.reduce == precision.param;
  const bool kernel_writes_16bit = gemm_kernel_writes_16bit(precision.param);
  const auto writes_16bit_gradient = [&](const LinearLayout& l) {
    return writes_16bit_gathered_gradient(l, wire_is_16bit_compute, kernel_writes_16bit);
  };
  const bool residual = config.model.kind == ModelKind::residual_mlp;
  const bool gated = residual && config.model.residual().gated;
  // The shared scratch's needs in floats (LayerScratchNeeds, merged by maximum over the layers)
  // and each communicator's largest scratch, by its axes.
  int64_t weight = 0, prefetch = 0, grad = 0, stage = 0, bias = 0, matmul_bytes = 0;
  // 16-bit elements: the gathered 16-bit landing, the weights' 16-bit compute copies.
  int64_t weight_16bit = 0, copy_halves = 0;
  const auto reserve = [&](const std::vector<std::string>& axes, int64_t floats) {
    int64_t& most = comm_scratch[axes];
    most = std::max(most, floats);
  };
  int64_t activation_floats = 0;
  const size_t n = plan.layers.size();
  // A plain MLP's 16-bit storage (layers/mlp.cpp, the plain constructor: a 16-bit param_dtype,
  // no MoE, no dropout, no feature axis or a feature axis whose layers are all row-parallel
  // (row_parallel_only)): its Linears write to and compute their input gradients in two shared
  // fp32 working buffers [rows, widest local input or output] (the last layer's output
  // excepted), its activations work in place there and keep their output (and, but for relu and
  // the identity, their input) as 16 bits, and the model keeps its input as 16 bits (instead of
  // an fp32 copy).
  // Decided as the model decides it (partition/sixteen_bit_storage.hpp), on the mesh's feature
  // axis as the run's context finds it.
  const PlanOptions options = plan_options(config);
  const LayerAxes axes = layer_axes_on(plan.mesh, {options.batch_axes, options.feature_axis});
  ActivationStorageQuery storage_query;
  storage_query.sixteen_bit_compute = !fp32;
  storage_query.residual = residual;
  storage_query.norms = residual && config.model.has_norms();
  storage_query.moe = config.model.moe().any();
  storage_query.dropout = config.model.dropout > 0.0;
  storage_query.feature_parallel = axes.feature.empty() ? 1 : plan.mesh.axis_size(axes.feature);
  std::vector<LinearLayout> layouts;
  for (const LayerPlan& layer : plan.layers) {
    if (!layer.moe) layouts.push_back(layer.layout);
  }
  storage_query.row_parallel_layers = !storage_query.moe && row_parallel_only(layouts);
  const ActivationStorage storage = sixteen_bit_activation_storage(storage_query);
  const bool keeps_16bit = storage.plain;
  // A residual_mlp's 16-bit storage of its blocks' hidden activations (layers/mlp.cpp, the
  // residual constructor: no MoE or dropout, no feature axis): the up projections write into one
  // shared fp32 working buffer [rows, hidden], the activations keep their output (and, but for
  // relu and the identity, their input) as 16 bits, the down projections compute their input
  // gradient in that buffer. SwiGLU blocks: the gate projections write into a second shared buffer
  // [rows, hidden], the SwiGLU keeps gate, up and its output as 16 bits and has no fp32 buffer
  // (layers/swiglu.hpp); without the stream's storage gate and up keep their own input gradients,
  // with it they compute them in the norms' buffer (up) and the stream (gate).
  const bool hidden_16bit = storage.residual_hidden;
  // With norms, its residual stream: three shared fp32 buffers [rows, width] (the stream, the
  // norms' and down projections' outputs, the gradient stream) instead of each block's output
  // and input gradient and each norm's output and input gradient; the norms keep their input
  // and output as 16 bits; the input projection writes into the stream, the up projections and
  // the last layer compute their input gradients in the norms' buffer.
  const bool stream_16bit = storage.residual_stream;
  int64_t activation_halves = 0;  // 16-bit elements
  // Under a feature axis (every layer row-parallel), the first layer keeps its slice of the
  // input (below) instead of the model's 16-bit copy, and where gemm() reads 16 bits a hidden
  // layer packs its dY as 16 bits for its all-gather-matmuls over its activation's kept output
  // (free by then), the last layer into a buffer of the model [rows, its split output].
  const bool tp_storage = keeps_16bit && storage_query.feature_parallel > 1;
  if (keeps_16bit) {
    // The working buffers as wide as the widest local input or output (the last layer's
    // excepted) that a layer computes in them: under a feature axis the first layer is handed the
    // raw batch and slices it itself.
    int64_t widest = 0;
    for (size_t i = 0; i < n; ++i) {
      const LinearLayout& l = plan.layers[i].layout;
      widest = std::max(widest, l.in_compute);
      if (i + 1 < n) widest = std::max(widest, l.out_local);
    }
    activation_floats += 2 * rows * widest;  // model/work_0, work_1
    if (!plan.layers.front().layout.slices_input()) {
      activation_halves += rows * config.model.input_width();  // model/input_16bit
    }
    // A hidden layer's 16-bit dY goes over its activation's kept output: only the last layer's
    // has a buffer (model/output_grad_16bit).
    const LinearLayout& last = plan.layers.back().layout;
    if (tp_storage && reads_16bit && last.split_output) activation_halves += rows * last.out_local;
  }
  int64_t activation_bytes = 0;  // buffers counted in bytes (a layer's sliced or gathered input)
  // model/hidden_work, and model/gate_work for SwiGLU blocks.
  if (hidden_16bit) activation_floats += (gated ? 2 : 1) * rows * config.model.residual().hidden;
  const auto ends_with = [](const std::string& name, const std::string& tail) {
    return name.size() > tail.size() &&
           name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
  };
  for (size_t i = 0; i < n; ++i) {
    const LayerPlan& layer = plan.layers[i];
    if (layer.moe) continue;  // an MoE layer's buffers: its dispatch buffers (totals) only
    const LinearLayout& l = layer.layout;
    // Linear's buffers (layers/linear.cpp); with 16-bit storage the shared working buffers
    // instead of a hidden layer's output (a residual block's up projection's) and of the input
    // gradient (a residual block's down projection's).
    const bool up = residual && ends_with(layer.name, "/up");
    const bool down = residual && ends_with(layer.name, "/down");
    const bool gate = residual && ends_with(layer.name, "/gate");
    const bool shared_output = (keeps_16bit && i + 1 < n) || (hidden_16bit && (up || gate)) ||
                               (stream_16bit && (i == 0 || down));
    const bool shared_input_grad =
        keeps_16bit || (hidden_16bit && down) || (stream_16bit && (up || gate || i + 1 == n));
    if (l.slices_input() || l.gathers_input()) {  // input, or input_16bit (the sliced input's rule)
      activation_bytes +=
          sliced_input_bytes(rows, l.in_compute, keeps_16bit, l.slices_input(), kernel_reads_16bit);
    }
    if (!shared_output) activation_floats += rows * l.out_local;  // output
    if (l.column_gathers_input()) {
      activation_floats += rows * l.input_width();  // input_grad
    } else if (!shared_input_grad) {
      activation_floats += rows * l.in_compute;  // input_grad_compute
    }
    // input_grad (none for the first layer's slice under 16-bit storage: never asked for).
    const bool input_grad = !(keeps_16bit && i == 0 && l.slices_input());
    if ((l.slices_input() || l.gathers_input()) && input_grad) {
      activation_floats += rows * l.input_width();
    }
    // Tensor parallelism with 16-bit weight copies: a row-parallel layer's dY as 16 bits
    // (output_grad_16bit), gathered by its backward all-gather-matmuls (under 16-bit storage the
    // model's shared buffer, above).
    if (!keeps_16bit && l.split_output && !l.column_parallel &&
        keeps_feature_parallel_weight_copy(storage_query, l, reads_16bit)) {
      activation_halves += rows * l.out_local;
    }
    // The layer that follows it in a plain MLP: its activation (and dropout); in a residual
    // block, the up projection's activation or the gate's SwiGLU (layers/swiglu.cpp).
    const bool hidden = residual ? up : i + 1 < n;
    if (hidden && (keeps_16bit || hidden_16bit)) {
      // output_16bit, and input_16bit where the derivative reads z (not relu's nor the
      // identity's: framework/core/activation_storage.hpp); a SwiGLU's gate_16bit, value_16bit,
      // output_16bit
      const int64_t kept = gated                                                   ? 3
                           : activation_keeps_16bit_input(config.model.activation) ? 2
                                                                                   : 1;
      activation_halves += kept * rows * l.out_local;
    } else if (hidden && !(residual && gated)) {
      activation_floats += rows * l.out_local;
      if (config.model.dropout > 0.0) activation_floats += rows * l.out_local;
    }
    if (gate && !hidden_16bit) {
      // output, gate and value gradients; the input gradient: with a shared gather of the
      // input (both fed it replicated) the gathered input, its partial gradient and this
      // rank's block of it, else the input's width.
      activation_floats += 3 * rows * l.out_local;
      if (l.input_grad_partial) {
        activation_floats += 2 * rows * l.in + rows * l.in / l.tp;
      } else {
        activation_floats += rows * l.input_width();
      }
      if (config.model.dropout > 0.0) activation_floats += rows * l.out_local;
    }
    // Its parameters' needs of the shared scratch (ShardedParameter::scratch_needs).
    const int64_t d1 = l.in_compute, d2 = l.compute_cols(), s1 = l.stored_rows, s2 = l.stored_cols;
    const bool gathered = l.gathers_weight();
    // The gathered gradient's scratch: 2 bytes an element where backward's GEMM writes it as the
    // 16 bits its reduce-scatter sends (partition/sixteen_bit_storage.hpp, as layers/linear.cpp).
    grad = std::max(grad, gradient_scratch_floats(d1, d2, gathered, writes_16bit_gradient(l)));
    const bool two_gathers = !l.weight_gather_dim0.empty() && !l.weight_gather_dim1.empty();
    if (two_gathers) stage = std::max(stage, std::max(d1 * s2, s1 * d2));
    // 16-bit storage: a weight gathered over one group has a 16-bit compute copy of its stored
    // block (partition/sixteen_bit_storage.hpp, as layers/mlp.cpp), gathered as 16 bits: blocking
    // into the bytes of the gradient scratch (dim-0 blocks read as 16 bits: into the weight
    // scratch, which holds them anyway), prefetched (overlap) into the 16-bit landing
    // (layers/sharded_parameter.cpp). A weight stored whole has one where gemm() reads 16 bits
    // (read as it is: no landing); this process's gemm_reads_16bit() answers for the run's, so
    // the plan is the run's when made on the run's machine with its MESHTRAIN_CPU_GEMM
    // (docs/mixed_precision.md). A weight gathered over two groups has none.
    const bool one_gather = gathered && !two_gathers;
    // Under a feature axis, a weight not gathered has one where gemm() reads 16 bits (the
    // collective matmuls read it as it is).
    const bool copy = (keeps_16bit && keeps_16bit_weight_copy(l, reads_16bit)) ||
                      keeps_feature_parallel_weight_copy(storage_query, l, reads_16bit);
    // The shared weight buffer (scratch.weight) the GEMMs read: fp32, or 2 bytes an element where
    // gemm()'s kernel reads a weight with a copy as 16 bits (partition/sixteen_bit_storage.hpp,
    // as ShardedParameter::scratch_needs).
    weight =
        std::max(weight, weight_scratch_floats(d1, d2, gathered, !fp32, copy, kernel_reads_16bit));
    if (copy) {
      copy_halves += s1 * s2;
      if (config.runtime.overlap && one_gather) weight_16bit = std::max(weight_16bit, d1 * d2);
    }
    // Prefetched (overlap) when gathered over one group: into the fp32 prefetch buffer without a
    // 16-bit copy.
    if (config.runtime.overlap && one_gather && !copy) prefetch = std::max(prefetch, d1 * d2);
    if (!l.bias_gather.empty() || !l.bias_direct) bias = std::max(bias, l.out);
    int64_t matmul = 0;
    if (l.tensor_parallel) matmul = 3 * rows * l.out * kFloat;
    if (l.column_gathers_input()) matmul = 3 * rows * l.in * kFloat;
    matmul_bytes = std::max(matmul_bytes, matmul);
    if (!l.weight_gather_dim1.empty()) reserve(l.weight_gather_dim1, d1 * d2);
    if (l.tp > 1) reserve({l.feature_axis}, rows * std::max(l.in, l.out));
  }
  // Norms (layers/norm.cpp) and residual blocks (layers/residual_block.cpp): the stream's width
  // as the input projection leaves it.
  // (A run's plan is made without its norms: their layouts are decided here as `plan` does.)
  std::vector<NormPlan> norms = plan.norms;
  if (norms.empty() && config.model.has_norms()) {
    norms = make_plan(model_parameter_shapes(config.model), plan.mesh, partition_rules(config),
                      plan_options(config), model_linear_layers(config.model),
                      model_norm_layers(config.model))
                .norms;
  }
  for (const NormPlan& norm : norms) {
    const NormLayout& l = norm.layout;
    activation_floats += rows * (1 + 2 + 3);  // row sums, statistics
    if (stream_16bit) {
      activation_halves += 2 * rows * l.local_width;  // input_16bit, output_16bit
    } else {
      activation_floats += 2 * rows * l.local_width;  // output, input_grad
    }
    // Full-width gradients ([scale | bias], when not direct) and each gathered parameter's own
    // buffer (layers/norm.cpp, layers/sharded_parameter.cpp: full_width_sum).
    if (!l.direct) activation_floats += static_cast<int64_t>(l.params.size()) * l.width;
    for (const NormParameterLayout& p : l.params) {
      if (!p.gather.empty()) activation_floats += p.gathered;
    }
  }
  if (residual) {
    const int64_t width = plan.layers.front().layout.out_local;
    if (stream_16bit) {
      activation_floats += 3 * rows * width;  // model/stream, norm_work, stream_grad
    } else {
      activation_floats += 2 * rows * width * config.model.residual().depth;
    }
  }
  // The model's 16-bit input copy and output gradient (layers/mlp.cpp).
  const LinearLayout& last = plan.layers.back().layout;
  const int64_t outputs = config.model.output_width();
  if (!fp32 && !keeps_16bit) activation_floats += rows * config.model.input_width();
  if (!fp32 || precision.needs_loss_scaling()) activation_floats += rows * last.out_local;
  // The loss (layers/loss.cpp): gradient, row maxima, statistics, per-row losses.
  const bool split = last.tp > 1 && last.output_layout() == FeatureLayout::split;
  const int64_t local_width = split ? outputs / last.tp : outputs;
  activation_floats += rows * (local_width + 1 + (split ? last.tp : 1) + 3 + 1);
  if (split) reserve({last.feature_axis}, rows * last.tp);
  // The loss's three double sums, and their host mirror where device memory is separate.
  const int64_t loss_scalars = (device_memory_is_separate() ? 2 : 1) * 3 * sizeof(double);
  w.activation_bytes = activation_floats * kFloat +
                       activation_halves * static_cast<int64_t>(sizeof(uint16_t)) +
                       activation_bytes + loss_scalars;
  // The batch (run/run_setup.cpp): inputs, and int32 labels or float targets.
  const bool labels = config.model.loss == LossKind::cross_entropy;
  w.batch_bytes = rows * config.model.input_width() * kFloat +
                  (labels ? rows * static_cast<int64_t>(sizeof(int32_t)) : rows * outputs * kFloat);
  constexpr int64_t kHalf = sizeof(uint16_t);
  w.sixteen_bit_copy_bytes = copy_halves * kHalf;
  w.gathered_weight_bytes = (weight + prefetch + grad + stage + bias) * kFloat +
                            weight_16bit * kHalf + w.sixteen_bit_copy_bytes;
  // CollectiveMatmulWorkspace::reserve rounds up to whole floats.
  w.collective_matmul_bytes = (matmul_bytes + kFloat - 1) / kFloat * kFloat;
  return w;
}

int64_t scratch_bytes(const std::map<std::vector<std::string>, int64_t>& comm_scratch) {
  int64_t bytes = 0;
  for (const auto& [axes, floats] : comm_scratch)
    bytes += floats * static_cast<int64_t>(sizeof(float));
  return bytes;
}

}  // namespace

int64_t evaluation_rows(const RunConfig& config, const ShardingPlan& plan) {
  if (plan.local_batch_rows <= 0) return 0;
  const int64_t eval_batch = config.data.eval_batch_size.value_or(config.data.batch_size);
  const int64_t shards = config.data.batch_size / plan.local_batch_rows;
  return shards > 0 && eval_batch % shards == 0 ? eval_batch / shards : 0;
}

TrainingWorkspace training_workspace(const RunConfig& config, const ShardingPlan& plan) {
  std::map<std::vector<std::string>, int64_t> comm_scratch;
  TrainingWorkspace w = workspace_for_rows(config, plan, plan.local_batch_rows, comm_scratch);
  // A separate evaluation model shares the communicators, whose scratch grows to its rows when
  // they are more.
  const int64_t eval_rows = evaluation_rows(config, plan);
  if (eval_rows > 0 && eval_rows != plan.local_batch_rows) {
    std::map<std::vector<std::string>, int64_t> eval_scratch;
    workspace_for_rows(config, plan, eval_rows, eval_scratch);
    for (const auto& [axes, floats] : eval_scratch) {
      int64_t& most = comm_scratch[axes];
      most = std::max(most, floats);
    }
  }
  w.comm_scratch_bytes = scratch_bytes(comm_scratch);
  return w;
}

EvaluationBuffers evaluation_buffers(const RunConfig& config, const ShardingPlan& plan) {
  EvaluationBuffers e;
  const int64_t rows = evaluation_rows(config, plan);
  // The run builds a forward-only model for the evaluation batch only when its rows per rank
  // differ from the training batch's (run/run_setup.cpp); it allocates what the training
  // model does at its rows.
  if (rows <= 0 || rows == plan.local_batch_rows) return e;
  std::map<std::vector<std::string>, int64_t> ignored;
  const TrainingWorkspace eval = workspace_for_rows(config, plan, rows, ignored);
  e.activation_bytes = eval.activation_bytes;
  e.batch_bytes = eval.batch_bytes;
  // Each model has a LayerScratch of its own: gathered weights and collective matmul workspace.
  // (The weights' 16-bit copies are the training model's, shared.)
  e.gathered_weight_bytes = eval.gathered_weight_bytes - eval.sixteen_bit_copy_bytes;
  e.collective_matmul_bytes = eval.collective_matmul_bytes;
  return e;
}

namespace {

// A DLRM run's data path per rank (run/dlrm_run.cpp), in place of the dense one's: the dense
// source's scratch (train and test) and the sparse readers' buffers (SparseHdf5Reader::
// buffer_bytes, at the capacity the run finds in each file: the rows times the largest bag,
// dlrm_bags; one id per bag for a file the plan cannot open); the read-ahead's data.prefetch
// slots of a training batch (its rows, dense features, labels and every table's CSR at the
// training file's capacity; evaluation reads in the step); the chunk caches as the run sizes them
// from the files' chunks (the training file's dense datasets and tables, the test file's tables and
// the dense source's default 1 MiB), counted 0 for a file the plan cannot open (the run refuses
// it).
void dlrm_data_footprint(const RunConfig& config, int64_t rows, DataFootprint& f) {
  const DlrmShape shape = config.model.dlrm();
  const auto tables = static_cast<int64_t>(shape.tables.size());
  const int64_t features = shape.bottom.front();
  const bool test = !config.data.test_path.empty();
  std::vector<std::string> names;
  for (const DlrmTable& t : shape.tables) names.push_back(t.name);
  const auto file = [](const std::vector<std::string>& entries) {
    return entries.size() == 1 ? entries.front() : std::string();
  };
  // As SparseHdf5Reader opened with max_ids < 0: the rows times the largest bag, at least 1.
  const DlrmBags train_bags = dlrm_bags(file(config.data.path), names, config.data.sparse_key);
  const auto capacity = [&](const DlrmBags& bags) {
    return std::max<int64_t>(rows * (bags.largest > 0 ? bags.largest : 1), 1);
  };
  const int64_t train_ids = capacity(train_bags);
  const int64_t scratch_row = 8 + 4 * features + 4;  // the order, x and a float label
  f.source_bytes = rows * scratch_row + SparseHdf5Reader::buffer_bytes(tables, rows, train_ids);
  if (test) {
    const int64_t test_ids =
        capacity(dlrm_bags(file(config.data.test_path), names, config.data.sparse_key));
    f.source_bytes += rows * scratch_row + SparseHdf5Reader::buffer_bytes(tables, rows, test_ids);
  }
  const int64_t slot = rows * scratch_row + tables * 8 * (rows + 1) + tables * 8 * train_ids;
  f.staging_bytes = std::max<int64_t>(config.data.prefetch, 0) * slot;
  const DlrmDataCaches train =
      dlrm_data_cache_bytes(file(config.data.path), names, config.data.sparse_key,
                            {config.data.x_key, config.data.y_key});
  f.cache_bytes = train.sparse_bytes + std::min(train.dense_bytes, train.dense_budget());
  if (test) {
    f.cache_bytes +=
        dlrm_data_cache_bytes(file(config.data.test_path), names, config.data.sparse_key, {})
            .sparse_bytes +
        Hdf5SourceOptions{}.chunk_cache_bytes;
  }
  f.source =
      "streamed from HDF5 (dense rows and the tables' ids; the sparse readers' buffers "
      "at the rows times the file's largest bag)";
  f.read.tables = tables;
  // The training file's ids of one row on average (one id per bag when it cannot be opened).
  f.read.ids_per_row = train_bags.ids_per_row > 0.0
                           ? std::max<int64_t>(std::llround(train_bags.ids_per_row), 1)
                           : tables;
}

}  // namespace

// Bytes per rank the weight gradients stored as 16 bits save against fp32 ones (2 an element),
// decided as the run decides it (partition/gradient_storage.hpp; Mlp::store_gradients_16bit in
// run/run_setup.cpp): a plain MLP's Linear weights neither gathered nor replicated over a
// non-batch axis whose weight-gradient product writes each element once (one GEMM, or a naive or
// ring all-gather-matmul: the algorithm the layer chooses, layer_matmul_algorithms on `hardware`),
// in a bf16 run that reduces in backward and does not clip. Under overlap a DP layer group's
// stored gradient is its range of the DP buckets' 16-bit buffer; that whole buffer (the other
// bucketed gradients' 16-bit copies too) is counted here as the gradients'. The others (TP's own
// all-reduce, no reduction) have a 16-bit buffer of their own.
static int64_t sixteen_bit_gradient_savings(const RunConfig& config, const ShardingPlan& plan,
                                            const HardwareProfile& hardware) {
  if (config.model.kind != ModelKind::mlp) return 0;
  const bool zero1 = config.optimizer.zero_stage == 1 && plan.mesh.has_axis(kZeroAxis) &&
                     plan.mesh.size_of({kZeroAxis}) > 1;
  GradientStorageQuery query;
  query.precision = config.mixed_precision.policy();
  query.kernel_writes_16bit = gemm_kernel_writes_16bit(query.precision.param);
  query.reduced_in_backward = !zero1 && config.train.accumulation_steps == 1;
  query.clipped = config.optimizer.clip_norm > 0;
  if (weight_gradient_storage(query) == Dtype::fp32) return 0;
  int64_t bucketed_saved = 0, own_saved = 0;
  int64_t others = 0;  // fp32 bytes of the bucketed gradients kept in fp32
  const bool buckets = config.runtime.overlap;
  for (const LayerPlan& layer : plan.layers) {
    if (layer.moe) continue;
    const LinearLayout& l = layer.layout;
    const int64_t weight = plan.find(layer.name + "/weight").bytes_per_rank;
    const bool bucketed = buckets && l.defers_reduction();
    if (bucketed) others += plan.find(layer.name + "/bias").bytes_per_rank;
    const CollectiveMatmulAlgorithm weight_grad =
        layer_matmul_algorithms(l, plan.local_batch_rows, config.partition.collective_matmul,
                                hardware, query.precision.param)
            .weight_grad;
    if (!stores_weight_gradient_16bit(l, weight_grad)) {
      if (bucketed) others += weight;
      continue;
    }
    (bucketed ? bucketed_saved : own_saved) += weight / 2;
  }
  // Under overlap the stored weights of the DP layer groups live in the DP buckets' 16-bit
  // buffer, which also holds a 16-bit copy of every other bucketed gradient (biases, weights
  // kept in fp32): the run counts that buffer as the gradients' (TrainingRun::plan_item_of), and
  // so does the plan.
  if (bucketed_saved > 0) bucketed_saved -= others / 2;
  return bucketed_saved + own_saved;
}

PlannedMemory planned_memory(const RunConfig& config, const ShardingPlan& plan,
                             const HardwareProfile& hardware) {
  PlannedMemory memory;
  memory.totals = plan.totals;
  memory.totals.gradient_bytes -= sixteen_bit_gradient_savings(config, plan, hardware);
  memory.workspace = training_workspace(config, plan);
  // The evaluation model's buffers as the memory model counts them (the planner's estimate,
  // its inputs and each layer's output, misses a residual model's norms and sums and every
  // layer's backward buffers, which the forward-only copy allocates too).
  memory.evaluation = evaluation_buffers(config, plan);
  memory.totals.evaluation_bytes = memory.evaluation.total_bytes();
  // A checkpoint that stages (asynchronous, or from device memory) copies the blocks a rank
  // writes: the blocks of its parameters and optimizer state it owns (owns_block: one replica
  // of each block writes it; under dp rank 0 alone). ZeRO-1's optimizer chunks are every
  // rank's own: counted on every rank.
  if (checkpoint_stages_tensors(config.checkpoint.async)) {
    const int world = plan.mesh.world_size();
    const bool zero1 = plan.totals.zero1_buffer_bytes > 0;
    const PlanOptions options = plan_options(config);
    const int64_t slots = options.optimizer_slots;
    memory.checkpoint_staging_by_rank.assign(static_cast<size_t>(world), 0);
    for (int r = 0; r < world; ++r) {
      int64_t& bytes = memory.checkpoint_staging_by_rank[static_cast<size_t>(r)];
      if (zero1) bytes = plan.totals.optimizer_bytes;
      // A DLRM's tables under sparse updates: the block and its own state (one float per row
      // of rowwise_adagrad; m, v and a step count per row of sparse_adamw), not `slots`.
      for (const auto& p : plan.parameters) {
        if (!owns_block(plan.mesh, r, p.spec)) continue;
        if (options.sparse_tables && is_embedding_weight_name(p.name)) {
          const int64_t per_row = p.local_shape.empty() ? 0 : p.local_shape[0] * 4;
          // The table as stored (2 bytes an element under table_dtype = "bf16"), its state fp32.
          const int64_t fp32_block = p.bytes_per_rank / options.table_bytes_per_element * 4;
          bytes +=
              p.bytes_per_rank + (config.optimizer.embeddings == EmbeddingOptimizer::sparse_adamw
                                      ? 2 * fp32_block + per_row
                                      : per_row);
          continue;
        }
        bytes += p.bytes_per_rank * (zero1 ? 1 : 1 + slots);
      }
      memory.checkpoint_staging_bytes = std::max(memory.checkpoint_staging_bytes, bytes);
    }
  }
  // This rank's rows of a batch and of an evaluation batch (the plan's batch shards).
  const int64_t eval_rows = evaluation_rows(config, plan);
  DataUse use{config.model.input_width(), config.model.output_width(),
              config.model.loss == LossKind::cross_entropy, config.train.accumulation_steps};
  if (config.data.source == DataSource::stream) {
    use.stream_buffer_rows = config.stream.buffer_rows;
    use.stream_held_out_rows = stream_held_out_rows(config.stream);
  }
  memory.data =
      data_footprint(config.data, use, std::max<int64_t>(plan.local_batch_rows, 0), eval_rows);
  if (config.model.kind == ModelKind::dlrm && config.data.source == DataSource::hdf5) {
    dlrm_data_footprint(config, std::max<int64_t>(plan.local_batch_rows, 0), memory.data);
  }
  memory.ring = ring_reduction_bytes(plan, config, hardware);
  return memory;
}

}  // namespace meshtrain
