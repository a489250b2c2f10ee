#include "layers/swiglu.hpp"

#include <Kokkos_Core.hpp>
#include <utility>

#include "base/error.hpp"
#include "framework/core/activation_math.hpp"
#include "framework/core/exec_space.hpp"
#include "framework/core/host_clones.hpp"
#include "framework/core/kernel_label.hpp"
#include "framework/core/kokkos_math.hpp"
#include "framework/core/precision.hpp"
#include "layers/activation.hpp"
#include "layers/inference.hpp"
#include "layers/sixteen_bit_passes.hpp"

namespace meshtrain {
namespace {

// swiglu_forward's value (activation_math::swiglu_value) from gate and value holding
// 16-bit values, keeping both and the output as 16-bit bits, the output also written over value
// (what the down projection reads), in one pass.
void swiglu_forward_keeping_kernel(MatrixView gate, MatrixView value, HalfMatrixView kept_gate,
                                   HalfMatrixView kept_value, HalfMatrixView kept_out,
                                   Dtype dtype) {
  const int64_t cols = static_cast<int64_t>(value.extent(1));
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::swiglu_forward_keeping_16bit"),
      Kokkos::RangePolicy<>(device_space(), 0, static_cast<int64_t>(value.extent(0))),
      KOKKOS_LAMBDA(const int64_t i) {
        for (int64_t j = 0; j < cols; ++j) {
          const float g = gate(i, j), u = value(i, j);  // 16-bit values: their bits are exact
          const uint16_t out = to_16bit(activation_math::swiglu_value(g, u), dtype);
          kept_gate(i, j) = to_16bit(g, dtype);
          kept_value(i, j) = to_16bit(u, dtype);
          kept_out(i, j) = out;
          value(i, j) = from_16bit(out, dtype);
        }
      });
}

// swiglu_backward's gradients (activation_math::swiglu_gradients) from the kept 16-bit gate and
// value: dgate into `dgate`, dvalue in place over dy.
void swiglu_backward_from_kernel(ConstHalfMatrixView kept_gate, ConstHalfMatrixView kept_value,
                                 MatrixView dy, MatrixView dgate, Dtype dtype) {
  const int64_t cols = static_cast<int64_t>(dy.extent(1));
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::swiglu_backward_from_16bit"),
      Kokkos::RangePolicy<>(device_space(), 0, static_cast<int64_t>(dy.extent(0))),
      KOKKOS_LAMBDA(const int64_t i) {
        for (int64_t j = 0; j < cols; ++j) {
          const float g = from_16bit(kept_gate(i, j), dtype), d = dy(i, j);
          const float u = from_16bit(kept_value(i, j), dtype);
          const activation_math::SwigluGradients grad = activation_math::swiglu_gradients(g, u, d);
          dgate(i, j) = round_to(grad.gate, dtype);
          dy(i, j) = round_to(grad.value, dtype);  // dvalue
        }
      });
}

// The same two for one row of host memory, compiled per instruction set without FMA
// contraction, the format a template argument (layers/sixteen_bit_passes.hpp): the kernels'
// operations per element, 16 lanes at a time on AVX-512. gate and value (dy and dgate) are
// distinct buffers, the kept ones distinct arrays (__restrict).
template <Dtype dtype>
MESHTRAIN_INLINE void forward_keeping_row(const float* __restrict gate, float* __restrict value,
                                          uint16_t* __restrict kept_gate,
                                          uint16_t* __restrict kept_value,
                                          uint16_t* __restrict kept_out, int64_t cols) {
  for (int64_t j = 0; j < cols; ++j) {
    const float g = gate[j], u = value[j];
    const uint16_t out = to_16bit_as<dtype>(activation_math::swiglu_value(g, u));
    kept_gate[j] = to_16bit_as<dtype>(g);
    kept_value[j] = to_16bit_as<dtype>(u);
    kept_out[j] = out;
    value[j] = from_16bit_as<dtype>(out);
  }
}
template <Dtype dtype>
MESHTRAIN_INLINE void backward_from_row(const uint16_t* __restrict kept_gate,
                                        const uint16_t* __restrict kept_value, float* __restrict dy,
                                        float* __restrict dgate, int64_t cols) {
  for (int64_t j = 0; j < cols; ++j) {
    const float g = from_16bit_as<dtype>(kept_gate[j]), d = dy[j];
    const float u = from_16bit_as<dtype>(kept_value[j]);
    const activation_math::SwigluGradients grad = activation_math::swiglu_gradients(g, u, d);
    dgate[j] = round_as<dtype>(grad.gate);
    dy[j] = round_as<dtype>(grad.value);
  }
}

