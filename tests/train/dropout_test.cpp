// Dropout ([model] dropout, layers/dropout.hpp) on dp, fsdp, tp and fsdp x tp meshes (2 x 4 at
// np 8 too):
// - the mask: after a training step with 2 micro-batches, every dropout layer's output on
//   every rank equals x * keep * float(1/(1-P)) (rounded to bf16 in a bf16 run) with keep
//   computed here from the key formula
//   of docs/model_math.md (Philox-4x32-10 of {feature, row, step, micro | layer << 16} under
//   the run seed), bit for bit, and the ranks together cover every global element;
// - training with dropout on every mesh equals the one-rank run (losses 1e-5 relative, final
//   parameters 1e-5 + 1e-4 relative, the tolerances of training_run_test), with overlap off
//   and on, and differs from
//   training without it;
// - with an MoE layer, ep and ep x tp meshes equal the one-rank run too;
// - a run saved at step 3 and resumed gives the uninterrupted run's losses and parameters bit
//   for bit, on every mesh;
// - evaluation and the Predictor of a model trained with P = 0.5 equal, bit for bit, those of
//   a P = 0 model with the same parameters;
// - backward multiplies dY by the forward's mask and scale (the reference's gradient checked
//   against central differences of its forward); outside training the layer is the identity
//   both ways;
// - the kept fraction of 2^18 elements is within 4 sigma of 1 - P (P = 0.1, 0.5, 0.9), and
//   each field of the key changes the mask;
// - bad values of model.dropout are refused naming the key.

#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "framework/comm/mpi_util.hpp"
#include "framework/core/philox.hpp"
#include "framework/core/precision.hpp"
#include "layers/dropout.hpp"
#include "run/predictor.hpp"
#include "run/training_run.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/support/finite_differences.hpp"
#include "tests/support/full_tensor.hpp"
#include "tests/support/mesh_cases.hpp"
#include "tests/support/temp_dir.hpp"
#include "tests/support/training_runs.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

constexpr double kRate = 0.3;

// The key formula, written out here (docs/model_math.md) on the KAT-checked generator.
bool reference_keep(uint64_t seed, int64_t step, int64_t micro, int64_t row, int64_t feature,
                    int64_t layer, double rate) {
  const Philox4x32Counter counter{{static_cast<uint32_t>(feature), static_cast<uint32_t>(row),
                                   static_cast<uint32_t>(step),
                                   static_cast<uint32_t>(micro + (layer << 16))}};
  const Philox4x32Key key{
      {static_cast<uint32_t>(seed & 0xffffffffu), static_cast<uint32_t>(seed >> 32)}};
  const double bits = philox4x32_10(counter, key).word[0];
  return bits >= std::floor(rate * 4294967296.0);
}

using testing::MeshCase;

// dp, fsdp, tp, fsdp x tp (2 x 4 at np 8 too).
std::vector<MeshCase> every_mesh() {
  const int n = world_size();
  std::vector<MeshCase> cases = testing::every_mesh(n);
  if (n == 8) cases.push_back({"fsdp_tp", {{"fsdp", 2}, {"tp", 4}}});
  return cases;
}

std::string name_of(const MeshCase& c) {
  return testing::describe(c);
}

// 2 micro-batches of 16 rows per step; widths divide by 4.
RunConfig dropout_config(const MeshCase& c, double rate = kRate) {
  RunConfig config = testing::synthetic_run_config("dropout_test", c.axes, c.preset);
  config.run.seed = 0x1234567890abcdefull;  // both key words non-zero
  config.model.sizes = {8, 16, 16, 4};
  config.model.activation = Activation::tanh;
  config.model.dropout = rate;
  config.data.synthetic_samples = 96;
  config.train.accumulation_steps = 2;
  config.optimizer.lr = 1e-2;
  config.train.steps = 6;
  return config;
}

std::vector<float> host_matrix(MatrixView m) {
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), m);
  std::vector<float> out(h.extent(0) * h.extent(1));
  for (size_t i = 0; i < h.extent(0); ++i) {
    for (size_t j = 0; j < h.extent(1); ++j) out[i * h.extent(1) + j] = h(i, j);
  }
  return out;
}

