#include "layers/norm.hpp"

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cmath>
#include <sstream>

#include "base/error.hpp"
#include "framework/core/exec_space.hpp"
#include "framework/core/host_clones.hpp"
#include "framework/core/kernel_label.hpp"
#include "framework/core/kokkos_math.hpp"
#include "framework/core/precision.hpp"
#include "layers/gradient_reduction.hpp"
#include "layers/inference.hpp"

namespace meshtrain {
namespace {

using Range2 = Kokkos::MDRangePolicy<Kokkos::Rank<2>>;
using Rows = Kokkos::RangePolicy<>;
// Row reductions: one team per row, its threads over the row's columns (coalesced on a GPU;
// a team of one thread, the plain loop, on a host backend).
using RowTeams = Kokkos::TeamPolicy<>;
using RowTeam = RowTeams::member_type;

Range2 range_of(const MatrixView& m) {
  return Range2(device_space(), {0, 0},
                {static_cast<int64_t>(m.extent(0)), static_cast<int64_t>(m.extent(1))});
}

// Column sums over the rows (fp32, then rounded to `dtype`, as a 16-bit autograd leaves
// them): dscale(j) = sum_i dy(i, j) x_hat(i, j), dbias(j) = sum_i dy(i, j) (layernorm).
// x_hat from the statistics [rows, 3] = (m0, delta, rstd) as in forward.
void norm_column_sums(MatrixView x, MatrixView dy, MatrixView stats, bool layernorm, Dtype dtype,
                      VectorView dscale, VectorView dbias) {
  const int64_t rows = static_cast<int64_t>(x.extent(0));
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::norm_param_grad"),
      Rows(device_space(), 0, static_cast<int64_t>(x.extent(1))), KOKKOS_LAMBDA(const int64_t j) {
        float ss = 0.0f, sb = 0.0f;
        for (int64_t i = 0; i < rows; ++i) {
          const float x_hat = layernorm ? ((x(i, j) - stats(i, 0)) - stats(i, 1)) * stats(i, 2)
                                        : x(i, j) * stats(i, 2);
          ss += dy(i, j) * x_hat;
          sb += dy(i, j);
        }
        dscale(j) = round_to(ss, dtype);
        if (layernorm) dbias(j) = round_to(sb, dtype);
      });
}

// The same into full-width vectors full = [dscale (width) | dbias (width)]: this rank's
// columns at [offset, offset + cols), zeros elsewhere.
void norm_column_sums_full(MatrixView x, MatrixView dy, MatrixView stats, bool layernorm,
                           Dtype dtype, int64_t offset, int64_t width, VectorView full) {
  const int64_t rows = static_cast<int64_t>(x.extent(0));
  const int64_t cols = static_cast<int64_t>(x.extent(1));
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::norm_param_grad_full"), Rows(device_space(), 0, width),
      KOKKOS_LAMBDA(const int64_t k) {
        const int64_t j = k - offset;
        float ss = 0.0f, sb = 0.0f;
        if (j >= 0 && j < cols) {
          for (int64_t i = 0; i < rows; ++i) {
            const float x_hat = layernorm ? ((x(i, j) - stats(i, 0)) - stats(i, 1)) * stats(i, 2)
                                          : x(i, j) * stats(i, 2);
            ss += dy(i, j) * x_hat;
            sb += dy(i, j);
          }
        }
        full(k) = round_to(ss, dtype);
        if (layernorm) full(width + k) = round_to(sb, dtype);
      });
}

}  // namespace

std::vector<ParameterShape> norm_parameter_shapes(NormKind kind, const std::string& prefix,
                                                  int64_t width) {
  std::vector<ParameterShape> shapes = {{prefix + "/scale", {width}}};
  if (kind == NormKind::layernorm) shapes.push_back({prefix + "/bias", {width}});
  return shapes;
}

FeatureNorm::FeatureNorm(NormKind kind, const std::string& name, ParameterRef scale,
                         ParameterRef bias, FeatureLayout layout, int64_t rows,
                         ParallelContext& context, float eps, const NormSharedBuffers* shared)
    : name_(name),
      eps_(eps),
      rows_(rows),
      compute_dtype_(context.precision().param),
      reduce_dtype_(context.precision().reduce) {
  MESHTRAIN_REQUIRE(scale.value && scale.grad, "norm '", name, "': no scale parameter");
  MESHTRAIN_REQUIRE(kind != NormKind::layernorm || (bias.value && bias.grad), "norm '", name,
                    "': LayerNorm needs a bias parameter");
  if (!(eps >= 0.0f) || !std::isfinite(eps)) {
    MESHTRAIN_BAD_INPUT("norm '", name, "': eps must be a finite number >= 0, got ", eps);
  }
  std::vector<ParameterRef> refs = {scale};
  if (kind == NormKind::layernorm) refs.push_back(bias);
  std::vector<LinearParameter> specs;
  for (const ParameterRef& r : refs) {
    specs.push_back({r.value->name, r.value->global_shape, r.value->spec});
  }
  layout_ = decide_norm_layout(name, kind, specs, context.mesh(),
                               {context.batch_axes(), context.feature_axis()}, layout);
  const NormLayout& l = layout_;
  offset_ = l.layout == FeatureLayout::split ? context.feature_index() * l.local_width : 0;

  // Communicators, in the same order on every rank (collective on first use).
  tp_comm_ = context.comm(l.stats_axes);
  grad_comm_ = context.comm(l.grad_reduce);
  // Buffers the parameters write into: [scale | bias] at full width (full gradients only).
  if (!l.direct) full_grad_ = Vector(name + "/full_grad", refs.size() * l.width);
  params_.reserve(refs.size());  // parameters_ points into it
  for (size_t k = 0; k < refs.size(); ++k) {
    params_.push_back(make_param(refs[k], l.params[k], static_cast<int64_t>(k), context));
    parameters_.push_back(&params_.back());
  }
  // Which gradients are left partial is one rule (layers/gradient_reduction.hpp; in this
  // constructor the rule sees FeatureNorm's overrides, which LayerNorm and RMSNorm keep);
  // norm_step_collectives charges the layout's decision, so the two must agree.
  MESHTRAIN_REQUIRE((partial_gradients_group(*this) != nullptr) == l.defers_reduction(), "norm '",
                    name,
                    "': its parameters and its layout disagree on whether its gradients can be "
                    "left partial");

  // Buffers.
  row_sum_ = Vector(name + "/row_sum", static_cast<size_t>(rows));
  row_sums2_ = Matrix(name + "/row_sums", rows, 2);
  stats_ = Matrix(name + "/statistics", rows, 3);
  if (shared) {
    const auto fits = [&](MatrixView v) {
      return static_cast<int64_t>(v.extent(0)) == rows &&
             static_cast<int64_t>(v.extent(1)) == l.local_width;
    };
    MESHTRAIN_REQUIRE(compute_dtype_ != Dtype::fp32 && tp_comm_ == nullptr &&
                          l.local_width == l.width && fits(shared->output) &&
                          fits(shared->input_work) &&
                          shared->output.data() != shared->input_work.data(),
                      "norm '", name,
                      "': 16-bit storage needs a 16-bit compute dtype, whole features and two "
                      "distinct shared buffers [rows, width]");
    y_ = shared->output;
    input_work_ = shared->input_work;
    kept_input_ = HalfMatrix(name + "/input_16bit", rows, l.local_width);
    kept_output_ = HalfMatrix(name + "/output_16bit", rows, l.local_width);
  } else {
    out_ = Matrix(name + "/output", rows, l.local_width);
    dx_ = Matrix(name + "/input_grad", rows, l.local_width);
    y_ = out_;
  }
  // 16-bit wires allocate their staging on first use: reserved here instead (the
  // parameters' gathers reserve their own).
  if (grad_comm_) {
    const size_t n = l.direct ? static_cast<size_t>(l.local_width) : full_grad_.extent(0);
    if (reduce_dtype_ != Dtype::fp32) grad_comm_->reserve_wire(n, n);
    grad_comm_->reserve_reductions(n, reduce_dtype_);  // [scale | bias] side by side
  }
}