MESHTRAIN_HOST_CLONES_EXACT
void forward_keeping_row_host(const float* gate, float* value, uint16_t* kept_gate,
                              uint16_t* kept_value, uint16_t* kept_out, int64_t cols, bool bf16) {
  if (bf16) {
    return forward_keeping_row<Dtype::bf16>(gate, value, kept_gate, kept_value, kept_out, cols);
  }
  forward_keeping_row<Dtype::fp16>(gate, value, kept_gate, kept_value, kept_out, cols);
}

MESHTRAIN_HOST_CLONES_EXACT
void backward_from_row_host(const uint16_t* kept_gate, const uint16_t* kept_value, float* dy,
                            float* dgate, int64_t cols, bool bf16) {
  if (bf16) return backward_from_row<Dtype::bf16>(kept_gate, kept_value, dy, dgate, cols);
  backward_from_row<Dtype::fp16>(kept_gate, kept_value, dy, dgate, cols);
}

void swiglu_forward_keeping_16bit(MatrixView gate, MatrixView value, HalfMatrixView kept_gate,
                                  HalfMatrixView kept_value, HalfMatrixView kept_out, Dtype dtype) {
  sixteen_bit_passes::swiglu_forward_keeping(sixteen_bit_passes::step_path(), gate, value,
                                             kept_gate, kept_value, kept_out, dtype);
}

void swiglu_backward_from_16bit(ConstHalfMatrixView kept_gate, ConstHalfMatrixView kept_value,
                                MatrixView dy, MatrixView dgate, Dtype dtype) {
  sixteen_bit_passes::swiglu_backward_from(sixteen_bit_passes::step_path(), kept_gate, kept_value,
                                           dy, dgate, dtype);
}

}  // namespace

