// `meshtrain train`: argument handling and printing around a TrainingRun.

#include "apps/train.hpp"
#include "apps/command.hpp"

#include <mpi.h>

#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>

#include "framework/comm/collective_matmul.hpp"
#include "framework/comm/exit_policy.hpp"
#include "framework/comm/failure_agreement.hpp"
#include "framework/comm/mpi_util.hpp"
#include "framework/io/metrics.hpp"
#include "framework/train/config.hpp"
#include "framework/train/hardware_file.hpp"
#include "partition/planner.hpp"
#include "run/dlrm_run.hpp"
#include "run/training_run.hpp"

namespace meshtrain {
namespace {

void print_line(const std::string& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

// What rank 0 prints while the run trains; other ranks print nothing.
RunEvents printing_events(bool rank0) {
  RunEvents events;
  if (!rank0) return events;
  events.on_log = [](const LogEvent& e) { print_line(format_log_line(e)); };
  events.on_eval = [](const EvalEvent& e) { print_line(format_eval_line(e)); };
  events.on_checkpoint = [](int64_t, const std::string& path) { print_line("checkpoint " + path); };
  events.on_warning = [](const std::string& warning) {
    std::fprintf(stderr, "warning: %s\n", warning.c_str());
    std::fflush(stderr);
  };
  // The end's figures are in the done line; a run above its plan is warned about once.
  events.on_memory = [warned = std::make_shared<bool>(false)](const MemoryEvent& e) {
    if (e.when != "end") print_line(format_memory_line(e));
    if (e.over_plan && !*warned) {
      *warned = true;
      std::fprintf(stderr, "warning: %s\n", format_memory_warning(e).c_str());
      std::fflush(stderr);
    }
  };
  return events;
}

// The command's ranks. Under MPMD (`mpirun -np 8 ./sim : -np 2 meshtrain train online.toml`,
// docs/online.md) every program takes its part of MPI_COMM_WORLD by MPI_APPNUM: the split is
// collective over the whole job, so the simulation makes it too (the usual MPMD idiom). A
// job of meshtrain alone keeps MPI_COMM_WORLD.
int train_on(MPI_Comm comm, const std::string& config_path,
             const std::vector<std::string>& overrides, const std::string& hardware);

MPI_Comm program_communicator() {
  int* appnum = nullptr;
  int flag = 0;
  check_mpi(MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_APPNUM, &appnum, &flag),
            "MPI_Comm_get_attr (MPI_APPNUM)");
  int world_rank = 0, world_size = 1, size = 1;
  check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(MPI_COMM_WORLD, &world_size), "MPI_Comm_size");
  MPI_Comm comm = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split(MPI_COMM_WORLD, flag && appnum ? *appnum : 0, world_rank, &comm),
            "MPI_Comm_split (this program's part of an MPMD job)");
  check_mpi(MPI_Comm_size(comm, &size), "MPI_Comm_size");
  if (size == world_size) {
    check_mpi(MPI_Comm_free(&comm), "MPI_Comm_free");
    return MPI_COMM_WORLD;
  }
  return comm;  // lives as long as the process
}

}  // namespace

int train_command(const std::string& config_path, const std::vector<std::string>& overrides,
                  const std::string& hardware) {
  const MPI_Comm comm = program_communicator();
  const int64_t rendezvous_before = stream_rendezvous_count();
  try {
    return train_on(comm, config_path, overrides, hardware);
  } catch (const AgreedError& error) {
    // Under MPMD the simulation may wait in its stream's connect: it is told why.
    if (comm != MPI_COMM_WORLD && stream_rendezvous_count() == rendezvous_before) {
      stream_trainer_failed(error.what());
    }
    return report_agreed_error(error, comm);  // every rank holds it
  }
}

