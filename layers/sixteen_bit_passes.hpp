#pragma once
// The training step's elementwise 16-bit passes of the activations (activation.cpp), the
// Linear (linear.cpp) and the SwiGLU (swiglu.cpp), each in its two versions: the Kokkos kernel
// (the default execution space: a device build's) and the host loop that stands for it where the
// layers run their host kernels (inference::layers_run_host_kernels()): per-ISA clones without
// FMA contraction (framework/core/host_clones.hpp), templated on the 16-bit format so that no
// dtype test is left in the loop, 16 lanes wide on AVX-512 where the kernel compiled for the
// build's baseline ran one element (or 4) at a time. Both give the same bits. The layers'
// functions pick the version (activation_forward_keeping_16bit, activation_backward_from_16bit,
// Linear::forward's bias add and Linear::bias_gradient, the SwiGLU layer's forward and backward
// under 16-bit storage); this header names both so that a test can compare them
// (tests/layers/sixteen_bit_passes_test.cpp). Path::host only where layers_run_host_kernels().

#include <cstdint>

#include "base/dtype.hpp"
#include "framework/core/choices.hpp"
#include "framework/core/precision.hpp"
#include "framework/core/views.hpp"

namespace meshtrain::sixteen_bit_passes {

enum class Path { kernel, host };

// The training step's path: the host loops where the layers run their host kernels
// (inference::layers_run_host_kernels()), else the Kokkos kernels.
Path step_path();
// Refuses the host loop on a build whose layers run no host kernels (`who`: the pass).
void require_host(const char* who);

// values[k] = f(values[k]) rounded to `dtype` (bf16 or fp16), its 16 bits into kept_out[k] and,
// where kept_z is not null, values[k]'s own 16 bits into kept_z[k] (values hold `dtype` values).
// One kernel labelled "meshtrain::activation_forward_keeping_16bit".
void activation_forward_keeping(Path path, Activation activation, float* values, uint16_t* kept_z,
                                uint16_t* kept_out, int64_t n, Dtype dtype);
// grads[k] = f'(kept[k]) grads[k] rounded to `dtype`, kept[k] the 16 bits of z (f(z) for relu and
// the identity). One kernel labelled "meshtrain::activation_backward_from_16bit".
void activation_backward_from(Path path, Activation activation, const uint16_t* kept, float* grads,
                              int64_t n, Dtype dtype);
// y(i, j) = round(round(y(i, j)) + round(bias[j])), round to `dtype` (16-bit): Linear::forward's
// bias in a 16-bit compute dtype. One kernel labelled "meshtrain::linear_add_bias".
void linear_add_bias(Path path, MatrixView y, const float* bias, Dtype dtype);
// full[j] = the sum over rows of dy(:, j - offset) (added row after row from 0) rounded to `dtype`
// for the columns dy covers, 0 elsewhere: Linear's bias gradient. Any dtype (fp32: no rounding).
// One kernel labelled "meshtrain::linear_bias_grad".
void linear_bias_gradient(Path path, MatrixView dy, int64_t offset, VectorView full, Dtype dtype);

// The SwiGLU layer's (swiglu.cpp), on [rows, cols] views whose rows may be strided, the kept
// arrays contiguous: out = swiglu(gate, value) rounded to `dtype` written over value, the 16 bits
// of gate, value and out kept ("meshtrain::swiglu_forward_keeping_16bit"); and from the kept
// gate and value, dgate = round(d u silu'(g)) and, over dy, round(d silu(g))
// ("meshtrain::swiglu_backward_from_16bit").
void swiglu_forward_keeping(Path path, MatrixView gate, MatrixView value, HalfMatrixView kept_gate,
                            HalfMatrixView kept_value, HalfMatrixView kept_out, Dtype dtype);
void swiglu_backward_from(Path path, ConstHalfMatrixView kept_gate, ConstHalfMatrixView kept_value,
                          MatrixView dy, MatrixView dgate, Dtype dtype);

}  // namespace meshtrain::sixteen_bit_passes
