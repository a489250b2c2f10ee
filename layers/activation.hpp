#pragma once
// Elementwise activations, forward and backward. They work on any layout (a block of an
// activation is activated independently of the others).
//   relu  max(z, 0); derivative 1 for z > 0, else 0
//   tanh  tanh(z);   derivative 1 - tanh(z)^2
//   gelu  the tanh approximation (as jax.nn.gelu(approximate=True) and GELU(approximate=
//         "tanh") in PyTorch): 0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3)))
//   gelu_erf  the exact form (PyTorch's GELU(approximate="none")): z Phi(z) =
//         0.5 z (1 + erf(z / sqrt 2)), computed as 0.5 z erfc(-z / sqrt 2); derivative
//         Phi(z) + z phi(z), phi(z) = exp(-z^2 / 2) / sqrt(2 pi)
//   silu  z sigmoid(z) (PyTorch's SiLU); derivative s (1 + z (1 - s)), s = sigmoid(z)
//   sigmoid  1 / (1 + exp(-z)); derivative s (1 - s)
//   none  identity
// sigmoid and silu take exp of -|z| only (no overflow for any z); gelu_erf's exp(-z^2 / 2)
// underflows to 0 for large |z|.

#include <string>

#include "framework/core/choices.hpp"    // Activation, its names
#include "framework/core/precision.hpp"  // HalfMatrix
#include "framework/core/sharded_tensor.hpp"
#include "layers/layer.hpp"

namespace meshtrain {

// out = f(z) rounded to `dtype` (mixed precision's compute dtype; fp32: not rounded); out
// may be z itself.
void activation_forward(Activation activation, MatrixView z, MatrixView out,
                        Dtype dtype = Dtype::fp32);
// grad = grad * f'(z) rounded to `dtype`, in place; `z` is the forward input.
void activation_backward(Activation activation, MatrixView z, MatrixView grad,
                         Dtype dtype = Dtype::fp32);

// Mixed precision's 16-bit storage (docs/mixed_precision.md, "Compute and memory on this
// build"): z's elements hold `dtype` values (16-bit). Forward, in one pass: z = f(z) rounded to
// `dtype` in place, kept_out = f(z)'s 16-bit bits and, where the derivative reads z
// (activation_keeps_16bit_input, framework/core/activation_storage.hpp: not relu, not the
// identity), kept_z = z's; for relu and the identity kept_z must be empty (checked). Backward:
// grad = grad * f'(z) rounded to `dtype`, in place, reading `kept`: forward's kept_z where
// activation_keeps_16bit_input, else forward's kept_out (relu's f'(z) read from f(z), the
// identity's reading nothing: the same bits). The formulas and roundings of activation_forward /
// activation_backward (so the values are bit for bit theirs); views contiguous.
void activation_forward_keeping_16bit(Activation activation, MatrixView z, HalfMatrixView kept_z,
                                      HalfMatrixView kept_out, Dtype dtype);
void activation_backward_from_16bit(Activation activation, ConstHalfMatrixView kept,
                                    MatrixView grad, Dtype dtype);

// SwiGLU on two inputs (Shazeer 2020), elementwise: out = silu(gate) * value, rounded once to
// `dtype`. Backward from dY: dgate = dY * value * silu'(gate), dvalue = dY * silu(gate), each
// rounded to `dtype`; dvalue may be dy itself.
void swiglu_forward(MatrixView gate, MatrixView value, MatrixView out, Dtype dtype = Dtype::fp32);
void swiglu_backward(MatrixView gate, MatrixView value, MatrixView dy, MatrixView dgate,
                     MatrixView dvalue, Dtype dtype = Dtype::fp32);

// Tangents and cotangents (docs/derivatives.md), fp32, k = dz.extent(0) / z.extent(0)
// directions per row, sample-major (row t belongs to value row t / k); each derivative of a
// value element is computed once for its k rows. Outputs never share memory with inputs.
//   activation_tangent  out(t, j) = f'(z(t / k, j)) dz(t, j): the tangent, and the cotangent
//                       too (the Jacobian is diagonal)
//   swiglu_tangent      out(t, j) = silu'(g) value dgate(t, j) + silu(g) dvalue(t, j), with
//                       g = gate(t / k, j), value = value(t / k, j)
//   swiglu_cotangent    dgate(t, j) = dy(t, j) value silu'(g), dvalue(t, j) = dy(t, j) silu(g)
void activation_tangent(Activation activation, MatrixView z, MatrixView dz, MatrixView out);
// activation_curvature_add: grad(i, j) += f''(z(i, j)) sum_d t_in(i k + d, j) dt(i k + d, j), the
// tangents' term of the pre-activation's gradient in training on derivatives (t_out = f'(z)
// t_in); nothing for relu and none (f'' = 0). grad [rows, width] may be written in place.
void activation_curvature_add(Activation activation, MatrixView z, MatrixView t_in, MatrixView dt,
                              MatrixView grad);
// The forward Laplacian (docs/derivatives.md, "Physics losses"), fp32. streams [rows * 2k,
// width] hold per value row i, at rows 2k i .. 2k i + 2k - 1, k first-derivative tangents t_d
// then k diagonal second derivatives s_d (d^2 / dx_d^2 of the pre-activation):
//   activation_second_order  out: t_d' = f'(z) t_d, s_d' = f'(z) s_d + f''(z) t_d^2
//   activation_second_order_backward  with g [rows, width] the gradient w.r.t. the value
//       output (overwritten in place by that w.r.t. z) and stream_grad w.r.t. the output
//       streams: g_z = f' g + f'' sum_d (t_d g_t_d + s_d g_s_d) + f''' sum_d t_d^2 g_s_d,
//       stream_grad_in: g_t_d = f' g_t_d + 2 f'' t_d g_s_d, g_s_d = f' g_s_d.
// relu's (and the identity's) f'' and f''' are 0. Outputs never share memory with inputs.
// value (optional, [rows, width]): f(z) as the forward computed it; tanh's derivatives are
// functions of it (1 - f^2, ...) and read it instead of computing tanh(z) again, the same float
// (activation_forward's fp32 tanh), so the same results, without the pass's most expensive call.
void activation_second_order(Activation activation, MatrixView z, MatrixView streams,
                             MatrixView out, MatrixView value = MatrixView());
void activation_second_order_backward(Activation activation, MatrixView z, MatrixView streams,
                                      MatrixView grad, MatrixView stream_grad,
                                      MatrixView stream_grad_in, MatrixView value = MatrixView());
void swiglu_tangent(MatrixView gate, MatrixView value, MatrixView dgate, MatrixView dvalue,
                    MatrixView out);
void swiglu_cotangent(MatrixView gate, MatrixView value, MatrixView dy, MatrixView dgate,
                      MatrixView dvalue);

// The activation between two layers of a model, as a layer of its own: no parameters, no
// communication; the output keeps the layout, width and offset of its input.
class ActivationLayer : public Layer {
 public:
  // `name` labels the output buffer [rows, width]; `dtype`: the compute dtype the output and
  // the gradient are rounded to. keeps_16bit (a 16-bit dtype; Mlp's 16-bit storage): the layer
  // computes in place in its input (the model's working buffer) and keeps its output as a 16-bit
  // copy ("<name>/output_16bit"), which backward and the next layer's backward (kept_output())
  // read, and, where the derivative reads z (not relu's nor the identity's:
  // activation_keeps_16bit_input), its input ("<name>/input_16bit"), which backward reads; it has
  // no fp32 buffer of its own.
  ActivationLayer(Activation activation, const std::string& name, int64_t rows, int64_t width,
                  FeatureLayout layout, int64_t offset, Dtype dtype, bool keeps_16bit = false);

