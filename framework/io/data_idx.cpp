// Fashion-MNIST from its IDX files (gzip), read with zlib.
//
// IDX: a big-endian header, magic 0x00000803 (uint8, 3 dims: count, rows, cols) for
// images and 0x00000801 (uint8, 1 dim: count) for labels, then the bytes.

#include <zlib.h>

#include <sys/stat.h>
#include <algorithm>
#include <array>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>

#include "base/error.hpp"
#include "framework/io/data.hpp"

namespace meshtrain {

namespace {

constexpr uint32_t kImagesMagic = 0x00000803;
constexpr uint32_t kLabelsMagic = 0x00000801;
constexpr int64_t kFashionClasses = 10;

// Owns a gzFile; reads exactly the bytes asked for or throws bad_input naming the path.
class GzReader {
 public:
  explicit GzReader(const std::string& path) : path_(path) {
    struct stat info {};
    if (::stat(path.c_str(), &info) != 0) {
      MESHTRAIN_BAD_INPUT("cannot read the data file '", path, "': ", std::strerror(errno));
    }
    file_ = gzopen(path.c_str(), "rb");
    if (file_ == nullptr) {
      MESHTRAIN_BAD_INPUT("cannot open the data file '", path,
                          "' with zlib: ", errno != 0 ? std::strerror(errno) : "out of memory");
    }
  }
  ~GzReader() {
    if (file_ != nullptr) gzclose(file_);
  }
  GzReader(const GzReader&) = delete;
  GzReader& operator=(const GzReader&) = delete;

  // Reads `bytes` bytes into `out`; `what` names the part for messages ("the header").
  void read(void* out, int64_t bytes, const char* what) {
    auto* dst = static_cast<unsigned char*>(out);
    int64_t done = 0;
    while (done < bytes) {
      const int64_t chunk = std::min<int64_t>(bytes - done, 1 << 30);  // gzread takes an int
      const int got = gzread(file_, dst + done, static_cast<unsigned>(chunk));
      if (got < 0) {
        int code = 0;
        const char* message = gzerror(file_, &code);
        MESHTRAIN_BAD_INPUT("the data file '", path_, "' is not a readable gzip file (reading ",
                            what, "): ", message);
      }
      if (got == 0) {
        int code = 0;
        const char* message = gzerror(file_, &code);
        MESHTRAIN_BAD_INPUT("the data file '", path_, "' is truncated: ", what, " needs ", bytes,
                            " bytes but only ", done, " could be read",
                            code != Z_OK ? std::string(" (zlib: ") + message + ")" : "");
      }
      done += got;
    }
  }

  uint32_t read_be32(const char* what) {
    std::array<unsigned char, 4> b{};
    read(b.data(), 4, what);
    return (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | uint32_t{b[3]};
  }

  const std::string& path() const { return path_; }

 private:
  std::string path_;
  gzFile file_ = nullptr;
};

std::string hex(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

void check_magic(const GzReader& in, uint32_t magic, uint32_t expected, const char* kind) {
  if (magic != expected) {
    MESHTRAIN_BAD_INPUT("the data file '", in.path(), "' is not an IDX ", kind,
                        " file: magic number ", hex(magic), ", expected ", hex(expected));
  }
}

// The IDX files of a split, their headers read and checked: `images` and `labels` are left
// at their first pixel and label.
struct IdxSplit {
  std::string images_path, labels_path;
  GzReader images, labels;
  DataShape shape;

  IdxSplit(const std::string& dir, Split split)
      : images_path(dir + "/" + (split == Split::train ? "train" : "t10k") +
                    "-images-idx3-ubyte.gz"),
        labels_path(dir + "/" + (split == Split::train ? "train" : "t10k") +
                    "-labels-idx1-ubyte.gz"),
        images(images_path),
        labels(labels_path) {
    check_magic(images, images.read_be32("the magic number"), kImagesMagic, "image (idx3, uint8)");
    const uint32_t n = images.read_be32("the image count");
    const uint32_t rows = images.read_be32("the image height");
    const uint32_t cols = images.read_be32("the image width");
    // Bounds keep the byte count far from overflow; Fashion-MNIST is 60000 x 28 x 28.
    if (n == 0 || n > (1u << 28) || rows == 0 || cols == 0 || rows > 4096 || cols > 4096) {
      MESHTRAIN_BAD_INPUT("the data file '", images_path, "' has an implausible header: ", n,
                          " images of ", rows, "x", cols, " pixels");
    }
    shape.description =
        std::string("Fashion-MNIST ") + split_name(split) + " set (" + images_path + ")";
    shape.num_classes = kFashionClasses;
    shape.num_samples = n;
    shape.features = int64_t{rows} * cols;
    check_magic(labels, labels.read_be32("the magic number"), kLabelsMagic, "label (idx1, uint8)");
    const uint32_t label_count = labels.read_be32("the label count");
    if (label_count != n) {
      MESHTRAIN_BAD_INPUT("the data file '", labels_path, "' has ", label_count, " labels but '",
                          images_path, "' has ", n, " images");
    }
  }
};

}  // namespace

DataShape fashion_mnist_shape(const std::string& dir, Split split) {
  return IdxSplit(dir, split).shape;
}

Dataset load_fashion_mnist(const std::string& dir, Split split) {
  IdxSplit idx(dir, split);
  Dataset d;
  static_cast<DataShape&>(d) = idx.shape;
  d.pixels.resize(static_cast<size_t>(d.num_samples * d.features));
  idx.images.read(d.pixels.data(), d.num_samples * d.features, "the pixels");
  std::vector<uint8_t> raw(static_cast<size_t>(d.num_samples));
  idx.labels.read(raw.data(), d.num_samples, "the labels");
  d.labels.resize(raw.size());
  for (size_t i = 0; i < raw.size(); ++i) {
    if (raw[i] >= kFashionClasses) {
      MESHTRAIN_BAD_INPUT("the data file '", idx.labels_path, "' has label ", int{raw[i]},
                          " at index ", i, ", outside [0, ", kFashionClasses, ")");
    }
    d.labels[i] = raw[i];
  }
  return d;
}

}  // namespace meshtrain
