#include "layers/residual_block.hpp"

#include <Kokkos_Core.hpp>
#include <utility>

#include "base/error.hpp"
#include "framework/core/exec_space.hpp"
#include "framework/core/kernel_label.hpp"
#include "framework/core/precision.hpp"
#include "framework/core/view_ops.hpp"
#include "layers/inference.hpp"
#include "layers/norm.hpp"

namespace meshtrain {
namespace {

// out = a + b rounded to `dtype` (out may be a).
void add_rounded(MatrixView a, MatrixView b, MatrixView out, Dtype dtype, const char* what) {
  MESHTRAIN_REQUIRE(a.extent(0) == out.extent(0) && a.extent(1) == out.extent(1) &&
                        b.extent(0) == out.extent(0) && b.extent(1) == out.extent(1),
                    what, ": [", a.extent(0), ", ", a.extent(1), "] + [", b.extent(0), ", ",
                    b.extent(1), "] into [", out.extent(0), ", ", out.extent(1), "]");
  if (dtype == Dtype::fp32 && inference::layers_run_host_kernels() && out.data() != a.data() &&
      out.data() != b.data()) {
    // per-ISA clones, the same sums
    return inference::add(a, b, out, MESHTRAIN_LABEL("meshtrain::residual_add"));
  }
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::residual_add"),
      Kokkos::MDRangePolicy<Kokkos::Rank<2>>(
          device_space(), {0, 0},
          {static_cast<int64_t>(out.extent(0)), static_cast<int64_t>(out.extent(1))}),
      KOKKOS_LAMBDA(const int64_t i, const int64_t j) {
        out(i, j) = round_to(a(i, j) + b(i, j), dtype);
      });
}

// out = a + b for tangents (fp32; out is neither): plain pointer loops over rows.
void add_tangents(MatrixView a, MatrixView b, MatrixView out) {
  MESHTRAIN_REQUIRE(a.extent(0) == out.extent(0) && a.extent(1) == out.extent(1) &&
                        b.extent(0) == out.extent(0) && b.extent(1) == out.extent(1),
                    "residual tangents: [", a.extent(0), ", ", a.extent(1), "] + [", b.extent(0),
                    ", ", b.extent(1), "] into [", out.extent(0), ", ", out.extent(1), "]");
  const int64_t cols = static_cast<int64_t>(out.extent(1));
  const int64_t a_stride = static_cast<int64_t>(a.stride(0));
  const int64_t b_stride = static_cast<int64_t>(b.stride(0));
  const int64_t o_stride = static_cast<int64_t>(out.stride(0));
  if (inference::layers_run_host_kernels()) {  // per-ISA clones
    return inference::add(a, b, out, MESHTRAIN_LABEL("meshtrain::residual_tangents"));
  }
  const float* a_data = a.data();
  const float* b_data = b.data();
  float* o_data = out.data();
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::residual_tangents"),
      Kokkos::RangePolicy<>(device_space(), 0, static_cast<int64_t>(out.extent(0))),
      KOKKOS_LAMBDA(const int64_t i) {
        const float* KOKKOS_RESTRICT ai = a_data + i * a_stride;
        const float* KOKKOS_RESTRICT bi = b_data + i * b_stride;
        float* KOKKOS_RESTRICT oi = o_data + i * o_stride;
        for (int64_t j = 0; j < cols; ++j) oi[j] = ai[j] + bi[j];
      });
}

}  // namespace

ResidualBlock::ResidualBlock(std::string name, std::vector<std::unique_ptr<Layer>> layers,
                             FeatureLayout input_layout, int64_t input_offset, int64_t rows,
                             int64_t width, Dtype dtype, const ResidualSharedBuffers* shared)
    : name_(std::move(name)),
      layers_(std::move(layers)),
      layout_(input_layout),
      offset_(input_offset),
      dtype_(dtype) {
  if (layers_.empty()) MESHTRAIN_BAD_INPUT("residual block '", name_, "' has no layers");
  const Layer& last = *layers_.back();
  if (last.output_layout() != input_layout || last.output_width() != width ||
      last.output_offset() != input_offset) {
    MESHTRAIN_BAD_INPUT("residual block '", name_, "': its layers end in ",
                        to_string(last.output_layout()), " features (", last.output_width(),
                        " columns from ", last.output_offset(), "), its input arrives ",
                        to_string(input_layout), " (", width, " columns from ", input_offset,
                        "): x + f(x) needs both alike (under tp: split input, and up and down "
                        "projections both tensor parallel)");
  }
  first_with_parameters_ = last_with_parameters_ = layers_.size();
  for (size_t k = 0; k < layers_.size(); ++k) {
    if (layers_[k]->parameter_count() == 0) continue;
    if (first_with_parameters_ == layers_.size()) first_with_parameters_ = k;
    last_with_parameters_ = k;
  }
  if (shared) {
    const auto fits = [&](MatrixView v) {
      return static_cast<int64_t>(v.extent(0)) == rows &&
             static_cast<int64_t>(v.extent(1)) == width;
    };
    MESHTRAIN_REQUIRE(dtype != Dtype::fp32 && fits(shared->output) && fits(shared->input_grad),
                      "residual block '", name_,
                      "': 16-bit storage needs a 16-bit compute dtype and shared buffers [", rows,
                      ", ", width, "]");
    out_ = shared->output;
    dx_ = shared->input_grad;
  } else {
    own_out_ = Matrix(name_ + "/output", rows, width);
    own_dx_ = Matrix(name_ + "/input_grad", rows, width);
    out_ = own_out_;
    dx_ = own_dx_;
  }
  rows_ = rows;
  std::vector<Layer*> inner;
  for (const auto& layer : layers_) inner.push_back(layer.get());
  inference_ = inference::Sequence(inner);
}