TEST(Dropout, MaskEqualsTheKeyFormulaOnEveryMesh) {
  for (const MeshCase& c : every_mesh()) {
    for (Dtype dtype : {Dtype::fp32, Dtype::bf16}) {
      SCOPED_TRACE(name_of(c) + (dtype == Dtype::bf16 ? ", bf16" : ", fp32"));
      RunConfig config = dropout_config(c);
      config.mixed_precision.param_dtype = dtype;
      config.mixed_precision.reduce_dtype = dtype;
      TrainingRun run(config);
      run.step();
      run.step();  // the last forward: step 1 (0-based), micro-batch 1
      const std::vector<Layer*>& sequence = run.model().sequence();
      const int64_t batch = config.data.batch_size;
      const float scale = static_cast<float>(1.0 / (1.0 - kRate));
      int layers = 0;
      for (size_t k = 1; k < sequence.size(); ++k) {
        const auto* dropout = dynamic_cast<const DropoutLayer*>(sequence[k]);
        if (!dropout) continue;
        ++layers;
        const int64_t layer = dropout->layer_index();
        EXPECT_EQ(layer, layers - 1);
        const int64_t width = config.model.sizes[static_cast<size_t>(layer) + 1];
        const std::vector<float> in = host_matrix(sequence[k - 1]->output());
        const std::vector<float> out = host_matrix(dropout->output());
        ASSERT_EQ(in.size(), out.size());
        const int64_t local_width = dropout->output_width();
        const int64_t rows = static_cast<int64_t>(out.size()) / local_width;
        const int64_t first_row = run.batch_slice().begin();
        const int64_t first_feature = dropout->output_offset();
        std::vector<int> covered(static_cast<size_t>(batch * width), 0);
        int64_t wrong = 0, dropped = 0;
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t f = 0; f < local_width; ++f) {
            const int64_t row = first_row + r, feature = first_feature + f;
            const bool keep =
                reference_keep(config.run.seed, 1, 1, row, feature, layer, config.model.dropout);
            const float x = in[r * local_width + f];
            const float want = keep ? round_to(x * scale, dtype) : 0.0f;
            if (std::memcmp(&want, &out[r * local_width + f], sizeof(float)) != 0) ++wrong;
            dropped += keep ? 0 : 1;
            covered[row * width + feature] = 1;
          }
        }
        EXPECT_EQ(wrong, 0) << "layer " << layer << ": elements unlike the key formula";
        EXPECT_GT(dropped, 0) << "layer " << layer;
        check_mpi(MPI_Allreduce(MPI_IN_PLACE, covered.data(), static_cast<int>(covered.size()),
                                MPI_INT, MPI_MAX, MPI_COMM_WORLD),
                  "MPI_Allreduce");
        int64_t missing = 0;
        for (int v : covered) missing += v == 0 ? 1 : 0;
        EXPECT_EQ(missing, 0) << "layer " << layer << ": global elements no rank holds";
      }
      EXPECT_EQ(layers, 2);  // one after each hidden activation
    }
  }
}