  // f(x) into the layer's buffer (keeps_16bit: into x); x (the pre-activation) is kept for
  // backward (keeps_16bit: as its 16-bit copy).
  MatrixView forward(MatrixView x, const LayerPass& pass) override;
  // dY * f'(x) in place in dy (the input gradient of the layer after, owned by it).
  MatrixView backward(MatrixView dy, bool need_input_grad, const LayerPass& pass) override;
  // f'(x) * dx per direction, into the layer's tangent buffer.
  MatrixView forward_tangents(MatrixView dx, const LayerPass& pass) override;
  void reserve_tangents(int64_t directions) override;
  // dy * f'(x) per direction, into the layer's cotangent buffer.
  MatrixView backward_cotangents(MatrixView dy, const LayerPass& pass) override;
  void reserve_cotangents(int64_t directions) override;
  bool cotangents_by_rows() const override { return true; }  // elementwise
  // [rows, width] for f'(x), which a derivative forward (LayerPass::derivative_forward) writes
  // in its visit of x and forward_tangents and backward_cotangents then read instead of
  // computing f' again (fp32 on host kernels; elsewhere nothing).
  void reserve_derivative_forward(bool for_cotangents) override;
  // Sobolev training: dy * f'(x) + f''(x) * sum_d t_in g_t in place in dy (backward's, plus the
  // tangents' term), and *dt_in = f'(x) * dt per direction (the cotangent buffer).
  MatrixView backward_with_tangents(MatrixView dy, MatrixView dt, bool need_input_grad,
                                    const LayerPass& pass, MatrixView* dt_in) override;
  void reserve_tangent_backward(int64_t directions) override;
  bool supports_laplacian() const override { return true; }

  MatrixView output() const override { return output_; }
  FeatureLayout output_layout() const override { return layout_; }
  int64_t output_width() const override { return width_; }
  int64_t output_offset() const override { return offset_; }
  std::string describe() const override { return ""; }
  Activation activation() const { return activation_; }
  Dtype dtype() const { return dtype_; }
  // keeps_16bit: the last forward's output as 16-bit bits of dtype() (what the next Linear
  // keeps of its input), until the model's backward overwrites it (dy_16bit_over_output());
  // else empty.
  ConstHalfMatrixView kept_output() const { return kept_output_; }
  // keeps_16bit: the same buffer, writable, for the Linear before this activation to pack its
  // dY's 16 bits into under tensor parallelism (layers/mlp.cpp, LinearSharedBuffers::
  // output_grad_16bit). It does so in its backward, after this layer's backward has read f(z) for
  // the last time (and the next Linear's weight gradient before that): after the model's
  // backward the kept output holds those dY bits, not f(z), until the next forward.
  HalfMatrixView dy_16bit_over_output() { return kept_output_; }

 private:
  Activation activation_;
  FeatureLayout layout_;
  int64_t offset_ = 0;
  Dtype dtype_ = Dtype::fp32;
  int64_t rows_ = 0, width_ = 0;
  MatrixView z_;       // the input of the last forward
  Matrix out_;         // [rows, width] (empty when keeping 16-bit copies)
  MatrixView output_;  // out_, or the last forward's input when keeping 16-bit copies
  HalfMatrix kept_input_, kept_output_;  // [rows, width] when keeping 16-bit copies
  std::string name_;
  Matrix tangents_, cotangents_;  // [rows * directions, width]
  MatrixView tangent_in_;         // the input of the last forward_tangents
  bool second_order_ = false;     // whether that pass carried second-order streams
  Matrix slopes_;                 // [rows, width] f'(z) (reserve_derivative_forward)
  bool slopes_kept_ = false;      // whether the last forward wrote slopes_
};

}  // namespace meshtrain
