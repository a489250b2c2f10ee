// Online training against offline at equal wall clock (issue 38, "Measured"; docs/online.md
// "Figures"), run by bench/online_vs_offline.sh: examples/online_heat's simulation
// (examples/online_heat/heat.hpp) made costlier the way a real one is, by a finer time step:
// each of its OUTPUTS steps is SUBSTEPS explicit substeps of 1 / SUBSTEPS of the example's
// step, and the rows of every cell (the example's 8 inputs and flux divergence) are taken once
// per output step, from the state at its start. The field restarts from a new random state
// every 100 output steps, as in the example. Prints one JSON line per mode.
//
//   online_vs_offline online GRID SUBSTEPS OUTPUTS
//     Beside `meshtrain train` (MPMD: the program takes its part of MPI_COMM_WORLD by
//     MPI_APPNUM): every output step's rows go to stream "heat-bench" (float64, backpressure
//     drop: the simulation never waits for the trainer), then close().
//   online_vs_offline write GRID SUBSTEPS OUTPUTS DIR
//     The same simulation, rows written to DIR/train-R.h5 by each rank R instead (/x [N, 8] and
//     /y [N, 1] float32, contiguous, one hyperslab write of each per output step, the file
//     closed at the end; no fsync).
//   online_vs_offline test GRID SUBSTEPS STATES FILE
//     Held-out rows for both models: STATES states the training runs never see (restarts
//     numbered from 1,000,000), each run for 100 output steps, the rows of every 10th written to
//     FILE (STATES x 10 x GRID^2 rows).
// GRID must be a multiple of the simulation's ranks.

#include <hdf5.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "examples/online_heat/heat.hpp"
#include "framework/comm/mpi_util.hpp"
#include "framework/io/hdf5_util.hpp"
#include "stream.hpp"

namespace {

using namespace online_heat;
namespace h5 = meshtrain::hdf5;
using Clock = std::chrono::steady_clock;

constexpr int kTestRestart = 1000000;  // the held-out states' restarts start here
constexpr int kTestEvery = 10;         // the held-out rows: every 10th output step of a state

double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// The simulation: OUTPUTS output steps of SUBSTEPS substeps; `take(output, x, divergence)` is
// called with the rows of each output step's starting state.
struct Simulation {
  Slab slab;
  Field k_east, k_north, u, x, divergence;
  int substeps = 1;

  Simulation(MPI_Comm comm, int grid, int substeps_) : substeps(substeps_) {
    slab = make_slab(comm, grid);
    make_conductivities(slab, k_east, k_north);
    u = make_field("u", slab);
    x = Field("x", static_cast<size_t>(slab.cells()), static_cast<size_t>(kInputs));
    divergence = Field("divergence", static_cast<size_t>(slab.cells()), 1);
  }

