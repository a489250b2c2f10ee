// Unit tests of framework/data: Fashion-MNIST, synthetic and HDF5 loading (with every bad
// input naming what is wrong), the seeded schedule, slices and evaluation batches.

#include <gtest/gtest.h>
#include <hdf5.h>
#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <numeric>
#include <set>

#include "framework/io/batch_stream.hpp"
#include "framework/io/data.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/support/idx_files.hpp"
#include "tests/support/temp_dir.hpp"

namespace meshtrain {
namespace {

using testing::expect_bad_input;

using testing::TempDir;

// Reads this slice of the global batch of `step` into x and labels / targets (empty views
// for the one the data lacks) through a BatchStream without a reader thread.
void read_step(RowSource& source, const BatchSchedule& schedule, int64_t step,
               const BatchSlice& slice, const Matrix& x, const BatchLabels& labels,
               const Matrix& targets = {}) {
  BatchStream stream(
      source, slice.rows,
      [&](int64_t seq, int64_t* rows) {
        schedule.slice_samples(seq, slice, rows);
        return slice.rows;
      },
      /*depth=*/0);
  EXPECT_EQ(stream.take(step, x, labels, targets), slice.rows);
}

bool have_fashion_mnist() {
  return std::filesystem::exists(default_fashion_mnist_dir() + "/train-images-idx3-ubyte.gz");
}

// --- Fashion-MNIST ----------------------------------------------------------------------

TEST(FashionMnist, TrainAndTestSplitsLoad) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  DataSection section;  // source fashion_mnist, default path
  // The IDX bytes as they are kept in memory (load_dataset reads them out as floats).
  const Dataset train = load_fashion_mnist(default_fashion_mnist_dir(), Split::train);
  EXPECT_EQ(train.num_samples, 60000);
  EXPECT_EQ(train.features, 784);
  EXPECT_EQ(train.num_classes, 10);
  EXPECT_TRUE(train.classification());
  ASSERT_EQ(train.pixels.size(), size_t{60000} * 784);
  EXPECT_TRUE(train.inputs.empty());
  // Fashion-MNIST is balanced: 6000 training and 1000 test images per class.
  std::vector<int64_t> histogram(10, 0);
  for (int32_t label : train.labels) {
    ASSERT_GE(label, 0);
    ASSERT_LT(label, 10);
    ++histogram[label];
  }
  for (int c = 0; c < 10; ++c) EXPECT_EQ(histogram[c], 6000) << "class " << c;
  // Known first samples: both splits start with an ankle boot (class 9).
  EXPECT_EQ(train.labels[0], 9);

  // load_dataset reads every row out of the source: pixels / 255 as floats.
  const Dataset test = load_dataset(section, Split::test, 0, 784, 10);
  EXPECT_EQ(test.num_samples, 10000);
  EXPECT_EQ(test.features, 784);
  EXPECT_TRUE(test.pixels.empty());
  ASSERT_EQ(test.inputs.size(), size_t{10000} * 784);
  {
    const Dataset bytes = load_fashion_mnist(default_fashion_mnist_dir(), Split::test);
    EXPECT_EQ(bytes.labels, test.labels);
    for (size_t i = 0; i < test.inputs.size(); i += 97) {
      ASSERT_EQ(test.inputs[i], static_cast<float>(bytes.pixels[i]) * (1.0f / 255.0f)) << i;
    }
  }
  std::vector<int64_t> test_histogram(10, 0);
  for (int32_t label : test.labels) ++test_histogram[label];
  for (int c = 0; c < 10; ++c) EXPECT_EQ(test_histogram[c], 1000) << "class " << c;
  EXPECT_EQ(test.labels[0], 9);