ShardedParameter FeatureNorm::make_param(ParameterRef ref, const NormParameterLayout& layout,
                                         int64_t index, ParallelContext& context) {
  const ShardedTensor& t = *ref.value;
  const int64_t stored = t.box.extent[0];
  MESHTRAIN_REQUIRE(stored == layout.stored, "norm '", name_, "': the block of '", t.name, "' has ",
                    stored, " elements, its layout ", layout.stored);
  // Gathered (into its own buffer: scale and bias are used together) as Linear's bias; the
  // gradient straight into the stored block (direct) or at full width into full_grad_,
  // [scale | bias], all-reduced in one collective (ShardedParameter::reduce_side_by_side).
  ParameterGathers g;
  g.compute = {1, 1, layout_.local_width};
  g.stored = {1, 1, stored};
  g.gather_dim2 = layout.gather;
  g.allreduce = layout_.grad_reduce;
  g.width = layout_.width;
  // The gathered vector: the compute block when sliced, the stored block when nothing is
  // gathered, else the full vector.
  g.gathered_offset =
      layout.gather_sliced ? offset_ : (layout.gather.empty() ? t.box.offset[0] : 0);
  g.compute_offset = offset_;
  g.direct = layout_.direct;
  g.own_gather_buffer = true;
  if (!layout_.direct) {
    g.full_gradient =
        VectorView(full_grad_.data() + index * layout_.width, static_cast<size_t>(layout_.width));
  }
  return ShardedParameter(ref, g, GatherMethod::full_width_sum, context);
}

std::vector<ShardedParameter*> FeatureNorm::sharded_parameters() {
  return parameters_;
}

LayerScratchNeeds FeatureNorm::scratch_needs() const {
  LayerScratchNeeds needs;  // none: its parameters keep their buffers (see make_param)
  for (const ShardedParameter& p : params_) needs.merge(p.scratch_needs());
  return needs;
}

void FeatureNorm::initialize_parameters() {
  Kokkos::deep_copy(params_[0].value().local, 1.0f);
  if (layout_.kind == NormKind::layernorm) Kokkos::deep_copy(params_[1].value().local, 0.0f);
}

MatrixView FeatureNorm::forward(MatrixView x, const LayerPass& pass) {
  MESHTRAIN_REQUIRE(static_cast<int64_t>(x.extent(0)) == rows_ &&
                        static_cast<int64_t>(x.extent(1)) == layout_.local_width,
                    "norm '", name_, "': input is [", x.extent(0), ", ", x.extent(1),
                    "], expected [", rows_, ", ", layout_.local_width, "]");
  x_ = x;
  const int64_t cols = layout_.local_width;
  const float n = static_cast<float>(layout_.width);
  const float eps = eps_;
  const Dtype dtype = compute_dtype_;
  const Vector row_sum = row_sum_;
  const Matrix sums2 = row_sums2_;
  const Matrix stats = stats_;
  const MatrixView y = y_;
  // 16-bit storage: the input's and the output's 16-bit copies, written in the passes that read
  // the input first and write the output (exact: both hold 16-bit values).
  const bool keep = kept_input_.data() != nullptr;
  const HalfMatrix kept_x = kept_input_, kept_y = kept_output_;
  MESHTRAIN_REQUIRE(pass.scratch, "norm '", name_, "': a pass without the model's scratch");
  LayerScratch& scratch = *pass.scratch;
  const ConstVectorView scale = params_[0].compute(scratch);
  const ConstVectorView bias =
      layout_.kind == NormKind::layernorm ? params_[1].compute(scratch) : ConstVectorView();
  // FSDP overlap: the next layer's weight gather runs under this layer's work.
  if (pass.prefetch) pass.prefetch->start_weight_prefetch(*pass.scratch);
  const bool one_pass = pass.derivative_forward && one_pass_derivative_forward_ && !keep;
  x_hat_kept_ = one_pass && kept_x_hat_.extent(0) != 0;
  if (one_pass) {
    // One host pass a row (the whole row here): y, the statistics (the tangents' and the
    // cotangents') and, for cotangents, x_hat; labelled as the kernel that writes y elsewhere.
    const MatrixView x_hat = x_hat_kept_ ? MatrixView(kept_x_hat_) : MatrixView();
    if (layout_.kind == NormKind::rmsnorm) {
      inference::rmsnorm_keeping(x, scale.data(), eps, y, stats, x_hat,
                                 MESHTRAIN_LABEL("meshtrain::rmsnorm_forward"));
    } else {
      inference::layernorm_keeping(x, scale.data(), bias.data(), eps, y, stats, x_hat,
                                   MESHTRAIN_LABEL("meshtrain::layernorm_forward"));
    }
    if (pass.prefetch) pass.prefetch->poll_weight_prefetch();
    return y;
  }

  if (layout_.kind == NormKind::rmsnorm) {
    Kokkos::parallel_for(
        MESHTRAIN_LABEL("meshtrain::rmsnorm_sum_squares"),
        RowTeams(device_space(), rows_, Kokkos::AUTO), KOKKOS_LAMBDA(const RowTeam& team) {
          const int64_t i = team.league_rank();
          float ss = 0.0f;
          Kokkos::parallel_reduce(
              Kokkos::TeamThreadRange(team, cols),
              [&](const int64_t j, float& sum) {
                if (keep) kept_x(i, j) = to_16bit(x(i, j), dtype);
                sum += x(i, j) * x(i, j);
              },
              ss);
          Kokkos::single(Kokkos::PerTeam(team), [&]() { row_sum(i) = ss; });
        });
    if (tp_comm_) tp_comm_->all_reduce(VectorView(row_sum.data(), row_sum.extent(0)));
    Kokkos::parallel_for(
        MESHTRAIN_LABEL("meshtrain::rmsnorm_statistics"), Rows(device_space(), 0, rows_),
        KOKKOS_LAMBDA(const int64_t i) {
          stats(i, 0) = 0.0f;
          stats(i, 1) = 0.0f;
          stats(i, 2) = 1.0f / kmath::sqrt(row_sum(i) / n + eps);
        });
    Kokkos::parallel_for(
        MESHTRAIN_LABEL("meshtrain::rmsnorm_forward"), range_of(y),
        KOKKOS_LAMBDA(const int64_t i, const int64_t j) {
          y(i, j) = round_to(x(i, j) * stats(i, 2) * round_to(scale(j), dtype), dtype);
          if (keep) kept_y(i, j) = to_16bit(y(i, j), dtype);
        });
    if (pass.prefetch) pass.prefetch->poll_weight_prefetch();
    return y;
  }

  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::layernorm_sum"), RowTeams(device_space(), rows_, Kokkos::AUTO),
      KOKKOS_LAMBDA(const RowTeam& team) {
        const int64_t i = team.league_rank();
        float s = 0.0f;
        Kokkos::parallel_reduce(
            Kokkos::TeamThreadRange(team, cols),
            [&](const int64_t j, float& sum) {
              if (keep) kept_x(i, j) = to_16bit(x(i, j), dtype);
              sum += x(i, j);
            },
            s);
        Kokkos::single(Kokkos::PerTeam(team), [&]() { row_sum(i) = s; });
      });
  if (tp_comm_) tp_comm_->all_reduce(VectorView(row_sum.data(), row_sum.extent(0)));
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::layernorm_centered_sums"),
      RowTeams(device_space(), rows_, Kokkos::AUTO), KOKKOS_LAMBDA(const RowTeam& team) {
        const int64_t i = team.league_rank();
        const float m0 = row_sum(i) / n;
        float a = 0.0f, b = 0.0f;
        Kokkos::parallel_reduce(
            Kokkos::TeamThreadRange(team, cols),
            [&](const int64_t j, float& sum) { sum += x(i, j) - m0; }, a);
        Kokkos::parallel_reduce(
            Kokkos::TeamThreadRange(team, cols),
            [&](const int64_t j, float& sum) {
              const float d = x(i, j) - m0;
              sum += d * d;
            },
            b);
        Kokkos::single(Kokkos::PerTeam(team), [&]() {
          sums2(i, 0) = a;
          sums2(i, 1) = b;
        });
      });
  if (tp_comm_) tp_comm_->all_reduce(MatrixView(sums2.data(), sums2.extent(0), 2));
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::layernorm_statistics"), Rows(device_space(), 0, rows_),
      KOKKOS_LAMBDA(const int64_t i) {
        const float delta = sums2(i, 0) / n;
        const float var = sums2(i, 1) / n - delta * delta;
        stats(i, 0) = row_sum(i) / n;
        stats(i, 1) = delta;
        stats(i, 2) = 1.0f / kmath::sqrt((var > 0.0f ? var : 0.0f) + eps);
      });
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::layernorm_forward"), range_of(y),
      KOKKOS_LAMBDA(const int64_t i, const int64_t j) {
        const float x_hat = ((x(i, j) - stats(i, 0)) - stats(i, 1)) * stats(i, 2);
        y(i, j) = round_to(x_hat * round_to(scale(j), dtype) + round_to(bias(j), dtype), dtype);
        if (keep) kept_y(i, j) = to_16bit(y(i, j), dtype);
      });
  if (pass.prefetch) pass.prefetch->poll_weight_prefetch();
  return y;
}

