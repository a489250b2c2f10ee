// Checkpoint throughput: save and load of the 784-4096-4096-10 MLP with AdamW state
// (params + m + v, float32) in FSDP over all ranks, compared with a plain sequential POSIX
// write (+ fsync) and read of the same number of bytes in the same directory, and the time
// an asynchronous save blocks a training loop.
//
//   mpirun -np 2 build/bin/checkpoint_bench [--dir DIR] [--repeats N] [--step-ms MS]
//
// Prints one JSON line per operation (best of N for each figure, all measured in this run):
//   save        a synchronous save: seconds, GB/s, the POSIX write+fsync GB/s, their ratio
//               (best against best), and median_paired_ratio: the median over the repeats
//               of the ratio of each save to the POSIX write made right after it
//   load        a load: the same against the POSIX read
//   save_async  an asynchronous save inside a simulated training loop whose steps compute
//               for MS milliseconds on the main thread (default 300 / np: the FLOPs of
//               this model's batch-256 step at 100 GFLOP/s per rank), then call
//               wait_snapshot() (before "the optimizer") and poll(): blocked_s = time spent
//               in save(), wait_snapshot() and poll(); seconds = the synchronous save;
//               blocked_over_sync = their ratio; blocked_no_overlap_s = save() plus an
//               immediate wait_snapshot() (a loop that changes the tensors at once);
//               async_wall_s = from save() until the checkpoint is complete.
// Page caches of both files are dropped (posix_fadvise DONTNEED after fsync) before every
// read, so reads come from the disk in both cases.

#include <fcntl.h>
#include <mpi.h>
#include <unistd.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "framework/io/checkpoint.hpp"
#include "base/error.hpp"

namespace {

using namespace meshtrain;
namespace fs = std::filesystem;

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

CheckpointContents mlp_contents(const Mesh& mesh, int rank) {
  const std::vector<int64_t> sizes = {784, 4096, 4096, 10};
  CheckpointContents c;
  c.mesh = mesh;
  c.train_state.step = 1;
  c.config_text = "[model]\nsizes = [784, 4096, 4096, 10]\n";
  c.opt_state = {{"m", {}}, {"v", {}}};
  const int fsdp = mesh.axis_size("fsdp");
  for (size_t l = 0; l + 1 < sizes.size(); ++l) {
    const std::string prefix = "layers/" + std::to_string(l) + "/";
    const PartitionSpec weight_spec = PartitionSpec::parse("P(fsdp, None)");
    const PartitionSpec bias_spec =
        PartitionSpec::parse(sizes[l + 1] % fsdp == 0 ? "P(fsdp)" : "P()");
    for (int slot = 0; slot < 3; ++slot) {
      auto w = ShardedTensor::allocate(prefix + "weight", {sizes[l], sizes[l + 1]}, weight_spec,
                                       mesh, rank);
      auto b = ShardedTensor::allocate(prefix + "bias", {sizes[l + 1]}, bias_spec, mesh, rank);
      Kokkos::deep_copy(w.local, 0.5f + slot);
      Kokkos::deep_copy(b.local, 0.25f + slot);
      auto& list = slot == 0 ? c.params : c.opt_state[slot - 1].tensors;
      list.push_back(w);
      list.push_back(b);
    }
  }
  return c;
}

int64_t global_bytes(const CheckpointContents& c) {
  int64_t elements = 0;
  auto add = [&](const ShardedTensor& t) {
    int64_t n = 1;
    for (auto d : t.global_shape) n *= d;
    elements += n;
  };
  for (const auto& t : c.params) add(t);
  for (const auto& s : c.opt_state)
    for (const auto& t : s.tensors) add(t);
  return elements * 4;
}

void check_os(bool ok, const std::string& what) {
  if (!ok) MESHTRAIN_FAIL(what, ": ", std::strerror(errno));
}

void drop_cache(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  check_os(fd >= 0, "open " + path);
  check_os(::fsync(fd) == 0, "fsync " + path);
  check_os(::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) == 0, "posix_fadvise " + path);
  ::close(fd);
}