  // A batch is scaled to [0, 1] and uses the full range.
  BatchSchedule schedule(train.num_samples, 500, ShuffleMode::rows, 1);
  const BatchSlice slice = make_batch_slice(Mesh::single(), 0, {"fsdp", "dp"}, 500);
  Matrix x_batch("x", 500, 784);
  BatchLabels labels_batch("labels", 500);
  auto source = open_data_source(section, Split::train, 0, 784, 10);
  read_step(*source, schedule, 0, slice, x_batch, labels_batch);
  const auto x = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), x_batch);
  const auto labels = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), labels_batch);
  float lo = 1e9f, hi = -1e9f;
  for (int r = 0; r < 500; ++r) {
    for (int c = 0; c < 784; ++c) {
      lo = std::min(lo, x(r, c));
      hi = std::max(hi, x(r, c));
    }
    const int64_t s = schedule.sample(0, r);
    EXPECT_EQ(labels(r), train.labels[s]);
    EXPECT_FLOAT_EQ(x(r, 400), train.pixels[s * 784 + 400] / 255.0f);
  }
  EXPECT_EQ(lo, 0.0f);
  EXPECT_EQ(hi, 1.0f);
}

TEST(FashionMnist, ModelSizesMustMatchTheData) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  DataSection section;
  expect_bad_input([&] { load_dataset(section, Split::test, 0, 785, 10); },
                   {"model.sizes[0] = 785", "784", "t10k-images-idx3-ubyte.gz"});
  expect_bad_input([&] { load_dataset(section, Split::test, 0, 784, 12); },
                   {"model.sizes[-1] = 12", "10 classes", "Fashion-MNIST"});
}

// A tiny IDX pair of the test split: n images of 2x2 pixels, labels as given.
void write_idx(const std::string& dir, uint32_t images_magic, uint32_t n_images, size_t pixel_bytes,
               uint32_t labels_magic, const std::vector<unsigned char>& labels) {
  testing::write_idx_pair(dir, "t10k", 2, images_magic, n_images, pixel_bytes, labels_magic,
                          labels);
}

TEST(FashionMnist, SmallIdxFilesRoundTrip) {
  TempDir dir;
  write_idx(dir.path(), 0x803, 3, 12, 0x801, {1, 0, 9});
  const Dataset d = load_fashion_mnist(dir.path(), Split::test);
  EXPECT_EQ(d.num_samples, 3);
  EXPECT_EQ(d.features, 4);
  EXPECT_EQ(d.labels, (std::vector<int32_t>{1, 0, 9}));
  ASSERT_EQ(d.pixels.size(), 12u);
  EXPECT_EQ(d.pixels[5], static_cast<unsigned char>(35));
}

TEST(FashionMnist, BadFilesNameThePathAndTheProblem) {
  expect_bad_input([] { load_fashion_mnist("/nonexistent/fmnist", Split::train); },
                   {"/nonexistent/fmnist/train-images-idx3-ubyte.gz", "No such file"});
  {
    TempDir dir;
    write_idx(dir.path(), 0x801, 3, 12, 0x801, {1, 0, 9});
    expect_bad_input([&] { load_fashion_mnist(dir.path(), Split::test); },
                     {"t10k-images-idx3-ubyte.gz", "magic number 0x00000801", "0x00000803"});
  }
  {
    TempDir dir;
    write_idx(dir.path(), 0x803, 3, 10, 0x801, {1, 0, 9});  // 2 pixel bytes missing
    expect_bad_input([&] { load_fashion_mnist(dir.path(), Split::test); },
                     {"t10k-images-idx3-ubyte.gz", "truncated", "12 bytes"});
  }
  {
    TempDir dir;
    write_idx(dir.path(), 0x803, 3, 12, 0x801, {1, 0});
    expect_bad_input([&] { load_fashion_mnist(dir.path(), Split::test); },
                     {"t10k-labels-idx1-ubyte.gz", "2 labels", "3 images"});
  }
  {
    TempDir dir;
    write_idx(dir.path(), 0x803, 3, 12, 0x801, {1, 10, 9});
    expect_bad_input([&] { load_fashion_mnist(dir.path(), Split::test); },
                     {"t10k-labels-idx1-ubyte.gz", "label 10", "index 1"});
  }
  {
    TempDir dir;
    write_idx(dir.path(), 0x803, 3, 12, 0x801, {1, 0, 9});
    testing::write_gz(dir.path() + "/t10k-images-idx3-ubyte.gz", {0, 0, 8});  // header cut short
    expect_bad_input([&] { load_fashion_mnist(dir.path(), Split::test); },
                     {"t10k-images-idx3-ubyte.gz", "truncated", "magic number"});
  }
}

