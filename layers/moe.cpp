#include "layers/moe.hpp"

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cmath>

#include "base/error.hpp"
#include "framework/core/activation_math.hpp"
#include "framework/core/exec_space.hpp"
#include "framework/core/gemm.hpp"
#include "framework/core/kernel_label.hpp"
#include "framework/core/kokkos_math.hpp"
#include "framework/core/precision.hpp"
#include "framework/core/view_ops.hpp"
#include "layers/activation.hpp"
#include "partition/moe_limits.hpp"

namespace meshtrain {
namespace {

using Range = Kokkos::RangePolicy<>;
using Range2 = Kokkos::MDRangePolicy<Kokkos::Rank<2>>;
constexpr int64_t kMaxTopK = kMoeMaxTopK;  // partition/moe_limits.hpp

Range2 matrix_range(int64_t rows, int64_t cols) {
  return Range2(device_space(), {0, 0}, {rows, cols});
}

// Row i of src -> row map(i) of dst (forward), or row map(i) of src -> row i of dst, for the
// first `rows` rows. (A free function: CUDA's extended lambdas cannot sit in private members.)
void permute_rows(MatrixView src, MatrixView dst, const Kokkos::View<int64_t*>& map, int64_t rows,
                  bool forward) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::moe_permute"),
      Range2(device_space(), {0, 0}, {rows, static_cast<int64_t>(src.extent(1))}),
      KOKKOS_LAMBDA(const int64_t i, const int64_t c) {
        if (forward) {
          dst(map(i), c) = src(i, c);
        } else {
          dst(i, c) = src(map(i), c);
        }
      });
}

using HostOffsets = Kokkos::View<int64_t*>::HostMirror;

// The experts' GEMMs (below) go through gemm_varying_rows(): an expert's rows change from step to
// step, and so that no step makes a oneDNN primitive, every such call runs the one whose rows are
// given at run time (gemm.hpp).

// Y_e = X_e W_e for each of the `local` experts on its rows (expert-major offsets); w holds
// the local experts' [in, out] matrices one after the other. rows_per_entry > 1: x and y hold
// that many rows per (row, expert) pair (tangent directions), pair q's from row q * it on.
void expert_gemms(MatrixView x, ConstVectorView w, int64_t in, int64_t out,
                  const HostOffsets& offsets, int64_t local, MatrixView y, Dtype dtype,
                  int64_t rows_per_entry = 1) {
  for (int64_t e = 0; e < local; ++e) {
    const int64_t first = offsets(e) * rows_per_entry,
                  count = offsets(e + 1) * rows_per_entry - first;
    if (count == 0) continue;
    gemm_varying_rows(plain(row_block(x, first, count)),
                      plain(ConstMatrixView(w.data() + e * in * out, in, out)), 0.0f,
                      row_block(y, first, count), dtype);
  }
}

// y(i, :) += the bias of row i's expert, for the first `received` rows (b: the biases of the
// experts from bias_first on, [*, out]).
void add_expert_bias(MatrixView y, ConstVectorView b, int64_t bias_first,
                     const Kokkos::View<int*>& expert_of, int64_t received, int64_t out,
                     Dtype dtype) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::moe_expert_bias"), matrix_range(received, out),
      KOKKOS_LAMBDA(const int64_t i, const int64_t c) {
        const float bias = b((bias_first + expert_of(i)) * out + c);
        y(i, c) = round_to(round_to(y(i, c), dtype) + round_to(bias, dtype), dtype);
      });
}

// dW_e = X_eᵀ dY_e per local expert (zero for an expert without rows), rounded.
void expert_weight_gradients(MatrixView x, MatrixView dy, VectorView gw, int64_t in, int64_t out,
                             const HostOffsets& offsets, int64_t local, Dtype dtype) {
  for (int64_t e = 0; e < local; ++e) {
    const int64_t first = offsets(e), count = offsets(e + 1) - first;
    MatrixView dw(gw.data() + e * in * out, in, out);
    if (count == 0) {
      set_zero(dw);
      continue;
    }
    gemm_varying_rows(transposed(row_block(x, first, count)), plain(row_block(dy, first, count)),
                      0.0f, dw, dtype);
  }
  round_in_place(MatrixView(gw.data(), 1, gw.extent(0)), dtype);
}

// db_e = the column sums of dY_e; gb holds bias rows from bias_first on (zero for the experts
// not on this rank).
void expert_bias_gradients(MatrixView dye, VectorView gb, int64_t bias_first,
                           const Kokkos::View<int64_t*>& offset, int64_t local, int64_t out,
                           Dtype dtype) {
  const int64_t rows_of_bias = static_cast<int64_t>(gb.extent(0)) / out;
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::moe_bias_grad"), matrix_range(rows_of_bias, out),
      KOKKOS_LAMBDA(const int64_t b, const int64_t c) {
        const int64_t e = b - bias_first;  // local expert of bias row b
        float sum = 0.0f;
        if (e >= 0 && e < local) {
          for (int64_t i = offset(e); i < offset(e + 1); ++i) sum += dye(i, c);
        }
        gb(b * out + c) = round_to(sum, dtype);
      });
}

// dW_e += T_eᵀ dT_e per local expert, with `rows_per_entry` rows per (row, expert) pair (the
// tangent terms of training on derivatives; fp32).
void expert_weight_gradients_add(MatrixView t, MatrixView dt, VectorView gw, int64_t in,
                                 int64_t out, const HostOffsets& offsets, int64_t local,
                                 int64_t rows_per_entry) {
  for (int64_t e = 0; e < local; ++e) {
    const int64_t first = offsets(e) * rows_per_entry,
                  count = offsets(e + 1) * rows_per_entry - first;
    if (count == 0) continue;
    gemm_varying_rows(transposed(row_block(t, first, count)), plain(row_block(dt, first, count)),
                      1.0f, MatrixView(gw.data() + e * in * out, in, out), Dtype::fp32);
  }
}

// dX_e (+)= dY_e W_eᵀ per local expert (beta 0: overwrite, 1: add).
// rows_per_entry as expert_gemms'.
void expert_input_gemms(MatrixView dy, ConstVectorView w, int64_t in, int64_t out,
                        const HostOffsets& offsets, int64_t local, float beta, MatrixView dx,
                        Dtype dtype, int64_t rows_per_entry = 1) {
  for (int64_t e = 0; e < local; ++e) {
    const int64_t first = offsets(e) * rows_per_entry,
                  count = offsets(e + 1) * rows_per_entry - first;
    if (count == 0) continue;
    gemm_varying_rows(plain(row_block(dy, first, count)),
                      transposed(ConstMatrixView(w.data() + e * in * out, in, out)), beta,
                      row_block(dx, first, count), dtype);
  }
}

// The router's backward for `rows` rows: dl(r, 0..k) holds the gates' gradients on entry, the
// logits' gradient on return (renormalized gates g_s = p_s / S over the chosen: dL/dp_s =
// (dg_s - sum_t g_t dg_t) / S, plus the balancing loss's aux_scale * rows routed to e, then
// the softmax backward).
void router_logit_gradient_kernel(const Matrix& probs, const Matrix& gates, const Matrix& dl,
                                  const Kokkos::View<int**>& chosen,
                                  const Kokkos::View<double*>& stats, int64_t rows, int64_t k,
                                  int64_t experts, float aux_scale, Dtype dtype) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::moe_router_grad"), Range(device_space(), 0, rows),
      KOKKOS_LAMBDA(const int64_t r) {
        // Gates g_s = p_s / S over the chosen: dL/dp_s = (dg_s - sum_t g_t dg_t) / S.
        float chosen_sum = 0.0f, weighted = 0.0f;
        float dgate[kMaxTopK];  // k <= kMaxTopK (checked at construction)
        for (int64_t s = 0; s < k; ++s) {
          dgate[s] = dl(r, s);
          chosen_sum += probs(r, chosen(r, s));
          weighted += gates(r, s) * dgate[s];
        }
        // dp into dl(r, :) (dgate saved above), then the softmax backward in place.
        for (int64_t e = 0; e < experts; ++e) dl(r, e) = aux_scale * static_cast<float>(stats(e));
        for (int64_t s = 0; s < k; ++s) dl(r, chosen(r, s)) += (dgate[s] - weighted) / chosen_sum;
        float dot = 0.0f;
        for (int64_t e = 0; e < experts; ++e) dot += probs(r, e) * dl(r, e);
        for (int64_t e = 0; e < experts; ++e)
          dl(r, e) = round_to(probs(r, e) * (dl(r, e) - dot), dtype);
      });
}

// SwiGLU experts' second-order streams (the forward Laplacian), h = silu(a) u per element of
// the `received` rows, each with k tangents then k second-order streams (2k rows), by the
// SwiGLU layer's jet and formulas (activation_math::silu_jet, swiglu_streams):
//   t_h = h1 t_a u + h t_u,   q_h = (h1 q_a + h2 t_a^2) u + 2 h1 t_a t_u + h q_u.
void swiglu_second_order_streams(MatrixView gate, MatrixView up, MatrixView t_gate, MatrixView t_up,
                                 MatrixView out, int64_t received, int64_t k) {
  const int64_t width = static_cast<int64_t>(gate.extent(1));
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::moe_swiglu_second_order"), matrix_range(received, width),
      KOKKOS_LAMBDA(const int64_t i, const int64_t j) {
        const activation_math::SiluJet f = activation_math::silu_jet(gate(i, j));
        const float u = up(i, j);
        for (int64_t d = 0; d < k; ++d) {
          const int64_t tt = i * 2 * k + d, qq = tt + k;
          const activation_math::SwigluStreams o = activation_math::swiglu_streams(
              f, u, t_gate(tt, j), t_up(tt, j), t_gate(qq, j), t_up(qq, j));
          out(tt, j) = o.t;
          out(qq, j) = o.q;
        }
      });
}

