// The losses with float targets (layers/loss.hpp): mse, huber, mae and binary_cross_entropy
// (logits from -25 to 25, targets 0, 1 and 0.3), with and without per-output
// weights, on dp, fsdp, tp (outputs split and replicated) and fsdp x tp meshes against the
// float64 reference of tests/support/reference_losses.hpp computed here from the same global
// outputs and targets. Each rank hands in its rows (and, split, its columns), as training
// does; the loss (all-reduced) and this rank's block of the gradient must match the
// reference's to float rounding. The errors cover both sides of huber's delta, d = 0 exactly
// (mae's subgradient 0) and a zero weight. binary_cross_entropy also counts targets outside
// [0, 1] (and NaN) over the whole batch, on every rank.
//
// The reference's own gradients are checked against central differences of its loss, away
// from the kinks (|d| = delta, d = 0) where the derivative is not defined.

#include <gtest/gtest.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "framework/comm/mesh_communicators.hpp"
#include "layers/loss.hpp"
#include "tests/support/backend.hpp"
#include "tests/support/finite_differences.hpp"
#include "tests/support/mesh_cases.hpp"
#include "tests/support/reference_losses.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

constexpr int64_t kRows = 8;   // global rows of the batch
constexpr int64_t kWidth = 4;  // outputs
constexpr double kDelta = 0.7;

struct LossCase {
  std::string name;
  LossKind kind;
  std::vector<double> weights;  // empty: unweighted
};

std::vector<LossCase> loss_cases() {
  const std::vector<double> weights = {0.5, 2.0, 0.0, 1.25};
  return {{"mse", LossKind::mse, {}},
          {"mse weighted", LossKind::mse, weights},
          {"huber", LossKind::huber, {}},
          {"huber weighted", LossKind::huber, weights},
          {"mae", LossKind::mae, {}},
          {"mae weighted", LossKind::mae, weights},
          {"binary_cross_entropy", LossKind::binary_cross_entropy, {}},
          {"binary_cross_entropy weighted", LossKind::binary_cross_entropy, weights}};
}

// Global outputs and targets [kRows, kWidth], row-major, as floats (what the kernels read).
struct Problem {
  std::vector<float> outputs, targets;
};

Problem problem(LossKind kind) {
  // Errors on both sides of delta = 0.7 (none within 0.05 of it) and exact zeros.
  const double errors[] = {-2.5, -0.9, -0.3, 0.0, 0.2, 0.55, 1.5, 3.0, 0.0, -0.05};
  Problem p;
  if (kind == LossKind::binary_cross_entropy) {
    // Logits far into both tails (where a naive log(1 + e^z) overflows or loses all digits)
    // and near 0; targets 0, 1 and a soft 0.3.
    const double logits[] = {-25.0, -8.0, -1.2, -0.1, 0.0, 0.4, 2.5, 9.0, 25.0, -3.3};
    const float targets[] = {0.0f, 1.0f, 0.3f};
    for (int64_t i = 0; i < kRows; ++i) {
      for (int64_t j = 0; j < kWidth; ++j) {
        p.outputs.push_back(static_cast<float>(logits[(i * 3 + j * 7) % 10]));
        p.targets.push_back(targets[(i + 2 * j) % 3]);
      }
    }
    return p;
  }
  for (int64_t i = 0; i < kRows; ++i) {
    for (int64_t j = 0; j < kWidth; ++j) {
      const float t = static_cast<float>(2.0 * std::sin(0.9 * i + 1.7 * j));
      const double e = errors[(i * 3 + j * 7) % 10];
      p.targets.push_back(t);
      p.outputs.push_back(e == 0.0 ? t : static_cast<float>(t + e));
    }
  }
  return p;
}

std::vector<double> as_double(const std::vector<float>& v) {
  return std::vector<double>(v.begin(), v.end());
}

