// The training loop, top to bottom: config -> mesh -> plan -> communicators -> data ->
// model -> loss -> optimizer -> (resume) -> steps, with evaluation and checkpoints ->
// summary. Everything the step touches is allocated before the first step.

#include "apps/train.hpp"

#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <limits>
#include <optional>

#include "framework/checkpoint.hpp"
#include "framework/config.hpp"
#include "framework/data.hpp"
#include "framework/init.hpp"
#include "framework/metrics.hpp"
#include "framework/optimizer.hpp"
#include "framework/runtime.hpp"
#include "layers/loss.hpp"
#include "layers/mlp.hpp"
#include "partition/error.hpp"
#include "partition/logical_axes.hpp"
#include "partition/planner.hpp"

namespace meshtrain {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Thrown after an error was printed once for the whole job; carries the exit status.
struct Reported {
  int exit_status;
};

// Runs one setup phase on every rank and agrees on the outcome (run_agreed). When it threw
// on any rank, rank 0 prints the lowest failing rank's message (one sentence for the whole
// job, not one per rank) and every rank throws Reported. A phase must not contain
// collectives that a failing rank would skip; those phases run unguarded (run_or_abort ends
// every rank).
void agree(const std::function<void()>& phase) {
  if (std::optional<Error> error = run_agreed(MPI_COMM_WORLD, phase)) {
    int rank = 0;
    check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &rank), "MPI_Comm_rank");
    if (rank == 0) std::fprintf(stderr, "meshtrain: error: %s\n", error->what());
    throw Reported{exit_status_for(*error)};
  }
}

// Creates `dir` (and its parents) and checks that a file can be made in it; bad_input
// naming the config key otherwise.
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

// Rank 0's value on every rank.
std::optional<std::string> broadcast_from_rank0(const std::optional<std::string>& value) {
  long long length = value ? static_cast<long long>(value->size()) : -1;
  check_mpi(MPI_Bcast(&length, 1, MPI_LONG_LONG, 0, MPI_COMM_WORLD), "MPI_Bcast");
  if (length < 0) return std::nullopt;
  std::string text = value.value_or(std::string(static_cast<size_t>(length), '\0'));
  check_mpi(MPI_Bcast(text.data(), checked_int(text.size(), "checkpoint path length"), MPI_CHAR, 0,
                      MPI_COMM_WORLD),
            "MPI_Bcast");
  return text;
}

// The batch buffers of one rank: inputs and either labels or targets.
struct Batch {
  BatchInputs x;
  BatchLabels labels;
  BatchTargets targets;
  Batch(const Dataset& data, int64_t rows, int64_t features)
      : x("meshtrain::batch_x", rows, features) {
    if (data.classification()) {
      labels = BatchLabels("meshtrain::batch_labels", rows);
    } else {
      targets = BatchTargets("meshtrain::batch_targets", rows, data.output_width());
    }
  }
  UnmanagedMatrix inputs() const { return UnmanagedMatrix(x.data(), x.extent(0), x.extent(1)); }
};

LossResult compute_loss(Loss& loss, UnmanagedMatrix output, const Batch& batch, bool with_gradient,
                        int64_t valid_rows = -1) {
  if (loss.kind() == LossKind::cross_entropy) {
    return loss.cross_entropy(output, batch.labels, with_gradient, valid_rows);
  }
  UnmanagedMatrix targets(batch.targets.data(), batch.targets.extent(0), batch.targets.extent(1));
  return loss.mse(output, targets, with_gradient, valid_rows);
}

