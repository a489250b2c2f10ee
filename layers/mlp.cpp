#include "layers/mlp.hpp"

#include "framework/core/kernel_label.hpp"
#include "framework/core/precision.hpp"
#include "base/error.hpp"

namespace meshtrain {

SpecLookup specs_from_plan(const ShardingPlan& plan) {
  return [&plan](const std::string& name) { return plan.find(name).spec; };
}

Mlp::Mlp(const std::vector<int64_t>& sizes, Activation activation, const SpecLookup& spec_of,
         ParallelContext& context, int64_t local_rows, const MoeSettings& moe)
    : sizes_(sizes),
      activation_(activation),
      rows_(local_rows),
      compute_dtype_(context.precision().param) {
  if (local_rows < 1)
    MESHTRAIN_BAD_INPUT("the local batch must have at least one row, got ", local_rows);
  const std::vector<ParameterShape> shapes = mlp_parameter_shapes(sizes, moe);  // checks sizes
  const Mesh& mesh = context.mesh();
  for (const auto& p : shapes) {
    const PartitionSpec spec = spec_of(p.name);
    spec.check_axes(mesh, p.name);
    check_divisible(p.shape, spec, mesh, p.name);
    params_.push_back(ShardedTensor::allocate(p.name, p.shape, spec, mesh, context.rank()));
    grads_.push_back(ShardedTensor::allocate(p.name, p.shape, spec, mesh, context.rank()));
  }
  const size_t n = sizes.size() - 1;
  for (int64_t layer : moe.layers) {
    if (layer < 0 || layer + 1 >= static_cast<int64_t>(n)) {
      MESHTRAIN_BAD_INPUT("MoE layer ", layer, " is not a hidden layer of a model of ", n,
                          " layers (an MoE layer is followed by an activation)");
    }
  }
  layers_.reserve(n);
  LinearScratchNeeds needs;
  FeatureLayout layout = FeatureLayout::replicated;  // x arrives with all features
  size_t param = 0;
  for (size_t i = 0; i < n; ++i) {
    int64_t width = 0;
    if (moe.is_moe(static_cast<int64_t>(i))) {
      slots_.push_back({true, moe_.size(), param});
      moe_.emplace_back(params_[param], params_[param + 1], params_[param + 2], moe.top_k,
                        moe.aux_loss_coef, layout, rows_, context);
      param += 3;
      layout = moe_.back().output_layout();
      width = moe_.back().output_width();
    } else {
      slots_.push_back({false, layers_.size(), param});
      layers_.emplace_back(params_[param], params_[param + 1], layout, rows_, context);
      param += 2;
      needs.merge(layers_.back().scratch_needs());
      prefetch_ = prefetch_ || (context.overlap() && layers_.back().can_prefetch_weight());
      layout = layers_.back().output_layout();
      width = layers_.back().output_width();
    }
    if (i + 1 < n) {
      activated_.push_back(Matrix("layers/" + std::to_string(i) + "/activation", rows_, width));
    }
  }
  scratch_ = LinearScratch(needs, prefetch_);
  if (compute_dtype_ != Dtype::fp32) input_ = Matrix("model/input", rows_, sizes.front());
  if (compute_dtype_ != Dtype::fp32 || context.precision().needs_loss_scaling()) {
    output_grad_ = Matrix("model/output_grad", rows_, layers_.back().output_width());
  }
  if (context.overlap()) {
    // One entry per linear layer (GradientReady's index); MoE layers reduce their own.
    std::vector<LayerGradients> reduced;
    for (const Slot& slot : slots_) {
      if (slot.moe) continue;
      const ShardedTensor& w = grads_[slot.param];
      const ShardedTensor& b = grads_[slot.param + 1];
      reduced.push_back({VectorView(w.local.data(), w.local.extent(0)),
                         VectorView(b.local.data(), b.local.extent(0)),
                         layers_[slot.index].deferred_reduction_group()});
    }
    buckets_ = GradientBuckets(reduced, context.bucket_mb(), context.precision().reduce);
  }
}

WeightPrefetch Mlp::prefetch_target(size_t k) {
  if (!prefetch_ || k >= slots_.size() || slots_[k].moe) return {};
  Linear& layer = layers_[slots_[k].index];
  if (!layer.can_prefetch_weight()) return {};
  return {&layer, &params_[slots_[k].param]};
}

MatrixView Mlp::output_of(size_t k) const {
  const Slot& slot = slots_[k];
  return slot.moe ? moe_[slot.index].output() : layers_[slot.index].output();
}

double Mlp::aux_loss() const {
  double sum = 0.0;
  for (const MoeLayer& layer : moe_) sum += layer.aux_loss();
  return sum;
}

std::vector<Communicator*> Mlp::deferred_reduction_groups() const {
  std::vector<Communicator*> groups;
  for (const Slot& slot : slots_) {
    if (slot.moe) {
      groups.insert(groups.end(), 3, nullptr);
    } else {
      Communicator* group = layers_[slot.index].deferred_reduction_group();
      groups.insert(groups.end(), 2, group);  // weight, bias
    }
  }
  return groups;
}

void Mlp::initialize(InitScheme scheme, uint64_t seed) {
  for (auto& p : params_) meshtrain::initialize(p, scheme, seed);
}

MatrixView Mlp::forward(MatrixView x) {
  MatrixView input = x;
  if (compute_dtype_ != Dtype::fp32) {  // the model input cast to the compute dtype
    MESHTRAIN_REQUIRE(x.extent(0) == input_.extent(0) && x.extent(1) == input_.extent(1),
                      "model input is [", x.extent(0), ", ", x.extent(1), "], expected [",
                      input_.extent(0), ", ", input_.extent(1), "]");
    round_copy(x, input_, compute_dtype_);
    input = input_;
  }
  MatrixView z;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Slot& slot = slots_[i];
    const size_t p = slot.param;
    if (slot.moe) {
      z = moe_[slot.index].forward(params_[p], params_[p + 1], params_[p + 2], input);
    } else {
      z = layers_[slot.index].forward(params_[p], params_[p + 1], input, scratch_,
                                      prefetch_target(i + 1));
    }
    if (i + 1 < slots_.size()) {
      activation_forward(activation_, z, activated_[i], compute_dtype_);
      input = activated_[i];
    }
  }
  return z;
}

