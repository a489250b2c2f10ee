// The simulation of examples/online_heat (docs/online.md): 2-D heat conduction with a varying
// conductivity, u_t = div(k(x, y) grad u), on the periodic unit square, explicit in time on an
// n x n grid whose rows are split over the simulation's ranks (a halo row exchanged with each
// neighbour every step), and the rows it streams (one per cell: the stencil's differences and
// face conductivities, and the flux divergence). online_heat.cpp trains on them and uses the
// model; bench/online_vs_offline.cpp runs the same simulation against an offline pipeline.
#pragma once

#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace online_heat {

constexpr int kInputs = 8, kOutputs = 1;
constexpr int kGrid = 32;           // the grid is kGrid x kGrid (bench: any size)
constexpr int kRestartEvery = 100;  // steps between new random states
constexpr double kPi = 3.14159265358979323846;
constexpr double kMaxConductivity = 1.5;
constexpr double kCourant = 0.2 / kMaxConductivity;  // dt / h^2, under the explicit limit 1/4k

using Host = Kokkos::DefaultHostExecutionSpace;
// Host memory: the halo rows go straight to MPI, and the rows to the stream.
using Field = Kokkos::View<double**, Kokkos::LayoutRight, Kokkos::HostSpace>;

// Every MPI call's return code checked: a failure throws with MPI's own sentence (main prints
// it). Here, not meshtrain's check_mpi: the example builds on the installed meshtrain alone.
inline void mpi_check(int code, const char* call) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  throw std::runtime_error(std::string(call) + " failed: " + std::string(text, length));
}

inline double conductivity(double x, double y) {
  return 1.0 + 0.5 * std::sin(2.0 * kPi * x) * std::cos(2.0 * kPi * y);
}

// This rank's rows of the grid: field rows 1 .. rows, rows 0 and rows + 1 the halo.
struct Slab {
  int n = kGrid;  // the grid's side
  int rows = 0, first_row = 0;
  int below = 0, above = 0;  // the neighbouring ranks (periodic)
  MPI_Comm comm = MPI_COMM_NULL;
  int cells() const { return rows * n; }
};

inline Field make_field(const char* name, const Slab& slab) {
  return Field(std::string(name), static_cast<size_t>(slab.rows + 2), static_cast<size_t>(slab.n));
}

// This rank's slab of an n x n grid over `comm`'s ranks (n a multiple of their count).
inline Slab make_slab(MPI_Comm comm, int n) {
  int rank = 0, ranks = 1;
  mpi_check(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
  mpi_check(MPI_Comm_size(comm, &ranks), "MPI_Comm_size");
  Slab slab;
  slab.n = n;
  slab.comm = comm;
  slab.rows = n / ranks;
  slab.first_row = rank * slab.rows;
  slab.below = (rank + ranks - 1) % ranks;
  slab.above = (rank + 1) % ranks;
  return slab;
}

// The face conductivities: `k_east(r, i)` the face east of cell (r, i), `k_north(r, i)` the face
// between field rows r and r + 1 (r = 0 .. rows).
inline void make_conductivities(const Slab& slab, Field& k_east, Field& k_north) {
  const double h = 1.0 / slab.n;
  const auto columns = static_cast<size_t>(slab.n);
  k_east = Field("k_east", static_cast<size_t>(slab.rows), columns);
  k_north = Field("k_north", static_cast<size_t>(slab.rows + 1), columns);
  for (int r = 0; r <= slab.rows; ++r)
    for (int i = 0; i < slab.n; ++i) {
      if (r < slab.rows) k_east(r, i) = conductivity((i + 1) * h, (slab.first_row + r + 0.5) * h);
      k_north(r, i) = conductivity((i + 0.5) * h, (slab.first_row + r) * h);
    }
}

// The wave numbers (x, y) of the initial states' modes: low, so that a state decays by about
// half over kRestartEvery steps (the rows then span a modest range of scales).
constexpr int kModes[3][2] = {{1, 0}, {0, 1}, {1, 1}};

// Three smooth modes with amplitudes and phases from a small LCG seeded by `restart`, the same
// on every rank.
inline void initial_state(const Field& u, const Slab& slab, int restart) {
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
  const int n = slab.n;
  const double h = 1.0 / n;
  const int first = slab.first_row;
  Kokkos::parallel_for("initial_state", Kokkos::RangePolicy<Host>(0, slab.cells()), [=](int cell) {
    const int j = cell / n, i = cell % n;
    const double x = (i + 0.5) * h, y = (first + j + 0.5) * h;
    double value = 0.0;
    for (int m = 0; m < 3; ++m)
      value += amplitude[m] * std::sin(2.0 * kPi * kModes[m][0] * x + phase_x[m]) *
               std::cos(2.0 * kPi * kModes[m][1] * y + phase_y[m]);
    u(j + 1, i) = value;
  });
  Kokkos::fence();
}

inline void exchange_halo(const Field& u, const Slab& slab) {
  // my first row goes below, my last above; each row is contiguous (LayoutRight)
  mpi_check(MPI_Sendrecv(&u(1, 0), slab.n, MPI_DOUBLE, slab.below, 0, &u(slab.rows + 1, 0), slab.n,
                         MPI_DOUBLE, slab.above, 0, slab.comm, MPI_STATUS_IGNORE),
            "MPI_Sendrecv (the halo below)");
  mpi_check(MPI_Sendrecv(&u(slab.rows, 0), slab.n, MPI_DOUBLE, slab.above, 1, &u(0, 0), slab.n,
                         MPI_DOUBLE, slab.below, 1, slab.comm, MPI_STATUS_IGNORE),
            "MPI_Sendrecv (the halo above)");
}

// One row per cell: the stencil's differences and face conductivities (inputs) and the flux
// divergence (target). `k_east(r, i)`: the face east of cell (r, i); `k_north(r, i)`: the face
// between field rows r and r + 1 (r = 0 .. rows).
inline void make_rows(const Field& u, const Field& k_east, const Field& k_north, const Slab& slab,
                      const Field& x, const Field& divergence) {
  const int n = slab.n;
  Kokkos::parallel_for("make_rows", Kokkos::RangePolicy<Host>(0, slab.cells()), [=](int cell) {
    const int r = cell / n + 1, i = cell % n;
    const int east = (i + 1) % n, west = (i + n - 1) % n;
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

// u += fraction x kCourant x divergence: one step, or with fraction 1/s one of s substeps (the
// benches' costlier simulation, bench/online_vs_offline.sh).
inline void advance(const Field& u, const Field& divergence, const Slab& slab,
                    double fraction = 1.0) {
  const int n = slab.n;
  const double courant = fraction * kCourant;
  Kokkos::parallel_for("advance", Kokkos::RangePolicy<Host>(0, slab.cells()), [=](int cell) {
    const int r = cell / n + 1, i = cell % n;
    u(r, i) += courant * divergence(cell, 0);
  });
  Kokkos::fence();
}

}  // namespace online_heat
