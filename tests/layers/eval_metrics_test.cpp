// EvalMetrics (layers/eval_metrics.hpp) on dp, fsdp, tp (outputs split and replicated) and
// fsdp x tp meshes against a float64 reference written here from the same global outputs,
// labels and targets: batches of 8 global rows over 37 rows (the last batch padded), each
// rank handing in its slice as TrainingRun's evaluation does.
//   classification (8 classes, one never present, many tied logits): accuracy, top-5 and
//     per-class accuracy and rows exactly (counts); the loss to 1e-6 relative (float logits);
//     4 classes: no top-5.
//   regression (4 outputs): MSE, MAE per output and overall, R^2 per output and mean,
//     de-normalized with target statistics given directly (std 0.5 and 3, means 1e3 and -7)
//     and without statistics on targets near 1e4 (the shift keeps SST from cancelling), to
//     1e-9 relative (R^2: 1e-9 absolute); the loss (trained units) to 1e-6 relative.
//     Relative L2 error per output and overall the same way, and NaN for an output whose
//     targets are all 0.
//   binary_cross_entropy (4 outputs, logits on a grid of 0.25 with ties, 0/1 targets and an
//     output with no positive row): AUC per output exactly the pairwise AUC (ties one half;
//     the bins are finer than the grid), NaN for the output without positives and the mean of
//     the others overall; accuracy exactly; log loss per output and overall to 1e-9 relative,
//     the loss to 1e-6.
// Every rank ends with the same bits in every field. The JSON record and the line of an
// eval event hold exactly the fields that apply.

#include "layers/eval_metrics.hpp"

#include <gtest/gtest.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "framework/comm/mesh_communicators.hpp"
#include "tests/support/backend.hpp"
#include "tests/support/mesh_cases.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

constexpr int64_t kRows = 37;      // global rows: 4 full batches and a padded one
constexpr int64_t kEvalBatch = 8;  // global rows of a batch
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Global inputs of one problem, row-major: outputs [kRows, width] as the model hands them in
// (normalized units), and labels or targets (normalized units).
struct Problem {
  int64_t width = 0;
  std::vector<float> outputs;
  std::vector<int32_t> labels;
  std::vector<float> targets;
};

Problem classification_problem(int64_t classes) {
  Problem p;
  p.width = classes;
  for (int64_t i = 0; i < kRows; ++i) {
    // Few distinct values: ties everywhere, also across the feature ranks' column blocks.
    for (int64_t j = 0; j < classes; ++j) {
      p.outputs.push_back(0.5f * static_cast<float>((i * 3 + j * 5 + (i * j) % 3) % 4) - 1.0f);
    }
    p.labels.push_back(static_cast<int32_t>((i * 5 + i / 3) % (classes - 1)));  // never the last
  }
  return p;
}

// Targets t' (normalized units) ~ a spread, outputs t' + an error that varies by output.
// zero_column >= 0: that output's targets are all 0 (no relative error, no R^2).
Problem regression_problem(double target_offset, int64_t zero_column = -1) {
  Problem p;
  p.width = 4;
  for (int64_t i = 0; i < kRows; ++i) {
    for (int64_t j = 0; j < p.width; ++j) {
      const double t = j == zero_column ? 0.0 : target_offset + std::sin(0.7 * i + j) * (1.0 + j);
      const double e = 0.1 * (j + 1) * std::cos(1.3 * i * (j + 1));
      p.targets.push_back(static_cast<float>(t));
      p.outputs.push_back(static_cast<float>(t + e));
    }
  }
  return p;
}

// Logits on a grid of 0.25 in [-3, 3] (ties within an output), targets 0 or 1; output 3 has
// no positive row (no AUC).
Problem binary_problem() {
  Problem p;
  p.width = 4;
  for (int64_t i = 0; i < kRows; ++i) {
    for (int64_t j = 0; j < p.width; ++j) {
      const double z = 0.25 * static_cast<double>((i * (j + 3) + 5 * j) % 25 - 12);
      // Targets that follow the logit more often than not, so the AUC is well above 0.5.
      const bool yes = j == 3 ? false : (z + 1.5 * std::sin(1.7 * i + j) > 0.0);
      p.outputs.push_back(static_cast<float>(z));
      p.targets.push_back(yes ? 1.0f : 0.0f);
    }
  }
  return p;
}

