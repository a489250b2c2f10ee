#pragma once
// Dynamic loss scaling for fp16 (docs/mixed_precision.md), as PyTorch's GradScaler with its
// defaults: the loss gradient is multiplied by `scale` (initially 2^16) before backward so
// small fp16 gradients do not flush to zero; after the gradients are reduced, unscale()
// divides them by it and finds out whether any is inf or NaN on any rank (one all-reduce
// over all ranks, so every rank decides alike). Then update(): a step with a non-finite
// gradient is skipped (the optimizer does not run) and halves the scale; after 2000 clean
// steps in a row the scale doubles. bf16 and fp32 runs do not scale (scale stays 1).
// A non-finite loss (the fp16 forward pass overflowed) skips the step and halves the scale
// alike, as GradScaler does, whose backward then yields non-finite gradients.
//
// The state (scale, clean steps) is saved in checkpoints (TrainState) so a resumed run
// continues exactly.

#include <cstdint>
#include <vector>

#include "framework/comm/communicator.hpp"
#include "framework/core/sharded_tensor.hpp"

namespace meshtrain {

struct LossScalerSettings {
  double initial_scale = 65536.0;  // 2^16
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
};

class LossScaler {
 public:
  // `world`: all ranks (every rank holds some gradients). Allocates its one scalar buffer.
  explicit LossScaler(Communicator& world, LossScalerSettings settings = {});

  float scale() const { return static_cast<float>(scale_); }
  int64_t clean_steps() const { return clean_steps_; }
  // From a checkpoint; bad_input for a scale that is not a positive finite number.
  void restore(double scale, int64_t clean_steps);

  // grads /= scale, in place; true when every gradient on every rank is finite. Collective.
  bool unscale(std::vector<ShardedTensor>& grads);
  // After a step: backoff on a non-finite one, growth after growth_interval clean ones.
  void update(bool finite);
  // Elements of `inputs` on this rank that fp16 cannot hold (|x| >= 65520 rounds to inf):
  // a batch with any has a non-finite fp16 loss at every scale. No communication.
  double count_beyond_fp16(ConstMatrixView inputs) const;
  // `count` summed over every rank. Collective.
  double sum_over_ranks(double count);

 private:
  Communicator& world_;
  LossScalerSettings settings_;
  double scale_;
  int64_t clean_steps_ = 0;
  // [1]: a count on this rank, then over all ranks (sum_over_ranks)
  Kokkos::View<double*, Kokkos::LayoutRight> non_finite_;
  Kokkos::View<double*, Kokkos::LayoutRight>::HostMirror non_finite_host_;
  // [gradients]: non-finite elements of each gradient on this rank (unscale)
  Kokkos::View<double*, Kokkos::LayoutRight> found_;
};

}  // namespace meshtrain