// --- Synthetic --------------------------------------------------------------------------

TEST(Synthetic, DeterministicFromTheSeed) {
  const Dataset a = make_synthetic(256, 12, 3, 42, Split::train);
  const Dataset b = make_synthetic(256, 12, 3, 42, Split::train);
  const Dataset c = make_synthetic(256, 12, 3, 43, Split::train);
  const Dataset t = make_synthetic(256, 12, 3, 42, Split::test);
  EXPECT_EQ(a.num_samples, 256);
  EXPECT_EQ(t.num_samples, 64);
  EXPECT_EQ(a.features, 12);
  EXPECT_EQ(a.target_width, 3);
  EXPECT_FALSE(a.classification());
  EXPECT_EQ(a.output_width(), 3);
  ASSERT_EQ(a.inputs.size(), 256u * 12);
  ASSERT_EQ(a.targets.size(), 256u * 3);
  EXPECT_EQ(a.inputs, b.inputs);
  EXPECT_EQ(a.targets, b.targets);
  EXPECT_NE(a.inputs, c.inputs);
  EXPECT_NE(std::vector<float>(a.inputs.begin(), a.inputs.begin() + 64 * 12), t.inputs);
  // Inputs look like N(0, 1).
  const double mean = std::accumulate(a.inputs.begin(), a.inputs.end(), 0.0) / a.inputs.size();
  double var = 0;
  for (float v : a.inputs) var += (v - mean) * (v - mean);
  var /= a.inputs.size();
  EXPECT_NEAR(mean, 0.0, 0.1);
  EXPECT_NEAR(var, 1.0, 0.1);
  for (float v : a.targets) EXPECT_LT(std::abs(v), 1.4f);  // tanh + 0.05 noise

  DataSection section;
  section.source = DataSource::synthetic;
  section.synthetic_samples = 256;
  const Dataset via_config = load_dataset(section, Split::train, 42, 12, 3);
  EXPECT_EQ(via_config.inputs, a.inputs);
}

// Solves the normal equations (A^T A) w = A^T y by Gaussian elimination (small n).
std::vector<double> least_squares(const std::vector<double>& a, const std::vector<double>& y,
                                  int rows, int n) {
  std::vector<double> m(n * (n + 1), 0.0);
  for (int r = 0; r < rows; ++r) {
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j) m[i * (n + 1) + j] += a[r * n + i] * a[r * n + j];
      m[i * (n + 1) + n] += a[r * n + i] * y[r];
    }
  }
  for (int p = 0; p < n; ++p) {
    for (int i = p + 1; i < n; ++i) {
      const double f = m[i * (n + 1) + p] / m[p * (n + 1) + p];
      for (int j = p; j <= n; ++j) m[i * (n + 1) + j] -= f * m[p * (n + 1) + j];
    }
  }
  std::vector<double> w(n);
  for (int i = n - 1; i >= 0; --i) {
    double s = m[i * (n + 1) + n];
    for (int j = i + 1; j < n; ++j) s -= m[i * (n + 1) + j] * w[j];
    w[i] = s / m[i * (n + 1) + i];
  }
  return w;
}

