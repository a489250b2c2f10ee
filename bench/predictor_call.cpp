// One Predictor::predict call on a fixed block of rows, timed as a user's time loop sees it
// (issue 37 item 7; bench/predictor_vs_onnxruntime.sh puts ONNX Runtime and PyTorch beside
// it on the same rows). The checkpoint's model on one rank, `--rows` rows read from a raw
// float32 file (row-major, the model's input width; the same file the other runtimes read),
// one warm-up call, then `--calls` calls of predict(x, y) with x and y in host memory. One
// JSON line: the best and the median milliseconds per call, and the process CPU milliseconds
// per call (a shared machine's wall time includes others' work; its CPU time does not).
//
//   OPENBLAS_NUM_THREADS=1 build/bin/bench_predictor_call CHECKPOINT --input ROWS.f32 \
//       [--rows 1000] [--calls 200] [--output OUT.f32] [--set k=v ...]
//
// --output writes the last call's outputs (float32, row-major) for the comparison of results.

#include <mpi.h>
#include <time.h>
#include <CLI/CLI.hpp>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "base/error.hpp"
#include "framework/comm/exit_policy.hpp"
#include "framework/core/gemm.hpp"
#include "run/predictor.hpp"

namespace {

double process_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Predictor::predict, one call on a block of rows, timed", "bench_predictor_call"};
  std::string checkpoint, input, output;
  int64_t rows = 1000;
  int calls = 200;
  std::vector<std::string> overrides;
  app.add_option("checkpoint", checkpoint, "A checkpoint file or directory")->required();
  app.add_option("--input", input, "Raw float32 rows [rows, inputs], row-major")->required();
  app.add_option("--rows", rows, "Rows per call")->check(CLI::PositiveNumber);
  app.add_option("--calls", calls, "Timed calls")->check(CLI::PositiveNumber);
  app.add_option("--output", output, "Write the last call's outputs here (raw float32)");
  app.add_option("--set", overrides, "Overrides (runtime, mixed_precision, ...)")->take_all();
  CLI11_PARSE(app, argc, argv);
  const auto runtime = meshtrain::start_runtime_or_abort(argc, argv);
  return meshtrain::run_or_abort([&] {
    int world = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    if (world != 1) MESHTRAIN_BAD_INPUT("bench_predictor_call runs on one rank, not ", world);
    meshtrain::Predictor predictor(checkpoint, rows, overrides);
    const int64_t width = predictor.inputs();

    using HostMatrix = Kokkos::View<float**, Kokkos::LayoutRight, Kokkos::HostSpace>;
    HostMatrix x("bench_x", rows, width), y("bench_y", rows, predictor.outputs());
    std::ifstream in(input, std::ios::binary);
    in.read(reinterpret_cast<char*>(x.data()), static_cast<std::streamsize>(x.size() * 4));
    if (!in || in.gcount() != static_cast<std::streamsize>(x.size() * 4)) {
      MESHTRAIN_BAD_INPUT("input '", input, "' holds fewer than ", rows, " rows of ", width,
                          " float32 values");
    }

    predictor.predict(x, y);  // warm-up
    std::vector<double> ms(static_cast<size_t>(calls));
    const double cpu_start = process_cpu_seconds();
    for (int c = 0; c < calls; ++c) {
      const auto start = std::chrono::steady_clock::now();
      predictor.predict(x, y);
      ms[c] = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                  .count();
    }
    const double cpu_ms = 1e3 * (process_cpu_seconds() - cpu_start) / calls;
    std::sort(ms.begin(), ms.end());

    if (!output.empty()) {
      std::ofstream out(output, std::ios::binary);
      out.write(reinterpret_cast<const char*>(y.data()),
                static_cast<std::streamsize>(y.size() * 4));
      if (!out) MESHTRAIN_FAIL("cannot write '", output, "'");
    }
    nlohmann::json line = {{"bench", "predictor_call"},
                           {"runtime", "meshtrain"},
                           {"model", predictor.model_description()},
                           {"rows", rows},
                           {"calls", calls},
                           {"gemm", meshtrain::inference_gemm_kernels()},
                           {"best_ms", ms.front()},
                           {"median_ms", ms[ms.size() / 2]},
                           {"cpu_ms_per_call", cpu_ms}};
    std::printf("%s\n", line.dump().c_str());
    return 0;
  });
}