// SwiGLU experts' backward through the tangents, per element of the `received` rows (the SwiGLU
// layer's jet and formulas: activation_math::silu_jet, swiglu_stream_gradients),
// h = silu(a) u with a = gate, u = up (pre-activations). First order (Sobolev training: k
// tangents per row, t_h = silu'(a) u t_a + silu(a) t_u), from dh (the value's gradient,
// overwritten by up's) and dth (the tangents'):
//   d_gate = dh u silu'(a) + sum_d dth (silu''(a) u t_a + silu'(a) t_u)
//   d_up   = dh silu(a) + sum_d dth silu'(a) t_a
//   d_t_a  = dth u silu'(a),  d_t_u = dth silu(a)
// Second order (the forward Laplacian: k tangents then k second-order streams q per row, whose
// gradients g_q follow the tangents' in dth), the reverse of swiglu_second_order_streams, as
// SwiGlu::backward_with_tangents (docs/derivatives.md):
//   d_t_a += 2 g_q (h2 t_a u + h1 t_u),  d_t_u += 2 g_q h1 t_a,  d_q_a = g_q u h1,  d_q_u = g_q h
//   d_gate += g_q ((h2 q_a + h3 t_a^2) u + 2 h2 t_a t_u + h1 q_u),  d_up += g_q (h1 q_a + h2 t_a^2)
void swiglu_backward_with_tangents(MatrixView gate, MatrixView up, MatrixView t_gate,
                                   MatrixView t_up, MatrixView dh, MatrixView dth,
                                   MatrixView d_gate, MatrixView d_t_gate, MatrixView d_t_up,
                                   int64_t received, int64_t k, bool second) {
  const int64_t width = static_cast<int64_t>(gate.extent(1));
  const int64_t per_row = second ? 2 * k : k;
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::moe_swiglu_backward_with_tangents"),
      matrix_range(received, width), KOKKOS_LAMBDA(const int64_t i, const int64_t j) {
        const activation_math::SiluJet f = activation_math::silu_jet(gate(i, j));
        const float u = up(i, j);
        const float g = dh(i, j);
        float grad_gate = g * u * f.h1, grad_up = g * f.h;
        for (int64_t d = 0; d < k; ++d) {
          const int64_t t = i * per_row + d, q = t + k;
          const float qa = second ? t_gate(q, j) : 0.0f, qu = second ? t_up(q, j) : 0.0f;
          const float gq = second ? dth(q, j) : 0.0f;
          const activation_math::SwigluStreamGradients r = activation_math::swiglu_stream_gradients(
              f, u, t_gate(t, j), t_up(t, j), qa, qu, dth(t, j), gq);
          grad_gate += r.gate;
          grad_up += r.up;
          d_t_gate(t, j) = r.t_gate;
          d_t_up(t, j) = r.t_up;
          if (second) {
            d_t_gate(q, j) = r.q_gate;
            d_t_up(q, j) = r.q_up;
          }
        }
        d_gate(i, j) = grad_gate;
        dh(i, j) = grad_up;
      });
}

LinearParameter linear_parameter(const ParameterRef& p) {
  if (p.value == nullptr) return {};
  return {p.value->name, p.value->global_shape, p.value->spec};
}

}  // namespace

namespace {

// The ShardedParameter gathers of an MoE parameter's storage.
ParameterGathers gathers_of(const MoeParameterStorage& storage) {
  return {storage.compute,     storage.stored,    storage.gather_dim1,
          storage.gather_dim2, storage.allreduce, storage.nonbatch_replication};
}

// full(t, c) += the row's k experts' returned input cotangents, in fp32: row t of `full` is
// direction t % dirs of row r = t / dirs, which the experts returned at columns
// [d in, (d + 1) in) of assignment position(r, s) (dirs = 1: plain input gradients).
void add_experts_input_cotangents(const std::string& label, MatrixView full,
                                  ConstMatrixView returned, Kokkos::View<int64_t**> position,
                                  int64_t rows, int64_t in, int64_t k, int64_t dirs) {
  Kokkos::parallel_for(
      label, matrix_range(rows, in), KOKKOS_LAMBDA(const int64_t t, const int64_t c) {
        const int64_t r = t / dirs, d = t % dirs;
        float sum = full(t, c);
        for (int64_t s = 0; s < k; ++s) sum += returned(position(r, s), d * in + c);
        full(t, c) = sum;
      });
}

}  // namespace

// --- MoeLayer ----------------------------------------------------------------------------

MoeLayer::MoeLayer(ParameterRef router, ParameterRef experts_weight, ParameterRef experts_bias,
                   int64_t top_k, double aux_loss_coef, FeatureLayout input_layout, int64_t rows,
                   ParallelContext& context)
    : layout_(decide_moe_layout(
          moe_layer_name(router.value->name),
          {router.value->name, router.value->global_shape, router.value->spec},
          {experts_weight.value->name, experts_weight.value->global_shape,
           experts_weight.value->spec},
          {experts_bias.value->name, experts_bias.value->global_shape, experts_bias.value->spec},
          top_k, context.mesh(), {context.batch_axes(), context.feature_axis()}, input_layout)),
      rows_(rows),
      aux_loss_coef_(aux_loss_coef),
      feature_index_(context.feature_index()),
      compute_dtype_(context.precision().param) {
  build(router, experts_weight, experts_bias, context);
}

MoeLayer::MoeLayer(const MoeFeedForward& p, int64_t top_k, double aux_loss_coef,
                   FeatureLayout input_layout, int64_t rows, ParallelContext& context)
    : layout_(decide_moe_feed_forward_layout(
          moe_layer_name(p.router.value->name), linear_parameter(p.router),
          linear_parameter(p.gate_weight), linear_parameter(p.gate_bias),
          linear_parameter(p.up_weight), linear_parameter(p.up_bias),
          linear_parameter(p.down_weight), linear_parameter(p.down_bias), top_k, context.mesh(),
          {context.batch_axes(), context.feature_axis()}, input_layout)),
      rows_(rows),
      aux_loss_coef_(aux_loss_coef),
      feature_index_(context.feature_index()),
      compute_dtype_(context.precision().param),
      activation_(p.activation) {
  build(p.router, p.up_weight, p.up_bias, context);
  const MoeLayout& l = layout_;
  if (l.gated) {
    gate_weight_ = ShardedParameter(p.gate_weight, gathers_of(l.experts_gate_weight),
                                    GatherMethod::as_blocks, context);
    gate_bias_ = ShardedParameter(p.gate_bias, gathers_of(l.experts_gate_bias),
                                  GatherMethod::as_blocks, context);
  }
  down_weight_ = ShardedParameter(p.down_weight, gathers_of(l.experts_down_weight),
                                  GatherMethod::as_blocks, context);
  down_bias_ = ShardedParameter(p.down_bias, gathers_of(l.experts_down_bias),
                                GatherMethod::as_blocks, context);
  const std::string& name = l.layer;
  ffn_up_ = Matrix(name + "/expert_up", capacity_, l.hidden);
  ffn_h_ = Matrix(name + "/expert_hidden", capacity_, l.hidden);
  ffn_dh_ = Matrix(name + "/expert_hidden_grad", capacity_, l.hidden);
  if (l.gated) {
    ffn_gate_ = Matrix(name + "/expert_gate", capacity_, l.hidden);
    ffn_dgate_ = Matrix(name + "/expert_gate_grad", capacity_, l.hidden);
  }
  if (l.splits_output()) {
    out_full_ = Matrix(name + "/output_full", rows_, l.out);
    dy_full_ = Matrix(name + "/output_grad_full", rows_, l.out);
    feature_comm_->reserve_scratch(static_cast<size_t>(rows_ * l.out));
  }
}

std::vector<ShardedParameter*> MoeLayer::sharded_parameters() {
  if (!layout_.feed_forward()) return {&router_, &weight_, &bias_};
  std::vector<ShardedParameter*> all = {&router_};
  if (layout_.gated) all.insert(all.end(), {&gate_weight_, &gate_bias_});
  all.insert(all.end(), {&weight_, &bias_, &down_weight_, &down_bias_});
  return all;
}

void MoeLayer::build(ParameterRef router, ParameterRef experts_weight, ParameterRef experts_bias,
                     ParallelContext& context) {
  const MoeLayout& l = layout_;
  const int64_t rows = rows_;
  const int64_t in = l.in, out = l.out, experts = l.experts, k = l.top_k;
  assignments_ = rows * k;
  // A row's k experts are distinct, so at most min(k, experts here) of each group member's
  // rows land here (moe_dispatch_capacity).
  capacity_ = moe_dispatch_capacity(l, rows);
  // The counts travel as floats (exact below 2^24); the gate gradient kernel keeps k of them
  // in registers; MPI counts are ints.
  if (k > kMaxTopK) {
    MESHTRAIN_BAD_INPUT("MoE layer '", l.layer, "': top_k = ", k, " is above the largest top_k ",
                        kMaxTopK, " an MoE layer takes");
  }
  if (rows >= (int64_t{1} << 24) || capacity_ * std::max(in, out) > INT32_MAX) {
    MESHTRAIN_BAD_INPUT("MoE layer '", l.layer, "': ", rows, " rows per rank (data.batch_size ",
                        "over the batch axes) x ", std::min(k, l.experts_local), " experts x ",
                        l.ep, " expert ranks x ", std::max(in, out),
                        " features is more than one all-to-all moves (2^31 elements); use a "
                        "smaller batch or more ranks on the batch axes");
  }
  global_rows_ = rows * context.batch_parallel();
  const Dtype compute = context.precision().param;

  // Communicators (collective on first use: the same calls in the same order everywhere).
  expert_comm_ = context.comm(l.expert_axes);
  batch_comm_ = context.comm(l.batch_axes);
  if (l.gathers_input()) feature_comm_ = context.comm({l.feature_axis});
  router_ = ShardedParameter(router, gathers_of(l.router), GatherMethod::as_blocks, context);
  weight_ = ShardedParameter(experts_weight, gathers_of(l.experts_weight), GatherMethod::as_blocks,
                             context);
  bias_ =
      ShardedParameter(experts_bias, gathers_of(l.experts_bias), GatherMethod::as_blocks, context);
  const int ep_index = expert_comm_ ? expert_comm_->rank() : 0;
  first_expert_ = ep_index * l.experts_local;

  const std::string& name = l.layer;
  if (l.gathers_input()) {
    x_full_ = Matrix(name + "/input", rows, in);
    dx_full_ = Matrix(name + "/input_grad_full", rows, in);
  }
  logits_ = Matrix(name + "/router_logits", rows, experts);
  probs_ = Matrix(name + "/router_probs", rows, experts);
  dlogits_ = Matrix(name + "/router_logits_grad", rows, experts);
  chosen_ = Kokkos::View<int**>(name + "/chosen", rows, k);
  gates_ = Matrix(name + "/gates", rows, k);
  position_ = Kokkos::View<int64_t**>(name + "/position", rows, k);
  stats_ = Kokkos::View<double*>(name + "/routing_stats", 2 * experts);
  stats_host_ = host_mirror(stats_);
  counts_ = Vector(name + "/expert_counts", experts);
  all_counts_ = Vector(name + "/all_expert_counts", l.ep * experts);
  all_counts_host_ = host_mirror(all_counts_);
  send_x_ = Matrix(name + "/send_x", assignments_, in);
  recv_x_ = Matrix(name + "/recv_x", capacity_, in);
  expert_x_ = Matrix(name + "/expert_x", capacity_, in);
  expert_y_ = Matrix(name + "/expert_y", capacity_, out);
  back_y_ = Matrix(name + "/back_y", capacity_, out);
  returned_y_ = Matrix(name + "/returned_y", assignments_, out);
  send_dy_ = Matrix(name + "/send_dy", assignments_, out);
  expert_dx_ = Matrix(name + "/expert_dx", capacity_, in);
  out_ = Matrix(name + "/output", rows, l.output_width());
  dx_ = Matrix(name + "/input_grad", rows, l.input_width());
  send_rows_.assign(static_cast<size_t>(l.ep), 0);
  recv_rows_.assign(static_cast<size_t>(l.ep), 0);
  expert_rows_.assign(static_cast<size_t>(experts), 0.0);
  to_expert_major_ = Kokkos::View<int64_t*>(name + "/to_expert_major", capacity_);
  to_expert_major_host_ = host_mirror(to_expert_major_);
  local_expert_ = Kokkos::View<int*>(name + "/local_expert", capacity_);
  local_expert_host_ = host_mirror(local_expert_);
  expert_offsets_ = Kokkos::View<int64_t*>(name + "/expert_offsets", l.experts_local + 1);
  expert_offsets_host_ = host_mirror(expert_offsets_);
  if (expert_comm_) {
    // Whatever the routing, the dispatches' 16-bit buffers and MPI's host staging are
    // already as large as they get.
    const size_t elements = static_cast<size_t>(capacity_ * std::max(in, out));
    if (compute != Dtype::fp32) expert_comm_->reserve_wire(elements, elements);
    expert_comm_->reserve_staging(elements * bytes_of(compute), elements * bytes_of(compute));
  }
  if (feature_comm_) feature_comm_->reserve_scratch(static_cast<size_t>(rows * in));
  // Their labels are made on first use (kernel_label.hpp): here, not in the first step whose
  // routing leaves an expert without rows.
  set_zero(MatrixView());
  copy_into(MatrixView(), ConstMatrixView());
}

