#include "framework/train/optimizer.hpp"

#include <Kokkos_Core.hpp>
#include <cmath>
#include <type_traits>

#include "base/error.hpp"
#include "framework/core/exec_space.hpp"
#include "framework/core/host_chunks.hpp"
#include "framework/core/host_clones.hpp"
#include "framework/core/kernel_label.hpp"
#include "framework/core/kokkos_math.hpp"
#include "framework/core/precision.hpp"
#include "framework/core/step_graph.hpp"
#include "framework/core/tensor_values.hpp"
#include "framework/core/view_ops.hpp"
#include "framework/train/adamw_math.hpp"

namespace meshtrain {
namespace {

// bits[i] = master rounded to `dtype`'s 16 bits (nothing for fp32): what every update writes
// into the parameter's 16-bit compute copy, the Kokkos kernels through CopyOut and the host
// loops directly.
template <Dtype dtype>
KOKKOS_INLINE_FUNCTION void write_copy(uint16_t* bits, int64_t i, float master) {
  if constexpr (dtype != Dtype::fp32) bits[i] = to_16bit_as<dtype>(master);
}

// Where an update also writes the parameter's 16-bit compute copy (ShardedTensor::copy_16bit):
// round_P(new master) in the same pass, so that no cast pass runs before the next forward.
// Without a copy (fp32, or a model that computes from the master) nothing is written. The
// copy's format is a template argument (fp32: no copy), so that each update is one loop
// without a per-element branch, which the compiler vectorizes.
template <Dtype dtype>
struct CopyOut {
  static constexpr Dtype kDtype = dtype;
  uint16_t* bits = nullptr;
  KOKKOS_INLINE_FUNCTION void write(int64_t i, float master) const {
    write_copy<dtype>(bits, i, master);
  }
};

// The gradient an update reads: fp32 floats, or the 16 bits of a gradient stored in 16 bits
// (ShardedTensor::stored_16bit: a DP weight gradient reduced over a 16-bit wire,
// partition/gradient_storage.hpp) widened as each element is read (exact), in the update's own
// pass.
struct GradIn {
  const float* f = nullptr;
  const uint16_t* h = nullptr;
  Dtype dtype = Dtype::fp32;
  KOKKOS_INLINE_FUNCTION float operator()(int64_t i) const {
    return h != nullptr ? from_16bit(h[i], dtype) : f[i];
  }
};

GradIn grad_in(const ShardedTensor& g) {
  if (g.stored_16bit()) return GradIn{nullptr, g.bits.data(), g.storage};
  return GradIn{g.local.data(), nullptr, Dtype::fp32};
}

// n 16-bit elements widened (exactly) into floats, per instruction set: with the format a
// template argument and not a per-element test (from_16bit's), the loop runs 16 lanes wide.
[[maybe_unused]] MESHTRAIN_HOST_CLONES_EXACT void widen_host(const uint16_t* __restrict h,
                                                             float* __restrict out, int64_t n,
                                                             bool bf16) {
  if (bf16) {
    for (int64_t j = 0; j < n; ++j) out[j] = from_16bit_as<Dtype::bf16>(h[j]);
  } else {
    for (int64_t j = 0; j < n; ++j) out[j] = from_16bit_as<Dtype::fp16>(h[j]);
  }
}

// body(gp, b, n) over [begin, end) with gp the floats of gradient elements [b, b + n): the
// gradient itself when fp32, else blocks of it widened into a stack buffer (the host loops'
// clones keep reading a float array; widening is exact, so the same floats).
template <class Body>
void with_float_gradient(const GradIn& g, int64_t begin, int64_t end, Body&& body) {
  if (g.h == nullptr) {
    body(g.f + begin, begin, end - begin);
    return;
  }
  constexpr int64_t kBlock = 512;
  float widened[kBlock];
  for (int64_t b = begin; b < end; b += kBlock) {
    const int64_t n = end - b < kBlock ? end - b : kBlock;
    widen_host(g.h + b, widened, n, g.dtype == Dtype::bf16);
    body(widened, b, n);
  }
}

// f(CopyOut<D>{...}) for the copy `t` has (CopyOut<fp32> without one).
template <class F>
void with_copy(const ShardedTensor& t, F&& f) {
  if (!t.copy_16bit) {
    f(CopyOut<Dtype::fp32>{});
    return;
  }
  // CopyOut writes bits[i] for every i of the update's range (t.local's): a raw pointer, so
  // the extents are checked here once.
  MESHTRAIN_REQUIRE(t.copy_16bit->bits.extent(0) == t.local.extent(0),
                    "optimizer: the 16-bit copy of '", t.name, "' holds ",
                    t.copy_16bit->bits.extent(0), " elements, its master ", t.local.extent(0));
  uint16_t* bits = t.copy_16bit->bits.data();
  if (t.copy_16bit->dtype == Dtype::bf16) {
    f(CopyOut<Dtype::bf16>{bits});
  } else {
    MESHTRAIN_REQUIRE(t.copy_16bit->dtype == Dtype::fp16, "optimizer: the 16-bit copy of '", t.name,
                      "' is not bf16 or fp16");
    f(CopyOut<Dtype::fp16>{bits});
  }
}

// The step's scalars as Optimizer::prepare_step lays them out: [0] the rate (SGD) or AdamW's
// step size lr / c1, [1] AdamW's 1 / c2, [2] AdamW's decay 1 - lr * wd, [3] SGD's first step
// (1 or 0). An eager step passes them by value (ByValue); a prepared step's kernels read them
// from memory when they run (InMemory: the device copy of Optimizer::prepared_, made by
// launch_prepared's first kernel), so that a replayed graph uses the current step's. The same
// floats either way, so the same bits.
struct ByValue {
  float s[4];
  KOKKOS_INLINE_FUNCTION float operator[](int k) const { return s[k]; }
};
struct InMemory {
  const float* s;
  KOKKOS_INLINE_FUNCTION float operator[](int k) const { return s[k]; }
};

// The updates on host memory (host_chunks.hpp: where the default execution space is the host's)
// as per-ISA clones without FMA contraction (host_clones.hpp): each element is the same IEEE
// operations as the Kokkos kernels' below (adamw_math.hpp's element functions; the baseline
// build has no FMA to contract into), so the masters, the state and the 16-bit copies are the
// same bits, 16 lanes at a time on AVX-512. The arrays are distinct allocations (master,
// gradient, slots, copy): __restrict. An eager step on the host only: a prepared step's
// scalars are read in its Kokkos kernel, as a graph's would be.
struct AdamwScalars {
  float beta1, beta2, decay, step_size, inv_correction2, eps;
};

template <Dtype dtype>
MESHTRAIN_INLINE void adamw_span(float* __restrict p, const float* __restrict g,
                                 float* __restrict m, float* __restrict v,
                                 uint16_t* __restrict bits, int64_t n, AdamwScalars s) {
  for (int64_t i = 0; i < n; ++i) {
    float mi = m[i], vi = v[i];
    const float updated = adamw_element(p[i], g[i], mi, vi, s.beta1, s.beta2, s.decay, s.step_size,
                                        s.inv_correction2, s.eps);
    m[i] = mi;
    v[i] = vi;
    p[i] = updated;
    write_copy<dtype>(bits, i, updated);
  }
}

// [[maybe_unused]]: a GPU build (kDefaultSpaceIsHost false) compiles them and calls none.
[[maybe_unused]] MESHTRAIN_HOST_CLONES_EXACT void adamw_host(float* p, const float* g, float* m,
                                                             float* v, uint16_t* bits, Dtype copy,
                                                             int64_t n, AdamwScalars s) {
  if (copy == Dtype::bf16) {
    adamw_span<Dtype::bf16>(p, g, m, v, bits, n, s);
  } else if (copy == Dtype::fp16) {
    adamw_span<Dtype::fp16>(p, g, m, v, bits, n, s);
  } else {
    adamw_span<Dtype::fp32>(p, g, m, v, bits, n, s);
  }
}

template <Dtype dtype>
MESHTRAIN_INLINE void sgd_span(float* __restrict p, const float* __restrict g,
                               float* __restrict buf, uint16_t* __restrict bits, int64_t n,
                               float lr, float momentum, float wd, bool first) {
  for (int64_t i = 0; i < n; ++i) {
    float b = buf[i];
    const float updated = sgd_element(p[i], g[i], b, lr, momentum, wd, first);
    buf[i] = b;
    p[i] = updated;
    write_copy<dtype>(bits, i, updated);
  }
}

[[maybe_unused]] MESHTRAIN_HOST_CLONES_EXACT void sgd_host(float* p, const float* g, float* buf,
                                                           uint16_t* bits, Dtype copy, int64_t n,
                                                           float lr, float momentum, float wd,
                                                           bool first) {
  if (copy == Dtype::bf16) {
    sgd_span<Dtype::bf16>(p, g, buf, bits, n, lr, momentum, wd, first);
  } else if (copy == Dtype::fp16) {
    sgd_span<Dtype::fp16>(p, g, buf, bits, n, lr, momentum, wd, first);
  } else {
    sgd_span<Dtype::fp32>(p, g, buf, bits, n, lr, momentum, wd, first);
  }
}

template <Dtype dtype>
MESHTRAIN_INLINE void sgd_plain_span(float* __restrict p, const float* __restrict g,
                                     uint16_t* __restrict bits, int64_t n, float lr, float wd) {
  for (int64_t i = 0; i < n; ++i) {
    const float updated = sgd_plain_element(p[i], g[i], lr, wd);
    p[i] = updated;
    write_copy<dtype>(bits, i, updated);
  }
}

[[maybe_unused]] MESHTRAIN_HOST_CLONES_EXACT void sgd_plain_host(float* p, const float* g,
                                                                 uint16_t* bits, Dtype copy,
                                                                 int64_t n, float lr, float wd) {
  if (copy == Dtype::bf16) {
    sgd_plain_span<Dtype::bf16>(p, g, bits, n, lr, wd);
  } else if (copy == Dtype::fp16) {
    sgd_plain_span<Dtype::fp16>(p, g, bits, n, lr, wd);
  } else {
    sgd_plain_span<Dtype::fp32>(p, g, bits, n, lr, wd);
  }
}

// Whether an update with these scalars runs as the host loops above (an eager step on a host
// build) rather than as its Kokkos kernel.
template <class Scalars>
constexpr bool kHostLoop = kDefaultSpaceIsHost&& std::is_same_v<Scalars, ByValue>;

template <class Copy, class Scalars>
void sgd_update(Vector p, GradIn g, Vector buf, Scalars scalars, float momentum, float wd,
                Copy copy) {
  const std::string& label = MESHTRAIN_LABEL("meshtrain::sgd_step");
  if constexpr (kHostLoop<Scalars>) {
    float* pp = p.data();
    float* bp = buf.data();
    uint16_t* bits = copy.bits;
    const float lr = scalars[0];
    const bool first = scalars[3] != 0.0f;
    for_host_chunks(label, static_cast<int64_t>(p.extent(0)), [=](int64_t begin, int64_t end) {
      with_float_gradient(g, begin, end, [&](const float* gp, int64_t b, int64_t n) {
        sgd_host(pp + b, gp, bp + b, bits == nullptr ? nullptr : bits + b, Copy::kDtype, n, lr,
                 momentum, wd, first);
      });
    });
  } else {
    Kokkos::parallel_for(
        label, Kokkos::RangePolicy<>(device_space(), 0, p.extent(0)),
        KOKKOS_LAMBDA(const int64_t i) {
          float b = buf(i);
          const float updated =
              sgd_element(p(i), g(i), b, scalars[0], momentum, wd, scalars[3] != 0.0f);
          buf(i) = b;
          p(i) = updated;
          copy.write(i, updated);
        });
  }
}

// Plain SGD (momentum 0): no state, so no slot is allocated (the plan counts none).
template <class Copy, class Scalars>
void sgd_plain_update(Vector p, GradIn g, Scalars scalars, float wd, Copy copy) {
  const std::string& label = MESHTRAIN_LABEL("meshtrain::sgd_plain_step");
  if constexpr (kHostLoop<Scalars>) {
    float* pp = p.data();
    uint16_t* bits = copy.bits;
    const float lr = scalars[0];
    for_host_chunks(label, static_cast<int64_t>(p.extent(0)), [=](int64_t begin, int64_t end) {
      with_float_gradient(g, begin, end, [&](const float* gp, int64_t b, int64_t n) {
        sgd_plain_host(pp + b, gp, bits == nullptr ? nullptr : bits + b, Copy::kDtype, n, lr, wd);
      });
    });
  } else {
    Kokkos::parallel_for(
        label, Kokkos::RangePolicy<>(device_space(), 0, p.extent(0)),
        KOKKOS_LAMBDA(const int64_t i) {
          const float updated = sgd_plain_element(p(i), g(i), scalars[0], wd);
          p(i) = updated;
          copy.write(i, updated);
        });
  }
}

template <class Copy, class Scalars>
void adamw_update(Vector p, GradIn g, Vector m, Vector v, Scalars scalars, float beta1, float beta2,
                  float eps, Copy copy) {
  float* pp = p.data();
  float* mp = m.data();
  float* vp = v.data();
  const std::string& label = MESHTRAIN_LABEL("meshtrain::adamw_step");
  if constexpr (kHostLoop<Scalars>) {
    const AdamwScalars s{beta1, beta2, scalars[2], scalars[0], scalars[1], eps};
    uint16_t* bits = copy.bits;
    for_host_chunks(label, static_cast<int64_t>(p.extent(0)), [=](int64_t begin, int64_t end) {
      with_float_gradient(g, begin, end, [&](const float* gp, int64_t b, int64_t n) {
        adamw_host(pp + b, gp, mp + b, vp + b, bits == nullptr ? nullptr : bits + b, Copy::kDtype,
                   n, s);
      });
    });
  } else {
    Kokkos::parallel_for(
        label, Kokkos::RangePolicy<>(device_space(), 0, p.extent(0)),
        KOKKOS_LAMBDA(const int64_t i) {
          const float updated = adamw_element(pp[i], g(i), mp[i], vp[i], beta1, beta2, scalars[2],
                                              scalars[0], scalars[1], eps);
          pp[i] = updated;
          copy.write(i, updated);
        });
  }
}

// The sum over g[0, count) of g^2 into the device scalar `total` (reduce_into,
// exec_space.hpp: no fence, no allocation). An empty range writes 0. A 16-bit gradient is
// widened as it is read.
template <class Total>
void sum_of_squares(const GradIn& g, int64_t count, const Total& total) {
  reduce_into(
      MESHTRAIN_LABEL("meshtrain::grad_sum_of_squares"), device_range(0, count),
      KOKKOS_LAMBDA(const int64_t i, double& acc) {
        const double x = static_cast<double>(g(i));
        acc += x * x;
      },
      total);
}

void scale(Vector g, float factor) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::grad_scale"),
      Kokkos::RangePolicy<>(device_space(), 0, g.extent(0)),
      KOKKOS_LAMBDA(const int64_t i) { g(i) *= factor; });
}

}  // namespace

