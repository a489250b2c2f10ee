// Online training's ingest and publish delay (issue 38, "Measured"; docs/online.md "Figures"),
// run by bench/online_ingest.sh: one program whose world ranks split into producers (the first
// half) and a trainer (the rest), as the online tests do. Prints JSON lines.
//
//   online_ingest ingest ROWS INPUTS MESSAGE_ROWS SCRATCH
//     Every producer sends ROWS rows of INPUTS float32 inputs and 1 target in sends of
//     MESSAGE_ROWS rows (backpressure block: every row arrives) to a StreamSource on each
//     trainer rank (a window of 65,536 rows), which pulls until every producer closed: rows/s
//     received (the trainer's counters over its time from the rendezvous to the last close).
//     Then the same rows the HDF5 way: each producer writes its rows to a file of its own
//     (SCRATCH/ingest-P.h5, contiguous /x and /y, one hyperslab write per send), and after a
//     barrier trainer rank t reads file t back through the HDF5 stream (open_hdf5_source, in
//     order, MESSAGE_ROWS rows a read): rows/s = rows / (slowest write + slowest read). Then
//     a plain memcpy of the same bytes on the trainer ranks at once (MESSAGE_ROWS rows a copy,
//     between two 64 MiB buffers): rows/s. One line each and a summary with the ratios.
//   online_ingest publish SECONDS
//     A TrainingRun (8-64-64-1 tanh MLP, batch 256, stream.publish_every = 10) on the trainer
//     ranks; each producer step sends 256 rows, calls LiveModel::refresh() and sleeps 1 ms (a
//     simulation's step), for SECONDS seconds. Each time refresh() takes a newer version,
//     producer 0 times it against the publish's own clock (PublishHeader::published_at, made
//     on trainer rank 0 after the gather; one host's steady clock): the delay from publish to
//     use. One line: versions seen and skipped, the delays' median, 90th percentile and max.

#include <hdf5.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "framework/comm/mpi_util.hpp"
#include "framework/io/data.hpp"
#include "framework/io/hdf5_util.hpp"
#include "framework/stream/stream_protocol.hpp"
#include "framework/stream/stream_source.hpp"
#include "run/training_run.hpp"
#include "stream.hpp"

