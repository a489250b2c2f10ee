// A training run's loop: train() runs the steps with their log, evaluation and checkpoint
// events; step() is accumulate_loaded_batch (forward, loss, backward) for each micro-batch,
// then apply_update (reduce, unscale, clip, rate, optimizer), read top to bottom. Set-up is in
// run_setup.cpp, evaluation in run_evaluation.cpp, checkpoints in run_saving.cpp, traces and
// memory in run_observe.cpp; training_run.hpp has the order of set-up and the error contract.

#include "run/training_run.hpp"

#include <mpi.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "base/error.hpp"
#include "framework/comm/failure_agreement.hpp"
#include "framework/comm/mpi_util.hpp"
#include "framework/core/exec_space.hpp"
#include "framework/core/kernel_label.hpp"
#include "framework/core/tensor_values.hpp"
#include "framework/observe/trace.hpp"
#include "run/run_common.hpp"

namespace meshtrain {
namespace {
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// sum = g (first) or sum += g: the gradient of one micro-batch added to the step's sum.
void add_gradient(const Vector& sum, const Vector& g, bool first) {
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::accumulate_gradient"),
      Kokkos::RangePolicy<>(device_space(), 0, g.extent(0)),
      KOKKOS_LAMBDA(const int64_t i) { sum(i) = first ? g(i) : sum(i) + g(i); });
}

// g = (g + sum) / micro_batches: the mean gradient of the step's micro-batches, each
// already the mean over its own rows.
void finish_gradient(const Vector& g, const Vector& sum, int64_t micro_batches) {
  const float scale = 1.0f / static_cast<float>(micro_batches);
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::mean_gradient"),
      Kokkos::RangePolicy<>(device_space(), 0, g.extent(0)),
      KOKKOS_LAMBDA(const int64_t i) { g(i) = (g(i) + sum(i)) * scale; });
}

// out = x * scale + mean per input column: standardized points back in the data's units. A
// free function because nvcc refuses device lambdas in private member functions.
void to_data_units(const Matrix& x, const Vector& mean, const Vector& scale, const Matrix& out) {
  const int64_t inputs = static_cast<int64_t>(x.extent(1));
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::physics_points"),
      device_range(0, static_cast<int64_t>(x.extent(0))), KOKKOS_LAMBDA(const int64_t r) {
        for (int64_t i = 0; i < inputs; ++i) out(r, i) = x(r, i) * scale(i) + mean(i);
      });
}

}  // namespace

RunSummary TrainingRun::train() {
  // Output and checkpoint directories are made (and found writable) before the first
  // step, not discovered unusable at the end of the run. A resumed run appends to the
  // metrics of the run it continues.
  on_every_rank(comm_, [&] {
    metrics_ = std::make_unique<MetricsLog>(config_.run.output_dir, rank_ == 0,
                                            /*append=*/steps_done_ > 0);
    if (rank_ == 0) ensure_writable_directory(config_.checkpoint.dir, "checkpoint.dir");
  });

  RunSummary summary;
  const int64_t first_step = steps_done_;
  const auto start = Clock::now();
  window_.start();
  window_loss_ = 0.0;
  window_aux_loss_ = 0.0;
  window_steps_ = 0;
  data_wait_s_ = 0.0;
  train_stream_->take_wait_seconds();  // waits before train() are not its steps'
  try {
    train_steps(summary);
  } catch (const AgreedError& error) {
    // The simulation's producers are told first (they drop their rows from now on and finish
    // with a warning giving this sentence), not only when the run is destroyed.
    if (stream_) stream_->stop_producers(error.what());
    // Every rank stopped at the same step and is alive: complete the save in flight, the
    // last good state a user resumes from (with a lower lr, or after fixing the data).
    try {
      finish_save();
    } catch (const Error&) {
      // The save failed too: the error that stopped training is the one to report.
    }
    throw;
  } catch (const std::exception& error) {
    // An error on this rank alone (the program ends every rank): the producers are told too.
    if (stream_) stream_->stop_producers(error.what());
    throw;
  }
  finish_save();
  // Training completed: the stream ends with "done" to its producers, not a stop.
  if (stream_) stream_->finish();
  // The closes that came during the last evaluation and save are answered now, not when the
  // run is destroyed after the program's own code (the producers wait for it).
  answer_stream_closes();
  // A run that stopped inside its trace window (early stopping, fewer steps) writes what it
  // recorded.
  if (tracing_) end_trace();
  summary.wall_s = seconds_since(start);
  if (steps_done_ > first_step) report_memory("end", &summary);
  summary.steps_run = steps_done_ - first_step;
  summary.samples_per_s = summary.wall_s > 0 ? summary.steps_run * config_.data.batch_size *
                                                   accumulation_ / summary.wall_s
                                             : 0.0;
  summary.data_wait_s = data_wait_s_;
  summary.tflops_per_rank = summary.wall_s > 0 ? summary.steps_run * flops_per_step() /
                                                     mesh_->world_size() / summary.wall_s / 1e12
                                               : 0.0;
  return summary;
}

