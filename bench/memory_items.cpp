// The memory tracker's figures by plan item against the plan's (issue 37, "Memory per rank (plan
// and tracker)"): a `meshtrain train` run of CONFIG (TrainingRun::train), then every live Kokkos
// allocation of each rank matched to its plan item (TrainingRun::plan_item_of, as
// tests/train/memory_plan_test.cpp does), summed per rank, and the sums of the rank with the
// largest live Kokkos total ("rank" in the line) printed beside the plan's figure for the same
// item; one JSON line on rank 0. bench/bf16_memory.sh runs it.
//
//   mpirun -np 2 build/bin/bench_memory_items CONFIG [--set section.key=value ...]
//
// measured.X / planned.X: "activations" (workspace.activation_bytes), "gathered weights"
// (workspace.gathered_weight_bytes; the tracker counts the scratch's empty Views as 128-byte
// headers), "kokkos" (every live allocation against planned kokkos_bytes()), and the items that
// match no plan item ("unplanned": e.g. gemm()'s bf16 copies of fp32 operands, the
// communicators' 16-bit wire staging, DP's gradient buckets) with rank 0's bytes by label, and
// rank 0's activations by label ("activation_bytes_rank0": where a mode's activation bytes go).
// measured."weight buffers" (no plan item of its own: part of "gathered weights") is the shared
// weight scratch by label: meshtrain::scratch_weight + scratch_prefetch + scratch_weight_16bit.

#include <mpi.h>

#include <CLI/CLI.hpp>
#include <cstdint>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "base/error.hpp"
#include "framework/comm/exit_policy.hpp"
#include "framework/comm/runtime.hpp"
#include "framework/observe/memory_tracker.hpp"
#include "run/training_run.hpp"

namespace {

void check_mpi(int status, const char* what) {
  if (status == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(status, text, &length);
  MESHTRAIN_FAIL("bench_memory_items: ", what, ": ", std::string(text, length));
}

}  // namespace

int main(int argc, char** argv) {
  const auto runtime = meshtrain::start_runtime_or_abort(argc, argv);
  return meshtrain::run_or_abort([&] {
    CLI::App app{"The memory tracker's bytes by plan item against the plan's (one JSON line)"};
    std::string config_path;
    std::vector<std::string> overrides;
    app.add_option("config", config_path, "run config (TOML)")->required();
    app.add_option("--set", overrides, "section.key=value overrides");
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      return app.exit(e);
    }
    int rank = 0, size = 1;
    check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &rank), "MPI_Comm_rank");
    check_mpi(MPI_Comm_size(MPI_COMM_WORLD, &size), "MPI_Comm_size");
    const meshtrain::RunConfig config = meshtrain::load_config(config_path, overrides);
    meshtrain::TrainingRun run(config);
    run.train();
    std::map<std::string, int64_t> mine;
    std::map<std::string, int64_t> unplanned_labels;   // rank 0's, by label
    std::map<std::string, int64_t> activation_labels;  // rank 0's, by label
    int64_t live = 0;
    for (const meshtrain::TrackedAllocation& a : meshtrain::kokkos_memory(1 << 20).largest) {
      std::string item = run.plan_item_of(a);
      if (item.empty()) {
        item = "unplanned";
        unplanned_labels[a.label] += a.bytes;
      }
      if (item == "activations") activation_labels[a.label] += a.bytes;
      mine[item] += a.bytes;
      live += a.bytes;
      if (a.label == "meshtrain::scratch_weight" || a.label == "meshtrain::scratch_prefetch" ||
          a.label == "meshtrain::scratch_weight_16bit") {
        mine["weight buffers"] += a.bytes;
      }
    }
    const std::vector<std::string> items = {"activations", "gathered weights", "weight buffers",
                                            "unplanned"};
    std::vector<int64_t> values;
    for (const std::string& item : items) values.push_back(mine[item]);
    values.push_back(live);  // last: the rank's live Kokkos total
    const int count = static_cast<int>(values.size());
    std::vector<int64_t> all(rank == 0 ? static_cast<size_t>(size) * values.size() : 0);
    check_mpi(MPI_Gather(values.data(), count, MPI_INT64_T, all.data(), count, MPI_INT64_T, 0,
                         MPI_COMM_WORLD),
              "MPI_Gather of the measured bytes");
    if (rank == 0) {
      // The rank with the largest live total (the first of equals), and its items.
      int largest_rank = 0;
      for (int r = 1; r < size; ++r) {
        if (all[(r + 1) * count - 1] > all[(largest_rank + 1) * count - 1]) largest_rank = r;
      }
      const std::vector<int64_t> largest(all.begin() + largest_rank * count,
                                         all.begin() + (largest_rank + 1) * count);
      const meshtrain::PlannedMemory& p = run.planned_memory();
      nlohmann::json line;
      line["bench"] = "memory_items";
      line["config"] = config_path;
      line["set"] = overrides;
      line["rank"] = largest_rank;
      for (size_t i = 0; i < items.size(); ++i) line["measured"][items[i]] = largest[i];
      line["measured"]["kokkos"] = largest.back();
      line["planned"]["activations"] = p.workspace.activation_bytes + p.evaluation.activation_bytes;
      line["planned"]["gathered weights"] =
          p.workspace.gathered_weight_bytes + p.evaluation.gathered_weight_bytes;
      line["planned"]["sixteen_bit_copy_bytes"] = p.workspace.sixteen_bit_copy_bytes;
      line["planned"]["kokkos"] = p.kokkos_bytes();
      line["planned"]["total"] = p.total_bytes();
      line["unplanned_bytes_rank0"] = unplanned_labels;
      line["activation_bytes_rank0"] = activation_labels;
      std::cout << line.dump() << std::endl;
    }
    return 0;
  });
}
