#pragma once
// The wire protocol between a simulation's producers and the trainer (docs/online.md): the
// rendezvous record every rank of the parent communicator contributes, the header of every
// message, and the check both sides run on the same gathered records, so that a mismatch is
// the same sentence on both sides.

#include <mpi.h>

#include <cstdint>
#include <string>
#include <vector>

namespace meshtrain::stream_protocol {

// Every message of a stream on its own communicator (a dup of the parent) has this tag, so
// MPI's non-overtaking order holds between a producer's rows and its close.
constexpr int kTag = 3801;
// The trainer's publishes (parameters and normalization) to producer 0, and its end: another
// tag, so that a producer probing for them never sees rows (and the reverse).
constexpr int kPublishTag = 3802;
// The trainer's last word to each producer rank (a LastWord: its stop, or done): a tag of its
// own, so that a producer probes for it alone.
constexpr int kLastWordTag = 3803;
// A rows message whose rows take at least StreamProducerOptions::split_bytes goes as three
// messages: its Header alone (split = 1) on kTag, then its x rows and its y rows, each one
// contiguous message on this tag (in that order: MPI keeps the order on one tag). The trainer
// matches the two (MPI_Improbe) when the header comes and receives them (MPI_Mrecv) only when
// it takes the message, straight into its buffer's slots where they fit (docs/online.md,
// "Copies per byte"): a large message's bytes are then copied once on the trainer, by MPI.
constexpr int kPayloadTag = 3804;
// Slots of received messages per producer on a trainer rank.
constexpr int64_t kStagingSlots = 4;
constexpr int kNameBytes = 64;
constexpr int kNoteBytes = 512;

// The protocol's version, in every Hello: the rendezvous refuses ranks that differ (a trainer
// of an older release would read a split message's header as a whole message). 2: split
// messages (kPayloadTag); 0: a release before the field (the end of Hello::note, zero there).
constexpr int64_t kProtocolVersion = 2;

// kFailedTrainer: a trainer rank whose run failed before its rendezvous joins it only to say
// why (Hello::note), so that the producers' connect fails rather than waits.
enum Role : int64_t { kNone = 0, kProducer = 1, kTrainer = 2, kFailedTrainer = 3 };
enum Dtype : int64_t { kFloat32 = 0, kFloat64 = 1 };
enum Kind : int64_t { kRows = 1, kClose = 2, kStop = 3, kPublish = 4, kPublishEnd = 5, kDone = 6 };

// One per rank of the parent, gathered by every rank at the rendezvous.
struct Hello {
  int64_t role = kNone;
  int64_t local_rank = 0;  // in the producers' or the trainer's communicator
  int64_t inputs = 0;
  int64_t outputs = 0;
  int64_t dtype = kFloat32;
  int64_t message_rows = 0;    // producers: rows of their largest message
  int64_t batch_index = 0;     // trainers: the index in their group over the batch axes
  int64_t batch_count = 1;     // trainers: the number of those groups
  int64_t publish_every = 0;   // trainers: stream.publish_every (0: no publishes)
  int64_t publish_floats = 0;  // trainers: the model's parameters (every element, whole)
  int64_t input_stats = 0;     // trainers: 1 when a publish carries input statistics
  int64_t target_stats = 0;    // trainers: 1 when it carries target statistics
  char name[kNameBytes] = {};
  char note[kNoteBytes - 8] = {};  // kFailedTrainer: the error's sentence
  // Last, in the bytes that were the end of note (always zero there): the record keeps its
  // size, so the gather with an older release works and its 0 is refused in one sentence.
  int64_t protocol = kProtocolVersion;
};
static_assert(sizeof(Hello) == 12 * 8 + kNameBytes + kNoteBytes);

struct Header {
  int64_t kind = kRows;
  int64_t rows = 0;
  int64_t first_row = 0;  // the producer's row number of the message's first row
  // 1: the rows follow as two messages on kPayloadTag (x, then y); 0: after this header, in
  // this message. 8 bytes: the payload stays 16-byte aligned.
  int64_t split = 0;
};

inline int64_t dtype_bytes(int64_t dtype) {
  return dtype == kFloat64 ? 8 : 4;
}
inline const char* dtype_name(int64_t dtype) {
  return dtype == kFloat64 ? "float64" : "float32";
}
// The head of a publish message (trainer rank 0 to producer 0). Then, in this order: the input
// mean and std (inputs doubles each) when input_stats, the target mean and std (outputs
// doubles each) when target_stats, and every parameter whole, row-major, in the model's
// parameters() order (floats). A kPublishEnd message is the head alone: no publish follows.
struct PublishHeader {
  int64_t kind = kPublish;
  int64_t version = 0;  // 1, 2, ...: the trainer's publishes so far
  int64_t step = 0;     // the training step the parameters come from
  int64_t floats = 0;
  int64_t input_stats = 0, target_stats = 0;
  // When trainer rank 0 made it: seconds of std::chrono::steady_clock (CLOCK_MONOTONIC, the
  // same clock in every process of one host), so a producer on that host can time the delay
  // from publish to use (bench/online_ingest.sh).
  double published_at = 0.0;
  int64_t unused = 0;  // 64 bytes: the doubles after it stay aligned
};
static_assert(sizeof(PublishHeader) == 64);

// The trainer's last word: trainer rank 0 sends every producer rank exactly one (the
// handshake that ends a stream, docs/online.md), which the producer's close() waits for:
// - kStop, when the run fails after the rendezvous before it took that producer's close (sent
//   at once, so that the producer drops its rows from then on), with the trainer's sentence;
// - kDone, when it took that producer's close and had not failed (sent as it takes it).
// So every producer receives its last word and no message is left unreceived at finalize.
struct LastWord {
  int64_t kind = kStop;
  int64_t unused[3] = {0, 0, 0};
  char note[kNoteBytes] = {};  // kStop: the trainer's error (its sentence)
};

// Bytes of a publish message.
inline int64_t publish_bytes(int64_t floats, int64_t inputs, int64_t outputs, bool input_stats,
                             bool target_stats) {
  return static_cast<int64_t>(sizeof(PublishHeader)) +
         static_cast<int64_t>(sizeof(double)) *
             (2 * inputs * (input_stats ? 1 : 0) + 2 * outputs * (target_stats ? 1 : 0)) +
         static_cast<int64_t>(sizeof(float)) * floats;
}

// Bytes of a rows message of `rows` rows.
inline int64_t message_bytes(int64_t rows, int64_t inputs, int64_t outputs, int64_t dtype) {
  return static_cast<int64_t>(sizeof(Header)) + rows * (inputs + outputs) * dtype_bytes(dtype);
}

// What the gathered records say: the parent ranks of the producers and of the trainer (in
// the order of their own ranks), the groups' members, and the first mismatch ("" when none).
struct Rendezvous {
  std::vector<int> producers;                 // parent rank of producer p
  std::vector<int> trainers;                  // parent rank of trainer rank t
  std::vector<std::vector<int>> group_ranks;  // parent ranks of every trainer of group g
  int64_t batch_count = 1;
  int64_t inputs = 0, outputs = 0, dtype = kFloat32;
  int64_t max_message_rows = 0;
  // The trainer's publishes: stream.publish_every (0: none), and what a LiveModel needs to
  // build the model before the first one (the run's config text, the message's contents).
  int64_t publish_every = 0;
  int64_t publish_floats = 0;
  bool input_stats = false, target_stats = false;
  std::string model_text;
  std::string problem;
};

// Every rank of `parent` calls it once (collective): dups `parent` into *stream_comm and
// gathers every rank's `mine`. The same result on every rank. With publishes (the trainer's
// publish_every > 0) and no problem, trainer rank 0's `model_text` (the run's config text) is
// broadcast to every rank, as Rendezvous::model_text.
Rendezvous rendezvous(MPI_Comm parent, const Hello& mine, MPI_Comm* stream_comm,
                      const std::string& model_text = {});

// The rendezvous this process took part in so far (a program may hold several streams in
// turn: the tests do).
int64_t rendezvous_count();

// The group of message `message` of producer `producer` (of `producers`) among `groups`.
inline int64_t group_of_message(int64_t producer, int64_t message, int64_t producers,
                                int64_t groups) {
  return (producer + message * producers) % groups;
}

}  // namespace meshtrain::stream_protocol
