/* A simulation in C that trains its own surrogate while it runs, through <meshtrain/stream.h>
 * alone (docs/online.md):
 *
 *   mpirun -np 2 ./online_c : -np 2 meshtrain train online.toml
 *
 * The simulation is 1-D heat conduction with a varying conductivity, u_t = (k(x) u_x)_x on a
 * periodic [0, 1), explicit in time, its cells split over the simulation's ranks with a halo
 * exchange each step. Every step each rank sends one row per cell: the inputs are the cell's
 * stencil and the conductivities of its two faces (u[i-1], u[i], u[i+1], k[i-1/2], k[i+1/2]),
 * the target the cell's next value; the trainer learns that update as the simulation runs.
 * Every 100 steps the field restarts from a new random initial condition, so the rows cover
 * more than one decay.
 *
 * Under MPMD the program takes its part of MPI_COMM_WORLD by MPI_APPNUM (the split is
 * collective over the whole job, so the trainer makes the same call). No argument needed;
 * `online_c STEPS CELLS_PER_RANK` changes the run's length and size. */
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

#include <meshtrain/stream.h>

enum { kInputs = 5, kOutputs = 1, kRestartEvery = 100 };
static const double kPi = 3.14159265358979323846;

static double conductivity(double x) {
  return 0.5 + 0.4 * sin(2.0 * kPi * x);
}

/* A smooth random field: three sine modes with amplitudes and phases from a small LCG seeded
 * by the restart's number, the same on every rank. */
static void initial_condition(double* u, int cells, int first_cell, int global_cells, int restart) {
  unsigned long long state = 0x9E3779B97F4A7C15ull * (unsigned long long)(restart + 1);
  double amplitude[3], phase[3];
  for (int m = 0; m < 3; ++m) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    amplitude[m] = (double)(state >> 11) / 9007199254740992.0 - 0.5;
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    phase[m] = 2.0 * kPi * (double)(state >> 11) / 9007199254740992.0;
  }
  for (int i = 0; i < cells; ++i) {
    const double x = (first_cell + i + 0.5) / global_cells;
    u[i + 1] = 0.0;
    for (int m = 0; m < 3; ++m) u[i + 1] += amplitude[m] * sin(2.0 * kPi * (m + 1) * x + phase[m]);
  }
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int* appnum = NULL;
  int flag = 0, world_rank = 0, rank = 0, ranks = 1;
  MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_APPNUM, &appnum, &flag);
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  MPI_Comm sim;
  MPI_Comm_split(MPI_COMM_WORLD, flag && appnum ? *appnum : 0, world_rank, &sim);
  MPI_Comm_rank(sim, &rank);
  MPI_Comm_size(sim, &ranks);

  const int steps = argc > 1 ? atoi(argv[1]) : 400;
  const int cells = argc > 2 ? atoi(argv[2]) : 32;
  if (steps < 1 || cells < 1) {
    if (rank == 0) fprintf(stderr, "online_c: STEPS and CELLS_PER_RANK must be positive\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  const int global_cells = cells * ranks, first_cell = rank * cells;
  const double dx = 1.0 / global_cells;
  const double dt = 0.4 * dx * dx / 0.9; /* under the explicit limit dx^2 / (2 max k) */
  const int left = (rank + ranks - 1) % ranks, right = (rank + 1) % ranks;

  /* u and next with one halo cell each side; k at the faces i - 1/2, for i = 0 .. cells. */
  double* u = malloc(sizeof(double) * (cells + 2));
  double* next = malloc(sizeof(double) * (cells + 2));
  double* k_face = malloc(sizeof(double) * (cells + 1));
  double* x = malloc(sizeof(double) * cells * kInputs);
  double* y = malloc(sizeof(double) * cells * kOutputs);
  for (int i = 0; i <= cells; ++i)
    k_face[i] = conductivity((double)(first_cell + i) / global_cells);

  /* block: the demo trains on every row it makes (a production run would keep the default,
   * drop, so that the simulation never waits for the trainer). */
  /* close_timeout 0: 120 s; no warning callback: the library prints them to stderr. */
  const mt_stream_options options = {0, 0, MT_STREAM_BLOCK, MPI_COMM_NULL, 0.0, NULL, NULL, 0};
  mt_stream* stream = NULL;
  if (mt_stream_connect(sim, "heat-c", kInputs, kOutputs, MT_STREAM_FLOAT64, &options, &stream) !=
      0) {
    fprintf(stderr, "online_c: %s\n", mt_stream_last_error(stream));
    mt_stream_free(stream);
    MPI_Comm_free(&sim);
    MPI_Finalize();
    return 2;
  }

  double energy = 0.0;
  for (int step = 0; step < steps; ++step) {
    if (step % kRestartEvery == 0)
      initial_condition(u, cells, first_cell, global_cells, step / kRestartEvery);
    /* halo exchange: my first cell goes left, my last right */
    MPI_Sendrecv(&u[1], 1, MPI_DOUBLE, left, 0, &u[cells + 1], 1, MPI_DOUBLE, right, 0, sim,
                 MPI_STATUS_IGNORE);
    MPI_Sendrecv(&u[cells], 1, MPI_DOUBLE, right, 1, &u[0], 1, MPI_DOUBLE, left, 1, sim,
                 MPI_STATUS_IGNORE);
    for (int i = 1; i <= cells; ++i) {
      const double flux_in = k_face[i - 1] * (u[i] - u[i - 1]);
      const double flux_out = k_face[i] * (u[i + 1] - u[i]);
      next[i] = u[i] + dt / (dx * dx) * (flux_out - flux_in);
      double* row = &x[(i - 1) * kInputs];
      row[0] = u[i - 1];
      row[1] = u[i];
      row[2] = u[i + 1];
      row[3] = k_face[i - 1];
      row[4] = k_face[i];
      y[i - 1] = next[i];
    }
    if (mt_stream_send(stream, x, y, cells) != 0) {
      fprintf(stderr, "online_c: %s\n", mt_stream_last_error(stream));
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    double* swap = u;
    u = next;
    next = swap;
  }
  for (int i = 1; i <= cells; ++i) energy += u[i] * u[i] * dx;
  MPI_Allreduce(MPI_IN_PLACE, &energy, 1, MPI_DOUBLE, MPI_SUM, sim);

  if (mt_stream_close(stream) != 0) fprintf(stderr, "online_c: %s\n", mt_stream_last_error(stream));
  long long sent = mt_stream_rows_sent(stream), dropped = mt_stream_rows_dropped(stream);
  MPI_Allreduce(MPI_IN_PLACE, &sent, 1, MPI_LONG_LONG, MPI_SUM, sim);
  MPI_Allreduce(MPI_IN_PLACE, &dropped, 1, MPI_LONG_LONG, MPI_SUM, sim);
  if (rank == 0)
    printf(
        "online_c: %d steps of %d cells on %d ranks, final energy %.6g; sent %lld rows, "
        "dropped %lld\n",
        steps, global_cells, ranks, energy, sent, dropped);
  mt_stream_free(stream);
  free(u);
  free(next);
  free(k_face);
  free(x);
  free(y);
  MPI_Comm_free(&sim);
  MPI_Finalize();
  return 0;
}
