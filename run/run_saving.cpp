// Checkpoints of a TrainingRun: saving (synchronous or in the background), resuming from
// the run's own latest checkpoint, and loading another run's parameters and statistics
// (checkpoint.init_from, meshtrain evaluate).

#include "run/training_run.hpp"

#include <mpi.h>

#include <optional>
#include <string>
#include <vector>

#include "base/error.hpp"
#include "framework/comm/failure_agreement.hpp"
#include "framework/comm/mpi_util.hpp"
#include "framework/core/choices.hpp"
#include "framework/observe/trace.hpp"
#include "framework/train/resume.hpp"

namespace meshtrain {
namespace {
// Rank 0's value on every rank of `comm`.
std::optional<std::string> broadcast_from_rank0(const std::optional<std::string>& value,
                                                MPI_Comm comm) {
  const char* op = "MPI_Ibcast (the checkpoint to resume)";
  int present = value.has_value() ? 1 : 0;
  broadcast_collective(&present, 1, MPI_INT, 0, comm, op);
  if (!present) return std::nullopt;
  std::string text = value.value_or(std::string());
  broadcast_string(text, 0, comm, op);
  return text;
}

}  // namespace

std::string TrainingRun::start_save() {
  // The train state is copied by save() (the tensors by the staging copy), so changing it
  // here does not touch a checkpoint in flight.
  TrainState& state = checkpoint_.train_state;
  state.step = steps_done_;
  state.epoch = schedule_->epoch_of(steps_done_);
  state.batch_in_epoch = steps_done_ % schedule_->steps_per_epoch();
  state.seed = config_.run.seed;
  state.optimizer_step = optimizer_->step_count();
  state.data_order = schedule_->order().name();
  state.loss_scale = scaler_ ? scaler_->scale() : 0.0;
  state.loss_scale_clean_steps = scaler_ ? scaler_->clean_steps() : 0;
  state.best_metric = best_metric_;
  state.evals_since_best = evals_since_best_;
  state.best_metric_name = to_string(best_metric_kind());
  // The best evaluation so far is this step's: this checkpoint becomes `best`.
  const bool best = config_.checkpoint.keep_best && best_step_ == steps_done_;
  // The stream's buffers as they are now (collective; a pull waits for the snapshot).
  if (!checkpoint_.stream.tensors.empty()) {
    on_every_rank(comm_, [&] { stream_->checkpoint_state(checkpoint_.stream); });
  }
  std::string path;
  TraceSpan span("checkpoint save");
  answer_stream_closes();  // the waits below may be long
  on_every_rank(comm_, [&] {
    report_checkpoint(checkpointer_->wait());  // the previous one, when still in flight
    in_flight_step_ = steps_done_;
    path = checkpointer_->save(checkpoint_, config_.checkpoint.dir, config_.checkpoint.keep, best);
    // A synchronous save is complete when save() returns: nothing is left in flight.
    if (!checkpointer_->async()) report_checkpoint(path);
  });
  return path;
}

std::optional<std::string> TrainingRun::finish_save() {
  std::optional<std::string> path;
  answer_stream_closes();  // before and after the wait, which may be long
  on_every_rank(comm_, [&] { path = checkpointer_->wait(); });
  answer_stream_closes();
  report_checkpoint(path);
  return path;
}

std::string TrainingRun::save() {
  const std::string path = start_save();
  finish_save();
  return path;
}

void TrainingRun::report_checkpoint(const std::optional<std::string>& path) {
  if (path) window_.mark_save();  // its completion is in the window's saving time
  if (path && events_.on_checkpoint) events_.on_checkpoint(in_flight_step_, *path);
}

void TrainingRun::resume() {
  // Rank 0 reads the pointer and every rank follows its answer: on a lagging shared file
  // system another rank might not see the pointer yet, and must not start alone.
  std::optional<std::string> latest;
  on_every_rank(comm_, [&] {
    if (rank_ == 0) latest = find_latest_checkpoint(config_.checkpoint.dir);
  });
  latest = broadcast_from_rank0(latest, comm_);
  if (!latest) return;
  // Same data order and model, and a step before the end, before any tensor is read.
  int stream_buffer_saved = 0;
  on_every_rank(comm_, [&] {
    if (rank_ == 0) {
      const CheckpointListing listing = list_checkpoint(*latest);
      const CheckpointInfo& saved = listing.info;
      // Before the data order's check, which another trainer mesh also fails (its schedule
      // counts the buffers' slots of every group), with a sentence about the data.
      if (!checkpoint_.stream.tensors.empty()) {
        stream_buffer_saved = check_stream_buffer_fits(listing) ? 1 : 0;
      }
      check_resume_compatible(config_, saved, total_steps_, schedule_->order().name());
      const std::string warning =
          learning_rate_change_warning(config_, saved, total_steps_, schedule_->steps_per_epoch());
      if (!warning.empty()) warnings_.push_back(warning);
    }
  });
  // load_checkpoint throws the same error on every rank, after the same collectives. The
  // stream's buffers with the rest, when the checkpoint holds them.
  broadcast_collective(&stream_buffer_saved, 1, MPI_INT, 0, comm_,
                       "MPI_Ibcast (whether the checkpoint holds the stream's buffers)");
  std::vector<ShardedTensor> stream_tensors;
  if (!stream_buffer_saved) std::swap(stream_tensors, checkpoint_.stream.tensors);
  CheckpointInfo info;
  on_every_rank(comm_, [&] { info = load_checkpoint(*latest, checkpoint_, comm_); });
  model_->masters_written();  // through checkpoint_'s views: the 16-bit copies are cast again
  if (!stream_buffer_saved) std::swap(stream_tensors, checkpoint_.stream.tensors);
  if (stream_buffer_saved) {
    std::vector<int64_t> rows_seen(static_cast<size_t>(stream_->groups() * 2), 0);
    on_every_rank(comm_, [&] {
      if (rank_ == 0) {
        rows_seen = read_stream_rows_seen(info.path);
        if (rows_seen.size() != static_cast<size_t>(stream_->groups() * 2)) {
          MESHTRAIN_BAD_INPUT("checkpoint '", info.path, "': /stream/rows_seen counts ",
                              rows_seen.size() / 2, " batch groups, but its buffers hold ",
                              stream_->groups());
        }
      }
    });
    broadcast_collective(rows_seen.data(), static_cast<int>(rows_seen.size()), MPI_INT64_T, 0,
                         comm_, "MPI_Ibcast (the stream's rows in the checkpoint)");
    on_every_rank(comm_, [&] { stream_->restore(rows_seen); });
  }
  steps_done_ = info.train_state.step;
  optimizer_->set_step_count(info.train_state.optimizer_step);
  // A run saved without loss scaling (bf16, fp32) resumed under fp16 starts at the initial scale.
  if (scaler_ && info.train_state.loss_scale > 0) {
    scaler_->restore(info.train_state.loss_scale, info.train_state.loss_scale_clean_steps);
  }
  // The run's statistics are the checkpoint's: never computed again.
  normalization_ = read_checkpoint_normalization(info.path, "checkpoint");
  checkpoint_.normalization = normalization_;
  // The saved best only when it measured this run's metric (keep_best may have changed).
  const ResumedBest best = resumed_best(info.train_state, best_metric_kind());
  best_metric_ = best.metric;
  evals_since_best_ = best.evals_since;
  resume_note_ = best.note;
  stopped_early_ =
      config_.train.early_stopping > 0 && evals_since_best_ >= config_.train.early_stopping;
  resumed_from_ = info;
}

// Rank 0, resuming an online run that saves its buffers: whether the checkpoint holds them
// (a run saved with stream.checkpoint_buffer = false starts with empty buffers, said in a
// warning); bad_input, one sentence, when it holds buffers of another shape (another trainer
// mesh, buffer_rows, or held-out window size): they are not redistributed. By shape alone:
// another test_fraction with the same window size is accepted (docs/online.md).
bool TrainingRun::check_stream_buffer_fits(const CheckpointListing& listing) {
  const std::vector<ShardedTensor>& wanted = checkpoint_.stream.tensors;
  bool any = false;
  for (const DatasetListing& d : listing.datasets) any = any || d.path.rfind("/stream/", 0) == 0;
  if (!any) {
    warnings_.push_back(detail::concat(
        "checkpoint '", listing.info.path, "' holds no buffer of stream \"", config_.stream.name,
        "\" (saved with stream.checkpoint_buffer = false?): the resumed run starts with empty ",
        "buffers"));
    return false;
  }
  for (const ShardedTensor& t : wanted) {
    const std::string path = "/stream/" + t.name;
    std::vector<int64_t> saved;
    for (const DatasetListing& d : listing.datasets) {
      if (d.path == path) saved = d.shape;
    }
    if (saved != t.global_shape) {
      MESHTRAIN_BAD_INPUT(
          "checkpoint '", listing.info.path, "' holds stream buffers ", path, " of shape ",
          saved.empty() ? std::string("(none)") : format_shape(saved),
          " [batch groups, rows, width], but this run keeps ", format_shape(t.global_shape), " (",
          stream_->groups(), " batch groups of mesh ", mesh_->describe(),
          ", stream.buffer_rows = ", config_.stream.buffer_rows,
          ", stream.test_fraction = ", config_.stream.test_fraction,
          ", held-out window = ", stream_held_out_rows(config_.stream), " rows",
          "); resume on the trainer mesh and [stream] keys it was saved with (the buffers ",
          "are not redistributed)");
    }
  }
  return true;
}

CheckpointInfo TrainingRun::load_model(const std::string& path) {
  // The parameters alone: the optimizer state, the step and the data position are this run's.
  CheckpointContents model_only;
  model_only.mesh = *mesh_;
  model_only.params = model_->parameters();
  CheckpointInfo info;
  on_every_rank(comm_, [&] { info = load_checkpoint(path, model_only, comm_); });
  normalization_ = read_checkpoint_normalization(info.path, "checkpoint");
  checkpoint_.normalization = normalization_;
  // The derivative term's scales are the statistics' stds.
  build_derivative_loss();
  if (train_stream_) {
    // Batches read ahead were standardized with the old statistics: read them again.
    train_stream_.reset();
    eval_stream_.reset();
    dy_stream_.reset();
    eval_seq_ = 0;
    start_streams();
  }
  return info;
}

Normalization TrainingRun::read_checkpoint_normalization(const std::string& file,
                                                         const std::string& role) {
  Normalization n;
  on_every_rank(comm_, [&] {
    if (rank_ == 0) n = read_normalization(file);
  });
  // Rank 0's vectors on every rank: their lengths, then their values.
  std::vector<double>* sides[] = {&n.input_mean, &n.input_std, &n.target_mean, &n.target_std};
  long long lengths[4];
  for (int i = 0; i < 4; ++i) lengths[i] = static_cast<long long>(sides[i]->size());
  broadcast_collective(lengths, 4, MPI_LONG_LONG, 0, comm_,
                       "MPI_Ibcast (the checkpoint's normalization statistics)");
  for (int i = 0; i < 4; ++i) {
    sides[i]->resize(static_cast<size_t>(lengths[i]));
    if (lengths[i] > 0) {
      broadcast_collective(sides[i]->data(), static_cast<int>(lengths[i]), MPI_DOUBLE, 0, comm_,
                           "MPI_Ibcast (the checkpoint's normalization statistics)");
    }
  }
  // The same values on every rank: every rank decides alike.
  on_every_rank(comm_, [&] {
    const DataShape& data = train_source_->shape();
    const auto check = [&](bool has, Normalize wanted, const char* key, const char* what,
                           size_t length, int64_t width) {
      const bool wants = wanted == Normalize::standard;
      if (has && !wants) {
        MESHTRAIN_BAD_INPUT(role, " '", file, "' holds ", what,
                            " statistics (its model was trained on standardized ", what, "s), but ",
                            config_.file, " sets ", key, " = \"none\"; set ", key,
                            " = \"standard\" (the statistics come from the checkpoint)");
      }
      if (!has && wants) {
        MESHTRAIN_BAD_INPUT(role, " '", file, "' holds no ", what,
                            " statistics (its model was trained on raw ", what, "s), but ",
                            config_.file, " sets ", key, " = \"standard\"; set ", key,
                            " = \"none\"");
      }
      if (has && static_cast<int64_t>(length) != width) {
        MESHTRAIN_BAD_INPUT(role, " '", file, "' holds ", what, " statistics of width ", length,
                            " but the data has width ", width);
      }
    };
    check(n.inputs(), config_.data.normalize_inputs, "data.normalize_inputs", "input",
          n.input_mean.size(), data.features);
    check(n.targets(), config_.data.normalize_targets, "data.normalize_targets", "target",
          n.target_mean.size(), data.output_width());
  });
  return n;
}

}  // namespace meshtrain