MatrixView FeatureNorm::infer(MatrixView x, const LayerPass& pass) {
  x_hat_kept_ = false;  // forward sets it again where it falls back; no kept x_hat is of this x
  if (!inference::runs_host_kernels() || compute_dtype_ != Dtype::fp32 || tp_comm_ != nullptr ||
      layout_.local_width != layout_.width) {
    return forward(x, pass);
  }
  MESHTRAIN_REQUIRE(static_cast<int64_t>(x.extent(0)) == rows_ &&
                        static_cast<int64_t>(x.extent(1)) == layout_.local_width,
                    "norm '", name_, "': input is [", x.extent(0), ", ", x.extent(1),
                    "], expected [", rows_, ", ", layout_.local_width, "]");
  MESHTRAIN_REQUIRE(pass.scratch, "norm '", name_, "': a pass without the model's scratch");
  const float* scale = params_[0].compute(*pass.scratch).data();
  if (layout_.kind == NormKind::rmsnorm) {
    inference::rmsnorm(x, scale, eps_, y_);
  } else {
    inference::layernorm(x, scale, params_[1].compute(*pass.scratch).data(), eps_, y_);
  }
  return y_;
}

MatrixView FeatureNorm::backward(MatrixView dy, bool need_input_grad, const LayerPass& pass) {
  MESHTRAIN_REQUIRE(static_cast<int64_t>(dy.extent(0)) == rows_ &&
                        static_cast<int64_t>(dy.extent(1)) == layout_.local_width,
                    "norm '", name_, "': output gradient is [", dy.extent(0), ", ", dy.extent(1),
                    "], expected [", rows_, ", ", layout_.local_width, "]");
  MESHTRAIN_REQUIRE(pass.scratch, "norm '", name_, "': a pass without the model's scratch");
  MESHTRAIN_REQUIRE(pass.deferred == DeferredReduction::now || layout_.defers_reduction(), "norm '",
                    name_, "': asked to leave gradients partial that it must reduce itself");
  const bool bucketed = pass.deferred == DeferredReduction::in_buckets;
  // FSDP overlap: the previous layer's weight gather runs under this layer's backward.
  if (pass.prefetch) pass.prefetch->start_weight_prefetch(*pass.scratch);
  if (kept_input_.data() != nullptr) {
    // 16-bit storage: forward's input widened (exactly) for the kernels below.
    widen_16bit(kept_input_, input_work_, compute_dtype_);
    x_ = input_work_;
  }
  parameter_gradients(dy, pass);
  if (bucketed) pass.buckets->layer_ready(pass.index);
  if (!need_input_grad) {
    if (pass.prefetch) pass.prefetch->poll_weight_prefetch();
    return MatrixView();
  }

  const MatrixView x = x_;
  const int64_t cols = layout_.local_width;
  const float n = static_cast<float>(layout_.width);
  const Dtype dtype = compute_dtype_;
  const Vector sum1 = row_sum_;     // RMSNorm: sum g x_hat
  const Matrix sums2 = row_sums2_;  // LayerNorm: sum g, sum g x_hat
  const Matrix stats = stats_;
  // 16-bit storage: dX in place over dY (each element reads its own dY after the row sums).
  const MatrixView dx = kept_input_.data() != nullptr ? dy : MatrixView(dx_);
  const ConstVectorView scale = params_[0].compute(*pass.scratch);
  const bool layernorm = layout_.kind == NormKind::layernorm;
  // Row sums of g = dy * scale and of g * x_hat (fp32), over all features.
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::norm_backward_row_sums"),
      RowTeams(device_space(), rows_, Kokkos::AUTO), KOKKOS_LAMBDA(const RowTeam& team) {
        const int64_t i = team.league_rank();
        const float m0 = stats(i, 0), delta = stats(i, 1), rstd = stats(i, 2);
        float sg = 0.0f, sgx = 0.0f;
        if (layernorm) {
          Kokkos::parallel_reduce(
              Kokkos::TeamThreadRange(team, cols),
              [&](const int64_t j, float& sum) { sum += dy(i, j) * round_to(scale(j), dtype); },
              sg);
        }
        Kokkos::parallel_reduce(
            Kokkos::TeamThreadRange(team, cols),
            [&](const int64_t j, float& sum) {
              const float g = dy(i, j) * round_to(scale(j), dtype);
              sum += g * (layernorm ? ((x(i, j) - m0) - delta) * rstd : x(i, j) * rstd);
            },
            sgx);
        Kokkos::single(Kokkos::PerTeam(team), [&]() {
          if (layernorm) {
            sums2(i, 0) = sg;
            sums2(i, 1) = sgx;
          } else {
            sum1(i) = sgx;
          }
        });
      });
  if (tp_comm_ && layernorm) tp_comm_->all_reduce(MatrixView(sums2.data(), sums2.extent(0), 2));
  if (tp_comm_ && !layernorm) tp_comm_->all_reduce(VectorView(sum1.data(), sum1.extent(0)));
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::norm_input_grad"), range_of(dx),
      KOKKOS_LAMBDA(const int64_t i, const int64_t j) {
        const float m0 = stats(i, 0), delta = stats(i, 1), rstd = stats(i, 2);
        const float g = dy(i, j) * round_to(scale(j), dtype);
        const float x_hat = layernorm ? ((x(i, j) - m0) - delta) * rstd : x(i, j) * rstd;
        const float mean_g = layernorm ? sums2(i, 0) / n : 0.0f;
        const float mean_gx = (layernorm ? sums2(i, 1) : sum1(i)) / n;
        dx(i, j) = round_to(rstd * (g - mean_g - x_hat * mean_gx), dtype);
      });
  if (bucketed) pass.buckets->poll();
  if (pass.prefetch) pass.prefetch->poll_weight_prefetch();
  return dx;
}