namespace sixteen_bit_passes {

void swiglu_forward_keeping(Path path, MatrixView gate, MatrixView value, HalfMatrixView kept_gate,
                            HalfMatrixView kept_value, HalfMatrixView kept_out, Dtype dtype) {
  MESHTRAIN_REQUIRE(dtype != Dtype::fp32 && kept_gate.span_is_contiguous() &&
                        kept_value.span_is_contiguous() && kept_out.span_is_contiguous(),
                    "swiglu_forward_keeping_16bit: a 16-bit dtype and contiguous kept arrays");
  if (path == Path::kernel) {
    return swiglu_forward_keeping_kernel(gate, value, kept_gate, kept_value, kept_out, dtype);
  }
  require_host("swiglu_forward_keeping_16bit");
  MESHTRAIN_REQUIRE(gate.data() != value.data(),
                    "swiglu_forward_keeping_16bit: gate and value share memory");
  const std::string& label = MESHTRAIN_LABEL("meshtrain::swiglu_forward_keeping_16bit");
  const float* g = gate.data();
  float* v = value.data();
  uint16_t* kg = kept_gate.data();
  uint16_t* kv = kept_value.data();
  uint16_t* ko = kept_out.data();
  const auto g_ld = static_cast<int64_t>(gate.stride(0));
  const auto v_ld = static_cast<int64_t>(value.stride(0));
  const auto cols = static_cast<int64_t>(value.extent(1));
  const bool bf16 = dtype == Dtype::bf16;
  Kokkos::parallel_for(label,
                       Kokkos::RangePolicy<Kokkos::DefaultHostExecutionSpace>(
                           host_space(), 0, static_cast<int64_t>(value.extent(0))),
                       [=](const int64_t i) {
                         forward_keeping_row_host(g + i * g_ld, v + i * v_ld, kg + i * cols,
                                                  kv + i * cols, ko + i * cols, cols, bf16);
                       });
  inference::fence_after_host_kernel(label);
}

void swiglu_backward_from(Path path, ConstHalfMatrixView kept_gate, ConstHalfMatrixView kept_value,
                          MatrixView dy, MatrixView dgate, Dtype dtype) {
  MESHTRAIN_REQUIRE(
      dtype != Dtype::fp32 && kept_gate.span_is_contiguous() && kept_value.span_is_contiguous(),
      "swiglu_backward_from_16bit: a 16-bit dtype and contiguous kept arrays");
  if (path == Path::kernel) {
    return swiglu_backward_from_kernel(kept_gate, kept_value, dy, dgate, dtype);
  }
  require_host("swiglu_backward_from_16bit");
  MESHTRAIN_REQUIRE(dy.data() != dgate.data(),
                    "swiglu_backward_from_16bit: dy and dgate share memory");
  const std::string& label = MESHTRAIN_LABEL("meshtrain::swiglu_backward_from_16bit");
  const uint16_t* kg = kept_gate.data();
  const uint16_t* kv = kept_value.data();
  float* d = dy.data();
  float* dg = dgate.data();
  const auto d_ld = static_cast<int64_t>(dy.stride(0));
  const auto dg_ld = static_cast<int64_t>(dgate.stride(0));
  const auto cols = static_cast<int64_t>(dy.extent(1));
  const bool bf16 = dtype == Dtype::bf16;
  Kokkos::parallel_for(label,
                       Kokkos::RangePolicy<Kokkos::DefaultHostExecutionSpace>(
                           host_space(), 0, static_cast<int64_t>(dy.extent(0))),
                       [=](const int64_t i) {
                         backward_from_row_host(kg + i * cols, kv + i * cols, d + i * d_ld,
                                                dg + i * dg_ld, cols, bf16);
                       });
  inference::fence_after_host_kernel(label);
}

}  // namespace sixteen_bit_passes

SwiGlu::SwiGlu(std::string name, std::unique_ptr<Linear> gate, std::unique_ptr<Linear> up,
               int64_t rows, Dtype dtype, Communicator* shared_gather, bool keeps_16bit)
    : name_(std::move(name)),
      gate_(std::move(gate)),
      up_(std::move(up)),
      dtype_(dtype),
      shared_gather_(shared_gather) {
  if (gate_->output_layout() != up_->output_layout() ||
      gate_->output_width() != up_->output_width() ||
      gate_->output_offset() != up_->output_offset() || gate_->in() != up_->in() ||
      gate_->input_layout() != up_->input_layout()) {
    MESHTRAIN_BAD_INPUT("SwiGLU '", name_, "': its gate and up projections differ in layout (",
                        gate_->describe(), " / ", up_->describe(),
                        "); split both weights by the same rule");
  }
  const int64_t width = up_->output_width();
  rows_ = rows;
  if (keeps_16bit) {
    // 16-bit storage: forward computes in gate's and up's output buffers, backward in place
    // (dvalue over dY, dgate over gate's output, dX into up's input gradient): no fp32 buffer.
    MESHTRAIN_REQUIRE(
        dtype != Dtype::fp32 && !shared_gather_ && gate_->output().data() != up_->output().data(),
        "SwiGLU '", name_,
        "': 16-bit storage needs a 16-bit compute dtype, no shared gather and distinct output "
        "buffers of gate and up");
    kept_gate_ = HalfMatrix(name_ + "/gate_16bit", rows, width);
    kept_value_ = HalfMatrix(name_ + "/value_16bit", rows, width);
    kept_output_ = HalfMatrix(name_ + "/output_16bit", rows, width);
    output_ = up_->output();
    return;
  }
  out_ = Matrix(name_ + "/output", rows, width);
  output_ = out_;
  dgate_ = Matrix(name_ + "/gate_grad", rows, width);
  dvalue_ = Matrix(name_ + "/value_grad", rows, width);
  if (shared_gather_) {
    MESHTRAIN_REQUIRE(gate_->layout().input_grad_partial && up_->layout().input_grad_partial &&
                          up_->in() % shared_gather_->size() == 0,
                      "SwiGLU '", name_, "': a shared gather needs gate and up built for it");
    x_full_ = Matrix(name_ + "/input_gathered", rows, up_->in());
    dx_full_ = Matrix(name_ + "/input_grad_partial", rows, up_->in());
    dx_ = Matrix(name_ + "/input_grad", rows, up_->in() / shared_gather_->size());
  } else {
    dx_ = Matrix(name_ + "/input_grad", rows, up_->input_width());
  }
}