// train()'s loop: each step, then its log, evaluation and checkpoint events.
void TrainingRun::train_steps(RunSummary& summary) {
  const int64_t first_step = steps_done_;
  while (!finished()) {
    const StepResult result = step();
    log_step(result);
    if (steps_done_ == first_step + 1) report_memory("first_step", nullptr);
    const double after_step = window_.now();  // evaluation and saving are not training time
    const int64_t done = result.step;
    const bool last = done == total_steps_ || stream_ended_;
    const int64_t eval_every = config_.train.eval_interval(schedule_->steps_per_epoch());
    const bool eval_now = eval_every > 0 && done % eval_every == 0;
    bool improved = false;
    if ((eval_now || last) && (eval_schedule_.num_batches > 0 || evaluates_held_out_rows())) {
      summary.last_eval = evaluate();
      answer_stream_closes();
      improved = record_evaluation(*summary.last_eval);
      metrics_->eval(*summary.last_eval);
      if (events_.on_eval) events_.on_eval(*summary.last_eval);
    }
    // Every rank holds the same evaluation, so every rank stops at the same step.
    stopped_early_ =
        config_.train.early_stopping > 0 && evals_since_best_ >= config_.train.early_stopping;
    const bool save_now =
        (config_.checkpoint.every_steps > 0 && done % config_.checkpoint.every_steps == 0) ||
        (improved && config_.checkpoint.keep_best) || stopped_early_;
    const double before_save = window_.now();
    window_.add_paused(before_save - after_step);
    if (save_now || last) {
      start_save();
      answer_stream_closes();
      window_.mark_save();
    } else if (checkpointer_->in_flight()) {
      // Not wrapped in an agreement: poll() reads an MPI_Iallreduce started at the previous
      // poll (so it waits for no slower rank), and the completion it may run agrees on its
      // own outcome, the same on every rank.
      report_checkpoint(checkpointer_->poll());
    }
    window_.add_saving(window_.now() - before_save);
  }
}

void TrainingRun::log_step(const StepResult& result) {
  window_loss_ += result.loss;
  window_aux_loss_ += result.aux_loss;
  window_derivative_loss_ += result.derivative_loss;
  ++window_steps_;
  if (result.step % config_.train.log_every != 0 && result.step != total_steps_ && !stream_ended_) {
    return;
  }
  // The steps' own time: evaluation and saving are left out (saving is reported apart).
  const ProgressWindow::Times times = window_.times();
  const double elapsed = times.step_s;
  LogEvent event;
  event.step = result.step;
  event.total_steps = total_steps_;
  event.epoch = schedule_->epoch_of(result.step - 1);
  event.loss = window_loss_ / window_steps_;
  if (config_.model.moe().any()) event.aux_loss = window_aux_loss_ / window_steps_;
  if (derivative_loss_) event.derivative_loss = window_derivative_loss_ / window_steps_;
  event.lr = lr_;
  event.cuda_graphs = graphs_ ? "on" : "off";
  const int64_t samples = window_steps_ * config_.data.batch_size * accumulation_;
  event.samples_per_s = elapsed > 0 ? samples / elapsed : 0.0;
  // Model TFLOP/s of one rank (torchtitan's convention: the model's FLOPs over the ranks).
  event.tflops_per_rank =
      elapsed > 0 ? window_steps_ * flops_per_step() / mesh_->world_size() / elapsed / 1e12 : 0.0;
  if (config_.run.peak_tflops > 0) {
    event.mfu_percent = 100.0 * event.tflops_per_rank / config_.run.peak_tflops;
  }
  event.eta_s = (total_steps_ - result.step) * elapsed / window_steps_;
  event.step_s = elapsed / window_steps_;
  if (times.saved) event.save_s = times.save_s;
  if (scaler_) {
    event.loss_scale = scaler_->scale();
    event.skipped_steps = skipped_steps_;
  }
  // The slowest rank's wait: a rank whose reader keeps up waits in the gradient all-reduce
  // for the one whose reader does not, so rank 0's own wait alone can read 0.
  double waited = train_stream_->take_wait_seconds();
  all_reduce_collective(&waited, 1, MPI_DOUBLE, MPI_MAX, comm_, "the reduction of the data wait",
                        data_wait_reduction_);
  event.data_wait_s = waited / window_steps_;
  if (stream_) {
    const StreamCounters& counters = stream_->counters();
    event.stream_rows_received = counters.rows_received;
    event.stream_rows_overwritten = counters.rows_overwritten;
    event.stream_buffer_rows = counters.buffer_rows;
    if (config_.stream.test_fraction > 0.0) event.stream_rows_held_out = counters.rows_held_out;
    if (stream_->publishing()) {
      event.stream_publishes = counters.publishes;
      event.stream_publishes_sent = counters.publishes_sent;
      event.stream_publishes_replaced = counters.publishes_replaced;
    }
  }
  data_wait_s_ += waited;
  metrics_->log(event);
  if (events_.on_log) events_.on_log(event);
  window_.start();
  window_loss_ = 0.0;
  window_aux_loss_ = 0.0;
  window_derivative_loss_ = 0.0;
  window_steps_ = 0;
}