size_t ResidualBlock::parameter_count() const {
  size_t n = 0;
  for (const auto& layer : layers_) n += layer->parameter_count();
  return n;
}

std::vector<ShardedParameter*> ResidualBlock::sharded_parameters() {
  std::vector<ShardedParameter*> all;
  for (const auto& layer : layers_) {
    const std::vector<ShardedParameter*> own = layer->sharded_parameters();
    all.insert(all.end(), own.begin(), own.end());
  }
  return all;
}

bool ResidualBlock::can_leave_gradients_partial() const {
  for (const auto& layer : layers_) {
    if (layer->parameter_count() > 0 && !layer->can_leave_gradients_partial()) return false;
  }
  return true;
}

LayerScratchNeeds ResidualBlock::scratch_needs() const {
  LayerScratchNeeds needs;
  for (const auto& layer : layers_) needs.merge(layer->scratch_needs());
  return needs;
}

double ResidualBlock::aux_loss() const {
  double sum = 0.0;
  for (const auto& layer : layers_) sum += layer->aux_loss();
  return sum;
}

std::string ResidualBlock::describe() const {
  std::string lines;
  for (const auto& layer : layers_) {
    const std::string line = layer->describe();
    if (line.empty()) continue;
    lines += (lines.empty() ? "" : "; ") + line;
  }
  return name_ + ": x + f(x), f = " + lines;
}

MatrixView ResidualBlock::forward(MatrixView x, const LayerPass& pass) {
  MatrixView h = x;
  for (size_t k = 0; k < layers_.size(); ++k) {
    LayerPass inner;
    inner.scratch = pass.scratch;
    inner.prefetch = k == last_with_parameters_ ? pass.prefetch : nullptr;
    inner.training = pass.training;  // a dropout inside the block keys on the same pass
    inner.inference_gemms = pass.inference_gemms;
    inner.derivative_forward = pass.derivative_forward;
    h = layers_[k]->forward(h, inner);
  }
  add_rounded(x, h, out_, dtype_, name_.c_str());
  return out_;
}

MatrixView ResidualBlock::infer(MatrixView x, const LayerPass& pass) {
  if (!inference::runs_host_kernels() || dtype_ != Dtype::fp32) return forward(x, pass);
  LayerPass inner;
  inner.scratch = pass.scratch;
  return inference_.run(x, inner, x, out_);
}

MatrixView ResidualBlock::backward(MatrixView dy, bool need_input_grad, const LayerPass& pass) {
  // dY is the residual's part of dX; copied first, as a layer may write into dY's memory (under
  // 16-bit storage dY arrives in the gradient stream from the block above, which f only reads).
  if (need_input_grad && dy.data() != dx_.data()) copy_into(dx_, dy);
  // The block's gradients reach the buckets as one entry: its layers leave them partial,
  // and the block reports them once all are computed.
  const bool bucketed = pass.deferred == DeferredReduction::in_buckets;
  MatrixView g = dy;
  for (size_t k = layers_.size(); k-- > 0;) {
    LayerPass inner = pass;
    inner.prefetch = k == first_with_parameters_ ? pass.prefetch : nullptr;
    if (bucketed) inner.deferred = DeferredReduction::later;
    g = layers_[k]->backward(g, /*need_input_grad=*/k > 0 || need_input_grad, inner);
  }
  if (bucketed) {
    pass.buckets->layer_ready(pass.index);
    pass.buckets->poll();
  }
  if (!need_input_grad) return MatrixView();
  add_rounded(dx_, g, dx_, dtype_, name_.c_str());
  return dx_;
}