// The pairwise AUC of one output: the share of (positive, negative) pairs whose positive logit
// is larger, ties one half; NaN without both kinds.
double pairwise_auc(const Problem& p, int64_t j) {
  double pairs = 0.0, wins = 0.0;
  for (int64_t a = 0; a < kRows; ++a) {
    for (int64_t b = 0; b < kRows; ++b) {
      if (p.targets[a * p.width + j] < 0.5f || p.targets[b * p.width + j] >= 0.5f) continue;
      const float za = p.outputs[a * p.width + j], zb = p.outputs[b * p.width + j];
      pairs += 1.0;
      wins += za > zb ? 1.0 : (za == zb ? 0.5 : 0.0);
    }
  }
  return pairs > 0 ? wins / pairs : kNaN;
}

EvalEvent binary_reference(const Problem& p) {
  EvalEvent e;
  const int64_t w = p.width;
  e.test_rows = kRows;
  double loss = 0.0, hits = 0.0, auc_sum = 0.0;
  int64_t auc_outputs = 0;
  for (int64_t j = 0; j < w; ++j) {
    double log_loss = 0.0;
    for (int64_t i = 0; i < kRows; ++i) {
      const double z = p.outputs[i * w + j], t = p.targets[i * w + j];
      log_loss += std::log1p(std::exp(-std::abs(z))) + std::max(z, 0.0) - z * t;
      hits += ((z > 0.0) == (t >= 0.5)) ? 1.0 : 0.0;
    }
    loss += log_loss;
    e.test_log_loss_per_output.push_back(log_loss / kRows);
    const double auc = pairwise_auc(p, j);
    e.test_auc_per_output.push_back(auc);
    if (!std::isnan(auc)) auc_sum += auc, ++auc_outputs;
  }
  e.test_loss = loss / kRows;
  e.test_log_loss = loss / (kRows * w);
  e.test_accuracy = hits / (kRows * w);
  e.test_auc = auc_sum / auc_outputs;
  return e;
}