StepResult TrainingRun::step() {
  try {
    return run_step();
  } catch (const std::exception& error) {
    // Also for a caller stepping by hand that catches the error and goes on to destroy the
    // run: the producers are told this sentence rather than the destructor's generic one.
    if (stream_) stream_->stop_producers(error.what());
    throw;
  }
}

StepResult TrainingRun::run_step() {
  const int64_t number = steps_done_ + 1;
  if (config_.runtime.traces() && number == config_.runtime.trace_first) begin_trace();
  if (tracing_) reset_pass_counts();
  StepResult result;
  {
    TraceSpan span("step", TraceKind::step);
    span.number(number);
    for (int64_t micro = 0; micro < accumulation_; ++micro) {
      {
        TraceSpan data("data wait");
        load_batch(steps_done_, micro);
      }
      accumulate_loaded_batch();
    }
    result = apply_update();
  }
  if (stream_ && stream_->publishing() && number % config_.stream.publish_every == 0) {
    // The parameters after this step's update, to the producers' LiveModel (never waits for
    // them to be taken). Read through the const overload: publishing writes no master, so the
    // 16-bit copies the optimizer just wrote stay current (no cast pass at the next step).
    TraceSpan span("stream publish");
    stream_->publish(std::as_const(*model_).parameters(), normalization_, number);
  }
  if (stream_ && config_.stream.until == StreamUntil::closed && stream_->ended()) {
    stream_ended_ = true;
  }
  // The last step done (also when stepped by hand): destroyed from now on, the run ends its
  // stream with "done" to the producers; destroyed before, it stops them (a failed run).
  if (stream_ && finished()) stream_->finish();
  // Into the room begin_trace reserved (a window of more steps keeps the first ones).
  if (tracing_ && traced_passes_.steps.size() < traced_passes_.steps.capacity()) {
    traced_passes_.steps.push_back({number, pass_totals()});
  }
  if (tracing_ && number == config_.runtime.trace_last) end_trace();
  return result;
}

void TrainingRun::load_batch(int64_t step, int64_t micro) {
  if (stream_statistics_pending_) freeze_stream_statistics();
  try {
    if (stream_) {
      // A save in flight may still be copying the buffer that this pull changes.
      if (!checkpoint_.stream.tensors.empty() && checkpointer_->in_flight()) {
        checkpointer_->wait_snapshot();
      }
      TraceSpan span("stream receive");
      stream_->pull();
    }
    train_stream_->take(step * accumulation_ + micro, x_, labels_, targets_);
    // The same rows' derivative targets (the same sample list, so the same order).
    if (dy_stream_) dy_stream_->take(step * accumulation_ + micro, dy_targets_, {}, {});
  } catch (const Error&) {
    keep_data_error(*loss_);
  }
}

