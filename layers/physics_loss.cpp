#include "layers/physics_loss.hpp"

#include <Kokkos_Core.hpp>
#include <cmath>
#include <set>
#include <string>
#include <utility>

#include "base/error.hpp"
#include "framework/core/exec_space.hpp"
#include "framework/core/kernel_label.hpp"
#include "framework/core/view_ops.hpp"

namespace meshtrain {
namespace {

void check_statistics(const std::vector<double>& values, int64_t count, const char* what,
                      bool positive) {
  if (values.empty()) return;
  if (static_cast<int64_t>(values.size()) != count) {
    MESHTRAIN_BAD_INPUT("physics loss: ", values.size(), " ", what, " values for ", count,
                        " columns");
  }
  for (const double v : values) {
    if (positive ? !(v > 0.0) : !std::isfinite(v)) {
      MESHTRAIN_BAD_INPUT("physics loss: a ", what, " value is ", v);
    }
  }
}

Vector vector_of(const char* label, const std::vector<double>& values, int64_t count,
                 double fallback) {
  Vector v(std::string(label), count);
  auto host = host_mirror(v);
  for (int64_t i = 0; i < count; ++i) {
    host(i) = static_cast<float>(values.empty() ? fallback : values[i]);
  }
  copy_view(v, host);
  return v;
}

}  // namespace

PhysicsLoss::PhysicsLoss(PhysicsLossSettings settings, ParallelContext& context, int64_t rows,
                         int64_t inputs, int64_t outputs, FeatureLayout layout)
    : residual_(std::move(settings.residual)),
      rows_(rows),
      inputs_(inputs),
      outputs_(outputs),
      directions_(static_cast<int64_t>(settings.inputs.size())),
      residuals_(settings.residuals),
      weight_(settings.weight),
      whole_values_(context, rows, outputs, layout),
      whole_streams_(context, rows * 2 * static_cast<int64_t>(settings.inputs.size()), outputs,
                     layout) {
  if (directions_ == 0) MESHTRAIN_BAD_INPUT("physics loss: no input column to differentiate by");
  std::set<int64_t> seen;
  for (const int64_t i : settings.inputs) {
    if (i < 0 || i >= inputs || !seen.insert(i).second) {
      MESHTRAIN_BAD_INPUT("physics loss: input column ", i, " is outside [0, ", inputs,
                          ") or chosen twice");
    }
  }
  if (!residual_) MESHTRAIN_BAD_INPUT("physics loss: no residual function given");
  if (residuals_ < 1) {
    MESHTRAIN_BAD_INPUT("physics loss: residuals per point must be >= 1, got ", residuals_);
  }
  if (!(weight_ >= 0.0))
    MESHTRAIN_BAD_INPUT("physics loss: the weight must be >= 0, got ", weight_);
  check_statistics(settings.input_std, inputs, "input standard deviation", true);
  check_statistics(settings.target_std, outputs, "target standard deviation", true);
  check_statistics(settings.target_mean, outputs, "target mean", false);

  const ParallelContext::OutputColumns columns =
      context.output_columns("physics loss", outputs, layout);
  local_width_ = columns.local_width;
  offset_ = columns.offset;
  global_rows_ = rows_ * context.batch_parallel();
  // Every feature rank holds the same rows, gathered whole: the sum is over the batch axes.
  batch_comm_ = context.comm(context.active(context.batch_axes()));

  const int64_t k = directions_;
  seeds_ = Matrix("meshtrain::physics_loss_seeds", rows_ * 2 * k, inputs);
  auto seeds_host = host_mirror(seeds_);
  for (int64_t r = 0; r < rows_; ++r) {
    for (int64_t d = 0; d < k; ++d) {
      const int64_t i = settings.inputs[d];
      seeds_host(r * 2 * k + d, i) =
          static_cast<float>(1.0 / (settings.input_std.empty() ? 1.0 : settings.input_std[i]));
    }
  }
  copy_view(seeds_, seeds_host);
  target_mean_ =
      vector_of("meshtrain::physics_loss_target_mean", settings.target_mean, outputs, 0.0);
  target_std_ = vector_of("meshtrain::physics_loss_target_std", settings.target_std, outputs, 1.0);
  u_ = Matrix("meshtrain::physics_loss_u", rows_, outputs);
  du_ = Matrix("meshtrain::physics_loss_du", rows_, outputs * k);
  d2u_ = Matrix("meshtrain::physics_loss_d2u", rows_, outputs * k);
  r_ = Matrix("meshtrain::physics_loss_r", rows_, residuals_);
  dr_du_ = Matrix("meshtrain::physics_loss_dr_du", rows_, residuals_ * outputs);
  dr_ddu_ = Matrix("meshtrain::physics_loss_dr_ddu", rows_, residuals_ * outputs * k);
  dr_dd2u_ = Matrix("meshtrain::physics_loss_dr_dd2u", rows_, residuals_ * outputs * k);
  output_gradient_ = Matrix("meshtrain::physics_loss_output_gradient", rows_, local_width_);
  stream_gradient_ = Matrix("meshtrain::physics_loss_stream_gradient", rows_ * 2 * k, local_width_);
  sum_ = Kokkos::View<double*, Kokkos::LayoutRight>("meshtrain::physics_loss_sum", 1);
  sum_host_ = host_mirror(sum_);
}

PhysicsLossResult PhysicsLoss::evaluate(MatrixView x, MatrixView output, MatrixView streams,
                                        bool with_gradient) {
  const int64_t k = directions_, outputs = outputs_, residuals = residuals_;
  MESHTRAIN_REQUIRE(static_cast<int64_t>(x.extent(0)) >= rows_ &&
                        static_cast<int64_t>(output.extent(0)) == rows_ &&
                        static_cast<int64_t>(output.extent(1)) == local_width_ &&
                        static_cast<int64_t>(streams.extent(0)) == rows_ * 2 * k &&
                        static_cast<int64_t>(streams.extent(1)) == local_width_,
                    "physics loss: points [", x.extent(0), ", ", x.extent(1), "], output [",
                    output.extent(0), ", ", output.extent(1), "] and streams [", streams.extent(0),
                    ", ", streams.extent(1), "], expected [>= ", rows_, ", ...], [", rows_, ", ",
                    local_width_, "] and [", rows_ * 2 * k, ", ", local_width_, "]");
  const MatrixView value = whole_values_.gather(output);
  const MatrixView stream = whole_streams_.gather(streams);
  const Matrix u = u_, du = du_, d2u = d2u_;
  const Vector mean = target_mean_, scale = target_std_;
  // The user's units: u = y' std + mean, du = std t', d2u = std s'.
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::physics_loss_unpack"), device_range(0, rows_),
      KOKKOS_LAMBDA(const int64_t r) {
        for (int64_t o = 0; o < outputs; ++o) {
          const float s = scale(o);
          u(r, o) = value(r, o) * s + mean(o);
          for (int64_t d = 0; d < k; ++d) {
            du(r, o * k + d) = s * stream(r * 2 * k + d, o);
            d2u(r, o * k + d) = s * stream(r * 2 * k + k + d, o);
          }
        }
      });
  Kokkos::deep_copy(r_, 0.0f);
  Kokkos::deep_copy(dr_du_, 0.0f);
  Kokkos::deep_copy(dr_ddu_, 0.0f);
  Kokkos::deep_copy(dr_dd2u_, 0.0f);
  residual_(PhysicsPoints{x, u_, du_, d2u_}, PhysicsResiduals{r_, dr_du_, dr_ddu_, dr_dd2u_});
  Kokkos::fence();