namespace {

// The norm's Jacobian on k rows per value row (docs/derivatives.md): with g = d * pre (the
// scale before the Jacobian: cotangents) and x_hat of value row i = t / k,
//   out(t, j) = post(j) * rstd * (g - sum(g) / N - x_hat * sum(x_hat g) / N)   (LayerNorm)
//   out(t, j) = post(j) * rstd * (g - x_hat * sum(x_hat g) / N)                (RMSNorm)
// post: the scale after it (tangents); the unused one is empty. The row sums over this rank's
// columns go to sums [rows * k, 2], all-reduced over `features` (split features) in between.
// x_hat is computed once per value row, into the block's first output row, which is written
// last; plain pointer loops over a row's columns (views may be row-strided).
void norm_jacobian(MatrixView x, MatrixView stats, MatrixView d, ConstVectorView pre,
                   ConstVectorView post, bool layernorm, float n, Communicator* features,
                   MatrixView sums, MatrixView out) {
  const int64_t rows = static_cast<int64_t>(x.extent(0));
  const int64_t cols = static_cast<int64_t>(x.extent(1));
  const int64_t k = rows > 0 ? static_cast<int64_t>(d.extent(0)) / rows : 0;
  MESHTRAIN_REQUIRE(
      d.extent(1) == x.extent(1) && out.extent(0) == d.extent(0) && out.extent(1) == d.extent(1) &&
          sums.extent(0) == d.extent(0) && (out.extent(0) == 0 || out.data() != d.data()),
      "norm_jacobian: values [", x.extent(0), ", ", x.extent(1), "], directions [", d.extent(0),
      ", ", d.extent(1), "] into [", out.extent(0), ", ", out.extent(1), "]");
  const int64_t x_stride = static_cast<int64_t>(x.stride(0));
  const int64_t d_stride = static_cast<int64_t>(d.stride(0));
  const int64_t o_stride = static_cast<int64_t>(out.stride(0));
  const float* x_data = x.data();
  const float* d_data = d.data();
  float* o_data = out.data();
  const float* pre_data = pre.extent(0) > 0 ? pre.data() : nullptr;
  const float* post_data = post.extent(0) > 0 ? post.data() : nullptr;
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::norm_jacobian_row_sums"), Rows(device_space(), 0, rows),
      KOKKOS_LAMBDA(const int64_t i) {
        const float m0 = stats(i, 0), delta = stats(i, 1), rstd = stats(i, 2);
        const float* KOKKOS_RESTRICT xi = x_data + i * x_stride;
        float* KOKKOS_RESTRICT x_hat = o_data + i * k * o_stride;
        for (int64_t j = 0; j < cols; ++j) {
          x_hat[j] = layernorm ? ((xi[j] - m0) - delta) * rstd : xi[j] * rstd;
        }
        for (int64_t e = 0; e < k; ++e) {
          const float* KOKKOS_RESTRICT g = d_data + (i * k + e) * d_stride;
          float s = 0.0f, sx = 0.0f;
          for (int64_t j = 0; j < cols; ++j) {
            const float gj = pre_data ? g[j] * pre_data[j] : g[j];
            s += gj;
            sx += gj * x_hat[j];
          }
          sums(i * k + e, 0) = layernorm ? s : 0.0f;
          sums(i * k + e, 1) = sx;
        }
      });
  if (features) features->all_reduce(sums);  // over every feature
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::norm_jacobian"), Rows(device_space(), 0, rows),
      KOKKOS_LAMBDA(const int64_t i) {
        const float rstd = stats(i, 2);
        float* x_hat = o_data + i * k * o_stride;  // the first row: written last, in place
        for (int64_t e = k; e-- > 0;) {
          const int64_t t = i * k + e;
          const float mean = sums(t, 0) / n, mean_x = sums(t, 1) / n;
          const float* g = d_data + t * d_stride;
          float* o = o_data + t * o_stride;
          for (int64_t j = 0; j < cols; ++j) {
            const float gj = pre_data ? g[j] * pre_data[j] : g[j];
            const float v = rstd * (gj - mean - x_hat[j] * mean_x);
            o[j] = post_data ? v * post_data[j] : v;
          }
        }
      });
}

// One value row of norm_jacobian for the cotangents (pre = the scale, no post), on host memory
// with the whole row on this rank: the two row sums of each direction and its output in one
// visit of the row (in cache), plus `add` (the residual stream's cotangents, or null). The
// sums run in 16 partial sums (a fixed order that vectorizes, as the inference LayerNorm's),
// so they differ from norm_jacobian's by float rounding; compiled per instruction set.
// Without x_hat kept (norm_cotangent_kept_host takes the kept case): x_hat is computed here
// from xi and the statistics into the row's first output row, overwritten last. This is why
// this path keeps its own per-direction loop instead of norm_cotangent_group: there x_hat and
// the outputs are __restrict, and x_hat here is output row 0 itself, which the group with e0 = 0
// writes while still reading x_hat for its other directions.
MESHTRAIN_HOST_CLONES
void norm_cotangent_block_host(const float* xi, float m0, float delta, float rstd,
                               const float* d_data, int64_t d_stride, const float* pre,
                               const float* add_data, int64_t a_stride, float* o_data,
                               int64_t o_stride, int64_t i, int64_t k, int64_t cols, bool layernorm,
                               float n) {
  constexpr int kLanes = 16;
  float* first = o_data + i * k * o_stride;  // the first row: written last, in place
  for (int64_t j = 0; j < cols; ++j) {
    first[j] = layernorm ? ((xi[j] - m0) - delta) * rstd : xi[j] * rstd;
  }
  const float* x_hat = first;
  for (int64_t e = k; e-- > 0;) {
    const int64_t t = i * k + e;
    const float* __restrict g = d_data + t * d_stride;
    float lanes_s[kLanes] = {}, lanes_x[kLanes] = {};
    int64_t j = 0;
    for (; j + kLanes <= cols; j += kLanes) {
      for (int l = 0; l < kLanes; ++l) {
        const float gj = g[j + l] * pre[j + l];
        lanes_s[l] += gj;
        lanes_x[l] += gj * x_hat[j + l];
      }
    }
    for (int l = 0; j < cols; ++j, ++l) {
      const float gj = g[j] * pre[j];
      lanes_s[l] += gj;
      lanes_x[l] += gj * x_hat[j];
    }
    float s = 0.0f, sx = 0.0f;
    for (int l = 0; l < kLanes; ++l) {
      s += lanes_s[l];
      sx += lanes_x[l];
    }
    const float mean = layernorm ? s / n : 0.0f, mean_x = sx / n;
    float* o = o_data + t * o_stride;
    if (add_data != nullptr) {
      const float* __restrict a = add_data + t * a_stride;
      for (int64_t c = 0; c < cols; ++c) {
        o[c] = a[c] + rstd * (g[c] * pre[c] - mean - x_hat[c] * mean_x);
      }
    } else {
      for (int64_t c = 0; c < cols; ++c) o[c] = rstd * (g[c] * pre[c] - mean - x_hat[c] * mean_x);
    }
  }
}