namespace {

using namespace meshtrain;
using Clock = std::chrono::steady_clock;

double now_s() {
  return std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
}

struct Roles {
  int world = 1, world_rank = 0, producers = 1, trainers = 1, rank = 0;
  bool producer = false;
  MPI_Comm comm = MPI_COMM_NULL;
  Roles() {
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    producers = std::max(1, world / 2);
    trainers = world - producers;
    producer = world_rank < producers;
    check_mpi(MPI_Comm_split(MPI_COMM_WORLD, producer ? 0 : 1, world_rank, &comm),
              "MPI_Comm_split");
    MPI_Comm_rank(comm, &rank);
  }
};

double max_over_world(double value) {
  double out = 0;
  MPI_Allreduce(&value, &out, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return out;
}

void fill_rows(int64_t rows, int64_t inputs, int seed, std::vector<float>& x,
               std::vector<float>& y) {
  x.resize(static_cast<size_t>(rows * inputs));
  y.resize(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < inputs; ++j) {
      x[static_cast<size_t>(i * inputs + j)] = static_cast<float>(std::sin(0.01 * i + j + seed));
    }
    y[static_cast<size_t>(i)] = static_cast<float>(std::cos(0.01 * i + seed));
  }
}

// The producer's rows written as a simulation would write them: a contiguous file sized for
// every row, one hyperslab write of /x and /y per send.
void write_hdf5(const std::string& path, int64_t rows, int64_t inputs, int64_t message_rows,
                const std::vector<float>& x, const std::vector<float>& y) {
  const hid_t file = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  MESHTRAIN_REQUIRE(file >= 0, "online_ingest: cannot create ", path);
  const hsize_t xdims[2] = {static_cast<hsize_t>(rows), static_cast<hsize_t>(inputs)};
  const hsize_t ydims[2] = {static_cast<hsize_t>(rows), 1};
  const hid_t xspace = H5Screate_simple(2, xdims, nullptr);
  const hid_t yspace = H5Screate_simple(2, ydims, nullptr);
  const hid_t xset =
      H5Dcreate2(file, "/x", H5T_NATIVE_FLOAT, xspace, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  const hid_t yset =
      H5Dcreate2(file, "/y", H5T_NATIVE_FLOAT, yspace, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  for (int64_t done = 0; done < rows; done += message_rows) {
    const hsize_t count = static_cast<hsize_t>(std::min(message_rows, rows - done));
    const hsize_t start[2] = {static_cast<hsize_t>(done), 0};
    const hsize_t xcount[2] = {count, static_cast<hsize_t>(inputs)};
    const hsize_t ycount[2] = {count, 1};
    const hid_t xmem = H5Screate_simple(2, xcount, nullptr);
    const hid_t ymem = H5Screate_simple(2, ycount, nullptr);
    H5Sselect_hyperslab(xspace, H5S_SELECT_SET, start, nullptr, xcount, nullptr);
    H5Sselect_hyperslab(yspace, H5S_SELECT_SET, start, nullptr, ycount, nullptr);
    MESHTRAIN_REQUIRE(
        H5Dwrite(xset, H5T_NATIVE_FLOAT, xmem, xspace, H5P_DEFAULT, x.data()) >= 0 &&
            H5Dwrite(yset, H5T_NATIVE_FLOAT, ymem, yspace, H5P_DEFAULT, y.data()) >= 0,
        "online_ingest: writing ", path);
    H5Sclose(xmem);
    H5Sclose(ymem);
  }
  H5Dclose(xset);
  H5Dclose(yset);
  H5Sclose(xspace);
  H5Sclose(yspace);
  H5Fclose(file);
}

void ingest(const Roles& roles, int64_t rows, int64_t inputs, int64_t message_rows,
            const std::string& scratch) {
  const int64_t total_rows = rows * roles.producers;
  const double row_bytes = static_cast<double>((inputs + 1) * 4);
  const char* machine = std::getenv("MACHINE_NOTE") ? std::getenv("MACHINE_NOTE") : "";
  const std::string path = std::getenv("INGEST_PATH") ? std::getenv("INGEST_PATH") : "split";
  MESHTRAIN_REQUIRE(path == "whole" || path == "split" || path == "direct",
                    "online_ingest: INGEST_PATH must be whole, split or direct, got ", path);
  // 1. The stream.
  double stream_s = 0;
  int64_t received = 0;
  // The copies' accounting: the producer's time in send() and in its pack (the copy into the
  // ring), the trainer's time in MPI's receives (the wire's copy) and in taking rows into the
  // buffer (its copy).
  double send_s = 0, close_s = 0, pack_s = 0;
  StreamCopyTimes times;
  std::vector<float> x, y;
  fill_rows(message_rows, inputs, roles.world_rank, x, y);
  if (roles.producer) {
    StreamProducerOptions options;
    options.message_rows = message_rows;
    options.ring_rows = 4 * message_rows;
    options.backpressure = StreamBackpressure::block;
    // INGEST_PATH: "whole" (every message whole: the copy into the ring, MPI's, the copy from
    // the trainer's staging into its buffer), "split" (the default options: large messages
    // split, received straight into the buffer) or "direct" (split and sent from the caller's
    // arrays: direct_sends).
    if (path == "whole") options.split_bytes = int64_t{1} << 40;
    options.direct_sends = path == "direct";
    StreamProducer producer;
    producer.connect(roles.comm, "ingest", inputs, 1, StreamDtype::float32, options);
    for (int64_t done = 0; done < rows; done += message_rows) {
      const double start = now_s();
      producer.send(x.data(), y.data(), std::min(message_rows, rows - done));
      send_s += now_s() - start;
    }
    const double close_start = now_s();
    producer.close();
    close_s = now_s() - close_start;
    pack_s = producer.pack_seconds();
  } else {
    StreamSection section;
    section.name = "ingest";
    section.buffer_rows = 65536;
    section.min_rows = 1;
    section.until = StreamUntil::closed;
    section.producer_timeout = 0;
    BatchSlice slice;
    slice.index = roles.rank;
    slice.count = roles.trainers;
    slice.global_batch = roles.trainers;
    slice.rows = 1;
    StreamSource source(section, roles.comm, slice, inputs, 1, 1, 7);
    const double start = now_s();
    do {
      source.pull();
    } while (!source.ended());
    stream_s = now_s() - start;
    received = source.counters().rows_received;
    times = source.copy_times();
  }
  stream_s = max_over_world(stream_s);
  send_s = max_over_world(send_s);
  close_s = max_over_world(close_s);
  pack_s = max_over_world(pack_s);
  // The slowest trainer rank's of each (the producers give 0).
  times.pull_s = max_over_world(times.pull_s);
  times.wire_s = max_over_world(times.wire_s);
  times.receive_s = max_over_world(times.receive_s);
  times.agree_s = max_over_world(times.agree_s);
  times.take_s = max_over_world(times.take_s);
  times.pulls = static_cast<int64_t>(max_over_world(static_cast<double>(times.pulls)));
  times.rows_direct = static_cast<int64_t>(max_over_world(static_cast<double>(times.rows_direct)));
  received = static_cast<int64_t>(max_over_world(static_cast<double>(received)));
  MESHTRAIN_REQUIRE(received == total_rows, "online_ingest: the trainer received ", received,
                    " rows of ", total_rows);

  // 2. The same rows written to HDF5 by the producers and read back by the trainer.
  double write_s = 0, read_s = 0;
  if (roles.producer) {
    const std::string path = scratch + "/ingest-" + std::to_string(roles.rank) + ".h5";
    const double start = now_s();
    write_hdf5(path, rows, inputs, message_rows, x, y);
    write_s = now_s() - start;
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (!roles.producer) {
    const double start = now_s();
    int64_t read = 0;
    std::vector<float> bx(static_cast<size_t>(message_rows * inputs)),
        by(static_cast<size_t>(message_rows));
    std::vector<int64_t> indices(static_cast<size_t>(message_rows));
    for (int f = roles.rank; f < roles.producers; f += roles.trainers) {
      auto source = open_hdf5_source({scratch + "/ingest-" + std::to_string(f) + ".h5"}, 1);
      const int64_t n = source->shape().num_samples;
      for (int64_t done = 0; done < n; done += message_rows) {
        const int64_t count = std::min(message_rows, n - done);
        for (int64_t i = 0; i < count; ++i) indices[static_cast<size_t>(i)] = done + i;
        source->read(indices.data(), count, RowBuffers{bx.data(), nullptr, by.data()});
        read += count;
      }
    }
    read_s = now_s() - start;
  }
  write_s = max_over_world(write_s);
  read_s = max_over_world(read_s);

  // 3. A plain memcpy of the same bytes, on every trainer rank at once.
  double copy_s = 0;
  if (!roles.producer) {
    const size_t chunk = static_cast<size_t>(message_rows * (inputs + 1)) * sizeof(float);
    const size_t ring = std::max<size_t>(chunk, size_t{64} << 20) / chunk * chunk;
    std::vector<unsigned char> from(ring, 1), to(ring, 0);
    const int64_t mine = (total_rows + roles.trainers - 1) / roles.trainers;
    MPI_Barrier(roles.comm);
    const double start = now_s();
    size_t at = 0;
    for (int64_t done = 0; done < mine; done += message_rows) {
      std::memcpy(to.data() + at, from.data() + at, chunk);
      at = (at + chunk) % ring;
    }
    copy_s = now_s() - start;
    if (to[static_cast<size_t>(roles.rank) % ring] != 1) std::abort();  // keeps the copies
  }
  copy_s = max_over_world(copy_s);

  if (roles.world_rank == 0) {
    const double stream_rate = total_rows / stream_s;
    const double hdf5_rate = total_rows / (write_s + read_s);
    const double copy_rate = total_rows / copy_s;
    const auto line = [&](const char* part, double seconds, double rate) {
      std::printf(
          "{\"bench\": \"online_ingest\", \"part\": \"%s\", \"path\": \"%s\", \"producers\": %d, "
          "\"trainers\": %d, \"rows\": %lld, \"row_bytes\": %.0f, \"message_rows\": %lld, "
          "\"seconds\": %.4f, "
          "\"rows_per_s\": %.0f, \"mb_per_s\": %.1f, \"machine\": \"%s\"}\n",
          part, path.c_str(), roles.producers, roles.trainers, static_cast<long long>(total_rows),
          row_bytes, static_cast<long long>(message_rows), seconds, rate, rate * row_bytes / 1e6,
          machine);
    };
    line("stream", stream_s, stream_rate);
    std::printf(
        "{\"bench\": \"online_ingest\", \"part\": \"hdf5\", \"write_s\": %.4f, \"read_s\": %.4f, "
        "\"rows_per_s\": %.0f, \"page_cache\": \"warm (the read follows the write)\"}\n",
        write_s, read_s, hdf5_rate);
    line("memcpy", copy_s, copy_rate);
    // Per rank (the slowest of each role): the bytes one producer sent, one trainer received.
    const double producer_mb = rows * row_bytes / 1e6;
    const double trainer_mb = total_rows * row_bytes / roles.trainers / 1e6;
    const auto rate = [](double mb, double seconds) { return seconds > 0 ? mb / seconds : 0.0; };
    std::printf(
        "{\"bench\": \"online_ingest\", \"part\": \"copies\", \"path\": \"%s\", "
        "\"producer_send_s\": %.4f, \"producer_close_s\": %.4f, \"producer_pack_s\": %.4f, "
        "\"producer_pack_mb_per_s\": %.0f, \"trainer_pulls\": %lld, \"trainer_pull_s\": %.4f, "
        "\"trainer_wire_s\": %.4f, \"trainer_wire_mb_per_s\": %.0f, \"trainer_probe_s\": %.4f, "
        "\"trainer_agree_s\": %.4f, \"trainer_take_s\": %.4f, \"trainer_take_mb_per_s\": %.0f, "
        "\"trainer_rows_received_direct\": %lld, \"memcpy_mb_per_s_per_rank\": %.0f}\n",
        path.c_str(), send_s, close_s, pack_s, rate(producer_mb, pack_s),
        static_cast<long long>(times.pulls), times.pull_s, times.wire_s,
        rate(trainer_mb, times.wire_s), times.receive_s, times.agree_s, times.take_s,
        rate(trainer_mb, times.take_s), static_cast<long long>(times.rows_direct),
        copy_rate * row_bytes / 1e6 / roles.trainers);
    std::printf(
        "{\"bench\": \"online_ingest\", \"summary\": true, \"path\": \"%s\", \"stream_over_hdf5\": "
        "%.2f, "
        "\"target_stream_over_hdf5\": 5, \"stream_over_memcpy\": %.3f, "
        "\"target_stream_over_memcpy\": 0.5}\n",
        path.c_str(), stream_rate / hdf5_rate, stream_rate / copy_rate);
    std::fflush(stdout);
  }
}

void publish_delay(const Roles& roles, double seconds) {
  constexpr int64_t kInputs = 8, kRows = 256, kPublishEvery = 10;
  if (!roles.producer) {
    RunConfig config;
    config.file = "online_ingest";
    config.run.seed = 3;
    config.mesh.axes = {{"dp", roles.trainers}};
    config.model.sizes = {kInputs, 64, 64, 1};
    config.model.activation = Activation::tanh;
    config.model.loss = LossKind::mse;
    config.partition.preset = "dp";
    config.data.source = DataSource::stream;
    config.data.batch_size = 256;
    config.optimizer.kind = OptimizerKind::adamw;
    config.optimizer.lr = 1e-3;
    config.train.log_every = 1000000;
    config.train.steps = 100000000;
    config.stream.name = "publish";
    config.stream.buffer_rows = 16384;
    config.stream.min_rows = 256;
    config.stream.until = StreamUntil::closed;
    config.stream.publish_every = kPublishEvery;
    const char* dir = std::getenv("RUN_DIR");
    config.run.output_dir = dir ? dir : "/tmp/online_ingest_run";
    config.checkpoint.dir = config.run.output_dir + "/checkpoints";
    TrainingRun run(config, {}, std::nullopt, roles.comm);
    const RunSummary summary = run.train();
    if (roles.rank == 0) {
      std::fprintf(stderr, "trainer: %lld steps in %.1f s\n",
                   static_cast<long long>(summary.steps_run), summary.wall_s);
    }
    return;
  }
  StreamProducerOptions options;
  options.backpressure = StreamBackpressure::drop;
  StreamProducer producer;
  producer.connect(roles.comm, "publish", kInputs, 1, StreamDtype::float32, options);
  LiveModel model(producer);
  std::vector<float> x, y;
  fill_rows(kRows, kInputs, roles.world_rank, x, y);
  std::vector<double> delays;
  delays.reserve(100000);
  int64_t seen = 0, skipped = 0, steps = 0;
  const double start = now_s();
  int go_on = 1;
  while (go_on) {
    producer.send(x.data(), y.data(), kRows);
    if (model.refresh() && roles.rank == 0) {
      stream_protocol::PublishHeader header;
      std::memcpy(&header, producer.latest_publish(), sizeof header);
      delays.push_back(now_s() - header.published_at);
      skipped += model.version() - seen - 1;
      seen = model.version();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    ++steps;
    go_on = now_s() - start < seconds ? 1 : 0;
    MPI_Bcast(&go_on, 1, MPI_INT, 0, roles.comm);  // every rank stops at the same step
  }
  const double elapsed = now_s() - start;
  producer.close();
  if (roles.rank == 0) {
    std::sort(delays.begin(), delays.end());
    const auto at = [&](double q) {
      return delays.empty()
                 ? 0.0
                 : delays[static_cast<size_t>(q * static_cast<double>(delays.size() - 1))];
    };
    std::printf(
        "{\"bench\": \"online_publish_delay\", \"producers\": %d, \"trainers\": %d, "
        "\"publish_every\": %lld, \"producer_steps\": %lld, \"producer_step_ms\": %.3f, "
        "\"versions_used\": %zu, \"versions_skipped\": %lld, \"delay_ms_median\": %.3f, "
        "\"delay_ms_p90\": %.3f, \"delay_ms_max\": %.3f, \"machine\": \"%s\"}\n",
        roles.producers, roles.trainers, static_cast<long long>(kPublishEvery),
        static_cast<long long>(steps), 1e3 * elapsed / static_cast<double>(steps), delays.size(),
        static_cast<long long>(skipped), 1e3 * at(0.5), 1e3 * at(0.9), 1e3 * at(1.0),
        std::getenv("MACHINE_NOTE") ? std::getenv("MACHINE_NOTE") : "");
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int code = 0;
  {
    Kokkos::ScopeGuard kokkos(argc, argv);
    Roles roles;
    const std::string mode = argc > 1 ? argv[1] : "";
    try {
      if (mode == "ingest" && argc == 6) {
        ingest(roles, std::atoll(argv[2]), std::atoll(argv[3]), std::atoll(argv[4]), argv[5]);
      } else if (mode == "publish" && argc == 3) {
        publish_delay(roles, std::atof(argv[2]));
      } else {
        if (roles.world_rank == 0) {
          std::fprintf(stderr,
                       "usage: online_ingest ingest ROWS INPUTS MESSAGE_ROWS SCRATCH | "
                       "online_ingest publish SECONDS\n");
        }
        code = 2;
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "online_ingest: error: %s\n", e.what());
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    MPI_Comm_free(&roles.comm);
  }
  MPI_Finalize();
  return code;
}