namespace {

// What a run (TrainingRun or DlrmRun) prints on rank 0 before its first step: where it starts
// from, its description, and what loading decided for the user (--set train.steps replacing the
// file's epochs).
template <typename Run>
void print_run_start(const Run& run, const std::string& resume_note) {
  if (const auto& info = run.resumed_from()) {
    std::printf("resumed from %s at step %lld (saved on %s)%s%s\n", info->path.c_str(),
                static_cast<long long>(info->train_state.step), info->mesh.c_str(),
                resume_note.empty() ? "" : "; ", resume_note.c_str());
  } else if (const auto& from = run.initialized_from()) {
    std::printf("initialized from %s (step %lld, saved on %s): starting from step 0\n",
                from->path.c_str(), static_cast<long long>(from->train_state.step),
                from->mesh.c_str());
  } else if (run.config().checkpoint.resume) {
    std::printf("no checkpoint in %s: starting from step 0\n", run.config().checkpoint.dir.c_str());
  }
  const std::vector<std::string> lines = run.describe();
  std::printf("meshtrain train %s: %s\n", run.config().file.c_str(), lines.front().c_str());
  for (size_t i = 1; i < lines.size(); ++i) std::printf("%s\n", lines[i].c_str());
  for (const std::string& note : run.config().notes) std::printf("note: %s\n", note.c_str());
  std::fflush(stdout);
}

// kind = "dlrm" (docs/recsys.md): a DlrmRun, printed as TrainingRun's run is.
int train_dlrm(MPI_Comm comm, RunConfig config) {
  int rank = 0;
  check_mpi(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
  const bool rank0 = rank == 0;
  const RunEvents printing = printing_events(rank0);
  DlrmRunEvents events{printing.on_log, printing.on_eval, printing.on_checkpoint};
  DlrmRun run(std::move(config), events, comm);
  if (rank0) print_run_start(run, "");
  const DlrmRunSummary summary = run.train();
  if (rank0 && summary.steps_run == 0) {
    std::printf(
        "done: the checkpoint is at step %lld, the last step of the run: nothing to train\n",
        static_cast<long long>(run.steps_done()));
  } else if (rank0) {
    std::printf("done: %lld steps in %s (%.1f s), %.1f samples/s",
                static_cast<long long>(summary.steps_run), format_duration(summary.wall_s).c_str(),
                summary.wall_s, summary.samples_per_s);
    if (summary.last_eval) {
      std::printf(", final test AUC %.4f, log loss %.5f", summary.last_eval->test_auc,
                  summary.last_eval->test_log_loss);
    }
    std::printf("\n");
  }
  if (rank0) std::printf("metrics: %s/metrics.jsonl\n", run.config().run.output_dir.c_str());
  return 0;
}

// The command on `comm`, its ranks.
int train_on(MPI_Comm comm, const std::string& config_path,
             const std::vector<std::string>& overrides, const std::string& hardware) {
  int rank = 0;
  check_mpi(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
  const bool rank0 = rank == 0;

  std::optional<RunConfig> config;
  if (auto error = run_agreed(comm, [&] {
        config = load_config(config_path, overrides);
        if (!hardware.empty()) set_collective_matmul_hardware(read_hardware_profile(hardware));
      })) {
    throw *error;
  }
  if (config->model.kind == ModelKind::dlrm) return train_dlrm(comm, std::move(*config));
  TrainingRun run(*config, printing_events(rank0), std::nullopt, comm);
  if (rank0) {
    print_run_start(run, run.resume_note());
    // Mesh axes that split neither parameters nor rows: their ranks repeat each other's work.
    const ShardingPlan& plan = run.plan();
    for (const std::string& axis : plan.replicated_axes) {
      std::fprintf(stderr, "warning: %s\n",
                   replicated_axis_note(axis, plan.mesh.axis_size(axis)).c_str());
    }
    for (const std::string& warning : run.warnings()) {
      std::fprintf(stderr, "warning: %s\n", warning.c_str());
    }
    std::fflush(stderr);
  }

  const RunSummary summary = run.train();
  if (rank0 && run.stopped_early()) {
    std::printf(
        "stopped early at step %lld: %s did not improve in %lld evaluations (best %.5g)\n",
        static_cast<long long>(run.steps_done()),
        to_string(run.config().checkpoint.keep_best.value_or(EvalMetric::test_loss)).c_str(),
        static_cast<long long>(run.config().train.early_stopping), run.best_metric());
  }
  if (rank0 && summary.steps_run == 0) {
    std::printf(
        "done: the checkpoint is at step %lld, the last step of the run: nothing to train\n",
        static_cast<long long>(run.steps_done()));
  } else if (rank0) {
    std::printf("done: %lld steps in %s (%.1f s), %.1f samples/s, %.4f TFLOP/s per rank",
                static_cast<long long>(summary.steps_run), format_duration(summary.wall_s).c_str(),
                summary.wall_s, summary.samples_per_s, summary.tflops_per_rank);
    if (summary.last_eval && !std::isnan(summary.last_eval->test_accuracy)) {
      std::printf(", final test accuracy %.4f", summary.last_eval->test_accuracy);
    } else if (summary.last_eval) {
      std::printf(", final test loss %.5f", summary.last_eval->test_loss);
    }
    if (summary.memory)
      std::printf("; memory per rank: %s", format_memory_figures(*summary.memory).c_str());
    std::printf("\n");
  }
  if (rank0) std::printf("metrics: %s/metrics.jsonl\n", run.config().run.output_dir.c_str());
  return 0;
}

}  // namespace

}  // namespace meshtrain
