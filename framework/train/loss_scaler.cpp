#include "framework/train/loss_scaler.hpp"

#include <cmath>

#include "base/error.hpp"
#include "framework/core/exec_space.hpp"
#include "framework/core/kernel_label.hpp"
#include "framework/core/kokkos_math.hpp"
#include "framework/core/precision.hpp"
#include "framework/core/step_graph.hpp"
#include "framework/core/view_ops.hpp"

namespace meshtrain {

LossScaler::LossScaler(Communicator& world, LossScalerSettings settings)
    : world_(world),
      settings_(settings),
      scale_(settings.initial_scale),
      non_finite_("meshtrain::loss_scaler_non_finite", 1),
      non_finite_host_(host_mirror(non_finite_)) {}

void LossScaler::restore(double scale, int64_t clean_steps) {
  if (!(scale > 0.0) || !std::isfinite(scale) || clean_steps < 0) {
    MESHTRAIN_BAD_INPUT("the checkpoint's loss scale ", scale, " (after ", clean_steps,
                        " clean steps) is not a positive finite number");
  }
  scale_ = scale;
  clean_steps_ = clean_steps;
}

bool LossScaler::unscale(std::vector<ShardedTensor>& grads) {
  const float inverse = static_cast<float>(1.0 / scale_);
  // One device count per gradient (sized at the first step), summed on the device and read
  // back by one copy: reductions into device scalars (reduce_into, exec_space.hpp).
  if (found_.extent(0) != grads.size()) {
    found_ =
        Kokkos::View<double*, Kokkos::LayoutRight>("meshtrain::loss_scaler_found", grads.size());
  }
  for (size_t i = 0; i < grads.size(); ++i) {
    const Vector data = grads[i].local;
    reduce_into(
        MESHTRAIN_LABEL("meshtrain::loss_scaler_unscale"), device_range(0, data.extent(0)),
        KOKKOS_LAMBDA(const int64_t k, double& bad) {
          const float v = data(k) * inverse;
          data(k) = v;
          if (!kmath::isfinite(v)) bad += 1.0;
        },
        Kokkos::subview(found_, i));
  }
  const auto found = found_;
  const auto total = non_finite_;
  const int64_t count = static_cast<int64_t>(grads.size());
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::loss_scaler_total"), device_range(0, 1),
      KOKKOS_LAMBDA(const int64_t) {
        double sum = 0.0;
        for (int64_t k = 0; k < count; ++k) sum += found(k);
        total(0) = sum;
      });
  fence_all(MESHTRAIN_LABEL("meshtrain::loss_scaler_before_sum"));
  world_.all_reduce(DoubleVectorView(non_finite_.data(), 1));
  note_host_read("the gradients' finiteness (LossScaler::unscale)");
  copy_view(non_finite_host_, non_finite_);
  return non_finite_host_(0) == 0.0;
}

double LossScaler::count_beyond_fp16(ConstMatrixView inputs) const {
  const int64_t columns = static_cast<int64_t>(inputs.extent(1));
  reduce_into(  // into a device scalar, as in unscale
      MESHTRAIN_LABEL("meshtrain::loss_scaler_count_beyond_fp16"),
      device_range(0, static_cast<int64_t>(inputs.size())),
      KOKKOS_LAMBDA(const int64_t k, double& count) {
        const float x = inputs(k / columns, k % columns);
        if (kmath::isfinite(x) && !kmath::isfinite(fp16_to_float(float_to_fp16(x)))) count += 1.0;
      },
      Kokkos::subview(non_finite_, 0));
  copy_view(non_finite_host_, non_finite_);
  return non_finite_host_(0);
}

double LossScaler::sum_over_ranks(double count) {
  non_finite_host_(0) = count;
  copy_view(non_finite_, non_finite_host_);
  world_.all_reduce(DoubleVectorView(non_finite_.data(), 1));
  copy_view(non_finite_host_, non_finite_);
  return non_finite_host_(0);
}

void LossScaler::update(bool finite) {
  if (!finite) {
    scale_ *= settings_.backoff_factor;
    clean_steps_ = 0;
    return;
  }
  if (++clean_steps_ >= settings_.growth_interval) {
    scale_ *= settings_.growth_factor;
    clean_steps_ = 0;
  }
}

}  // namespace meshtrain