void SwiGlu::require_fp32_buffers(const char* what) const {
  MESHTRAIN_REQUIRE(!keeps_16bit(), "SwiGLU '", name_, "': ", what,
                    " need fp32 buffers, not 16-bit storage (derivatives are fp32 only)");
}

std::vector<ShardedParameter*> SwiGlu::sharded_parameters() {
  std::vector<ShardedParameter*> all = gate_->sharded_parameters();
  for (ShardedParameter* p : up_->sharded_parameters()) all.push_back(p);
  return all;
}

LayerScratchNeeds SwiGlu::scratch_needs() const {
  LayerScratchNeeds needs = gate_->scratch_needs();
  needs.merge(up_->scratch_needs());
  return needs;
}

std::string SwiGlu::describe() const {
  return gate_->describe() + "; " + up_->describe();
}

MatrixView SwiGlu::forward(MatrixView x, const LayerPass& pass) {
  LayerPass inner;
  inner.scratch = pass.scratch;
  MatrixView input = x;
  if (shared_gather_) {  // one gather of the split input for both projections
    shared_gather_->all_gather(x, MatrixView(x_full_), 1, dtype_);
    input = x_full_;
  }
  const MatrixView gate = gate_->forward(input, inner);
  inner.prefetch = pass.prefetch;
  const MatrixView value = up_->forward(input, inner);
  if (keeps_16bit()) {
    swiglu_forward_keeping_16bit(gate, value, kept_gate_, kept_value_, kept_output_, dtype_);
    return value;  // the output, written over up's
  }
  swiglu_forward(gate, value, out_, dtype_);
  return out_;
}

MatrixView SwiGlu::backward(MatrixView dy, bool need_input_grad, const LayerPass& pass) {
  // 16-bit storage: dvalue in place over dY (read first), dgate over gate's output buffer.
  const MatrixView dgate = keeps_16bit() ? gate_->output() : MatrixView(dgate_);
  const MatrixView dvalue = keeps_16bit() ? dy : MatrixView(dvalue_);
  if (keeps_16bit()) {
    swiglu_backward_from_16bit(kept_gate_, kept_value_, dy, dgate, dtype_);
  } else {
    swiglu_backward(gate_->output(), up_->output(), dy, dgate, dvalue, dtype_);
  }
  const bool bucketed = pass.deferred == DeferredReduction::in_buckets;
  LayerPass inner = pass;
  inner.prefetch = nullptr;
  if (bucketed) inner.deferred = DeferredReduction::later;
  const MatrixView dx_up = up_->backward(dvalue, need_input_grad, inner);
  inner.prefetch = pass.prefetch;
  const MatrixView dx_gate = gate_->backward(dgate, need_input_grad, inner);
  if (bucketed) {
    pass.buckets->layer_ready(pass.index);
    pass.buckets->poll();
  }
  if (!need_input_grad) return MatrixView();
  // Shared gather: the two partial sums added at full width, then reduce-scattered once.
  // 16-bit storage: gate's added into up's input gradient in place (elementwise: exact alike).
  const MatrixView dx = shared_gather_  ? MatrixView(dx_full_)
                        : keeps_16bit() ? dx_up
                                        : MatrixView(dx_);
  const Dtype dtype = dtype_;
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::swiglu_input_grad"),
      Kokkos::MDRangePolicy<Kokkos::Rank<2>>(
          device_space(), {0, 0},
          {static_cast<int64_t>(dx.extent(0)), static_cast<int64_t>(dx.extent(1))}),
      KOKKOS_LAMBDA(const int64_t i, const int64_t j) {
        dx(i, j) = round_to(dx_up(i, j) + dx_gate(i, j), dtype);
      });
  if (shared_gather_) shared_gather_->reduce_scatter(dx, MatrixView(dx_), 1, dtype_);
  return keeps_16bit() ? dx : MatrixView(dx_);
}