// Loss (and accuracy for classification) over the whole test split, sharded over the
// batch axes like training; Loss reduces each batch's sums over the ranks.
EvalEvent evaluate(Mlp& model, Loss& loss, const Dataset& test, const EvalSchedule& schedule,
                   const BatchSlice& slice, Batch& batch, int64_t step) {
  double loss_sum = 0.0;
  int64_t correct = 0, count = 0;
  for (int64_t b = 0; b < schedule.num_batches; ++b) {
    const int64_t valid = test.classification()
                              ? fill_eval_batch(test, schedule, b, slice, batch.x, batch.labels)
                              : fill_eval_batch(test, schedule, b, slice, batch.x, batch.targets);
    const LossResult r = compute_loss(loss, model.forward(batch.inputs()), batch, false, valid);
    loss_sum += r.loss_sum;
    correct += r.correct;
    count += r.count;
  }
  EvalEvent event;
  event.step = step;
  event.test_loss = count ? loss_sum / count : std::numeric_limits<double>::quiet_NaN();
  event.test_accuracy = test.classification() && count ? static_cast<double>(correct) / count
                                                       : std::numeric_limits<double>::quiet_NaN();
  return event;
}

}  // namespace

int train_command(const std::string& config_path, const std::vector<std::string>& overrides,
                  Runtime& runtime) try {
  const int rank = runtime.world_rank();
  const bool rank0 = rank == 0;

  // --- What to run: config, mesh and the plan (the same one `meshtrain plan` prints). ---
  RunConfig config;
  std::optional<Mesh> mesh;
  std::optional<ShardingPlan> plan;
  std::optional<LogicalAxes> logical;
  agree([&] {
    config = load_config(config_path, overrides);
    mesh = config.mesh.resolve(runtime.world_size());
    // The same plan `meshtrain plan` prints, layer layouts included.
    plan = make_plan(mlp_parameter_shapes(config.model.sizes), *mesh, partition_rules(config),
                     plan_options(config), mlp_linear_layers(config.model.sizes));
    logical = LogicalAxes::with_overrides(config.partition.logical_axes);
  });
  const std::vector<int64_t>& sizes = config.model.sizes;
  const int64_t global_batch = config.data.batch_size;

  // --- Data: every rank holds the dataset and copies its slice of each global batch. ----
  std::optional<Dataset> train_data, test_data;
  std::optional<BatchSchedule> schedule;
  std::optional<BatchSlice> slice;
  agree([&] {
    train_data =
        load_dataset(config.data, Split::train, config.run.seed, sizes.front(), sizes.back());
    test_data =
        load_dataset(config.data, Split::test, config.run.seed, sizes.front(), sizes.back());
    schedule.emplace(train_data->num_samples, global_batch, config.data.shuffle, config.run.seed);
    slice = make_batch_slice(*mesh, rank, logical->axes_of("batch"), global_batch);
  });
  const int64_t total_steps =
      config.train.steps ? *config.train.steps : *config.train.epochs * schedule->steps_per_epoch();

  // --- Model, loss, optimizer: collective construction, identical on every rank. --------
  MeshCommunicators comms(*mesh);
  CollectiveMatmulAlgorithm algorithm =
      parse_collective_matmul_algorithm(config.partition.collective_matmul);
  ParallelContext context = ParallelContext::from_logical_axes(comms, *logical, algorithm);
  Mlp model(sizes, parse_activation(config.model.activation), specs_from_plan(*plan), context,
            slice->rows);
  model.initialize(parse_init_scheme(config.model.init), config.run.seed);
  Loss loss(parse_loss_kind(config.model.loss), context, slice->rows, sizes.back(),
            model.output_layout());

  OptimizerSettings settings;
  settings.kind = parse_optimizer_kind(config.optimizer.kind);
  settings.momentum = static_cast<float>(config.optimizer.momentum);
  settings.beta1 = static_cast<float>(config.optimizer.betas.first);
  settings.beta2 = static_cast<float>(config.optimizer.betas.second);
  settings.eps = static_cast<float>(config.optimizer.eps);
  settings.weight_decay = static_cast<float>(config.optimizer.weight_decay);
  Optimizer optimizer(settings, model.parameters());
  GradientClipper clipper(*mesh, rank, model.gradients());
  const float lr = static_cast<float>(config.optimizer.lr);
  Communicator& world = runtime.world();  // created here: its first use is collective

  Batch batch(*train_data, slice->rows, sizes.front());
  const EvalSchedule eval_schedule = EvalSchedule::create(test_data->num_samples, global_batch);

  // The checkpoint views the live tensors (no copies): a save writes them, a load fills them.
  CheckpointContents checkpoint;
  checkpoint.mesh = *mesh;
  checkpoint.config_text = config.text;
  checkpoint.params = model.parameters();
  for (const std::string& slot : optimizer.slot_names()) {
    checkpoint.opt_state.push_back({slot, optimizer.slot(slot)});
  }
  // Saves run in the background when checkpoint.async is on: the writer copies the tensors
  // before the next optimizer step (wait_snapshot), each step polls for completion, and the
  // end of the run waits. A failed save is one error for the whole job (agree). Any other
  // way out of this function joins the writer (~Checkpointer) and leaves `latest` as it was.
  Checkpointer checkpointer(MPI_COMM_WORLD, config.checkpoint.async);
  auto report = [&](const std::optional<std::string>& path) {
    if (rank0 && path) std::printf("checkpoint %s\n", path->c_str());
  };
  auto save = [&](int64_t step) {
    checkpoint.train_state.step = step;
    checkpoint.train_state.epoch = schedule->epoch_of(step);
    checkpoint.train_state.batch_in_epoch = step % schedule->steps_per_epoch();
    checkpoint.train_state.seed = config.run.seed;
    checkpoint.train_state.optimizer_step = optimizer.step_count();
    agree([&] {
      report(checkpointer.wait());  // the previous one, when still in flight
      checkpointer.save(checkpoint, config.checkpoint.dir, config.checkpoint.keep);
      if (!checkpointer.async()) report(checkpointer.wait());
    });
  };

  int64_t first_step = 0;
  if (config.checkpoint.resume) {
    // Rank 0 reads the pointer and every rank follows its answer: on a lagging shared
    // file system another rank might not see the pointer yet, and must not start alone.
    std::optional<std::string> latest;
    agree([&] {
      if (rank0) latest = find_latest_checkpoint(config.checkpoint.dir);
    });
    latest = broadcast_from_rank0(latest);
    if (latest) {
      // load_checkpoint throws the same error on every rank, after the same collectives.
      CheckpointInfo info;
      agree([&] {
        info = load_checkpoint(*latest, checkpoint, MPI_COMM_WORLD);
        if (info.train_state.seed != config.run.seed) {
          MESHTRAIN_BAD_INPUT("checkpoint '", info.path,
                              "' was saved by a run with run.seed = ", info.train_state.seed,
                              " but ", config.file, " has run.seed = ", config.run.seed,
                              ": resuming would change the data order");
        }
      });
      first_step = info.train_state.step;
      optimizer.set_step_count(info.train_state.optimizer_step);
      if (rank0) {
        std::printf("resumed from %s at step %lld (saved on %s)\n", info.path.c_str(),
                    static_cast<long long>(first_step), info.mesh.c_str());
      }
    } else if (rank0) {
      std::printf("no checkpoint in %s: starting from step 0\n", config.checkpoint.dir.c_str());
    }
  }

  // A resumed run appends to the metrics of the run it continues.
  // Output and checkpoint directories are made (and found writable) before the first step,
  // not discovered unusable at the end of the run. A resumed run appends to its metrics.
  std::optional<MetricsLog> metrics;
  agree([&] {
    metrics.emplace(config.run.output_dir, rank0, /*append=*/first_step > 0);
    if (rank0) ensure_writable_directory(config.checkpoint.dir, "checkpoint.dir");
  });
  if (rank0) {
    std::printf(
        "meshtrain train %s: %d ranks, mesh %s, batch %lld (%lld rows per rank), %lld steps\n",
        config.file.c_str(), mesh->world_size(), mesh->short_description().c_str(),
        static_cast<long long>(global_batch), static_cast<long long>(slice->rows),
        static_cast<long long>(total_steps));
    for (const std::string& line : model.describe()) std::printf("  %s\n", line.c_str());
    std::fflush(stdout);
  }

  // --- The steps. -----------------------------------------------------------------------
  const auto run_start = Clock::now();
  auto window_start = run_start;
  double window_loss = 0.0;
  int64_t window_steps = 0;
  std::optional<EvalEvent> last_eval;
  for (int64_t step = first_step; step < total_steps; ++step) {
    if (train_data->classification()) {
      fill_batch(*train_data, *schedule, step, *slice, batch.x, batch.labels);
    } else {
      fill_batch(*train_data, *schedule, step, *slice, batch.x, batch.targets);
    }
    UnmanagedMatrix output = model.forward(batch.inputs());
    const LossResult result = compute_loss(loss, output, batch, true);
    // The loss is reduced over the ranks, so every rank stops here together.
    if (!std::isfinite(result.loss)) {
      if (rank0) {
        std::fprintf(stderr,
                     "meshtrain: error: the training loss became %s at step %lld; lower "
                     "optimizer.lr (now %g) or set optimizer.clip_norm\n",
                     std::isnan(result.loss) ? "NaN" : "infinite", static_cast<long long>(step + 1),
                     config.optimizer.lr);
      }
      return 1;
    }
    model.backward(loss.gradient());
    if (config.optimizer.clip_norm > 0) {
      clipper.clip(model.gradients(), config.optimizer.clip_norm, world);
    }
    checkpointer.wait_snapshot();  // a save in flight has copied the tensors it writes
    optimizer.step(model.parameters(), model.gradients(), lr);

    const int64_t done = step + 1;
    window_loss += result.loss;
    ++window_steps;
    if (done % config.train.log_every == 0 || done == total_steps) {
      const double elapsed = seconds_since(window_start);
      LogEvent event;
      event.step = done;
      event.total_steps = total_steps;
      event.epoch = schedule->epoch_of(step);
      event.loss = window_loss / window_steps;
      event.samples_per_s = elapsed > 0 ? window_steps * global_batch / elapsed : 0.0;
      event.eta_s = (total_steps - done) * elapsed / window_steps;
      metrics->log(event);
      window_start = Clock::now();
      window_loss = 0.0;
      window_steps = 0;
    }
    const bool eval_now = config.train.eval_every > 0 && done % config.train.eval_every == 0;
    if ((eval_now || done == total_steps) && eval_schedule.num_batches > 0) {
      last_eval = evaluate(model, loss, *test_data, eval_schedule, *slice, batch, done);
      metrics->eval(*last_eval);
    }
    const bool checkpoint_now =
        config.checkpoint.every_steps > 0 && done % config.checkpoint.every_steps == 0;
    if (checkpoint_now || done == total_steps) {
      save(done);
    } else if (checkpointer.in_flight()) {
      agree([&] { report(checkpointer.poll()); });
    }
  }
  agree([&] { report(checkpointer.wait()); });

  // --- Summary. -------------------------------------------------------------------------
  const double wall = seconds_since(run_start);
  const int64_t steps_run = total_steps - first_step;
  if (rank0) {
    std::printf("done: %lld steps in %s (%.1f s), %.1f samples/s",
                static_cast<long long>(steps_run), format_duration(wall).c_str(), wall,
                wall > 0 ? steps_run * global_batch / wall : 0.0);
    if (last_eval && !std::isnan(last_eval->test_accuracy)) {
      std::printf(", final test accuracy %.4f", last_eval->test_accuracy);
    } else if (last_eval) {
      std::printf(", final test loss %.5f", last_eval->test_loss);
    }
    std::printf("\n");
  }
  return 0;
} catch (const Reported& reported) {
  return reported.exit_status;
}

}  // namespace meshtrain
