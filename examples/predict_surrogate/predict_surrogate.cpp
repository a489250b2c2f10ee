// A simulation that uses a trained meshtrain model as a surrogate inside its own time loop.
//
//   mpirun -np N predict_surrogate CHECKPOINT [STEPS]
//
// CHECKPOINT is a checkpoint file, a `latest` / `best` pointer or a checkpoint directory (for
// example the one examples/train_mlp writes). Each rank owns some cells, each with a state of
// the model's input width; every time step the model maps every cell's state to its outputs
// (one collective Predictor call per step, allocating nothing) and the state is advanced with
// them. The Predictor is built once, before the loop, on MPI_COMM_WORLD; its mesh is the
// checkpoint's when it fits the world (else dp over every rank), and each rank passes its own
// cells, at most predictor.local_rows() of them per call.

#include <meshtrain/framework/core/kokkos_math.hpp>  // meshtrain::kmath: sin, tanh, ... in kernels
#include <meshtrain/meshtrain.hpp>

#include <Kokkos_Core.hpp>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

int main(int argc, char** argv) {
  meshtrain::Runtime runtime(argc, argv);  // MPI and Kokkos, for the whole program
  const bool rank0 = runtime.world_rank() == 0;
  if (argc < 2 || argc > 3) {
    if (rank0) std::fprintf(stderr, "usage: mpirun -np N %s CHECKPOINT [STEPS]\n", argv[0]);
    return 2;
  }
  const int steps = argc == 3 ? std::atoi(argv[2]) : 20;
  try {
    meshtrain::Predictor surrogate(argv[1], /*batch_size=*/64);  // collective
    if (rank0) {
      for (const std::string& line : surrogate.describe()) std::printf("%s\n", line.c_str());
    }
    const int64_t cells = surrogate.local_rows();  // this rank's cells: one row each
    const int64_t width = surrogate.inputs(), outputs = surrogate.outputs();
    // The simulation's own arrays, in the default memory space (device memory on a GPU).
    Kokkos::View<float**> state("state", cells, width);
    Kokkos::View<float**> rates("rates", cells, outputs);
    const int rank = runtime.world_rank();
    Kokkos::parallel_for(
        "initial_state", Kokkos::MDRangePolicy<Kokkos::Rank<2>>({0, 0}, {cells, width}),
        KOKKOS_LAMBDA(const int64_t c, const int64_t j) {
          state(c, j) =
              static_cast<float>(meshtrain::kmath::sin(0.1 * (rank * cells + c) + 0.7 * j));
        });

    for (int step = 1; step <= steps; ++step) {
      surrogate.predict(state, rates);  // every rank, every step: it is collective
      // Advance each cell with the surrogate's outputs, kept bounded.
      Kokkos::parallel_for(
          "advance", Kokkos::MDRangePolicy<Kokkos::Rank<2>>({0, 0}, {cells, width}),
          KOKKOS_LAMBDA(const int64_t c, const int64_t j) {
            state(c, j) = static_cast<float>(
                meshtrain::kmath::tanh(state(c, j) + 0.05f * rates(c, j % outputs)));
          });
    }
    // A figure every rank agrees on: the mean |output| of the last step over all cells.
    double local = 0.0;
    Kokkos::parallel_reduce(
        "mean_rate", Kokkos::MDRangePolicy<Kokkos::Rank<2>>({0, 0}, {cells, outputs}),
        KOKKOS_LAMBDA(const int64_t c, const int64_t o, double& sum) {
          sum += meshtrain::kmath::fabs(rates(c, o));
        },
        local);
    double total = 0.0;
    MPI_Allreduce(&local, &total, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    const double mean = total / (static_cast<double>(cells) * outputs * runtime.world_size());
    if (!std::isfinite(mean)) {
      if (rank0) std::fprintf(stderr, "predict_surrogate: the outputs are not finite\n");
      return 1;
    }
    if (rank0) {
      std::printf("predict_surrogate: %d time steps of %lld cells per rank, mean |output| %.6f\n",
                  steps, static_cast<long long>(cells), mean);
    }
  } catch (const meshtrain::AgreedError& e) {
    // Every rank holds this error (a bad checkpoint, say): report it once, end normally.
    if (rank0) std::fprintf(stderr, "predict_surrogate: %s\n", e.what());
    return e.kind() == meshtrain::ErrorKind::bad_input ? 2 : 1;
  }
  return 0;
}