TEST(Synthetic, TargetsAreLearnableFromInputs) {
  // Even a linear fit explains most of the variance of tanh(x W) + small noise, and the
  // fit from the train split carries over to the test split (same teacher).
  const int in = 8;
  const Dataset train = make_synthetic(2000, in, 2, 7, Split::train);
  const Dataset test = make_synthetic(2000, in, 2, 7, Split::test);
  for (int o = 0; o < 2; ++o) {
    std::vector<double> a(train.inputs.begin(), train.inputs.end()), y(train.num_samples);
    for (int64_t r = 0; r < train.num_samples; ++r) y[r] = train.targets[r * 2 + o];
    const auto w = least_squares(a, y, static_cast<int>(train.num_samples), in);
    double residual = 0, total = 0, mean = 0;
    for (int64_t r = 0; r < test.num_samples; ++r) mean += test.targets[r * 2 + o];
    mean /= test.num_samples;
    for (int64_t r = 0; r < test.num_samples; ++r) {
      double pred = 0;
      for (int f = 0; f < in; ++f) pred += test.inputs[r * in + f] * w[f];
      const double t = test.targets[r * 2 + o];
      residual += (t - pred) * (t - pred);
      total += (t - mean) * (t - mean);
    }
    EXPECT_GT(1.0 - residual / total, 0.7) << "output " << o;  // R^2 on the test split
  }
}

// --- HDF5 -------------------------------------------------------------------------------

// Writes /x float [n, f] (values i*f+c or the given ones) and /y of the given type/shape.
struct H5Writer {
  hid_t file;
  explicit H5Writer(const std::string& path) {
    file = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    EXPECT_GE(file, 0);
  }
  ~H5Writer() { H5Fclose(file); }
  void write(const char* name, hid_t mem_type, const std::vector<hsize_t>& dims, const void* data) {
    hid_t space = H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr);
    hid_t ds = H5Dcreate2(file, name, mem_type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    ASSERT_GE(ds, 0);
    ASSERT_GE(H5Dwrite(ds, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data), 0);
    H5Dclose(ds);
    H5Sclose(space);
  }
};

std::vector<float> ramp(size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = 0.25f * static_cast<float>(i);
  return v;
}

DataSection hdf5_section(const std::string& train, const std::string& test = "") {
  DataSection s;
  s.source = DataSource::hdf5;
  if (!train.empty()) s.path = {train};
  if (!test.empty()) s.test_path = {test};
  return s;
}

TEST(Hdf5Dataset, LabelsRoundTrip) {
  TempDir dir;
  const std::string path = dir.path() + "/train.h5";
  const auto x = ramp(10 * 3);
  const std::vector<int64_t> y = {0, 1, 2, 3, 0, 1, 2, 3, 3, 3};
  {
    H5Writer w(path);
    w.write("x", H5T_NATIVE_FLOAT, {10, 3}, x.data());
    w.write("y", H5T_NATIVE_INT64, {10}, y.data());
  }
  const Dataset d = load_dataset(hdf5_section(path), Split::train, 0, 3, 4);
  EXPECT_EQ(d.num_samples, 10);
  EXPECT_EQ(d.features, 3);
  EXPECT_EQ(d.num_classes, 4);
  EXPECT_EQ(d.inputs, x);
  EXPECT_EQ(d.labels, (std::vector<int32_t>(y.begin(), y.end())));
  // No test_path: an empty test split.
  const Dataset none = load_dataset(hdf5_section(path), Split::test, 0, 3, 4);
  EXPECT_EQ(none.num_samples, 0);
  EXPECT_EQ(EvalSchedule::create(0, 4).num_batches, 0);
  // Batches carry the file's rows.
  BatchSchedule schedule(d.num_samples, 5, ShuffleMode::none, 0);
  const BatchSlice slice = make_batch_slice(Mesh::single(), 0, {"fsdp", "dp"}, 5);
  Matrix bx_batch("x", 5, 3);
  BatchLabels bl_batch("y", 5);
  auto source = open_data_source(hdf5_section(path), Split::train, 0, 3, 4);
  read_step(*source, schedule, 1, slice, bx_batch, bl_batch);  // identity order: rows 5..9
  const auto bx = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), bx_batch);
  const auto bl = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), bl_batch);
  for (int r = 0; r < 5; ++r) {
    EXPECT_EQ(bl(r), y[5 + r]);
    for (int c = 0; c < 3; ++c) EXPECT_EQ(bx(r, c), x[(5 + r) * 3 + c]);
  }
}

