// Collective matmul benchmark: prints one JSON line per measurement on rank 0.
//
//   OPENBLAS_NUM_THREADS=1 mpirun -np 2 build/bin/bench_collective_matmul \
//       --m 256 --k 4096 --n 4096 --kind all --algorithm all --repeats 5
//
// Shapes (n ranks; the notebook's layouts):
//   all_gather:     out [M, N] = lhs [M, K] @ all_gather(rhs_block [K/n, N], dim 0)
//   reduce_scatter: out [M, N/n] (--scatter-dim 1, the TP forward) or [M/n, N] (0)
//                   = reduce_scatter(lhs [M, K/n] @ rhs [K/n, N])
// Each line: time per call (median over repeats of the slowest rank), GFLOP/s per rank,
// time over naive's, the bytes each rank receives, the workspace bytes of the call. Then
// "local_gemm": the same per-rank GEMM without communication (all ranks at once, as in the
// collective) and "single_rank_sgemm": the full M x K x N sgemm on rank 0 alone while the
// others wait. All variants are timed interleaved, round by round.

#include <mpi.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <ctime>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "framework/comm/backend.hpp"
#include "framework/comm/collective_matmul.hpp"
#include "framework/comm/exit_policy.hpp"
#include "framework/comm/mesh_communicators.hpp"
#include "framework/comm/runtime.hpp"
#include "framework/train/hardware_file.hpp"

namespace {

using meshtrain::CollectiveMatmulAlgorithm;
using Matrix = Kokkos::View<float**, Kokkos::LayoutRight>;

Matrix filled(const std::string& label, std::size_t rows, std::size_t cols, float seed) {
  Matrix m(label, rows, cols);
  Kokkos::parallel_for(
      "meshtrain::bench_fill", rows * cols, KOKKOS_LAMBDA(const std::size_t k) {
        m.data()[k] =
            static_cast<float>((k * 2654435761u + static_cast<std::size_t>(seed * 97)) % 1000) /
                1000.0f -
            0.5f;
      });
  Kokkos::fence();
  return m;
}

double process_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// Medians over `repeats` rounds of the slowest rank's time of each fn (after one warm-up
// call each); `cpu` gets the same of the process CPU time (which time-sharing the cores
// with other jobs does not inflate; ranks waiting in MPI spin, so it counts waits too).
// The calls are interleaved round by round, so a change in the machine's load (other jobs
// on shared cores) hits every variant alike and the ratios stay meaningful.
std::vector<double> median_times(int repeats, const std::vector<std::function<void()>>& fns,
                                 MPI_Comm comm, std::vector<double>* cpu = nullptr) {
  for (const auto& fn : fns) fn();
  std::vector<std::vector<double>> times(fns.size()), cpu_times(fns.size());
  for (int r = 0; r < repeats; ++r) {
    for (std::size_t f = 0; f < fns.size(); ++f) {
      MPI_Barrier(comm);
      const double start = MPI_Wtime(), cpu_start = process_cpu_seconds();
      fns[f]();
      double elapsed[2] = {MPI_Wtime() - start, process_cpu_seconds() - cpu_start};
      double slowest[2] = {0.0, 0.0};
      MPI_Allreduce(elapsed, slowest, 2, MPI_DOUBLE, MPI_MAX, comm);
      times[f].push_back(slowest[0]);
      cpu_times[f].push_back(slowest[1]);
    }
  }
  auto medians = [](std::vector<std::vector<double>>& all) {
    std::vector<double> out;
    for (auto& t : all) {
      std::sort(t.begin(), t.end());
      out.push_back(t[t.size() / 2]);
    }
    return out;
  };
  if (cpu) *cpu = medians(cpu_times);
  return medians(times);
}

}  // namespace

