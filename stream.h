/* meshtrain's stream producer for C (and Fortran through iso_c_binding): a simulation's
 * rank sends rows of (inputs, targets) to a trainer running in the same MPI job
 * (docs/online.md). Installed as <meshtrain/stream.h>; the C++ form is <meshtrain/stream.hpp>.
 *
 *   mt_stream* s = NULL;
 *   if (mt_stream_connect(comm, "heat", 5, 1, MT_STREAM_FLOAT64, NULL, &s) != 0) {
 *     fprintf(stderr, "%s\n", mt_stream_last_error(s));  // s is still freed by mt_stream_free
 *   }
 *   mt_stream_send(s, x, y, rows);  // copies into the ring and returns
 *   mt_stream_close(s);
 *   mt_stream_free(s);
 *
 * Every function returns 0, or MT_STREAM_BAD_INPUT (a shape, dtype or name the trainer does
 * not share, a bad argument) or MT_STREAM_ERROR (an MPI or other failure); the sentence is
 * mt_stream_last_error(s). Nothing is allocated by send. */
#ifndef MESHTRAIN_STREAM_H
#define MESHTRAIN_STREAM_H

#include <mpi.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mt_stream mt_stream; /* opaque */

enum { MT_STREAM_FLOAT32 = 0, MT_STREAM_FLOAT64 = 1 };
enum { MT_STREAM_DROP = 0, MT_STREAM_BLOCK = 1 };
enum { MT_STREAM_OK = 0, MT_STREAM_BAD_INPUT = 2, MT_STREAM_ERROR = 1 };

typedef struct mt_stream_options {
  int64_t ring_rows;    /* rows the ring holds; 0: 4096 */
  int64_t message_rows; /* rows of one message at most; 0: 256 */
  int backpressure;     /* MT_STREAM_DROP (default) or MT_STREAM_BLOCK */
  MPI_Comm parent;      /* where the trainer is found; MPI_COMM_NULL: MPI_COMM_WORLD */
  /* Seconds mt_stream_close waits for the trainer's last word; 0: 120; INFINITY: for ever;
   * negative or NaN: MT_STREAM_BAD_INPUT. */
  double close_timeout;
  /* Called with each sentence the simulation should be told (no "warning: " prefix): the
   * trainer's stop (producer rank 0) and a close the trainer did not answer (that rank), with
   * warning_data. NULL: printed to stderr as "warning: SENTENCE" (a simulation that gives no
   * callback, the Fortran one, would otherwise never learn of an unanswered close). */
  void (*on_warning)(const char* sentence, void* warning_data);
  void* warning_data;
  /* Non-zero: consecutive sends share a message until it holds message_rows rows (the last
   * one's rows wait until mt_stream_close); 0 (default): each send's rows start their own
   * message (docs/online.md, "The producer"). Last, so older initializers leave it 0. */
  int share_messages;
  /* Non-zero (with MT_STREAM_BLOCK only; not with share_messages): messages of 64 KiB or more
   * are sent straight from x and y, with no copy into the ring, and mt_stream_send returns
   * once their sends completed: once the trainer took them, for payloads above MPI's eager
   * limit (a few KiB); a send after the trainer's run finished waits until the trainer drops
   * it (in an evaluation or save it still runs, else when its stream source is destroyed)
   * (docs/online.md, "Copies per byte"). 0: the default. */
  int direct_sends;
} mt_stream_options;
/* The struct grows at its end as options come (share_messages, direct_sends): fields an older
 * initializer leaves out are 0 (their defaults), but a producer compiled against an older
 * stream.h passes a smaller struct, of which the library reads past the end: recompile C
 * producers against the stream.h of the meshtrain they link. */

/* Collective over the parent communicator. *out is set (even on failure, for the error). */
int mt_stream_connect(MPI_Comm comm, const char* name, int64_t inputs, int64_t outputs, int dtype,
                      const mt_stream_options* options, mt_stream** out);
/* x [rows, inputs], y [rows, outputs], row-major, of the connected dtype. */
int mt_stream_send(mt_stream* s, const void* x, const void* y, int64_t rows);
/* With options.share_messages: starts the message being filled, if any, so that its rows go
 * now rather than when it fills or at mt_stream_close (the C form of StreamProducer::flush;
 * never waits for the trainer). Without the option, or with nothing waiting: does nothing. */
int mt_stream_flush(mt_stream* s);
/* Sends the close, then waits for the trainer's last word (its stop, or done once it took the
 * close; at most options.close_timeout s, after which it reports one warning and returns). */
int mt_stream_close(mt_stream* s);
void mt_stream_free(mt_stream* s);
int64_t mt_stream_rows_sent(const mt_stream* s);
int64_t mt_stream_rows_dropped(const mt_stream* s);
const char* mt_stream_last_error(const mt_stream* s);
/* 1 when the trainer failed after connect and told the producers to stop: every send since
 * then returned 0 and dropped its rows (mt_stream_rows_dropped); rank 0 reported one warning
 * (options.on_warning, else stderr). */
int mt_stream_stopped(const mt_stream* s);

/* For Fortran (iso_c_binding; docs/online.md has the interface block): mt_stream_connect with
 * the communicator as a Fortran handle (`comm%MPI_VAL` under `use mpi_f08`, the integer under
 * `use mpi`), the options as values (0: the defaults; the parent is MPI_COMM_WORLD; warnings
 * printed to stderr; share_messages non-zero: consecutive sends share a message, flushed by
 * mt_stream_flush or mt_stream_close) and the name NUL-terminated (`trim(name) //
 * c_null_char`). share_messages came last in 2026-11: an interface block without it must add
 * it (a missing value argument is undefined behaviour, not a default). */
int mt_stream_connect_f(MPI_Fint comm, const char* name, int64_t inputs, int64_t outputs, int dtype,
                        int64_t ring_rows, int64_t message_rows, int backpressure,
                        double close_timeout, int share_messages, mt_stream** out);

/* The trainer's model as it trains (its stream.publish_every > 0): the C form of
 * meshtrain::LiveModel (docs/online.md), in the meshtrain_run library.
 *
 *   mt_live_model* m = NULL;
 *   mt_live_model_create(s, 0, &m);            // collective over the producers' comm
 *   each step: mt_live_model_refresh(m);       // collective; 1: newer weights taken
 *              if (mt_live_model_version(m) > 0) mt_live_model_predict(m, x, y, rows);
 *   mt_live_model_free(m);                     // before mt_stream_free(s)
 *
 * predict takes x [rows, inputs] and writes y [rows, outputs], row-major host arrays of the
 * stream's dtype, rows <= mt_live_model_local_rows(m); before the first publish it returns
 * MT_STREAM_BAD_INPUT with the sentence in mt_live_model_last_error. */
typedef struct mt_live_model mt_live_model; /* opaque */

int mt_live_model_create(mt_stream* s, int64_t batch_size, mt_live_model** out);
/* 1: newer weights were taken, 0: none, negative: -MT_STREAM_BAD_INPUT or -MT_STREAM_ERROR. */
int mt_live_model_refresh(mt_live_model* m);
int mt_live_model_predict(mt_live_model* m, const void* x, void* y, int64_t rows);
int64_t mt_live_model_version(const mt_live_model* m); /* 0 before the first publish */
int64_t mt_live_model_step(const mt_live_model* m);    /* the weights' training step */
int64_t mt_live_model_local_rows(const mt_live_model* m);
void mt_live_model_free(mt_live_model* m);
const char* mt_live_model_last_error(const mt_live_model* m);

#ifdef __cplusplus
}
#endif

#endif