// norm_cotangent_block_host's directions e0 .. e0 + G - 1 of value row i with x_hat kept, in one
// sweep: the 2 G row sums (each in the same 16 partial sums, lane l adding columns l, l + 16,
// ... in order, then the lanes 0 to 15 in order) read x_hat and the scale once for the G
// directions (G a constant), then the G outputs. On the AVX-512 clone a lane group is one vector,
// so the 2 G accumulators can fit in its registers (8 of 32 at G = 4; GCC 12's v4 code keeps
// G = 1's there, its loops for larger G also touch the stack); the AVX2 and baseline clones take
// 2 and 4 registers a lane group. Spilled or not, the sums are the same.
template <int G>
MESHTRAIN_INLINE void norm_cotangent_group(const float* __restrict x_hat, float rstd,
                                           const float* d_data, int64_t d_stride,
                                           const float* __restrict pre, const float* add_data,
                                           int64_t a_stride, float* o_data, int64_t o_stride,
                                           int64_t t0, int64_t cols, bool layernorm, float n) {
  constexpr int kLanes = 16;
  const float* g[G];
  for (int e = 0; e < G; ++e) g[e] = d_data + (t0 + e) * d_stride;
  float lanes_s[G][kLanes] = {}, lanes_x[G][kLanes] = {};
  const int64_t full = cols - cols % kLanes;
  for (int64_t j = 0; j < full; j += kLanes) {
    for (int e = 0; e < G; ++e) {
      for (int l = 0; l < kLanes; ++l) {
        const float gj = g[e][j + l] * pre[j + l];
        lanes_s[e][l] += gj;
        lanes_x[e][l] += gj * x_hat[j + l];
      }
    }
  }
  if (full <
      cols) {  // the last columns into lanes 0 .. cols - full - 1, the others left as they are
    for (int e = 0; e < G; ++e) {
      for (int l = 0; l < kLanes; ++l) {
        if (full + l < cols) {
          const float gj = g[e][full + l] * pre[full + l];
          lanes_s[e][l] += gj;
          lanes_x[e][l] += gj * x_hat[full + l];
        }
      }
    }
  }
  float mean[G], mean_x[G];
  for (int e = 0; e < G; ++e) {
    float s = 0.0f, sx = 0.0f;
    for (int l = 0; l < kLanes; ++l) {
      s += lanes_s[e][l];
      sx += lanes_x[e][l];
    }
    mean[e] = layernorm ? s / n : 0.0f;
    mean_x[e] = sx / n;
  }
  for (int e = 0; e < G; ++e) {
    const float* __restrict ge = g[e];
    float* __restrict o = o_data + (t0 + e) * o_stride;
    const float m = mean[e], mx = mean_x[e];
    if (add_data != nullptr) {
      const float* __restrict a = add_data + (t0 + e) * a_stride;
      for (int64_t c = 0; c < cols; ++c) o[c] = a[c] + rstd * (ge[c] * pre[c] - m - x_hat[c] * mx);
    } else {
      for (int64_t c = 0; c < cols; ++c) o[c] = rstd * (ge[c] * pre[c] - m - x_hat[c] * mx);
    }
  }
}

// One value row of the cotangents with x_hat kept (the derivative forward's): its k directions
// in groups of up to 4 (norm_cotangent_group), the same sums and outputs as
// norm_cotangent_block_host's per-direction loop.
MESHTRAIN_HOST_CLONES
void norm_cotangent_kept_host(const float* x_hat, float rstd, const float* d_data, int64_t d_stride,
                              const float* pre, const float* add_data, int64_t a_stride,
                              float* o_data, int64_t o_stride, int64_t i, int64_t k, int64_t cols,
                              bool layernorm, float n) {
  for (int64_t e0 = 0; e0 < k; e0 += 4) {
    const int64_t t0 = i * k + e0;
    switch (k - e0 < 4 ? k - e0 : 4) {
      case 1:
        norm_cotangent_group<1>(x_hat, rstd, d_data, d_stride, pre, add_data, a_stride, o_data,
                                o_stride, t0, cols, layernorm, n);
        break;
      case 2:
        norm_cotangent_group<2>(x_hat, rstd, d_data, d_stride, pre, add_data, a_stride, o_data,
                                o_stride, t0, cols, layernorm, n);
        break;
      case 3:
        norm_cotangent_group<3>(x_hat, rstd, d_data, d_stride, pre, add_data, a_stride, o_data,
                                o_stride, t0, cols, layernorm, n);
        break;
      default:
        norm_cotangent_group<4>(x_hat, rstd, d_data, d_stride, pre, add_data, a_stride, o_data,
                                o_stride, t0, cols, layernorm, n);
        break;
    }
  }
}

}  // namespace

MatrixView FeatureNorm::forward_tangents(MatrixView dx, const LayerPass& pass) {
  const int64_t k = tangent_directions(static_cast<int64_t>(dx.extent(0)), rows_, name_);
  const int64_t rows = rows_ * k;
  MESHTRAIN_REQUIRE(static_cast<int64_t>(dx.extent(1)) == layout_.local_width, "norm '", name_,
                    "': tangent input is [", dx.extent(0), ", ", dx.extent(1), "], expected [",
                    rows, ", ", layout_.local_width, "]");
  MESHTRAIN_REQUIRE(pass.scratch, "norm '", name_, "': a pass without the model's scratch");
  // The streams' form, which keeps what backward_with_tangents reads, for the forward Laplacian
  // and for first-order tangents once reserve_tangent_backward made room for them (Sobolev
  // training); its first-order arithmetic is norm_jacobian's, so the tangents are the same.
  if (pass.second_order || k <= laplacian_rows_) return laplacian_forward(dx, pass);
  const MatrixView out = leading_rows(tangents_, rows);
  norm_jacobian(x_, stats_, dx, ConstVectorView(), params_[0].compute(*pass.scratch),
                layout_.kind == NormKind::layernorm, static_cast<float>(layout_.width), tp_comm_,
                leading_rows(tangent_sums_, rows), out);
  return out;
}

void FeatureNorm::reserve_tangents(int64_t directions) {
  if (directions <= tangent_capacity_) return;
  const int64_t rows = rows_ * directions;
  tangent_sums_ = Matrix(name_ + "/tangent_sums", rows, 2);
  tangents_ = Matrix(name_ + "/tangents", rows, layout_.local_width);
  if (tp_comm_) tp_comm_->reserve_reductions(static_cast<size_t>(rows * 2));
  tangent_capacity_ = directions;
}

MatrixView FeatureNorm::backward_cotangents(MatrixView dy, const LayerPass& pass) {
  const int64_t block = cotangent_block_rows(pass, rows_, name_).rows;
  const int64_t k = cotangent_directions(static_cast<int64_t>(dy.extent(0)), block, name_);
  const int64_t rows = block * k;
  MESHTRAIN_REQUIRE(static_cast<int64_t>(dy.extent(1)) == layout_.local_width, "norm '", name_,
                    "': cotangent input is [", dy.extent(0), ", ", dy.extent(1), "], expected [",
                    rows, ", ", layout_.local_width, "]");
  MESHTRAIN_REQUIRE(pass.scratch, "norm '", name_, "': a pass without the model's scratch");
  const MatrixView out = leading_rows(cotangents_, rows);
  if (cotangents_in_one_pass()) {
    cotangents_adding(dy, MatrixView(), out, pass);
    return out;
  }
  norm_jacobian(x_, stats_, dy, params_[0].compute(*pass.scratch), ConstVectorView(),
                layout_.kind == NormKind::layernorm, static_cast<float>(layout_.width), tp_comm_,
                leading_rows(cotangent_sums_, rows), out);
  return out;
}

bool FeatureNorm::cotangents_in_one_pass() const {
  return inference::layers_run_host_kernels() && tp_comm_ == nullptr &&
         compute_dtype_ == Dtype::fp32;
}

bool FeatureNorm::cotangents_by_rows() const {
  return cotangents_in_one_pass() && !params_[0].gathered();
}