TEST(Dropout, EveryMeshTrainsLikeOneRank) {
  const MeshCase one{"dp", {{"dp", 1}}};
  std::vector<double> reference_losses, plain_losses;
  std::vector<testing::Tensor> reference_params;
  {
    TrainingRun reference(dropout_config(one), {}, std::nullopt, MPI_COMM_SELF);
    TrainingRun plain(dropout_config(one, 0.0), {}, std::nullopt, MPI_COMM_SELF);
    for (int s = 0; s < 5; ++s) {
      reference_losses.push_back(reference.step().loss);
      plain_losses.push_back(plain.step().loss);
    }
    for (const ShardedTensor& p : reference.model().parameters()) {
      reference_params.push_back(testing::to_host(p));
    }
  }
  double largest_change = 0.0;  // dropout changes the losses after the first step's
  for (int s = 0; s < 5; ++s) {
    largest_change = std::max(largest_change, std::abs(reference_losses[s] - plain_losses[s]) /
                                                  (1 + std::abs(plain_losses[s])));
  }
  EXPECT_GT(largest_change, 1e-3);
  EXPECT_LT(reference_losses.back(), reference_losses.front());  // it learns
  for (const MeshCase& c : every_mesh()) {
    for (bool overlap : {false, true}) {
      SCOPED_TRACE(name_of(c) + (overlap ? ", overlap on" : ", overlap off"));
      RunConfig config = dropout_config(c);
      config.runtime.overlap = overlap;  // FSDP prefetch and DP buckets around the dropout layers
      TrainingRun run(config);
      for (int s = 0; s < 5; ++s) {
        const double loss = run.step().loss;
        EXPECT_NEAR(loss, reference_losses[s], 1e-5 * (1 + std::abs(reference_losses[s])))
            << "step " << s + 1;
      }
      const std::vector<ShardedTensor>& params = run.model().parameters();
      ASSERT_EQ(params.size(), reference_params.size());
      for (size_t i = 0; i < params.size(); ++i) {
        const testing::Tensor full = testing::gather_full(params[i], run.mesh(), world_rank());
        ASSERT_EQ(full.size(), reference_params[i].size());
        for (size_t j = 0; j < full.size(); ++j) {
          ASSERT_NEAR(full[j], reference_params[i][j],
                      1e-5 + 1e-4 * std::abs(reference_params[i][j]))
              << params[i].name << "[" << j << "]";
        }
      }
    }
  }
}

// MoE (layer 1 of 8 experts, top-2) with dropout after both hidden layers: on ep meshes (the
// rows split over ep too) like the one-rank run, losses to 1e-5 relative.
TEST(Dropout, MoeMeshesTrainLikeOneRank) {
  const int n = world_size();
  const auto with_moe = [](RunConfig config) {
    config.model.moe_layers = {1};
    config.model.experts = 8;
    config.model.top_k = 2;
    return config;
  };
  std::vector<double> reference;
  {
    TrainingRun one(with_moe(dropout_config({"dp", {{"dp", 1}, {"ep", 1}}})), {}, std::nullopt,
                    MPI_COMM_SELF);
    for (int s = 0; s < 4; ++s) reference.push_back(one.step().loss);
  }
  std::vector<MeshCase> cases = {{"dp", {{"ep", n}}}};
  if (n % 2 == 0) cases.push_back({"fsdp_tp", {{"fsdp", 1}, {"ep", n / 2}, {"tp", 2}}});
  for (const MeshCase& c : cases) {
    SCOPED_TRACE(name_of(c));
    TrainingRun run(with_moe(dropout_config(c)));
    for (int s = 0; s < 4; ++s) {
      EXPECT_NEAR(run.step().loss, reference[s], 1e-5 * (1 + std::abs(reference[s])))
          << "step " << s + 1;
    }
  }
}

TEST(Dropout, ResumeIsBitIdenticalOnEveryMesh) {
  for (const MeshCase& c : every_mesh()) {
    SCOPED_TRACE(name_of(c));
    const testing::TempDir tmp(/*shared=*/true, "meshtrain_dropout_resume");
    const std::string& dir = tmp.path();
    RunConfig config = dropout_config(c);
    config.checkpoint.dir = dir;
    testing::expect_bit_identical_resume(config, /*save_at=*/3, /*steps=*/6);
  }
}

