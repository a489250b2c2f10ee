// The C LiveModel (stream.h) over meshtrain::LiveModel.

#include <Kokkos_Core.hpp>
#include <exception>
#include <memory>
#include <string>

#include "base/error.hpp"
#include "framework/stream/stream_c_handle.hpp"
#include "run/live_model.hpp"

struct mt_live_model {
  std::unique_ptr<meshtrain::LiveModel> model;
  int dtype = MT_STREAM_FLOAT32;
  std::string error;
};

namespace {

// 0, or the error's code with its sentence kept in m->error.
template <class Fn>
int guarded(mt_live_model* m, Fn&& fn) {
  try {
    fn();
    if (m) m->error.clear();
    return MT_STREAM_OK;
  } catch (const meshtrain::Error& e) {
    if (m) m->error = e.what();
    return e.kind() == meshtrain::ErrorKind::bad_input ? MT_STREAM_BAD_INPUT : MT_STREAM_ERROR;
  } catch (const std::exception& e) {
    if (m) m->error = e.what();
    return MT_STREAM_ERROR;
  }
}

template <class T>
using HostRows = Kokkos::View<T**, Kokkos::LayoutRight, Kokkos::HostSpace,
                              Kokkos::MemoryTraits<Kokkos::Unmanaged>>;

template <class T>
void predict_rows(meshtrain::LiveModel& model, const void* x, void* y, int64_t rows) {
  if (rows < 0) MESHTRAIN_BAD_INPUT("mt_live_model_predict: negative rows (", rows, ")");
  HostRows<const T> in(static_cast<const T*>(x), static_cast<size_t>(rows),
                       static_cast<size_t>(model.inputs()));
  HostRows<T> out(static_cast<T*>(y), static_cast<size_t>(rows),
                  static_cast<size_t>(model.outputs()));
  model.predict(in, out);
}

}  // namespace

extern "C" {

int mt_live_model_create(mt_stream* s, int64_t batch_size, mt_live_model** out) {
  if (!out) return MT_STREAM_BAD_INPUT;
  *out = new mt_live_model;
  mt_live_model* m = *out;
  return guarded(m, [&] {
    if (!s) MESHTRAIN_BAD_INPUT("mt_live_model_create: no stream (NULL handle)");
    m->dtype = s->dtype;
    m->model = std::make_unique<meshtrain::LiveModel>(s->producer, batch_size);
  });
}

int mt_live_model_refresh(mt_live_model* m) {
  if (!m || !m->model) return -MT_STREAM_BAD_INPUT;
  bool changed = false;
  const int status = guarded(m, [&] { changed = m->model->refresh(); });
  if (status != MT_STREAM_OK) return -status;
  return changed ? 1 : 0;
}

int mt_live_model_predict(mt_live_model* m, const void* x, void* y, int64_t rows) {
  if (!m || !m->model) return MT_STREAM_BAD_INPUT;
  return guarded(m, [&] {
    if (m->dtype == MT_STREAM_FLOAT64) {
      predict_rows<double>(*m->model, x, y, rows);
    } else {
      predict_rows<float>(*m->model, x, y, rows);
    }
  });
}

int64_t mt_live_model_version(const mt_live_model* m) {
  return m && m->model ? m->model->version() : 0;
}

int64_t mt_live_model_step(const mt_live_model* m) {
  return m && m->model ? m->model->step() : 0;
}

int64_t mt_live_model_local_rows(const mt_live_model* m) {
  return m && m->model ? m->model->local_rows() : 0;
}

void mt_live_model_free(mt_live_model* m) {
  delete m;
}

const char* mt_live_model_last_error(const mt_live_model* m) {
  return m ? m->error.c_str() : "mt_live_model: no model (NULL handle)";
}

}  // extern "C"
