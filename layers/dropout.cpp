#include "layers/dropout.hpp"

#include <Kokkos_Core.hpp>
#include <cmath>

#include "base/error.hpp"
#include "framework/core/exec_space.hpp"
#include "framework/core/kernel_label.hpp"
#include "framework/core/precision.hpp"

namespace meshtrain {
namespace {

using Range2 = Kokkos::MDRangePolicy<Kokkos::Rank<2>>;

Range2 range_of(const MatrixView& m) {
  return Range2(device_space(), {0, 0},
                {static_cast<int64_t>(m.extent(0)), static_cast<int64_t>(m.extent(1))});
}

// out = keep ? round(in * scale) : 0 for every element of the block; out may be in.
// `directions` > 1: the block holds that many tangent rows per value row (row i of the block
// takes value row i / directions's mask).
void apply_mask(MatrixView in, MatrixView out, const TrainingPass& key, int64_t layer,
                int64_t offset, uint32_t threshold, float scale, Dtype dtype,
                int64_t directions = 1) {
  const uint64_t seed = key.seed;
  const int64_t step = key.step;
  const int64_t micro = key.micro_batch;
  const int64_t first_row = key.first_row;
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::dropout"), range_of(in),
      KOKKOS_LAMBDA(const int64_t i, const int64_t j) {
        const uint32_t bits =
            dropout_bits(seed, step, micro, first_row + i / directions, offset + j, layer);
        out(i, j) = bits >= threshold ? round_to(in(i, j) * scale, dtype) : 0.0f;
      });
}

}  // namespace

uint32_t dropout_threshold(double rate) {
  const double t = std::floor(rate * 4294967296.0);
  return t >= 4294967295.0 ? 0xffffffffu : static_cast<uint32_t>(t);
}

float dropout_scale(double rate) {
  return static_cast<float>(1.0 / (1.0 - rate));
}

DropoutLayer::DropoutLayer(double rate, int64_t layer, const std::string& name, int64_t rows,
                           int64_t width, FeatureLayout layout, int64_t offset, Dtype dtype)
    : rate_(rate),
      threshold_(dropout_threshold(rate)),
      scale_(dropout_scale(rate)),
      layer_(layer),
      layout_(layout),
      offset_(offset),
      dtype_(dtype),
      out_(name, rows, width) {
  // model.dropout's range is the config's to check (framework/train/config_schema.cpp); the
  // model makes a dropout layer only for a rate above 0.
  MESHTRAIN_REQUIRE(rate > 0.0 && rate < 1.0, "DropoutLayer: rate ", rate, " is outside (0, 1)");
  MESHTRAIN_REQUIRE(layer >= 0 && layer < kDropoutMaxLayers, "dropout layer index ", layer,
                    " is outside [0, ", kDropoutMaxLayers, ")");
  MESHTRAIN_REQUIRE(offset + width <= (int64_t{1} << 32), "dropout: feature ", offset + width,
                    " does not fit the key's 32 bits");
}

MatrixView DropoutLayer::forward(MatrixView x, const LayerPass& pass) {
  has_mask_ = pass.training != nullptr;
  if (!has_mask_) {
    last_ = x;
    return x;
  }
  key_ = *pass.training;
  MESHTRAIN_REQUIRE(key_.micro_batch >= 0 && key_.micro_batch < kDropoutMaxMicroBatches,
                    "dropout: micro-batch ", key_.micro_batch, " is outside the key's 16 bits");
  MESHTRAIN_REQUIRE(key_.first_row >= 0 &&
                        key_.first_row + static_cast<int64_t>(x.extent(0)) <= (int64_t{1} << 32),
                    "dropout: row ", key_.first_row, " does not fit the key's 32 bits");
  apply_mask(x, out_, key_, layer_, offset_, threshold_, scale_, dtype_);
  last_ = out_;
  return out_;
}

MatrixView DropoutLayer::backward(MatrixView dy, bool need_input_grad, const LayerPass&) {
  if (!need_input_grad) return MatrixView();
  if (has_mask_) apply_mask(dy, dy, key_, layer_, offset_, threshold_, scale_, dtype_);
  return dy;
}

MatrixView DropoutLayer::forward_tangents(MatrixView dx, const LayerPass&) {
  const int64_t rows = static_cast<int64_t>(out_.extent(0));
  const int64_t k = tangent_directions(static_cast<int64_t>(dx.extent(0)), rows, "dropout");
  if (!has_mask_) return dx;  // the identity outside training
  const MatrixView out = leading_rows(tangents_, rows * k);
  apply_mask(dx, out, key_, layer_, offset_, threshold_, scale_, Dtype::fp32, k);
  return out;
}

void DropoutLayer::reserve_tangents(int64_t directions) {
  if (directions <= tangent_capacity_) return;
  tangents_ = Matrix("dropout/tangents", out_.extent(0) * directions, out_.extent(1));
  tangent_capacity_ = directions;
}

MatrixView DropoutLayer::backward_cotangents(MatrixView dy, const LayerPass& pass) {
  // A block only outside training (cotangents_by_rows: no mask).
  const int64_t rows =
      cotangent_block_rows(pass, static_cast<int64_t>(out_.extent(0)), "dropout").rows;
  const int64_t k = cotangent_directions(static_cast<int64_t>(dy.extent(0)), rows, "dropout");
  if (!has_mask_) return dy;
  const MatrixView out = leading_rows(cotangents_, rows * k);
  apply_mask(dy, out, key_, layer_, offset_, threshold_, scale_, Dtype::fp32, k);
  return out;
}

void DropoutLayer::reserve_cotangents(int64_t directions) {
  if (directions <= cotangent_capacity_) return;
  cotangents_ = Matrix("dropout/cotangents", out_.extent(0) * directions, out_.extent(1));
  cotangent_capacity_ = directions;
}

MatrixView DropoutLayer::backward_with_tangents(MatrixView dy, MatrixView dt, bool need_input_grad,
                                                const LayerPass& pass, MatrixView* dt_in) {
  MESHTRAIN_REQUIRE(dtype_ == Dtype::fp32, "dropout: training on derivatives is fp32 only");
  if (!need_input_grad) return MatrixView();
  // dt is not written (only dy may be): its product goes to the cotangents' buffer.
  *dt_in = backward_cotangents(dt, pass);
  return backward(dy, need_input_grad, pass);
}

void DropoutLayer::reserve_tangent_backward(int64_t directions) {
  reserve_tangents(directions);
  reserve_cotangents(directions);
}

}  // namespace meshtrain