std::string MoeLayer::describe() const {
  return layout_.layer + ": " + describe_moe_layout(layout_);
}

MatrixView MoeLayer::forward(MatrixView x, const LayerPass& pass) {
  LayerScratch& scratch = *pass.scratch;
  const MoeLayout& l = layout_;
  MESHTRAIN_REQUIRE(static_cast<int64_t>(x.extent(0)) == rows_ &&
                        static_cast<int64_t>(x.extent(1)) == l.input_width(),
                    "MoE layer '", l.layer, "': input is [", x.extent(0), ", ", x.extent(1),
                    "], expected [", rows_, ", ", l.input_width(), "]");
  const Dtype dtype = compute_dtype_;
  if (feature_comm_) {
    feature_comm_->all_gather(x, x_full_, 1, dtype);
    x_used_ = x_full_;
  } else {
    x_used_ = x;
  }
  const int64_t in = l.in, out = l.out, experts = l.experts, k = l.top_k;

  // Router: logits in the compute dtype, softmax in fp32, top-k and renormalized gates.
  const ConstVectorView wr = router_.compute(scratch);
  gemm(plain(x_used_), plain(ConstMatrixView(wr.data(), in, experts)), 0.0f, logits_, dtype);
  {
    const Matrix logits = logits_, probs = probs_, gates = gates_;
    const Kokkos::View<int**> chosen = chosen_;
    Kokkos::parallel_for(
        MESHTRAIN_LABEL("meshtrain::moe_route"), Range(device_space(), 0, rows_),
        KOKKOS_LAMBDA(const int64_t r) {
          float top = round_to(logits(r, 0), dtype);
          for (int64_t e = 0; e < experts; ++e) {
            logits(r, e) = round_to(logits(r, e), dtype);
            top = logits(r, e) > top ? logits(r, e) : top;
          }
          float sum = 0.0f;
          for (int64_t e = 0; e < experts; ++e) {
            probs(r, e) = kmath::exp(logits(r, e) - top);
            sum += probs(r, e);
          }
          for (int64_t e = 0; e < experts; ++e) probs(r, e) /= sum;
          // Top k by selection: the largest not yet chosen, the lower index on ties.
          float chosen_sum = 0.0f;
          for (int64_t s = 0; s < k; ++s) {
            int best = -1;
            for (int64_t e = 0; e < experts; ++e) {
              bool taken = false;
              for (int64_t t = 0; t < s; ++t) taken = taken || chosen(r, t) == e;
              if (!taken && (best < 0 || probs(r, e) > probs(r, best))) best = static_cast<int>(e);
            }
            chosen(r, s) = best;
            chosen_sum += probs(r, best);
          }
          for (int64_t s = 0; s < k; ++s) gates(r, s) = probs(r, chosen(r, s)) / chosen_sum;
        });
  }

  // Per expert: this rank's rows and probability sums (the balancing loss's statistics),
  // and each (row, expert) pair's row in the send buffer, grouped by expert in row order.
  {
    const Matrix probs = probs_;
    const Kokkos::View<int**> chosen = chosen_;
    const Kokkos::View<double*> stats = stats_;
    const Vector counts = counts_;
    const Kokkos::View<int64_t**> position = position_;
    const int64_t rows = rows_;
    Kokkos::parallel_for(
        MESHTRAIN_LABEL("meshtrain::moe_count"), Range(device_space(), 0, experts),
        KOKKOS_LAMBDA(const int64_t e) {
          int64_t count = 0;
          double prob = 0.0;
          for (int64_t r = 0; r < rows; ++r) {
            prob += probs(r, e);
            for (int64_t s = 0; s < k; ++s) count += chosen(r, s) == e ? 1 : 0;
          }
          stats(e) = static_cast<double>(count);
          stats(experts + e) = prob;
          counts(e) = static_cast<float>(count);
        });
    Kokkos::parallel_for(
        MESHTRAIN_LABEL("meshtrain::moe_positions"), Range(device_space(), 0, experts),
        KOKKOS_LAMBDA(const int64_t e) {
          int64_t next = 0;
          for (int64_t f = 0; f < e; ++f) next += static_cast<int64_t>(counts(f));
          for (int64_t r = 0; r < rows; ++r) {
            for (int64_t s = 0; s < k; ++s) {
              if (chosen(r, s) == e) position(r, s) = next++;
            }
          }
        });
  }
  // The counts of the whole expert group (exact in float: each at most rows < 2^24, checked
  // at construction), then the global statistics.
  if (expert_comm_) {
    expert_comm_->all_gather(ConstVectorView(counts_.data(), counts_.extent(0)),
                             VectorView(all_counts_));
  } else {
    copy_view(all_counts_, counts_);
  }
  if (batch_comm_) batch_comm_->all_reduce(DoubleVectorView(stats_.data(), stats_.extent(0)));
  copy_view(stats_host_, stats_);
  double balance = 0.0;
  for (int64_t e = 0; e < experts; ++e) {
    expert_rows_[static_cast<size_t>(e)] = stats_host_(e);
    balance += stats_host_(e) * stats_host_(experts + e);
  }
  const double n = static_cast<double>(global_rows_);
  aux_loss_ = aux_loss_coef_ * static_cast<double>(experts) * balance / (n * n);
  plan_dispatch();

  // The rows out to their experts' ranks.
  {
    const MatrixView xu = x_used_;
    const Matrix send = send_x_;
    const Kokkos::View<int64_t**> position = position_;
    Kokkos::parallel_for(
        MESHTRAIN_LABEL("meshtrain::moe_pack_rows"), matrix_range(assignments_, in),
        KOKKOS_LAMBDA(const int64_t a, const int64_t c) {
          send(position(a / k, a % k), c) = xu(a / k, c);
        });
  }
  dispatch(send_x_, recv_x_, true);
  permute(recv_x_, expert_x_, true);

  experts_forward(scratch);
  permute(expert_y_, back_y_, false);
  dispatch(back_y_, returned_y_, false);

  // y = sum over the row's experts of gate x expert output.
  const MatrixView y_full = l.splits_output() ? MatrixView(out_full_) : MatrixView(out_);
  {
    const MatrixView y = y_full;
    const Matrix returned = returned_y_, gates = gates_;
    const Kokkos::View<int64_t**> position = position_;
    Kokkos::parallel_for(
        MESHTRAIN_LABEL("meshtrain::moe_combine"), matrix_range(rows_, out),
        KOKKOS_LAMBDA(const int64_t r, const int64_t c) {
          float sum = 0.0f;
          for (int64_t s = 0; s < k; ++s) sum += gates(r, s) * returned(position(r, s), c);
          y(r, c) = round_to(sum, dtype);
        });
  }
  if (l.splits_output()) {  // this rank's feature block of the residual stream
    const int64_t width = l.output_width(), offset = feature_index_ * width;
    const Matrix part = out_;
    Kokkos::parallel_for(
        MESHTRAIN_LABEL("meshtrain::moe_output_block"), matrix_range(rows_, width),
        KOKKOS_LAMBDA(const int64_t r, const int64_t c) { part(r, c) = y_full(r, offset + c); });
  }
  return out_;
}

void MoeLayer::experts_forward(LayerScratch& scratch) {
  const MoeLayout& l = layout_;
  const Dtype dtype = compute_dtype_;
  const int64_t local = l.experts_local;
  auto bias_first = [this](const MoeParameterStorage& b) {
    return b.all_experts ? first_expert_ : int64_t{0};
  };
  if (!l.feed_forward()) {  // one GEMM per local expert on its rows, plus its bias
    expert_gemms(expert_x_, weight_.compute(scratch), l.in, l.out, expert_offsets_host_, local,
                 expert_y_, dtype);
    add_expert_bias(expert_y_, bias_.compute(scratch), bias_first(l.experts_bias), local_expert_,
                    received_, l.out, dtype);
    return;
  }
  // act(x U + bu) (or silu(x G + bg) * (x U + bu)), then D + bd.
  const int64_t in = l.in, hidden = l.hidden, out = l.out;
  expert_gemms(expert_x_, weight_.compute(scratch), in, hidden, expert_offsets_host_, local,
               ffn_up_, dtype);
  add_expert_bias(ffn_up_, bias_.compute(scratch), bias_first(l.experts_bias), local_expert_,
                  received_, hidden, dtype);
  const MatrixView h = row_block(ffn_h_, 0, received_);
  if (l.gated) {
    expert_gemms(expert_x_, gate_weight_.compute(scratch), in, hidden, expert_offsets_host_, local,
                 ffn_gate_, dtype);
    add_expert_bias(ffn_gate_, gate_bias_.compute(scratch), bias_first(l.experts_gate_bias),
                    local_expert_, received_, hidden, dtype);
    swiglu_forward(row_block(ffn_gate_, 0, received_), row_block(ffn_up_, 0, received_), h, dtype);
  } else {
    activation_forward(activation_, row_block(ffn_up_, 0, received_), h, dtype);
  }
  expert_gemms(ffn_h_, down_weight_.compute(scratch), hidden, out, expert_offsets_host_, local,
               expert_y_, dtype);
  add_expert_bias(expert_y_, down_bias_.compute(scratch), bias_first(l.experts_down_bias),
                  local_expert_, received_, out, dtype);
}

