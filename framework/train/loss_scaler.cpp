#include "framework/train/loss_scaler.hpp"

#include <cmath>

#include "framework/core/kernel_label.hpp"
#include "framework/core/kokkos_math.hpp"
#include "framework/core/precision.hpp"
#include "base/error.hpp"

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
  double non_finite = 0.0;
  for (ShardedTensor& g : grads) {
    const Vector data = g.local;
    double found = 0.0;
    Kokkos::parallel_reduce(
        MESHTRAIN_LABEL("meshtrain::loss_scaler_unscale"), data.extent(0),
        KOKKOS_LAMBDA(const std::size_t k, double& bad) {
          const float v = data(k) * inverse;
          data(k) = v;
          if (!kmath::isfinite(v)) bad += 1.0;
        },
        found);
    non_finite += found;
  }
  return sum_over_ranks(non_finite) == 0.0;
}

double LossScaler::count_beyond_fp16(ConstMatrixView inputs) const {
  const int64_t columns = static_cast<int64_t>(inputs.extent(1));
  double beyond = 0.0;
  Kokkos::parallel_reduce(
      MESHTRAIN_LABEL("meshtrain::loss_scaler_count_beyond_fp16"), inputs.size(),
      KOKKOS_LAMBDA(const std::size_t k, double& count) {
        const float x = inputs(static_cast<int64_t>(k) / columns, static_cast<int64_t>(k) % columns);
        if (kmath::isfinite(x) && !kmath::isfinite(fp16_to_float(float_to_fp16(x)))) count += 1.0;
      },
      beyond);
  return beyond;
}

double LossScaler::sum_over_ranks(double count) {
  non_finite_host_(0) = count;
  Kokkos::deep_copy(non_finite_, non_finite_host_);
  world_.all_reduce(DoubleVectorView(non_finite_.data(), 1));
  Kokkos::deep_copy(non_finite_host_, non_finite_);
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
