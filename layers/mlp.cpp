#include "layers/mlp.hpp"

#include <algorithm>
#include <map>

#include "base/error.hpp"
#include "framework/core/exec_space.hpp"
#include "framework/core/gemm.hpp"
#include "framework/core/kernel_label.hpp"
#include "framework/core/precision.hpp"
#include "framework/observe/trace.hpp"
#include "framework/train/config.hpp"
#include "layers/residual_block.hpp"
#include "layers/swiglu.hpp"
#include "partition/cost_model.hpp"
#include "partition/gradient_storage.hpp"
#include "partition/sixteen_bit_storage.hpp"

namespace meshtrain {

SpecLookup specs_from_plan(const ShardingPlan& plan) {
  return [&plan](const std::string& name) { return plan.find(name).spec; };
}

std::unique_ptr<Mlp> make_model(const ModelSection& model, const SpecLookup& spec_of,
                                ParallelContext& context, int64_t local_rows,
                                const Mlp* shares_parameters_of) {
  if (model.kind == ModelKind::dlrm) {
    // Not an Mlp: which command serves which kind is the commands' policy (run/dlrm_run.hpp).
    MESHTRAIN_BAD_INPUT("model.kind = \"dlrm\" is not an Mlp: it is built as meshtrain::Dlrm ",
                        "(layers/dlrm.hpp) and trained by meshtrain::DlrmRun (run/dlrm_run.hpp)");
  }
  if (model.kind == ModelKind::residual_mlp) {
    return std::make_unique<Mlp>(model.residual(), model.activation, spec_of, context, local_rows,
                                 model.dropout, shares_parameters_of);
  }
  return std::make_unique<Mlp>(model.sizes, model.activation, spec_of, context, local_rows,
                               model.moe(), model.dropout, shares_parameters_of);
}

namespace {

// Whether the Linear of `weight` and `bias`, fed `layout`, keeps a 16-bit compute copy of its
// weight under 16-bit storage (partition/sixteen_bit_storage.hpp: gathered over one group, or
// stored whole where gemm() reads 16 bits).
LinearLayout layout_of(const ShardedTensor& weight, const ShardedTensor& bias, FeatureLayout layout,
                       const ParallelContext& context) {
  return decide_linear_layout(linear_layer_name(weight.name),
                              {weight.name, weight.global_shape, weight.spec},
                              {bias.name, bias.global_shape, bias.spec}, context.mesh(),
                              {context.batch_axes(), context.feature_axis()}, layout);
}

bool weight_copy_wanted(const ShardedTensor& weight, const ShardedTensor& bias,
                        FeatureLayout layout, const ParallelContext& context) {
  return keeps_16bit_weight_copy(layout_of(weight, bias, layout, context),
                                 gemm_reads_16bit(context.precision().param));
}

// Gives `weight` a 16-bit compute copy of its block, which the optimizer writes.
void add_16bit_copy(ShardedTensor& weight, Dtype dtype) {
  auto copy = std::make_shared<SixteenBitCopy>();
  copy->bits = HalfBits("meshtrain::scratch_16bit_copy:" + weight.name, weight.local.extent(0));
  copy->dtype = dtype;
  weight.copy_16bit = std::move(copy);
}

}  // namespace

Mlp::Mlp(const std::vector<int64_t>& sizes, Activation activation, const SpecLookup& spec_of,
         ParallelContext& context, int64_t local_rows, const MoeSettings& moe, double dropout,
         const Mlp* shares_parameters_of)
    : sizes_(sizes),
      activation_(activation),
      rows_(local_rows),
      compute_dtype_(context.precision().param) {
  allocate(mlp_parameter_shapes(sizes, moe), spec_of, context, shares_parameters_of);
  const size_t n = sizes.size() - 1;
  for (int64_t layer : moe.layers) {
    if (layer < 0 || layer + 1 >= static_cast<int64_t>(n)) {
      MESHTRAIN_BAD_INPUT("MoE layer ", layer, " is not a hidden layer of a model of ", n,
                          " layers (an MoE layer is followed by an activation)");
    }
  }
  // The sequence: layer i (Linear, or MoE where listed), then its activation (none after the
  // last). Each layer takes the next parameters in parameters() order.
  linear_.reserve(n);
  moe_.reserve(n);
  activations_.reserve(n);
  if (dropout > 0.0) dropouts_.reserve(n);
  auto ref = [this](size_t p) { return ParameterRef{&params_[p], &grads_[p]}; };
  // 16-bit storage (docs/mixed_precision.md, "Compute and memory on this build"): the layers
  // compute in two fp32 working buffers of the model, [rows, widest input], in turn (layer i
  // reads work_[i % 2] and writes work_[(i + 1) % 2], its activation works in place there), and
  // keep for backward only 16-bit copies: the model's input, each activation's output and, where
  // its derivative reads it (not relu's nor the identity's: framework/core/activation_storage.hpp),
  // its input.
  // Backward runs on the same two buffers: layer i widens its kept input into work_[i % 2] for
  // its weight gradient and then writes its input gradient there, which the layer below reads
  // as its dY from the other buffer. The last layer's output (the logits) stays its own.
  // Under a feature axis whose layers are all row-parallel (tp, dp_tp, fsdp_tp) the same, with
  // the widths local (the buffers as wide as the widest layer's local input or output): the
  // model hands the raw batch to the first layer, which keeps its slice of it itself, rounded (16
  // bits where gemm()'s kernel reads them, layers/linear.cpp), and keeps no copy; and each hidden
  // layer packs its dY's 16 bits for its all-gather-matmuls over its activation's kept output,
  // dead by then (the last layer into a small buffer of the model). Where it does not
  // apply (fp32, MoE, dropout, a feature axis with a layer that is not row-parallel), the simulated
  // path: fp32 buffers holding 16-bit values. framework/train/memory_plan.cpp counts the same
  // buffers under the same condition.
  ActivationStorageQuery storage_query;  // the plan asks partition/sixteen_bit_storage.hpp too
  storage_query.sixteen_bit_compute =
      compute_dtype_ != Dtype::fp32 && context.stores_16bit_activations();
  storage_query.moe = !moe.layers.empty();
  storage_query.dropout = dropout > 0.0;
  storage_query.feature_parallel = context.feature_parallel();
  // The layers' layouts as they will be built (without MoE layers, the storage's condition).
  std::vector<LinearLayout> layouts;
  if (moe.layers.empty()) {
    FeatureLayout in_layout = FeatureLayout::replicated;
    for (size_t i = 0; i < n; ++i) {
      layouts.push_back(layout_of(params_[2 * i], params_[2 * i + 1], in_layout, context));
      in_layout = layouts.back().output_layout();
    }
  }
  storage_query.row_parallel_layers = row_parallel_only(layouts);
  keeps_16bit_ = sixteen_bit_activation_storage(storage_query).plain;
  if (keeps_16bit_) {
    // What the layers read and write there (below): each one's input as it computes, and each
    // output but the last (without a feature axis the first layer's input is the model's input).
    int64_t widest = 0;
    for (size_t i = 0; i < layouts.size(); ++i) {
      const LinearLayout& l = layouts[i];
      widest = std::max(widest, l.in_compute);
      if (i + 1 < layouts.size()) widest = std::max(widest, l.out_local);
    }
    work_[0] = Matrix("model/work_0", rows_, widest);
    work_[1] = Matrix("model/work_1", rows_, widest);
    if (!layouts.front().slices_input()) {
      input_16bit_ = HalfMatrix("model/input_16bit", rows_, sizes.front());
    }
    // A hidden layer's dY as 16 bits goes over its activation's kept 16-bit output (below); only
    // the last layer, which has no activation, needs a buffer of the model for it.
    if (storage_query.feature_parallel > 1 && gemm_reads_16bit(compute_dtype_) &&
        layouts.back().split_output) {
      output_grad_16bit_ = HalfMatrix("model/output_grad_16bit", rows_, layouts.back().out_local);
    }
  }
  FeatureLayout layout = FeatureLayout::replicated;  // x arrives with all features
  size_t param = 0;
  for (size_t i = 0; i < n; ++i) {
    Layer* layer = nullptr;
    if (moe.is_moe(static_cast<int64_t>(i))) {
      moe_.emplace_back(ref(param), ref(param + 1), ref(param + 2), moe.top_k, moe.aux_loss_coef,
                        layout, rows_, context);
      layer = &moe_.back();
    } else if (keeps_16bit_) {
      // A 16-bit compute copy of the weight, which the optimizer writes as it updates the master:
      // where the weight is gathered over one group (FSDP) the Linear gathers it as 16 bits;
      // where it is stored whole (DP, one rank) only if gemm() reads 16 bits, the GEMMs then
      // reading it as it is (no cast of the master at each use); elsewhere a weight stored whole
      // is rounded from the master into the fp32 weight buffer the GEMM reads, as a copy would be
      // widened into it, so a copy would be 2 bytes a parameter more and save no pass; a weight
      // gathered over two groups is gathered from the master. A model sharing another's parameters
      // shares its copies (the same ShardedTensors) and makes none, which the optimizer would not
      // keep current. framework/train/memory_plan.cpp counts them under the same condition.
      if (!shares_parameters_of &&
          weight_copy_wanted(params_[param], params_[param + 1], layout, context)) {
        add_16bit_copy(params_[param], compute_dtype_);
      }
      const LinearLayout& l = layouts[i];
      LinearSharedBuffers shared;
      if (i + 1 < n) shared.output = work_view((i + 1) % 2, l.out_local);
      shared.work = work_view(i % 2, l.in_compute);
      shared.kept_input =
          i == 0 ? ConstHalfMatrixView(input_16bit_) : activations_[i - 1].kept_output();
      shared.output_grad_16bit = output_grad_16bit_;
      if (i + 1 < n) {
        // The activation that follows is made first: under tensor parallelism this layer's
        // backward packs its dY's 16 bits over the activation's kept 16-bit output f(z), read for
        // the last time by the activation's backward just before (and by the next layer's
        // weight gradient before that), so no buffer of the model holds them. The activation's
        // width and offset are this layer's output's (checked below once the layer is made).
        const int64_t offset = l.split_output ? context.feature_index() * l.out_local : 0;
        activations_.emplace_back(activation, "layers/" + std::to_string(i) + "/activation", rows_,
                                  l.out_local, l.output_layout(), offset, compute_dtype_, true);
        if (storage_query.feature_parallel > 1 && gemm_reads_16bit(compute_dtype_)) {
          shared.output_grad_16bit = activations_.back().dy_16bit_over_output();
        }
      }
      shared.input_grad = i > 0 || !l.slices_input();  // the first layer is asked for none
      linear_.emplace_back(ref(param), ref(param + 1), layout, rows_, context, false, &shared);
      layer = &linear_.back();
    } else {
      // Under a feature axis (no 16-bit activation storage), where gemm() reads 16 bits: a weight
      // not gathered has a 16-bit copy that the GEMMs and collective matmuls read as it is
      // (partition/sixteen_bit_storage.hpp; memory_plan.cpp counts it under the same condition).
      if (!shares_parameters_of &&
          keeps_feature_parallel_weight_copy(
              storage_query, layout_of(params_[param], params_[param + 1], layout, context),
              gemm_reads_16bit(compute_dtype_))) {
        add_16bit_copy(params_[param], compute_dtype_);
      }
      linear_.emplace_back(ref(param), ref(param + 1), layout, rows_, context);
      layer = &linear_.back();
    }
    sequence_.push_back(layer);
    param += layer->parameter_count();
    layout = layer->output_layout();
    if (i + 1 < n && keeps_16bit_) {  // made above, before the layer
      const ActivationLayer& made = activations_.back();
      MESHTRAIN_REQUIRE(made.output_width() == layer->output_width() &&
                            made.output_offset() == layer->output_offset() &&
                            made.output_layout() == layout,
                        "layer ", i, "'s activation was made for another output");
      sequence_.push_back(&activations_.back());
    } else if (i + 1 < n) {
      activations_.emplace_back(activation, "layers/" + std::to_string(i) + "/activation", rows_,
                                layer->output_width(), layout, layer->output_offset(),
                                compute_dtype_, keeps_16bit_);
      sequence_.push_back(&activations_.back());
      if (dropout > 0.0) {
        dropouts_.emplace_back(
            dropout, static_cast<int64_t>(i), "layers/" + std::to_string(i) + "/dropout", rows_,
            layer->output_width(), layout, layer->output_offset(), compute_dtype_);
        sequence_.push_back(&dropouts_.back());
      }
    }
  }

  finish(context);
}

void Mlp::allocate(const std::vector<ParameterShape>& shapes, const SpecLookup& spec_of,
                   ParallelContext& context, const Mlp* shares) {
  if (rows_ < 1) MESHTRAIN_BAD_INPUT("the local batch must have at least one row, got ", rows_);
  const Mesh& mesh = context.mesh();
  for (size_t i = 0; i < shapes.size(); ++i) {
    const ParameterShape& p = shapes[i];
    const PartitionSpec spec = spec_of(p.name);
    spec.check_axes(mesh, p.name);
    check_divisible(p.shape, spec, mesh, p.name);
    if (shares) {
      MESHTRAIN_REQUIRE(i < shares->params_.size() && shares->params_[i].name == p.name &&
                            shares->params_[i].global_shape == p.shape &&
                            shares->params_[i].spec == spec,
                        "a model sharing parameters must have the same ones: '", p.name, "'");
      params_.push_back(shares->params_[i]);  // shallow: the same Views
      grads_.push_back(shares->grads_[i]);
      continue;
    }
    params_.push_back(ShardedTensor::allocate(p.name, p.shape, spec, mesh, context.rank()));
    grads_.push_back(ShardedTensor::allocate(p.name, p.shape, spec, mesh, context.rank()));
  }
  MESHTRAIN_REQUIRE(!shares || shares->params_.size() == shapes.size(),
                    "a model sharing parameters must have as many");
}

Mlp::Mlp(const ResidualMlpShape& shape, Activation activation, const SpecLookup& spec_of,
         ParallelContext& context, int64_t local_rows, double dropout,
         const Mlp* shares_parameters_of)
    : sizes_{shape.inputs, shape.outputs},
      activation_(activation),
      rows_(local_rows),
      compute_dtype_(context.precision().param) {
  allocate(residual_mlp_parameter_shapes(shape), spec_of, context,
           shares_parameters_of);  // checks the sizes
  // The MoE blocks below have no dropout layer: the config refuses the two together
  // (model.dropout, framework/train/config_schema.cpp); a model built in code must not ask.
  MESHTRAIN_REQUIRE(!(shape.moe.any() && dropout > 0.0), "Mlp: dropout ", dropout,
                    " with MoE blocks, which have no dropout");
  // Each layer takes the next parameters in parameters() order.
  size_t param = 0;
  auto next = [this, &param]() {
    const size_t p = param++;
    return ParameterRef{&params_[p], &grads_[p]};
  };
  auto linear = [&](FeatureLayout layout, bool input_grad_partial = false,
                    const LinearSharedBuffers* shared = nullptr) {
    const ParameterRef weight = next();
    const ParameterRef bias = next();
    return std::make_unique<Linear>(weight, bias, layout, rows_, context, input_grad_partial,
                                    shared);
  };
  // 16-bit storage of the blocks' hidden activations (docs/mixed_precision.md, "Compute and
  // memory on this build"), under a 16-bit param_dtype for blocks without MoE or dropout on a
  // mesh without a feature axis (SwiGLU blocks alike: see the gated branch below, gate's output
  // in a second shared buffer `model/gate_work`): the up projection writes its output
  // into one fp32 working buffer [rows, hidden] that every block shares, the activation works in
  // place there and keeps its output (and, but for relu and the identity, its input) as 16 bits
  // (in the same pass), and the down projection keeps nothing of its input but that 16-bit
  // output: in backward it widens it into the shared buffer for its weight gradient and writes its
  // input gradient over it, through which the activation's backward runs in place and which the
  // up projection reads as its dY. The values are those of the simulated path (fp32 buffers
  // holding 16-bit values), bit for bit.
  // With norms, the residual stream too: the input projection writes the stream into one fp32
  // buffer [rows, width] (`model/stream`), each block's norm keeps its input (the stream) and its
  // output as 16 bits in the passes that read and write them, writes its fp32 output into a
  // second shared buffer (`model/norm_work`), which the up projection reads and keeps no more of
  // than the norm's 16-bit output, the down projection writes its output there too, and the
  // block adds it into the stream in place. Backward: the blocks pass the input gradient down in
  // a third shared buffer (`model/stream_grad`) and add into it in place; the up projection widens
  // its kept input into `model/norm_work` and writes its input gradient over it, the norm widens
  // its kept input into `model/stream` (free in backward) and writes its input gradient in place.
  // The output norm and the last layer alike. 16-bit values in fp32 buffers are widened and
  // rounded exactly, so the values are the simulated path's, bit for bit.
  // framework/train/memory_plan.cpp counts the same buffers under the same condition
  // (partition/sixteen_bit_storage.hpp).
  ActivationStorageQuery storage_query;
  storage_query.sixteen_bit_compute =
      compute_dtype_ != Dtype::fp32 && context.stores_16bit_activations();
  storage_query.residual = true;
  storage_query.norms = shape.norm;
  storage_query.moe = shape.moe.any();
  storage_query.dropout = dropout > 0.0;
  storage_query.feature_parallel = context.feature_parallel();
  const ActivationStorage storage = sixteen_bit_activation_storage(storage_query);
  hidden_16bit_ = storage.residual_hidden;
  stream_16bit_ = storage.residual_stream;
  if (hidden_16bit_) hidden_work_ = Matrix("model/hidden_work", rows_, shape.hidden);
  if (hidden_16bit_ && shape.gated) gate_work_ = Matrix("model/gate_work", rows_, shape.hidden);
  if (stream_16bit_) {
    stream_ = Matrix("model/stream", rows_, shape.width);
    norm_work_ = Matrix("model/norm_work", rows_, shape.width);
    stream_grad_ = Matrix("model/stream_grad", rows_, shape.width);
  }
  NormSharedBuffers norm_buffers;
  norm_buffers.output = norm_work_;
  norm_buffers.input_work = stream_;
  ResidualSharedBuffers block_buffers;
  block_buffers.output = stream_;
  block_buffers.input_grad = stream_grad_;
  const ResidualSharedBuffers* shared_stream = stream_16bit_ ? &block_buffers : nullptr;
  // The layout of the linear layer whose weight is parameter p, fed `layout`.
  auto layout_of = [&](size_t p, FeatureLayout layout) {
    const ShardedTensor& w = params_[p];
    const ShardedTensor& b = params_[p + 1];
    return decide_linear_layout(linear_layer_name(w.name), {w.name, w.global_shape, w.spec},
                                {b.name, b.global_shape, b.spec}, context.mesh(),
                                {context.batch_axes(), context.feature_axis()}, layout);
  };
  auto norm = [&](const std::string& name, FeatureLayout layout) -> std::unique_ptr<Layer> {
    std::unique_ptr<FeatureNorm> layer;
    const ParameterRef scale = next();
    const NormSharedBuffers* shared = stream_16bit_ ? &norm_buffers : nullptr;
    if (shape.norm_kind == NormKind::layernorm) {
      const ParameterRef bias = next();
      layer = std::make_unique<LayerNorm>(name, scale, bias, layout, rows_, context, kLayerNormEps,
                                          shared);
    } else {
      layer = std::make_unique<RMSNorm>(name, scale, layout, rows_, context, kRmsNormEps, shared);
    }
    norms_.push_back(layer.get());
    return layer;
  };
  auto add = [this](std::unique_ptr<Layer> layer) {
    sequence_.push_back(layer.get());
    owned_.push_back(std::move(layer));
  };

  LinearSharedBuffers input_buffers;  // 16-bit storage: the stream starts in model/stream
  input_buffers.output = stream_;
  std::unique_ptr<Linear> input =
      linear(FeatureLayout::replicated, false,
             stream_16bit_ ? &input_buffers : nullptr);  // x has all features
  // The residual stream as the input projection leaves it (split under tp).
  const FeatureLayout layout = input->output_layout();
  const int64_t offset = input->output_offset(), width = input->output_width();
  add(std::move(input));
  for (int64_t i = 0; i < shape.depth; ++i) {
    const std::string block = "blocks/" + std::to_string(i);
    std::vector<std::unique_ptr<Layer>> f;
    if (shape.norm) f.push_back(norm(block + "/norm", layout));
    if (shape.moe.is_moe(i)) {  // one MoE layer of feed-forward experts instead of up, down
      MoeFeedForward experts;
      experts.router = next();
      if (shape.gated) {
        experts.gate_weight = next();
        experts.gate_bias = next();
      }
      experts.up_weight = next();
      experts.up_bias = next();
      experts.down_weight = next();
      experts.down_bias = next();
      experts.activation = activation;
      f.push_back(std::make_unique<MoeLayer>(experts, shape.moe.top_k, shape.moe.aux_loss_coef,
                                             layout, rows_, context));
      add(std::make_unique<ResidualBlock>(block, std::move(f), layout, offset, rows_, width,
                                          compute_dtype_));
      continue;
    }
    if (shape.gated && hidden_16bit_) {
      // 16-bit storage (layers/swiglu.hpp): gate writes into model/gate_work, up into
      // model/hidden_work, where the SwiGLU writes its output over up's and keeps gate, up and
      // output as 16 bits; with the stream's storage both read the norm's output kept as 16 bits,
      // widened in backward into model/norm_work (up) and model/stream (gate, free in backward),
      // where each writes its input gradient (gate's then added into up's).
      LinearSharedBuffers gate_buffers, up_buffers;
      gate_buffers.output = gate_work_;
      up_buffers.output = hidden_work_;
      if (stream_16bit_) {
        gate_buffers.work = stream_;
        gate_buffers.kept_input = up_buffers.kept_input = norms_.back()->kept_output();
        up_buffers.work = norm_work_;
      }
      std::unique_ptr<Linear> gate = linear(layout, false, &gate_buffers);
      std::unique_ptr<Linear> up = linear(layout, false, &up_buffers);
      auto swiglu = std::make_unique<SwiGlu>(block + "/swiglu", std::move(gate), std::move(up),
                                             rows_, compute_dtype_, nullptr, /*keeps_16bit=*/true);
      LinearSharedBuffers down_buffers;
      down_buffers.work = hidden_work_;
      down_buffers.kept_input = swiglu->kept_output();
      if (stream_16bit_) down_buffers.output = norm_work_;  // added into the stream at once
      const FeatureLayout hidden_layout = swiglu->output_layout();
      f.push_back(std::move(swiglu));
      f.push_back(linear(hidden_layout, false, &down_buffers));  // down
      add(std::make_unique<ResidualBlock>(block, std::move(f), layout, offset, rows_, width,
                                          compute_dtype_, shared_stream));
      continue;
    } else if (shape.gated) {
      // Gate and up column-parallel on the split stream share one gather of it.
      const bool shared =
          shares_input_gather(layout_of(param, layout), layout_of(param + 2, layout));
      const FeatureLayout fed = shared ? FeatureLayout::replicated : layout;
      std::unique_ptr<Linear> gate = linear(fed, shared);
      std::unique_ptr<Linear> up = linear(fed, shared);
      f.push_back(std::make_unique<SwiGlu>(
          block + "/swiglu", std::move(gate), std::move(up), rows_, compute_dtype_,
          shared ? context.comm({context.feature_axis()}) : nullptr));
    } else if (hidden_16bit_) {
      LinearSharedBuffers up_buffers;
      up_buffers.output = hidden_work_;
      if (stream_16bit_) {  // the norm's output kept as 16 bits, widened into model/norm_work
        up_buffers.work = norm_work_;
        up_buffers.kept_input = norms_.back()->kept_output();
      }
      std::unique_ptr<Linear> up = linear(layout, false, &up_buffers);
      auto act = std::make_unique<ActivationLayer>(
          activation, block + "/activation", rows_, up->output_width(), up->output_layout(),
          up->output_offset(), compute_dtype_, /*keeps_16bit=*/true);
      LinearSharedBuffers down_buffers;
      down_buffers.work = hidden_work_;
      down_buffers.kept_input = act->kept_output();
      if (stream_16bit_) down_buffers.output = norm_work_;  // added into the stream at once
      const FeatureLayout hidden_layout = act->output_layout();
      f.push_back(std::move(up));
      f.push_back(std::move(act));
      f.push_back(linear(hidden_layout, false, &down_buffers));  // down
      add(std::make_unique<ResidualBlock>(block, std::move(f), layout, offset, rows_, width,
                                          compute_dtype_, shared_stream));
      continue;
    } else {
      std::unique_ptr<Linear> up = linear(layout);
      auto act = std::make_unique<ActivationLayer>(activation, block + "/activation", rows_,
                                                   up->output_width(), up->output_layout(),
                                                   up->output_offset(), compute_dtype_);
      f.push_back(std::move(up));
      f.push_back(std::move(act));
    }
    if (dropout > 0.0) {  // on the block's hidden activations, keyed by the block's index
      const Layer& hidden = *f.back();
      f.push_back(std::make_unique<DropoutLayer>(dropout, i, block + "/dropout", rows_,
                                                 hidden.output_width(), hidden.output_layout(),
                                                 hidden.output_offset(), compute_dtype_));
    }
    f.push_back(linear(f.back()->output_layout()));  // down
    add(std::make_unique<ResidualBlock>(block, std::move(f), layout, offset, rows_, width,
                                        compute_dtype_));
  }
  if (shape.norm) add(norm("output_norm", layout));
  LinearSharedBuffers last_buffers;  // 16-bit storage: the output norm's output kept as 16 bits
  if (stream_16bit_) {
    last_buffers.work = norm_work_;
    last_buffers.kept_input = norms_.back()->kept_output();
  }
  add(linear(layout, false, stream_16bit_ ? &last_buffers : nullptr));
  MESHTRAIN_REQUIRE(param == params_.size(), "residual_mlp took ", param, " of ", params_.size(),
                    " parameters");
  finish(context);
}

void Mlp::finish(ParallelContext& context) {
  LayerScratchNeeds needs;
  for (const Layer* layer : sequence_) needs.merge(layer->scratch_needs());

  // FSDP prefetch (overlap): each layer starts the gather of the next layer with parameters
  // in the pass's direction, when that one can prefetch.
  const size_t count = sequence_.size();
  forward_prefetch_.assign(count, nullptr);
  backward_prefetch_.assign(count, nullptr);
  bool prefetch = false;
  if (context.overlap()) {
    auto prefetchable = [](Layer* l) { return l->parameter_count() > 0; };
    for (size_t k = 0; k < count; ++k) {
      for (size_t j = k + 1; j < count; ++j) {
        if (!prefetchable(sequence_[j])) continue;
        if (sequence_[j]->can_prefetch_weight()) forward_prefetch_[k] = sequence_[j];
        break;
      }
      for (size_t j = k; j-- > 0;) {
        if (!prefetchable(sequence_[j])) continue;
        if (sequence_[j]->can_prefetch_weight()) backward_prefetch_[k] = sequence_[j];
        break;
      }
      prefetch = prefetch || sequence_[k]->can_prefetch_weight();
    }
  }
  scratch_ = LayerScratch(needs, prefetch);
  inference_ = inference::Sequence(sequence_);
  // One prefetch is in flight at a time (the scratch has one prefetch buffer): each
  // communicator a prefetched weight is gathered over reserves one started all-gather of the
  // largest such weight, so that a prefetch beside DP buckets on the same communicator does
  // not grow its request pool in a step.
  if (prefetch) {
    std::map<Communicator*, ShardedParameter::PrefetchGather> largest;
    for (size_t k = 0; k < count; ++k) {
      for (Layer* target : {forward_prefetch_[k], backward_prefetch_[k]}) {
        if (!target) continue;
        for (ShardedParameter* p : target->sharded_parameters()) {
          if (!p->can_prefetch()) continue;
          const ShardedParameter::PrefetchGather g = p->prefetch_gather();
          ShardedParameter::PrefetchGather& most = largest[g.group];
          if (g.send_elements > most.send_elements) most = g;
        }
      }
    }
    for (const auto& [group, g] : largest) {
      if (g.sixteen_bit_copy) {
        group->reserve_started_16bit_all_gathers(1, g.send_elements, g.wire);
      } else {
        group->reserve_started_all_gathers(1, g.send_elements, g.wire);
      }
    }
  }
  if (compute_dtype_ != Dtype::fp32 && !keeps_16bit_) {
    input_ = Matrix("model/input", rows_, sizes_.front());
  }
  if (compute_dtype_ != Dtype::fp32 || context.precision().needs_loss_scaling()) {
    output_grad_ = Matrix("model/output_grad", rows_, output_width());
  }
  // Which gradients are left partial, decided once for every reader (the layers' passes,
  // the buckets, reduce_gradients(), ZeRO-1).
  reductions_ = GradientReductionPlan(sequence_);
  if (context.overlap()) {
    // One entry per layer of the sequence (LayerPass::index); only the layers that defer
    // their reduction take part.
    buckets_ = GradientBuckets(reductions_.bucket_gradients(), context.bucket_mb(),
                               context.precision().reduce);
  }
}

void Mlp::reserve_reductions(GradientReduction reduction) const {
  for (size_t k = 0; k < sequence_.size(); ++k) {
    // A deferrable gradient's all-reduce runs in a bucket, in ZeRO-1's reduce-scatter (which
    // reserves its own), or blocking (by the layer, or once per step).
    const bool deferred = reductions_.layer_group(k) != nullptr;
    const bool elsewhere =
        deferred && (reduction == GradientReduction::zero1 ||
                     (reduction == GradientReduction::in_backward && !buckets_.empty()));
    for (const ShardedParameter* p : sequence_[k]->sharded_parameters()) {
      p->reserve_reductions(elsewhere);
    }
  }
}

std::size_t Mlp::store_gradients_16bit(const ParallelContext& context) {
  const MixedPrecision& precision = context.precision();
  GradientStorageQuery query;
  query.precision = precision;
  query.kernel_writes_16bit = gemm_kernel_writes_16bit(precision.param);
  query.reduced_in_backward = true;  // the caller's promise (see mlp.hpp)
  const Dtype dtype = weight_gradient_storage(query);
  if (dtype == Dtype::fp32) return 0;
  // The plain MLP's Linear layers, by their index in the sequence (the buckets' layer index):
  // those reduced in a DP group (a layer group: blocking or in buckets), a tensor-parallel layer's
  // all-reduced by itself over the batch axes, and those reduced by no one (one rank, TP alone).
  std::vector<std::pair<size_t, ShardedParameter*>> weights;
  for (size_t k = 0; k < sequence_.size(); ++k) {
    Linear* linear = nullptr;
    for (Linear& l : linear_) {
      if (&l == sequence_[k]) linear = &l;
    }
    if (linear == nullptr) continue;
    ShardedParameter* w = linear->sharded_parameters().front();
    // The weight-gradient product's algorithm, as the Linear chose it at construction.
    const CollectiveMatmulAlgorithm weight_grad =
        layer_matmul_algorithms(linear->layout(), rows_, context.matmul_algorithm(),
                                collective_matmul_hardware(), precision.param)
            .weight_grad;
    if (w->gathered() || w->grad().stored_16bit() ||
        !stores_weight_gradient_16bit(linear->layout(), weight_grad)) {
      continue;
    }
    weights.emplace_back(k, w);
  }
  if (weights.empty()) return 0;
  // The fp32 gradients freed, each replaced by its 16 bits (at construction, not in a step):
  // under overlap a DP layer group's range of the buckets' 16-bit buffer, which backward's GEMM
  // writes and the bucket's all-reduce sums in place (nothing allocated); else a buffer of its own.
  std::map<Communicator*, size_t> largest;  // per group, the blocking ones
  for (auto& [k, w] : weights) {
    ShardedTensor& g = w->grad();
    const size_t elements = g.local.extent(0);
    const bool bucketed = !buckets_.empty() && reductions_.layer_group(k) != nullptr;
    uint16_t* home = bucketed ? buckets_.keep_in_wire(k, 0) : nullptr;
    g.local = Vector();
    g.storage = dtype;
    // Under overlap unmanaged: the buckets own the memory (the model owns both).
    g.bits = home != nullptr ? HalfBits(home, elements) : HalfBits(g.name, elements);
    if (home == nullptr && w->allreduce_group() != nullptr) {
      size_t& most = largest[w->allreduce_group()];
      most = std::max(most, elements);
    }
  }
  // Each blocking one summed in place by a started 16-bit all-reduce, one at a time: one request
  // slot per group, for its largest (ShardedParameter::reserve_reductions leaves these out).
  for (auto& [group, elements] : largest) {
    group->reserve_started_16bit_all_reduces(1, elements, dtype);
  }
  return weights.size();
}

double Mlp::aux_loss() const {
  double sum = 0.0;
  for (const Layer* layer : sequence_) sum += layer->aux_loss();
  return sum;
}

void Mlp::initialize(InitScheme scheme, uint64_t seed) {
  masters_written();
  for (auto& p : params_) meshtrain::initialize(p, scheme, seed);
  for (FeatureNorm* norm : norms_) norm->initialize_parameters();
}

MatrixView Mlp::forward(MatrixView x, const TrainingPass* training) {
  return forward_pass(x, training, /*for_derivatives=*/false);
}

MatrixView Mlp::forward_for_derivatives(MatrixView x) {
  return forward_pass(x, nullptr, /*for_derivatives=*/true);
}

MatrixView Mlp::forward_pass(MatrixView x, const TrainingPass* training, bool for_derivatives) {
  MatrixView input = x;
  if (keeps_16bit_) {
    MESHTRAIN_REQUIRE(static_cast<int64_t>(x.extent(0)) == rows_ &&
                          static_cast<int64_t>(x.extent(1)) == sizes_.front(),
                      "model input is [", x.extent(0), ", ", x.extent(1), "], expected [", rows_,
                      ", ", sizes_.front(), "]");
    // Cast into the first working buffer, and kept as 16 bits, in one pass; under a feature axis
    // the raw batch, of which the first layer keeps its slice, rounded, itself.
    if (input_16bit_.data() != nullptr) {
      input = work_view(0, sizes_.front());
      round_copy_keeping_16bit(x, input, input_16bit_, compute_dtype_);
    }
  } else if (compute_dtype_ != Dtype::fp32) {  // the model input cast to the compute dtype
    MESHTRAIN_REQUIRE(x.extent(0) == input_.extent(0) && x.extent(1) == input_.extent(1),
                      "model input is [", x.extent(0), ", ", x.extent(1), "], expected [",
                      input_.extent(0), ", ", input_.extent(1), "]");
    round_copy(x, input_, compute_dtype_);
    input = input_;
  }
  for (size_t k = 0; k < sequence_.size(); ++k) {
    LayerPass pass;
    pass.scratch = &scratch_;
    pass.prefetch = forward_prefetch_[k];
    pass.training = training;
    pass.inference_gemms = for_derivatives;
    pass.derivative_forward = for_derivatives;
    TraceSpan span(tracer().on() ? trace_name(k) : "", TraceKind::layer);
    span.detail("forward");
    input = sequence_[k]->forward(input, pass);
  }
  return input;
}

MatrixView Mlp::work_view(size_t buffer, int64_t width) const {
  return MatrixView(work_[buffer].data(), rows_, width);
}

MatrixView Mlp::infer(MatrixView x) {
  if (!inference::runs_host_kernels() || compute_dtype_ != Dtype::fp32) return forward(x);
  MESHTRAIN_REQUIRE(static_cast<int64_t>(x.extent(1)) == sizes_.front(), "model input is [",
                    x.extent(0), ", ", x.extent(1), "], expected [", rows_, ", ", sizes_.front(),
                    "]");
  LayerPass pass;
  pass.scratch = &scratch_;
  return inference_.run(x, pass);
}

// A layer's name in traces: what its describe() line starts with ("layers/0"), made once for
// every layer on the first traced step (the pointers stay valid: the vector never grows).
const char* Mlp::trace_name(size_t k) {
  if (trace_names_.size() != sequence_.size()) {
    trace_names_.resize(sequence_.size());
    // A layer without a line of its own (an activation) is named after the one before it.
    for (size_t i = 0; i < sequence_.size(); ++i) {
      const std::string line = sequence_[i]->describe();
      const std::string head = line.substr(0, line.find(':'));
      trace_names_[i] = !head.empty() ? head
                        : i > 0       ? trace_names_[i - 1] + " activation"
                                      : "layer 0";
    }
  }
  return trace_names_[k].c_str();
}

void Mlp::backward(MatrixView output_grad, bool reduce, float loss_scale) {
  // What the layers the plan defers do with those gradients, decided here only:
  // all-reduced now; in buckets (DP overlap: each layer reports its finished gradients,
  // and a bucket's all-reduce starts as it completes while the layers below compute); or
  // left partial for reduce_gradients() / ZeRO-1.
  const DeferredReduction deferred = !reduce            ? DeferredReduction::later
                                     : buckets_.empty() ? DeferredReduction::now
                                                        : DeferredReduction::in_buckets;
  MatrixView grad = output_grad;
  if (compute_dtype_ != Dtype::fp32 || loss_scale != 1.0f) {
    // The loss gradient times the loss scale, cast to the compute dtype (the logits' dtype).
    MESHTRAIN_REQUIRE(output_grad.extent(0) == output_grad_.extent(0) &&
                          output_grad.extent(1) == output_grad_.extent(1),
                      "output gradient is [", output_grad.extent(0), ", ", output_grad.extent(1),
                      "], expected [", output_grad_.extent(0), ", ", output_grad_.extent(1), "]");
    const MatrixView scaled = output_grad_;
    const Dtype dtype = compute_dtype_;
    Kokkos::parallel_for(
        MESHTRAIN_LABEL("meshtrain::scale_output_grad"),
        Kokkos::MDRangePolicy<Kokkos::Rank<2>>(
            device_space(), {0, 0},
            {static_cast<int64_t>(scaled.extent(0)), static_cast<int64_t>(scaled.extent(1))}),
        KOKKOS_LAMBDA(const int64_t i, const int64_t j) {
          scaled(i, j) = round_to(loss_scale * output_grad(i, j), dtype);
        });
    grad = scaled;
  }
  for (size_t k = sequence_.size(); k-- > 0;) {
    const LayerPass pass{
        &scratch_, backward_prefetch_[k], reductions_.for_layer(k, deferred), &buckets_, k,
        loss_scale};
    TraceSpan span(tracer().on() ? trace_name(k) : "", TraceKind::layer);
    span.detail("backward");
    grad = sequence_[k]->backward(grad, /*need_input_grad=*/k > 0, pass);
  }
  // The gradients are final from here on.
  if (deferred == DeferredReduction::in_buckets) buckets_.wait_all();
}

void Mlp::reduce_gradients() {
  reductions_.all_reduce_deferred();
}

namespace {
void require_fp32(Dtype dtype) {
  if (dtype != Dtype::fp32) {
    MESHTRAIN_BAD_INPUT("derivatives with respect to the input are computed in fp32; this model ",
                        "computes in ", to_string(dtype));
  }
}

// Each layer answers whether its passes carry the derivative streams `what` needs exactly;
// `built_for` names the layers that do (a layer without the second-order rules would take the
// Laplacian's streams for plain tangents: wrong values, silently).
void require_every_layer(const std::vector<Layer*>& sequence, bool (Layer::*supports)() const,
                         const char* what, const char* built_for) {
  for (const Layer* layer : sequence) {
    if ((layer->*supports)()) continue;
    const std::string line = layer->describe();
    MESHTRAIN_BAD_INPUT(what, " is built for ", built_for, ", which this model has",
                        line.empty() ? std::string() : " ('" + line + "')");
  }
}
}  // namespace

MatrixView Mlp::backward_cotangents(MatrixView dy) {
  return backward_cotangents(dy, 0, rows_);
}

bool Mlp::cotangents_by_rows() const {
  for (const Layer* layer : sequence_) {
    if (!layer->cotangents_by_rows()) return false;
  }
  return true;
}

MatrixView Mlp::backward_cotangents(MatrixView dy, int64_t first_row, int64_t rows) {
  require_fp32(compute_dtype_);
  const bool whole = first_row == 0 && rows == rows_;  // the pass over every row
  if (!whole && (rows <= 0 || first_row < 0 || first_row + rows > rows_)) {
    MESHTRAIN_BAD_INPUT("Mlp::backward_cotangents: value rows [", first_row, ", ", first_row + rows,
                        ") are not a block of the forward's ", rows_,
                        " rows (first_row >= 0, rows > 0, first_row + rows <= ", rows_, ")");
  }
  const bool blocked = !whole;
  if (blocked && !cotangents_by_rows()) {
    MESHTRAIN_BAD_INPUT("Mlp::backward_cotangents: value rows [", first_row, ", ", first_row + rows,
                        ") of ", rows_, ": a layer of this model takes its ",
                        "cotangents only for every row (cotangents_by_rows() is false: tp, a ",
                        "gathered parameter, SwiGLU, MoE, dropout after a training forward, or ",
                        "device kernels)");
  }
  MESHTRAIN_REQUIRE(static_cast<int64_t>(dy.extent(1)) == output_width(), "output cotangents are [",
                    dy.extent(0), ", ", dy.extent(1), "], expected [", rows, " x directions, ",
                    output_width(), "]");
  MatrixView g = dy;
  for (size_t k = sequence_.size(); k-- > 0;) {
    LayerPass pass;
    pass.scratch = &scratch_;
    pass.cotangent_first_row = blocked ? first_row : 0;
    pass.cotangent_rows = blocked ? rows : 0;
    TraceSpan span(tracer().on() ? trace_name(k) : "", TraceKind::layer);
    span.detail("cotangents");
    g = sequence_[k]->backward_cotangents(g, pass);
  }
  return g;
}

MatrixView Mlp::forward_tangents(MatrixView dx) {
  return tangent_pass(dx, false);
}

MatrixView Mlp::forward_laplacian(MatrixView streams) {
  require_laplacian_layers();
  const int64_t streams_per_row = static_cast<int64_t>(streams.extent(0)) / rows_;
  if (streams_per_row > 2 * laplacian_directions_) {
    MESHTRAIN_BAD_INPUT("the forward Laplacian got ", streams_per_row / 2,
                        " directions a row, but reserve_laplacian reserved ", laplacian_directions_,
                        " (call reserve_laplacian(k) before it)");
  }
  return tangent_pass(streams, true);
}

void Mlp::require_laplacian_layers() const {
  require_every_layer(sequence_, &Layer::supports_laplacian, "the forward Laplacian",
                      "linear layers, activations, SwiGLU, LayerNorm, RMSNorm, dropout, MoE "
                      "layers and residual blocks of them");
}

MatrixView Mlp::tangent_pass(MatrixView dx, bool second_order) {
  require_fp32(compute_dtype_);
  MESHTRAIN_REQUIRE(static_cast<int64_t>(dx.extent(1)) == sizes_.front(), "input tangents are [",
                    dx.extent(0), ", ", dx.extent(1), "], expected [", rows_, " x directions, ",
                    sizes_.front(), "]");
  MatrixView t = dx;
  for (size_t k = 0; k < sequence_.size(); ++k) {
    LayerPass pass;
    pass.scratch = &scratch_;
    TraceSpan span(tracer().on() ? trace_name(k) : "", TraceKind::layer);
    pass.second_order = second_order;
    span.detail(second_order ? "laplacian" : "tangents");
    t = sequence_[k]->forward_tangents(t, pass);
  }
  return t;
}

void Mlp::reserve_tangents(int64_t directions) {
  MESHTRAIN_REQUIRE(directions >= 1, "Mlp::reserve_tangents: ", directions, " directions");
  LayerScratchNeeds needs;
  for (Layer* layer : sequence_) {
    layer->reserve_tangents(directions);
    needs.merge(layer->scratch_needs());
  }
  if (needs.matmul > scratch_.matmul.capacity_bytes()) scratch_.matmul.reserve(needs.matmul);
}

void Mlp::reserve_cotangents(int64_t directions) {
  MESHTRAIN_REQUIRE(directions >= 1, "Mlp::reserve_cotangents: ", directions, " directions");
  LayerScratchNeeds needs;
  for (Layer* layer : sequence_) {
    layer->reserve_cotangents(directions);
    needs.merge(layer->scratch_needs());
  }
  if (needs.matmul > scratch_.matmul.capacity_bytes()) scratch_.matmul.reserve(needs.matmul);
}

void Mlp::reserve_derivative_forward(bool for_cotangents) {
  for (Layer* layer : sequence_) layer->reserve_derivative_forward(for_cotangents);
}

void Mlp::reserve_tangent_backward(int64_t directions) {
  MESHTRAIN_REQUIRE(directions >= 1, "Mlp::reserve_tangent_backward: ", directions, " directions");
  if (compute_dtype_ != Dtype::fp32) {
    MESHTRAIN_BAD_INPUT("training on derivatives is fp32 only; this model computes in ",
                        to_string(compute_dtype_));
  }
  require_every_layer(sequence_, &Layer::supports_tangent_backward, "training on derivatives",
                      "linear layers, activations, SwiGLU, LayerNorm, RMSNorm, dropout, MoE "
                      "layers and residual blocks of them");
  reserve_layers_tangent_backward(directions);
}

// Each layer's room for `streams` tangent streams a row in backward, and the shared matmul
// scratch they need.
void Mlp::reserve_layers_tangent_backward(int64_t streams) {
  LayerScratchNeeds needs;
  for (Layer* layer : sequence_) {
    layer->reserve_tangent_backward(streams);
    needs.merge(layer->scratch_needs());
  }
  if (needs.matmul > scratch_.matmul.capacity_bytes()) scratch_.matmul.reserve(needs.matmul);
}

void Mlp::reserve_laplacian(int64_t directions) {
  MESHTRAIN_REQUIRE(directions >= 1, "Mlp::reserve_laplacian: ", directions, " directions");
  if (compute_dtype_ != Dtype::fp32) {
    MESHTRAIN_BAD_INPUT("the forward Laplacian is fp32 only; this model computes in ",
                        to_string(compute_dtype_));
  }
  require_laplacian_layers();
  reserve_layers_tangent_backward(2 * directions);  // k tangents and k second-order streams
  laplacian_directions_ = std::max(laplacian_directions_, directions);
}

void Mlp::backward_with_tangents(MatrixView output_grad, MatrixView tangent_grad, bool reduce) {
  backward_through_tangents(output_grad, tangent_grad, reduce, false);
}

void Mlp::backward_with_laplacian(MatrixView output_grad, MatrixView stream_grad, bool reduce) {
  backward_through_tangents(output_grad, stream_grad, reduce, true);
}

void Mlp::backward_through_tangents(MatrixView output_grad, MatrixView tangent_grad, bool reduce,
                                    bool second_order) {
  require_fp32(compute_dtype_);
  MESHTRAIN_REQUIRE(static_cast<int64_t>(output_grad.extent(1)) == output_width() &&
                        static_cast<int64_t>(tangent_grad.extent(1)) == output_width(),
                    "output gradient [", output_grad.extent(0), ", ", output_grad.extent(1),
                    "] and tangent gradient [", tangent_grad.extent(0), ", ",
                    tangent_grad.extent(1), "], expected ", output_width(), " columns");
  // No buckets and no prefetch: each layer reduces its own gradients now, or leaves them for
  // reduce_gradients(), and gathers its weight when it runs.
  const DeferredReduction deferred = reduce ? DeferredReduction::now : DeferredReduction::later;
  MatrixView grad = output_grad, tangent = tangent_grad;
  for (size_t k = sequence_.size(); k-- > 0;) {
    LayerPass pass;
    pass.scratch = &scratch_;
    pass.deferred = reductions_.for_layer(k, deferred);
    pass.index = k;
    pass.second_order = second_order;
    TraceSpan span(tracer().on() ? trace_name(k) : "", TraceKind::layer);
    span.detail(second_order ? "backward with laplacian" : "backward with tangents");
    MatrixView tangent_in;
    grad = sequence_[k]->backward_with_tangents(grad, tangent, /*need_input_grad=*/k > 0, pass,
                                                &tangent_in);
    tangent = tangent_in;
  }
}

std::vector<std::string> Mlp::describe() const {
  std::vector<std::string> out;
  for (const Layer* layer : sequence_) {
    if (layer->parameter_count() > 0) out.push_back(layer->describe());
  }
  return out;
}

}  // namespace meshtrain
