#pragma once
// Small Fashion-MNIST-like IDX files (gzip) for the data and plan tests.

#include <gtest/gtest.h>
#include <zlib.h>

#include <cstdint>
#include <string>
#include <vector>

namespace meshtrain::testing {

// Writes `bytes` gzip-compressed to `path`.
inline void write_gz(const std::string& path, const std::vector<unsigned char>& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  if (!bytes.empty()) {
    ASSERT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())),
              static_cast<int>(bytes.size()));
  }
  ASSERT_EQ(gzclose(f), Z_OK);
}

inline void put_be32(std::vector<unsigned char>& out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8)
    out.push_back(static_cast<unsigned char>(v >> shift));
}

// dir/<prefix>-images-idx3-ubyte.gz and dir/<prefix>-labels-idx1-ubyte.gz: n_images images
// of side x side pixels (pixel_bytes of them written), labels as given.
inline void write_idx_pair(const std::string& dir, const std::string& prefix, uint32_t side,
                           uint32_t images_magic, uint32_t n_images, size_t pixel_bytes,
                           uint32_t labels_magic, const std::vector<unsigned char>& labels) {
  std::vector<unsigned char> images;
  put_be32(images, images_magic);
  put_be32(images, n_images);
  put_be32(images, side);
  put_be32(images, side);
  for (size_t i = 0; i < pixel_bytes; ++i) images.push_back(static_cast<unsigned char>(i * 7));
  write_gz(dir + "/" + prefix + "-images-idx3-ubyte.gz", images);
  std::vector<unsigned char> label_bytes;
  put_be32(label_bytes, labels_magic);
  put_be32(label_bytes, static_cast<uint32_t>(labels.size()));
  label_bytes.insert(label_bytes.end(), labels.begin(), labels.end());
  write_gz(dir + "/" + prefix + "-labels-idx1-ubyte.gz", label_bytes);
}

}  // namespace meshtrain::testing