TEST(RegressionLoss, MatchesFloat64ReferenceOnEveryMesh) {
  for (const LossCase& lc : loss_cases()) {
    const Problem p = problem(lc.kind);
    std::vector<double> ref_grad;
    const double ref_loss =
        testing::regression_loss_and_gradient(lc.kind, as_double(p.outputs), kRows, kWidth,
                                              as_double(p.targets), kDelta, lc.weights, ref_grad);
    for (const testing::OutputMeshCase& c : testing::output_meshes(world_size())) {
      SCOPED_TRACE(lc.name + " on " + c.name);
      const Mesh mesh = Mesh::create(c.axes, world_size());
      MeshCommunicators comms(mesh, MPI_COMM_WORLD, testing::test_communicator_factory());
      ParallelContext context(comms, {"fsdp", "dp"}, "tp");
      const int64_t rows = kRows / context.batch_parallel();
      const bool split = c.layout == FeatureLayout::split && context.feature_parallel() > 1;
      const int64_t lw = split ? kWidth / context.feature_parallel() : kWidth;
      const int64_t offset = split ? context.feature_index() * lw : 0;
      const int64_t first = context.batch_index() * rows;
      Loss loss(lc.kind, context, rows, kWidth, c.layout, LossOptions{kDelta, lc.weights});
      Matrix output("output", rows, lw);
      Matrix targets("targets", rows, kWidth);
      auto oh = Kokkos::create_mirror_view(output);
      auto th = Kokkos::create_mirror_view(targets);
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t j = 0; j < lw; ++j) oh(i, j) = p.outputs[(first + i) * kWidth + offset + j];
        for (int64_t j = 0; j < kWidth; ++j) th(i, j) = p.targets[(first + i) * kWidth + j];
      }
      Kokkos::deep_copy(output, oh);
      Kokkos::deep_copy(targets, th);
      const LossResult r = loss.regression(output, targets);
      EXPECT_EQ(r.count, kRows);
      EXPECT_EQ(r.targets_outside, 0);
      EXPECT_EQ(r.correct, 0);  // counts argmax hits for cross_entropy only
      EXPECT_NEAR(r.loss, ref_loss, 1e-6 * std::max(1.0, std::abs(ref_loss)));
      auto gh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), loss.gradient());
      int reported = 0;
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t j = 0; j < lw; ++j) {
          const double expected = ref_grad[(first + i) * kWidth + offset + j];
          if (std::abs(gh(i, j) - expected) > 1e-6 && reported++ < 5) {
            ADD_FAILURE() << "gradient of global row " << first + i << ", output " << offset + j
                          << " is " << gh(i, j) << ", expected " << expected;
          }
        }
      }
      // Padding rows (an evaluation's last batch) add nothing: the loss over the first
      // valid rows of each rank is the reference's over those rows.
      if (rows > 1) {
        const LossResult padded = loss.regression(output, targets, false, rows - 1);
        EXPECT_EQ(padded.count, kRows - context.batch_parallel());
        double expected_sum = 0;
        for (int b = 0; b < context.batch_parallel(); ++b) {
          std::vector<double> y, t, unused;
          for (int64_t i = b * rows; i < b * rows + rows - 1; ++i) {
            for (int64_t j = 0; j < kWidth; ++j) {
              y.push_back(p.outputs[i * kWidth + j]);
              t.push_back(p.targets[i * kWidth + j]);
            }
          }
          expected_sum +=
              (rows - 1) * testing::regression_loss_and_gradient(lc.kind, y, rows - 1, kWidth, t,
                                                                 kDelta, lc.weights, unused);
        }
        EXPECT_NEAR(padded.loss_sum, expected_sum, 1e-6 * std::max(1.0, std::abs(expected_sum)));
      }
    }
  }
}

// binary_cross_entropy counts the targets outside [0, 1] (NaN too) over the global batch, the
// same count on every rank, split or not; padding rows are not counted.
TEST(RegressionLoss, BinaryCrossEntropyCountsTargetsOutsideZeroToOne) {
  Problem p = problem(LossKind::binary_cross_entropy);
  // Global (row, output) pairs made bad: 1.5, -0.25, NaN, 2.
  const std::vector<std::pair<int64_t, int64_t>> bad = {{0, 1}, {3, 2}, {6, 0}, {kRows - 1, 3}};
  const float values[] = {1.5f, -0.25f, std::nanf(""), 2.0f};
  for (size_t k = 0; k < bad.size(); ++k) {
    p.targets[bad[k].first * kWidth + bad[k].second] = values[k];
  }
  for (const testing::OutputMeshCase& c : testing::output_meshes(world_size())) {
    SCOPED_TRACE(c.name);
    const Mesh mesh = Mesh::create(c.axes, world_size());
    MeshCommunicators comms(mesh, MPI_COMM_WORLD, testing::test_communicator_factory());
    ParallelContext context(comms, {"fsdp", "dp"}, "tp");
    const int64_t rows = kRows / context.batch_parallel();
    const bool split = c.layout == FeatureLayout::split && context.feature_parallel() > 1;
    const int64_t lw = split ? kWidth / context.feature_parallel() : kWidth;
    const int64_t offset = split ? context.feature_index() * lw : 0;
    const int64_t first = context.batch_index() * rows;
    Loss loss(LossKind::binary_cross_entropy, context, rows, kWidth, c.layout);
    Matrix output("output", rows, lw);
    Matrix targets("targets", rows, kWidth);
    auto oh = Kokkos::create_mirror_view(output);
    auto th = Kokkos::create_mirror_view(targets);
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < lw; ++j) oh(i, j) = p.outputs[(first + i) * kWidth + offset + j];
      for (int64_t j = 0; j < kWidth; ++j) th(i, j) = p.targets[(first + i) * kWidth + j];
    }
    Kokkos::deep_copy(output, oh);
    Kokkos::deep_copy(targets, th);
    EXPECT_EQ(loss.regression(output, targets).targets_outside, 4);
    // Every rank's last row is padding: the bad targets in those rows are not counted.
    int64_t counted = 0;
    for (const auto& [row, column] : bad) counted += row % rows != rows - 1 ? 1 : 0;
    EXPECT_EQ(loss.regression(output, targets, false, rows - 1).targets_outside, counted);
  }
}

