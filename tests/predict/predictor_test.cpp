// Predictor and `meshtrain predict` against a float64 forward pass written here from the
// checkpoint's datasets (read with serial HDF5), on every mesh the world allows: dp, fsdp,
// tp, fsdp x tp (and 2x4 at np 8), and an MoE model on ep. A tiny model is trained for two
// steps on a dp mesh and saved; the predictions are made on the other meshes (resharded).
//
// Tolerances: fp32 against float64, |got - ref| <= 1e-5 x the largest |ref| of the batch's
// outputs (an MLP's outputs are sums of products: their rounding scales with the largest
// term, not with each output); the same between meshes. Probabilities to 1e-5 absolute.
// Row order: 37 rows (not a multiple of the batch of 16) in 3 shards, one gzip-chunked.
// Allocations: operator new is counted (and Kokkos allocations through the tools callback)
// over three predict() calls after construction: none (those made inside oneDNN's matmul
// counted apart, tests/support/onednn_allocations.hpp).

#include <gtest/gtest.h>
#include <hdf5.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include "apps/predict.hpp"
#include "framework/io/hdf5_util.hpp"
#include "run/predictor.hpp"
#include "run/training_run.hpp"
#include "tests/support/counting_allocator.hpp"
#include "tests/support/datasets.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/support/hdf5_files.hpp"
#include "tests/support/reference_activations.hpp"
#include "tests/support/temp_dir.hpp"
#include "tests/support/world.hpp"

namespace {
// A batch stream that cannot be made on one rank: the Kokkos allocation of its staging
// buffer ("meshtrain::staged_x") fails there (a rank short of memory), as if Kokkos threw.
std::atomic<int> g_fail_staging_on_rank{-1};
void fail_staging(Kokkos::Profiling::SpaceHandle, const char* label, const void*, uint64_t) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == g_fail_staging_on_rank.load() && std::string(label) == "meshtrain::staged_x") {
    throw std::runtime_error("no memory for the batch stream on rank " + std::to_string(rank) +
                             " (the test's)");
  }
}
}  // namespace