void MoeLayer::experts_backward(LayerScratch& scratch, bool need_input_grad) {
  const MoeLayout& l = layout_;
  const Dtype dtype = compute_dtype_;
  const int64_t local = l.experts_local;
  auto bias_first = [this](const MoeParameterStorage& b) {
    return b.all_experts ? first_expert_ : int64_t{0};
  };
  if (!l.feed_forward()) {
    // Per local expert: dW_e = X_eᵀ dY_e, db_e = column sums of dY_e, dX_e = dY_e W_eᵀ.
    expert_weight_gradients(expert_x_, expert_y_, weight_.gradient(scratch), l.in, l.out,
                            expert_offsets_host_, local, dtype);
    expert_bias_gradients(expert_y_, bias_.gradient(scratch), bias_first(l.experts_bias),
                          expert_offsets_, local, l.out, dtype);
    if (need_input_grad) {
      expert_input_gemms(expert_y_, weight_.compute(scratch), l.in, l.out, expert_offsets_host_,
                         local, 0.0f, expert_dx_, dtype);
    }
    return;
  }
  const int64_t in = l.in, hidden = l.hidden, out = l.out;
  // Down: dD_e = H_eᵀ dY_e, dbd_e, dH_e = dY_e D_eᵀ.
  expert_weight_gradients(ffn_h_, expert_y_, down_weight_.gradient(scratch), hidden, out,
                          expert_offsets_host_, local, dtype);
  expert_bias_gradients(expert_y_, down_bias_.gradient(scratch), bias_first(l.experts_down_bias),
                        expert_offsets_, local, out, dtype);
  expert_input_gemms(expert_y_, down_weight_.compute(scratch), hidden, out, expert_offsets_host_,
                     local, 0.0f, ffn_dh_, dtype);
  const MatrixView dh = row_block(ffn_dh_, 0, received_);
  round_in_place(dh, dtype);
  // Through the activation: ffn_dh_ becomes the up projection's output gradient.
  if (l.gated) {
    swiglu_backward(row_block(ffn_gate_, 0, received_), row_block(ffn_up_, 0, received_), dh,
                    row_block(ffn_dgate_, 0, received_), dh, dtype);
  } else {
    activation_backward(activation_, row_block(ffn_up_, 0, received_), dh, dtype);
  }
  expert_weight_gradients(expert_x_, ffn_dh_, weight_.gradient(scratch), in, hidden,
                          expert_offsets_host_, local, dtype);
  expert_bias_gradients(ffn_dh_, bias_.gradient(scratch), bias_first(l.experts_bias),
                        expert_offsets_, local, hidden, dtype);
  if (l.gated) {
    expert_weight_gradients(expert_x_, ffn_dgate_, gate_weight_.gradient(scratch), in, hidden,
                            expert_offsets_host_, local, dtype);
    expert_bias_gradients(ffn_dgate_, gate_bias_.gradient(scratch), bias_first(l.experts_gate_bias),
                          expert_offsets_, local, hidden, dtype);
  }
  if (need_input_grad) {
    expert_input_gemms(ffn_dh_, weight_.compute(scratch), in, hidden, expert_offsets_host_, local,
                       0.0f, expert_dx_, dtype);
    if (l.gated) {
      // The up part rounded to the compute dtype, then the gate part added (rounded after).
      round_in_place(row_block(expert_dx_, 0, received_), dtype);
      expert_input_gemms(ffn_dgate_, gate_weight_.compute(scratch), in, hidden,
                         expert_offsets_host_, local, 1.0f, expert_dx_, dtype);
    }
  }
}

void MoeLayer::plan_dispatch() {
  const MoeLayout& l = layout_;
  copy_view(all_counts_host_, all_counts_);
  const int ep = l.ep, me = expert_comm_ ? expert_comm_->rank() : 0;
  const int64_t experts = l.experts, local = l.experts_local;
  auto count = [&](int src, int64_t expert) {
    return static_cast<int64_t>(all_counts_host_(src * experts + expert));
  };
  for (int j = 0; j < ep; ++j) {
    int64_t to_j = 0, from_j = 0;
    for (int64_t e = 0; e < local; ++e) {
      to_j += count(me, j * local + e);
      from_j += count(j, first_expert_ + e);
    }
    send_rows_[static_cast<size_t>(j)] = to_j;
    recv_rows_[static_cast<size_t>(j)] = from_j;
  }
  // Expert-major offsets, then where each received row goes: the rows from source j for
  // local expert e follow those from sources before j.
  expert_offsets_host_(0) = 0;
  for (int64_t e = 0; e < local; ++e) {
    int64_t total = 0;
    for (int j = 0; j < ep; ++j) total += count(j, first_expert_ + e);
    expert_offsets_host_(e + 1) = expert_offsets_host_(e) + total;
  }
  received_ = expert_offsets_host_(local);
  MESHTRAIN_REQUIRE(received_ <= capacity_, "MoE layer '", l.layer, "': ", received_,
                    " rows routed here, more than the ", capacity_, " the buffers hold");
  int64_t recv_row = 0;
  for (int j = 0; j < ep; ++j) {
    for (int64_t e = 0; e < local; ++e) {
      int64_t dst = expert_offsets_host_(e);
      for (int i = 0; i < j; ++i) dst += count(i, first_expert_ + e);
      for (int64_t n = count(j, first_expert_ + e); n > 0; --n) {
        local_expert_host_(dst) = static_cast<int>(e);
        to_expert_major_host_(recv_row++) = dst++;
      }
    }
  }
  copy_view(to_expert_major_, to_expert_major_host_);
  copy_view(local_expert_, local_expert_host_);
  copy_view(expert_offsets_, expert_offsets_host_);
}

void MoeLayer::dispatch(MatrixView send, MatrixView recv, bool forward_direction) {
  const std::vector<int64_t>& out_rows = forward_direction ? send_rows_ : recv_rows_;
  const std::vector<int64_t>& in_rows = forward_direction ? recv_rows_ : send_rows_;
  if (expert_comm_) {
    expert_comm_->all_to_all_v(send, out_rows, recv, in_rows, compute_dtype_);
    return;
  }
  // One rank holds every expert: what would be sent is what arrives.
  const int64_t n = out_rows[0];
  copy_into(row_block(recv, 0, n), row_block(send, 0, n));
}

void MoeLayer::permute(MatrixView src, MatrixView dst, bool to_expert_major) {
  permute_rows(src, dst, to_expert_major_, received_, to_expert_major);
}

MatrixView MoeLayer::backward(MatrixView dy, bool need_input_grad, const LayerPass& pass) {
  LayerScratch& scratch = *pass.scratch;
  const float loss_scale = pass.loss_scale;
  const MoeLayout& l = layout_;
  MESHTRAIN_REQUIRE(static_cast<int64_t>(dy.extent(0)) == rows_ &&
                        static_cast<int64_t>(dy.extent(1)) == l.output_width(),
                    "MoE layer '", l.layer, "': output gradient is [", dy.extent(0), ", ",
                    dy.extent(1), "], expected [", rows_, ", ", l.output_width(), "]");
  const Dtype dtype = compute_dtype_;
  const int64_t in = l.in, out = l.out, experts = l.experts, k = l.top_k;
  if (l.splits_output()) {  // every tp rank computes the whole layer: the whole gradient
    feature_comm_->all_gather(dy, dy_full_, 1, dtype);
    dy = dy_full_;
  }

  // The gates' gradients (dY . expert output, into dlogits' first k columns for now) and
  // the experts' output gradients (gate x dY), in send order.
  {
    const Matrix returned = returned_y_, send = send_dy_, gates = gates_, dl = dlogits_;
    const Kokkos::View<int64_t**> position = position_;
    Kokkos::parallel_for(
        MESHTRAIN_LABEL("meshtrain::moe_gate_grad"), Range(device_space(), 0, rows_),
        KOKKOS_LAMBDA(const int64_t r) {
          for (int64_t s = 0; s < k; ++s) {
            float dot = 0.0f;
            for (int64_t c = 0; c < out; ++c) dot += dy(r, c) * returned(position(r, s), c);
            dl(r, s) = dot;
          }
        });
    Kokkos::parallel_for(
        MESHTRAIN_LABEL("meshtrain::moe_pack_output_grad"), matrix_range(assignments_, out),
        KOKKOS_LAMBDA(const int64_t a, const int64_t c) {
          const int64_t r = a / k, s = a % k;
          send(position(r, s), c) = round_to(gates(r, s) * dy(r, c), dtype);
        });
  }
  dispatch(send_dy_, back_y_, true);
  permute(back_y_, expert_y_, true);  // expert_y_ now holds the experts' output gradients

  experts_backward(scratch, need_input_grad);
  if (need_input_grad) {
    round_in_place(row_block(expert_dx_, 0, received_), dtype);
    permute(expert_dx_, recv_x_, false);
    dispatch(recv_x_, send_x_, false);  // send_x_ now holds each pair's input gradient
  }

  // Router: gate gradients -> probabilities (+ the balancing loss's) -> logits (softmax).
  router_logit_gradients(loss_scale);
  const VectorView gr = router_.gradient(scratch);
  gemm(transposed(x_used_), plain(dlogits_), 0.0f, MatrixView(gr.data(), in, experts), dtype);
  round_in_place(MatrixView(gr.data(), 1, gr.extent(0)), dtype);

  MatrixView dx;
  if (need_input_grad) {
    // dX = dlogits Wrᵀ + the sum over the row's experts of their input gradients.
    const ConstVectorView wr = router_.compute(scratch);
    const MatrixView full = feature_comm_ ? MatrixView(dx_full_) : MatrixView(dx_);
    gemm(plain(dlogits_), transposed(ConstMatrixView(wr.data(), in, experts)), 0.0f, full, dtype);
    const Matrix returned = send_x_;
    const Kokkos::View<int64_t**> position = position_;
    Kokkos::parallel_for(
        MESHTRAIN_LABEL("meshtrain::moe_input_grad"), matrix_range(rows_, in),
        KOKKOS_LAMBDA(const int64_t r, const int64_t c) {
          float sum = round_to(full(r, c), dtype);
          for (int64_t s = 0; s < k; ++s) sum += returned(position(r, s), c);
          full(r, c) = round_to(sum, dtype);
        });
    if (feature_comm_) {  // back to this rank's feature block
      const int64_t offset = feature_index_ * l.input_width();
      const Matrix part = dx_;
      Kokkos::parallel_for(
          MESHTRAIN_LABEL("meshtrain::moe_input_grad_block"), matrix_range(rows_, l.input_width()),
          KOKKOS_LAMBDA(const int64_t r, const int64_t c) { part(r, c) = full(r, offset + c); });
    }
    dx = dx_;
  }

  reduce_gradients(scratch);
  return dx;
}