void FeatureNorm::cotangents_adding(MatrixView dy, MatrixView add, MatrixView out,
                                    const LayerPass& pass) {
  MESHTRAIN_REQUIRE(cotangents_in_one_pass(), "norm '", name_,
                    "': one-pass cotangents need host memory, fp32 and whole rows");
  // A block of the value rows (LayerPass::cotangent_first_row, cotangent_rows), or all of them:
  // x_ and stats_ read at the block's rows, dy, add and out from their first row.
  const RowBlock rows_of = cotangent_block_rows(pass, rows_, name_);
  const int64_t block = rows_of.rows, first = rows_of.first;
  const int64_t k = cotangent_directions(static_cast<int64_t>(dy.extent(0)), block, name_);
  const int64_t cols = layout_.local_width;
  MESHTRAIN_REQUIRE(static_cast<int64_t>(dy.extent(1)) == cols && out.extent(0) == dy.extent(0) &&
                        out.extent(1) == dy.extent(1) && out.data() != dy.data() &&
                        out.data() != add.data() &&
                        (add.data() == nullptr ||
                         (add.extent(0) == dy.extent(0) && add.extent(1) == dy.extent(1))),
                    "norm '", name_, "': cotangents [", dy.extent(0), ", ", dy.extent(1),
                    "] into [", out.extent(0), ", ", out.extent(1), "] (", block * k, ", ", cols,
                    " expected; out neither dy's nor add's memory)");
  MESHTRAIN_REQUIRE(pass.scratch, "norm '", name_, "': a pass without the model's scratch");
  const ConstVectorView scale = params_[0].compute(*pass.scratch);
  const float* pre = scale.data();
  const float* x_data = x_.data();
  const float* d_data = dy.data();
  const float* a_data = add.data();
  float* o_data = out.data();
  const int64_t x_stride = static_cast<int64_t>(x_.stride(0));
  const int64_t d_stride = static_cast<int64_t>(dy.stride(0));
  const int64_t a_stride = a_data != nullptr ? static_cast<int64_t>(add.stride(0)) : 0;
  const int64_t o_stride = static_cast<int64_t>(out.stride(0));
  const bool layernorm = layout_.kind == NormKind::layernorm;
  const float n = static_cast<float>(layout_.width);
  const MatrixView stats = stats_;
  const float* h_data = x_hat_kept_ ? kept_x_hat_.data() : nullptr;
  const int64_t h_stride = x_hat_kept_ ? static_cast<int64_t>(kept_x_hat_.stride(0)) : 0;
  const std::string& label = MESHTRAIN_LABEL("meshtrain::norm_cotangents_host");
  Kokkos::parallel_for(
      label, Kokkos::RangePolicy<Kokkos::DefaultHostExecutionSpace>(host_space(), 0, block),
      [=](const int64_t i) {
        const int64_t v = first + i;  // the value row
        if (h_data != nullptr) {
          norm_cotangent_kept_host(h_data + v * h_stride, stats(v, 2), d_data, d_stride, pre,
                                   a_data, a_stride, o_data, o_stride, i, k, cols, layernorm, n);
          return;
        }
        norm_cotangent_block_host(x_data + v * x_stride, stats(v, 0), stats(v, 1), stats(v, 2),
                                  d_data, d_stride, pre, a_data, a_stride, o_data, o_stride, i, k,
                                  cols, layernorm, n);
      });
  inference::fence_after_host_kernel(label);
}

void FeatureNorm::reserve_derivative_forward(bool for_cotangents) {
  if (!cotangents_in_one_pass() || kept_input_.data() != nullptr ||
      layout_.local_width != layout_.width) {
    return;
  }
  one_pass_derivative_forward_ = true;
  // x_hat only for the cotangents: the tangents' norm_jacobian reads x and the statistics.
  if (for_cotangents && kept_x_hat_.extent(0) == 0) {
    kept_x_hat_ = Matrix(name_ + "/kept_x_hat", rows_, layout_.local_width);
  }
}

void FeatureNorm::reserve_cotangents(int64_t directions) {
  if (directions <= cotangent_capacity_) return;
  const int64_t rows = rows_ * directions;
  cotangent_sums_ = Matrix(name_ + "/cotangent_sums", rows, 2);
  cotangents_ = Matrix(name_ + "/cotangents", rows, layout_.local_width);
  if (tp_comm_) tp_comm_->reserve_reductions(static_cast<size_t>(rows * 2));
  cotangent_capacity_ = directions;
}

// ---- The forward Laplacian (docs/derivatives.md, "LayerNorm and RMSNorm, second order") ------
// Per value row i and direction d, with t = stream row i * 2k + d (a tangent) and q = stream
// row i * 2k + k + d (its second-order stream), r = rstd, N the global width, means over all N
// (LayerNorm; RMSNorm: mean(t) = mean(q) = 0, no centring):
//   a = mean(x_hat t), b = mean(x_hat q), m2 = mean(t^2) - mean(t)^2
//   J t = r (t - mean(t) - x_hat a)                       (the first-order tangent)
//   w   = r (q - mean(q) - x_hat b) - 2 r a J t - r^2 (m2 - a^2) x_hat
// outputs scale * J t and scale * w; J t and w are kept (hat_streams_) for the backward.
// First-order tangents (pass.second_order false: Sobolev training) are the same with k stream
// rows per value row, i * k + d, and no q: b = mean(q) = 0, and w is not computed.
MatrixView FeatureNorm::laplacian_forward(MatrixView streams, const LayerPass& pass) {
  const bool second = pass.second_order;
  const int64_t per_row = static_cast<int64_t>(streams.extent(0)) / rows_;
  MESHTRAIN_REQUIRE((!second || per_row % 2 == 0) && per_row <= laplacian_rows_, "norm '", name_,
                    "': ", per_row, second ? " second-order" : " tangent",
                    " stream rows per row, with room for ", laplacian_rows_,
                    " (reserve_tangent_backward; 2 per direction for the forward Laplacian)");
  const int64_t k = second ? per_row / 2 : per_row;
  const int64_t rows = rows_;
  const int64_t cols = layout_.local_width;
  const float n = static_cast<float>(layout_.width);
  const bool layernorm = layout_.kind == NormKind::layernorm;
  const MatrixView x = x_, stats = stats_, x_hat = x_hat_, q_in = streams;
  const MatrixView sums = leading_rows(laplacian_sums_, rows * per_row);
  const MatrixView dir = leading_rows(laplacian_stats_, rows * k);
  const MatrixView hat = leading_rows(hat_streams_, rows * per_row);
  const MatrixView out = leading_rows(tangents_, rows * per_row);
  const ConstVectorView scale = params_[0].compute(*pass.scratch);
  streams_in_ = streams;
  streams_second_order_ = second;
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::norm_laplacian_row_sums"), Rows(device_space(), 0, rows),
      KOKKOS_LAMBDA(const int64_t i) {
        const float m0 = stats(i, 0), delta = stats(i, 1), r = stats(i, 2);
        for (int64_t j = 0; j < cols; ++j) {
          x_hat(i, j) = layernorm ? ((x(i, j) - m0) - delta) * r : x(i, j) * r;
        }
        for (int64_t e = 0; e < per_row; ++e) {
          const int64_t t = i * per_row + e;
          float s = 0.0f, sx = 0.0f, ss = 0.0f;
          for (int64_t j = 0; j < cols; ++j) {
            const float v = q_in(t, j);
            s += v;
            sx += x_hat(i, j) * v;
            ss += v * v;
          }
          sums(t, 0) = s;
          sums(t, 1) = sx;
          sums(t, 2) = e < k ? ss : 0.0f;
        }
      });
  if (tp_comm_) tp_comm_->all_reduce(sums);  // over every feature
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::norm_laplacian"), Rows(device_space(), 0, rows),
      KOKKOS_LAMBDA(const int64_t i) {
        const float r = stats(i, 2);
        for (int64_t d = 0; d < k; ++d) {
          const int64_t tt = i * per_row + d, qq = tt + k;
          const float mean_t = layernorm ? sums(tt, 0) / n : 0.0f;
          const float mean_q = layernorm && second ? sums(qq, 0) / n : 0.0f;
          const float a = sums(tt, 1) / n, b = second ? sums(qq, 1) / n : 0.0f;
          const float m2 = sums(tt, 2) / n - mean_t * mean_t;
          dir(i * k + d, 0) = mean_t;
          dir(i * k + d, 1) = a;
          dir(i * k + d, 2) = b;
          dir(i * k + d, 3) = m2;
          dir(i * k + d, 4) = mean_q;
          const float c2 = r * r * (m2 - a * a);
          for (int64_t j = 0; j < cols; ++j) {
            const float jt = r * (q_in(tt, j) - mean_t - x_hat(i, j) * a);
            hat(tt, j) = jt;
            out(tt, j) = scale(j) * jt;
            if (!second) continue;
            const float w =
                r * (q_in(qq, j) - mean_q - x_hat(i, j) * b) - 2.0f * r * a * jt - c2 * x_hat(i, j);
            hat(qq, j) = w;
            out(qq, j) = scale(j) * w;
          }
        }
      });
  return out;
}