std::vector<std::string> optimizer_slot_names(const OptimizerSettings& settings) {
  if (settings.kind == OptimizerKind::adamw) return {"m", "v"};
  if (settings.momentum != 0.0f) return {"momentum"};
  return {};
}

Optimizer::Optimizer(const OptimizerSettings& settings, const std::vector<ShardedTensor>& params)
    : settings_(settings) {
  slot_names_ = optimizer_slot_names(settings);
  for (const auto& slot_name : slot_names_) {
    std::vector<ShardedTensor> state;
    state.reserve(params.size());
    for (const auto& p : params) {
      ShardedTensor s;
      s.name = p.name;
      s.global_shape = p.global_shape;
      s.spec = p.spec;
      s.box = p.box;
      s.local = Vector(slot_name + ":" + p.name, p.local.extent(0));  // zero-filled
      state.push_back(std::move(s));
    }
    slots_.push_back(std::move(state));
  }
  for (const auto& p : params) {
    ShardedTensor layout = p;  // shape only: the step checks its arguments against it
    layout.local = Vector();
    layout_.push_back(std::move(layout));
    local_sizes_.push_back(static_cast<int64_t>(p.local.extent(0)));
  }
}

void Optimizer::check_same_layout(size_t i, const ShardedTensor& b, const char* what) const {
  const ShardedTensor& a = layout_[i];
  // A gradient stored as 16 bits holds its elements in `bits`.
  const int64_t held = held_elements(b);
  MESHTRAIN_REQUIRE(local_sizes_[i] == held && a.global_shape == b.global_shape,
                    "optimizer: ", what, " '", b.name, "' does not match parameter '", a.name,
                    "' (", held, " local elements, expected ", local_sizes_[i], ")");
}