// The training step, top to bottom: accumulate_loaded_batch for each micro-batch, then
// apply_update. Nothing here allocates.
double TrainingRun::accumulate_loaded_batch() {
  if (graphs_) return accumulate_captured_batch();  // the same step, as captured regions
  MESHTRAIN_REQUIRE(micro_done_ < accumulation_, "accumulate_loaded_batch: the step already has ",
                    accumulation_, " micro-batches; call apply_update()");
  // Dropout's key: the run's seed and step counter (restored by a resume), the micro-batch,
  // and where this rank's rows sit in it (the same mask on every mesh).
  const TrainingPass training{config_.run.seed, steps_done_, micro_done_, slice_.begin()};
  MatrixView output = [&] {
    TraceSpan span("forward");
    return model_->forward(x_, &training);
  }();
  // fp16: inputs beyond its range overflow at every loss scale. This rank's loss is poisoned
  // so that every rank sees a non-finite loss and stops below, in check_fp16_overflow.
  inputs_beyond_fp16_ = scaler_ ? scaler_->count_beyond_fp16(x_) : 0.0;
  if (inputs_beyond_fp16_ > 0) loss_->poison_next_reduction();
  LossResult result = [&] {
    TraceSpan span("loss");
    return compute_loss(*loss_, output, labels_, targets_, /*with_gradient=*/true);
  }();
  // The data loss alone, kept for the physics loss's weighting below. MoE layers: their
  // load-balancing loss is part of the training loss (backward adds its gradient); it is the
  // same on every rank.
  const double data_loss = result.loss;
  const double aux_loss = model_->aux_loss();
  result.loss = data_loss + aux_loss;
  // Sobolev training: the derivative term on the tangents of the chosen input directions
  // (reserved at set-up), reduced over the ranks as the loss is.
  double derivative_loss = 0.0;
  if (derivative_loss_) {
    TraceSpan span("derivative loss");
    const MatrixView tangents = model_->forward_tangents(derivative_loss_->seeds());
    derivative_loss = derivative_loss_->evaluate(tangents, dy_targets_).loss;
    result.loss += derivative_loss;
  }
  // A physics loss (set_physics): the residual of the forward Laplacian's u, du, d2u at the
  // batch's points (de-normalized for the residual), joined to the weighted data loss.
  double physics_loss = 0.0;
  if (physics_loss_) {
    TraceSpan span("physics loss");
    denormalize_physics_points();
    const MatrixView streams = model_->forward_laplacian(physics_loss_->seeds());
    physics_loss = physics_loss_->evaluate(physics_x_, output, streams).loss;
    // data_loss_weight weighs the data loss only: the balancing loss's gradient (the MoE layers'
    // backward) is not weighted, so neither is its share of the loss.
    result.loss = physics_data_weight_ * (data_loss + derivative_loss) + aux_loss + physics_loss;
  }
  // The loss is reduced over the ranks, so every rank decides here alike.
  if (!std::isfinite(result.loss)) {
    if (!scaler_) {
      fail_non_finite_loss(result.loss);
    }
    // fp16, as GradScaler: this loss's gradient would not be finite, so the step's update is
    // skipped (apply_update) and the scale backs off.
    try {
      throw_agreed_data_error();
      check_fp16_overflow(/*loss_overflowed=*/true);
    } catch (...) {
      forget_micro_batches();
      throw;
    }
    step_loss_overflowed_ = true;
  }
  // A step whose loss overflowed fp16 runs no more backward passes: its update is skipped.
  if (!step_loss_overflowed_) {
    // Partial gradients (gradient_reduction_ other than in_backward) are completed once per
    // step, in apply_update. The last micro-batch's gradient stays in the gradients.
    TraceSpan span("backward");
    if (physics_loss_) {
      // Through the value and the Laplacian's streams at once (fp32, as below).
      physics_loss_->add_output_gradient_to(loss_->gradient(),
                                            static_cast<float>(physics_data_weight_));
      model_->backward_with_laplacian(loss_->gradient(), physics_loss_->stream_gradient(),
                                      gradient_reduction_ == GradientReduction::in_backward);
    } else if (derivative_loss_) {
      // Through the value and the tangent pass at once; no loss scaling (fp32 only), no
      // buckets or prefetch (each layer reduces, or leaves for apply_update, its own).
      model_->backward_with_tangents(loss_->gradient(), derivative_loss_->gradient(),
                                     gradient_reduction_ == GradientReduction::in_backward);
    } else {
      model_->backward(loss_->gradient(), gradient_reduction_, scaler_ ? scaler_->scale() : 1.0f);
    }
    if (micro_done_ + 1 < accumulation_) {
      std::vector<ShardedTensor>& grads = model_->gradients();
      for (size_t i = 0; i < grads.size(); ++i) {
        add_gradient(gradient_sum_[i].local, grads[i].local, micro_done_ == 0);
      }
    }
  }
  ++micro_done_;
  micro_loss_sum_ += result.loss;
  micro_aux_loss_sum_ += aux_loss;
  micro_derivative_loss_sum_ += derivative_loss;
  micro_physics_loss_sum_ += physics_loss;
  return result.loss;
}

