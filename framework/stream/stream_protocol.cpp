#include "framework/stream/stream_protocol.hpp"

#include <algorithm>
#include <cstring>
#include <sstream>

#include "framework/comm/mpi_util.hpp"

namespace meshtrain::stream_protocol {
namespace {

std::string name_of(const Hello& hello) {
  return std::string(hello.name, strnlen(hello.name, kNameBytes));
}

std::string shape_of(const Hello& hello) {
  std::ostringstream s;
  s << hello.inputs << " inputs and " << hello.outputs << " outputs as " << dtype_name(hello.dtype);
  return s.str();
}

int64_t g_rendezvous_count = 0;

}  // namespace

int64_t rendezvous_count() {
  return g_rendezvous_count;
}

Rendezvous rendezvous(MPI_Comm parent, const Hello& mine, MPI_Comm* stream_comm,
                      const std::string& model_text) {
  ++g_rendezvous_count;
  check_mpi(MPI_Comm_dup(parent, stream_comm), "MPI_Comm_dup (the stream's communicator)");
  int size = 0;
  check_mpi(MPI_Comm_size(*stream_comm, &size), "MPI_Comm_size");
  std::vector<Hello> hellos(static_cast<size_t>(size));
  check_mpi(MPI_Allgather(&mine, sizeof(Hello), MPI_BYTE, hellos.data(), sizeof(Hello), MPI_BYTE,
                          *stream_comm),
            "MPI_Allgather (the stream's rendezvous)");

  Rendezvous r;
  std::vector<std::pair<int64_t, int>> producers, trainers;
  const Hello* first_producer = nullptr;
  const Hello* first_trainer = nullptr;
  for (int rank = 0; rank < size; ++rank) {
    const Hello& h = hellos[static_cast<size_t>(rank)];
    if (h.role == kProducer) {
      producers.emplace_back(h.local_rank, rank);
      if (!first_producer) first_producer = &h;
    } else if (h.role == kTrainer) {
      trainers.emplace_back(h.local_rank, rank);
      if (!first_trainer) first_trainer = &h;
    }
  }
  // First the protocol: an older release's records may mean something else.
  for (int rank = 1; rank < size; ++rank) {
    const Hello& a = hellos[0];
    const Hello& h = hellos[static_cast<size_t>(rank)];
    if (h.protocol == a.protocol) continue;
    const auto side = [](const Hello& x) {
      return std::string(x.role == kProducer ? "a producer"
                         : x.role == kNone   ? "outside the stream"
                                             : "a trainer rank");
    };
    r.problem = "stream \"" + name_of(first_producer ? *first_producer : mine) +
                "\": the ranks speak different versions of the stream protocol (rank 0 of the "
                "rendezvous, " +
                side(a) + ", version " + std::to_string(a.protocol) + "; rank " +
                std::to_string(rank) + ", " + side(h) + ", version " + std::to_string(h.protocol) +
                "; 0: a release before 2026-11-30): build the producers and the trainer from the "
                "same meshtrain release";
    return r;
  }
  for (int rank = 0; rank < size; ++rank) {
    const Hello& h = hellos[static_cast<size_t>(rank)];
    if (h.role == kFailedTrainer) {
      r.problem = "stream \"" + name_of(first_producer ? *first_producer : h) +
                  "\": the trainer stopped before it trained: " +
                  std::string(h.note, strnlen(h.note, sizeof h.note));
      return r;
    }
  }
  std::sort(producers.begin(), producers.end());
  std::sort(trainers.begin(), trainers.end());
  for (const auto& [local, rank] : producers) r.producers.push_back(rank);
  for (const auto& [local, rank] : trainers) r.trainers.push_back(rank);

  const std::string name = name_of(first_producer ? *first_producer : mine);
  if (!first_producer || !first_trainer) {
    r.problem = "stream \"" + name +
                "\": " + (first_producer ? "no trainer joined it" : "no producer joined it") +
                " (every process of the job takes part in the rendezvous once: the producers "
                "in connect, the trainer's ranks as their run is built)";
    return r;
  }
  const Hello& p = *first_producer;
  const Hello& t = *first_trainer;
  for (int rank = 0; rank < size && r.problem.empty(); ++rank) {
    const Hello& h = hellos[static_cast<size_t>(rank)];
    if (h.role == kNone) continue;
    const Hello& like = h.role == kProducer ? p : t;
    if (name_of(h) != name_of(p)) {
      r.problem = "stream \"" + name_of(p) + "\": another rank joined stream \"" + name_of(h) +
                  "\" (a job holds one stream; the producers' name and [stream] name must be "
                  "the same)";
    } else if (h.inputs != like.inputs || h.outputs != like.outputs || h.dtype != like.dtype) {
      r.problem = "stream \"" + name_of(p) + "\": its " +
                  (h.role == kProducer ? "producers" : "trainer ranks") +
                  " disagree among themselves: " + shape_of(like) + " against " + shape_of(h);
    }
  }
  if (r.problem.empty() && (p.inputs != t.inputs || p.outputs != t.outputs || p.dtype != t.dtype)) {
    r.problem = "stream \"" + name_of(p) + "\": the producers send rows of " + shape_of(p) +
                ", but the trainer takes rows of " + shape_of(t) +
                " (its model's input and output widths, stream.dtype)";
  }
  if (!r.problem.empty()) return r;
  r.inputs = t.inputs;
  r.outputs = t.outputs;
  r.dtype = t.dtype;
  r.batch_count = t.batch_count;
  r.group_ranks.assign(static_cast<size_t>(r.batch_count), {});
  for (int rank : r.trainers) {
    const Hello& h = hellos[static_cast<size_t>(rank)];
    r.group_ranks[static_cast<size_t>(h.batch_index)].push_back(rank);
  }
  for (int rank : r.producers) {
    r.max_message_rows =
        std::max(r.max_message_rows, hellos[static_cast<size_t>(rank)].message_rows);
  }
  r.publish_every = t.publish_every;
  if (r.publish_every > 0) {
    // Every rank takes this branch (the same table): the model's text from trainer rank 0.
    r.publish_floats = t.publish_floats;
    r.input_stats = t.input_stats != 0;
    r.target_stats = t.target_stats != 0;
    const int root = r.trainers.front();
    int rank = 0;
    check_mpi(MPI_Comm_rank(*stream_comm, &rank), "MPI_Comm_rank");
    long long length = rank == root ? static_cast<long long>(model_text.size()) : 0;
    check_mpi(MPI_Bcast(&length, 1, MPI_LONG_LONG, root, *stream_comm),
              "MPI_Bcast (the stream's model text)");
    r.model_text = rank == root ? model_text : std::string(static_cast<size_t>(length), ' ');
    if (length > 0) {
      check_mpi(
          MPI_Bcast(r.model_text.data(), static_cast<int>(length), MPI_CHAR, root, *stream_comm),
          "MPI_Bcast (the stream's model text)");
    }
  }
  return r;
}

}  // namespace meshtrain::stream_protocol
