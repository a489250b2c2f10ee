// Normalization kept with the model (issue 26, item 4) and checkpoint.init_from (item 5),
// through TrainingRun's C++ API on in-code regression data of 9000 rows (three 4096-row
// statistics blocks) whose 8 features run from 1e-3 to 1e4, one of them constant:
//  - the statistics equal a float64 reference computed here (two passes in long double) and
//    are the same bits on dp, fsdp, tp and fsdp x tp meshes as on one rank; the constant
//    feature gets std 1 and a note;
//  - the model sees (x - mean) / std: a normalized run has bit for bit the losses and the
//    evaluation of a raw run on rows standardized here;
//  - the statistics are in the checkpoint (float64, crc32: verify_checkpoint passes) and a
//    resumed run keeps them bit for bit (on other rows, where new statistics would differ);
//  - init_from onto another mesh starts at step 0 with the source's parameters (the bytes of
//    its checkpoint), fresh optimizer state and its statistics; a resumable checkpoint of its
//    own wins over init_from; a model of another shape is refused naming the parameter and
//    both shapes, statistics that data.normalize_inputs does not ask for naming that key;
//  - raw inputs whose scales differ by more than 1e4 get a warning naming the key, and
//    normalized or evenly scaled ones do not; normalize_targets with cross_entropy is refused
//    naming the key.

#include <gtest/gtest.h>
#include <hdf5.h>
#include <mpi.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "framework/comm/mpi_util.hpp"
#include "framework/io/checkpoint.hpp"
#include "framework/io/normalization.hpp"
#include "run/training_run.hpp"
#include "tests/support/agreed_error.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/support/mesh_cases.hpp"
#include "tests/support/temp_dir.hpp"
#include "tests/support/training_runs.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

constexpr int64_t kFeatures = 8;
constexpr int64_t kTargets = 4;
constexpr int64_t kConstantFeature = 3;

