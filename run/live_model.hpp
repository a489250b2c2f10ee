#pragma once
// The trainer's model as it trains, inside the simulation (docs/online.md): a Predictor whose
// weights the trainer publishes every stream.publish_every steps and refresh() swaps in
// between calls. Installed with <meshtrain/stream.hpp>.
//
//   meshtrain::StreamProducer producer;
//   producer.connect(sim_comm, "heat", 5, 1, meshtrain::StreamDtype::float64);
//   meshtrain::LiveModel model(producer, rows_per_rank);  // collective over sim_comm
//   each time step:
//     producer.send(x, y, rows);
//     if (model.refresh()) ...;      // collective over sim_comm; newer weights taken
//     if (model.ready()) model.predict(x_view, y_view);
//
// The architecture comes from the trainer at connect (its run's config text), so the model is
// built (and every buffer allocated) by the constructor; refresh() allocates nothing. Every
// rank of the producers' communicator holds the whole model and computes its own rows (a
// Predictor on dp = those ranks: predict() needs no other rank). Producer rank 0 receives the
// publishes (the newest kept, never waiting: StreamProducer::take_publishes) and refresh()
// broadcasts the newest to the other ranks when it is newer than the one in use.
//
// Before the first publish the model is not ready: ready() is false, version() 0, and predict()
// throws a bad_input Error saying so (as a PyTorch module whose state was never loaded should).
// After producer.close() the last publish taken stays in use; refresh() still works (it takes
// what close() received).

#include <cstdint>

#include "framework/stream/producer.hpp"
#include "run/predictor.hpp"

namespace meshtrain {

class LiveModel : public Predictor {
 public:
  // Collective over producer.comm(). The producer must be connected to a trainer that
  // publishes (stream.publish_every > 0), else bad_input. `batch_size`: rows per call over
  // every producer rank (0: the trainer's data.batch_size, rounded up to the producers).
  explicit LiveModel(StreamProducer& producer, int64_t batch_size = 0);

  // Collective over the producers' communicator: takes the newest publish when it is newer
  // than the weights in use. Returns whether the weights changed. Allocates nothing.
  bool refresh();
  bool ready() const { return version_ > 0; }
  // The publish in use: 1 for the trainer's first, 0 before any.
  int64_t version() const { return version_; }
  // step(): the training step the weights come from (Predictor::step; 0 before any).

 private:
  // The model the trainer announced at the rendezvous (bad_input when it publishes nothing).
  static NoWeightsYet what_the_trainer_said(const StreamProducer& producer);

  StreamProducer& producer_;
  int64_t version_ = 0;
  int rank_ = 0;
};

}  // namespace meshtrain