std::vector<ShardedTensor>& Optimizer::slot(const std::string& name) {
  for (size_t s = 0; s < slot_names_.size(); ++s) {
    if (slot_names_[s] == name) return slots_[s];
  }
  MESHTRAIN_BAD_INPUT("optimizer state slot '", name, "' does not exist for this optimizer");
}

const std::vector<ShardedTensor>& Optimizer::slot(const std::string& name) const {
  return const_cast<Optimizer*>(this)->slot(name);
}

void Optimizer::check_step_arguments(const std::vector<ShardedTensor>& params,
                                     const std::vector<ShardedTensor>& grads) const {
  const size_t n = layout_.size();
  MESHTRAIN_REQUIRE(params.size() == n && grads.size() == n, "optimizer step: got ", params.size(),
                    " parameters and ", grads.size(), " gradients, expected ", n);
  for (size_t i = 0; i < n; ++i) {
    check_same_layout(i, params[i], "parameter");
    check_same_layout(i, grads[i], "gradient");
  }
}

void Optimizer::enable_prepared_steps() {
  if (prepared_.extent(0) == 0) {
    prepared_ = Kokkos::View<float*, HostStagingSpace>("meshtrain::optimizer_step_scalars", 4);
    prepared_device_ = Kokkos::View<float*>("meshtrain::optimizer_step_scalars_device", 4);
  }
}

