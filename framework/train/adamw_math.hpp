#pragma once
// One AdamW element update and its bias correction (torch.optim.AdamW's arithmetic), shared by
// the dense optimizer (framework/train/optimizer.cpp) and the sparse table updates
// (layers/sparse_optimizer.cpp), so that a row updated every step is the same float either way;
// and SGD's element updates (torch.optim.SGD's), which every path of the dense optimizer calls.

#include <Kokkos_Core.hpp>

#include "framework/core/kokkos_math.hpp"

namespace meshtrain {

// 1 - beta^t, computed in double and rounded once.
KOKKOS_INLINE_FUNCTION float adamw_bias_correction(float beta, double t) {
  return static_cast<float>(1.0 - kmath::pow(static_cast<double>(beta), t));
}

// m, v updated in place; returns p * decay - step_size * m / (sqrt(v * inv_correction2) + eps)
// (m_hat = m / c1 and v_hat = v / c2 with the divisions by c1, c2 hoisted out:
// step_size = lr / c1, inv_correction2 = 1 / c2, decay = 1 - lr * wd).
KOKKOS_INLINE_FUNCTION float adamw_element(float p, float grad, float& m, float& v, float beta1,
                                           float beta2, float decay, float step_size,
                                           float inv_correction2, float eps) {
  const float mi = beta1 * m + (1.0f - beta1) * grad;
  const float vi = beta2 * v + (1.0f - beta2) * grad * grad;
  m = mi;
  v = vi;
  return p * decay - step_size * mi / (kmath::sqrt(vi * inv_correction2) + eps);
}

// SGD with momentum: buf updated in place (at the first step buf = the gradient, torch's);
// returns p - lr * buf, the gradient with weight decay wd added.
KOKKOS_INLINE_FUNCTION float sgd_element(float p, float grad, float& buf, float lr, float momentum,
                                         float wd, bool first) {
  const float decayed = grad + wd * p;
  const float b = first ? decayed : momentum * buf + decayed;
  buf = b;
  return p - lr * b;
}

// Plain SGD (momentum 0, no state): p - lr * (grad + wd * p).
KOKKOS_INLINE_FUNCTION float sgd_plain_element(float p, float grad, float lr, float wd) {
  return p - lr * (grad + wd * p);
}

}  // namespace meshtrain