void MoeLayer::router_logit_gradients(float loss_scale) {
  const double n = static_cast<double>(global_rows_);
  const int64_t experts = layout_.experts;
  // d aux / d p(r, e) = coef * E * f_e / n with f_e = rows_e / n; times the loss scale.
  const float aux_scale =
      static_cast<float>(loss_scale * aux_loss_coef_ * static_cast<double>(experts) / (n * n));
  router_logit_gradient_kernel(probs_, gates_, dlogits_, chosen_, stats_, rows_, layout_.top_k,
                               experts, aux_scale, compute_dtype_);
}

void MoeLayer::reduce_gradients(LayerScratch& scratch) {
  const MoeLayout& l = layout_;
  if (l.feed_forward()) {
    down_weight_.reduce(scratch);
    down_bias_.reduce(scratch);
  }
  weight_.reduce(scratch);
  bias_.reduce(scratch);
  if (l.gated) {
    gate_weight_.reduce(scratch);
    gate_bias_.reduce(scratch);
  }
  router_.reduce(scratch);
}

MatrixView MoeLayer::forward_tangents(MatrixView dx, const LayerPass& pass) {
  LayerScratch& scratch = *pass.scratch;
  const MoeLayout& l = layout_;
  const int64_t dirs = tangent_directions(static_cast<int64_t>(dx.extent(0)), rows_, l.layer);
  const int64_t rows = rows_ * dirs;
  MESHTRAIN_REQUIRE(static_cast<int64_t>(dx.extent(1)) == l.input_width(), "MoE layer '", l.layer,
                    "': tangent input is [", dx.extent(0), ", ", dx.extent(1), "], expected [",
                    rows, ", ", l.input_width(), "]");
  const Dtype dtype = compute_dtype_;
  const int64_t in = l.in, out = l.out, experts = l.experts, k = l.top_k;
  MatrixView dxu = dx;
  if (feature_comm_) {
    dxu = leading_rows(tangent_x_full_, rows);
    feature_comm_->all_gather(dx, dxu, 1, dtype);
  }

  tangent_x_used_ = dxu;  // for backward_with_tangents
  // The forward Laplacian: per row, dirs / 2 tangents then as many second-order streams.
  const bool second = pass.second_order;
  MESHTRAIN_REQUIRE(!second || dirs % 2 == 0, "MoE layer '", l.layer, "': ", dirs,
                    " stream rows per row in a second-order pass (2 per direction)");
  second_order_ = second;
  const int64_t half = second ? dirs / 2 : dirs;
  // Router: dl = dX Wr, then the softmax's and the renormalized gates' derivatives.
  const ConstVectorView wr = router_.compute(scratch);
  const MatrixView dl = leading_rows(tangent_logits_, rows);
  gemm(plain(dxu), plain(ConstMatrixView(wr.data(), in, experts)), 0.0f, dl, dtype);
  const MatrixView dg = leading_rows(tangent_gates_, rows);
  {
    const Matrix probs = probs_, gates = gates_;
    const Kokkos::View<int**> chosen = chosen_;
    Kokkos::parallel_for(
        MESHTRAIN_LABEL("meshtrain::moe_gate_tangent"), Range(device_space(), 0, rows),
        KOKKOS_LAMBDA(const int64_t t) {
          const int64_t r = t / dirs, j = t % dirs;
          if (j >= half) {
            // Second order along direction d = j - half (g = softmax of the chosen logits):
            // a, b the tangent and second-order logits, m = sum g a, dg = g (a - m),
            // n = sum dg a + g b, d2g = dg (a - m) + g (b - n).
            const int64_t tt = r * dirs + (j - half);
            float m = 0.0f;
            for (int64_t s = 0; s < k; ++s) m += gates(r, s) * dl(tt, chosen(r, s));
            float n = 0.0f;
            for (int64_t s = 0; s < k; ++s) {
              const int e = chosen(r, s);
              const float dgs = gates(r, s) * (dl(tt, e) - m);
              n += dgs * dl(tt, e) + gates(r, s) * dl(t, e);
            }
            for (int64_t s = 0; s < k; ++s) {
              const int e = chosen(r, s);
              const float a = dl(tt, e) - m;
              dg(t, s) = gates(r, s) * a * a + gates(r, s) * (dl(t, e) - n);
            }
            return;
          }
          float dot = 0.0f;
          for (int64_t e = 0; e < experts; ++e) dot += probs(r, e) * dl(t, e);
          float chosen_sum = 0.0f, dp_sum = 0.0f;
          for (int64_t s = 0; s < k; ++s) {
            const int e = chosen(r, s);
            chosen_sum += probs(r, e);
            dp_sum += probs(r, e) * (dl(t, e) - dot);
          }
          for (int64_t s = 0; s < k; ++s) {
            const int e = chosen(r, s);
            const float dp = probs(r, e) * (dl(t, e) - dot);
            dg(t, s) = (dp - gates(r, s) * dp_sum) / chosen_sum;
          }
        });
  }

  // Each (row, expert) pair's k tangents, one wide row [k * in] at the pair's place in the
  // forward's send buffer, to the expert's rank and into expert-major order.
  const MatrixView send(tangent_send_x_.data(), assignments_, dirs * in);
  {
    const Kokkos::View<int64_t**> position = position_;
    Kokkos::parallel_for(
        MESHTRAIN_LABEL("meshtrain::moe_pack_tangents"), matrix_range(assignments_, dirs * in),
        KOKKOS_LAMBDA(const int64_t a, const int64_t c) {
          send(position(a / k, a % k), c) = dxu((a / k) * dirs + c / in, c % in);
        });
  }
  const MatrixView recv(tangent_recv_x_.data(), capacity_, dirs * in);
  dispatch(send, recv, true);
  permute(recv, MatrixView(tangent_expert_x_.data(), capacity_, dirs * in), true);
  experts_tangents(scratch, dirs, second);
  const MatrixView back(tangent_back_y_.data(), capacity_, dirs * out);
  permute(MatrixView(tangent_expert_y_.data(), capacity_, dirs * out), back, false);
  const MatrixView returned(tangent_returned_.data(), assignments_, dirs * out);
  dispatch(back, returned, false);

  // dy = sum over the row's experts of dg x expert output + gate x expert tangent.
  const MatrixView y_full =
      l.splits_output() ? leading_rows(tangent_out_full_, rows) : leading_rows(tangents_, rows);
  {
    const MatrixView y = y_full;
    const Matrix values = returned_y_, gates = gates_;
    const Kokkos::View<int64_t**> position = position_;
    Kokkos::parallel_for(
        MESHTRAIN_LABEL("meshtrain::moe_combine_tangents"), matrix_range(rows, out),
        KOKKOS_LAMBDA(const int64_t t, const int64_t c) {
          const int64_t r = t / dirs, d = t % dirs;
          float sum = 0.0f;
          for (int64_t s = 0; s < k; ++s) {
            const int64_t p = position(r, s);
            sum += dg(t, s) * values(p, c) + gates(r, s) * returned(p, d * out + c);
          }
          if (d >= half) {  // second order: q_y = sum d2g y + 2 dg t + g q
            const int64_t first = d - half, tt = r * dirs + first;
            for (int64_t s = 0; s < k; ++s) {
              sum += 2.0f * dg(tt, s) * returned(position(r, s), first * out + c);
            }
          }
          y(t, c) = sum;
        });
  }
  const MatrixView result = leading_rows(tangents_, rows);
  if (l.splits_output()) {  // this rank's feature block
    const int64_t width = l.output_width(), offset = feature_index_ * width;
    Kokkos::parallel_for(
        MESHTRAIN_LABEL("meshtrain::moe_tangent_block"), matrix_range(rows, width),
        KOKKOS_LAMBDA(const int64_t t, const int64_t c) { result(t, c) = y_full(t, offset + c); });
  }
  return result;
}

void MoeLayer::experts_tangents(LayerScratch& scratch, int64_t directions, bool second_order) {
  const MoeLayout& l = layout_;
  const Dtype dtype = compute_dtype_;
  const int64_t local = l.experts_local, rows = received_ * directions;
  const HostOffsets& offsets = expert_offsets_host_;
  const MatrixView x(tangent_expert_x_.data(), capacity_ * directions, l.in);
  const MatrixView y(tangent_expert_y_.data(), capacity_ * directions, l.out);
  if (!l.feed_forward()) {  // dX_e W_e per local expert
    expert_gemms(x, weight_.compute(scratch), l.in, l.out, offsets, local, y, dtype, directions);
    return;
  }
  const int64_t hidden = l.hidden;
  const MatrixView du(tangent_up_.data(), capacity_ * directions, hidden);
  const MatrixView dh(tangent_h_.data(), capacity_ * directions, hidden);
  expert_gemms(x, weight_.compute(scratch), l.in, hidden, offsets, local, du, dtype, directions);
  if (l.gated) {
    const MatrixView dgate(tangent_gate_.data(), capacity_ * directions, hidden);
    expert_gemms(x, gate_weight_.compute(scratch), l.in, hidden, offsets, local, dgate, dtype,
                 directions);
    if (second_order) {
      swiglu_second_order_streams(row_block(ffn_gate_, 0, received_),
                                  row_block(ffn_up_, 0, received_), row_block(dgate, 0, rows),
                                  row_block(du, 0, rows), row_block(dh, 0, rows), received_,
                                  directions / 2);
    } else {
      swiglu_tangent(row_block(ffn_gate_, 0, received_), row_block(ffn_up_, 0, received_),
                     row_block(dgate, 0, rows), row_block(du, 0, rows), row_block(dh, 0, rows));
    }
  } else if (second_order) {  // t_h = f' t_u, q_h = f' q_u + f'' t_u^2
    activation_second_order(activation_, row_block(ffn_up_, 0, received_), row_block(du, 0, rows),
                            row_block(dh, 0, rows), row_block(ffn_h_, 0, received_));
  } else {
    activation_tangent(activation_, row_block(ffn_up_, 0, received_), row_block(du, 0, rows),
                       row_block(dh, 0, rows));
  }
  expert_gemms(dh, down_weight_.compute(scratch), hidden, l.out, offsets, local, y, dtype,
               directions);
}