MatrixView SwiGlu::forward_tangents(MatrixView dx, const LayerPass& pass) {
  require_fp32_buffers("tangents");
  const int64_t k = tangent_directions(static_cast<int64_t>(dx.extent(0)), rows_, name_);
  LayerPass inner;
  inner.scratch = pass.scratch;
  MatrixView input = dx;
  if (shared_gather_) {  // one gather of the split tangents for both projections
    input = leading_rows(tangent_x_full_, rows_ * k);
    shared_gather_->all_gather(dx, input, 1, dtype_);
  }
  inner.second_order = pass.second_order;
  const MatrixView dgate = gate_->forward_tangents(input, inner);
  const MatrixView dvalue = up_->forward_tangents(input, inner);
  const MatrixView out = leading_rows(tangents_, rows_ * k);
  second_order_ = pass.second_order;
  stream_gate_ = dgate;  // for backward_with_tangents, of either kind
  stream_value_ = dvalue;
  if (pass.second_order) {
    swiglu_second_order(gate_->output(), up_->output(), dgate, dvalue, out);
  } else {
    swiglu_tangent(gate_->output(), up_->output(), dgate, dvalue, out);
  }
  return out;
}

void SwiGlu::reserve_tangents(int64_t directions) {
  if (directions <= tangent_capacity_) return;
  gate_->reserve_tangents(directions);
  up_->reserve_tangents(directions);
  const int64_t rows = rows_ * directions;
  if (shared_gather_) {
    tangent_x_full_ = Matrix(name_ + "/input_tangents_gathered", rows, up_->in());
    shared_gather_->reserve_scratch(static_cast<size_t>(rows * up_->in()));
  }
  tangents_ = Matrix(name_ + "/tangents", rows, up_->output_width());
  tangent_capacity_ = directions;
}

MatrixView SwiGlu::backward_cotangents(MatrixView dy, const LayerPass& pass) {
  require_fp32_buffers("cotangents");
  cotangent_block_rows(pass, rows_, name_);  // whole passes only: a block is refused
  const int64_t k = cotangent_directions(static_cast<int64_t>(dy.extent(0)), rows_, name_);
  const int64_t rows = rows_ * k;
  LayerPass inner;
  inner.scratch = pass.scratch;
  const MatrixView dgate = leading_rows(cotangent_gate_, rows);
  const MatrixView dvalue = leading_rows(cotangent_value_, rows);
  swiglu_cotangent(gate_->output(), up_->output(), dy, dgate, dvalue);
  const MatrixView dx_up = up_->backward_cotangents(dvalue, inner);
  const MatrixView dx_gate = gate_->backward_cotangents(dgate, inner);
  const MatrixView dx =
      shared_gather_ ? leading_rows(cotangent_full_, rows) : leading_rows(cotangents_, rows);
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::swiglu_input_cotangents"),
      Kokkos::RangePolicy<>(device_space(), 0, rows), KOKKOS_LAMBDA(const int64_t t) {
        for (int64_t j = 0; j < static_cast<int64_t>(dx.extent(1)); ++j) {
          dx(t, j) = dx_up(t, j) + dx_gate(t, j);
        }
      });
  if (!shared_gather_) return dx;
  const MatrixView mine = leading_rows(cotangents_, rows);
  shared_gather_->reduce_scatter(dx, mine, 1, dtype_);
  return mine;
}

