#include "run/run_common.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "base/error.hpp"
#include "framework/comm/failure_agreement.hpp"
#include "framework/comm/mpi_util.hpp"
#include "framework/observe/device_timer.hpp"
#include "framework/observe/trace.hpp"

namespace meshtrain {

OptimizerSettings optimizer_settings(const OptimizerSection& section) {
  OptimizerSettings settings;
  settings.kind = section.kind;
  settings.momentum = static_cast<float>(section.momentum);
  settings.beta1 = static_cast<float>(section.betas.first);
  settings.beta2 = static_cast<float>(section.betas.second);
  settings.eps = static_cast<float>(section.eps);
  settings.weight_decay = static_cast<float>(section.weight_decay);
  return settings;
}

void ensure_writable_directory(const std::string& dir, const char* key) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  const std::string probe = dir + "/.meshtrain-write-test";
  std::FILE* file = ec ? nullptr : std::fopen(probe.c_str(), "w");
  if (!file) {
    MESHTRAIN_BAD_INPUT("cannot write to the directory '", dir, "' (", key,
                        "): ", ec ? ec.message() : std::strerror(errno));
  }
  std::fclose(file);
  std::remove(probe.c_str());
}

std::string run_directory(const RunConfig& config) {
  return config.run.output_dir.empty() ? "runs/" + config.run.name : config.run.output_dir;
}

TraceClock start_trace(MPI_Comm comm, int rank, const RuntimeSection& runtime,
                       const std::string& dir) {
  // The others write theirs only after the collectives below.
  if (rank == 0) remove_trace_files(dir);
  TraceClock clock;
  clock.offset_ns = clock_offset_to_rank0_ns(comm);
  clock.origin_ns = Tracer::now_ns() + clock.offset_ns;
  check_mpi(MPI_Bcast(&clock.origin_ns, 1, MPI_INT64_T, 0, comm), "MPI_Bcast (trace origin)");
  const int64_t steps = runtime.trace_last - runtime.trace_first + 1;
  tracer().start(static_cast<std::size_t>(std::min<int64_t>(steps, 64)) << 16);
  return clock;
}

void write_traces(MPI_Comm comm, int rank, const TraceClock& clock, const std::string& dir,
                  const RunConfig& config, const std::function<void()>& more_on_rank0) {
  int ranks = 1;
  check_mpi(MPI_Comm_size(comm, &ranks), "MPI_Comm_size");
  on_every_rank(comm, [&] {
    std::error_code error;
    std::filesystem::create_directories(dir, error);
    if (error) MESHTRAIN_FAIL("cannot create the trace folder '", dir, "': ", error.message());
    write_chrome_trace(tracer().events(), device_timer::resolve(), tracer().lane_events(),
                       tracer().dropped(), rank, ranks, clock.offset_ns, clock.origin_ns,
                       dir + "/rank-" + std::to_string(rank) + ".json");
  });
  on_every_rank(comm, [&] {
    if (rank != 0) return;
    std::vector<std::string> paths;
    for (int r = 0; r < ranks; ++r) paths.push_back(dir + "/rank-" + std::to_string(r) + ".json");
    merge_chrome_traces(paths, dir + "/all-ranks.json");
    // The run's config beside it: `meshtrain trace-report` predicts the step from it.
    write_trace_file(dir + "/config.toml", config_to_toml(config));
    if (more_on_rank0) more_on_rank0();
  });
}

}  // namespace meshtrain