// Sequential write of `bytes` + fsync; returns seconds.
double posix_write(const std::string& path, int64_t bytes, std::vector<char>& buffer) {
  const double t0 = now();
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  check_os(fd >= 0, "open " + path);
  for (int64_t done = 0; done < bytes;) {
    const size_t n =
        static_cast<size_t>(std::min<int64_t>(bytes - done, static_cast<int64_t>(buffer.size())));
    const ssize_t w = ::write(fd, buffer.data(), n);
    check_os(w > 0, "write " + path);
    done += w;
  }
  check_os(::fsync(fd) == 0, "fsync " + path);
  check_os(::close(fd) == 0, "close " + path);
  return now() - t0;
}

double posix_read(const std::string& path, int64_t bytes, std::vector<char>& buffer) {
  const double t0 = now();
  const int fd = ::open(path.c_str(), O_RDONLY);
  check_os(fd >= 0, "open " + path);
  for (int64_t done = 0; done < bytes;) {
    const ssize_t r = ::read(fd, buffer.data(), buffer.size());
    check_os(r > 0, "read " + path);
    done += r;
  }
  ::close(fd);
  return now() - t0;
}

// Busy arithmetic on the main thread for `ms` milliseconds (a training step's compute).
void compute_for(double ms) {
  const double end = now() + ms / 1e3;
  volatile float sink = 0;
  while (now() < end) {
    float x = sink;
    for (int i = 0; i < 10000; ++i) x = x * 0.999f + 1.0f;
    sink = x;
  }
}