  const Matrix r = r_, dr_du = dr_du_, dr_ddu = dr_ddu_, dr_dd2u = dr_dd2u_;
  const Matrix g_out = output_gradient_, g_streams = stream_gradient_;
  const int64_t width = local_width_, offset = offset_;
  const double count = static_cast<double>(global_rows_) * static_cast<double>(residuals);
  const float factor = static_cast<float>(2.0 * weight_ / count);
  reduce_into(
      MESHTRAIN_LABEL("meshtrain::physics_loss"), device_range(0, rows_),
      KOKKOS_LAMBDA(const int64_t row, double& acc) {
        for (int64_t c = 0; c < residuals; ++c) {
          acc += static_cast<double>(r(row, c)) * static_cast<double>(r(row, c));
        }
        if (!with_gradient) return;
        // dLoss/d(.) = factor sum_c r_c dr_c/d(.), times target_std_o for the model's units.
        for (int64_t j = 0; j < width; ++j) {
          const int64_t o = offset + j;
          float g = 0.0f;
          for (int64_t c = 0; c < residuals; ++c) g += r(row, c) * dr_du(row, c * outputs + o);
          g_out(row, j) = factor * scale(o) * g;
          for (int64_t d = 0; d < k; ++d) {
            float gt = 0.0f, gs = 0.0f;
            for (int64_t c = 0; c < residuals; ++c) {
              gt += r(row, c) * dr_ddu(row, (c * outputs + o) * k + d);
              gs += r(row, c) * dr_dd2u(row, (c * outputs + o) * k + d);
            }
            g_streams(row * 2 * k + d, j) = factor * scale(o) * gt;
            g_streams(row * 2 * k + k + d, j) = factor * scale(o) * gs;
          }
        }
      },
      Kokkos::subview(sum_, 0));
  Kokkos::fence();
  if (batch_comm_) batch_comm_->all_reduce(DoubleVectorView(sum_.data(), 1));
  copy_view(sum_host_, sum_);
  PhysicsLossResult result;
  result.mean_square = sum_host_(0) / count;
  result.loss = weight_ * result.mean_square;
  return result;
}

void PhysicsLoss::add_output_gradient_to(MatrixView into, float into_weight) const {
  MESHTRAIN_REQUIRE(
      into.extent(0) == output_gradient_.extent(0) && into.extent(1) == output_gradient_.extent(1),
      "physics loss: adding its output gradient [", output_gradient_.extent(0), ", ",
      output_gradient_.extent(1), "] to [", into.extent(0), ", ", into.extent(1), "]");
  const Matrix g = output_gradient_;
  const int64_t width = static_cast<int64_t>(g.extent(1));
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::physics_loss_add_gradient"),
      device_range(0, static_cast<int64_t>(g.extent(0))), KOKKOS_LAMBDA(const int64_t row) {
        for (int64_t j = 0; j < width; ++j) into(row, j) = into_weight * into(row, j) + g(row, j);
      });
}

}  // namespace meshtrain
