// The C producer API (stream.h) over StreamProducer.

#include <cstdio>
#include <exception>
#include <string>

#include "base/error.hpp"
#include "framework/stream/stream_c_handle.hpp"

namespace {

template <class Fn>
int guarded(mt_stream* s, Fn&& fn) {
  try {
    fn();
    if (s) s->error.clear();
    return MT_STREAM_OK;
  } catch (const meshtrain::Error& e) {
    if (s) s->error = e.what();
    return e.kind() == meshtrain::ErrorKind::bad_input ? MT_STREAM_BAD_INPUT : MT_STREAM_ERROR;
  } catch (const std::exception& e) {
    if (s) s->error = e.what();
    return MT_STREAM_ERROR;
  }
}

}  // namespace

extern "C" {

int mt_stream_connect(MPI_Comm comm, const char* name, int64_t inputs, int64_t outputs, int dtype,
                      const mt_stream_options* options, mt_stream** out) {
  if (!out) return MT_STREAM_BAD_INPUT;
  *out = new mt_stream;
  mt_stream* s = *out;
  return guarded(s, [&] {
    if (!name) MESHTRAIN_BAD_INPUT("mt_stream_connect: the stream's name is NULL");
    if (dtype != MT_STREAM_FLOAT32 && dtype != MT_STREAM_FLOAT64) {
      MESHTRAIN_BAD_INPUT("mt_stream_connect: dtype must be MT_STREAM_FLOAT32 or ",
                          "MT_STREAM_FLOAT64, got ", dtype);
    }
    meshtrain::StreamProducerOptions o;
    void (*on_warning)(const char*, void*) = nullptr;
    void* warning_data = nullptr;
    if (options) {
      if (options->ring_rows > 0) o.ring_rows = options->ring_rows;
      if (options->message_rows > 0) o.message_rows = options->message_rows;
      o.backpressure = options->backpressure == MT_STREAM_BLOCK
                           ? meshtrain::StreamBackpressure::block
                           : meshtrain::StreamBackpressure::drop;
      if (options->parent != MPI_COMM_NULL) o.parent = options->parent;
      // 0 is the struct's zero default (120 s); negatives and NaN reach connect's refusal.
      if (options->close_timeout != 0.0) o.close_timeout = options->close_timeout;
      on_warning = options->on_warning;
      warning_data = options->warning_data;
      o.share_messages = options->share_messages != 0;
      o.direct_sends = options->direct_sends != 0;
    }
    if (on_warning) {
      o.on_warning = [on_warning, warning_data](const std::string& warning) {
        on_warning(warning.c_str(), warning_data);
      };
    } else {
      // No callback (NULL options, the Fortran entry): printed, since a C or Fortran simulation
      // has no other way to learn of a close the trainer did not answer (mt_stream_stopped
      // covers the stop alone), and silence there would hide a 120 s wait.
      o.on_warning = [](const std::string& warning) {
        std::fprintf(stderr, "warning: %s\n", warning.c_str());
        std::fflush(stderr);
      };
    }
    s->dtype = dtype;
    s->producer.connect(comm, name, inputs, outputs,
                        dtype == MT_STREAM_FLOAT64 ? meshtrain::StreamDtype::float64
                                                   : meshtrain::StreamDtype::float32,
                        o);
  });
}

int mt_stream_send(mt_stream* s, const void* x, const void* y, int64_t rows) {
  if (!s) return MT_STREAM_BAD_INPUT;
  return guarded(s, [&] {
    if (s->dtype == MT_STREAM_FLOAT64) {
      s->producer.send(static_cast<const double*>(x), static_cast<const double*>(y), rows);
    } else {
      s->producer.send(static_cast<const float*>(x), static_cast<const float*>(y), rows);
    }
  });
}

int mt_stream_flush(mt_stream* s) {
  if (!s) return MT_STREAM_BAD_INPUT;
  return guarded(s, [&] {
    if (!s->producer.connected()) {
      MESHTRAIN_BAD_INPUT("mt_stream_flush: the stream is not connected (connect failed, or it ",
                          "was closed)");
    }
    s->producer.flush();
  });
}

int mt_stream_close(mt_stream* s) {
  if (!s) return MT_STREAM_BAD_INPUT;
  return guarded(s, [&] { s->producer.close(); });
}

void mt_stream_free(mt_stream* s) {
  delete s;
}

int64_t mt_stream_rows_sent(const mt_stream* s) {
  return s ? s->producer.rows_sent() : 0;
}

int64_t mt_stream_rows_dropped(const mt_stream* s) {
  return s ? s->producer.rows_dropped() : 0;
}

int mt_stream_stopped(const mt_stream* s) {
  return s && s->producer.stopped() ? 1 : 0;
}

const char* mt_stream_last_error(const mt_stream* s) {
  return s ? s->error.c_str() : "mt_stream: no stream (NULL handle)";
}

int mt_stream_connect_f(MPI_Fint comm, const char* name, int64_t inputs, int64_t outputs, int dtype,
                        int64_t ring_rows, int64_t message_rows, int backpressure,
                        double close_timeout, int share_messages, mt_stream** out) {
  const mt_stream_options options = {ring_rows,     message_rows,   backpressure,
                                     MPI_COMM_NULL, close_timeout,  nullptr,
                                     nullptr,       share_messages, 0};
  return mt_stream_connect(MPI_Comm_f2c(comm), name, inputs, outputs, dtype, &options, out);
}

}  // extern "C"
