// `meshtrain predict` against the forward-only rate of its Predictor (issue 26, "Measured"):
// the same checkpoint, mesh and batch: predict_command over the input file (reading,
// predicting and writing an output beside it; set-up not counted), and Predictor::predict on
// an in-memory batch repeated (as many rows as the input has, at least 20 batches), three
// rounds each, alternating. One JSON line on rank 0: the best rows/s of both and their ratio.
//
//   mpirun -np 2 bench_predict CHECKPOINT --input FILE.h5 [--batch N] [--set k=v ...]

#include <CLI/CLI.hpp>
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "apps/predict.hpp"
#include "framework/comm/exit_policy.hpp"
#include "run/predictor.hpp"

int main(int argc, char** argv) {
  CLI::App app{"meshtrain predict against its forward-only rate", "bench_predict"};
  std::string checkpoint, input;
  int64_t batch = 256;
  std::vector<std::string> overrides;
  app.add_option("checkpoint", checkpoint, "A checkpoint file or directory")->required();
  app.add_option("--input", input, "An HDF5 input file")->required();
  app.add_option("--batch", batch, "Global rows per batch")->check(CLI::PositiveNumber);
  app.add_option("--set", overrides, "Overrides (mesh, partition, ...)")->take_all();
  CLI11_PARSE(app, argc, argv);
  const auto runtime = meshtrain::start_runtime_or_abort(argc, argv);
  return meshtrain::run_or_abort([&] {
    using Clock = std::chrono::steady_clock;
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);

    meshtrain::PredictOptions options;
    options.checkpoint = checkpoint;
    options.inputs = {input};
    options.output = input + ".bench-predictions.h5";
    options.overwrite = true;
    options.overrides = overrides;
    options.batch_size = batch;
    options.progress_seconds = 1e9;
    // Three rounds of both, alternating; the best rate of each (a shared machine's noise
    // only ever slows a round down).
    meshtrain::Predictor predictor(checkpoint, batch, overrides);
    meshtrain::Matrix x("x", predictor.local_rows(), predictor.inputs());
    Kokkos::deep_copy(x, 0.25f);
    for (int i = 0; i < 2; ++i) predictor.predict(x);  // warm-up
    meshtrain::PredictSummary summary;
    options.summary = &summary;
    double best_predict = 0.0, best_forward = 0.0;
    int64_t calls = 0;
    for (int round = 0; round < 3; ++round) {
      if (const int status = meshtrain::predict_command(options)) return status;
      best_predict = std::max(best_predict, summary.rows / summary.seconds);
      calls = std::max<int64_t>(20, (summary.rows + batch - 1) / batch);
      MPI_Barrier(MPI_COMM_WORLD);
      const auto start = Clock::now();
      for (int64_t i = 0; i < calls; ++i) predictor.predict(x);
      MPI_Barrier(MPI_COMM_WORLD);
      const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
      best_forward = std::max(best_forward, calls * batch / seconds);
    }
    if (rank == 0) std::remove(options.output.c_str());

    const double forward_rate = best_forward;
    const double predict_rate = best_predict;
    if (rank == 0) {
      int world = 1;
      MPI_Comm_size(MPI_COMM_WORLD, &world);
      nlohmann::json line = {{"bench", "predict"},
                             {"world", world},
                             {"mesh", predictor.mesh().short_description()},
                             {"model", predictor.model_description()},
                             {"batch", batch},
                             {"rows", summary.rows},
                             {"forward_rows_per_s", forward_rate},
                             {"predict_rows_per_s", predict_rate},
                             {"predict_over_forward", predict_rate / forward_rate}};
      std::printf("%s\n", line.dump().c_str());
    }
    return 0;
  });
}