// A model trained with P = 0.5 and a P = 0 model given its parameters: the same evaluation and
// the same predictions, bit for bit (dropout is off outside training steps).
TEST(Dropout, EvaluationAndPredictorIgnoreDropout) {
  for (const MeshCase& c : every_mesh()) {
    SCOPED_TRACE(name_of(c));
    const testing::TempDir tmp_with(/*shared=*/true, "meshtrain_dropout_with");
    const testing::TempDir tmp_without(/*shared=*/true, "meshtrain_dropout_without");
    const std::string &dir_with = tmp_with.path(), &dir_without = tmp_without.path();
    RunConfig with = dropout_config(c, 0.5), without = dropout_config(c, 0.0);
    with.checkpoint.dir = dir_with;
    without.checkpoint.dir = dir_without;
    TrainingRun a(with), b(without);
    for (int s = 0; s < 3; ++s) a.step();
    std::vector<ShardedTensor>& pa = a.model().parameters();
    std::vector<ShardedTensor>& pb = b.model().parameters();
    ASSERT_EQ(pa.size(), pb.size());
    for (size_t i = 0; i < pa.size(); ++i) Kokkos::deep_copy(pb[i].local, pa[i].local);
    const EvalEvent ea = a.evaluate(), eb = b.evaluate();
    EXPECT_EQ(ea.test_loss, eb.test_loss);
    EXPECT_EQ(ea.test_mse_per_output, eb.test_mse_per_output);
    const std::string path_with = a.save(), path_without = b.save();
    Predictor pw(path_with, 16), po(path_without, 16);
    ASSERT_EQ(pw.local_rows(), po.local_rows());
    Kokkos::View<float**, Kokkos::HostSpace> x("x", pw.local_rows(), pw.inputs());
    Kokkos::View<float**, Kokkos::HostSpace> yw("yw", pw.local_rows(), pw.outputs());
    Kokkos::View<float**, Kokkos::HostSpace> yo("yo", po.local_rows(), po.outputs());
    for (size_t i = 0; i < x.extent(0); ++i) {
      for (size_t j = 0; j < x.extent(1); ++j) {
        x(i, j) = std::sin(0.7f * static_cast<float>(pw.slice().begin() + static_cast<int64_t>(i)) +
                           0.3f * static_cast<float>(j));
      }
    }
    pw.predict(x, yw);
    po.predict(x, yo);
    int64_t differ = 0;
    for (size_t i = 0; i < yw.extent(0); ++i) {
      for (size_t j = 0; j < yw.extent(1); ++j) differ += yw(i, j) == yo(i, j) ? 0 : 1;
    }
    EXPECT_EQ(differ, 0);
  }
}

// One layer on 512 x 512 elements at row key.first_row and feature `first_feature` of a
// larger batch.
std::vector<float> masked(double rate, const TrainingPass& key, int64_t layer,
                          int64_t first_feature = 3000) {
  constexpr int64_t n = 512;
  DropoutLayer dropout(rate, layer, "dropout_test/out", n, n, FeatureLayout::split, first_feature,
                       Dtype::fp32);
  Matrix x("dropout_test/x", n, n);
  Kokkos::deep_copy(x, 1.0f);
  LayerPass pass;
  pass.training = &key;
  return host_matrix(dropout.forward(x, pass));
}

TEST(Dropout, KeptFractionAndEveryKeyFieldMatters) {
  const TrainingPass key{7, 12, 1, 1000};
  for (double rate : {0.1, 0.5, 0.9}) {
    SCOPED_TRACE(rate);
    const std::vector<float> out = masked(rate, key, 2);
    const double n = static_cast<double>(out.size());
    const float scale = static_cast<float>(1.0 / (1.0 - rate));
    double kept = 0;
    for (float v : out) {
      ASSERT_TRUE(v == 0.0f || v == scale) << v;
      kept += v == scale ? 1 : 0;
    }
    const double sigma = std::sqrt(n * rate * (1 - rate));
    EXPECT_LE(std::abs(kept - n * (1 - rate)), 4 * sigma) << kept << " of " << n;
  }
  // Changing any one field gives another mask (agreeing on about half of the elements at
  // P = 0.5), and the same key the same one.
  const std::vector<float> base = masked(0.5, key, 2);
  EXPECT_EQ(masked(0.5, key, 2), base);
  const auto agreement = [&](const std::vector<float>& other) {
    double same = 0;
    for (size_t i = 0; i < base.size(); ++i) same += base[i] == other[i] ? 1 : 0;
    return same / static_cast<double>(base.size());
  };
  EXPECT_LT(agreement(masked(0.5, {8, 12, 1, 1000}, 2)), 0.52);           // seed
  EXPECT_LT(agreement(masked(0.5, {7, 13, 1, 1000}, 2)), 0.52);           // step
  EXPECT_LT(agreement(masked(0.5, {7, 12, 0, 1000}, 2)), 0.52);           // micro-batch
  EXPECT_LT(agreement(masked(0.5, {7, 12, 1, 1512}, 2)), 0.52);           // rows
  EXPECT_LT(agreement(masked(0.5, key, 3)), 0.52);                        // layer
  EXPECT_LT(agreement(masked(0.5, key, 2, 3512)), 0.52);                  // features
  EXPECT_LT(agreement(masked(0.5, {7ull << 32, 12, 1, 1000}, 2)), 0.52);  // seed's high word
}