MatrixView MoeLayer::backward_cotangents(MatrixView dy, const LayerPass& pass) {
  LayerScratch& scratch = *pass.scratch;
  const MoeLayout& l = layout_;
  cotangent_block_rows(pass, rows_, l.layer);  // whole passes only: a block is refused
  const int64_t dirs = cotangent_directions(static_cast<int64_t>(dy.extent(0)), rows_, l.layer);
  const int64_t rows = rows_ * dirs;
  MESHTRAIN_REQUIRE(static_cast<int64_t>(dy.extent(1)) == l.output_width(), "MoE layer '", l.layer,
                    "': cotangent input is [", dy.extent(0), ", ", dy.extent(1), "], expected [",
                    rows, ", ", l.output_width(), "]");
  const Dtype dtype = compute_dtype_;
  const int64_t in = l.in, out = l.out, experts = l.experts, k = l.top_k;
  MatrixView dyu = dy;
  if (l.splits_output()) {  // every tp rank computes the whole layer: the whole cotangents
    dyu = leading_rows(cotangent_y_full_, rows);
    feature_comm_->all_gather(dy, dyu, 1, dtype);
  }

  // The gates' cotangents (dy . expert output) and the experts' output cotangents (gate x dy),
  // one wide row [k * out] per (row, expert) pair at its place in the forward's send buffer.
  const MatrixView dg = leading_rows(cotangent_gates_, rows);
  const MatrixView send(cotangent_send_y_.data(), assignments_, dirs * out);
  {
    const Matrix values = returned_y_, gates = gates_;
    const Kokkos::View<int64_t**> position = position_;
    Kokkos::parallel_for(
        MESHTRAIN_LABEL("meshtrain::moe_gate_cotangents"), Range(device_space(), 0, rows),
        KOKKOS_LAMBDA(const int64_t t) {
          const int64_t r = t / dirs, d = t % dirs;
          for (int64_t s = 0; s < k; ++s) {
            const int64_t p = position(r, s);
            const float gate = gates(r, s);
            float dot = 0.0f;
            for (int64_t c = 0; c < out; ++c) {
              dot += dyu(t, c) * values(p, c);
              send(p, d * out + c) = gate * dyu(t, c);
            }
            dg(t, s) = dot;
          }
        });
  }
  const MatrixView recv(cotangent_recv_y_.data(), capacity_, dirs * out);
  dispatch(send, recv, true);
  permute(recv, MatrixView(cotangent_expert_y_.data(), capacity_, dirs * out), true);
  experts_cotangents(scratch, dirs);
  const MatrixView back(cotangent_back_x_.data(), capacity_, dirs * in);
  permute(MatrixView(cotangent_expert_x_.data(), capacity_, dirs * in), back, false);
  const MatrixView returned(cotangent_returned_x_.data(), assignments_, dirs * in);
  dispatch(back, returned, false);

  // Router: the gates' cotangents -> the probabilities' -> the logits' (softmax), as backward
  // without the balancing loss's term.
  const MatrixView dl = leading_rows(cotangent_logits_, rows);
  {
    const Matrix probs = probs_, gates = gates_;
    const Kokkos::View<int**> chosen = chosen_;
    Kokkos::parallel_for(
        MESHTRAIN_LABEL("meshtrain::moe_router_cotangents"), Range(device_space(), 0, rows),
        KOKKOS_LAMBDA(const int64_t t) {
          const int64_t r = t / dirs;
          float chosen_sum = 0.0f, weighted = 0.0f;
          for (int64_t s = 0; s < k; ++s) {
            chosen_sum += probs(r, chosen(r, s));
            weighted += gates(r, s) * dg(t, s);
          }
          for (int64_t e = 0; e < experts; ++e) dl(t, e) = 0.0f;
          for (int64_t s = 0; s < k; ++s) dl(t, chosen(r, s)) = (dg(t, s) - weighted) / chosen_sum;
          float dot = 0.0f;
          for (int64_t e = 0; e < experts; ++e) dot += probs(r, e) * dl(t, e);
          for (int64_t e = 0; e < experts; ++e) dl(t, e) = probs(r, e) * (dl(t, e) - dot);
        });
  }
  // dX = dl Wrᵀ + the sum over the row's experts of their input cotangents.
  const ConstVectorView wr = router_.compute(scratch);
  const MatrixView full =
      feature_comm_ ? leading_rows(cotangent_x_full_, rows) : leading_rows(cotangents_, rows);
  gemm(plain(dl), transposed(ConstMatrixView(wr.data(), in, experts)), 0.0f, full, dtype);
  add_experts_input_cotangents(MESHTRAIN_LABEL("meshtrain::moe_input_cotangents"), full, returned,
                               position_, rows, in, k, dirs);
  const MatrixView result = leading_rows(cotangents_, rows);
  if (feature_comm_) {  // back to this rank's feature block
    const int64_t width = l.input_width(), offset = feature_index_ * width;
    Kokkos::parallel_for(
        MESHTRAIN_LABEL("meshtrain::moe_cotangent_block"), matrix_range(rows, width),
        KOKKOS_LAMBDA(const int64_t t, const int64_t c) { result(t, c) = full(t, offset + c); });
  }
  return result;
}

