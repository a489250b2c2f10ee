// A Kokkos simulation that trains its own surrogate while it runs and then uses it
// (docs/online.md, "examples/online_heat"):
//
//   mpirun -np 2 ./online_heat : -np 1 meshtrain train examples/online_heat/online.toml
//
// The simulation is 2-D heat conduction with a varying conductivity, u_t = div(k(x, y) grad u),
// on the periodic unit square, explicit in time on a 32 x 32 grid whose rows are split over the
// simulation's ranks (a halo row exchanged with each neighbour every step). The surrogate is
// the flux divergence of one cell, the part of the update a costlier physics would spend its
// time on:
//   inputs  (u_E - u_C, u_W - u_C, u_N - u_C, u_S - u_C, k_E, k_W, k_N, k_S)  (k at the faces)
//   target  k_E (u_E - u_C) + k_W (u_W - u_C) + k_N (u_N - u_C) + k_S (u_S - u_C)
// and the update is u_C += dt / h^2 x target.
//
// Phase 1 (learning): every step each rank sends one row per cell to stream "heat-2d" and calls
// LiveModel::refresh(); whenever a newer model came, its error on that step's rows (relative
// RMS of the divergence over every rank) is measured, and once it is under kTrustTolerance the
// model is trusted. The field restarts from a new random smooth state every kRestartEvery steps,
// so the rows cover more than one decay.
// Phase 2 (using it): from a new state, a hybrid field takes every other step's update from the
// LiveModel (the steps between from the stencil) beside a reference field that the full solver
// advances alone, for kRestartEvery steps; the program reports the hybrid field's relative L2
// error against the reference and exits 0 when it is under kFieldTolerance (1 when not, or
// when no model was trusted within kMaxLearningSteps steps). The reference keeps streaming.
//
// Under MPMD the program takes its part of MPI_COMM_WORLD by MPI_APPNUM (the split is collective
// over the whole job, and `meshtrain train` makes the same call). It needs no argument;
// `online_heat bench STEPS` times the producer's overhead instead (bench/online_overhead.sh).

#include <meshtrain/meshtrain.hpp>
#include <meshtrain/stream.hpp>

#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

