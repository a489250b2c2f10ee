/* A simulation's producer in C, using only <meshtrain/stream.h> (docs/online.md): under MPMD
 * (`mpirun -np 1 online_c_producer : -np 2 meshtrain train online.toml`) it takes its part of
 * MPI_COMM_WORLD by MPI_APPNUM, connects to stream "c-demo" with 4 inputs and 2 outputs (or
 * the inputs given as its argument), sends 50 sends of 16 rows (backpressure block) and closes.
 * Prints what it sent; exits 2 with the error's sentence when connect fails. With a second
 * argument "no-close" its last rank (of two or more) ends without mt_stream_close or
 * mt_stream_free, as a simulation that returns from main without closing its stream. With
 * "until-stopped" every rank sends 16 rows a millisecond until the trainer's stop comes (the
 * trainer failed: mt_stream_stopped), then 100 sends more (dropped), closes and exits 0; it
 * gives up after 20,000 sends, printing "never stopped" and exiting 1. With "close-at-once" every
 * rank closes right after connect, sending nothing, and prints whether the trainer's stop came
 * (its last word, which close() waits for): "closed at once, stopped" (exit 0) or "closed at
 * once, never stopped" (exit 1). */
#define _POSIX_C_SOURCE 199309L /* nanosleep */
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "stream.h"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int* appnum = NULL;
  int flag = 0, world_rank = 0, rank = 0;
  MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_APPNUM, &appnum, &flag);
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  MPI_Comm sim;
  MPI_Comm_split(MPI_COMM_WORLD, flag && appnum ? *appnum : 0, world_rank, &sim);
  MPI_Comm_rank(sim, &rank);
  int ranks = 1;
  MPI_Comm_size(sim, &ranks);
  const int leaves_unclosed =
      argc > 2 && strcmp(argv[2], "no-close") == 0 && ranks > 1 && rank == ranks - 1;
  const int until_stopped = argc > 2 && strcmp(argv[2], "until-stopped") == 0;
  const int close_at_once = argc > 2 && strcmp(argv[2], "close-at-once") == 0;
  const int64_t inputs = argc > 1 ? atoi(argv[1]) : 4, outputs = 2, rows = 16;

  /* block: every row reaches the trainer, however long it takes to start */
  /* close_timeout 0: 120 s; no warning callback: the library prints them to stderr. */
  const mt_stream_options options = {0, 0, MT_STREAM_BLOCK, MPI_COMM_NULL, 0.0, NULL, NULL, 0};
  mt_stream* s = NULL;
  if (mt_stream_connect(sim, "c-demo", inputs, outputs, MT_STREAM_FLOAT32, &options, &s) != 0) {
    fprintf(stderr, "producer: error: %s\n", mt_stream_last_error(s));
    mt_stream_free(s);
    MPI_Comm_free(&sim);
    MPI_Finalize();
    return 2;
  }
  float x[16 * 8], y[16 * 2];
  int steps = until_stopped ? 20000 : close_at_once ? 0 : 50, after_stop = -1;
  for (int step = 0; step < steps; ++step) {
    for (int64_t i = 0; i < rows; ++i) {
      const double t = 0.01 * (double)(step * rows + i) + 0.5 * rank;
      for (int64_t j = 0; j < inputs && j < 8; ++j) x[i * inputs + j] = (float)sin(t * (j + 1));
      for (int64_t o = 0; o < outputs; ++o) y[i * outputs + o] = (float)cos(t + o);
    }
    if (mt_stream_send(s, x, y, rows) != 0) {
      fprintf(stderr, "producer: error: %s\n", mt_stream_last_error(s));
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    if (until_stopped && after_stop < 0 && mt_stream_stopped(s)) {
      after_stop = step;
      steps = step + 101; /* the simulation goes on a little without its trainer */
    }
    if (until_stopped) {
      const struct timespec millisecond = {0, 1000000};
      nanosleep(&millisecond, NULL);
    }
  }
  if (leaves_unclosed) {
    printf("producer %d: sent %lld rows and ends without closing\n", rank,
           (long long)mt_stream_rows_sent(s));
    MPI_Comm_free(&sim);
    MPI_Finalize();
    return 0;
  }
  if (mt_stream_close(s) != 0) {
    fprintf(stderr, "producer: error: %s\n", mt_stream_last_error(s));
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  printf("producer %d: sent %lld rows, dropped %lld\n", rank, (long long)mt_stream_rows_sent(s),
         (long long)mt_stream_rows_dropped(s));
  int code = 0;
  if (close_at_once) {
    printf("producer %d: closed at once, %s\n", rank,
           mt_stream_stopped(s) ? "stopped" : "never stopped");
    code = mt_stream_stopped(s) ? 0 : 1;
  }
  if (until_stopped) {
    if (after_stop < 0) {
      printf("producer %d: never stopped after %d sends\n", rank, steps);
      code = 1;
    } else {
      printf("producer %d: stopped at send %d\n", rank, after_stop);
    }
  }
  mt_stream_free(s);
  MPI_Comm_free(&sim);
  MPI_Finalize();
  return code;
}
