// Reduce-scatter and all-reduce: the MPI library's collectives against meshtrain's own ring
// (framework/comm/backends/mpi_ring.hpp, [runtime] reductions), one JSON line per size,
// operation and wire type on rank 0:
//
//   mpirun -np 2 build/bin/bench_reductions --hardware hw.toml --max-bytes 268435456
//
// Sizes: the float buffer each rank passes (reduce_scatter's send, all_reduce's data), from
// --min-bytes to --max-bytes, times 4 each step. Each line: the median over --repeats rounds
// (the two algorithms interleaved round by round, each call bracketed by a barrier) of the
// slowest rank's time; ring / library; and the ring against a memory-bandwidth bound, the
// bytes the ring's rank reads and writes divided by calibrate's memory_bandwidth (B/s per rank,
// read + written; --hardware FILE or --memory-bandwidth B/s):
//   per hop of a block of w wire bytes: the reduction reads 2 w and writes w, and MPI's copy over
//   shared memory reads w and writes w (a single copy, as Open MPI's CMA does): 5 w;
//   reduce_scatter moves n - 1 blocks of W / n (W the wire bytes of the buffer); all_reduce adds
//   an all-gather of n - 1 blocks copied once (2 w each);
//   a 16-bit wire adds packing (read the floats, write the halves) and widening of what comes
//   back.

#include <mpi.h>

#include <CLI/CLI.hpp>
#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "framework/comm/backends/mpi_communicator.hpp"
#include "framework/comm/exit_policy.hpp"
#include "framework/comm/runtime.hpp"
#include "framework/core/choices.hpp"
#include "framework/train/hardware_file.hpp"

namespace {

using meshtrain::Dtype;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The ring's bytes through memory per rank (see the header comment).
double ring_memory_bytes(bool scatter, double float_bytes, Dtype wire, int n) {
  const double wire_bytes = wire == Dtype::fp32 ? float_bytes : float_bytes / 2;
  const double hops = (n - 1.0) / n * wire_bytes;
  double bytes = 5.0 * hops;
  if (!scatter) bytes += 2.0 * hops;
  if (wire != Dtype::fp32) {
    const double back = scatter ? float_bytes / n : float_bytes;  // floats widened into
    bytes += float_bytes + wire_bytes + back / 2 + back;
  }
  return bytes;
}

}  // namespace

int main(int argc, char** argv) {
  const auto runtime = meshtrain::start_runtime_or_abort(argc, argv);
  return meshtrain::run_or_abort([&] {
    CLI::App app{"Reduce-scatter and all-reduce: the MPI library against meshtrain's ring"};
    std::size_t min_bytes = 1024, max_bytes = std::size_t{256} << 20;
    int repeats = 5;
    std::string wires = "fp32,bf16", hardware;
    double memory_bandwidth = 0.0;
    app.add_option("--min-bytes", min_bytes, "smallest buffer per rank (bytes of floats)");
    app.add_option("--max-bytes", max_bytes, "largest buffer per rank (bytes of floats)");
    app.add_option("--repeats", repeats, "timed rounds per size (median; 3 from 64 MiB on)")
        ->check(CLI::PositiveNumber);
    app.add_option("--wires", wires, "fp32,bf16,fp16 (comma-separated)");
    app.add_option("--hardware", hardware, "calibrate's profile: its memory_bandwidth");
    app.add_option("--memory-bandwidth", memory_bandwidth, "B/s per rank, read + written");
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      return app.exit(e);
    }
    if (!hardware.empty()) {
      memory_bandwidth = meshtrain::read_hardware_profile(hardware).memory_bandwidth;
    }
    int rank = 0, n = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    auto comm = meshtrain::MpiCommunicator::duplicate(MPI_COMM_WORLD, "world");
    std::vector<Dtype> wire_list;
    for (const char* name : {"fp32", "bf16", "fp16"}) {
      if (("," + wires + ",").find(std::string(",") + name + ",") != std::string::npos) {
        wire_list.push_back(meshtrain::parse_dtype(name, "--wires"));
      }
    }
    for (std::size_t bytes = min_bytes; bytes <= max_bytes; bytes *= 4) {
      const std::size_t block = std::max<std::size_t>(1, bytes / sizeof(float) / n);
      const std::size_t count = block * n;
      Kokkos::View<float*> send("bench_send", count), recv("bench_recv", block);
      Kokkos::deep_copy(send, 0.5f);
      const int rounds = bytes >= (std::size_t{64} << 20) ? std::min(repeats, 3) : repeats;
      for (const Dtype wire : wire_list) {
        for (const bool scatter : {true, false}) {
          auto call = [&] {
            if (scatter) {
              comm.reduce_scatter(send, recv, wire);
            } else {
              comm.all_reduce(send, meshtrain::ReduceOp::sum, wire);
            }
          };
          std::vector<double> times[2];
          for (int round = 0; round <= rounds; ++round) {
            for (int ring = 0; ring < 2; ++ring) {
              comm.set_reduction_choice(ring ? meshtrain::ReductionChoice::ring()
                                             : meshtrain::ReductionChoice::library());
              MPI_Barrier(MPI_COMM_WORLD);
              const double start = MPI_Wtime();
              call();
              double elapsed = MPI_Wtime() - start, slowest = 0.0;
              MPI_Allreduce(&elapsed, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
              if (round > 0) times[ring].push_back(slowest);  // round 0 warms up
            }
          }
          if (rank != 0) continue;
          const double library_s = median(times[0]), ring_s = median(times[1]);
          nlohmann::json line;
          line["bench"] = "reductions";
          line["op"] = scatter ? "reduce_scatter" : "all_reduce";
          line["wire"] = wire == Dtype::fp32 ? "fp32" : wire == Dtype::bf16 ? "bf16" : "fp16";
          line["np"] = n;
          line["bytes_per_rank"] = count * sizeof(float);
          line["rounds"] = rounds;
          line["library_s"] = library_s;
          line["ring_s"] = ring_s;
          line["library_over_ring"] = library_s / ring_s;
          if (memory_bandwidth > 0.0) {
            const double bound_s =
                ring_memory_bytes(scatter, static_cast<double>(count * sizeof(float)), wire, n) /
                memory_bandwidth;
            line["memory_bound_s"] = bound_s;
            line["ring_fraction_of_bound"] = bound_s / ring_s;
          }
          std::printf("%s\n", line.dump().c_str());
          std::fflush(stdout);
        }
      }
    }
    return 0;
  });
}