void Optimizer::prepare_step(float lr) {
  MESHTRAIN_REQUIRE(prepared_.extent(0) == 4,
                    "Optimizer::prepare_step before enable_prepared_steps()");
  const bool first = step_count_ == 0;
  ++step_count_;
  const auto& s = settings_;
  // Written while no kernel of the previous step reads them: the caller has read that step's
  // loss back (a fence) before this step's update.
  float* out = prepared_.data();
  if (s.kind == OptimizerKind::sgd) {
    out[0] = lr;
    out[1] = out[2] = 0.0f;
    out[3] = first ? 1.0f : 0.0f;
    return;
  }
  // As step(): adamw_update's step size, 1 / correction2 and decay, from the same floats.
  const double t = static_cast<double>(step_count_);
  const float correction1 = adamw_bias_correction(s.beta1, t);
  const float correction2 = adamw_bias_correction(s.beta2, t);
  out[0] = lr / correction1;
  out[1] = 1.0f / correction2;
  out[2] = 1.0f - lr * s.weight_decay;
  out[3] = 0.0f;
}

void Optimizer::launch_prepared(std::vector<ShardedTensor>& params,
                                const std::vector<ShardedTensor>& grads) {
  MESHTRAIN_REQUIRE(prepared_device_.extent(0) == 4,
                    "Optimizer::launch_prepared before enable_prepared_steps(): the step's "
                    "scalars have no device memory to be copied to");
  check_step_arguments(params, grads);
  // The 16 bytes to device memory by one kernel of 4 threads, each reading one float of pinned
  // host memory (on a GPU over PCIe, once), before the update kernels, which read the copy (in
  // device memory: every thread of every update kernel reads it). A kernel, not a deep_copy:
  // a kernel is what a CUDA graph captures and replays reading the pinned bytes as they are at
  // the replay, and the host capture-safety checker (step_graph.hpp) refuses any deep copy in a
  // region, since it cannot tell an asynchronous one (capture-legal) from a synchronous one.
  const float* from = prepared_.data();
  float* to = prepared_device_.data();
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::optimizer_step_scalars_copy"),
      Kokkos::RangePolicy<>(device_space(), 0, 4),
      KOKKOS_LAMBDA(const int64_t k) { to[k] = from[k]; });
  launch(params, grads, InMemory{prepared_device_.data()});
}