double normal(std::mt19937_64& gen) {
  const double u1 = (static_cast<double>(gen() >> 11) + 1.0) * 0x1.0p-53;
  const double u2 = static_cast<double>(gen() >> 11) * 0x1.0p-53;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

// Features at scales 1e-3 .. 1e4 (one far from 0 with a small spread, one constant), targets
// a smooth function of them plus noise. `even`: every feature ~ N(0, 1) instead.
Dataset regression_rows(int64_t n, uint64_t seed, bool even = false) {
  Dataset d;
  d.description = "normalization test rows";
  d.num_samples = n;
  d.features = kFeatures;
  d.target_width = kTargets;
  d.inputs.resize(static_cast<size_t>(n * kFeatures));
  d.targets.resize(static_cast<size_t>(n * kTargets));
  std::mt19937_64 gen(seed);
  for (int64_t s = 0; s < n; ++s) {
    double f[kFeatures];
    if (even) {
      for (double& v : f) v = normal(gen);
    } else {
      f[0] = normal(gen);
      f[1] = 1e4 + 1e-3 * normal(gen);
      f[2] = 1e-3 * normal(gen);
      f[3] = 5.0;
      f[4] = 100.0 + 10.0 * normal(gen);
      f[5] = 3.0 * normal(gen) - 1.0;
      f[6] = f[0] * f[0];
      f[7] = -2e3 + 7.0 * normal(gen);
    }
    for (int64_t c = 0; c < kFeatures; ++c) d.inputs[s * kFeatures + c] = static_cast<float>(f[c]);
    const double t[kTargets] = {std::tanh(f[0]) + 0.1 * normal(gen), 50.0 + 2.0 * normal(gen),
                                1e3 * std::sin(f[5]), 0.5 * f[5] + 1e-2 * (f[4] - 100.0)};
    for (int64_t o = 0; o < kTargets; ++o) d.targets[s * kTargets + o] = static_cast<float>(t[o]);
  }
  return d;
}

RunData regression_data(uint64_t seed = 11, bool even = false) {
  return RunData{regression_rows(9000, seed, even), regression_rows(1000, seed + 100, even)};
}

RunConfig regression_config(std::vector<std::pair<std::string, int>> axes,
                            const std::string& preset) {
  RunConfig config = testing::synthetic_run_config("normalization_test", std::move(axes), preset);
  config.run.seed = 5;
  config.model.sizes = {kFeatures, 16, kTargets};  // every width divides by 4
  config.model.activation = Activation::tanh;
  config.model.loss = LossKind::mse;
  config.data.synthetic_samples = 9000;  // unused: the rows are given
  config.data.batch_size = 32;
  config.data.normalize_inputs = Normalize::standard;
  config.data.normalize_targets = Normalize::standard;
  config.optimizer.lr = 1e-2;
  config.train.steps = 4;
  config.train.log_every = 2;
  return config;
}

using testing::every_mesh;
using testing::MeshCase;

// Mean and population std of column c of `rows` (width w), two passes in long double.
std::pair<double, double> reference_moments(const std::vector<float>& rows, int64_t w, int64_t c) {
  const int64_t n = static_cast<int64_t>(rows.size()) / w;
  long double sum = 0;
  for (int64_t r = 0; r < n; ++r) sum += rows[r * w + c];
  const long double mean = sum / n;
  long double squares = 0;
  for (int64_t r = 0; r < n; ++r) {
    const long double d = rows[r * w + c] - mean;
    squares += d * d;
  }
  return {static_cast<double>(mean), static_cast<double>(std::sqrt(squares / n))};
}

bool same_bits(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

bool same_bits(const Normalization& a, const Normalization& b) {
  return same_bits(a.input_mean, b.input_mean) && same_bits(a.input_std, b.input_std) &&
         same_bits(a.target_mean, b.target_mean) && same_bits(a.target_std, b.target_std);
}

// The same answer on every rank (or a failure naming this rank).
void expect_on_every_rank(bool mine, const std::string& what) {
  int value = mine ? 1 : 0, all = 0;
  check_mpi(MPI_Allreduce(&value, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD), "MPI_Allreduce");
  EXPECT_EQ(all, 1) << what << " (this rank: " << mine << ", rank " << world_rank() << ")";
}

// Every float32 dataset under `group` of a checkpoint, read whole (serial HDF5).
std::map<std::string, std::vector<float>> read_tensors(const std::string& file,
                                                       const std::string& group) {
  std::map<std::string, std::vector<float>> tensors;
  for (const DatasetListing& d : list_checkpoint(file).datasets) {
    if (d.path.rfind(group, 0) != 0) continue;
    const hid_t h5 = H5Fopen(file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    const hid_t set = H5Dopen2(h5, d.path.c_str(), H5P_DEFAULT);
    int64_t count = 1;
    for (int64_t e : d.shape) count *= e;
    std::vector<float> values(static_cast<size_t>(count));
    EXPECT_GE(H5Dread(set, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()), 0);
    H5Dclose(set);
    H5Fclose(h5);
    tensors[d.path.substr(group.size())] = std::move(values);
  }
  return tensors;
}

bool has_warning(const TrainingRun& run, const std::string& fragment) {
  for (const std::string& w : run.warnings()) {
    if (w.find(fragment) != std::string::npos) return true;
  }
  return false;
}

// Mean and std per input feature and target against the long double reference: 1e-12
// relative (the feature at 1e4 with a spread of 1e-3 included; about 1e-15 is reached). The
// constant feature: its mean, and std 1.
TEST(Normalization, StatisticsMatchAFloat64ReferenceOnEveryMesh) {
  const int n = world_size();
  const RunData data = regression_data();
  const Normalization one_rank =
      TrainingRun(regression_config({{"dp", 1}}, "dp"), {}, data, MPI_COMM_SELF).normalization();
  ASSERT_EQ(one_rank.input_mean.size(), static_cast<size_t>(kFeatures));
  ASSERT_EQ(one_rank.target_mean.size(), static_cast<size_t>(kTargets));
  for (int64_t c = 0; c < kFeatures; ++c) {
    SCOPED_TRACE("input feature " + std::to_string(c));
    const auto [mean, std_dev] = reference_moments(data.train.inputs, kFeatures, c);
    EXPECT_NEAR(one_rank.input_mean[c], mean, 1e-12 * std::fabs(mean));
    if (c == kConstantFeature) {
      EXPECT_EQ(std_dev, 0.0);
      EXPECT_EQ(one_rank.input_std[c], 1.0);
    } else {
      EXPECT_NEAR(one_rank.input_std[c], std_dev, 1e-12 * std_dev);
    }
  }
  for (int64_t o = 0; o < kTargets; ++o) {
    SCOPED_TRACE("target " + std::to_string(o));
    const auto [mean, std_dev] = reference_moments(data.train.targets, kTargets, o);
    EXPECT_NEAR(one_rank.target_mean[o], mean, 1e-12 * std::fabs(mean));
    EXPECT_NEAR(one_rank.target_std[o], std_dev, 1e-12 * std_dev);
  }
  for (const MeshCase& m : every_mesh(n)) {
    SCOPED_TRACE(m.preset);
    TrainingRun run(regression_config(m.axes, m.preset), {}, data);
    expect_on_every_rank(same_bits(run.normalization(), one_rank),
                         "the statistics are the one-rank run's bit for bit");
    // The note about the constant feature, on rank 0 (where warnings are kept).
    if (world_rank() == 0) {
      EXPECT_TRUE(has_warning(run, "input feature 3 is constant")) << run.warnings().size();
    }
  }
}

// Standardizing the rows here with the run's statistics and training on them raw gives the
// normalized run's losses and evaluation bit for bit: the model sees float((x - mean) / std)
// computed in float64, for training and evaluation batches (inputs and targets) alike.
TEST(Normalization, TheModelSeesStandardizedBatches) {
  const int n = world_size();
  const RunData data = regression_data();
  for (const MeshCase& m : {every_mesh(n)[1], every_mesh(n).back()}) {
    SCOPED_TRACE(m.preset);
    RunConfig config = regression_config(m.axes, m.preset);
    config.data.prefetch = 2;
    TrainingRun normalized(config, {}, data);
    const Normalization& stats = normalized.normalization();
    RunData standardized = data;
    for (Dataset* d : {&standardized.train, &standardized.test}) {
      for (int64_t s = 0; s < d->num_samples; ++s) {
        for (int64_t c = 0; c < kFeatures; ++c) {
          float& x = d->inputs[s * kFeatures + c];
          x = static_cast<float>((static_cast<double>(x) - stats.input_mean[c]) /
                                 stats.input_std[c]);
        }
        for (int64_t o = 0; o < kTargets; ++o) {
          float& y = d->targets[s * kTargets + o];
          y = static_cast<float>((static_cast<double>(y) - stats.target_mean[o]) /
                                 stats.target_std[o]);
        }
      }
    }
    config.data.normalize_inputs = config.data.normalize_targets = Normalize::none;
    config.data.prefetch = 0;
    TrainingRun raw(config, {}, standardized);
    EXPECT_FALSE(raw.normalization().inputs());
    for (int s = 0; s < 3; ++s) {
      const double a = normalized.step().loss, b = raw.step().loss;
      EXPECT_EQ(a, b) << "step " << s + 1;
    }
    EXPECT_EQ(normalized.evaluate().test_loss, raw.evaluate().test_loss);
  }
}

// The checkpoint holds the statistics (read_normalization, verify_checkpoint: float64 with
// their CRC-32s); a run resumed from it on another mesh, given other rows (on which new
// statistics would differ), keeps them bit for bit and saves them again.
TEST(Normalization, StatisticsSurviveSaveAndResume) {
  const int n = world_size();
  const testing::TempDir tmp(/*shared=*/true, "meshtrain_norm_resume");
  const std::string& dir = tmp.path();
  RunConfig config = regression_config({{"fsdp", n}}, "fsdp");
  config.run.output_dir = dir;
  config.checkpoint.dir = dir + "/checkpoints";
  config.checkpoint.resume = true;
  Normalization saved;
  {
    TrainingRun run(config, {}, regression_data());
    run.train();
    saved = run.normalization();
  }
  const std::string first = *find_latest_checkpoint(config.checkpoint.dir);
  expect_on_every_rank(same_bits(read_normalization(first), saved),
                       "the checkpoint holds the run's statistics");
  EXPECT_EQ(verify_checkpoint(first), static_cast<int64_t>(list_checkpoint(first).datasets.size()));

  RunConfig resumed_config = config;
  resumed_config.mesh.axes = {{"dp", n}};
  resumed_config.partition.preset = "dp";
  resumed_config.train.steps = 6;
  TrainingRun other_rows(resumed_config, {}, regression_data(/*seed=*/99));
  EXPECT_FALSE(same_bits(other_rows.normalization(), Normalization{}));
  {
    // What the other rows' statistics would be: not what the resumed run uses.
    RunConfig fresh = resumed_config;
    fresh.checkpoint.resume = false;
    TrainingRun recomputed(fresh, {}, regression_data(/*seed=*/99));
    EXPECT_FALSE(same_bits(recomputed.normalization(), saved));
  }
  ASSERT_TRUE(other_rows.resumed_from().has_value());
  expect_on_every_rank(same_bits(other_rows.normalization(), saved),
                       "the resumed run keeps the checkpoint's statistics");
  other_rows.train();
  expect_on_every_rank(
      same_bits(read_normalization(*find_latest_checkpoint(config.checkpoint.dir)), saved),
      "the resumed run's checkpoint holds them again");

  // A resumed run cannot stop normalizing half-way: the key is named.
  RunConfig raw = resumed_config;
  raw.data.normalize_inputs = Normalize::none;
  raw.train.steps = 8;
  const std::string message = testing::expect_agreed_error(
      [&] { TrainingRun run(raw, {}, regression_data()); }, ErrorKind::bad_input);
  EXPECT_NE(message.find("data.normalize_inputs"), std::string::npos) << message;
}

// init_from: a source run on fsdp (x tp) trains 4 steps; a run on another mesh, on other rows,
// starts from its checkpoint (a directory, its latest pointer, the file) at step 0 with its
// parameters bit for bit, zero AdamW moments and its statistics. Once that run has a
// checkpoint of its own, resuming wins over init_from.
TEST(Normalization, InitFromStartsANewRunOnAnotherMesh) {
  const int n = world_size();
  const testing::TempDir tmp(/*shared=*/true, "meshtrain_norm_init_from");
  const std::string& dir = tmp.path();
  const MeshCase source_mesh = every_mesh(n).back();
  RunConfig source = regression_config(source_mesh.axes, source_mesh.preset);
  source.run.output_dir = dir + "/source";
  source.checkpoint.dir = dir + "/source/checkpoints";
  Normalization source_stats;
  {
    TrainingRun run(source, {}, regression_data());
    run.train();
    source_stats = run.normalization();
  }
  const std::string source_file = *find_latest_checkpoint(source.checkpoint.dir);
  const auto source_params = read_tensors(source_file, "/params/");
  ASSERT_EQ(source_params.size(), 4u);

  RunConfig tuned = regression_config({{"tp", n}}, "tp");
  tuned.run.output_dir = dir + "/tuned";
  tuned.checkpoint.dir = dir + "/tuned/checkpoints";
  tuned.checkpoint.resume = true;
  tuned.train.steps = 2;
  for (const std::string& from :
       {source.checkpoint.dir, source.checkpoint.dir + "/latest", source_file}) {
    SCOPED_TRACE(from);
    tuned.checkpoint.init_from = from;
    TrainingRun run(tuned, {}, regression_data(/*seed=*/99));
    EXPECT_EQ(run.steps_done(), 0);
    EXPECT_FALSE(run.resumed_from().has_value());
    ASSERT_TRUE(run.initialized_from().has_value());
    EXPECT_EQ(run.initialized_from()->path, source_file);
    EXPECT_EQ(run.initialized_from()->train_state.step, 4);
    EXPECT_EQ(run.optimizer().step_count(), 0);
    expect_on_every_rank(same_bits(run.normalization(), source_stats),
                         "init_from takes the source's statistics");
    if (from == source_file) {
      const std::string at_start = run.save();  // step 0, on the tp mesh
      std::map<std::string, std::vector<float>> params, moments;
      if (world_rank() == 0) {
        params = read_tensors(at_start, "/params/");
        moments = read_tensors(at_start, "/opt_state/m/");
      }
      if (world_rank() == 0) {
        EXPECT_EQ(params, source_params) << "the parameters are the source checkpoint's";
        ASSERT_EQ(moments.size(), 4u);
        for (const auto& [name, values] : moments) {
          for (float v : values) ASSERT_EQ(v, 0.0f) << "fresh optimizer state: " << name;
        }
      }
      run.train();  // 2 steps: the run now has checkpoints of its own
    }
  }
  // Re-started with the same config, the fine-tune continues rather than starting over.
  TrainingRun again(tuned, {}, regression_data(/*seed=*/99));
  ASSERT_TRUE(again.resumed_from().has_value());
  EXPECT_EQ(again.steps_done(), 2);
  EXPECT_NE(again.resumed_from()->path.find("/tuned/"), std::string::npos);
  EXPECT_FALSE(again.initialized_from().has_value());

  // A model of another shape: one sentence naming the parameter and both shapes.
  RunConfig wider = tuned;
  wider.checkpoint.dir = dir + "/wider/checkpoints";
  wider.checkpoint.init_from = source_file;
  wider.model.sizes = {kFeatures, 32, kTargets};
  std::string message = testing::expect_agreed_error(
      [&] { TrainingRun run(wider, {}, regression_data()); }, ErrorKind::bad_input);
  EXPECT_NE(message.find("checkpoint.init_from"), std::string::npos) << message;
  EXPECT_NE(message.find("layers/0/weight"), std::string::npos) << message;
  EXPECT_NE(message.find("[8, 16]"), std::string::npos) << message;
  EXPECT_NE(message.find("[8, 32]"), std::string::npos) << message;
  // Statistics the config does not ask for: the key that fixes it.
  RunConfig raw = tuned;
  raw.checkpoint.dir = dir + "/raw/checkpoints";
  raw.checkpoint.init_from = source_file;
  raw.data.normalize_inputs = Normalize::none;
  message = testing::expect_agreed_error([&] { TrainingRun run(raw, {}, regression_data()); },
                                         ErrorKind::bad_input);
  EXPECT_NE(message.find("data.normalize_inputs"), std::string::npos) << message;
}

// Raw inputs with max |x| from about 4e-3 (feature 2) to 1e4 (feature 1) are warned about on
// rank 0, naming both features and the key; normalized inputs and evenly scaled raw ones
// are not.
TEST(Normalization, InputsOfVeryDifferentScalesAreWarnedAbout) {
  const int n = world_size();
  RunConfig config = regression_config({{"dp", n}}, "dp");
  config.data.normalize_inputs = config.data.normalize_targets = Normalize::none;
  const std::string key = "data.normalize_inputs = \"standard\"";
  {
    TrainingRun raw(config, {}, regression_data());
    if (world_rank() == 0) {
      EXPECT_TRUE(has_warning(raw, key));
      EXPECT_TRUE(has_warning(raw, "feature 1 reaches"));
      EXPECT_TRUE(has_warning(raw, "feature 2 only"));
    } else {
      EXPECT_TRUE(raw.warnings().empty());
    }
  }
  {
    TrainingRun even(config, {}, regression_data(11, /*even=*/true));
    EXPECT_FALSE(has_warning(even, key));
  }
  config.data.normalize_inputs = Normalize::standard;
  TrainingRun normalized(config, {}, regression_data());
  EXPECT_FALSE(has_warning(normalized, key));
}

// normalize_targets = "standard" needs regression targets: refused with cross_entropy,
// naming the key, in a TOML file (at its line) and in a run made in code.
TEST(Normalization, StandardizedTargetsNeedRegression) {
  testing::expect_bad_input(
      [] {
        parse_config(
            "[model]\nsizes = [8, 4]\nloss = \"cross_entropy\"\n[data]\nsource = "
            "\"fashion_mnist\"\nnormalize_targets = \"standard\"\n[partition]\npreset = \"dp\"\n",
            "targets.toml");
      },
      {"targets.toml:6", "normalize_targets", "cross_entropy"});
  testing::expect_bad_input(
      [] { parse_config("[model]\nsizes = [8, 4]\n[data]\nnormalize_inputs = \"z\"\n", "x.toml"); },
      {"x.toml:4", "normalize_inputs", "none | standard"});
  // The key round-trips through the writer.
  RunConfig config = regression_config({{"dp", world_size()}}, "dp");
  config.checkpoint.init_from = "runs/a/checkpoints";
  check_config(config);  // the defaults of a config made in code (run.output_dir)
  const RunConfig read = parse_config(config_to_toml(config), "written");
  EXPECT_EQ(read.data.normalize_inputs, Normalize::standard);
  EXPECT_EQ(read.data.normalize_targets, Normalize::standard);
  EXPECT_EQ(read.checkpoint.init_from, "runs/a/checkpoints");

  Dataset labels;
  labels.description = "labelled rows";
  labels.num_samples = 64;
  labels.features = kFeatures;
  labels.num_classes = kTargets;
  labels.inputs.assign(64 * kFeatures, 1.0f);
  labels.labels.assign(64, 1);
  config.model.loss = std::nullopt;  // resolved from the data: cross_entropy
  const std::string message = testing::expect_agreed_error(
      [&] {
        TrainingRun run(config, {}, RunData{labels, Dataset{}});
      },
      ErrorKind::bad_input);
  EXPECT_NE(message.find("data.normalize_targets"), std::string::npos) << message;
}

}  // namespace
}  // namespace meshtrain