int run(int argc, char** argv) {
  int rank = 0;
  int size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::string dir = "/tmp/meshtrain-checkpoint-bench";
  int repeats = 3;
  double step_ms = -1;  // default: below
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string key = argv[i];
    if (key == "--dir")
      dir = argv[i + 1];
    else if (key == "--repeats")
      repeats = std::max(1, std::atoi(argv[i + 1]));
    else if (key == "--step-ms")
      step_ms = std::max(0.0, std::atof(argv[i + 1]));
  }
  // A training step's compute for this model: forward and backward of a batch of 256 are
  // 6 x 256 x 20.0 M parameters = 30.8 GFLOP, split over the ranks at about 100 GFLOP/s each
  // (the single-thread sgemm rate of the build machines): 300 ms / np.
  if (step_ms < 0) step_ms = 300.0 / size;
  const Mesh mesh = Mesh::create({{"fsdp", size}}, size);
  CheckpointContents contents = mlp_contents(mesh, rank);
  CheckpointContents into = mlp_contents(mesh, rank);
  const int64_t bytes = global_bytes(contents);
  const std::string posix_path = dir + "/posix-sequential.bin";
  std::vector<char> buffer(size_t{8} << 20, 'x');
  if (rank == 0) fs::create_directories(dir);

  const double inf = std::numeric_limits<double>::max();
  double save_best = inf, load_best = inf, write_best = inf, read_best = inf;
  std::vector<double> save_ratios, load_ratios;  // rank 0: per repeat, POSIX time / ours
  double blocked_best = inf, no_overlap_best = inf, async_wall_best = inf;
  int steps_overlapped = 0;
  double blocked_parts[3] = {0, 0, 0};  // each the slowest rank's, in the best run
  Checkpointer sync_saver(MPI_COMM_WORLD, /*async=*/false);
  Checkpointer async_saver(MPI_COMM_WORLD, /*async=*/true);
  int64_t step = 0;
  for (int r = 0; r < repeats; ++r) {
    // Synchronous save.
    contents.train_state.step = ++step;
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = now();
    const std::string path = sync_saver.save(contents, dir, 1);
    MPI_Barrier(MPI_COMM_WORLD);
    const double save_s = now() - t0;
    save_best = std::min(save_best, save_s);
    // The POSIX write right after, so the pair sees the same load on the machine.
    double write_s = 0, read_s = 0;
    if (rank == 0) {
      write_s = posix_write(posix_path, bytes, buffer);
      write_best = std::min(write_best, write_s);
      drop_cache(posix_path);
      drop_cache(path);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    t0 = now();
    load_checkpoint(dir, into, MPI_COMM_WORLD);
    MPI_Barrier(MPI_COMM_WORLD);
    const double load_s = now() - t0;
    load_best = std::min(load_best, load_s);
    if (rank == 0) {
      read_s = posix_read(posix_path, bytes, buffer);
      read_best = std::min(read_best, read_s);
    }
    save_ratios.push_back(write_s / save_s);
    load_ratios.push_back(read_s / load_s);

    // Asynchronous save inside a training loop.
    contents.train_state.step = ++step;
    MPI_Barrier(MPI_COMM_WORLD);
    t0 = now();
    async_saver.save(contents, dir, 1);
    double parts[3] = {now() - t0, 0, 0};  // in save(), wait_snapshot(), poll()
    int steps = 0;
    while (async_saver.in_flight()) {
      compute_for(step_ms);         // forward and backward
      MPI_Barrier(MPI_COMM_WORLD);  // the step's collectives (not counted)
      double t = now();
      async_saver.wait_snapshot();  // before the optimizer changes the tensors
      parts[1] += now() - t;
      ++steps;
      t = now();
      async_saver.poll();
      parts[2] += now() - t;
    }
    const double blocked = parts[0] + parts[1] + parts[2];
    const double wall = now() - t0;
    double worst[2] = {blocked, wall}, all[2] = {0, 0};
    MPI_Allreduce(worst, all, 2, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    double worst_parts[3] = {0, 0, 0};
    MPI_Allreduce(parts, worst_parts, 3, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (all[0] < blocked_best) {
      steps_overlapped = steps;
      std::copy(worst_parts, worst_parts + 3, blocked_parts);
    }
    blocked_best = std::min(blocked_best, all[0]);
    async_wall_best = std::min(async_wall_best, all[1]);

    // The same without overlap: the tensors are needed again at once.
    contents.train_state.step = ++step;
    MPI_Barrier(MPI_COMM_WORLD);
    t0 = now();
    async_saver.save(contents, dir, 1);
    async_saver.wait_snapshot();
    double no_overlap = now() - t0, slowest = 0;
    async_saver.wait();
    MPI_Allreduce(&no_overlap, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    no_overlap_best = std::min(no_overlap_best, slowest);
  }
  if (rank == 0) {
    fs::remove_all(dir);
    const double gb = static_cast<double>(bytes) / 1e9;
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
    };
    for (const auto& [op, t, base, ratios] :
         {std::tuple{"save", save_best, write_best, save_ratios},
          std::tuple{"load", load_best, read_best, load_ratios}}) {
      nlohmann::json line = {{"bench", "checkpoint"},
                             {"op", op},
                             {"model", "784-4096-4096-10 adamw (params+m+v)"},
                             {"np", size},
                             {"mesh", mesh.describe()},
                             {"bytes", bytes},
                             {"seconds", t},
                             {"gb_per_s", gb / t},
                             {"posix_seconds", base},
                             {"posix_gb_per_s", gb / base},
                             {"ratio_to_posix", base / t},
                             {"median_paired_ratio", median(ratios)},
                             {"repeats", repeats}};
      std::printf("%s\n", line.dump().c_str());
    }
    nlohmann::json line = {{"bench", "checkpoint"},
                           {"op", "save_async"},
                           {"model", "784-4096-4096-10 adamw (params+m+v)"},
                           {"np", size},
                           {"mesh", mesh.describe()},
                           {"bytes", bytes},
                           {"step_ms", step_ms},
                           {"blocked_s", blocked_best},
                           {"seconds", save_best},
                           {"blocked_over_sync", blocked_best / save_best},
                           {"blocked_in_save_s", blocked_parts[0]},
                           {"blocked_in_wait_snapshot_s", blocked_parts[1]},
                           {"blocked_in_poll_s", blocked_parts[2]},
                           {"blocked_no_overlap_s", no_overlap_best},
                           {"no_overlap_over_sync", no_overlap_best / save_best},
                           {"async_wall_s", async_wall_best},
                           {"steps_overlapped", steps_overlapped},
                           {"repeats", repeats}};
    std::printf("%s\n", line.dump().c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  Kokkos::initialize(argc, argv);
  int status = 0;
  try {
    status = run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "checkpoint_bench: %s\n", e.what());
    status = 1;
  }
  Kokkos::finalize();
  if (status != 0) MPI_Abort(MPI_COMM_WORLD, status);
  MPI_Finalize();
  return status;
}