MatrixView ResidualBlock::forward_tangents(MatrixView dx, const LayerPass& pass) {
  const int64_t k = tangent_directions(static_cast<int64_t>(dx.extent(0)), rows_, name_);
  LayerPass inner;
  inner.scratch = pass.scratch;
  inner.second_order = pass.second_order;  // the streams add as tangents do: x + f(x) is linear
  MatrixView h = dx;
  for (const auto& layer : layers_) h = layer->forward_tangents(h, inner);
  const MatrixView out = leading_rows(tangents_, rows_ * k);
  add_tangents(dx, h, out);
  return out;
}

void ResidualBlock::reserve_tangents(int64_t directions) {
  if (directions <= tangent_capacity_) return;
  for (const auto& layer : layers_) layer->reserve_tangents(directions);
  tangents_ = Matrix(name_ + "/tangents", rows_ * directions, out_.extent(1));
  tangent_capacity_ = directions;
}

MatrixView ResidualBlock::backward_cotangents(MatrixView dy, const LayerPass& pass) {
  const int64_t rows = cotangent_block_rows(pass, rows_, name_).rows;
  const int64_t k = cotangent_directions(static_cast<int64_t>(dy.extent(0)), rows, name_);
  LayerPass inner;
  inner.scratch = pass.scratch;
  inner.cotangent_first_row = pass.cotangent_first_row;
  inner.cotangent_rows = pass.cotangent_rows;
  MatrixView g = dy;
  const MatrixView out = leading_rows(cotangents_, rows * k);
  // A pre-norm block (the norm first) adds dy inside the norm's one pass over its cotangents.
  auto* norm = dynamic_cast<FeatureNorm*>(layers_.front().get());
  const bool fused = norm != nullptr && norm->cotangents_in_one_pass();
  for (size_t i = layers_.size(); i-- > (fused ? 1 : 0);) {
    g = layers_[i]->backward_cotangents(g, inner);
  }
  if (fused) {
    norm->cotangents_adding(g, dy, out, inner);
  } else {
    add_tangents(dy, g, out);
  }
  return out;
}

bool ResidualBlock::cotangents_by_rows() const {
  for (const auto& layer : layers_) {
    if (!layer->cotangents_by_rows()) return false;
  }
  return true;
}

void ResidualBlock::reserve_derivative_forward(bool for_cotangents) {
  for (const auto& layer : layers_) layer->reserve_derivative_forward(for_cotangents);
}

void ResidualBlock::reserve_cotangents(int64_t directions) {
  if (directions <= cotangent_capacity_) return;
  for (const auto& layer : layers_) layer->reserve_cotangents(directions);
  cotangents_ = Matrix(name_ + "/cotangents", rows_ * directions, out_.extent(1));
  cotangent_capacity_ = directions;
}

}  // namespace meshtrain

namespace meshtrain {

bool ResidualBlock::supports_laplacian() const {
  for (const auto& layer : layers_) {
    if (!layer->supports_laplacian()) return false;
  }
  return true;
}

bool ResidualBlock::supports_tangent_backward() const {
  for (const auto& layer : layers_) {
    if (!layer->supports_tangent_backward()) return false;
  }
  return true;
}

// y = x + f(x) is linear in (x, f(x)), so every stream adds alike: the gradients are the
// output's plus f's input gradients, for the value and for the streams. f's layers read dt
// without writing it (Layer::backward_with_tangents may overwrite dy only), so dt is added
// after them as it is.
MatrixView ResidualBlock::backward_with_tangents(MatrixView dy, MatrixView dt, bool need_input_grad,
                                                 const LayerPass& pass, MatrixView* dt_in) {
  MESHTRAIN_REQUIRE(pass.deferred != DeferredReduction::in_buckets, "residual block '", name_,
                    "': training on derivatives does not reduce in buckets");
  const int64_t k = cotangent_directions(static_cast<int64_t>(dt.extent(0)), rows_, name_);
  if (need_input_grad) copy_into(dx_, dy);
  MatrixView g = dy, g_streams = dt;
  for (size_t i = layers_.size(); i-- > 0;) {
    LayerPass inner = pass;
    inner.prefetch = nullptr;
    MatrixView streams_in;
    g = layers_[i]->backward_with_tangents(
        g, g_streams, /*need_input_grad=*/i > 0 || need_input_grad, inner, &streams_in);
    g_streams = streams_in;
  }
  if (!need_input_grad) return MatrixView();
  add_rounded(dx_, g, dx_, dtype_, name_.c_str());
  const MatrixView out = leading_rows(cotangents_, rows_ * k);
  add_tangents(dt, g_streams, out);
  *dt_in = out;
  return dx_;
}

void ResidualBlock::reserve_tangent_backward(int64_t directions) {
  for (const auto& layer : layers_) layer->reserve_tangent_backward(directions);
  reserve_tangents(directions);
  reserve_cotangents(directions);
}

}  // namespace meshtrain