// accumulate_loaded_batch for a run whose step is captured (graphs_, choose_cuda_graphs: one
// micro-batch, cross-entropy, no loss scaling, clipping, dropout, MoE or derivative terms): the
// forward, the loss's kernels and backward are one region (StepGraph), then the loss is read
// back and checked as there. Unlike the eager step, backward runs before the check; a
// non-finite loss still throws before the update, so the parameters are those of the eager
// step (the gradients, rewritten by the next step, are not).
double TrainingRun::accumulate_captured_batch() {
  MESHTRAIN_REQUIRE(micro_done_ == 0 && accumulation_ == 1,
                    "accumulate_captured_batch: a captured step has one micro-batch");
  // Dropout's key (unused: no dropout when graphs_) as in accumulate_loaded_batch.
  const TrainingPass training{config_.run.seed, steps_done_, 0, slice_.begin()};
  auto region = [&] {
    const MatrixView output = [&] {
      TraceSpan span("forward");
      return model_->forward(x_, &training);
    }();
    {
      TraceSpan span("loss");
      loss_->cross_entropy_kernels(output, labels_, /*with_gradient=*/true);
    }
    TraceSpan span("backward");
    model_->backward(loss_->gradient(), gradient_reduction_, 1.0f);
  };
  // A 16-bit compute copy marked stale (a checkpoint loaded between steps) makes forward cast
  // it, which the captured region does not: such a step runs eagerly (the update marks them
  // current again).
  bool copies_current = true;
  for (const ShardedTensor& p : std::as_const(*model_).parameters()) {  // const: reads only
    if (p.copy_16bit && !p.copy_16bit->current) copies_current = false;
  }
  if (copies_current) {
    fill_graph_buffers();
    run_graphed(*forward_backward_graph_, StepRegion(region));
  } else {
    forward_backward_graph_->run_eagerly(region);
  }
  LossResult result = loss_->cross_entropy_result();
  const double aux_loss = model_->aux_loss();  // 0: no MoE layers
  result.loss += aux_loss;
  if (!std::isfinite(result.loss)) {
    fail_non_finite_loss(result.loss);
  }
  ++micro_done_;
  micro_loss_sum_ += result.loss;
  micro_aux_loss_sum_ += aux_loss;
  return result.loss;
}

// The addresses the captured regions read and write, in place (no allocation): the batch, the
// loss's gradient, every parameter and gradient; for the update also the optimizer's slots and
// the parameters' 16-bit compute copies (null where a parameter has none).
void TrainingRun::fill_graph_buffers() {
  std::vector<const void*>& region = forward_backward_graph_->buffers();
  std::vector<const void*>& update = update_graph_->buffers();
  // Through the const overload: the non-const one marks the 16-bit copies stale.
  const std::vector<ShardedTensor>& params = std::as_const(*model_).parameters();
  const std::vector<ShardedTensor>& grads = model_->gradients();
  region[0] = x_.data();
  region[1] = labels_.data();
  region[2] = loss_->gradient().data();
  for (size_t i = 0; i < params.size(); ++i) {
    // A gradient stored as 16 bits (Mlp::store_gradients_16bit) is its bits.
    const void* grad = data_pointer(grads[i]);
    region[3 + 2 * i] = params[i].local.data();
    region[4 + 2 * i] = grad;
    update[2 * i] = params[i].local.data();
    update[2 * i + 1] = grad;
  }
  size_t next = 2 * params.size();
  for (const std::string& name : optimizer_->slot_names()) {
    for (const ShardedTensor& s : std::as_const(*optimizer_).slot(name)) {
      update[next++] = s.local.data();
    }
  }
  for (const ShardedTensor& p : params) {
    update[next++] = p.copy_16bit ? static_cast<const void*>(p.copy_16bit->bits.data()) : nullptr;
  }
}