// What EvalMetrics should give, in float64 from the global arrays.
EvalEvent reference(const Problem& p, LossKind kind, const Normalization* norm) {
  EvalEvent e;
  const int64_t w = p.width;
  e.test_rows = kRows;
  if (kind == LossKind::cross_entropy) {
    std::vector<int64_t> rows(w, 0), hits(w, 0);
    int64_t correct = 0, top5 = 0;
    double loss = 0.0;
    for (int64_t i = 0; i < kRows; ++i) {
      const float* l = &p.outputs[i * w];
      const int32_t label = p.labels[i];
      int64_t rank = 0;
      double m = l[0];
      for (int64_t j = 0; j < w; ++j) {
        if (l[j] > l[label] || (l[j] == l[label] && j < label)) ++rank;
        m = std::max<double>(m, l[j]);
      }
      double s = 0.0;
      for (int64_t j = 0; j < w; ++j) s += std::exp(double(l[j]) - m);
      loss += std::log(s) + m - l[label];
      ++rows[label];
      if (rank == 0) ++hits[label], ++correct;
      if (rank < 5) ++top5;
    }
    e.test_loss = loss / kRows;
    e.test_accuracy = double(correct) / kRows;
    e.test_top5_accuracy = w > 5 ? double(top5) / kRows : kNaN;
    for (int64_t c = 0; c < w; ++c) {
      e.test_class_rows.push_back(rows[c]);
      e.test_class_accuracy.push_back(rows[c] ? double(hits[c]) / rows[c] : kNaN);
    }
    return e;
  }
  // Regression: de-normalize each element first (y = y' std + mean), then two passes.
  double loss = 0.0, sse_all = 0.0, sae_all = 0.0, r2_all = 0.0, tsq_all = 0.0;
  for (int64_t i = 0; i < kRows; ++i) {
    for (int64_t j = 0; j < w; ++j) {
      const double d = double(p.outputs[i * w + j]) - double(p.targets[i * w + j]);
      loss += d * d;
    }
  }
  for (int64_t j = 0; j < w; ++j) {
    const double sd = norm ? norm->target_std[j] : 1.0;
    const double mean = norm ? norm->target_mean[j] : 0.0;
    double sse = 0.0, sae = 0.0, sum_t = 0.0, sst = 0.0, tsq = 0.0;
    for (int64_t i = 0; i < kRows; ++i) {
      const double y = double(p.outputs[i * w + j]) * sd + mean;
      const double t = double(p.targets[i * w + j]) * sd + mean;
      sse += (y - t) * (y - t);
      sae += std::abs(y - t);
      sum_t += t;
      tsq += t * t;
    }
    const double t_mean = sum_t / kRows;
    for (int64_t i = 0; i < kRows; ++i) {
      const double t = double(p.targets[i * w + j]) * sd + mean;
      sst += (t - t_mean) * (t - t_mean);
    }
    e.test_mse_per_output.push_back(sse / kRows);
    e.test_mae_per_output.push_back(sae / kRows);
    e.test_r2_per_output.push_back(sst > 0 ? 1.0 - sse / sst : kNaN);
    e.test_rel_l2_per_output.push_back(tsq > 0 ? std::sqrt(sse / tsq) : kNaN);
    sse_all += sse;
    sae_all += sae;
    r2_all += sst > 0 ? 1.0 - sse / sst : kNaN;
    tsq_all += tsq;
  }
  e.test_rel_l2 = std::sqrt(sse_all / tsq_all);
  e.test_loss = loss / kRows;
  e.test_accuracy = kNaN;
  e.test_mse = sse_all / (kRows * w);
  e.test_mae = sae_all / (kRows * w);
  e.test_r2 = r2_all / w;
  return e;
}

// Runs EvalMetrics (and the Loss that feeds it) over the batches, as TrainingRun::evaluate.
EvalEvent evaluate_on_mesh(const Problem& p, LossKind kind, const testing::OutputMeshCase& c,
                           const Normalization* norm) {
  const Mesh mesh = Mesh::create(c.axes, world_size());
  MeshCommunicators comms(mesh, MPI_COMM_WORLD, testing::test_communicator_factory());
  ParallelContext context(comms, {"fsdp", "dp"}, "tp");
  const int64_t rows = kEvalBatch / context.batch_parallel();
  const int64_t w = p.width;
  const bool split = c.layout == FeatureLayout::split && context.feature_parallel() > 1;
  const int64_t lw = split ? w / context.feature_parallel() : w;
  const int64_t offset = split ? context.feature_index() * lw : 0;
  Loss loss(kind, context, rows, w, c.layout);
  EvalMetrics metrics(kind, context, rows, w, c.layout);
  Matrix output("output", rows, lw);
  const bool takes = takes_targets(kind);
  Matrix targets("targets", takes ? rows : 0, w);
  Kokkos::View<int32_t*> labels("labels", rows);
  auto oh = Kokkos::create_mirror_view(output);
  auto th = Kokkos::create_mirror_view(targets);
  auto lh = Kokkos::create_mirror_view(labels);
  EvalEvent event;
  for (int pass = 0; pass < 2; ++pass) {  // reset() forgets the first pass
    metrics.reset();
    const int64_t batches = (kRows + kEvalBatch - 1) / kEvalBatch;
    for (int64_t b = 0; b < batches; ++b) {
      const int64_t first = b * kEvalBatch + context.batch_index() * rows;
      const int64_t valid = std::clamp<int64_t>(kRows - first, 0, rows);
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t g = std::min(first + i, kRows - 1);  // padding: any row, not counted
        for (int64_t j = 0; j < lw; ++j) oh(i, j) = p.outputs[g * w + offset + j];
        if (takes) {
          for (int64_t j = 0; j < w; ++j) th(i, j) = p.targets[g * w + j];
        } else {
          lh(i) = i < valid ? p.labels[g] : -1;
        }
      }
      Kokkos::deep_copy(output, oh);
      Kokkos::deep_copy(targets, th);
      Kokkos::deep_copy(labels, lh);
      const LossResult r = kind == LossKind::cross_entropy
                               ? loss.cross_entropy(output, labels, false, valid)
                               : loss.regression(output, targets, false, valid);
      metrics.add(output, labels, targets, valid, r);
      if (pass == 0) break;  // one batch, then reset
    }
    metrics.finish(event, norm);
  }
  return event;
}