namespace meshtrain {
namespace {

using testing::TempDir;

constexpr int64_t kRows = 37;   // inputs predicted (not a multiple of kBatch)
constexpr int64_t kBatch = 16;  // global rows per call (every world size divides it)

enum class ModelKind { classifier, regressor, moe };

struct ModelCase {
  ModelKind kind;
  std::vector<int64_t> sizes;
  const char* name;
};

ModelCase model_case(ModelKind kind) {
  switch (kind) {
    case ModelKind::classifier:
      return {kind, {8, 16, 16, 8}, "classifier"};
    case ModelKind::regressor:
      return {kind, {8, 16, 8}, "regressor"};
    case ModelKind::moe:
      return {kind, {8, 16, 16, 8}, "moe"};
  }
  return {};
}

// x[s, c] = 2 sin(0.37 s + 1.3 c): varied, exact in float32 as written.
std::vector<float> inputs(int64_t rows, int64_t features) {
  std::vector<float> x(static_cast<size_t>(rows * features));
  for (int64_t s = 0; s < rows; ++s) {
    for (int64_t c = 0; c < features; ++c) {
      x[s * features + c] = static_cast<float>(2.0 * std::sin(0.37 * s + 1.3 * c));
    }
  }
  return x;
}

// Trains the model two steps on dp = world and saves it; returns the checkpoint directory.
std::string train_checkpoint(const std::string& dir, const ModelCase& m) {
  RunConfig config;
  config.run.seed = 11;
  config.run.output_dir = dir + "/" + m.name;
  config.checkpoint.dir = config.run.output_dir + "/checkpoints";
  config.checkpoint.async = false;
  config.mesh.axes = {{"dp", -1}};
  if (m.kind == ModelKind::moe) config.mesh.axes.push_back({"ep", 1});  // the experts' axis
  config.partition.preset = "dp";
  config.partition.min_sharding_size = 0;
  config.model.sizes = m.sizes;
  config.model.activation = Activation::gelu;
  config.model.loss = m.kind == ModelKind::regressor ? LossKind::mse : LossKind::cross_entropy;
  if (m.kind == ModelKind::moe) {
    config.model.moe_layers = {1};
    config.model.experts = 8;
    config.model.top_k = 2;
  }
  config.data.batch_size = 8;
  config.train.steps = 2;
  config.train.log_every = 100;
  config.optimizer.lr = 0.05;  // the parameters move from their initial values
  Dataset train = m.kind == ModelKind::regressor
                      ? testing::numbered_targets(32, m.sizes.front(), m.sizes.back())
                      : testing::numbered_classes(32, m.sizes.front(), m.sizes.back());
  TrainingRun run(config, {}, RunData{std::move(train), Dataset{}});
  run.train();
  return config.checkpoint.dir;
}

// --- the float64 reference ---------------------------------------------------------------

std::vector<double> read_dataset(const std::string& file, const std::string& name) {
  std::lock_guard<std::mutex> lock(hdf5::global_mutex());
  const hid_t f = H5Fopen(file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  EXPECT_GE(f, 0) << file;
  const hid_t d = H5Dopen2(f, name.c_str(), H5P_DEFAULT);
  EXPECT_GE(d, 0) << name << " in " << file;
  const hid_t space = H5Dget_space(d);
  const auto n = static_cast<size_t>(H5Sget_simple_extent_npoints(space));
  std::vector<double> values(n);
  EXPECT_GE(H5Dread(d, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()), 0);
  H5Sclose(space);
  H5Dclose(d);
  H5Fclose(f);
  return values;
}

// The model of `file` on rows x [rows, sizes[0]] in float64: y = x W + b per layer ([in, out]
// weights), tanh-GELU between layers, none after the last; an MoE layer routes each row to
// its top-2 experts of softmax(x Wr) (ties: the lower index) with renormalized gates.
// Normalization (when the file has it): x' = (x - mean) / std before, y = y' std + mean after.
std::vector<double> reference(const std::string& file, const ModelCase& m,
                              const std::vector<float>& x, int64_t rows) {
  const bool normalized = [&] {
    std::lock_guard<std::mutex> lock(hdf5::global_mutex());
    const hid_t f = H5Fopen(file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    const bool has = H5Lexists(f, "/normalization", H5P_DEFAULT) > 0;
    H5Fclose(f);
    return has;
  }();
  std::vector<double> h(x.begin(), x.end());
  int64_t width = m.sizes.front();
  if (normalized) {
    const auto mean = read_dataset(file, "/normalization/input_mean");
    const auto sd = read_dataset(file, "/normalization/input_std");
    for (int64_t s = 0; s < rows; ++s) {
      for (int64_t c = 0; c < width; ++c) h[s * width + c] = (h[s * width + c] - mean[c]) / sd[c];
    }
  }
  const size_t layers = m.sizes.size() - 1;
  for (size_t i = 0; i < layers; ++i) {
    const int64_t in = m.sizes[i], out = m.sizes[i + 1];
    const std::string prefix = "/params/layers/" + std::to_string(i);
    std::vector<double> y(static_cast<size_t>(rows * out), 0.0);
    if (m.kind == ModelKind::moe && i == 1) {
      const int64_t experts = 8;
      const auto router = read_dataset(file, prefix + "/router/weight");
      const auto w = read_dataset(file, prefix + "/experts/weight");
      const auto b = read_dataset(file, prefix + "/experts/bias");
      for (int64_t s = 0; s < rows; ++s) {
        std::vector<double> p(experts, 0.0);
        for (int64_t e = 0; e < experts; ++e) {
          for (int64_t k = 0; k < in; ++k) p[e] += h[s * in + k] * router[k * experts + e];
        }
        const double top = *std::max_element(p.begin(), p.end());
        for (double& v : p) v = std::exp(v - top);
        int64_t first = 0, second = -1;
        for (int64_t e = 1; e < experts; ++e)
          if (p[e] > p[first]) first = e;
        for (int64_t e = 0; e < experts; ++e) {
          if (e != first && (second < 0 || p[e] > p[second])) second = e;
        }
        const double norm = p[first] + p[second];
        for (int64_t e : {first, second}) {
          const double gate = p[e] / norm;
          for (int64_t o = 0; o < out; ++o) {
            double z = b[e * out + o];
            for (int64_t k = 0; k < in; ++k) z += h[s * in + k] * w[(e * in + k) * out + o];
            y[s * out + o] += gate * z;
          }
        }
      }
    } else {
      const auto w = read_dataset(file, prefix + "/weight");
      const auto b = read_dataset(file, prefix + "/bias");
      for (int64_t s = 0; s < rows; ++s) {
        for (int64_t o = 0; o < out; ++o) {
          double z = b[o];
          for (int64_t k = 0; k < in; ++k) z += h[s * in + k] * w[k * out + o];
          y[s * out + o] = z;
        }
      }
    }
    if (i + 1 < layers) {
      for (double& v : y) v = testing::gelu_tanh(v);
    }
    h = std::move(y);
    width = out;
  }
  if (normalized && m.kind == ModelKind::regressor) {
    const auto mean = read_dataset(file, "/normalization/target_mean");
    const auto sd = read_dataset(file, "/normalization/target_std");
    for (int64_t s = 0; s < rows; ++s) {
      for (int64_t c = 0; c < width; ++c) h[s * width + c] = h[s * width + c] * sd[c] + mean[c];
    }
  }
  return h;
}

// Softmax per row of [rows, width] values.
std::vector<double> softmax(const std::vector<double>& logits, int64_t rows, int64_t width) {
  std::vector<double> p(logits.size());
  for (int64_t s = 0; s < rows; ++s) {
    const double top =
        *std::max_element(logits.begin() + s * width, logits.begin() + (s + 1) * width);
    double sum = 0.0;
    for (int64_t c = 0; c < width; ++c) sum += std::exp(logits[s * width + c] - top);
    for (int64_t c = 0; c < width; ++c)
      p[s * width + c] = std::exp(logits[s * width + c] - top) / sum;
  }
  return p;
}

// |got - want| <= 1e-5 x the largest |want|, for each value.
void expect_close(const std::vector<double>& got, const std::vector<double>& want,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 0.0;
  for (double v : want) scale = std::max(scale, std::abs(v));
  int reported = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::abs(got[i] - want[i]) > 1e-5 * scale && reported++ < 5) {
      ADD_FAILURE() << what << ": value " << i << " is " << got[i] << ", expected " << want[i]
                    << " (tolerance " << 1e-5 * scale << ")";
    }
  }
}

// The meshes of this world size, as overrides of the checkpoint's dp config.
struct MeshCase {
  std::string name;
  std::vector<std::string> overrides;
};

std::vector<MeshCase> mesh_cases(ModelKind kind) {
  const int n = world_size();
  if (kind == ModelKind::moe) {
    return {{"dp", {}}, {"ep", {"mesh.dp=1", "mesh.ep=-1", "partition.preset=dp"}}};
  }
  std::vector<MeshCase> cases = {
      {"dp", {}},
      {"fsdp", {"mesh.dp=1", "mesh.fsdp=-1", "partition.preset=fsdp"}},
      {"tp", {"mesh.dp=1", "mesh.tp=-1", "partition.preset=tp"}},
  };
  if (n % 2 == 0) {
    cases.push_back(
        {"fsdp_tp", {"mesh.dp=1", "mesh.fsdp=-1", "mesh.tp=2", "partition.preset=fsdp_tp"}});
  }
  if (n == 8) {
    cases.push_back(
        {"fsdp2_tp4", {"mesh.dp=1", "mesh.fsdp=2", "mesh.tp=4", "partition.preset=fsdp_tp"}});
  }
  return cases;
}

// Whether this rank is the first of those holding its slice (tp partners hold the same rows).
bool first_of_slice(const Predictor& p) {
  MPI_Comm slice_comm;
  MPI_Comm_split(MPI_COMM_WORLD, static_cast<int>(p.slice().index), world_rank(), &slice_comm);
  int rank = 0;
  MPI_Comm_rank(slice_comm, &rank);
  MPI_Comm_free(&slice_comm);
  return rank == 0;
}

// Every row's outputs (and probabilities, classes) through predict(), as every rank of the
// world sees them (summed from the first rank of each slice). Inputs are passed as float64
// host views in LayoutLeft (a Fortran simulation's arrays): the predictor converts them.
struct AllRows {
  std::vector<double> outputs, probabilities, classes;
};

AllRows predict_all(Predictor& p, const std::vector<float>& x) {
  const int64_t in = p.inputs(), out = p.outputs();
  AllRows all;
  all.outputs.assign(static_cast<size_t>(kRows * out), 0.0);
  all.probabilities.assign(all.outputs.size(), 0.0);
  all.classes.assign(static_cast<size_t>(kRows), 0.0);
  const bool contributes = first_of_slice(p);
  for (int64_t b = 0; b * p.batch_size() < kRows; ++b) {
    const int64_t first = b * p.batch_size() + p.slice().begin();
    const int64_t rows = std::clamp<int64_t>(kRows - first, 0, p.local_rows());
    Kokkos::View<double**, Kokkos::LayoutLeft, Kokkos::HostSpace> xs("x", rows, in);
    for (int64_t s = 0; s < rows; ++s) {
      for (int64_t c = 0; c < in; ++c) xs(s, c) = x[(first + s) * in + c];
    }
    Kokkos::View<float**, Kokkos::HostSpace> ys("y", rows, out);
    EXPECT_EQ(p.predict(xs, ys), rows);
    // The classifier's extras from the device views of the same call.
    const Prediction pr = p.predict(xs);
    Kokkos::View<float**, Kokkos::LayoutRight, Kokkos::HostSpace> probs("probs", rows, out);
    Kokkos::View<int64_t*, Kokkos::LayoutRight, Kokkos::HostSpace> classes("classes", rows);
    if (p.classification()) {
      Kokkos::deep_copy(probs, pr.probabilities);
      Kokkos::deep_copy(classes, pr.classes);
    }
    if (!contributes) continue;
    for (int64_t s = 0; s < rows; ++s) {
      for (int64_t c = 0; c < out; ++c) {
        all.outputs[(first + s) * out + c] = ys(s, c);
        all.probabilities[(first + s) * out + c] = probs(s, c);
      }
      all.classes[first + s] = static_cast<double>(classes(s));
    }
  }
  for (std::vector<double>* v : {&all.outputs, &all.probabilities, &all.classes}) {
    MPI_Allreduce(MPI_IN_PLACE, v->data(), static_cast<int>(v->size()), MPI_DOUBLE, MPI_SUM,
                  MPI_COMM_WORLD);
  }
  return all;
}

void check_classes(const std::vector<double>& classes, const std::vector<double>& logits,
                   int64_t width, const std::string& what) {
  for (int64_t s = 0; s < kRows; ++s) {
    const auto row = logits.begin() + s * width;
    const auto best = std::max_element(row, row + width) - row;
    EXPECT_EQ(static_cast<int64_t>(classes[s]), best) << what << ", row " << s;
  }
}

class PredictorTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir(/*shared=*/true);
    for (ModelKind kind : {ModelKind::classifier, ModelKind::regressor, ModelKind::moe}) {
      checkpoints_[static_cast<int>(kind)] = train_checkpoint(dir_->path(), model_case(kind));
    }
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  static std::string checkpoint_dir(ModelKind kind) { return checkpoints_[static_cast<int>(kind)]; }
  static std::string checkpoint_file(ModelKind kind) {
    return *find_latest_checkpoint(checkpoint_dir(kind));
  }
  static TempDir* dir_;
  static std::string checkpoints_[3];
};
TempDir* PredictorTest::dir_ = nullptr;
std::string PredictorTest::checkpoints_[3];

TEST_F(PredictorTest, EqualsTheFloat64ReferenceOnEveryMesh) {
  for (ModelKind kind : {ModelKind::classifier, ModelKind::regressor, ModelKind::moe}) {
    const ModelCase m = model_case(kind);
    const std::vector<float> x = inputs(kRows, m.sizes.front());
    const std::vector<double> want = reference(checkpoint_file(kind), m, x, kRows);
    std::vector<double> first_mesh;
    for (const MeshCase& mesh : mesh_cases(kind)) {
      const std::string what = std::string(m.name) + " on " + mesh.name;
      SCOPED_TRACE(what);
      Predictor p(checkpoint_dir(kind), kBatch, mesh.overrides);
      EXPECT_EQ(p.inputs(), m.sizes.front());
      EXPECT_EQ(p.outputs(), m.sizes.back());
      EXPECT_EQ(p.classification(), kind != ModelKind::regressor);
      EXPECT_EQ(p.step(), 2);
      EXPECT_EQ(p.mesh().world_size(), world_size());
      const AllRows got = predict_all(p, x);
      expect_close(got.outputs, want, what + ": outputs against float64");
      if (p.classification()) {
        expect_close(got.probabilities, softmax(want, kRows, m.sizes.back()),
                     what + ": probabilities");
        check_classes(got.classes, got.outputs, m.sizes.back(), what);
      }
      if (first_mesh.empty()) {
        first_mesh = got.outputs;
      } else {
        expect_close(got.outputs, first_mesh, what + ": against the dp mesh");
      }
    }
  }
}

// A checkpoint with normalization statistics (the documented /normalization datasets, added
// to a copy here): inputs standardized before the model, outputs returned to the targets'
// units after it.
TEST_F(PredictorTest, AppliesTheCheckpointsNormalization) {
  const ModelCase m = model_case(ModelKind::regressor);
  const std::string copy = dir_->file("normalized.h5");
  if (world_rank() == 0) {
    std::filesystem::copy_file(checkpoint_file(ModelKind::regressor), copy,
                               std::filesystem::copy_options::overwrite_existing);
    std::lock_guard<std::mutex> lock(hdf5::global_mutex());
    const hid_t f = H5Fopen(copy.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    ASSERT_GE(f, 0);
    const hid_t g = H5Gcreate2(f, "/normalization", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    const auto write = [&](const char* name, const std::vector<double>& v) {
      const hsize_t n = v.size();
      const hid_t space = H5Screate_simple(1, &n, nullptr);
      const hid_t d =
          H5Dcreate2(g, name, H5T_IEEE_F64LE, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
      EXPECT_GE(H5Dwrite(d, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data()), 0);
      H5Dclose(d);
      H5Sclose(space);
    };
    std::vector<double> in_mean, in_std, out_mean, out_std;
    for (int64_t c = 0; c < m.sizes.front(); ++c) {
      in_mean.push_back(0.5 - 0.25 * c);
      in_std.push_back(c % 2 ? 1000.0 : 0.01);  // scales far apart, as in the issue
    }
    for (int64_t c = 0; c < m.sizes.back(); ++c) {
      out_mean.push_back(100.0 * c - 50.0);
      out_std.push_back(0.5 + c);
    }
    write("input_mean", in_mean);
    write("input_std", in_std);
    write("target_mean", out_mean);
    write("target_std", out_std);
    H5Gclose(g);
    H5Fclose(f);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  std::vector<float> x = inputs(kRows, m.sizes.front());
  for (int64_t s = 0; s < kRows; ++s) {
    for (int64_t c = 0; c < m.sizes.front(); ++c) {
      float& v = x[s * m.sizes.front() + c];
      v = c % 2 ? v * 1000.0f : v * 0.01f;  // the user's units
    }
  }
  const std::vector<double> want = reference(copy, m, x, kRows);
  for (const MeshCase& mesh : mesh_cases(ModelKind::regressor)) {
    SCOPED_TRACE(mesh.name);
    Predictor p(copy, kBatch, mesh.overrides);
    ASSERT_TRUE(p.normalization().inputs());
    ASSERT_TRUE(p.normalization().targets());
    expect_close(predict_all(p, x).outputs, want, "normalized regressor on " + mesh.name);
  }
}

TEST_F(PredictorTest, AllocatesNothingPerCall) {
  for (ModelKind kind : {ModelKind::classifier, ModelKind::moe}) {
    for (const MeshCase& mesh : mesh_cases(kind)) {
      SCOPED_TRACE(std::string(model_case(kind).name) + " on " + mesh.name);
      Predictor p(checkpoint_dir(kind), kBatch, mesh.overrides);
      Kokkos::View<float**, Kokkos::HostSpace> host_x("x", p.local_rows(), p.inputs());
      Kokkos::View<double**, Kokkos::LayoutLeft, Kokkos::HostSpace> host_y("y", p.local_rows(),
                                                                           p.outputs());
      Matrix device_x("x", p.local_rows() - 1, p.inputs());  // a partial batch
      Kokkos::deep_copy(host_x, 0.5f);
      Kokkos::deep_copy(device_x, -0.25f);
      // oneDNN's matmul (the inference GEMMs where the build has it) allocates a few small
      // blocks inside each execution, which its API cannot avoid: counted apart, as in the
      // training step's test; everything of meshtrain's still counts.
      testing::AllocationWindow window(testing::AllocationWindow::Threads::all,
                                       testing::AllocationWindow::OneDnn::left_out);
      p.predict(host_x, host_y);
      p.predict(device_x);
      p.predict(host_x);
      EXPECT_EQ(window.close(), 0) << "heap allocations in three predict() calls";
      EXPECT_EQ(window.kokkos_allocations(), 0) << "Kokkos allocations in three predict() calls";
    }
  }
}

// The `meshtrain predict` path: 37 rows in 3 shards (the middle one gzip-chunked, the last
// without /y), the inputs at data.x_key = "features", batches of 16 (the last padded);
// /prediction, /class and /probability in input row order.
TEST_F(PredictorTest, CommandKeepsRowOrderAcrossShardsAndPadding) {
  const ModelCase m = model_case(ModelKind::classifier);
  const std::vector<float> x = inputs(kRows, m.sizes.front());
  const std::vector<double> want = reference(checkpoint_file(ModelKind::classifier), m, x, kRows);
  Dataset data = testing::numbered_classes(kRows, m.sizes.front(), m.sizes.back());
  data.inputs = x;
  std::vector<std::string> files;
  if (world_rank() == 0) {
    for (int i = 0; i < 3; ++i) {
      const int64_t first = i == 0 ? 0 : i == 1 ? 13 : 25;
      const int64_t count = i == 0 ? 13 : 12;
      testing::H5Layout layout;
      layout.chunked = i == 1;
      layout.x_name = "/features";  // read through data.x_key
      const std::string file = dir_->file("in-" + std::to_string(i) + ".h5");
      testing::write_h5(file, data, layout, first, count);
      if (i == 2) {  // inputs alone: predict needs no labels or targets
        std::lock_guard<std::mutex> lock(hdf5::global_mutex());
        const hid_t f = H5Fopen(file.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
        ASSERT_GE(f, 0);
        ASSERT_GE(H5Ldelete(f, "/y", H5P_DEFAULT), 0);
        H5Fclose(f);
      }
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
  for (const MeshCase& mesh : mesh_cases(ModelKind::classifier)) {
    SCOPED_TRACE(mesh.name);
    PredictOptions options;
    options.checkpoint = checkpoint_dir(ModelKind::classifier) + "/latest";
    options.inputs = {dir_->file("in-0.h5"), dir_->file("in-[12].h5")};  // a file and a glob
    options.output = dir_->file("out-" + mesh.name + ".h5");
    options.overrides = mesh.overrides;
    options.overrides.push_back("data.x_key=features");
    options.batch_size = kBatch;
    ASSERT_EQ(predict_command(options), 0);
    EXPECT_FALSE(std::filesystem::exists(options.output + ".tmp"));
    const std::vector<double> prediction = read_dataset(options.output, "/prediction");
    expect_close(prediction, want, "/prediction on " + mesh.name);
    expect_close(read_dataset(options.output, "/probability"), softmax(want, kRows, m.sizes.back()),
                 "/probability on " + mesh.name);
    check_classes(read_dataset(options.output, "/class"), prediction, m.sizes.back(), mesh.name);
    MPI_Barrier(MPI_COMM_WORLD);  // every rank has read the file before the next mesh's
  }
}

// One rank fails to make its batch stream (an allocation, after the model is built and the
// output file created): every rank ends `meshtrain predict` at once with that rank's error,
// exit status 1, and no output left, instead of the others waiting in the predictions'
// collectives for the collective timeout (60 s in the tests).
TEST_F(PredictorTest, CommandEndsEveryRankWhenOneCannotMakeItsBatchStream) {
  const ModelCase m = model_case(ModelKind::classifier);
  Dataset data = testing::numbered_classes(kRows, m.sizes.front(), m.sizes.back());
  data.inputs = inputs(kRows, m.sizes.front());
  const std::string input = dir_->file("stream-failure-in.h5");
  if (world_rank() == 0) testing::write_h5(input, data, testing::H5Layout(), 0, kRows);
  MPI_Barrier(MPI_COMM_WORLD);
  PredictOptions options;
  options.checkpoint = checkpoint_dir(ModelKind::classifier);
  options.inputs = {input};
  options.output = dir_->file("stream-failure-out.h5");
  options.batch_size = kBatch;
  const int failing = world_size() - 1;
  g_fail_staging_on_rank = failing;
  Kokkos::Tools::Experimental::set_allocate_data_callback(fail_staging);
  if (world_rank() == 0) ::testing::internal::CaptureStderr();
  const auto start = std::chrono::steady_clock::now();
  int status = -1;
  try {
    status = predict_command(options);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "rank " << world_rank() << ": predict threw instead of agreeing: " << e.what();
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  Kokkos::Tools::Experimental::set_allocate_data_callback(nullptr);
  g_fail_staging_on_rank = -1;
  const std::string printed = world_rank() == 0 ? ::testing::internal::GetCapturedStderr() : "";
  EXPECT_EQ(status, 1) << "rank " << world_rank();
  EXPECT_LT(seconds, 30.0) << "rank " << world_rank() << " waited for the failed rank";
  if (world_rank() == 0) {
    EXPECT_NE(printed.find("meshtrain: error: "), std::string::npos) << printed;
    EXPECT_NE(printed.find("no memory for the batch stream on rank " + std::to_string(failing)),
              std::string::npos)
        << printed;
  }
  MPI_Barrier(MPI_COMM_WORLD);
  EXPECT_FALSE(std::filesystem::exists(options.output));
  EXPECT_FALSE(std::filesystem::exists(options.output + ".tmp"));
}

// A Predictor on a communicator of its own (each half of the world, or the one rank): the
// same outputs as the float64 reference, each half predicting all the rows alone.
TEST_F(PredictorTest, RunsOnAGivenCommunicator) {
  const ModelCase m = model_case(ModelKind::classifier);
  const std::vector<float> x = inputs(kRows, m.sizes.front());
  const std::vector<double> want = reference(checkpoint_file(ModelKind::classifier), m, x, kRows);
  MPI_Comm half;
  MPI_Comm_split(MPI_COMM_WORLD, world_rank() % 2, world_rank(), &half);
  int half_size = 0, half_rank = 0;
  MPI_Comm_size(half, &half_size);
  MPI_Comm_rank(half, &half_rank);
  {
    Predictor p(checkpoint_dir(ModelKind::classifier), kBatch, {}, half);
    EXPECT_EQ(p.mesh().world_size(), half_size);
    std::vector<double> got(want.size(), 0.0);
    for (int64_t b = 0; b * kBatch < kRows; ++b) {
      const int64_t first = b * kBatch + p.slice().begin();
      const int64_t rows = std::clamp<int64_t>(kRows - first, 0, p.local_rows());
      Kokkos::View<float**, Kokkos::HostSpace> xs("x", rows, p.inputs());
      Kokkos::View<float**, Kokkos::HostSpace> ys("y", rows, p.outputs());
      for (int64_t s = 0; s < rows; ++s) {
        for (int64_t c = 0; c < p.inputs(); ++c) xs(s, c) = x[(first + s) * p.inputs() + c];
      }
      p.predict(xs, ys);
      for (int64_t s = 0; s < rows; ++s) {
        for (int64_t c = 0; c < p.outputs(); ++c) got[(first + s) * p.outputs() + c] = ys(s, c);
      }
    }
    // dp over the half: every rank's rows are its own; summed over the half they are all.
    MPI_Allreduce(MPI_IN_PLACE, got.data(), static_cast<int>(got.size()), MPI_DOUBLE, MPI_SUM,
                  half);
    expect_close(got, want, "on a communicator of " + std::to_string(half_size) + " ranks");
  }
  MPI_Comm_free(&half);
}

TEST_F(PredictorTest, RefusesModelChangingOverridesAndBadInputs) {
  testing::expect_bad_input(
      [&] { Predictor p(checkpoint_dir(ModelKind::classifier), kBatch, {"model.sizes=[8, 8]"}); },
      {"model.sizes", "cannot be changed"});
  testing::expect_bad_input(
      [&] { Predictor p(checkpoint_dir(ModelKind::classifier), kBatch, {"optimizer.lr=1"}); },
      {"optimizer.lr"});
  testing::expect_bad_input([&] { Predictor p(dir_->file("no-such-checkpoint"), kBatch); },
                            {"no-such-checkpoint", "does not exist"});
  Predictor p(checkpoint_dir(ModelKind::classifier), kBatch);
  Kokkos::View<float**, Kokkos::HostSpace> wide("x", 1, p.inputs() + 1);
  testing::expect_bad_input([&] { p.predict(wide); }, {"9 columns", "takes 8 inputs"});
  Kokkos::View<float**, Kokkos::HostSpace> tall("x", p.local_rows() + 1, p.inputs());
  testing::expect_bad_input([&] { p.predict(tall); }, {"at most"});
}

}  // namespace
}  // namespace meshtrain
