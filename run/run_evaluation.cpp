// Evaluation of a TrainingRun on the test split, and the best evaluation so far by the
// run's metric (checkpoint.keep_best, early stopping).

#include "run/training_run.hpp"

#include <mpi.h>

#include <cmath>

#include "base/error.hpp"
#include "framework/comm/mpi_util.hpp"
#include "framework/observe/trace.hpp"

namespace meshtrain {

// The metrics over the whole test split, sharded over the batch axes like training: Loss
// reduces each batch's loss sums over the ranks, EvalMetrics the rest once at the end.
EvalEvent TrainingRun::evaluate() {
  TraceSpan span("evaluate");
  Mlp& model = eval_model_ ? *eval_model_ : *model_;
  Loss& loss = eval_model_ ? *eval_loss_ : *loss_;
  const Matrix& x = eval_model_ ? eval_x_ : x_;
  const BatchLabels& labels = eval_model_ ? eval_labels_ : labels_;
  const Matrix& targets = eval_model_ ? eval_targets_ : targets_;
  eval_metrics_->reset();
  if (evaluates_held_out_rows()) {
    // A stream's held-out rows: as many batches as the fullest rank's window needs (a rank
    // with fewer rows pads), agreed, numbered from this evaluation's first.
    const int64_t rows = eval_slice_.rows;
    int64_t batches = (stream_->held_out().filled() + rows - 1) / rows;
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, &batches, 1, MPI_INT64_T, MPI_MAX, comm_),
              "MPI_Allreduce (the held-out rows' batches)");
    eval_schedule_.num_batches = batches;
    eval_first_seq_ = eval_seq_;
  }
  for (int64_t b = 0; b < eval_schedule_.num_batches; ++b) {
    int64_t valid = 0;
    try {
      valid = eval_stream_->take(eval_seq_++, x, labels, targets);
    } catch (const Error&) {
      keep_data_error(loss);
    }
    MatrixView output = model.forward(x);
    const LossResult r =
        compute_loss(loss, output, labels, targets, /*with_gradient=*/false, valid);
    eval_metrics_->add(output, labels, targets, valid, r);
    answer_stream_closes();  // a long evaluation leaves no simulation waiting on its close
  }
  if (!std::isfinite(eval_metrics_->loss_sum())) throw_agreed_data_error();
  EvalEvent event;
  eval_metrics_->finish(event, &normalization_);
  event.step = steps_done_;
  return event;
}

EvalMetric TrainingRun::best_metric_kind() const {
  return config_.checkpoint.keep_best.value_or(EvalMetric::test_loss);
}

// Whether `eval` is better than every earlier evaluation by the run's metric
// (checkpoint.keep_best, else the test loss); counts the evaluations since the best.
bool TrainingRun::record_evaluation(const EvalEvent& eval) {
  const EvalMetric metric = best_metric_kind();
  const double value = eval_metric_value(eval, metric);
  const bool improved = std::isnan(best_metric_) ||
                        (metric.higher_is_better() ? value > best_metric_ : value < best_metric_);
  if (improved && !std::isnan(value)) {
    best_metric_ = value;
    best_step_ = steps_done_;
    evals_since_best_ = 0;
    return true;
  }
  ++evals_since_best_;
  return false;
}

}  // namespace meshtrain
