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
// `online_heat bench STEPS [GRID]` times the producer's overhead instead, on a GRID x GRID grid
// (default 32; bench/online_overhead.sh).

#include <meshtrain/meshtrain.hpp>
#include <meshtrain/stream.hpp>

#include "heat.hpp"

#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <exception>
#include <string>

namespace {

constexpr int kMaxLearningSteps = 60000;  // phase 1 gives up after this many steps
constexpr double kTrustTolerance = 0.05;  // the model's relative RMS error to be used
constexpr double kFieldTolerance = 0.02;  // the hybrid field's relative L2 error to pass

using namespace online_heat;

// sqrt(sum (a - b)^2 / sum b^2) over every rank's first `cells` rows (column 0) or field cells.
double relative_error(const Field& a, const Field& b, int first_row, int rows, MPI_Comm comm) {
  double sums[2] = {0.0, 0.0};
  for (int r = first_row; r < first_row + rows; ++r)
    for (int i = 0; i < static_cast<int>(a.extent(1)); ++i) {
      const double diff = a(r, i) - b(r, i);
      sums[0] += diff * diff;
      sums[1] += b(r, i) * b(r, i);
    }
  mpi_check(MPI_Allreduce(MPI_IN_PLACE, sums, 2, MPI_DOUBLE, MPI_SUM, comm), "MPI_Allreduce");
  return sums[1] > 0.0 ? std::sqrt(sums[0] / sums[1]) : 0.0;
}

// This thread's CPU time (the send call's own work, without the time the thread was not on a
// core).
double thread_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// `online_heat bench STEPS [GRID]`: the producer's overhead on a GRID x GRID grid instead.
struct Bench {
  int steps = 0;  // 0: the example itself
  int grid = kGrid;
};

// The producer's overhead (bench/online_overhead.sh): a warm-up with sends (so that the trainer
// holds min_rows and trains from then on, in every timed phase alike), then the same steps with
// and without sends, alternated three times, timed on rank 0 between barriers (the fastest of
// each kept). Inside the timed phases each rank also times its own send calls and halo
// exchanges (steady_clock around them), and the thread's CPU time in its send calls: the send
// call's own cost, against what the step around it pays (a rank descheduled, the neighbour's
// halo late). ratio_send_call = (off + the send calls' time) / off: the step's cost if the send
// took only its own time, which on loaded cores the measured ratio cannot resolve.
void bench_overhead(meshtrain::StreamProducer& producer, const Bench& bench, const Slab& slab,
                    const Field& u, const Field& k_east, const Field& k_north, const Field& x,
                    const Field& divergence) {
  using Clock = std::chrono::steady_clock;
  const auto since = [](Clock::time_point t) {
    return std::chrono::duration<double>(Clock::now() - t).count();
  };
  int rank = 0, ranks = 1;
  mpi_check(MPI_Comm_rank(slab.comm, &rank), "MPI_Comm_rank");
  mpi_check(MPI_Comm_size(slab.comm, &ranks), "MPI_Comm_size");
  struct Phase {
    double seconds = 1e30, send = 0, send_cpu = 0, send_max = 0, exchange = 0;  // the fastest's
  } off, on;
  double phase_us[7], phase_send_us[7];  // rank 0's step and send call, the warm-up first
  for (int repeat = -1; repeat < 6; ++repeat) {
    const bool warm_up = repeat < 0, sends = warm_up || repeat % 2 == 1;
    const int steps = warm_up ? std::max(200, bench.steps / 4) : bench.steps;
    initial_state(u, slab, repeat + 1);
    mpi_check(MPI_Barrier(slab.comm), "MPI_Barrier");
    double send = 0, send_cpu = 0, send_max = 0, exchange = 0;
    const auto begin = Clock::now();
    for (int s = 0; s < steps; ++s) {
      const auto t0 = Clock::now();
      exchange_halo(u, slab);
      exchange += since(t0);
      make_rows(u, k_east, k_north, slab, x, divergence);
      if (sends) {
        // The wall timer around the CPU timer: the CPU clock read right around the send.
        const auto t1 = Clock::now();
        const double cpu = thread_cpu_seconds();
        producer.send(x.data(), divergence.data(), slab.cells());
        send_cpu += thread_cpu_seconds() - cpu;
        const double t = since(t1);
        send += t;
        send_max = std::max(send_max, t);
      }
      advance(u, divergence, slab);
    }
    mpi_check(MPI_Barrier(slab.comm), "MPI_Barrier");
    const double t = since(begin);
    phase_us[repeat + 1] = 1e6 * t / steps;
    phase_send_us[repeat + 1] = 1e6 * send / steps;
    Phase& best = sends ? on : off;
    if (!warm_up && t < best.seconds) best = Phase{t, send, send_cpu, send_max, exchange};
  }
  // rank 0's step times; each send and exchange figure the largest over the ranks
  double worst[5] = {on.send, on.send_max, on.exchange, off.exchange, on.send_cpu};
  mpi_check(MPI_Allreduce(MPI_IN_PLACE, worst, 5, MPI_DOUBLE, MPI_MAX, slab.comm), "MPI_Allreduce");
  const double per_step = 1e6 / bench.steps;
  const long long rows_sent = producer.rows_sent(), rows_dropped = producer.rows_dropped();
  long long counts[2] = {rows_sent, rows_dropped};
  mpi_check(MPI_Allreduce(MPI_IN_PLACE, counts, 2, MPI_LONG_LONG, MPI_SUM, slab.comm),
            "MPI_Allreduce");
  if (rank == 0) {
    std::string phases, sends;
    for (int p = 0; p < 7; ++p) {
      phases += (p ? ", " : "") + std::to_string(phase_us[p]);
      sends += (p ? ", " : "") + std::to_string(phase_send_us[p]);
    }
    std::printf(
        "{\"bench\": \"online_producer_overhead\", \"ranks\": %d, \"cells\": %d, "
        "\"steps\": %d, \"step_us_off\": %.3f, \"step_us_on\": %.3f, \"ratio\": %.4f, "
        "\"send_call_us\": %.3f, \"send_call_cpu_us\": %.3f, \"ratio_send_call\": %.4f, "
        "\"send_call_max_us\": %.1f, "
        "\"exchange_us_off\": %.3f, "
        "\"exchange_us_on\": %.3f, \"rows_sent\": %lld, \"rows_dropped\": %lld, \"phase_step_us\": "
        "[%s], \"phase_send_us\": [%s]}\n",
        ranks, slab.n * slab.n, bench.steps, per_step * off.seconds, per_step * on.seconds,
        on.seconds / off.seconds, per_step * worst[0], per_step * worst[4],
        (off.seconds + worst[0]) / off.seconds, 1e6 * worst[1], per_step * worst[3],
        per_step * worst[2], counts[0], counts[1], phases.c_str(), sends.c_str());
  }
}

int run(MPI_Comm sim, const Bench& bench) {
  const int bench_steps = bench.steps;
  int rank = 0, ranks = 1;
  mpi_check(MPI_Comm_rank(sim, &rank), "MPI_Comm_rank");
  mpi_check(MPI_Comm_size(sim, &ranks), "MPI_Comm_size");
  if (bench.grid < 2 || bench.grid % ranks != 0) {
    // before connect: the trainer waits in the rendezvous, so the whole job ends
    if (rank == 0)
      std::fprintf(stderr,
                   "online_heat: the grid's side (%d) must be at least 2 and a multiple of the "
                   "%d simulation ranks\n",
                   bench.grid, ranks);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  const Slab slab = make_slab(sim, bench.grid);
  const auto cells = static_cast<size_t>(slab.cells());
  Field k_east, k_north;
  make_conductivities(slab, k_east, k_north);
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
    bench_overhead(producer, bench, slab, u, k_east, k_north, x, divergence);
    producer.close();
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
  mpi_check(MPI_Allreduce(MPI_IN_PLACE, &sent, 1, MPI_LONG_LONG, MPI_SUM, sim), "MPI_Allreduce");
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
                step + kRestartEvery, slab.n, slab.n, ranks, seconds(), sent);
  }
  return passed ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  meshtrain::Runtime runtime(argc, argv);  // MPI and Kokkos
  MPI_Comm sim = MPI_COMM_NULL;
  int status = 0;
  try {
    int* appnum = nullptr;
    int flag = 0;
    mpi_check(MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_APPNUM, &appnum, &flag),
              "MPI_Comm_get_attr (MPI_APPNUM)");
    mpi_check(
        MPI_Comm_split(MPI_COMM_WORLD, flag && appnum ? *appnum : 0, runtime.world_rank(), &sim),
        "MPI_Comm_split");
    // `online_heat bench STEPS`: the producer's overhead (bench/online_overhead.sh) instead.
    Bench bench;
    if (argc > 2 && std::string(argv[1]) == "bench") {
      bench.steps = std::atoi(argv[2]);
      if (argc > 3) bench.grid = std::atoi(argv[3]);
    }
    status = run(sim, bench);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "online_heat: error: %s\n", e.what());
    status = 2;
  }
  if (sim != MPI_COMM_NULL && MPI_Comm_free(&sim) != MPI_SUCCESS) {
    std::fprintf(stderr, "online_heat: error: MPI_Comm_free failed\n");
    status = 2;
  }
  return status;
}