// Graphs are on only under runtime.cuda_graphs = "auto" (no setting insists on them), which
// promises the step's results, not its speed: a capture or replay that StepGraph refuses (the
// host checker's refusal, a CUDA capture error, scratch reallocated under the graph) turns
// graphs off for the rest of the run, with one warning, and the region runs eagerly, unless
// the refused call already did its work (the host checker refuses after running it). For the
// update, prepare_step has counted the step already: the eager region is launch_prepared, with
// the rates it wrote. A region that fails eagerly too throws as it would without graphs.
void TrainingRun::run_graphed(StepGraph& graph, const StepRegion& region) {
  try {
    graph.run_region(region);
  } catch (const std::exception& error) {
    turn_graphs_off(graph, error.what());
    if (!graph.last_call_ran()) region();
  }
}

void TrainingRun::turn_graphs_off(const StepGraph& graph, const std::string& why) {
  graphs_ = false;
  graphs_note_ =
      detail::concat("CUDA graphs: off from step ", steps_done_ + 1, ", where the ", graph.name(),
                     " region could not be ", graph.captured() ? "replayed" : "captured", " (", why,
                     "); the run goes on eagerly");
  if (rank_ == 0) {
    warnings_.push_back(graphs_note_);
    if (events_.on_warning) events_.on_warning(graphs_note_);
  }
}

void TrainingRun::denormalize_physics_points() {
  to_data_units(x_, physics_input_mean_, physics_input_std_, physics_x_);
}

LossResult TrainingRun::compute_loss(Loss& loss, MatrixView output, const BatchLabels& labels,
                                     const Matrix& targets, bool with_gradient,
                                     int64_t valid_rows) {
  if (loss.kind() == LossKind::cross_entropy) {
    return loss.cross_entropy(output, labels, with_gradient, valid_rows);
  }
  LossResult result = loss.regression(output, targets, with_gradient, valid_rows);
  // The count is reduced over every rank with the loss: they all stop here, with this sentence.
  if (loss.kind() == LossKind::binary_cross_entropy && result.targets_outside > 0) {
    const DataSection& data = config_.data;
    const std::vector<std::string>& paths = with_gradient ? data.path : data.test_path;
    const std::string origin =
        data.source == DataSource::hdf5 && !paths.empty()
            ? std::string(with_gradient ? "data.path" : "data.test_path") + " = \"" +
                  paths.front() + "\"" + (paths.size() > 1 ? " and the others" : "")
            : std::string("data.source = \"") + to_string(data.source) + "\"";
    MESHTRAIN_BAD_INPUT(config_.file.empty() ? "" : config_.file + ": ",
                        "model.loss = \"binary_cross_entropy\" needs targets in [0, 1], but ",
                        result.targets_outside, " of a batch's targets are outside (the ",
                        with_gradient ? "training" : "test", " data, ", origin, ")");
  }
  return result;
}