void SwiGlu::reserve_cotangents(int64_t directions) {
  if (directions <= cotangent_capacity_) return;
  gate_->reserve_cotangents(directions);
  up_->reserve_cotangents(directions);
  const int64_t rows = rows_ * directions;
  cotangent_gate_ = Matrix(name_ + "/gate_cotangents", rows, up_->output_width());
  cotangent_value_ = Matrix(name_ + "/value_cotangents", rows, up_->output_width());
  cotangents_ = Matrix(name_ + "/input_cotangents", rows, dx_.extent(1));
  if (shared_gather_) {
    cotangent_full_ = Matrix(name_ + "/input_cotangents_partial", rows, up_->in());
    shared_gather_->reserve_scratch(static_cast<size_t>(rows * up_->in()));
    shared_gather_->reserve_reductions(static_cast<size_t>(rows * up_->in()), dtype_);
  }
  cotangent_capacity_ = directions;
}

// a = silu(g) u along each row's k tangents (t) and k second-order streams (s)
// (docs/derivatives.md), h = silu(g) and h1, h2 its derivatives (activation_math::silu_jet and
// swiglu_streams, the MoE layer's SwiGLU experts' too):
//   t_a = h1 t_g u + h t_u,   s_a = (h1 s_g + h2 t_g^2) u + 2 h1 t_g t_u + h s_u.
void SwiGlu::swiglu_second_order(MatrixView gate, MatrixView value, MatrixView dgate,
                                 MatrixView dvalue, MatrixView out) const {
  const int64_t rows = rows_;
  const int64_t k = static_cast<int64_t>(dgate.extent(0)) / rows / 2;
  const int64_t cols = static_cast<int64_t>(out.extent(1));
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::swiglu_second_order"),
      Kokkos::RangePolicy<>(device_space(), 0, rows), KOKKOS_LAMBDA(const int64_t i) {
        for (int64_t j = 0; j < cols; ++j) {
          const activation_math::SiluJet f = activation_math::silu_jet(gate(i, j));
          const float u = value(i, j);
          for (int64_t d = 0; d < k; ++d) {
            const int64_t tt = i * 2 * k + d, qq = tt + k;
            const activation_math::SwigluStreams o = activation_math::swiglu_streams(
                f, u, dgate(tt, j), dvalue(tt, j), dgate(qq, j), dvalue(qq, j));
            out(tt, j) = o.t;
            out(qq, j) = o.q;
          }
        }
      });
}