// The backward, by the chain rule through the formulas above (docs/derivatives.md): with
// A_t = scale * dt_t, A_w = scale * dt_q, A_x = scale * dy, the row sums
//   P1 = sum A_w, P2 = sum x_hat A_w, P3 = sum Jt A_w, P4 = sum Jq A_w (Jq = r (q - ...) ),
//   P5 = sum A_t, P6 = sum x_hat A_t, P7 = sum Jt A_t
// give each direction's adjoints; T = A_t - 2 r a A_w (the adjoint of J t):
//   m2' = -r^2 P2,  b' = -r P2,  a' = -2 r P3 + 2 r^2 a P2 - r sum(x_hat T)
//   r'  = -2 a P3 - 2 r (m2 - a^2) P2 + (P4 + sum(Jt T)) / r
//   grad q = r (A_w - mean(A_w) - x_hat P2 / N)
//   grad t = r (T - mean(T)) + a' x_hat / N + 2 m2' ct / N                (ct = t - mean(t))
//   x_hat' = A_x + sum_d [-(r^2 (m2 - a^2) + r b) A_w + b' cq / N - r a T + a' ct / N]
//   grad x = r (x_hat' - mean(x_hat') - x_hat mean(x_hat x_hat')) - r^2 x_hat sum_d r' / N
// (RMSNorm: no mean subtracted). The parameters: dscale = column sums of dy x_hat + sum over
// the streams of dt * (J t or w), dbias = column sums of dy.
// First-order tangents (Sobolev training) are the same with A_w = 0 (no q stream): P1..P4,
// m2', b' and the w terms vanish, leaving grad t = r (A_t - mean(A_t) - x_hat P6 / N) (J's
// transpose), x_hat' = A_x + sum_d [-r a A_t + a' ct / N], a' = -r P6, r' = sum_d P7 / r.
MatrixView FeatureNorm::backward_with_tangents(MatrixView dy, MatrixView dt, bool need_input_grad,
                                               const LayerPass& pass, MatrixView* dt_in) {
  MESHTRAIN_REQUIRE(streams_second_order_ == pass.second_order, "norm '", name_,
                    "': the backward's streams are not of the kind the last tangent pass had ",
                    "(reserve_tangent_backward before it)");
  MESHTRAIN_REQUIRE(compute_dtype_ == Dtype::fp32, "norm '", name_,
                    "': training on derivatives is fp32 only");
  MESHTRAIN_REQUIRE(pass.deferred != DeferredReduction::in_buckets, "norm '", name_,
                    "': training on derivatives does not reduce in buckets");
  MESHTRAIN_REQUIRE(pass.deferred == DeferredReduction::now || layout_.defers_reduction(), "norm '",
                    name_, "': asked to leave gradients partial that it must reduce itself");
  MESHTRAIN_REQUIRE(streams_in_.extent(0) == dt.extent(0) &&
                        dt.extent(1) == streams_in_.extent(1) &&
                        static_cast<int64_t>(dy.extent(0)) == rows_ &&
                        static_cast<int64_t>(dy.extent(1)) == layout_.local_width,
                    "norm '", name_, "': gradients [", dy.extent(0), ", ", dy.extent(1), "] and [",
                    dt.extent(0), ", ", dt.extent(1), "] after a second-order pass of [",
                    streams_in_.extent(0), ", ", streams_in_.extent(1), "]");
  MESHTRAIN_REQUIRE(pass.scratch, "norm '", name_, "': a pass without the model's scratch");
  const bool second = streams_second_order_;
  const int64_t per_row = static_cast<int64_t>(dt.extent(0)) / rows_;
  const int64_t k = second ? per_row / 2 : per_row;
  const int64_t rows = rows_;
  const int64_t cols = layout_.local_width;
  const float n = static_cast<float>(layout_.width);
  const bool layernorm = layout_.kind == NormKind::layernorm;
  const MatrixView stats = stats_, x_hat = x_hat_, q_in = streams_in_;
  const MatrixView dir = leading_rows(laplacian_stats_, rows * k);
  const MatrixView hat = leading_rows(hat_streams_, rows * per_row);
  LayerScratch& scratch = *pass.scratch;
  const ConstVectorView scale = params_[0].compute(scratch);

  // The parameters' gradients: column sums over the value rows and the stream rows, into the
  // stored blocks (direct) or full-width vectors (zeros outside this rank's columns).
  {
    const bool all_reduce = pass.deferred == DeferredReduction::now;
    const int64_t offset = layout_.direct ? 0 : offset_;
    const int64_t length = layout_.direct ? cols : layout_.width;
    float* dscale = nullptr;
    float* dbias = nullptr;
    if (layout_.direct) {
      dscale = params_[0].gradient(scratch).data();
      if (layernorm) dbias = params_[1].gradient(scratch).data();
    } else {
      dscale = full_grad_.data();
      if (layernorm) dbias = full_grad_.data() + layout_.width;
    }
    const int64_t stream_rows = rows * per_row;
    Kokkos::parallel_for(
        MESHTRAIN_LABEL("meshtrain::norm_laplacian_param_grad"), Rows(device_space(), 0, length),
        KOKKOS_LAMBDA(const int64_t c) {
          const int64_t j = c - offset;
          float ss = 0.0f, sb = 0.0f;
          if (j >= 0 && j < cols) {
            for (int64_t i = 0; i < rows; ++i) {
              ss += dy(i, j) * x_hat(i, j);
              sb += dy(i, j);
            }
            for (int64_t t = 0; t < stream_rows; ++t) ss += dt(t, j) * hat(t, j);
          }
          dscale[c] = ss;
          if (dbias) dbias[c] = sb;
        });
    if (layout_.direct) {
      for (ShardedParameter& p : params_) p.reduce(scratch, all_reduce);
    } else {
      ShardedParameter::reduce_side_by_side(parameters_, all_reduce);
    }
  }
  if (!need_input_grad) return MatrixView();

  const MatrixView back = leading_rows(laplacian_back_sums_, rows * k);
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::norm_laplacian_backward_sums"), Rows(device_space(), 0, rows),
      KOKKOS_LAMBDA(const int64_t i) {
        for (int64_t d = 0; d < k; ++d) {
          const int64_t tt = i * per_row + d, qq = tt + k;
          const float r = stats(i, 2), a = dir(i * k + d, 1), m2 = dir(i * k + d, 3);
          const float c2 = r * r * (m2 - a * a);
          float p[7] = {0, 0, 0, 0, 0, 0, 0};
          for (int64_t j = 0; j < cols; ++j) {
            const float at = scale(j) * dt(tt, j);
            const float jt = hat(tt, j);
            if (second) {
              const float aw = scale(j) * dt(qq, j);
              const float jq = hat(qq, j) + 2.0f * r * a * jt + c2 * x_hat(i, j);
              p[0] += aw;
              p[1] += x_hat(i, j) * aw;
              p[2] += jt * aw;
              p[3] += jq * aw;
            }
            p[4] += at;
            p[5] += x_hat(i, j) * at;
            p[6] += jt * at;
          }
          for (int c = 0; c < 7; ++c) back(i * k + d, c) = p[c];
        }
      });
  if (tp_comm_) tp_comm_->all_reduce(back);

  const MatrixView grad_streams = leading_rows(stream_grad_, rows * per_row);
  const MatrixView xbar = dx_;  // x_hat's adjoint first, the input gradient in place after
  const MatrixView vsums = laplacian_value_sums_;
  const Vector rbar = rstd_adjoint_;
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::norm_laplacian_stream_grads"), Rows(device_space(), 0, rows),
      KOKKOS_LAMBDA(const int64_t i) {
        const float r = stats(i, 2);
        for (int64_t j = 0; j < cols; ++j) xbar(i, j) = scale(j) * dy(i, j);
        float r_adjoint = 0.0f;
        for (int64_t d = 0; d < k; ++d) {
          const int64_t tt = i * per_row + d, qq = tt + k, e = i * k + d;
          const float mean_t = dir(e, 0), a = dir(e, 1), b = dir(e, 2), m2 = dir(e, 3);
          const float p1 = back(e, 0), p2 = back(e, 1), p3 = back(e, 2), p4 = back(e, 3);
          const float p5 = back(e, 4), p6 = back(e, 5), p7 = back(e, 6);
          const float mean_q = dir(e, 4);
          const float two_ra = 2.0f * r * a;
          const float sum_t = p5 - two_ra * p1;     // sum T
          const float sum_xt = p6 - two_ra * p2;    // sum x_hat T
          const float sum_jt_t = p7 - two_ra * p3;  // sum Jt T
          const float m2_adj = -r * r * p2;
          const float b_adj = -r * p2;
          const float a_adj = -2.0f * r * p3 + 2.0f * r * r * a * p2 - r * sum_xt;
          r_adjoint += -2.0f * a * p3 - 2.0f * r * (m2 - a * a) * p2 + (p4 + sum_jt_t) / r;
          const float w_coef = r * r * (m2 - a * a) + r * b;
          const float mean_tbar = layernorm ? sum_t / n : 0.0f;
          const float mean_aw = layernorm ? p1 / n : 0.0f;
          for (int64_t j = 0; j < cols; ++j) {
            // First order: no q stream, its gradient A_w and its centred values cq are 0.
            const float aw = second ? scale(j) * dt(qq, j) : 0.0f;
            const float tbar = scale(j) * dt(tt, j) - two_ra * aw;
            const float ct = q_in(tt, j) - mean_t;
            const float cq = second ? q_in(qq, j) - mean_q : 0.0f;
            if (second) grad_streams(qq, j) = r * (aw - mean_aw - x_hat(i, j) * p2 / n);
            grad_streams(tt, j) =
                r * (tbar - mean_tbar) + a_adj * x_hat(i, j) / n + 2.0f * m2_adj * ct / n;
            xbar(i, j) += -w_coef * aw + b_adj * cq / n - r * a * tbar + a_adj * ct / n;
          }
        }
        float s = 0.0f, sx = 0.0f;
        for (int64_t j = 0; j < cols; ++j) {
          s += xbar(i, j);
          sx += x_hat(i, j) * xbar(i, j);
        }
        vsums(i, 0) = layernorm ? s : 0.0f;
        vsums(i, 1) = sx;
        rbar(i) = r_adjoint;
      });
  if (tp_comm_) tp_comm_->all_reduce(vsums);
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::norm_laplacian_input_grad"), Rows(device_space(), 0, rows),
      KOKKOS_LAMBDA(const int64_t i) {
        const float r = stats(i, 2);
        const float mean = vsums(i, 0) / n, mean_x = vsums(i, 1) / n;
        const float tail = r * r * rbar(i) / n;
        for (int64_t j = 0; j < cols; ++j) {
          xbar(i, j) = r * (xbar(i, j) - mean - x_hat(i, j) * mean_x) - tail * x_hat(i, j);
        }
      });
  *dt_in = grad_streams;
  return xbar;
}