StepResult TrainingRun::apply_update() {
  MESHTRAIN_REQUIRE(micro_done_ == accumulation_, "apply_update after ", micro_done_, " of ",
                    accumulation_, " micro-batches");
  if (step_loss_overflowed_) {
    // Every rank saw the same non-finite loss and skipped the same reductions.
    const double loss = micro_loss_sum_ / static_cast<double>(accumulation_);
    const double aux_loss = micro_aux_loss_sum_ / static_cast<double>(accumulation_);
    const double derivative_loss = micro_derivative_loss_sum_ / static_cast<double>(accumulation_);
    const double physics_loss = micro_physics_loss_sum_ / static_cast<double>(accumulation_);
    forget_micro_batches();
    ++loss_overflows_in_a_row_;
    scaler_->update(/*finite=*/false);
    ++skipped_steps_;
    ++steps_done_;
    return {steps_done_, loss, aux_loss, derivative_loss, physics_loss};
  }
  loss_overflows_in_a_row_ = 0;
  std::vector<ShardedTensor>& grads = model_->gradients();
  if (accumulation_ > 1) {
    for (size_t i = 0; i < grads.size(); ++i) {
      finish_gradient(grads[i].local, gradient_sum_[i].local, accumulation_);
    }
  }
  // The reductions backward left out, once per step (gradient_reduction_). With ZeRO-1 the
  // update (clipping included) sees this rank's chunk of each gradient.
  if (gradient_reduction_ == GradientReduction::per_step) {
    TraceSpan span("gradient reduction");
    model_->reduce_gradients();
  }
  if (gradient_reduction_ == GradientReduction::zero1) {
    TraceSpan span("gradient reduction");
    zero1_->reduce(grads);
  }
  std::vector<ShardedTensor>& update_grads = updated_gradients();
  const double loss = micro_loss_sum_ / static_cast<double>(accumulation_);
  const double aux_loss = micro_aux_loss_sum_ / static_cast<double>(accumulation_);
  const double derivative_loss = micro_derivative_loss_sum_ / static_cast<double>(accumulation_);
  const double physics_loss = micro_physics_loss_sum_ / static_cast<double>(accumulation_);
  forget_micro_batches();
  if (scaler_) {
    // fp16: the gradients come scaled; a step with an inf or NaN anywhere is skipped on
    // every rank (the optimizer does not run) and the scale backs off.
    TraceSpan span("loss scaling");
    const bool finite = scaler_->unscale(update_grads);
    scaler_->update(finite);
    if (!finite) {
      check_fp16_overflow(/*loss_overflowed=*/false);
      ++skipped_steps_;
      ++steps_done_;
      return {steps_done_, loss, aux_loss, derivative_loss, physics_loss};
    }
  }
  if (config_.optimizer.clip_norm > 0) {
    // The norm is reduced over the ranks too: every rank stops here together.
    TraceSpan span("clip");
    const double norm = clipper_->clip(update_grads, config_.optimizer.clip_norm, *world_);
    if (!std::isfinite(norm)) {
      throw AgreedError(Error(
          ErrorKind::runtime,
          detail::concat("the gradient norm became ", std::isnan(norm) ? "NaN" : "infinite",
                         " at step ", steps_done_ + 1, " (the gradient of ",
                         clipper_->non_finite_gradient(),
                         " is not finite); lower optimizer.lr (now ", config_.optimizer.lr, ")"),
          __FILE__, __LINE__));
    }
  }
  // The rate depends on the step index alone, so a resumed run continues it exactly.
  lr_ = static_cast<float>(lr_schedule_.at(steps_done_));
  {
    TraceSpan span("optimizer");
    if (checkpointer_->in_flight()) {
      // A save in flight has copied the tensors it writes: saving time, not the step's.
      const double waiting = window_.now();
      checkpointer_->wait_snapshot();
      window_.add_saving(window_.now() - waiting);
    }
    if (graphs_) {
      // The step's rate and bias corrections into the memory the captured kernels read.
      optimizer_->prepare_step(lr_);
      auto update = [&] { optimizer_->launch_prepared(updated_parameters(), update_grads); };
      run_graphed(*update_graph_, StepRegion(update));
    } else {
      optimizer_->step(updated_parameters(), update_grads, lr_);
    }
    if (zero1_) zero1_->gather(model_->parameters());  // every replica gets every chunk
  }
  ++steps_done_;
  return {steps_done_, loss, aux_loss, derivative_loss, physics_loss};
}

StepResult TrainingRun::step_on_loaded_batch() {
  MESHTRAIN_REQUIRE(accumulation_ == 1,
                    "step_on_loaded_batch needs train.accumulation_steps = 1; use step()");
  TraceSpan span("step", TraceKind::step);
  span.number(steps_done_ + 1);
  accumulate_loaded_batch();
  return apply_update();
}

// In a catch of a batch this rank could not read: only this rank knows, so it keeps the
// error (the first) and poisons the loss's next reduction, which every rank then sees.
void TrainingRun::keep_data_error(Loss& loss) {
  if (!data_error_) data_error_ = std::current_exception();
  loss.poison_next_reduction();
}

// After a non-finite reduced loss: when some rank could not read its rows, that is why
// (the lowest such rank's error, thrown on every rank); otherwise returns.
void TrainingRun::throw_agreed_data_error() {
  std::exception_ptr error = std::exchange(data_error_, nullptr);
  on_every_rank(comm_, [&] {
    if (error) std::rethrow_exception(error);
  });
}

// A non-finite reduced loss without a loss scaler ends the run on every rank alike: with the
// data error of a rank that could not read its rows where there is one, else this sentence.
void TrainingRun::fail_non_finite_loss(double loss) {
  forget_micro_batches();
  throw_agreed_data_error();
  throw AgreedError(
      Error(ErrorKind::runtime,
            detail::concat("the training loss became ", std::isnan(loss) ? "NaN" : "infinite",
                           " at step ", steps_done_ + 1, "; lower optimizer.lr (now ",
                           config_.optimizer.lr, ") or set optimizer.clip_norm"),
            __FILE__, __LINE__));
}