MatrixView MoeLayer::backward_with_tangents(MatrixView dy, MatrixView dt, bool need_input_grad,
                                            const LayerPass& pass, MatrixView* dt_in) {
  LayerScratch& scratch = *pass.scratch;
  const MoeLayout& l = layout_;
  MESHTRAIN_REQUIRE(compute_dtype_ == Dtype::fp32, "MoE layer '", l.layer,
                    "': training on derivatives is fp32 only");
  MESHTRAIN_REQUIRE(second_order_ == pass.second_order, "MoE layer '", l.layer,
                    "': the backward's streams are not of the kind the last tangent pass had");
  const int64_t dirs = tangent_directions(static_cast<int64_t>(dt.extent(0)), rows_, l.layer);
  const int64_t rows = rows_ * dirs;
  const bool second = second_order_;
  const int64_t half = second ? dirs / 2 : dirs;  // first-order rows per row
  MESHTRAIN_REQUIRE(static_cast<int64_t>(dy.extent(0)) == rows_ &&
                        static_cast<int64_t>(dy.extent(1)) == l.output_width() &&
                        static_cast<int64_t>(dt.extent(1)) == l.output_width() &&
                        cotangent_capacity_ >= dirs &&
                        static_cast<int64_t>(tangent_x_used_.extent(0)) == rows,
                    "MoE layer '", l.layer, "': output gradient [", dy.extent(0), ", ",
                    dy.extent(1), "] and tangent gradient [", dt.extent(0), ", ", dt.extent(1),
                    "], expected [", rows_, ", ", l.output_width(),
                    "] and as many tangent rows as the last forward_tangents after "
                    "reserve_tangent_backward");
  const int64_t in = l.in, out = l.out, experts = l.experts, k = l.top_k;
  MatrixView dtu = dt;
  if (l.splits_output()) {  // every tp rank computes the whole layer: the whole gradients
    feature_comm_->all_gather(dy, dy_full_, 1, Dtype::fp32);
    dy = dy_full_;
    dtu = leading_rows(cotangent_y_full_, rows);
    feature_comm_->all_gather(dt, dtu, 1, Dtype::fp32);
  }

  // Per row: c(d, s) = dt_d . y_s (into cotangent_gates_), w_d = sum_s g_s c(d, s),
  // m_d = sum_s g_s a(d, s) with a the tangent logits of the chosen experts; the gates'
  // gradients dy . y_s + sum_d dt_d . t_s + c (a - m) - a w (t_s: the expert's tangents, as
  // forward_tangents received them; into dlogits_' first k columns) and the tangent logits'
  // gradients g_s (c - w) on the chosen experts, 0 elsewhere.
  const MatrixView cg = leading_rows(cotangent_gates_, rows);
  const MatrixView ga = leading_rows(cotangent_logits_, rows);
  {
    const Matrix values = returned_y_, gates = gates_, dl = dlogits_;
    const MatrixView tl = leading_rows(tangent_logits_, rows);
    const MatrixView expert_tangents(tangent_returned_.data(), assignments_, dirs * out);
    const Kokkos::View<int**> chosen = chosen_;
    const Kokkos::View<int64_t**> position = position_;
    const MatrixView g_value = dy, g_tangent = dtu;
    const MatrixView dgates = leading_rows(tangent_gates_, rows);
    Kokkos::parallel_for(
        MESHTRAIN_LABEL("meshtrain::moe_gate_grad_with_tangents"), Range(device_space(), 0, rows_),
        KOKKOS_LAMBDA(const int64_t r) {
          float gate_grad[kMaxTopK];
          for (int64_t s = 0; s < k; ++s) {
            const int64_t p = position(r, s);
            float dot = 0.0f;
            for (int64_t c = 0; c < out; ++c) dot += g_value(r, c) * values(p, c);
            gate_grad[s] = dot;
          }
          if (second) {
            // The reverse of the second-order gates (docs/derivatives.md, "MoE layers"), per
            // direction: C = g_q . y_s (d2g's gradient), D = g_t . y_s + 2 g_q . t_s (dg's),
            // W2 = sum g C, D' = D + C (a - m) - W2 a, mbar = -sum C dg - sum g D';
            // the logits' gradients a: dg (C - W2) + g (D' + mbar), b: g (C - W2); the gates'
            // g_t . t_s + g_q . q_s + C (b - n) - W2 b + D' (a - m) + a mbar.
            for (int64_t d = 0; d < half; ++d) {
              const int64_t tt = r * dirs + d, qq = tt + half;
              float cc[kMaxTopK], dd[kMaxTopK];
              float m = 0.0f, n = 0.0f, w2 = 0.0f;
              for (int64_t s = 0; s < k; ++s) {
                const int64_t p = position(r, s);
                const int e = chosen(r, s);
                float c_dot = 0.0f, d_dot = 0.0f, direct = 0.0f;
                for (int64_t c = 0; c < out; ++c) {
                  const float ts = expert_tangents(p, d * out + c);
                  c_dot += g_tangent(qq, c) * values(p, c);
                  d_dot += g_tangent(tt, c) * values(p, c) + 2.0f * g_tangent(qq, c) * ts;
                  direct += g_tangent(tt, c) * ts +
                            g_tangent(qq, c) * expert_tangents(p, (d + half) * out + c);
                }
                cc[s] = c_dot;
                dd[s] = d_dot;
                gate_grad[s] += direct;
                m += gates(r, s) * tl(tt, e);
                n += dgates(tt, s) * tl(tt, e) + gates(r, s) * tl(qq, e);
                w2 += gates(r, s) * c_dot;
              }
              float mbar = 0.0f;
              for (int64_t s = 0; s < k; ++s) {
                const float a = tl(tt, chosen(r, s));
                dd[s] += cc[s] * (a - m) - w2 * a;
                mbar -= cc[s] * dgates(tt, s) + gates(r, s) * dd[s];
              }
              for (int64_t e = 0; e < experts; ++e) {
                ga(tt, e) = 0.0f;
                ga(qq, e) = 0.0f;
              }
              for (int64_t s = 0; s < k; ++s) {
                const int e = chosen(r, s);
                const float a = tl(tt, e), b = tl(qq, e), g = gates(r, s);
                ga(tt, e) = dgates(tt, s) * (cc[s] - w2) + g * (dd[s] + mbar);
                ga(qq, e) = g * (cc[s] - w2);
                gate_grad[s] += cc[s] * (b - n) - w2 * b + dd[s] * (a - m) + a * mbar;
              }
            }
            for (int64_t s = 0; s < k; ++s) dl(r, s) = gate_grad[s];
            return;
          }
          for (int64_t d = 0; d < dirs; ++d) {
            const int64_t t = r * dirs + d;
            float w = 0.0f, m = 0.0f;
            for (int64_t s = 0; s < k; ++s) {
              const int64_t p = position(r, s);
              float dot = 0.0f;
              for (int64_t c = 0; c < out; ++c) dot += g_tangent(t, c) * values(p, c);
              cg(t, s) = dot;
              w += gates(r, s) * dot;
              // g_s t_s in the output tangent: the gate's gradient gains dt . t_s.
              float through_tangent = 0.0f;
              for (int64_t c = 0; c < out; ++c)
                through_tangent += g_tangent(t, c) * expert_tangents(p, d * out + c);
              gate_grad[s] += through_tangent;
              m += gates(r, s) * tl(t, chosen(r, s));
            }
            for (int64_t e = 0; e < experts; ++e) ga(t, e) = 0.0f;
            for (int64_t s = 0; s < k; ++s) {
              const float a = tl(t, chosen(r, s));
              gate_grad[s] += cg(t, s) * (a - m) - a * w;
              ga(t, chosen(r, s)) = gates(r, s) * (cg(t, s) - w);
            }
          }
          for (int64_t s = 0; s < k; ++s) dl(r, s) = gate_grad[s];
        });
  }
  // The experts' value gradients g_s dy + sum_d dg_s dt_d (send order) and tangent gradients
  // g_s dt_d (one wide row [k * out] per pair), out through the forward's dispatch plan.
  const MatrixView send_t(cotangent_send_y_.data(), assignments_, dirs * out);
  {
    const Matrix send = send_dy_, gates = gates_;
    const MatrixView dg = leading_rows(tangent_gates_, rows);
    const Kokkos::View<int64_t**> position = position_;
    const MatrixView g_value = dy, g_tangent = dtu;
    Kokkos::parallel_for(
        MESHTRAIN_LABEL("meshtrain::moe_pack_grads_with_tangents"), matrix_range(assignments_, out),
        KOKKOS_LAMBDA(const int64_t a, const int64_t c) {
          const int64_t r = a / k, s = a % k, p = position(r, s);
          const float gate = gates(r, s);
          // (second order: dg holds d2g on the second-order rows, and a tangent's gradient
          // gains 2 dg g_q from the combination's 2 dg t_s)
          float sum = gate * g_value(r, c);
          for (int64_t d = 0; d < dirs; ++d) {
            sum += dg(r * dirs + d, s) * g_tangent(r * dirs + d, c);
            float grad = gate * g_tangent(r * dirs + d, c);
            if (d < half && second) {
              grad += 2.0f * dg(r * dirs + d, s) * g_tangent(r * dirs + d + half, c);
            }
            send_t(p, d * out + c) = grad;
          }
          send(p, c) = sum;
        });
  }
  dispatch(send_dy_, back_y_, true);
  permute(back_y_, expert_y_, true);  // expert_y_ now holds the experts' output gradients
  const MatrixView recv_t(cotangent_recv_y_.data(), capacity_, dirs * out);
  dispatch(send_t, recv_t, true);
  permute(recv_t, MatrixView(cotangent_expert_y_.data(), capacity_, dirs * out), true);

  experts_backward_with_tangents(scratch, dirs, need_input_grad, second);
  const MatrixView returned_t(cotangent_returned_x_.data(), assignments_, dirs * in);
  if (need_input_grad) {
    permute(expert_dx_, recv_x_, false);
    dispatch(recv_x_, send_x_, false);  // send_x_ now holds each pair's input gradient
    const MatrixView back_t(cotangent_back_x_.data(), capacity_, dirs * in);
    permute(MatrixView(cotangent_expert_x_.data(), capacity_, dirs * in), back_t, false);
    dispatch(back_t, returned_t, false);
  }

  // Router: logits' gradient (with the balancing loss's term); its weight's gradient
  // xᵀ dl + tᵀ ga.
  router_logit_gradients(pass.loss_scale);
  const VectorView gr = router_.gradient(scratch);
  const MatrixView gr_matrix(gr.data(), in, experts);
  gemm(transposed(x_used_), plain(dlogits_), 0.0f, gr_matrix, Dtype::fp32);
  gemm(transposed(tangent_x_used_), plain(ga), 1.0f, gr_matrix, Dtype::fp32);

  MatrixView dx;
  *dt_in = MatrixView();
  if (need_input_grad) {
    // dX = dl Wrᵀ + the experts' input gradients; dT = ga Wrᵀ + the experts' input tangents'.
    const ConstVectorView wr = router_.compute(scratch);
    const ConstMatrixView wr_matrix(wr.data(), in, experts);
    const MatrixView full = feature_comm_ ? MatrixView(dx_full_) : MatrixView(dx_);
    const MatrixView full_t =
        feature_comm_ ? leading_rows(cotangent_x_full_, rows) : leading_rows(cotangents_, rows);
    gemm(plain(dlogits_), transposed(wr_matrix), 0.0f, full, Dtype::fp32);
    gemm(plain(ga), transposed(wr_matrix), 0.0f, full_t, Dtype::fp32);
    add_experts_input_cotangents(MESHTRAIN_LABEL("meshtrain::moe_input_grad"), full, send_x_,
                                 position_, rows_, in, k, 1);
    add_experts_input_cotangents(MESHTRAIN_LABEL("meshtrain::moe_input_cotangents"), full_t,
                                 returned_t, position_, rows, in, k, dirs);
    dx = dx_;
    *dt_in = leading_rows(cotangents_, rows);
    if (feature_comm_) {  // back to this rank's feature blocks
      const int64_t width = l.input_width(), offset = feature_index_ * width;
      const Matrix part = dx_;
      const MatrixView part_t = *dt_in;
      Kokkos::parallel_for(
          MESHTRAIN_LABEL("meshtrain::moe_input_grad_block"), matrix_range(rows_, width),
          KOKKOS_LAMBDA(const int64_t r, const int64_t c) { part(r, c) = full(r, offset + c); });
      Kokkos::parallel_for(
          MESHTRAIN_LABEL("meshtrain::moe_cotangent_block"), matrix_range(rows, width),
          KOKKOS_LAMBDA(const int64_t t, const int64_t c) {
            part_t(t, c) = full_t(t, offset + c);
          });
    }
  }
  reduce_gradients(scratch);
  return dx;
}

void MoeLayer::experts_backward_with_tangents(LayerScratch& scratch, int64_t directions,
                                              bool need_input_grad, bool second_order) {
  const MoeLayout& l = layout_;
  const Dtype dtype = Dtype::fp32;
  const int64_t local = l.experts_local, rows = received_ * directions;
  const HostOffsets& offsets = expert_offsets_host_;
  auto bias_first = [this](const MoeParameterStorage& b) {
    return b.all_experts ? first_expert_ : int64_t{0};
  };
  // The tangent inputs and the tangent gradients, `directions` rows per pair, expert-major.
  const MatrixView t_x(tangent_expert_x_.data(), capacity_ * directions, l.in);
  const MatrixView g_t(cotangent_expert_y_.data(), capacity_ * directions, l.out);
  const MatrixView g_t_x(cotangent_expert_x_.data(), capacity_ * directions, l.in);
  if (!l.feed_forward()) {
    // dW_e = X_eᵀ dY_e + T_eᵀ dT_e, db_e = column sums of dY_e, dX_e = dY_e W_eᵀ,
    // dT_in = dT_e W_eᵀ.
    const VectorView gw = weight_.gradient(scratch);
    expert_weight_gradients(expert_x_, expert_y_, gw, l.in, l.out, offsets, local, dtype);
    expert_weight_gradients_add(t_x, g_t, gw, l.in, l.out, offsets, local, directions);
    expert_bias_gradients(expert_y_, bias_.gradient(scratch), bias_first(l.experts_bias),
                          expert_offsets_, local, l.out, dtype);
    if (need_input_grad) {
      expert_input_gemms(expert_y_, weight_.compute(scratch), l.in, l.out, offsets, local, 0.0f,
                         expert_dx_, dtype);
      expert_input_gemms(g_t, weight_.compute(scratch), l.in, l.out, offsets, local, 0.0f, g_t_x,
                         dtype, directions);
    }
    return;
  }
  const int64_t in = l.in, hidden = l.hidden, out = l.out;
  const MatrixView t_up(tangent_up_.data(), capacity_ * directions, hidden);
  const MatrixView t_h(tangent_h_.data(), capacity_ * directions, hidden);
  const MatrixView g_th(cotangent_h_.data(), capacity_ * directions, hidden);
  const MatrixView g_tu(cotangent_up_.data(), capacity_ * directions, hidden);
  // Down: dD_e = H_eᵀ dY_e + TH_eᵀ dT_e, dbd_e, dH_e = dY_e D_eᵀ, dTH_e = dT_e D_eᵀ.
  const VectorView gd = down_weight_.gradient(scratch);
  expert_weight_gradients(ffn_h_, expert_y_, gd, hidden, out, offsets, local, dtype);
  expert_weight_gradients_add(t_h, g_t, gd, hidden, out, offsets, local, directions);
  expert_bias_gradients(expert_y_, down_bias_.gradient(scratch), bias_first(l.experts_down_bias),
                        expert_offsets_, local, out, dtype);
  expert_input_gemms(expert_y_, down_weight_.compute(scratch), hidden, out, offsets, local, 0.0f,
                     ffn_dh_, dtype);
  expert_input_gemms(g_t, down_weight_.compute(scratch), hidden, out, offsets, local, 0.0f, g_th,
                     dtype, directions);
  const MatrixView u = row_block(ffn_up_, 0, received_);
  const MatrixView dh = row_block(ffn_dh_, 0, received_);
  if (l.gated) {  // SwiGLU: ffn_dh_ becomes up's gradient, ffn_dgate_ gate's
    const MatrixView g_tg(cotangent_gate_.data(), capacity_ * directions, hidden);
    swiglu_backward_with_tangents(row_block(ffn_gate_, 0, received_), u,
                                  MatrixView(tangent_gate_.data(), capacity_ * directions, hidden),
                                  t_up, dh, g_th, row_block(ffn_dgate_, 0, received_), g_tg, g_tu,
                                  received_, second_order ? directions / 2 : directions,
                                  second_order);
    const VectorView gg = gate_weight_.gradient(scratch);
    expert_weight_gradients(expert_x_, ffn_dgate_, gg, in, hidden, offsets, local, dtype);
    expert_weight_gradients_add(t_x, g_tg, gg, in, hidden, offsets, local, directions);
    expert_bias_gradients(ffn_dgate_, gate_bias_.gradient(scratch), bias_first(l.experts_gate_bias),
                          expert_offsets_, local, hidden, dtype);
  } else if (second_order) {
    // Through the activation's second-order rule (t_h = f' t_u, q_h = f' q_u + f'' t_u^2):
    // dU = f' dH + f'' sum_d (t_u g_t + q_u g_q) + f''' sum_d t_u^2 g_q, g_t_u = f' g_t +
    // 2 f'' t_u g_q, g_q_u = f' g_q (activation_second_order_backward).
    activation_second_order_backward(activation_, u, row_block(t_up, 0, rows), dh,
                                     row_block(g_th, 0, rows), row_block(g_tu, 0, rows),
                                     row_block(ffn_h_, 0, received_));
  } else {
    // Through the activation (t_h = f'(u) t_up): dU = f'(u) dH + f''(u) sum_d t_up dTH,
    // dT_up = f'(u) dTH.
    activation_backward(activation_, u, dh, dtype);
    activation_curvature_add(activation_, u, row_block(t_up, 0, rows), row_block(g_th, 0, rows),
                             dh);
    activation_tangent(activation_, u, row_block(g_th, 0, rows), row_block(g_tu, 0, rows));
  }
  // Up: dU_e = X_eᵀ dU + T_eᵀ dT_up, dbu_e, dX_e = dU W_eᵀ, dT_in = dT_up W_eᵀ.
  const VectorView gu = weight_.gradient(scratch);
  expert_weight_gradients(expert_x_, ffn_dh_, gu, in, hidden, offsets, local, dtype);
  expert_weight_gradients_add(t_x, g_tu, gu, in, hidden, offsets, local, directions);
  expert_bias_gradients(ffn_dh_, bias_.gradient(scratch), bias_first(l.experts_bias),
                        expert_offsets_, local, hidden, dtype);
  if (need_input_grad) {
    expert_input_gemms(ffn_dh_, weight_.compute(scratch), in, hidden, offsets, local, 0.0f,
                       expert_dx_, dtype);
    expert_input_gemms(g_tu, weight_.compute(scratch), in, hidden, offsets, local, 0.0f, g_t_x,
                       dtype, directions);
    if (l.gated) {  // plus the gate's parts
      expert_input_gemms(ffn_dgate_, gate_weight_.compute(scratch), in, hidden, offsets, local,
                         1.0f, expert_dx_, dtype);
      expert_input_gemms(MatrixView(cotangent_gate_.data(), capacity_ * directions, hidden),
                         gate_weight_.compute(scratch), in, hidden, offsets, local, 1.0f, g_t_x,
                         dtype, directions);
    }
  }
}

