// The producer's live model: see live_model.hpp.

#include "run/live_model.hpp"

#include <cstring>

#include "base/error.hpp"
#include "framework/comm/mpi_util.hpp"
#include "framework/stream/stream_protocol.hpp"

namespace meshtrain {
namespace {

namespace sp = stream_protocol;

}  // namespace

Predictor::NoWeightsYet LiveModel::what_the_trainer_said(const StreamProducer& producer) {
  if (!producer.connected()) {
    MESHTRAIN_BAD_INPUT("LiveModel: the producer is not connected to a stream (connect first)");
  }
  if (producer.publish_every() <= 0) {
    MESHTRAIN_BAD_INPUT("LiveModel: the trainer of stream \"", producer.name(),
                        "\" publishes nothing; set stream.publish_every in its config");
  }
  Predictor::NoWeightsYet model;
  model.config_text = producer.model_text();
  model.source = "the live model of stream \"" + producer.name() + "\"";
  model.not_ready = "LiveModel: the trainer of stream \"" + producer.name() +
                    "\" has published no weights yet; call refresh() until ready() is true";
  model.input_stats = producer.publish_input_stats();
  model.target_stats = producer.publish_target_stats();
  return model;
}

LiveModel::LiveModel(StreamProducer& producer, int64_t batch_size)
    : Predictor(what_the_trainer_said(producer), batch_size, producer.comm()), producer_(producer) {
  check_mpi(MPI_Comm_rank(producer.comm(), &rank_), "MPI_Comm_rank");
  int64_t parameters = 0;
  for (const ShardedTensor& t : this->parameters()) parameters += t.box.elements();
  MESHTRAIN_REQUIRE(parameters == producer.publish_floats(), "LiveModel: the model of stream \"",
                    producer.name(), "\" has ", parameters, " parameters, but the trainer ",
                    "publishes ", producer.publish_floats());
}

bool LiveModel::refresh() {
  // Rank 0's newest version and its step, to every rank.
  int64_t newest[2] = {version_, 0};
  if (rank_ == 0 && producer_.take_publishes() > version_) {
    sp::PublishHeader header;
    std::memcpy(&header, producer_.latest_publish(), sizeof header);
    newest[0] = header.version;
    newest[1] = header.step;
  }
  check_mpi(MPI_Bcast(newest, 2, MPI_INT64_T, 0, producer_.comm()),
            "MPI_Bcast (a LiveModel's version)");
  if (newest[0] <= version_) return false;
  unsigned char* message = producer_.latest_publish();
  check_mpi(MPI_Bcast(message, static_cast<int>(producer_.publish_bytes()), MPI_BYTE, 0,
                      producer_.comm()),
            "MPI_Bcast (a LiveModel's weights)");
  sp::PublishHeader header;
  std::memcpy(&header, message, sizeof header);
  const auto* doubles = reinterpret_cast<const double*>(message + sizeof header);
  const double *input_mean = nullptr, *input_std = nullptr;
  const double *target_mean = nullptr, *target_std = nullptr;
  if (header.input_stats) {
    input_mean = doubles;
    input_std = doubles + inputs();
    doubles += 2 * inputs();
  }
  if (header.target_stats) {
    target_mean = doubles;
    target_std = doubles + outputs();
    doubles += 2 * outputs();
  }
  set_normalization(input_mean, input_std, target_mean, target_std);
  // Every parameter whole, in the model's order: straight into this rank's tensors.
  const auto* floats = reinterpret_cast<const float*>(doubles);
  for (ShardedTensor& t : parameters()) {
    const auto n = static_cast<size_t>(t.box.elements());
    Kokkos::View<const float*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> host(
        floats, n);
    Kokkos::deep_copy(t.local, host);
    floats += n;
  }
  version_ = header.version;
  set_ready(header.step);
  return true;
}

}  // namespace meshtrain