void expect_close(double actual, double expected, double relative, const char* what) {
  if (std::isnan(expected)) {
    EXPECT_TRUE(std::isnan(actual)) << what << " = " << actual << ", expected NaN";
    return;
  }
  EXPECT_NEAR(actual, expected, relative * std::max(1.0, std::abs(expected))) << what;
}

void expect_close(const std::vector<double>& actual, const std::vector<double>& expected,
                  double relative, const char* what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (size_t i = 0; i < actual.size(); ++i) {
    SCOPED_TRACE(std::string(what) + "[" + std::to_string(i) + "]");
    expect_close(actual[i], expected[i], relative, what);
  }
}

// Every rank holds the same bits: the bytes of each double compared with rank 0's.
void expect_same_on_every_rank(const std::vector<double>& values) {
  std::vector<double> root = values;
  MPI_Bcast(root.data(), static_cast<int>(root.size()), MPI_DOUBLE, 0, MPI_COMM_WORLD);
  EXPECT_EQ(std::memcmp(root.data(), values.data(), values.size() * sizeof(double)), 0)
      << "rank " << world_rank() << " differs from rank 0";
}

std::vector<double> all_values(const EvalEvent& e) {
  std::vector<double> v = {e.test_loss, e.test_accuracy, e.test_top5_accuracy, e.test_mse,
                           e.test_mae,  e.test_r2,       e.test_rel_l2,        double(e.test_rows)};
  v.push_back(e.test_auc);
  v.push_back(e.test_log_loss);
  for (const auto* list : {&e.test_class_accuracy, &e.test_mse_per_output, &e.test_mae_per_output,
                           &e.test_r2_per_output, &e.test_rel_l2_per_output, &e.test_auc_per_output,
                           &e.test_log_loss_per_output}) {
    v.insert(v.end(), list->begin(), list->end());
  }
  for (int64_t rows : e.test_class_rows) v.push_back(double(rows));
  return v;
}

TEST(EvalMetrics, ClassificationMatchesFloat64ReferenceOnEveryMesh) {
  for (int64_t classes : {8, 4}) {
    const Problem p = classification_problem(classes);
    const EvalEvent ref = reference(p, LossKind::cross_entropy, nullptr);
    ASSERT_EQ(ref.test_class_rows.back(), 0);  // a class without rows: NaN accuracy
    for (const testing::OutputMeshCase& c : testing::output_meshes(world_size())) {
      SCOPED_TRACE(c.name + ", " + std::to_string(classes) + " classes");
      const EvalEvent e = evaluate_on_mesh(p, LossKind::cross_entropy, c, nullptr);
      EXPECT_EQ(e.test_rows, kRows);
      expect_close(e.test_loss, ref.test_loss, 1e-6, "test_loss");
      EXPECT_EQ(e.test_accuracy, ref.test_accuracy);  // counts: exact
      if (classes > 5) {
        EXPECT_EQ(e.test_top5_accuracy, ref.test_top5_accuracy);
        EXPECT_LT(e.test_top5_accuracy, 1.0);  // the tie rule matters in this set
      } else {
        EXPECT_TRUE(std::isnan(e.test_top5_accuracy));
      }
      EXPECT_EQ(e.test_class_rows, ref.test_class_rows);
      expect_close(e.test_class_accuracy, ref.test_class_accuracy, 0.0, "test_class_accuracy");
      EXPECT_TRUE(e.test_mse_per_output.empty());
      EXPECT_TRUE(std::isnan(e.test_mse));
      expect_same_on_every_rank(all_values(e));
    }
  }
}