void MoeLayer::reserve_tangent_backward(int64_t directions) {
  reserve_tangents(directions);
  reserve_cotangents(directions);  // the backward's tangent-side buffers
}

void MoeLayer::experts_cotangents(LayerScratch& scratch, int64_t directions) {
  const MoeLayout& l = layout_;
  const Dtype dtype = compute_dtype_;
  const int64_t local = l.experts_local, rows = received_ * directions;
  const HostOffsets& offsets = expert_offsets_host_;
  const MatrixView dy(cotangent_expert_y_.data(), capacity_ * directions, l.out);
  const MatrixView dx(cotangent_expert_x_.data(), capacity_ * directions, l.in);
  if (!l.feed_forward()) {  // dY_e W_eᵀ per local expert
    expert_input_gemms(dy, weight_.compute(scratch), l.in, l.out, offsets, local, 0.0f, dx, dtype,
                       directions);
    return;
  }
  const int64_t hidden = l.hidden;
  const MatrixView dh(cotangent_h_.data(), capacity_ * directions, hidden);
  const MatrixView du(cotangent_up_.data(), capacity_ * directions, hidden);
  expert_input_gemms(dy, down_weight_.compute(scratch), hidden, l.out, offsets, local, 0.0f, dh,
                     dtype, directions);
  if (l.gated) {
    const MatrixView dgate(cotangent_gate_.data(), capacity_ * directions, hidden);
    swiglu_cotangent(row_block(ffn_gate_, 0, received_), row_block(ffn_up_, 0, received_),
                     row_block(dh, 0, rows), row_block(dgate, 0, rows), row_block(du, 0, rows));
    expert_input_gemms(du, weight_.compute(scratch), l.in, hidden, offsets, local, 0.0f, dx, dtype,
                       directions);
    expert_input_gemms(dgate, gate_weight_.compute(scratch), l.in, hidden, offsets, local, 1.0f, dx,
                       dtype, directions);
    return;
  }
  activation_tangent(activation_, row_block(ffn_up_, 0, received_), row_block(dh, 0, rows),
                     row_block(du, 0, rows));  // diagonal: the cotangent is the same product
  expert_input_gemms(du, weight_.compute(scratch), l.in, hidden, offsets, local, 0.0f, dx, dtype,
                     directions);
}

void MoeLayer::reserve_cotangents(int64_t directions) {
  if (directions <= cotangent_capacity_) return;
  const MoeLayout& l = layout_;
  const std::string& name = l.layer;
  const int64_t rows = rows_ * directions;
  const int64_t pairs = capacity_ * directions;
  if (pairs * std::max(l.in, l.out) > INT32_MAX) {
    MESHTRAIN_BAD_INPUT("MoE layer '", l.layer, "': ", directions, " cotangent directions of ",
                        rows_,
                        " rows per rank are more than one all-to-all moves (2^31 elements); "
                        "use a smaller batch");
  }
  if (l.splits_output()) cotangent_y_full_ = Matrix(name + "/output_cotangents_full", rows, l.out);
  cotangent_gates_ = Matrix(name + "/gate_cotangents", rows, l.top_k);
  cotangent_logits_ = Matrix(name + "/router_logit_cotangents", rows, l.experts);
  cotangent_send_y_ = Matrix(name + "/send_y_cotangents", assignments_ * directions, l.out);
  cotangent_recv_y_ = Matrix(name + "/recv_y_cotangents", pairs, l.out);
  cotangent_expert_y_ = Matrix(name + "/expert_y_cotangents", pairs, l.out);
  if (l.feed_forward()) {
    cotangent_h_ = Matrix(name + "/expert_hidden_cotangents", pairs, l.hidden);
    cotangent_up_ = Matrix(name + "/expert_up_cotangents", pairs, l.hidden);
    if (l.gated) cotangent_gate_ = Matrix(name + "/expert_gate_cotangents", pairs, l.hidden);
  }
  cotangent_expert_x_ = Matrix(name + "/expert_x_cotangents", pairs, l.in);
  cotangent_back_x_ = Matrix(name + "/back_x_cotangents", pairs, l.in);
  cotangent_returned_x_ = Matrix(name + "/returned_x_cotangents", assignments_ * directions, l.in);
  if (feature_comm_) cotangent_x_full_ = Matrix(name + "/input_cotangents_full", rows, l.in);
  cotangents_ = Matrix(name + "/input_cotangents", rows, l.input_width());
  if (expert_comm_) {
    const size_t elements = static_cast<size_t>(pairs * std::max(l.in, l.out));
    if (compute_dtype_ != Dtype::fp32) expert_comm_->reserve_wire(elements, elements);
    expert_comm_->reserve_staging(elements * bytes_of(compute_dtype_),
                                  elements * bytes_of(compute_dtype_));
  }
  if (feature_comm_) feature_comm_->reserve_scratch(static_cast<size_t>(rows * l.out));
  cotangent_capacity_ = directions;
}

void MoeLayer::reserve_tangents(int64_t directions) {
  if (directions <= tangent_capacity_) return;
  const MoeLayout& l = layout_;
  const std::string& name = l.layer;
  const int64_t rows = rows_ * directions;
  const int64_t pairs = capacity_ * directions;
  if (pairs * std::max(l.in, l.out) > INT32_MAX) {
    MESHTRAIN_BAD_INPUT("MoE layer '", l.layer, "': ", directions, " tangent directions of ", rows_,
                        " rows per rank are more than one all-to-all moves (2^31 elements); "
                        "use a smaller batch");
  }
  if (l.gathers_input()) tangent_x_full_ = Matrix(name + "/input_tangents", rows, l.in);
  tangent_logits_ = Matrix(name + "/router_logit_tangents", rows, l.experts);
  tangent_gates_ = Matrix(name + "/gate_tangents", rows, l.top_k);
  tangent_send_x_ = Matrix(name + "/send_x_tangents", assignments_ * directions, l.in);
  tangent_recv_x_ = Matrix(name + "/recv_x_tangents", pairs, l.in);
  tangent_expert_x_ = Matrix(name + "/expert_x_tangents", pairs, l.in);
  if (l.feed_forward()) {
    tangent_up_ = Matrix(name + "/expert_up_tangents", pairs, l.hidden);
    tangent_h_ = Matrix(name + "/expert_hidden_tangents", pairs, l.hidden);
    if (l.gated) tangent_gate_ = Matrix(name + "/expert_gate_tangents", pairs, l.hidden);
  }
  tangent_expert_y_ = Matrix(name + "/expert_y_tangents", pairs, l.out);
  tangent_back_y_ = Matrix(name + "/back_y_tangents", pairs, l.out);
  tangent_returned_ = Matrix(name + "/returned_y_tangents", assignments_ * directions, l.out);
  if (l.splits_output()) tangent_out_full_ = Matrix(name + "/output_tangents_full", rows, l.out);
  tangents_ = Matrix(name + "/tangents", rows, l.output_width());
  if (expert_comm_) {
    const size_t elements = static_cast<size_t>(pairs * std::max(l.in, l.out));
    if (compute_dtype_ != Dtype::fp32) expert_comm_->reserve_wire(elements, elements);
    expert_comm_->reserve_staging(elements * bytes_of(compute_dtype_),
                                  elements * bytes_of(compute_dtype_));
  }
  if (feature_comm_) feature_comm_->reserve_scratch(static_cast<size_t>(rows * l.in));
  tangent_capacity_ = directions;
}

}  // namespace meshtrain
