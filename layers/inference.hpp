#pragma once
// The inference forward (Mlp::infer, what Predictor runs): the layers' forward without what
// backward and the derivative passes keep, with the elementwise work folded into as few
// passes as the GEMMs allow. Per Linear layer, one GEMM call and at most one pass:
//   C = bias (+ the residual stream, for a residual block's last projection), filled as
//   BLAS would zero it for beta = 0; C += x @ W (gemm with beta = 1); then the activation
//   that follows the layer, in place (none: no pass).
// A LayerNorm is one pass over each row (its statistics and its output, the row in cache).
//
// The host kernels below run on the calling thread (as the Serial backend runs every kernel),
// compiled for AVX-512, AVX2 and the baseline, the best one picked at load time (GCC's
// target_clones); silu and sigmoid use a polynomial exp (within 2 ulp of expf) that
// vectorizes. They are used where the default memory space is host memory and the model
// computes in fp32; elsewhere (a GPU build, a 16-bit compute dtype) infer() is forward().
//
// Against forward(), in fp32: the GEMM's sum is the same, with the bias (and the residual)
// as its first term instead of its last; the activations' exp is the polynomial one; the
// LayerNorm's row sums are summed in 16 partial sums. Each output moves by a few ulps of the
// values it is made of (tests/predict: 1e-5 of the largest output against float64).

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "framework/core/choices.hpp"
#include "framework/core/views.hpp"

namespace meshtrain {

class Layer;
class Linear;
struct LayerPass;

namespace inference {

// Whether this build runs the host kernels below (the default memory space is host memory).
constexpr bool kHostKernels = !kDeviceMemoryIsHostInaccessible;
// kHostKernels, for the layers' run-time choice (a function: no code after it is unreachable
// to a compiler in a GPU build, which would warn).
bool runs_host_kernels();
// Whether the layers' training and derivative kernels take their host versions: host memory
// and, more than runs_host_kernels(), the default execution space is the host's
// (kDefaultSpaceIsHost, framework/core/exec_space.hpp). A GPU build with host-readable device
// memory (CUDA with unified memory) runs its other kernels on the GPU, which a host loop would not
// wait for.
bool layers_run_host_kernels();
// After a kernel on the host execution space that stands where a default-space kernel would:
// nothing where the two spaces are one type (a Serial or OpenMP parallel_for returns after
// its work, and the default-space kernel it replaces had no fence; Kokkos 4 reports a fence
// to tools, and the training step's pass budget holds none), a fence of the host space
// otherwise.
void fence_after_host_kernel(const std::string& label);

// c(i, j) = bias[j] + (residual ? residual(i, j) : 0); residual may be empty.
void fill_bias(MatrixView c, const float* bias, ConstMatrixView residual);
// c(i, j) += bias[j] (Linear::forward's fp32 bias, the same sums), labelled
// "meshtrain::linear_add_bias" as the kernel it replaces.
void add_bias(MatrixView c, const float* bias);
// c = f(c) in place, f = `activation` (none: nothing).
void activate(MatrixView c, Activation activation);
// y(i, :) = layernorm(x(i, :)) * scale + bias (the whole row on this rank), with LayerNorm's
// statistics (layers/norm.cpp: mean m0 = sum / n, delta = mean of (x - m0), rstd from the
// variance of x - m0 less delta^2) and eps.
void layernorm(ConstMatrixView x, const float* scale, const float* bias, float eps, MatrixView y);
// y(i, :) = x(i, :) * rstd(i) * scale, rstd = 1 / sqrt(mean(x^2) + eps) (RMSNorm).
void rmsnorm(ConstMatrixView x, const float* scale, float eps, MatrixView y);
// The same for a derivative forward (LayerPass::derivative_forward), keeping for the derivative
// passes each row's statistics stats(i, :) = (m0, delta, rstd) (RMSNorm: 0, 0, rstd; FeatureNorm's
// layout) and x_hat [rows, cols], the normalized values ((x - m0) - delta) rstd (RMSNorm: x rstd);
// y the same bits as layernorm() and rmsnorm(), which are these with stats and x_hat empty
// (nothing kept); x_hat alone may be empty (kept for cotangents only). One visit of each row;
// labelled `label`.
void layernorm_keeping(ConstMatrixView x, const float* scale, const float* bias, float eps,
                       MatrixView y, MatrixView stats, MatrixView x_hat, const std::string& label);
void rmsnorm_keeping(ConstMatrixView x, const float* scale, float eps, MatrixView y,
                     MatrixView stats, MatrixView x_hat, const std::string& label);
// out = a + b elementwise, one kernel labelled `label` (the inference residual's
// "meshtrain::infer_residual_add"; the training step's residual adds keep their own labels).
void add(ConstMatrixView a, ConstMatrixView b, MatrixView out, const std::string& label);

// A sequence of layers as infer() runs it: each Linear followed by an fp32 activation layer
// takes that activation into its own pass (the activation layer is skipped), decided once.
class Sequence {
 public:
  Sequence() = default;
  explicit Sequence(const std::vector<Layer*>& layers);
  // The layers' inference forward on x. `residual` (empty: none) is added to the last layer's
  // output, inside its GEMM when it is a Linear layer that can fuse it; the result is then
  // owned by that layer, else by `sum` [rows, width], which must be given with a residual.
  MatrixView run(MatrixView x, const LayerPass& pass, ConstMatrixView residual = {},
                 MatrixView sum = {}) const;

 private:
  struct Step {
    Layer* layer = nullptr;
    Linear* linear = nullptr;  // the layer as a Linear that fuses (else nullptr)
    Activation activation = Activation::none;
  };
  std::vector<Step> steps_;
};

}  // namespace inference
}  // namespace meshtrain
