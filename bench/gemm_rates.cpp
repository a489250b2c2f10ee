// GFLOP/s of gemm() per host library, kernel, input dtype, shape and epilogue, one JSON line
// each, then one summary line of ratios to OpenBLAS's fp32 sgemm:
//
//   source scripts/env.sh   # one thread: OMP_NUM_THREADS=1, OPENBLAS_NUM_THREADS=1
//   build/bin/bench_gemm_rates --shapes 256x4096x4096 --rounds 7
//
// Shapes are M x K x N (C [M, N] = A [M, K] @ B [K, N]). Paths: openblas (cblas_sgemm, then
// gemm()'s epilogue pass), onednn (fp32 matmul with post-ops), and for bf16 inputs onednn with
// the kernel gemm() picks on this CPU ("automatic") on fp32 buffers holding bf16 values and on
// 16-bit operands (gemm.hpp: read as stored by the bf16 matmul, widened for an fp32 kernel), and
// the bf16 kernel forced where oneDNN only emulates it. Epilogues: none, bias+relu and bias+gelu
// forward, the relu backward with its bias gradient; and the other two products of a layer's
// backward without an epilogue: weight_grad (Xᵀ @ dY, A transposed: the step's weight gradient,
// whose K is the batch) and input_grad (dY @ Wᵀ). The calls of all paths alternate round by
// round (a loaded machine slows them alike); each line has the median over the rounds of
// wall-clock and thread-CPU time, as GFLOP/s (2 M K N per call), the ratio to OpenBLAS fp32
// on the same shape and epilogue, and the oneDNN primitive the timed calls ran ("primitive":
// fixed_shape, runtime, or none off oneDNN). gemm() picks that primitive from the call alone
// (gemm_onednn.cpp, primitive_for), so the order of --shapes does not change a line's kernel.

#include <CLI/CLI.hpp>
#include <Kokkos_Core.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "framework/core/backends/gemm_backend.hpp"
#include "framework/core/gemm.hpp"
#include "framework/core/precision.hpp"
#include "framework/core/views.hpp"

namespace {

using meshtrain::Activation;
using meshtrain::Dtype;
using meshtrain::GemmEpilogue;
using meshtrain::Matrix;
using meshtrain::Vector;
using meshtrain::gemm_backend::Bf16Kernel;
using meshtrain::gemm_backend::HostLibrary;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double thread_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

struct Shape {
  int64_t m, k, n;
};

std::vector<Shape> parse_shapes(const std::string& text) {
  std::vector<Shape> shapes;
  std::stringstream list(text);
  std::string item;
  while (std::getline(list, item, ',')) {
    Shape s{};
    if (std::sscanf(item.c_str(), "%ldx%ldx%ld", &s.m, &s.k, &s.n) != 3 || s.m <= 0 || s.k <= 0 ||
        s.n <= 0) {
      throw CLI::ValidationError("--shapes", "'" + item + "' is not MxKxN with positive sizes");
    }
    shapes.push_back(s);
  }
  return shapes;
}

struct Path {
  std::string library, kernel;
  HostLibrary host;
  Bf16Kernel bf16_kernel;
  Dtype dtype;
  bool sixteen_bit_operands = false;  // A and B as 16-bit buffers (gemm.hpp's 16-bit operands)
};

struct Epilogue {
  std::string name;
  bool backward;
  Activation activation;
  bool transpose_a = false;     // weight_grad: A stored [K, M], as a layer's Xᵀ @ dY
  bool plain_backward = false;  // input_grad: the backward's dY @ Wᵀ without an epilogue
};

// Values in [-1, 1] rounded to `dtype`.
Matrix random_matrix(const char* label, int64_t rows, int64_t cols, Dtype dtype, unsigned seed) {
  Matrix m(std::string(label), rows, cols);
  auto host = Kokkos::create_mirror_view(m);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) host(i, j) = meshtrain::round_to(uniform(rng), dtype);
  Kokkos::deep_copy(m, host);
  return m;
}

}  // namespace

// oneDNN's execution counters (gemm_backend.hpp); zero without oneDNN.
int64_t onednn_executions() {
#if defined(MESHTRAIN_GEMM_ONEDNN)
  return meshtrain::gemm_backend::onednn_executions();
#else
  return 0;
#endif
}
int64_t onednn_fixed_shape_executions() {
#if defined(MESHTRAIN_GEMM_ONEDNN)
  return meshtrain::gemm_backend::onednn_fixed_shape_executions();
#else
  return 0;
#endif
}