TEST(Hdf5Dataset, RegressionTargetsRoundTrip) {
  TempDir dir;
  const std::string path = dir.path() + "/reg.h5";
  const auto x = ramp(6 * 2);
  const auto y = ramp(6 * 3);
  {
    H5Writer w(path);
    w.write("x", H5T_NATIVE_FLOAT, {6, 2}, x.data());
    w.write("y", H5T_NATIVE_FLOAT, {6, 3}, y.data());
  }
  const Dataset d = load_dataset(hdf5_section(path, path), Split::test, 0, 2, 3);
  EXPECT_FALSE(d.classification());
  EXPECT_EQ(d.target_width, 3);
  EXPECT_EQ(d.targets, y);
  expect_bad_input([&] { load_dataset(hdf5_section(path), Split::train, 0, 2, 4); },
                   {"model.sizes[-1] = 4", "target width 3", path});
}

TEST(Hdf5Dataset, BadInputsNameTheProblem) {
  TempDir dir;
  const auto x = ramp(4 * 3);
  const std::vector<int64_t> y = {0, 1, 2, 1};

  const std::string missing = dir.path() + "/missing.h5";
  expect_bad_input([&] { load_dataset(hdf5_section(missing), Split::train, 0, 3, 3); },
                   {missing, "No such file"});

  const std::string not_hdf5 = dir.path() + "/text.h5";
  testing::write_gz(not_hdf5, {1, 2, 3});
  expect_bad_input([&] { load_dataset(hdf5_section(not_hdf5), Split::train, 0, 3, 3); },
                   {not_hdf5, "cannot open it", "H5Fopen"});

  const std::string no_y = dir.path() + "/no_y.h5";
  { H5Writer(no_y).write("x", H5T_NATIVE_FLOAT, {4, 3}, x.data()); }
  expect_bad_input([&] { load_dataset(hdf5_section(no_y), Split::train, 0, 3, 3); },
                   {no_y, "no dataset /y"});

  const std::string no_x = dir.path() + "/no_x.h5";
  { H5Writer(no_x).write("y", H5T_NATIVE_INT64, {4}, y.data()); }
  expect_bad_input([&] { load_dataset(hdf5_section(no_x), Split::train, 0, 3, 3); },
                   {no_x, "no dataset /x"});

  const std::string good = dir.path() + "/good.h5";
  {
    H5Writer w(good);
    w.write("x", H5T_NATIVE_FLOAT, {4, 3}, x.data());
    w.write("y", H5T_NATIVE_INT64, {4}, y.data());
  }
  // Label 2 at index 2 is outside [0, 2) for a 2-class model: the rows are checked as
  // they are read (streaming), so it is a runtime error naming the file and the row.
  testing::expect_error([&] { load_dataset(hdf5_section(good), Split::train, 0, 3, 2); },
                        ErrorKind::runtime, {good, "/y[2] = 2", "[0, 2)"});
  expect_bad_input([&] { load_dataset(hdf5_section(good), Split::train, 0, 5, 3); },
                   {"model.sizes[0] = 5", "3 input features", good});

  const std::string wrong_rank = dir.path() + "/rank.h5";
  {
    H5Writer w(wrong_rank);
    w.write("x", H5T_NATIVE_FLOAT, {12}, x.data());
    w.write("y", H5T_NATIVE_INT64, {4}, y.data());
  }
  expect_bad_input([&] { load_dataset(hdf5_section(wrong_rank), Split::train, 0, 3, 3); },
                   {wrong_rank, "/x must be a float dataset [N, features]", "[12]"});

  const std::string mismatch = dir.path() + "/mismatch.h5";
  {
    H5Writer w(mismatch);
    w.write("x", H5T_NATIVE_FLOAT, {4, 3}, x.data());
    w.write("y", H5T_NATIVE_INT64, {3}, y.data());
  }
  expect_bad_input([&] { load_dataset(hdf5_section(mismatch), Split::train, 0, 3, 3); },
                   {mismatch, "/x has 4 samples", "/y has 3"});

  const std::string nan = dir.path() + "/nan.h5";
  {
    auto bad = x;
    bad[7] = std::numeric_limits<float>::quiet_NaN();
    H5Writer w(nan);
    w.write("x", H5T_NATIVE_FLOAT, {4, 3}, bad.data());
    w.write("y", H5T_NATIVE_INT64, {4}, y.data());
  }
  testing::expect_error([&] { load_dataset(hdf5_section(nan), Split::train, 0, 3, 3); },
                        ErrorKind::runtime, {nan, "/x[2, 1]", "finite"});
  // Opening it is fine: only the rows are wrong.
  EXPECT_EQ(open_data_source(hdf5_section(nan), Split::train, 0, 3, 3)->shape().num_samples, 4);

  expect_bad_input([&] { load_dataset(hdf5_section(""), Split::train, 0, 3, 3); }, {"data.path"});
}