  template <class Take>
  void run(int first_restart, int outputs, Take take) {
    const double fraction = 1.0 / substeps;
    for (int output = 0; output < outputs; ++output) {
      if (output % kRestartEvery == 0)
        initial_state(u, slab, first_restart + output / kRestartEvery);
      for (int s = 0; s < substeps; ++s) {
        exchange_halo(u, slab);
        make_rows(u, k_east, k_north, slab, x, divergence);
        if (s == 0) take(output, x, divergence);
        advance(u, divergence, slab, fraction);
      }
    }
  }
};

// Rows written as a simulation writes its output: a contiguous file sized for every row, one
// hyperslab write of /x and /y per output step (float64 in memory, float32 in the file).
class RowFile {
 public:
  RowFile(const std::string& path, int64_t rows) : path_(path) {
    h5::silence_errors();
    file_ = h5::make(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose,
                     meshtrain::ErrorKind::runtime, "H5Fcreate " + path);
    const hsize_t xdims[2] = {static_cast<hsize_t>(rows), static_cast<hsize_t>(kInputs)};
    const hsize_t ydims[2] = {static_cast<hsize_t>(rows), 1};
    xspace_ = h5::make(H5Screate_simple(2, xdims, nullptr), H5Sclose, meshtrain::ErrorKind::runtime,
                       "H5Screate_simple");
    yspace_ = h5::make(H5Screate_simple(2, ydims, nullptr), H5Sclose, meshtrain::ErrorKind::runtime,
                       "H5Screate_simple");
    xset_ = h5::make(
        H5Dcreate2(file_, "/x", H5T_IEEE_F32LE, xspace_, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
        H5Dclose, meshtrain::ErrorKind::runtime, "H5Dcreate2 /x in " + path);
    yset_ = h5::make(
        H5Dcreate2(file_, "/y", H5T_IEEE_F32LE, yspace_, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
        H5Dclose, meshtrain::ErrorKind::runtime, "H5Dcreate2 /y in " + path);
  }

  void write(const Field& x, const Field& y) {
    write_one(xset_, xspace_, x, kInputs);
    write_one(yset_, yspace_, y, 1);
    next_ += static_cast<int64_t>(x.extent(0));
  }

  void close() {
    xset_.close("H5Dclose /x in " + path_);
    yset_.close("H5Dclose /y in " + path_);
    file_.close("H5Fclose " + path_);
  }

 private:
  void write_one(const h5::Handle& set, const h5::Handle& space, const Field& rows, int width) {
    const hsize_t start[2] = {static_cast<hsize_t>(next_), 0};
    const hsize_t count[2] = {static_cast<hsize_t>(rows.extent(0)), static_cast<hsize_t>(width)};
    h5::Handle memory = h5::make(H5Screate_simple(2, count, nullptr), H5Sclose,
                                 meshtrain::ErrorKind::runtime, "H5Screate_simple");
    h5::check(H5Sselect_hyperslab(space, H5S_SELECT_SET, start, nullptr, count, nullptr),
              meshtrain::ErrorKind::runtime, "H5Sselect_hyperslab in " + path_);
    h5::check(H5Dwrite(set, H5T_NATIVE_DOUBLE, memory, space, H5P_DEFAULT, rows.data()),
              meshtrain::ErrorKind::runtime, "H5Dwrite in " + path_);
  }

  std::string path_;
  h5::Handle file_, xspace_, yspace_, xset_, yset_;
  int64_t next_ = 0;
};

void check_grid(const Simulation& sim, int ranks, int grid) {
  if (grid < 2 || grid % ranks != 0 || sim.substeps < 1) {
    MESHTRAIN_BAD_INPUT("online_vs_offline: GRID (", grid,
                        ") must be at least 2 and a multiple of ", "the ", ranks,
                        " simulation ranks, SUBSTEPS (", sim.substeps, ") at least 1");
  }
}

int run(MPI_Comm comm, int argc, char** argv) {
  int rank = 0, ranks = 1;
  meshtrain::check_mpi(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
  meshtrain::check_mpi(MPI_Comm_size(comm, &ranks), "MPI_Comm_size");
  const std::string mode = argc > 1 ? argv[1] : "";
  const bool known = (mode == "online" && argc == 5) || (mode == "write" && argc == 6) ||
                     (mode == "test" && argc == 6);
  if (!known) {
    if (rank == 0)
      std::fprintf(stderr,
                   "usage: online_vs_offline online GRID SUBSTEPS OUTPUTS | write GRID SUBSTEPS "
                   "OUTPUTS DIR | test GRID SUBSTEPS STATES FILE\n");
    return 2;
  }
  const int grid = std::atoi(argv[2]), substeps = std::atoi(argv[3]), count = std::atoi(argv[4]);
  Simulation sim(comm, grid > 1 ? grid : 2, substeps);
  check_grid(sim, ranks, grid);
  const int64_t cells = sim.slab.cells();
  const auto begin = Clock::now();
  if (mode == "online") {
    meshtrain::StreamProducerOptions options;  // backpressure drop, the default
    meshtrain::StreamProducer producer;
    producer.connect(comm, "heat-bench", kInputs, kOutputs, meshtrain::StreamDtype::float64,
                     options);
    const auto start = Clock::now();
    sim.run(0, count,
            [&](int, const Field& x, const Field& y) { producer.send(x.data(), y.data(), cells); });
    const double simulate_s = since(start);
    producer.close();
    long long rows[2] = {producer.rows_sent(), producer.rows_dropped()};
    meshtrain::check_mpi(MPI_Allreduce(MPI_IN_PLACE, rows, 2, MPI_LONG_LONG, MPI_SUM, comm),
                         "MPI_Allreduce");
    if (rank == 0)
      std::printf(
          "{\"bench\": \"online_vs_offline\", \"part\": \"online_simulation\", \"ranks\": %d, "
          "\"grid\": %d, \"substeps\": %d, \"outputs\": %d, \"simulate_s\": %.3f, "
          "\"close_s\": %.3f, \"rows_sent\": %lld, \"rows_dropped\": %lld}\n",
          ranks, grid, substeps, count, simulate_s, since(start) - simulate_s, rows[0], rows[1]);
  } else if (mode == "write") {
    const std::string path = std::string(argv[5]) + "/train-" + std::to_string(rank) + ".h5";
    RowFile file(path, cells * count);
    double write_s = 0;
    sim.run(0, count, [&](int, const Field& x, const Field& y) {
      const auto t = Clock::now();
      file.write(x, y);
      write_s += since(t);
    });
    const auto t = Clock::now();
    file.close();
    write_s += since(t);
    double worst[2] = {since(begin), write_s};
    meshtrain::check_mpi(MPI_Allreduce(MPI_IN_PLACE, worst, 2, MPI_DOUBLE, MPI_MAX, comm),
                         "MPI_Allreduce");
    if (rank == 0)
      std::printf(
          "{\"bench\": \"online_vs_offline\", \"part\": \"offline_simulation\", \"ranks\": %d, "
          "\"grid\": %d, \"substeps\": %d, \"outputs\": %d, \"simulate_and_write_s\": %.3f, "
          "\"write_s\": %.3f, \"rows_written\": %lld}\n",
          ranks, grid, substeps, count, worst[0], worst[1],
          static_cast<long long>(cells * count * ranks));
  } else {
    MESHTRAIN_REQUIRE(ranks == 1, "online_vs_offline test: one rank");
    RowFile file(argv[5], cells * count * (kRestartEvery / kTestEvery));
    sim.run(kTestRestart, count * kRestartEvery, [&](int output, const Field& x, const Field& y) {
      if (output % kTestEvery == 0) file.write(x, y);
    });
    file.close();
    if (rank == 0)
      std::printf(
          "{\"bench\": \"online_vs_offline\", \"part\": \"test_rows\", \"grid\": %d, "
          "\"substeps\": %d, \"states\": %d, \"rows\": %lld}\n",
          grid, substeps, count,
          static_cast<long long>(cells * count * (kRestartEvery / kTestEvery)));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (MPI_Init(&argc, &argv) != MPI_SUCCESS) {
    std::fprintf(stderr, "online_vs_offline: error: MPI_Init failed\n");
    return 2;
  }
  int status = 0;
  {
    Kokkos::ScopeGuard kokkos(argc, argv);
    try {
      int* appnum = nullptr;
      int flag = 0;
      meshtrain::check_mpi(MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_APPNUM, &appnum, &flag),
                           "MPI_Comm_get_attr (MPI_APPNUM)");
      int world_rank = 0;
      meshtrain::check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank), "MPI_Comm_rank");
      MPI_Comm comm = MPI_COMM_NULL;
      meshtrain::check_mpi(
          MPI_Comm_split(MPI_COMM_WORLD, flag && appnum ? *appnum : 0, world_rank, &comm),
          "MPI_Comm_split");
      status = run(comm, argc, argv);
      meshtrain::check_mpi(MPI_Comm_free(&comm), "MPI_Comm_free");
    } catch (const std::exception& e) {
      std::fprintf(stderr, "online_vs_offline: error: %s\n", e.what());
      MPI_Abort(MPI_COMM_WORLD, 2);
    }
  }
  if (MPI_Finalize() != MPI_SUCCESS) {
    std::fprintf(stderr, "online_vs_offline: error: MPI_Finalize failed\n");
    return 2;
  }
  return status;
}