// The update's kernels, one per tensor, with the step's scalars from `scalars` (ByValue or
// InMemory, above); then the 16-bit compute copies hold the new masters.
template <class Scalars>
void Optimizer::launch(std::vector<ShardedTensor>& params, const std::vector<ShardedTensor>& grads,
                       const Scalars& scalars) {
  const auto& s = settings_;
  for (size_t i = 0; i < layout_.size(); ++i) {
    with_copy(params[i], [&](auto copy) {
      if (s.kind == OptimizerKind::adamw) {
        adamw_update(params[i].local, grad_in(grads[i]), slots_[0][i].local, slots_[1][i].local,
                     scalars, s.beta1, s.beta2, s.eps, copy);
      } else if (slots_.empty()) {
        sgd_plain_update(params[i].local, grad_in(grads[i]), scalars, s.weight_decay, copy);
      } else {
        sgd_update(params[i].local, grad_in(grads[i]), slots_[0][i].local, scalars, s.momentum,
                   s.weight_decay, copy);
      }
    });
  }
  for (ShardedTensor& p : params) {
    if (p.copy_16bit) p.copy_16bit->current = true;
  }
}

void Optimizer::step(std::vector<ShardedTensor>& params, const std::vector<ShardedTensor>& grads,
                     float lr) {
  check_step_arguments(params, grads);
  const bool first = step_count_ == 0;
  ++step_count_;
  const auto& s = settings_;
  if (s.kind == OptimizerKind::sgd) {
    launch(params, grads, ByValue{{lr, 0.0f, 0.0f, first ? 1.0f : 0.0f}});
    return;
  }
  // The same floats as prepare_step's.
  const double t = static_cast<double>(step_count_);
  const float correction1 = adamw_bias_correction(s.beta1, t);
  const float correction2 = adamw_bias_correction(s.beta2, t);
  launch(params, grads,
         ByValue{{lr / correction1, 1.0f / correction2, 1.0f - lr * s.weight_decay, 0.0f}});
}