// The new kinds' names and the output weights' checks.
TEST(RegressionLoss, KindsAreRegressionAndWeightsMustFitTheOutputs) {
  EXPECT_EQ(parse_loss_kind("huber"), LossKind::huber);
  EXPECT_EQ(parse_loss_kind("mae"), LossKind::mae);
  EXPECT_EQ(parse_loss_kind("binary_cross_entropy"), LossKind::binary_cross_entropy);
  EXPECT_TRUE(is_regression(LossKind::mse));
  EXPECT_TRUE(is_regression(LossKind::huber));
  EXPECT_TRUE(is_regression(LossKind::mae));
  EXPECT_FALSE(is_regression(LossKind::cross_entropy));
  EXPECT_FALSE(is_regression(LossKind::binary_cross_entropy));
  EXPECT_TRUE(takes_targets(LossKind::binary_cross_entropy));
  EXPECT_TRUE(takes_targets(LossKind::mae));
  EXPECT_FALSE(takes_targets(LossKind::cross_entropy));
  const Mesh mesh = Mesh::create({{"dp", world_size()}}, world_size());
  MeshCommunicators comms(mesh, MPI_COMM_WORLD, testing::test_communicator_factory());
  ParallelContext context(comms, {"fsdp", "dp"}, "tp");
  EXPECT_THROW(Loss(LossKind::mse, context, 2, kWidth, FeatureLayout::replicated,
                    LossOptions{1.0, {1.0, 2.0}}),
               Error);
  EXPECT_THROW(Loss(LossKind::cross_entropy, context, 2, kWidth, FeatureLayout::replicated,
                    LossOptions{1.0, {1.0, 1.0, 1.0, 1.0}}),
               Error);
}

// The reference's gradients are the derivatives of its losses (away from the kinks).
TEST(RegressionLossReference, GradientsMatchCentralDifferences) {
  std::vector<double> y, t;
  const double errors[] = {-2.5, -0.9, -0.3, 0.1, 0.2, 0.55, 1.5, 3.0, -0.45, -0.05};
  for (int64_t k = 0; k < kRows * kWidth; ++k) {
    t.push_back(std::sin(0.37 * k));
    y.push_back(t.back() + errors[k % 10]);
  }
  const std::vector<double> weights = {0.5, 2.0, 0.0, 1.25};
  for (LossKind kind :
       {LossKind::mse, LossKind::huber, LossKind::mae, LossKind::binary_cross_entropy}) {
    if (kind == LossKind::binary_cross_entropy) {
      for (double& v : t) v = 0.5 + 0.5 * v;  // targets in [0, 1]
    }
    for (const std::vector<double>& w : {std::vector<double>{}, weights}) {
      SCOPED_TRACE(std::string(to_string(kind)) + (w.empty() ? "" : " weighted"));
      std::vector<double> analytic;
      testing::regression_loss_and_gradient(kind, y, kRows, kWidth, t, kDelta, w, analytic);
      const auto loss = [&](const testing::Tensors& v) {
        std::vector<double> unused;
        return testing::regression_loss_and_gradient(kind, v[0], kRows, kWidth, t, kDelta, w,
                                                     unused);
      };
      const testing::Tensors numeric = testing::central_differences({y}, loss, 1e-6);
      testing::expect_matches_central_differences(numeric, {analytic}, 1e-7, {"dy"});
    }
  }
}

}  // namespace
}  // namespace meshtrain