TEST(EvalMetrics, RegressionIsInTheUsersUnitsOnEveryMesh) {
  Normalization norm;
  norm.target_mean = {1e3, -7.0, 0.0, 2.5};
  norm.target_std = {0.5, 3.0, 1.0, 1e-2};
  struct Variant {
    const char* name;
    double offset;
    const Normalization* norm;
  };
  for (const Variant& v :
       {Variant{"normalized targets", 0.0, &norm}, Variant{"raw targets near 1e4", 1e4, nullptr}}) {
    const Problem p = regression_problem(v.offset);
    const EvalEvent ref = reference(p, LossKind::mse, v.norm);
    for (const testing::OutputMeshCase& c : testing::output_meshes(world_size())) {
      SCOPED_TRACE(c.name + ", " + v.name);
      const EvalEvent e = evaluate_on_mesh(p, LossKind::mse, c, v.norm);
      EXPECT_EQ(e.test_rows, kRows);
      expect_close(e.test_loss, ref.test_loss, 1e-6, "test_loss (trained units)");
      EXPECT_TRUE(std::isnan(e.test_accuracy));
      EXPECT_TRUE(e.test_class_accuracy.empty());
      expect_close(e.test_mse_per_output, ref.test_mse_per_output, 1e-9, "test_mse_per_output");
      expect_close(e.test_mae_per_output, ref.test_mae_per_output, 1e-9, "test_mae_per_output");
      expect_close(e.test_r2_per_output, ref.test_r2_per_output, 1e-9, "test_r2_per_output");
      expect_close(e.test_mse, ref.test_mse, 1e-9, "test_mse");
      expect_close(e.test_mae, ref.test_mae, 1e-9, "test_mae");
      expect_close(e.test_r2, ref.test_r2, 1e-9, "test_r2");
      expect_close(e.test_rel_l2_per_output, ref.test_rel_l2_per_output, 1e-9,
                   "test_rel_l2_per_output");
      expect_close(e.test_rel_l2, ref.test_rel_l2, 1e-9, "test_rel_l2");
      expect_same_on_every_rank(all_values(e));
    }
  }
  {
    // An output whose targets are all 0 has no relative error (NaN); the others do.
    const Problem p = regression_problem(0.0, /*zero_column=*/2);
    const EvalEvent ref = reference(p, LossKind::mse, nullptr);
    ASSERT_TRUE(std::isnan(ref.test_rel_l2_per_output[2]));
    for (const testing::OutputMeshCase& c : testing::output_meshes(world_size())) {
      SCOPED_TRACE(c.name + ", a column of zero targets");
      const EvalEvent e = evaluate_on_mesh(p, LossKind::mse, c, nullptr);
      expect_close(e.test_rel_l2_per_output, ref.test_rel_l2_per_output, 1e-9,
                   "test_rel_l2_per_output");
      expect_close(e.test_rel_l2, ref.test_rel_l2, 1e-9, "test_rel_l2");
    }
  }
  // The statistics matter: without them the first output's MSE is off by std^2 = 0.25.
  const Problem p = regression_problem(0.0);
  const EvalEvent with = reference(p, LossKind::mse, &norm);
  const EvalEvent without = reference(p, LossKind::mse, nullptr);
  EXPECT_NEAR(with.test_mse_per_output[0] / without.test_mse_per_output[0], 0.25, 1e-12);
}