void Mlp::backward(MatrixView output_grad, bool reduce, float loss_scale) {
  // DP overlap: each layer reports its finished gradients to the buckets, which start an
  // all-reduce per completed bucket while the layers below compute.
  GradientBuckets* buckets = reduce && !buckets_.empty() ? &buckets_ : nullptr;
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
        Kokkos::MDRangePolicy<Kokkos::Rank<2>>({0, 0}, {static_cast<int64_t>(scaled.extent(0)),
                                                        static_cast<int64_t>(scaled.extent(1))}),
        KOKKOS_LAMBDA(const int64_t i, const int64_t j) {
          scaled(i, j) = round_to(loss_scale * output_grad(i, j), dtype);
        });
    grad = scaled;
  }
  for (size_t k = slots_.size(); k-- > 0;) {
    const Slot& slot = slots_[k];
    const size_t p = slot.param;
    MatrixView dx;
    if (slot.moe) {
      dx = moe_[slot.index].backward(params_[p], params_[p + 1], grads_[p], grads_[p + 1],
                                     grads_[p + 2], grad, k > 0, loss_scale);
    } else {
      dx = layers_[slot.index].backward(params_[p], grads_[p], grads_[p + 1], grad, k > 0, scratch_,
                                        reduce, k > 0 ? prefetch_target(k - 1) : WeightPrefetch{},
                                        {buckets, slot.index});
    }
    if (k > 0) {
      // dx is owned by layer k; the pre-activation of layer k-1 is its output buffer.
      activation_backward(activation_, output_of(k - 1), dx, compute_dtype_);
      grad = dx;
    }
  }
  if (buckets) buckets->wait_all();  // the gradients are final from here on
}

void Mlp::reduce_gradients() {
  for (const Slot& slot : slots_) {
    if (!slot.moe) layers_[slot.index].reduce_gradients(grads_[slot.param], grads_[slot.param + 1]);
  }
}

std::vector<std::string> Mlp::describe() const {
  std::vector<std::string> out;
  for (const Slot& slot : slots_) {
    out.push_back(slot.moe ? moe_[slot.index].describe() : layers_[slot.index].describe());
  }
  return out;
}

}  // namespace meshtrain
