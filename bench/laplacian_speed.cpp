// A training step with a physics loss (the forward Laplacian, docs/derivatives.md "Physics
// losses") against a plain training step of the same model and batch (issue 40 item 2b,
// "Measured"; bench/laplacian_speed.sh puts PyTorch's double backward beside it). One rank:
// an mlp of `--inputs` inputs (2: a 2-D PDE), `--depth` hidden layers of `--width` (tanh), one
// output, `--rows` collocation points; the plain step is forward, mse and backward; the physics
// step is forward, the forward Laplacian over every input, a Poisson-like residual
// r = sum_i d2u/dx_i^2 - u (its value and seeds in a Kokkos kernel) and the backward through
// both. Each timed over `--steps` steps (no optimizer: the same weights every step), best of
// `--rounds`. One JSON line.
//
//   OPENBLAS_NUM_THREADS=1 build/bin/bench_laplacian --rows 4096 --width 64 --depth 3

#include <mpi.h>
#include <CLI/CLI.hpp>

#include <time.h>
#include <Kokkos_Core.hpp>
#include <algorithm>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <vector>

#include "framework/comm/exit_policy.hpp"
#include "framework/comm/mesh_communicators.hpp"
#include "framework/train/init.hpp"
#include "layers/context.hpp"
#include "layers/loss.hpp"
#include "layers/mlp.hpp"
#include "layers/physics_loss.hpp"

namespace {

double thread_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// Seconds per step of the best round, and in *cpu the calling thread's CPU seconds per step of
// that round (one core, one BLAS thread: the work is on this thread; other processes' load
// moves it less than wall time).
template <class F>
double best_seconds(int rounds, int steps, F step, double* cpu) {
  double best = 1e30;
  for (int round = 0; round < rounds; ++round) {
    Kokkos::fence();
    const double start_cpu = thread_cpu_seconds();
    const auto start = std::chrono::steady_clock::now();
    for (int s = 0; s < steps; ++s) step();
    Kokkos::fence();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (seconds < best) {
      best = seconds;
      *cpu = (thread_cpu_seconds() - start_cpu) / steps;
    }
  }
  return best / steps;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"A physics-loss step against a plain step", "bench_laplacian"};
  int64_t rows = 4096, inputs = 2, width = 64, depth = 3;
  int steps = 20, rounds = 5;
  app.add_option("--rows", rows, "Collocation points per step")->check(CLI::PositiveNumber);
  app.add_option("--inputs", inputs, "Inputs (all differentiated)")->check(CLI::PositiveNumber);
  app.add_option("--width", width, "Hidden width")->check(CLI::PositiveNumber);
  app.add_option("--depth", depth, "Hidden layers")->check(CLI::PositiveNumber);
  app.add_option("--steps", steps, "Steps per round")->check(CLI::PositiveNumber);
  app.add_option("--rounds", rounds, "Rounds")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  const auto runtime = meshtrain::start_runtime_or_abort(argc, argv);
  return meshtrain::run_or_abort([&] {
    using namespace meshtrain;
    const Mesh mesh = Mesh::create({{"dp", 1}}, 1);
    MeshCommunicators comms(mesh, MPI_COMM_SELF, CommunicatorFactory{});
    ParallelContext context(comms, {"dp"}, "tp", CollectiveMatmulAlgorithm::bidirectional, false,
                            25.0);
    const SpecLookup replicated = [](const std::string&) { return PartitionSpec(); };
    std::vector<int64_t> sizes = {inputs};
    for (int64_t l = 0; l < depth; ++l) sizes.push_back(width);
    sizes.push_back(1);
    Mlp model(sizes, Activation::tanh, replicated, context, rows);
    model.initialize(InitScheme::he_normal, 1);
    Loss loss(LossKind::mse, context, rows, 1, model.output_layout());
    std::vector<int64_t> all(static_cast<size_t>(inputs));
    for (int64_t i = 0; i < inputs; ++i) all[static_cast<size_t>(i)] = i;
    const int64_t k = inputs;
    PhysicsLossSettings settings;
    settings.inputs = all;
    settings.residual = [k](const PhysicsPoints& p, const PhysicsResiduals& q) {
      const MatrixView u = p.u, d2u = p.d2u, r = q.r, dr_du = q.dr_du, dr_dd2u = q.dr_dd2u;
      Kokkos::parallel_for(
          "bench_residual", Kokkos::RangePolicy<>(0, static_cast<int64_t>(u.extent(0))),
          KOKKOS_LAMBDA(const int64_t i) {
            float sum = -u(i, 0);
            for (int64_t d = 0; d < k; ++d) {
              sum += d2u(i, d);
              dr_dd2u(i, d) = 1.0f;
            }
            r(i, 0) = sum;
            dr_du(i, 0) = -1.0f;
          });
    };
    PhysicsLoss physics(settings, context, rows, inputs, 1, model.output_layout());
    model.reserve_laplacian(k);
    Matrix x("x", rows, inputs), t("t", rows, 1);
    auto xh = Kokkos::create_mirror_view(x);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < inputs; ++i)
        xh(r, i) = static_cast<float>(std::sin(0.37 * static_cast<double>(r * inputs + i)));
    Kokkos::deep_copy(x, xh);

    auto plain = [&] {
      const MatrixView y = model.forward(x);
      loss.regression(y, t);
      model.backward(loss.gradient());
    };
    auto with_physics = [&] {
      const MatrixView y = model.forward(x);
      physics.evaluate(x, y, model.forward_laplacian(physics.seeds()));
      model.backward_with_laplacian(physics.output_gradient(), physics.stream_gradient());
    };
    plain();
    with_physics();
    double plain_cpu = 0.0, physics_cpu = 0.0;
    const double plain_s = best_seconds(rounds, steps, plain, &plain_cpu);
    const double physics_s = best_seconds(rounds, steps, with_physics, &physics_cpu);
    nlohmann::json line = {{"bench", "laplacian_step"},
                           {"rows", rows},
                           {"inputs", inputs},
                           {"width", width},
                           {"depth", depth},
                           {"plain_step_s", plain_s},
                           {"physics_step_s", physics_s},
                           {"ratio", physics_s / plain_s},
                           {"plain_step_cpu_s", plain_cpu},
                           {"physics_step_cpu_s", physics_cpu}};
    std::printf("%s\n", line.dump().c_str());
    return 0;
  });
}
