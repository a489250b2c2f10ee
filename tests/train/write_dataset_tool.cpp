// Writes a small classification dataset for `meshtrain train` with data.source = "hdf5":
// /x float [N, FEATURES] (values in [0, 1)) and /y int32 [N] (labels i % CLASSES), with
// optionally one label replaced (to test the trainer's label check).
//
//   train_write_dataset OUT.h5 N FEATURES CLASSES [BAD_INDEX BAD_LABEL]
//
// Exit status 0, or 1 with one line on stderr when an argument or an HDF5 call fails.

#include <hdf5.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

[[noreturn]] void fail(const std::string& message) {
  std::fprintf(stderr, "train_write_dataset: %s\n", message.c_str());
  std::exit(1);
}

long long parse(const char* text, const char* what, long long min) {
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  if (*text == '\0' || *end != '\0' || value < min) {
    fail(std::string(what) + " '" + text + "' is not an integer >= " + std::to_string(min));
  }
  return value;
}

template <class T>
T check(T status, const std::string& what) {
  if (status < 0) {
    H5Eprint2(H5E_DEFAULT, stderr);
    fail(what + " failed");
  }
  return status;
}

void write(hid_t file, const char* name, hid_t type, const std::vector<hsize_t>& dims,
           const void* data) {
  const hid_t space = check(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr),
                            std::string("creating the dataspace of ") + name);
  const hid_t dataset =
      check(H5Dcreate2(file, name, type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
            std::string("creating ") + name);
  check(H5Dwrite(dataset, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data),
        std::string("writing ") + name);
  check(H5Dclose(dataset), std::string("closing ") + name);
  check(H5Sclose(space), std::string("closing the dataspace of ") + name);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5 && argc != 7) {
    fail("usage: train_write_dataset OUT.h5 N FEATURES CLASSES [BAD_INDEX BAD_LABEL]");
  }
  const std::string path = argv[1];
  const long long n = parse(argv[2], "N", 1);
  const long long features = parse(argv[3], "FEATURES", 1);
  const long long classes = parse(argv[4], "CLASSES", 1);
  if (n > (1 << 20) || features > (1 << 16)) fail("N or FEATURES is too large for a test file");

  std::vector<float> x(static_cast<size_t>(n * features));
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 2654435761u) % 1000) / 1000;
  std::vector<int32_t> y(static_cast<size_t>(n));
  for (long long i = 0; i < n; ++i) y[static_cast<size_t>(i)] = static_cast<int32_t>(i % classes);
  if (argc == 7) {
    const long long index = parse(argv[5], "BAD_INDEX", 0);
    if (index >= n) fail("BAD_INDEX " + std::to_string(index) + " is not below N");
    y[static_cast<size_t>(index)] = static_cast<int32_t>(parse(argv[6], "BAD_LABEL", INT32_MIN));
  }

  const hid_t file =
      check(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), "creating " + path);
  write(file, "/x", H5T_NATIVE_FLOAT, {static_cast<hsize_t>(n), static_cast<hsize_t>(features)},
        x.data());
  write(file, "/y", H5T_NATIVE_INT32, {static_cast<hsize_t>(n)}, y.data());
  check(H5Fclose(file), "closing " + path);
  return 0;
}
