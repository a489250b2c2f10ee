// `meshtrain predict` against the forward-only rate of its Predictor (issue 26, "Measured"):
// the same checkpoint, mesh and batch: predict_command over the input file (reading,
// predicting and writing an output beside it; set-up not counted), and Predictor::predict on
// in-memory batches, three rounds each, alternating. One JSON line on rank 0: the best rows/s
// of both, their ratio, and the CPU seconds each side's best round took on rank 0 (the
// process's, the predict side's reader thread included: on a shared machine CPU time shows
// what wall time alone cannot).
//
// The forward-only side does the work predict does minus reading and writing: as many
// Predictor::predict calls as predict makes batches, on this rank's rows of the input's first
// batches read into memory beforehand (up to 64 MiB per rank, used in turn), softmax and argmax
// included on both sides; its rate counts the input's rows over that time, as predict's does.
// The batches are real rows: a constant batch would make the activations' branches predictable
// and flatter the forward side.
//
//   mpirun -np 2 bench_predict CHECKPOINT --input FILE.h5 [--batch N] [--set k=v ...]

#include <mpi.h>
#include <time.h>
#include <CLI/CLI.hpp>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "apps/predict.hpp"
#include "framework/comm/exit_policy.hpp"
#include "framework/io/data.hpp"
#include "run/predictor.hpp"

namespace {

double process_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

}  // namespace

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
    meshtrain::Predictor predictor(checkpoint, batch, overrides);

    // This rank's rows of the input's first batches, in memory (read as predict reads them).
    meshtrain::Hdf5SourceOptions source_options;
    source_options.x_name = meshtrain::canonical_dataset_key(predictor.config().data.x_key);
    source_options.y_name = "";
    const auto source = meshtrain::open_hdf5_source({input}, 1, source_options);
    const int64_t total = source->shape().num_samples;
    const auto schedule = meshtrain::EvalSchedule::create(total, predictor.batch_size(), "--batch");
    const int64_t rows = predictor.local_rows(), width = predictor.inputs();
    const int64_t batch_bytes = std::max<int64_t>(1, rows * width * 4);
    const int64_t held = std::clamp<int64_t>((int64_t{64} << 20) / batch_bytes, 1,
                                             std::max<int64_t>(1, schedule.num_batches));
    meshtrain::Matrix::HostMirror batches("bench_batches", held * rows, width);
    std::vector<int64_t> samples(static_cast<size_t>(rows));
    for (int64_t b = 0; b < held; ++b) {
      const int64_t valid =
          b < schedule.num_batches
              ? meshtrain::eval_slice_samples(schedule, b, predictor.slice(), samples.data())
              : 0;
      if (valid > 0) source->read(samples.data(), valid, {&batches(b * rows, 0), nullptr, nullptr});
    }
    const auto batch_view = [&](int64_t b) {
      const int64_t first = (b % held) * rows;
      return Kokkos::subview(batches, std::make_pair(first, first + rows), Kokkos::ALL);
    };
    for (int64_t b = 0; b < std::min<int64_t>(held, 2); ++b) predictor.predict(batch_view(b));

    // Three rounds of both, alternating; the best rate of each (a shared machine's noise
    // only ever slows a round down).
    meshtrain::PredictSummary summary;
    options.summary = &summary;
    double best_predict = 0.0, best_forward = 0.0, predict_cpu = 0.0, forward_cpu = 0.0;
    for (int round = 0; round < 3; ++round) {
      double cpu = process_cpu_seconds();
      if (const int status = meshtrain::predict_command(options)) return status;
      cpu = process_cpu_seconds() - cpu;
      if (summary.rows / summary.seconds > best_predict) {
        best_predict = summary.rows / summary.seconds;
        predict_cpu = cpu;  // set-up included (a few ms)
      }
      MPI_Barrier(MPI_COMM_WORLD);
      cpu = process_cpu_seconds();
      const auto start = Clock::now();
      for (int64_t b = 0; b < schedule.num_batches; ++b) predictor.predict(batch_view(b));
      MPI_Barrier(MPI_COMM_WORLD);
      const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
      cpu = process_cpu_seconds() - cpu;
      if (total / seconds > best_forward) {
        best_forward = total / seconds;
        forward_cpu = cpu;
      }
    }
    if (rank == 0) std::remove(options.output.c_str());

    if (rank == 0) {
      int world = 1;
      MPI_Comm_size(MPI_COMM_WORLD, &world);
      nlohmann::json line = {{"bench", "predict"},
                             {"world", world},
                             {"mesh", predictor.mesh().short_description()},
                             {"model", predictor.model_description()},
                             {"batch", batch},
                             {"rows", total},
                             {"batches_in_memory", held},
                             {"forward_rows_per_s", best_forward},
                             {"predict_rows_per_s", best_predict},
                             {"predict_over_forward", best_predict / best_forward},
                             {"forward_cpu_s", forward_cpu},
                             {"predict_cpu_s", predict_cpu}};
      std::printf("%s\n", line.dump().c_str());
    }
    return 0;
  });
}
