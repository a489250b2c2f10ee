#pragma once
// The elementwise activations, one struct each, for kernels: `value(z)` is f(z) and
// `gradient(z, g)` is g f'(z), in fp32. The one place of these formulas: the layers' own
// passes (layers/activation.cpp) and the GEMM epilogues run them, so the two agree bit for
// bit (layers/activation.hpp says what each activation is):
//   relu      max(z, 0); f' = 1 for z > 0, else 0
//   tanh      tanh(z); f' = 1 - tanh(z)^2
//   gelu      0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3))), the tanh approximation
//   gelu_erf  z Phi(z) = 0.5 z erfc(-z / sqrt 2); f' = Phi(z) + z phi(z)
//   silu      z sigmoid(z); f' = s (1 + z (1 - s)), s = sigmoid(z)
//   sigmoid   1 / (1 + exp(-z)); f' = s (1 - s)
//   none      the identity
// sigmoid and silu take exp of -|z| only (no overflow for any z).
// exp and tanh are fast_math's (framework/core/fast_math.hpp: branch-free, so these loops
// vectorize; within 1 and 2 ulps of float64), not glibc's expf and tanhf: since that change the
// fp32 results of tanh, gelu, silu and sigmoid models differ from before in the last bits.
// gelu_erf keeps the library's erfc and exp (its loops stay scalar). Forced inline: a call per
// element (GCC left Tanh::gradient out of line) keeps the caller's loop scalar.
//
// with_activation(kind, body) calls body(Op{}) with the struct of `kind`, so a kernel is
// instantiated once per activation and its loop has no switch inside. Forced inline (GCC), so a
// body called from a host clone (framework/core/host_clones.hpp) is compiled inside that clone,
// for its instruction set and with its FMA setting.

#include <Kokkos_Core.hpp>

#include "framework/core/choices.hpp"
#include "framework/core/fast_math.hpp"
#include "framework/core/host_clones.hpp"
#include "framework/core/kokkos_math.hpp"

