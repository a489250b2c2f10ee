// Predictor::jacobian against one plain forward (Predictor::predict) of the same rows (issue 40,
// "Measured"; bench/jacobian_speed.sh puts PyTorch beside it). The checkpoint's model, `--rows`
// global rows in one call (the batch), inputs drawn around the model's input statistics (the
// user's units); after one warm-up call of each, `--rounds` rounds of predict() then jacobian()
// in each mode asked for. One JSON line per mode on rank 0: the best and median seconds of each
// (the slowest rank's), their ratio, the directions per forward-mode pass and the process CPU
// seconds of the best round on rank 0.
//
//   OPENBLAS_NUM_THREADS=1 mpirun -np 1 build/bin/bench_jacobian CHECKPOINT --rows 10000 \
//       [--mode all|auto|forward|reverse] [--rounds 5] [--row-block N] [--set k=v ...]
// --row-block: reverse mode's rows per block (Predictor::set_jacobian_row_block; 0, the
// default: automatic; >= the local rows: one block).

#include <mpi.h>
#include <time.h>
#include <CLI/CLI.hpp>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "framework/comm/exit_policy.hpp"
#include "framework/core/gemm.hpp"
#include "run/predictor.hpp"

namespace {

double process_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Seconds of fn on the slowest rank (every rank starts together).
template <class F>
double timed(F fn) {
  MPI_Barrier(MPI_COMM_WORLD);
  const auto start = std::chrono::steady_clock::now();
  fn();
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  MPI_Allreduce(MPI_IN_PLACE, &seconds, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return seconds;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Predictor::jacobian against one forward of the same rows", "bench_jacobian"};
  std::string checkpoint, mode_name = "all";
  int64_t rows = 10000;
  int rounds = 5;
  int64_t row_block = 0;
  std::vector<std::string> overrides;
  app.add_option("checkpoint", checkpoint, "A checkpoint file or directory")->required();
  app.add_option("--rows", rows, "Global rows per call")->check(CLI::PositiveNumber);
  app.add_option("--mode", mode_name, "all, auto, forward or reverse");
  app.add_option("--rounds", rounds, "Timed rounds")->check(CLI::PositiveNumber);
  app.add_option("--row-block", row_block, "Reverse mode's rows per block (0: automatic)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--set", overrides, "Overrides (mesh, partition, ...)")->take_all();
  CLI11_PARSE(app, argc, argv);
  const auto runtime = meshtrain::start_runtime_or_abort(argc, argv);
  return meshtrain::run_or_abort([&] {
    using meshtrain::JacobianMode;
    int rank = 0, world = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    meshtrain::Predictor predictor(checkpoint, rows, overrides);
    predictor.set_jacobian_row_block(row_block);
    std::vector<JacobianMode> modes;
    if (mode_name == "all") {
      modes = {JacobianMode::forward, JacobianMode::reverse};
    } else {
      modes = {meshtrain::parse_jacobian_mode(mode_name, "--mode")};
    }

    // This rank's rows: mean + std * a smooth pseudo-random pattern, per input.
    const int64_t local = predictor.local_rows(), in = predictor.inputs();
    const int64_t out = predictor.outputs();
    const meshtrain::Normalization& n = predictor.normalization();
    Kokkos::View<float**, Kokkos::HostSpace> x("x", local, in);
    for (int64_t s = 0; s < local; ++s) {
      const double row = static_cast<double>(predictor.slice().begin() + s);
      for (int64_t c = 0; c < in; ++c) {
        const double z = std::sin(0.7071 * row + 1.37 * static_cast<double>(c) + 0.1 * row * c);
        x(s, c) = static_cast<float>(n.inputs() ? n.input_mean[c] + 1.5 * z * n.input_std[c] : z);
      }
    }
    Kokkos::View<float**, Kokkos::HostSpace> y("y", local, out);
    Kokkos::View<float***, Kokkos::HostSpace> J("J", local, out, in);
    predictor.predict(x, y);  // warm-up
    for (JacobianMode mode : modes) predictor.jacobian(x, J, mode);

    for (JacobianMode mode : modes) {
      std::vector<double> forward, jacobian;
      double best_forward_cpu = 0.0, best_jacobian_cpu = 0.0;
      for (int r = 0; r < rounds; ++r) {
        double cpu = process_cpu_seconds();
        forward.push_back(timed([&] { predictor.predict(x, y); }));
        cpu = process_cpu_seconds() - cpu;
        if (forward.back() <= *std::min_element(forward.begin(), forward.end())) {
          best_forward_cpu = cpu;
        }
        cpu = process_cpu_seconds();
        jacobian.push_back(timed([&] { predictor.jacobian(x, J, mode); }));
        cpu = process_cpu_seconds() - cpu;
        if (jacobian.back() <= *std::min_element(jacobian.begin(), jacobian.end())) {
          best_jacobian_cpu = cpu;
        }
      }
      const double best_j = *std::min_element(jacobian.begin(), jacobian.end());
      const double best_f = *std::min_element(forward.begin(), forward.end());
      if (rank != 0) continue;
      nlohmann::json line;
      line["bench"] = "meshtrain_jacobian";
      line["model"] = predictor.model_description();
      line["ranks"] = world;
      line["mesh"] = predictor.mesh().short_description();
      line["rows"] = predictor.batch_size();
      line["inputs"] = in;
      line["outputs"] = out;
      line["mode"] = meshtrain::to_string(mode);
      line["automatic_mode"] = meshtrain::to_string(predictor.jacobian_mode());
      line["directions_per_pass"] = predictor.jacobian_directions(mode);
      if (mode == JacobianMode::reverse) line["row_block"] = predictor.jacobian_row_block();
      line["gemm"] = meshtrain::gemm_kernels();
      line["rounds"] = rounds;
      line["jacobian_s"] = best_j;
      line["jacobian_median_s"] = median(jacobian);
      line["forward_s"] = best_f;
      line["forward_median_s"] = median(forward);
      line["jacobian_over_forward"] = best_j / best_f;
      line["jacobian_cpu_s"] = best_jacobian_cpu;
      line["forward_cpu_s"] = best_forward_cpu;
      if (mode == JacobianMode::reverse && predictor.jacobian_row_block() < local) {
        // The blocked pass against one block of every row: elements whose bits differ, and the
        // largest difference over the largest |J| (this rank's rows).
        Kokkos::View<float***, Kokkos::HostSpace> blocked("blocked", local, out, in);
        Kokkos::deep_copy(blocked, J);
        const int64_t block = predictor.jacobian_row_block();
        predictor.set_jacobian_row_block(local);
        predictor.jacobian(x, J, mode);
        predictor.set_jacobian_row_block(block);
        int64_t differing = 0;
        double largest = 0.0, diff = 0.0;
        for (size_t i = 0; i < J.size(); ++i) {
          const float a = blocked.data()[i], b = J.data()[i];
          differing += a != b;
          largest = std::max(largest, std::abs(static_cast<double>(b)));
          diff = std::max(diff, std::abs(static_cast<double>(a) - b));
        }
        line["blocked_elements_differing"] = differing;
        line["blocked_max_difference_over_max"] = largest > 0.0 ? diff / largest : 0.0;
      }
      std::printf("%s\n", line.dump().c_str());
      std::fflush(stdout);
    }
    return 0;
  });
}
