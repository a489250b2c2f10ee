#include "layers/mlp.hpp"

#include "framework/core/kernel_label.hpp"
#include "framework/core/precision.hpp"
#include "partition/error.hpp"

namespace meshtrain {

SpecLookup specs_from_plan(const ShardingPlan& plan) {
  return [&plan](const std::string& name) { return plan.find(name).spec; };
}

Mlp::Mlp(const std::vector<int64_t>& sizes, Activation activation, const SpecLookup& spec_of,
         ParallelContext& context, int64_t local_rows)
    : sizes_(sizes),
      activation_(activation),
      rows_(local_rows),
      compute_dtype_(context.precision().param) {
  if (local_rows < 1)
    MESHTRAIN_BAD_INPUT("the local batch must have at least one row, got ", local_rows);
  const std::vector<ParameterShape> shapes = mlp_parameter_shapes(sizes);  // checks sizes
  const Mesh& mesh = context.mesh();
  for (const auto& p : shapes) {
    const PartitionSpec spec = spec_of(p.name);
    spec.check_axes(mesh, p.name);
    check_divisible(p.shape, spec, mesh, p.name);
    params_.push_back(ShardedTensor::allocate(p.name, p.shape, spec, mesh, context.rank()));
    grads_.push_back(ShardedTensor::allocate(p.name, p.shape, spec, mesh, context.rank()));
  }
  const size_t n = sizes.size() - 1;
  layers_.reserve(n);
  LinearScratchNeeds needs;
  FeatureLayout layout = FeatureLayout::replicated;  // x arrives with all features
  for (size_t i = 0; i < n; ++i) {
    layers_.emplace_back(params_[2 * i], params_[2 * i + 1], layout, rows_, context);
    needs.merge(layers_.back().scratch_needs());
    prefetch_ = prefetch_ || (context.overlap() && layers_.back().can_prefetch_weight());
    layout = layers_.back().output_layout();
    if (i + 1 < n) {
      activated_.push_back(Matrix("layers/" + std::to_string(i) + "/activation", rows_,
                                  layers_.back().output_width()));
    }
  }
  scratch_ = LinearScratch(needs, prefetch_);
  if (compute_dtype_ != Dtype::fp32) input_ = Matrix("model/input", rows_, sizes.front());
  if (compute_dtype_ != Dtype::fp32 || context.precision().needs_loss_scaling()) {
    output_grad_ = Matrix("model/output_grad", rows_, layers_.back().output_width());
  }
  if (context.overlap()) {
    std::vector<LayerGradients> reduced;
    for (size_t i = 0; i < n; ++i) {
      reduced.push_back(
          {VectorView(grads_[2 * i].local.data(), grads_[2 * i].local.extent(0)),
           VectorView(grads_[2 * i + 1].local.data(), grads_[2 * i + 1].local.extent(0)),
           layers_[i].deferred_reduction_group()});
    }
    buckets_ = GradientBuckets(reduced, context.bucket_mb(), context.precision().reduce);
  }
}

WeightPrefetch Mlp::prefetch_target(size_t k) {
  if (!prefetch_ || k >= layers_.size() || !layers_[k].can_prefetch_weight()) return {};
  return {&layers_[k], &params_[2 * k]};
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
  for (size_t i = 0; i < layers_.size(); ++i) {
    z = layers_[i].forward(params_[2 * i], params_[2 * i + 1], input, scratch_,
                           prefetch_target(i + 1));
    if (i + 1 < layers_.size()) {
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
  for (size_t k = layers_.size(); k-- > 0;) {
    Linear& layer = layers_[k];
    MatrixView dx =
        layer.backward(params_[2 * k], grads_[2 * k], grads_[2 * k + 1], grad, k > 0, scratch_,
                       reduce, k > 0 ? prefetch_target(k - 1) : WeightPrefetch{}, {buckets, k});
    if (k > 0) {
      // dx is owned by layer k; the pre-activation of layer k-1 is its output buffer.
      activation_backward(activation_, layers_[k - 1].output(), dx, compute_dtype_);
      grad = dx;
    }
  }
  if (buckets) buckets->wait_all();  // the gradients are final from here on
}

void Mlp::reduce_gradients() {
  for (size_t k = 0; k < layers_.size(); ++k) {
    layers_[k].reduce_gradients(grads_[2 * k], grads_[2 * k + 1]);
  }
}

std::vector<std::string> Mlp::describe() const {
  std::vector<std::string> out;
  for (const auto& l : layers_) out.push_back(l.describe());
  return out;
}

}  // namespace meshtrain