// `directions` stream rows per value row: k first-order tangents (Sobolev training), or the
// forward Laplacian's 2k (Mlp::reserve_laplacian); the per-direction statistics have room for
// either (k = directions).
void FeatureNorm::reserve_tangent_backward(int64_t directions) {
  reserve_tangents(directions);
  if (directions <= laplacian_rows_) return;
  const int64_t k = directions;
  const int64_t cols = layout_.local_width;
  x_hat_ = Matrix(name_ + "/laplacian_x_hat", rows_, cols);
  hat_streams_ = Matrix(name_ + "/laplacian_streams", rows_ * directions, cols);
  laplacian_sums_ = Matrix(name_ + "/laplacian_sums", rows_ * directions, 3);
  laplacian_stats_ = Matrix(name_ + "/laplacian_stats", rows_ * k, 5);
  laplacian_back_sums_ = Matrix(name_ + "/laplacian_backward_sums", rows_ * k, 7);
  laplacian_value_sums_ = Matrix(name_ + "/laplacian_value_sums", rows_, 2);
  rstd_adjoint_ = Vector(name_ + "/laplacian_rstd_adjoint", rows_);
  stream_grad_ = Matrix(name_ + "/laplacian_stream_grad", rows_ * directions, cols);
  if (tp_comm_) tp_comm_->reserve_reductions(static_cast<size_t>(rows_ * k * 7));
  laplacian_rows_ = directions;
}

void FeatureNorm::parameter_gradients(MatrixView dy, const LayerPass& pass) {
  const bool layernorm = layout_.kind == NormKind::layernorm;
  LayerScratch& scratch = *pass.scratch;
  // DP buckets or a later all-reduce take the direct gradients from here when the model
  // defers them (pass.deferred is `now` otherwise).
  const bool all_reduce = pass.deferred == DeferredReduction::now;
  if (layout_.direct) {
    const VectorView dscale = params_[0].gradient(scratch);
    const VectorView dbias = layernorm ? params_[1].gradient(scratch) : VectorView();
    norm_column_sums(x_, dy, stats_, layernorm, compute_dtype_, dscale, dbias);
    for (ShardedParameter& p : params_) p.reduce(scratch, all_reduce);
    return;
  }
  // Full-width vectors [scale | bias], zero outside this rank's columns, summed over the
  // batch axes (and the feature axis when split) in one all-reduce; then each stored block
  // is kept.
  const VectorView full(full_grad_.data(), full_grad_.extent(0));
  norm_column_sums_full(x_, dy, stats_, layernorm, compute_dtype_, offset_, layout_.width, full);
  ShardedParameter::reduce_side_by_side(parameters_, all_reduce);
}

std::string FeatureNorm::describe() const {
  return name_ + ": " + describe_norm_layout(layout_);
}

}  // namespace meshtrain