// --- Schedule, slices, evaluation -------------------------------------------------------

TEST(BatchSchedule, ShuffleIsASeededPermutationPerEpoch) {
  BatchSchedule a(103, 10, ShuffleMode::rows, 5);
  BatchSchedule b(103, 10, ShuffleMode::rows, 5);
  BatchSchedule other_seed(103, 10, ShuffleMode::rows, 6);
  EXPECT_EQ(a.steps_per_epoch(), 10);  // 3 samples dropped per epoch
  const auto e0 = a.permutation(0);
  const auto e1 = a.permutation(1);
  auto sorted = e0;
  std::sort(sorted.begin(), sorted.end());
  std::vector<int64_t> identity(103);
  std::iota(identity.begin(), identity.end(), 0);
  EXPECT_EQ(sorted, identity);
  sorted = e1;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted, identity);
  EXPECT_NE(e0, e1);
  EXPECT_NE(e0, identity);
  EXPECT_EQ(e0, b.permutation(0));
  EXPECT_EQ(e1, b.permutation(1));
  EXPECT_NE(e0, other_seed.permutation(0));

  // Step s = rows [(s mod 10) * 10, +10) of epoch s / 10; the cache survives going back.
  for (int64_t step : {0, 3, 9, 10, 25, 4, 31}) {
    const auto perm = a.permutation(step / 10);
    const auto batch = b.global_batch_samples(step);
    for (int r = 0; r < 10; ++r) {
      EXPECT_EQ(batch[r], perm[(step % 10) * 10 + r]) << "step " << step << " row " << r;
      EXPECT_EQ(a.sample(step, r), batch[r]);
    }
  }
  // Within an epoch no sample repeats.
  std::set<int64_t> seen;
  for (int64_t step = 20; step < 30; ++step) {
    for (int64_t s : a.global_batch_samples(step)) EXPECT_TRUE(seen.insert(s).second);
  }
}

TEST(BatchSchedule, NoShuffleIsTheIdentity) {
  BatchSchedule s(20, 6, ShuffleMode::none, 5);
  EXPECT_EQ(s.steps_per_epoch(), 3);
  EXPECT_EQ(s.global_batch_samples(1), (std::vector<int64_t>{6, 7, 8, 9, 10, 11}));
  EXPECT_EQ(s.global_batch_samples(3), (std::vector<int64_t>{0, 1, 2, 3, 4, 5}));
  expect_bad_input([] { BatchSchedule(20, 21, ShuffleMode::rows, 0); },
                   {"data.batch_size = 21", "20"});
  expect_bad_input([] { BatchSchedule(20, 0, ShuffleMode::rows, 0); }, {"data.batch_size = 0"});
}