namespace meshtrain::activation_math {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;
constexpr float kInvSqrt2 = 0.7071067811865476f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;  // 1 / sqrt(2 pi)

// sigmoid(x) and 1 - sigmoid(x) = sigmoid(-x), both from e = exp(-|x|) <= 1: exp never
// overflows and neither value is a difference of nearly equal numbers, for any x.
struct Sigmoids {
  float of_x;      // sigmoid(x)
  float of_minus;  // sigmoid(-x) = 1 - sigmoid(x)
};
KOKKOS_FORCEINLINE_FUNCTION Sigmoids sigmoids(float x) {
  const float e = fast_math::exp(-kmath::fabs(x));
  const float big = 1.0f / (1.0f + e);  // sigmoid(|x|)
  const float small = e / (1.0f + e);   // sigmoid(-|x|)
  return x >= 0.0f ? Sigmoids{big, small} : Sigmoids{small, big};
}

// SwiGLU, silu(g) * u, and its two partial derivatives times the output gradient d: the one
// expression of every SwiGLU kernel, so fp32 buffers and 16-bit storage agree bit for bit.
KOKKOS_FORCEINLINE_FUNCTION float swiglu_value(float g, float u) {
  return g * sigmoids(g).of_x * u;
}
struct SwigluGradients {
  float gate;   // d * u * silu'(g)
  float value;  // d * silu(g)
};
KOKKOS_FORCEINLINE_FUNCTION SwigluGradients swiglu_gradients(float g, float u, float d) {
  const Sigmoids s = sigmoids(g);
  return {d * u * (s.of_x * (1.0f + g * s.of_minus)), d * g * s.of_x};
}

// silu(a) = a s (s the sigmoid) and its first three derivatives, p = s (1 - s):
//   h1 = s (1 + a (1 - s)),  h2 = p (2 + a (1 - 2s)),  h3 = 3 p (1 - 2s) + a p (1 - 6p)
// from sigmoids(a), so 1 - s is never a difference (p is exact to rounding where s rounds to 1)
// and h, h1 are swiglu_value's and swiglu_gradients' silu and slope bit for bit. The one jet
// of the SwiGLU layer's and the SwiGLU MoE experts' second-order streams (swiglu_streams,
// swiglu_stream_gradients below).
struct SiluJet {
  float h, h1, h2, h3;
};
KOKKOS_FORCEINLINE_FUNCTION SiluJet silu_jet(float a) {
  const Sigmoids sg = sigmoids(a);
  const float s = sg.of_x, p = sg.of_x * sg.of_minus, one_minus_2s = sg.of_minus - s;
  return {a * s, s * (1.0f + a * sg.of_minus), p * (2.0f + a * one_minus_2s),
          3.0f * p * one_minus_2s + a * p * (1.0f - 6.0f * p)};
}

// SwiGLU's streams per element and direction (docs/derivatives.md), h = silu(a) u with a the
// gate's and u the up projection's pre-activation, f = silu_jet(a); t_a, t_u their tangents and
// q_a, q_u their second-order streams (0 for first-order tangents):
//   t = h1 t_a u + h t_u,   q = (h1 q_a + h2 t_a^2) u + 2 h1 t_a t_u + h q_u
struct SwigluStreams {
  float t, q;
};
KOKKOS_FORCEINLINE_FUNCTION SwigluStreams swiglu_streams(const SiluJet& f, float u, float ta,
                                                         float tu, float qa, float qu) {
  return {f.h1 * ta * u + f.h * tu,
          (f.h1 * qa + f.h2 * ta * ta) * u + 2.0f * f.h1 * ta * tu + f.h * qu};
}
// Their reverse for one direction, from the streams' gradients g_t, g_q (g_q, q_a, q_u 0 for
// first-order tangents): the terms this direction adds to the gate's and up's value gradients
// and the gradients of t_a, t_u, q_a, q_u:
//   gate  += g_t (h2 t_a u + h1 t_u) + g_q ((h2 q_a + h3 t_a^2) u + 2 h2 t_a t_u + h1 q_u)
//   up    += g_t h1 t_a + g_q (h1 q_a + h2 t_a^2)
//   d t_a  = g_t h1 u + 2 g_q (h2 t_a u + h1 t_u),   d t_u = g_t h + 2 g_q h1 t_a
//   d q_a  = g_q h1 u,                              d q_u = g_q h
struct SwigluStreamGradients {
  float gate, up, t_gate, t_up, q_gate, q_up;
};
KOKKOS_FORCEINLINE_FUNCTION SwigluStreamGradients swiglu_stream_gradients(const SiluJet& f, float u,
                                                                          float ta, float tu,
                                                                          float qa, float qu,
                                                                          float gt, float gq) {
  return {gt * (f.h2 * ta * u + f.h1 * tu) +
              gq * ((f.h2 * qa + f.h3 * ta * ta) * u + 2.0f * f.h2 * ta * tu + f.h1 * qu),
          gt * f.h1 * ta + gq * (f.h1 * qa + f.h2 * ta * ta),
          gt * f.h1 * u + 2.0f * gq * (f.h2 * ta * u + f.h1 * tu),
          gt * f.h + 2.0f * gq * f.h1 * ta,
          gq * f.h1 * u,
          gq * f.h};
}

// Phi(x) = 0.5 (1 + erf(x / sqrt 2)) written 0.5 erfc(-x / sqrt 2): no cancellation for x << 0.
KOKKOS_FORCEINLINE_FUNCTION float normal_cdf(float x) {
  return 0.5f * kmath::erfc(-x * kInvSqrt2);
}

struct Identity {
  KOKKOS_FORCEINLINE_FUNCTION static float value(float x) { return x; }
  KOKKOS_FORCEINLINE_FUNCTION static float gradient(float, float g) { return g; }
};
struct Relu {
  KOKKOS_FORCEINLINE_FUNCTION static float value(float x) { return x > 0.0f ? x : 0.0f; }
  KOKKOS_FORCEINLINE_FUNCTION static float gradient(float x, float g) {
    return x > 0.0f ? g : 0.0f;
  }
};
struct Tanh {
  KOKKOS_FORCEINLINE_FUNCTION static float value(float x) { return fast_math::tanh(x); }
  KOKKOS_FORCEINLINE_FUNCTION static float gradient(float x, float g) {
    const float t = fast_math::tanh(x);
    return g * (1.0f - t * t);
  }
};
struct GeluTanh {
  KOKKOS_FORCEINLINE_FUNCTION static float value(float x) {
    const float inner = kSqrt2OverPi * (x + kGeluCubic * x * x * x);
    return 0.5f * x * (1.0f + fast_math::tanh(inner));
  }
  KOKKOS_FORCEINLINE_FUNCTION static float gradient(float x, float g) {
    const float inner = kSqrt2OverPi * (x + kGeluCubic * x * x * x);
    const float t = fast_math::tanh(inner);
    const float d_inner = kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * x * x);
    return g * (0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * d_inner);
  }
};
struct GeluErf {
  KOKKOS_FORCEINLINE_FUNCTION static float value(float x) { return x * normal_cdf(x); }
  // Phi(x) + x phi(x); exp(-x^2 / 2) underflows to 0, never overflows.
  KOKKOS_FORCEINLINE_FUNCTION static float gradient(float x, float g) {
    const float density = kInvSqrt2Pi * kmath::exp(-0.5f * x * x);
    return g * (normal_cdf(x) + x * density);
  }
};
struct Silu {
  KOKKOS_FORCEINLINE_FUNCTION static float value(float x) { return x * sigmoids(x).of_x; }
  KOKKOS_FORCEINLINE_FUNCTION static float gradient(float x, float g) {
    const Sigmoids s = sigmoids(x);
    return g * (s.of_x * (1.0f + x * s.of_minus));
  }
};
struct Sigmoid {
  KOKKOS_FORCEINLINE_FUNCTION static float value(float x) { return sigmoids(x).of_x; }
  KOKKOS_FORCEINLINE_FUNCTION static float gradient(float x, float g) {
    const Sigmoids s = sigmoids(x);
    return g * (s.of_x * s.of_minus);
  }
};

template <class Body>
MESHTRAIN_INLINE void with_activation(Activation kind, Body&& body) {
  switch (kind) {
    case Activation::relu:
      body(Relu{});
      return;
    case Activation::tanh:
      body(Tanh{});
      return;
    case Activation::gelu:
      body(GeluTanh{});
      return;
    case Activation::gelu_erf:
      body(GeluErf{});
      return;
    case Activation::silu:
      body(Silu{});
      return;
    case Activation::sigmoid:
      body(Sigmoid{});
      return;
    case Activation::none:
      body(Identity{});
      return;
  }
}

}  // namespace meshtrain::activation_math