// The product's backward (docs/derivatives.md): the value's gradients (dgate_, dvalue_) and
// the gate's and up's streams' gradients, then gate's and up's own backward_with_tangents,
// their input gradients summed (and reduce-scattered once under a shared gather) as backward's.
// First-order tangents (Sobolev training: k stream rows per value row, no second-order ones)
// take the same kernel with the second-order streams and their gradients (gs, sg, su) zero.
MatrixView SwiGlu::backward_with_tangents(MatrixView dy, MatrixView dt, bool need_input_grad,
                                          const LayerPass& pass, MatrixView* dt_in) {
  MESHTRAIN_REQUIRE(second_order_ == pass.second_order, "SwiGLU '", name_,
                    "': the backward's streams are not of the kind the last tangent pass had");
  MESHTRAIN_REQUIRE(dtype_ == Dtype::fp32, "SwiGLU '", name_,
                    "': training on derivatives is fp32 only");
  MESHTRAIN_REQUIRE(pass.deferred != DeferredReduction::in_buckets, "SwiGLU '", name_,
                    "': training on derivatives does not reduce in buckets");
  MESHTRAIN_REQUIRE(
      stream_gate_.extent(0) == dt.extent(0) && stream_gate_.extent(1) == dt.extent(1), "SwiGLU '",
      name_, "': stream gradient [", dt.extent(0), ", ", dt.extent(1),
      "] after a second-order pass of [", stream_gate_.extent(0), ", ", stream_gate_.extent(1),
      "]");
  const int64_t rows = rows_;
  const int64_t stream_rows = static_cast<int64_t>(dt.extent(0));
  const bool second = second_order_;
  const int64_t per_row = stream_rows / rows;
  const int64_t k = second ? per_row / 2 : per_row;
  const int64_t cols = static_cast<int64_t>(dt.extent(1));
  const MatrixView gate = gate_->output(), value = up_->output();
  const MatrixView tgate = stream_gate_, tvalue = stream_value_;
  const MatrixView ggate = dgate_, gvalue = dvalue_;
  const MatrixView sgate = leading_rows(cotangent_gate_, stream_rows);
  const MatrixView svalue = leading_rows(cotangent_value_, stream_rows);
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::swiglu_second_order_backward"),
      Kokkos::RangePolicy<>(device_space(), 0, rows), KOKKOS_LAMBDA(const int64_t i) {
        for (int64_t j = 0; j < cols; ++j) {
          const activation_math::SiluJet f = activation_math::silu_jet(gate(i, j));
          const float u = value(i, j), a = dy(i, j);
          float gu = a * f.h, gz = a * u * f.h1;
          for (int64_t d = 0; d < k; ++d) {
            const int64_t tt = i * per_row + d, qq = tt + k;
            const float sg = second ? tgate(qq, j) : 0.0f, su = second ? tvalue(qq, j) : 0.0f;
            const float gs = second ? dt(qq, j) : 0.0f;
            const activation_math::SwigluStreamGradients r =
                activation_math::swiglu_stream_gradients(f, u, tgate(tt, j), tvalue(tt, j), sg, su,
                                                         dt(tt, j), gs);
            if (second) {
              svalue(qq, j) = r.q_up;
              sgate(qq, j) = r.q_gate;
            }
            svalue(tt, j) = r.t_up;
            sgate(tt, j) = r.t_gate;
            gu += r.up;
            gz += r.gate;
          }
          gvalue(i, j) = gu;
          ggate(i, j) = gz;
        }
      });
  LayerPass inner = pass;
  inner.prefetch = nullptr;
  MatrixView streams_up, streams_gate;
  const MatrixView dx_up =
      up_->backward_with_tangents(dvalue_, svalue, need_input_grad, inner, &streams_up);
  const MatrixView dx_gate =
      gate_->backward_with_tangents(dgate_, sgate, need_input_grad, inner, &streams_gate);
  if (!need_input_grad) return MatrixView();
  const MatrixView dx = shared_gather_ ? MatrixView(dx_full_) : MatrixView(dx_);
  const MatrixView dstreams = shared_gather_ ? leading_rows(cotangent_full_, stream_rows)
                                             : leading_rows(cotangents_, stream_rows);
  const int64_t in = static_cast<int64_t>(dx.extent(1));
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::swiglu_second_order_input_grads"),
      Kokkos::RangePolicy<>(device_space(), 0, rows), KOKKOS_LAMBDA(const int64_t i) {
        for (int64_t j = 0; j < in; ++j) dx(i, j) = dx_up(i, j) + dx_gate(i, j);
        for (int64_t t = i * per_row; t < (i + 1) * per_row; ++t) {
          for (int64_t j = 0; j < in; ++j) dstreams(t, j) = streams_up(t, j) + streams_gate(t, j);
        }
      });
  if (!shared_gather_) {
    *dt_in = dstreams;
    return dx_;
  }
  shared_gather_->reduce_scatter(dx, MatrixView(dx_), 1, dtype_);
  const MatrixView mine = leading_rows(cotangents_, stream_rows);
  shared_gather_->reduce_scatter(dstreams, mine, 1, dtype_);
  *dt_in = mine;
  return dx_;
}

void SwiGlu::reserve_tangent_backward(int64_t directions) {
  gate_->reserve_tangent_backward(directions);
  up_->reserve_tangent_backward(directions);
  reserve_tangents(directions);
  reserve_cotangents(directions);
}

}  // namespace meshtrain