// Under fp16, after a non-finite loss or gradient. Skipping steps and backing off the scale
// (GradScaler) recovers from a scale too large for the gradients; it cannot recover from
// inputs beyond fp16's range, from a forward pass that overflows (the scale does not touch
// it) in 16 steps in a row, or from gradients that overflow at a scale below 2^-24 (fp16's
// smallest step). Each ends the run in one sentence naming the key that fixes it.
void TrainingRun::check_fp16_overflow(bool loss_overflowed) {
  constexpr int64_t kMaxLossOverflowsInARow = 16;
  const double kSmallestScale = std::ldexp(1.0, -24);
  const auto fix = [&] {  // only when failing: skipping a step allocates nothing
    return detail::concat(
        "set mixed_precision.param_dtype = \"bf16\" (fp32's range) or lower "
        "optimizer.lr (now ",
        config_.optimizer.lr, ")");
  };
  if (loss_overflowed) {
    const double beyond = scaler_->sum_over_ranks(inputs_beyond_fp16_);
    if (beyond > 0) {
      throw AgreedError(
          Error(ErrorKind::bad_input,
                detail::concat("the inputs of step ", steps_done_ + 1, " hold ", beyond,
                               " values beyond fp16's range (|x| >= 65520 rounds to inf), so the "
                               "training loss is not finite at any loss scale; set "
                               "mixed_precision.param_dtype = \"bf16\" (fp32's range) or scale the "
                               "inputs down"),
                __FILE__, __LINE__));
    }
    if (loss_overflows_in_a_row_ + 1 >= kMaxLossOverflowsInARow) {
      throw AgreedError(
          Error(ErrorKind::runtime,
                detail::concat("the training loss was not finite in ", kMaxLossOverflowsInARow,
                               " steps in a row up to step ", steps_done_ + 1,
                               " under fp16: the forward pass overflows fp16's "
                               "range (65504) whatever the loss scale; ",
                               fix()),
                __FILE__, __LINE__));
    }
  } else if (scaler_->scale() < kSmallestScale) {
    throw AgreedError(Error(ErrorKind::runtime,
                            detail::concat("the gradients were not finite under fp16 at every loss "
                                           "scale down to 2^-24 (step ",
                                           steps_done_ + 1,
                                           "): the backward pass overflows fp16's range (65504) "
                                           "whatever the scale; ",
                                           fix()),
                            __FILE__, __LINE__));
  }
}

void TrainingRun::forget_micro_batches() {
  micro_done_ = 0;
  micro_loss_sum_ = 0.0;
  micro_aux_loss_sum_ = 0.0;
  micro_derivative_loss_sum_ = 0.0;
  micro_physics_loss_sum_ = 0.0;
  step_loss_overflowed_ = false;
}

double TrainingRun::flops_per_step() const {
  const int64_t rows = config_.data.batch_size * accumulation_;
  if (config_.model.kind == ModelKind::residual_mlp) {  // every weight's elements, 6 per row
    double parameters = 0.0;  // an MoE block's: its router and top_k experts' [E, in, out]
    for (const ParameterShape& p : model_parameter_shapes(config_.model)) {
      if (p.shape.size() == 2) parameters += static_cast<double>(p.shape[0]) * p.shape[1];
      if (p.shape.size() == 3) {
        parameters += static_cast<double>(config_.model.top_k) * p.shape[1] * p.shape[2];
      }
    }
    return 6.0 * parameters * static_cast<double>(rows);
  }
  const std::vector<int64_t>& sizes = config_.model.sizes;
  const MoeSettings moe = config_.model.moe();
  double parameters = 0.0;  // those a row uses: an MoE layer's router and its top_k experts
  for (size_t i = 0; i + 1 < sizes.size(); ++i) {
    const double layer = static_cast<double>(sizes[i]) * sizes[i + 1] + sizes[i + 1];
    if (moe.is_moe(static_cast<int64_t>(i))) {
      parameters += static_cast<double>(sizes[i]) * moe.experts + moe.top_k * layer;
    } else {
      parameters += layer;
    }
  }
  return 6.0 * parameters * static_cast<double>(config_.data.batch_size * accumulation_);
}

}  // namespace meshtrain