int main(int argc, char** argv) {
  CLI::App app{"gemm() GFLOP/s per host library, kernel, dtype, shape and epilogue"};
  std::string shapes_text = "256x4096x4096";
  int rounds = 7;
  std::string epilogues_text = "none,bias_relu,bias_gelu,relu_backward,weight_grad,input_grad";
  app.add_option("--shapes", shapes_text, "MxKxN,... (C [M, N] = A [M, K] @ B [K, N])");
  app.add_option("--rounds", rounds, "timed calls per path (after one warm-up call)")
      ->check(CLI::PositiveNumber);
  app.add_option("--epilogues", epilogues_text,
                 "of none, bias_relu, bias_gelu, relu_backward, weight_grad (C = Aᵀ @ B, A stored "
                 "[K, M]: a layer's Xᵀ @ dY), input_grad (dX [M, K] = dY [M, N] @ Wᵀ, W [K, N], no "
                 "epilogue: a layer's dY @ Wᵀ) (comma-separated)");
  CLI11_PARSE(app, argc, argv);
  std::vector<Shape> shapes;
  try {
    shapes = parse_shapes(shapes_text);
  } catch (const CLI::Error& e) {
    return app.exit(e);
  }
  std::vector<Epilogue> epilogues;
  {
    std::stringstream list(epilogues_text);
    std::string item;
    while (std::getline(list, item, ',')) {
      if (item == "none") {
        epilogues.push_back({item, false, Activation::none});
      } else if (item == "bias_relu") {
        epilogues.push_back({item, false, Activation::relu});
      } else if (item == "bias_gelu") {
        epilogues.push_back({item, false, Activation::gelu});
      } else if (item == "relu_backward") {
        epilogues.push_back({item, true, Activation::relu});
      } else if (item == "weight_grad") {
        epilogues.push_back({item, false, Activation::none, true});
      } else if (item == "input_grad") {
        epilogues.push_back({item, false, Activation::none, false, true});
      } else {
        std::cerr << "--epilogues: '" << item
                  << "' is not one of none, bias_relu, bias_gelu, relu_backward, weight_grad, "
                     "input_grad\n";
        return 2;
      }
    }
  }

  Kokkos::ScopeGuard kokkos(argc, argv);
  if (meshtrain::kDeviceMemoryIsHostInaccessible) {
    std::cerr << "bench_gemm_rates compares host libraries; this build multiplies on a GPU\n";
    return 2;
  }
  std::vector<Path> paths{
      {"openblas", "sgemm", HostLibrary::openblas, Bf16Kernel::automatic, Dtype::fp32}};
#if defined(MESHTRAIN_GEMM_ONEDNN)
  paths.push_back({"onednn", "fp32", HostLibrary::onednn, Bf16Kernel::automatic, Dtype::fp32});
  paths.push_back({"onednn", meshtrain::gemm_backend::onednn_has_native_bf16() ? "bf16" : "fp32",
                   HostLibrary::onednn, Bf16Kernel::automatic, Dtype::bf16});
  paths.push_back({"onednn",
                   meshtrain::gemm_backend::onednn_has_native_bf16()
                       ? "bf16, 16-bit operands"
                       : "fp32, 16-bit operands widened",
                   HostLibrary::onednn, Bf16Kernel::automatic, Dtype::bf16, true});
  if (meshtrain::gemm_backend::onednn_has_bf16_matmul() &&
      !meshtrain::gemm_backend::onednn_has_native_bf16()) {
    paths.push_back(
        {"onednn", "bf16 (forced)", HostLibrary::onednn, Bf16Kernel::bf16, Dtype::bf16});
  }
#endif
  paths.push_back({"openblas", "sgemm", HostLibrary::openblas, Bf16Kernel::automatic, Dtype::bf16});

  nlohmann::json summary;
  summary["bench"] = "gemm_rates_summary";
  summary["kernels"] = meshtrain::gemm_kernels();
  for (const Shape& s : shapes) {
    for (const Epilogue& epilogue : epilogues) {
      const bool backward_shape = epilogue.backward || epilogue.plain_backward;
      const int64_t c_cols = backward_shape ? s.k : s.n;
      std::vector<std::vector<double>> wall(paths.size()), cpu(paths.size());
      // oneDNN executions of each path's timed calls, all and on a fixed-shape primitive.
      std::vector<int64_t> executions(paths.size(), 0), fixed_executions(paths.size(), 0);
      std::vector<Matrix> a_of(paths.size()), b_of(paths.size());
      std::vector<meshtrain::HalfMatrix> a16_of(paths.size()), b16_of(paths.size());
      for (std::size_t p = 0; p < paths.size(); ++p) {
        // forward: C [M, N] = A [M, K] @ B [K, N]; backward: dX [M, K] = dY [M, N] @ Wᵀ, W [K, N]
        a_of[p] = epilogue.transpose_a
                      ? random_matrix("a", s.k, s.m, paths[p].dtype, 1)
                      : random_matrix("a", s.m, backward_shape ? s.n : s.k, paths[p].dtype, 1);
        b_of[p] = random_matrix("b", s.k, s.n, paths[p].dtype, 2);
        if (paths[p].sixteen_bit_operands) {
          a16_of[p] = meshtrain::HalfMatrix("a16", a_of[p].extent(0), a_of[p].extent(1));
          b16_of[p] = meshtrain::HalfMatrix("b16", b_of[p].extent(0), b_of[p].extent(1));
          meshtrain::pack_16bit(a_of[p].data(), a16_of[p].data(), a_of[p].size(), paths[p].dtype);
          meshtrain::pack_16bit(b_of[p].data(), b16_of[p].data(), b_of[p].size(), paths[p].dtype);
          Kokkos::fence();
        }
      }
      Matrix c("c", s.m, c_cols);
      const Matrix z = random_matrix("z", s.m, c_cols, Dtype::fp32, 3);
      Vector bias("bias", c_cols), bias_gradient("bias_gradient", c_cols);
      Kokkos::deep_copy(bias, 0.125f);
      const auto call = [&](std::size_t p) {
        const GemmEpilogue e = epilogue.backward
                                   ? GemmEpilogue::backward(epilogue.activation, z, bias_gradient)
                               : epilogue.activation == Activation::none
                                   ? GemmEpilogue()
                                   : GemmEpilogue::forward(bias, epilogue.activation);
        meshtrain::GemmOperand a = paths[p].sixteen_bit_operands
                                       ? meshtrain::plain(meshtrain::ConstHalfMatrixView(a16_of[p]))
                                       : meshtrain::plain(a_of[p]);
        meshtrain::GemmOperand b = paths[p].sixteen_bit_operands
                                       ? meshtrain::plain(meshtrain::ConstHalfMatrixView(b16_of[p]))
                                       : meshtrain::plain(b_of[p]);
        a.transpose = epilogue.transpose_a;
        b.transpose = backward_shape;
        meshtrain::gemm(a, b, 0.0f, c, paths[p].dtype, e);
        Kokkos::fence();
      };
      for (int round = -1; round < rounds; ++round) {  // round -1 warms every path up
        for (std::size_t p = 0; p < paths.size(); ++p) {
          meshtrain::gemm_backend::select_host_library(paths[p].host, paths[p].bf16_kernel);
          const int64_t executed = onednn_executions(), fixed = onednn_fixed_shape_executions();
          const double start = wall_seconds(), cpu_start = thread_cpu_seconds();
          call(p);
          if (round >= 0) {
            wall[p].push_back(wall_seconds() - start);
            cpu[p].push_back(thread_cpu_seconds() - cpu_start);
            executions[p] += onednn_executions() - executed;
            fixed_executions[p] += onednn_fixed_shape_executions() - fixed;
          }
        }
      }
      meshtrain::gemm_backend::select_host_library(meshtrain::gemm_backend::default_host_library());
      const double flops = 2.0 * static_cast<double>(s.m) * s.k * s.n;
      const double reference = flops / median(cpu[0]) * 1e-9;  // openblas fp32, CPU time
      for (std::size_t p = 0; p < paths.size(); ++p) {
        nlohmann::json line;
        line["bench"] = "gemm_rates";
        line["library"] = paths[p].library;
        line["kernel"] = paths[p].kernel;
        // oneDNN's primitive: made for the call's whole shape or with runtime M, K and strides
        // (gemm_onednn.cpp, primitive_for); none where oneDNN did not run.
        line["primitive"] = executions[p] == 0                     ? "none"
                            : fixed_executions[p] == executions[p] ? "fixed_shape"
                            : fixed_executions[p] == 0             ? "runtime"
                                                                   : "both";
        line["inputs"] = meshtrain::to_string(paths[p].dtype);
        line["m"] = s.m;
        line["k"] = s.k;
        line["n"] = s.n;
        line["epilogue"] = epilogue.name;
        line["rounds"] = rounds;
        line["gflops_wall"] = flops / median(wall[p]) * 1e-9;
        line["gflops_cpu"] = flops / median(cpu[p]) * 1e-9;
        line["over_openblas_fp32_cpu"] = line["gflops_cpu"].get<double>() / reference;
        std::cout << line.dump() << std::endl;
        summary[std::to_string(s.m) + "x" + std::to_string(s.k) + "x" + std::to_string(s.n) + " " +
                epilogue.name + " " + paths[p].library + " " + paths[p].kernel + " " +
                meshtrain::to_string(paths[p].dtype)] = line["over_openblas_fp32_cpu"];
      }
    }
  }
  std::cout << summary.dump() << std::endl;
  return 0;
}