TEST(EvalMetrics, BinaryAucAndLogLossMatchTheReferenceOnEveryMesh) {
  const Problem p = binary_problem();
  const EvalEvent ref = binary_reference(p);
  ASSERT_TRUE(std::isnan(ref.test_auc_per_output[3]));
  for (int64_t j = 0; j < 3; ++j) ASSERT_GT(ref.test_auc_per_output[j], 0.6);
  for (const testing::OutputMeshCase& c : testing::output_meshes(world_size())) {
    SCOPED_TRACE(c.name);
    const EvalEvent e = evaluate_on_mesh(p, LossKind::binary_cross_entropy, c, nullptr);
    EXPECT_EQ(e.test_rows, kRows);
    expect_close(e.test_loss, ref.test_loss, 1e-6, "test_loss");
    expect_close(e.test_log_loss_per_output, ref.test_log_loss_per_output, 1e-9,
                 "test_log_loss_per_output");
    expect_close(e.test_log_loss, ref.test_log_loss, 1e-9, "test_log_loss");
    // Counts: exact. The bins (1/512 of a logit for 4 outputs) are finer than the grid.
    expect_close(e.test_auc_per_output, ref.test_auc_per_output, 0.0, "test_auc_per_output");
    EXPECT_EQ(e.test_auc, ref.test_auc);
    EXPECT_EQ(e.test_accuracy, ref.test_accuracy);
    EXPECT_TRUE(e.test_mse_per_output.empty());
    EXPECT_TRUE(e.test_class_accuracy.empty());
    expect_same_on_every_rank(all_values(e));
  }
}

// The eval record (metrics.jsonl, evaluate --json) and line: the fields that apply, a NaN
// inside an array as null, doubles that read back to the same bits.
TEST(EvalEvent, JsonAndLineHoldTheMetricsThatApply) {
  EvalEvent c;
  c.step = 7;
  c.test_loss = 0.1 + 0.2;  // 0.30000000000000004: needs 17 digits
  c.test_accuracy = 0.5;
  c.test_rows = 4;
  c.test_top5_accuracy = 0.75;
  c.test_class_accuracy = {1.0, kNaN};
  c.test_class_rows = {4, 0};
  EXPECT_EQ(
      eval_event_json(c),
      "{\"event\":\"eval\",\"step\":7,\"test_accuracy\":0.5,\"test_class_accuracy\":[1.0,null],"
      "\"test_class_rows\":[4,0],\"test_loss\":0.30000000000000004,\"test_rows\":4,"
      "\"test_top5_accuracy\":0.75}");
  EXPECT_EQ(format_eval_line(c),
            "eval at step 7: test loss 0.30000  test accuracy 0.5000  top-5 0.7500");

  EvalEvent r;
  r.step = 3;
  r.test_loss = 2.0;
  r.test_accuracy = kNaN;
  r.test_rows = 10;
  r.test_mse = 1.5;
  r.test_mae = 0.25;
  r.test_r2 = 0.875;
  r.test_mse_per_output = {1.5};
  r.test_mae_per_output = {0.25};
  r.test_r2_per_output = {0.875};
  r.test_rel_l2 = 0.125;
  r.test_rel_l2_per_output = {0.125};
  EXPECT_EQ(eval_event_json(r),
            "{\"event\":\"eval\",\"step\":3,\"test_loss\":2.0,\"test_mae\":0.25,"
            "\"test_mae_per_output\":[0.25],\"test_mse\":1.5,\"test_mse_per_output\":[1.5],"
            "\"test_r2\":0.875,\"test_r2_per_output\":[0.875],\"test_rel_l2\":0.125,"
            "\"test_rel_l2_per_output\":[0.125],\"test_rows\":10}");
  EXPECT_EQ(format_eval_line(r),
            "eval at step 3: test loss 2.00000  MSE 1.5  MAE 0.25  R^2 0.8750  rel L2 0.125");

  EvalEvent b;
  b.step = 5;
  b.test_loss = 0.5;
  b.test_accuracy = 0.75;
  b.test_rows = 8;
  b.test_auc = 0.875;
  b.test_log_loss = 0.25;
  b.test_auc_per_output = {0.875, kNaN};
  b.test_log_loss_per_output = {0.25, 0.25};
  EXPECT_EQ(eval_event_json(b),
            "{\"event\":\"eval\",\"step\":5,\"test_accuracy\":0.75,\"test_auc\":0.875,"
            "\"test_auc_per_output\":[0.875,null],\"test_log_loss\":0.25,"
            "\"test_log_loss_per_output\":[0.25,0.25],\"test_loss\":0.5,\"test_rows\":8}");
  EXPECT_EQ(
      format_eval_line(b),
      "eval at step 5: test loss 0.50000  test accuracy 0.7500  AUC 0.8750  log loss 0.25000");
}

}  // namespace
}  // namespace meshtrain
