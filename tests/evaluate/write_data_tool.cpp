// Writes a small learnable data file for the `meshtrain evaluate` tests: /x float32 [N,
// FEATURES] in [-1, 1), and /y from a fixed teacher W [FEATURES, WIDTH] (the same for every
// file, so a model trained on one file does well on another):
//   --classes C   /y int32 [N]: argmax of x W (C columns)
//   --targets T   /y float32 [N, T] (or [N] when T is 1): 100 + 40 tanh(x W) per column,
//                 targets far from 0 and of another scale than the inputs
// SEED picks the rows (different files, same teacher).
//
//   evaluate_write_data OUT.h5 N FEATURES SEED (--classes C | --targets T)
//
// Exit status 0, or 1 with one line on stderr when an argument or an HDF5 call fails.

#include <hdf5.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

namespace {

[[noreturn]] void fail(const std::string& message) {
  std::fprintf(stderr, "evaluate_write_data: %s\n", message.c_str());
  std::exit(1);
}

long long parse(const char* text, const char* what) {
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  if (*text == '\0' || *end != '\0' || value < 1 || value > (1 << 20)) {
    fail(std::string(what) + " '" + text + "' is not an integer in [1, 2^20]");
  }
  return value;
}

void check(long long status, const std::string& what) {
  if (status < 0) {
    H5Eprint2(H5E_DEFAULT, stderr);
    fail(what + " failed");
  }
}

void write(hid_t file, const char* name, hid_t type, const std::vector<hsize_t>& dims,
           const void* data) {
  const hid_t space = H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr);
  check(space, std::string("creating the dataspace of ") + name);
  const hid_t dataset = H5Dcreate2(file, name, type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  check(dataset, std::string("creating ") + name);
  check(H5Dwrite(dataset, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data),
        std::string("writing ") + name);
  check(H5Dclose(dataset), std::string("closing ") + name);
  check(H5Sclose(space), std::string("closing the dataspace of ") + name);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 7) {
    fail("usage: evaluate_write_data OUT.h5 N FEATURES SEED (--classes C | --targets T)");
  }
  const std::string path = argv[1];
  const long long n = parse(argv[2], "N"), features = parse(argv[3], "FEATURES");
  const long long seed = parse(argv[4], "SEED");
  const std::string kind = argv[5];
  const long long width = parse(argv[6], kind == "--classes" ? "C" : "T");
  if (kind != "--classes" && kind != "--targets") fail("unknown option '" + kind + "'");

  std::mt19937_64 teacher_rng(12345);  // the same teacher in every file
  std::normal_distribution<double> normal(0.0, 1.0 / std::sqrt(static_cast<double>(features)));
  std::vector<double> w(static_cast<size_t>(features * width));
  for (double& v : w) v = normal(teacher_rng);
  std::mt19937_64 rng(static_cast<uint64_t>(seed));
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n * features));
  for (float& v : x) v = uniform(rng);

  std::vector<int32_t> labels;
  std::vector<float> targets;
  for (long long i = 0; i < n; ++i) {
    int32_t best = 0;
    double best_value = -1e300;
    for (long long j = 0; j < width; ++j) {
      double z = 0.0;
      for (long long k = 0; k < features; ++k) z += x[i * features + k] * w[k * width + j];
      if (z > best_value) best_value = z, best = static_cast<int32_t>(j);
      targets.push_back(static_cast<float>(100.0 + 40.0 * std::tanh(2.0 * z)));
    }
    labels.push_back(best);
  }
  const hid_t file = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  check(file, "creating " + path);
  const hsize_t rows = static_cast<hsize_t>(n);
  write(file, "/x", H5T_NATIVE_FLOAT, {rows, static_cast<hsize_t>(features)}, x.data());
  if (kind == "--classes") {
    write(file, "/y", H5T_NATIVE_INT32, {rows}, labels.data());
  } else if (width == 1) {
    write(file, "/y", H5T_NATIVE_FLOAT, {rows}, targets.data());
  } else {
    write(file, "/y", H5T_NATIVE_FLOAT, {rows, static_cast<hsize_t>(width)}, targets.data());
  }
  check(H5Fclose(file), "closing " + path);
  return 0;
}