GradientClipper::GradientClipper(const Mesh& mesh, int rank,
                                 const std::vector<ShardedTensor>& grads)
    : buffer_("meshtrain::grad_norm", grads.size()), host_(host_mirror(buffer_)) {
  for (const auto& g : grads) {
    counted_.push_back(owns_block(mesh, rank, g.spec));  // each block counted once
    names_.push_back(g.name);
  }
}

double GradientClipper::global_norm(const std::vector<ShardedTensor>& grads, Communicator& world) {
  MESHTRAIN_REQUIRE(grads.size() == counted_.size(), "gradient clipping: got ", grads.size(),
                    " gradients, expected ", counted_.size());
  for (size_t i = 0; i < grads.size(); ++i) {
    const ShardedTensor& g = grads[i];
    sum_of_squares(grad_in(g), counted_[i] ? held_elements(g) : 0, Kokkos::subview(buffer_, i));
  }
  fence_all(MESHTRAIN_LABEL("meshtrain::grad_norm_before_sum"));
  world.all_reduce(DoubleVectorView(buffer_.data(), buffer_.extent(0)), ReduceOp::sum);
  note_host_read("the gradient norm (GradientClipper::clip)");
  copy_view(host_, buffer_);
  double total = 0.0;
  for (size_t i = 0; i < grads.size(); ++i) total += host_(i);
  non_finite_.clear();
  if (!std::isfinite(total)) non_finite_ = first_non_finite_gradient();
  return std::sqrt(total);  // NaN stays NaN (a comparison with max_norm would hide it)
}

std::string GradientClipper::first_non_finite_gradient() const {
  for (size_t i = 0; i < names_.size(); ++i) {
    if (!std::isfinite(host_(i))) return names_[i];
  }
  return {};
}

double GradientClipper::clip(std::vector<ShardedTensor>& grads, double max_norm,
                             Communicator& world) {
  const double norm = global_norm(grads, world);
  if (!std::isfinite(norm)) return norm;  // scaling would turn an infinity into NaN
  if (max_norm > 0.0 && norm > max_norm) {
    const float factor = static_cast<float>(max_norm / (norm + 1e-6));
    // Scaling would leave values a 16-bit storage cannot hold: such gradients are made only
    // where the run does not clip (partition/gradient_storage.hpp). Checked for every gradient
    // before any is scaled, so a refusal leaves them all as they were.
    for (const auto& g : grads) {
      MESHTRAIN_REQUIRE(!g.stored_16bit(), "gradient clipping: the gradient of '", g.name,
                        "' is stored as 16 bits and cannot be scaled exactly");
    }
    for (auto& g : grads) scale(g.local, factor);
  }
  return norm;
}

}  // namespace meshtrain