int main(int argc, char** argv) {
  const auto runtime = meshtrain::start_runtime_or_abort(argc, argv);
  return meshtrain::run_or_abort([&] {
    CLI::App app{"Benchmark of all_gather_matmul and matmul_reduce_scatter"};
    std::size_t m = 2048, k = 2048, n = 2048;
    int repeats = 5, scatter_dim = 1;
    std::string algorithm = "all", kind = "all", backend = "auto", precision = "fp32";
    app.add_option("--m", m, "rows of lhs and of the output");
    app.add_option("--k", k, "contraction length (full)");
    app.add_option("--n", n, "columns of rhs and of the output");
    app.add_option("--algorithm", algorithm, "naive|ring|bidirectional|auto|all");
    app.add_option("--kind", kind, "all_gather|reduce_scatter|all");
    app.add_option("--repeats", repeats, "timed calls per measurement (median)");
    app.add_option("--scatter-dim", scatter_dim, "reduce_scatter output dim (1 = TP forward)");
    app.add_option("--backend", backend, "runtime.backend: auto|mpi|nccl");
    app.add_option("--precision", precision, "runtime.matmul_precision: fp32|tf32");
    std::string hardware;
    app.add_option("--hardware", hardware,
                   "hardware profile (meshtrain calibrate) for auto and predicted_s");
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      if (runtime->world_rank() == 0) app.exit(e);
      return e.get_exit_code();
    }
    std::vector<CollectiveMatmulAlgorithm> algorithms;
    if (algorithm == "all") {
      algorithms = {CollectiveMatmulAlgorithm::naive, CollectiveMatmulAlgorithm::ring,
                    CollectiveMatmulAlgorithm::bidirectional, CollectiveMatmulAlgorithm::automatic};
    } else {
      algorithms = {meshtrain::parse_collective_matmul_algorithm(algorithm)};
    }
    meshtrain::set_matmul_precision(meshtrain::parse_matmul_precision(precision));
    if (!hardware.empty()) {
      meshtrain::set_collective_matmul_hardware(meshtrain::read_hardware_profile(hardware));
    }
    meshtrain::MeshCommunicators comms(
        meshtrain::Mesh::create({{"tp", -1}}, runtime->world_size(), "bench"), MPI_COMM_WORLD,
        meshtrain::prepare_comm_backend(meshtrain::resolve_comm_backend(backend, MPI_COMM_WORLD),
                                        MPI_COMM_WORLD));
    meshtrain::Communicator& tp = comms.get({"tp"});
    const std::size_t ranks = static_cast<std::size_t>(tp.size());
    if (k % ranks != 0 || (scatter_dim == 0 ? m : n) % ranks != 0) {
      MESHTRAIN_BAD_INPUT("--k ", k, " and the scattered dimension must be divisible by ", ranks,
                          " ranks");
    }
    const bool root = runtime->world_rank() == 0;
    auto emit = [&](const nlohmann::json& line) {
      if (root) std::printf("%s\n", line.dump().c_str());
      std::fflush(stdout);
    };
    const nlohmann::json shape = {{"M", m},
                                  {"K", k},
                                  {"N", n},
                                  {"ranks", ranks},
                                  {"backend", backend},
                                  {"precision", precision},
                                  {"execution_space", Kokkos::DefaultExecutionSpace::name()}};

    std::vector<std::string> kinds = {kind};
    if (kind == "all") kinds = {"all_gather", "reduce_scatter"};
    for (const std::string& which : kinds) {
      if (which != "all_gather" && which != "reduce_scatter") {
        MESHTRAIN_BAD_INPUT("--kind '", which, "' is not one of all_gather, reduce_scatter, all");
      }
      const bool gather = which == "all_gather";
      const char* op = gather ? "all_gather_matmul" : "matmul_reduce_scatter";
      const std::size_t local_k = gather ? k : k / ranks;
      Matrix lhs = filled("lhs", m, local_k, 1.0f + tp.rank());
      Matrix rhs = filled("rhs", gather ? k / ranks : local_k, n, 2.0f + tp.rank());
      Matrix out = gather ? Matrix("out", m, n)
                          : Matrix("out", scatter_dim == 0 ? m / ranks : m,
                                   scatter_dim == 1 ? n / ranks : n);
      const std::size_t block_bytes =
          (gather ? (k / ranks) * n : out.extent(0) * out.extent(1)) * sizeof(float);
      // Variants timed together: each algorithm, the per-rank GEMM without communication
      // (every rank at once, as inside the collective), and the full M x K x N sgemm on
      // rank 0 alone (the others wait): the per-core reference rate.
      std::vector<meshtrain::CollectiveMatmulWorkspace> workspaces(algorithms.size());
      std::vector<std::function<void()>> variants;
      for (std::size_t v = 0; v < algorithms.size(); ++v) {
        variants.push_back([&, v] {
          if (gather) {
            meshtrain::all_gather_matmul(tp, meshtrain::GatherSide::right, 0, meshtrain::plain(lhs),
                                         meshtrain::plain(rhs), out, algorithms[v], workspaces[v]);
          } else {
            meshtrain::matmul_reduce_scatter(tp, scatter_dim, meshtrain::plain(lhs),
                                             meshtrain::plain(rhs), out, algorithms[v],
                                             workspaces[v]);
          }
        });
      }
      Matrix local_b = filled("local_b", local_k, n, 6.0f), local_c("local_c", m, n);
      variants.push_back([&] {
        meshtrain::gemm(meshtrain::plain(lhs), meshtrain::plain(local_b), 0.0f, local_c);
      });
      Matrix full_a = root ? filled("full_a", m, k, 5.0f) : Matrix("full_a", 0, 0);
      Matrix full_b = root ? filled("full_b", k, n, 6.0f) : Matrix("full_b", 0, 0);
      Matrix full_c = root ? Matrix("full_c", m, n) : Matrix("full_c", 0, 0);
      variants.push_back([&] {
        if (root) meshtrain::gemm(meshtrain::plain(full_a), meshtrain::plain(full_b), 0.0f, full_c);
      });
      std::vector<double> cpu;
      const std::vector<double> t = median_times(repeats, variants, MPI_COMM_WORLD, &cpu);

      const double flops = 2.0 * static_cast<double>(m) * local_k * n;  // per rank
      const meshtrain::CollectiveMatmulShape call_shape =
          gather ? meshtrain::all_gather_matmul_shape(tp, meshtrain::GatherSide::right, 0,
                                                      meshtrain::plain(lhs), meshtrain::plain(rhs),
                                                      out)
                 : meshtrain::matmul_reduce_scatter_shape(tp, scatter_dim, meshtrain::plain(lhs),
                                                          meshtrain::plain(rhs), out);
      const double single_time = t.back(), local_time = t[t.size() - 2];
      const double single_gflops = 2.0 * m * k * n / single_time * 1e-9;
      double naive_time = 0.0;
      for (std::size_t v = 0; v < algorithms.size(); ++v) {
        if (algorithms[v] == CollectiveMatmulAlgorithm::naive) naive_time = t[v];
      }
      for (std::size_t v = 0; v < algorithms.size(); ++v) {
        nlohmann::json line = shape;
        line["op"] = op;
        line["algorithm"] = meshtrain::to_string(algorithms[v]);
        line["resolved"] = meshtrain::to_string(
            meshtrain::resolve_collective_matmul_algorithm(algorithms[v], call_shape));
        // The cost model's prediction for this call (the process's hardware profile).
        const auto& hw = meshtrain::collective_matmul_hardware();
        line["predicted_s"] =
            meshtrain::collective_matmul_seconds(call_shape, algorithms[v], hw.link("tp"), hw);
        if (!gather) line["scatter_dim"] = scatter_dim;
        line["time_s"] = t[v];
        line["cpu_time_s"] = cpu[v];
        line["gflops"] = flops / t[v] * 1e-9;
        if (naive_time > 0.0) line["time_over_naive"] = t[v] / naive_time;
        line["bytes_moved_per_rank"] = (ranks - 1) * block_bytes;
        line["workspace_bytes"] = workspaces[v].last_call_bytes();
        line["block_bytes"] = block_bytes;
        emit(line);
      }
      nlohmann::json local = shape;
      local["op"] = "local_gemm";
      local["for"] = op;
      local["gemm_mkn"] = {m, local_k, n};
      local["time_s"] = local_time;
      local["gflops"] = flops / local_time * 1e-9;
      local["over_single_rank_sgemm"] = flops / local_time * 1e-9 / single_gflops;
      emit(local);
      nlohmann::json single = shape;
      single["op"] = "single_rank_sgemm";
      single["for"] = op;
      single["gemm_mkn"] = {m, k, n};
      single["time_s"] = single_time;
      single["gflops"] = single_gflops;
      emit(single);
    }
    return 0;
  });
}