namespace {

constexpr int kInputs = 8, kOutputs = 1;
constexpr int kGlobalCells = 32;          // the grid is kGlobalCells x kGlobalCells
constexpr int kRestartEvery = 100;        // steps between new random states
constexpr int kMaxLearningSteps = 60000;  // phase 1 gives up after this many steps
constexpr double kTrustTolerance = 0.05;  // the model's relative RMS error to be used
constexpr double kFieldTolerance = 0.02;  // the hybrid field's relative L2 error to pass
constexpr double kPi = 3.14159265358979323846;
constexpr double kMaxConductivity = 1.5;
constexpr double kCourant = 0.2 / kMaxConductivity;  // dt / h^2, under the explicit limit 1/4k

using Host = Kokkos::DefaultHostExecutionSpace;
// Host memory: the halo rows go straight to MPI, and the rows to the stream.
using Field = Kokkos::View<double**, Kokkos::LayoutRight, Kokkos::HostSpace>;

double conductivity(double x, double y) {
  return 1.0 + 0.5 * std::sin(2.0 * kPi * x) * std::cos(2.0 * kPi * y);
}

// This rank's rows of the grid: field rows 1 .. rows, rows 0 and rows + 1 the halo.
struct Slab {
  int rows = 0, first_row = 0;
  int below = 0, above = 0;  // the neighbouring ranks (periodic)
  MPI_Comm comm = MPI_COMM_NULL;
  int cells() const { return rows * kGlobalCells; }
};

Field make_field(const char* name, const Slab& slab) {
  return Field(std::string(name), static_cast<size_t>(slab.rows + 2),
               static_cast<size_t>(kGlobalCells));
}

// The wave numbers (x, y) of the initial states' modes: low, so that a state decays by about
// half over kRestartEvery steps (the rows then span a modest range of scales).
constexpr int kModes[3][2] = {{1, 0}, {0, 1}, {1, 1}};

// Three smooth modes with amplitudes and phases from a small LCG seeded by `restart`, the same
// on every rank.
void initial_state(const Field& u, const Slab& slab, int restart) {
  uint64_t state = 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(restart + 1);
  const auto uniform = [&state] {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<double>(state >> 11) / 9007199254740992.0;
  };
  double amplitude[3], phase_x[3], phase_y[3];
  for (int m = 0; m < 3; ++m) {
    amplitude[m] = uniform() - 0.5;
    phase_x[m] = 2.0 * kPi * uniform();
    phase_y[m] = 2.0 * kPi * uniform();
  }
  const double h = 1.0 / kGlobalCells;
  const int first = slab.first_row;
  Kokkos::parallel_for("initial_state", Kokkos::RangePolicy<Host>(0, slab.cells()), [=](int cell) {
    const int j = cell / kGlobalCells, i = cell % kGlobalCells;
    const double x = (i + 0.5) * h, y = (first + j + 0.5) * h;
    double value = 0.0;
    for (int m = 0; m < 3; ++m)
      value += amplitude[m] * std::sin(2.0 * kPi * kModes[m][0] * x + phase_x[m]) *
               std::cos(2.0 * kPi * kModes[m][1] * y + phase_y[m]);
    u(j + 1, i) = value;
  });
  Kokkos::fence();
}

void exchange_halo(const Field& u, const Slab& slab) {
  // my first row goes below, my last above; each row is contiguous (LayoutRight)
  MPI_Sendrecv(&u(1, 0), kGlobalCells, MPI_DOUBLE, slab.below, 0, &u(slab.rows + 1, 0),
               kGlobalCells, MPI_DOUBLE, slab.above, 0, slab.comm, MPI_STATUS_IGNORE);
  MPI_Sendrecv(&u(slab.rows, 0), kGlobalCells, MPI_DOUBLE, slab.above, 1, &u(0, 0), kGlobalCells,
               MPI_DOUBLE, slab.below, 1, slab.comm, MPI_STATUS_IGNORE);
}

// One row per cell: the stencil's differences and face conductivities (inputs) and the flux
// divergence (target). `k_east(r, i)`: the face east of cell (r, i); `k_north(r, i)`: the face
// between field rows r and r + 1 (r = 0 .. rows).
void make_rows(const Field& u, const Field& k_east, const Field& k_north, const Slab& slab,
               const Field& x, const Field& divergence) {
  Kokkos::parallel_for("make_rows", Kokkos::RangePolicy<Host>(0, slab.cells()), [=](int cell) {
    const int r = cell / kGlobalCells + 1, i = cell % kGlobalCells;
    const int east = (i + 1) % kGlobalCells, west = (i + kGlobalCells - 1) % kGlobalCells;
    const double centre = u(r, i);
    const double d[4] = {u(r, east) - centre, u(r, west) - centre, u(r + 1, i) - centre,
                         u(r - 1, i) - centre};
    const double k[4] = {k_east(r - 1, i), k_east(r - 1, west), k_north(r, i), k_north(r - 1, i)};
    double sum = 0.0;
    for (int f = 0; f < 4; ++f) {
      x(cell, f) = d[f];
      x(cell, 4 + f) = k[f];
      sum += k[f] * d[f];
    }
    divergence(cell, 0) = sum;
  });
  Kokkos::fence();
}

void advance(const Field& u, const Field& divergence, const Slab& slab) {
  Kokkos::parallel_for("advance", Kokkos::RangePolicy<Host>(0, slab.cells()), [=](int cell) {
    const int r = cell / kGlobalCells + 1, i = cell % kGlobalCells;
    u(r, i) += kCourant * divergence(cell, 0);
  });
  Kokkos::fence();
}

// sqrt(sum (a - b)^2 / sum b^2) over every rank's first `cells` rows (column 0) or field cells.
double relative_error(const Field& a, const Field& b, int first_row, int rows, MPI_Comm comm) {
  double sums[2] = {0.0, 0.0};
  for (int r = first_row; r < first_row + rows; ++r)
    for (int i = 0; i < static_cast<int>(a.extent(1)); ++i) {
      const double diff = a(r, i) - b(r, i);
      sums[0] += diff * diff;
      sums[1] += b(r, i) * b(r, i);
    }
  MPI_Allreduce(MPI_IN_PLACE, sums, 2, MPI_DOUBLE, MPI_SUM, comm);
  return sums[1] > 0.0 ? std::sqrt(sums[0] / sums[1]) : 0.0;
}

int run(MPI_Comm sim, int bench_steps) {
  Slab slab;
  slab.comm = sim;
  int rank = 0, ranks = 1;
  MPI_Comm_rank(sim, &rank);
  MPI_Comm_size(sim, &ranks);
  if (kGlobalCells % ranks != 0) {
    // before connect: the trainer waits in the rendezvous, so the whole job ends
    if (rank == 0)
      std::fprintf(stderr, "online_heat: %d simulation ranks do not divide the %d grid rows\n",
                   ranks, kGlobalCells);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  slab.rows = kGlobalCells / ranks;
  slab.first_row = rank * slab.rows;
  slab.below = (rank + ranks - 1) % ranks;
  slab.above = (rank + 1) % ranks;
  const double h = 1.0 / kGlobalCells;

  const auto columns = static_cast<size_t>(kGlobalCells);
  const auto cells = static_cast<size_t>(slab.cells());
  Field k_east("k_east", static_cast<size_t>(slab.rows), columns);
  Field k_north("k_north", static_cast<size_t>(slab.rows + 1), columns);
  for (int r = 0; r <= slab.rows; ++r)
    for (int i = 0; i < kGlobalCells; ++i) {
      if (r < slab.rows) k_east(r, i) = conductivity((i + 1) * h, (slab.first_row + r + 0.5) * h);
      k_north(r, i) = conductivity((i + 0.5) * h, (slab.first_row + r) * h);
    }
  Field u = make_field("u", slab), hybrid = make_field("hybrid", slab);
  Field x("x", cells, static_cast<size_t>(kInputs));
  Field divergence("divergence", cells, static_cast<size_t>(kOutputs));
  Field hybrid_x("hybrid_x", cells, static_cast<size_t>(kInputs));
  Field hybrid_divergence("hybrid_divergence", cells, static_cast<size_t>(kOutputs));
  Field predicted("predicted", cells, static_cast<size_t>(kOutputs));
  Field start_of_phase = make_field("start_of_phase", slab);

  // block: the demo's simulation is far cheaper than training, so it waits for the trainer's
  // receives rather than dropping rows (a production run keeps drop: docs/online.md).
  meshtrain::StreamProducerOptions options;
  // (bench/online_overhead.sh: drop, as production runs keep, so sends never wait.)
  options.backpressure =
      bench_steps > 0 ? meshtrain::StreamBackpressure::drop : meshtrain::StreamBackpressure::block;
  // The library prints nothing: the simulation says what it is told (the trainer's stop, on
  // rank 0; a close the trainer did not answer).
  options.on_warning = [](const std::string& warning) {
    std::fprintf(stderr, "warning: %s\n", warning.c_str());
    std::fflush(stderr);
  };
  meshtrain::StreamProducer producer;
  producer.connect(sim, "heat-2d", kInputs, kOutputs, meshtrain::StreamDtype::float64, options);
  if (bench_steps > 0) {
    // The producer's overhead: the same steps with and without sends, alternated three times
    // (the fastest of each kept), timed on rank 0 between barriers.
    double seconds_off = 1e30, seconds_on = 1e30;
    for (int repeat = 0; repeat < 6; ++repeat) {
      const bool sends = repeat % 2 == 1;
      initial_state(u, slab, repeat);
      MPI_Barrier(sim);
      const auto begin = std::chrono::steady_clock::now();
      for (int s = 0; s < bench_steps; ++s) {
        exchange_halo(u, slab);
        make_rows(u, k_east, k_north, slab, x, divergence);
        if (sends) producer.send(x.data(), divergence.data(), slab.cells());
        advance(u, divergence, slab);
      }
      MPI_Barrier(sim);
      const double t =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
      double& best = sends ? seconds_on : seconds_off;
      best = std::min(best, t);
    }
    producer.close();
    long long sent = producer.rows_sent(), dropped = producer.rows_dropped();
    MPI_Allreduce(MPI_IN_PLACE, &sent, 1, MPI_LONG_LONG, MPI_SUM, sim);
    MPI_Allreduce(MPI_IN_PLACE, &dropped, 1, MPI_LONG_LONG, MPI_SUM, sim);
    if (rank == 0)
      std::printf(
          "{\"bench\": \"online_producer_overhead\", \"ranks\": %d, \"cells\": %d, "
          "\"steps\": %d, \"step_us_off\": %.3f, \"step_us_on\": %.3f, \"ratio\": "
          "%.4f, \"rows_sent\": %lld, \"rows_dropped\": %lld}\n",
          ranks, kGlobalCells * kGlobalCells, bench_steps, 1e6 * seconds_off / bench_steps,
          1e6 * seconds_on / bench_steps, seconds_on / seconds_off, sent, dropped);
    return 0;
  }
  meshtrain::LiveModel model(producer, static_cast<int64_t>(slab.cells()) * ranks);

  // Phase 1: stream, refresh, and measure each new model on the step's rows until one is good.
  const auto start = std::chrono::steady_clock::now();
  const auto seconds = [&start] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  int step = 0, trusted_version = 0;
  double model_error = 0.0;
  for (; step < kMaxLearningSteps && trusted_version == 0; ++step) {
    if (step % kRestartEvery == 0) initial_state(u, slab, step / kRestartEvery);
    exchange_halo(u, slab);
    make_rows(u, k_east, k_north, slab, x, divergence);
    producer.send(x.data(), divergence.data(), slab.cells());
    if (model.refresh()) {
      model.predict(x, predicted);
      model_error = relative_error(predicted, divergence, 0, slab.cells(), sim);
      if (rank == 0)
        std::printf(
            "online_heat: step %d (%.1f s): model version %lld (training step %lld), "
            "error %.3g of the flux divergence\n",
            step, seconds(), static_cast<long long>(model.version()),
            static_cast<long long>(model.step()), model_error);
      if (model_error < kTrustTolerance) trusted_version = static_cast<int>(model.version());
    }
    advance(u, divergence, slab);
  }
  if (trusted_version == 0) {
    producer.close();
    if (rank == 0)
      std::printf("online_heat: no model under the error %.3g within %d steps (last %.3g)\n",
                  kTrustTolerance, kMaxLearningSteps, model_error);
    return 1;
  }
  if (rank == 0)
    std::printf("online_heat: model version %d trusted after %d simulation steps (%.1f s)\n",
                trusted_version, step, seconds());

  // Phase 2: from a new state, every other step of the hybrid field by the model.
  const int restart = step / kRestartEvery + 1;
  initial_state(u, slab, restart);
  initial_state(hybrid, slab, restart);
  Kokkos::deep_copy(start_of_phase, u);
  int model_steps = 0;
  for (int phase_step = 0; phase_step < kRestartEvery; ++phase_step) {
    exchange_halo(u, slab);
    make_rows(u, k_east, k_north, slab, x, divergence);
    producer.send(x.data(), divergence.data(), slab.cells());
    advance(u, divergence, slab);

    model.refresh();
    exchange_halo(hybrid, slab);
    make_rows(hybrid, k_east, k_north, slab, hybrid_x, hybrid_divergence);
    if (phase_step % 2 == 1) {
      model.predict(hybrid_x, predicted);
      advance(hybrid, predicted, slab);
      ++model_steps;
    } else {
      advance(hybrid, hybrid_divergence, slab);
    }
  }
  producer.close();
  const double field_error = relative_error(hybrid, u, 1, slab.rows, sim);
  const double change = relative_error(start_of_phase, u, 1, slab.rows, sim);
  long long sent = producer.rows_sent();
  MPI_Allreduce(MPI_IN_PLACE, &sent, 1, MPI_LONG_LONG, MPI_SUM, sim);
  const bool passed = field_error < kFieldTolerance;
  if (rank == 0) {
    std::printf(
        "online_heat: %d of %d steps by the model (version %lld, training step %lld): "
        "relative L2 error %.3g against the full solver (the field itself changed by "
        "%.3g), %s the tolerance %.3g\n",
        model_steps, kRestartEvery, static_cast<long long>(model.version()),
        static_cast<long long>(model.step()), field_error, change, passed ? "under" : "NOT under",
        kFieldTolerance);
    std::printf("online_heat: %d steps of %d x %d cells on %d ranks in %.1f s; sent %lld rows\n",
                step + kRestartEvery, kGlobalCells, kGlobalCells, ranks, seconds(), sent);
  }
  return passed ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  meshtrain::Runtime runtime(argc, argv);  // MPI and Kokkos
  int* appnum = nullptr;
  int flag = 0;
  MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_APPNUM, &appnum, &flag);
  MPI_Comm sim = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, flag && appnum ? *appnum : 0, runtime.world_rank(), &sim);
  int status = 0;
  try {
    // `online_heat bench STEPS`: the producer's overhead (bench/online_overhead.sh) instead.
    const int bench_steps = argc > 2 && std::string(argv[1]) == "bench" ? std::atoi(argv[2]) : 0;
    status = run(sim, bench_steps);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "online_heat: error: %s\n", e.what());
    status = 2;
  }
  MPI_Comm_free(&sim);
  return status;
}