TEST(BatchSlice, IndivisibleBatchNamesTheKeyAndK) {
  const Mesh mesh = Mesh::create({{"dp", 2}, {"fsdp", 2}, {"tp", 2}}, 8);
  expect_bad_input(
      [&] {
        make_batch_slice(mesh, 0, {"fsdp", "dp"}, 6);
      },
      {"data.batch_size = 6", "k = 4", "fsdp, dp"});
  expect_bad_input(
      [&] {
        make_batch_slice(mesh, 0, {"fsdp", "dp"}, 10, "--batch");
      },
      {"--batch = 10", "k = 4"});
  // Axes the mesh lacks count as size 1.
  const Mesh dp_only = Mesh::create({{"dp", 2}}, 2);
  const BatchSlice s = make_batch_slice(dp_only, 1, {"fsdp", "dp"}, 6);
  EXPECT_EQ(s.count, 2);
  EXPECT_EQ(s.index, 1);
  EXPECT_EQ(s.rows, 3);
  EXPECT_EQ(s.begin(), 3);
}

TEST(EvalSchedule, LastBatchIsPaddedAndMasked) {
  Dataset d = make_synthetic(40, 3, 2, 1, Split::test);  // 10 samples
  ASSERT_EQ(d.num_samples, 10);
  const EvalSchedule eval = EvalSchedule::create(d.num_samples, 4);
  EXPECT_EQ(eval.num_batches, 3);
  const Mesh mesh = Mesh::create({{"dp", 2}}, 2);
  auto source = make_memory_source(d);
  int64_t total = 0;
  for (int64_t b = 0; b < eval.num_batches; ++b) {
    for (int rank = 0; rank < 2; ++rank) {
      const BatchSlice slice = make_batch_slice(mesh, rank, {"dp"}, 4);
      Matrix x_batch("x", 2, 3);
      Matrix t_batch("t", 2, 2);
      // Fill the views with garbage first: padding rows must come back as zeros.
      Kokkos::deep_copy(x_batch, 7.0f);
      Kokkos::deep_copy(t_batch, 7.0f);
      BatchStream stream(
          *source, slice.rows,
          [&](int64_t seq, int64_t* rows) { return eval_slice_samples(eval, seq, slice, rows); },
          /*depth=*/0);
      const int64_t valid = stream.take(b, x_batch, BatchLabels(), t_batch);
      const auto x = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), x_batch);
      const auto t = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), t_batch);
      // Batch 2 holds samples 8, 9: rank 0 gets both, rank 1 only padding.
      EXPECT_EQ(valid, b < 2 ? 2 : (rank == 0 ? 2 : 0)) << "batch " << b << " rank " << rank;
      for (int64_t r = 0; r < 2; ++r) {
        const int64_t sample = b * 4 + rank * 2 + r;
        for (int c = 0; c < 3; ++c) {
          EXPECT_EQ(x(r, c), r < valid ? d.inputs[sample * 3 + c] : 0.0f);
        }
        for (int c = 0; c < 2; ++c) {
          EXPECT_EQ(t(r, c), r < valid ? d.targets[sample * 2 + c] : 0.0f);
        }
      }
      total += valid;
    }
  }
  EXPECT_EQ(total, d.num_samples);
  // Evaluation batches have data.eval_batch_size rows (issue 12): the message names that
  // key by default, or the key the caller gives.
  expect_bad_input([] { EvalSchedule::create(10, 0); }, {"data.eval_batch_size = 0"});
  expect_bad_input([] { EvalSchedule::create(10, -1, "my.key"); }, {"my.key = -1"});
}

}  // namespace
}  // namespace meshtrain