// Backward multiplies dY by the forward's mask and scale (recomputed), in place; after a
// forward outside training it passes dY through untouched; the forward outside training
// returns its input itself.
TEST(Dropout, BackwardUsesTheForwardMask) {
  constexpr int64_t n = 64;
  const double rate = 0.4;
  const float scale = static_cast<float>(1.0 / (1.0 - rate));
  DropoutLayer dropout(rate, 1, "dropout_test/out", n, n, FeatureLayout::split, 16, Dtype::fp32);
  Matrix x("dropout_test/x", n, n), dy("dropout_test/dy", n, n);
  auto hx = Kokkos::create_mirror_view(x);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) hx(i, j) = 0.5f + 0.01f * static_cast<float>(i * n + j);
  }
  Kokkos::deep_copy(x, hx);
  const TrainingPass key{11, 5, 0, 32};
  LayerPass training;
  training.training = &key;
  const std::vector<float> out = host_matrix(dropout.forward(x, training));
  Kokkos::deep_copy(dy, 3.0f);
  const MatrixView dx = dropout.backward(dy, true, LayerPass{});
  EXPECT_EQ(dx.data(), dy.data());
  const std::vector<float> grad = host_matrix(dx);
  int64_t wrong = 0;
  for (int64_t e = 0; e < n * n; ++e) {
    const int64_t i = e / n, j = e % n;
    const bool keep = reference_keep(11, 5, 0, 32 + i, 16 + j, 1, rate);
    wrong += out[e] == (keep ? hx(i, j) * scale : 0.0f) ? 0 : 1;
    wrong += grad[e] == (keep ? 3.0f * scale : 0.0f) ? 0 : 1;
  }
  EXPECT_EQ(wrong, 0);
  // The reference backward above, dY * keep * scale, is the derivative of the reference forward
  // x * keep * scale: central differences in float64 of L = sum(dY * forward(x)). The forward
  // is linear in x, so the difference has no truncation error, only rounding, eps |L| / h ~
  // 2e-8 for |L| ~ 2e5 and h = 1e-3: tolerance 1e-7 (1 + |g|) (a mask or scale off anywhere
  // moves an element's gradient by O(1)).
  {
    testing::Tensors x_values(1), reference_grad(1);
    std::vector<double> keeps(n * n);
    for (int64_t e = 0; e < n * n; ++e) {
      keeps[e] = reference_keep(11, 5, 0, 32 + e / n, 16 + e % n, 1, rate) ? 1.0 : 0.0;
      x_values[0].push_back(hx(e / n, e % n));
      reference_grad[0].push_back(3.0 * keeps[e] * scale);
    }
    const testing::Tensors numeric = testing::central_differences(
        x_values,
        [&](const testing::Tensors& v) {
          double loss = 0.0;
          for (int64_t e = 0; e < n * n; ++e) loss += 3.0 * v[0][e] * keeps[e] * scale;
          return loss;
        },
        1e-3);
    testing::expect_matches_central_differences(numeric, reference_grad, 1e-7, {"dx"});
  }
  // Outside training: the identity, no copy, and backward leaves dY as it is.
  EXPECT_EQ(dropout.forward(x, LayerPass{}).data(), x.data());
  Kokkos::deep_copy(dy, 3.0f);
  for (float g : host_matrix(dropout.backward(dy, true, LayerPass{}))) ASSERT_EQ(g, 3.0f);
}

TEST(Dropout, BadRateNamesTheKey) {
  const MeshCase one{"dp", {{"dp", 1}}};
  for (double rate : {-0.1, 1.0, 1.5, std::nan("")}) {
    SCOPED_TRACE(rate);
    RunConfig config = dropout_config(one, rate);
    testing::expect_bad_input([&] { TrainingRun run(config, {}, std::nullopt, MPI_COMM_SELF); },
                              {"model.dropout", "[0, 1)"});
  }
}

}  // namespace
}  // namespace meshtrain
