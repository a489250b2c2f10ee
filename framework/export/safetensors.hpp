#pragma once
// The safetensors format (Hugging Face; what PyTorch models are shared in), written as its
// bytes come: no copy of the tensors is encoded in memory first.
//
//   8 bytes    N, the header's length, a little-endian uint64
//   N bytes    the header: a UTF-8 JSON object, {"NAME": {"dtype": "F32", "shape": [2, 3],
//              "data_offsets": [BEGIN, END]}, ...} and "__metadata__": {"KEY": "VALUE", ...}
//              (strings only), padded with spaces so that the data starts at a multiple of 8
//   the data   every tensor's little-endian, row-major bytes, BEGIN and END counted from the
//              data's start; consecutive, no gaps, no overlap, nothing after the last
//
// Tensors are laid out by descending element size, then in the order given, so each starts
// at a multiple of its element size (what zero-copy readers want).

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "framework/export/output_writer.hpp"

namespace meshtrain::safetensors {

enum class ElementType { float64, float32 };
const char* to_string(ElementType type);  // "F64", "F32": the header's dtype
size_t element_size(ElementType type);

struct Tensor {
  std::string name;
  ElementType type = ElementType::float32;
  std::vector<int64_t> shape;
  // Hands the tensor's bytes to the sink, in order and in any pieces: exactly bytes() of them.
  // Called once, when the file is written (the values it reads must live until then).
  std::function<void(const ExportByteSink&)> write;
  size_t elements() const;
  size_t bytes() const { return elements() * element_size(type); }
};

// The 8-byte length and the padded header of a file of `tensors`. Throws (a library error)
// for a name used twice, an empty name or "__metadata__", a negative dimension.
std::string encode_header(const std::vector<Tensor>& tensors,
                          const std::map<std::string, std::string>& metadata);

// The whole file: encode_header, then each tensor's bytes. Returns the bytes written; throws
// when a tensor's `write` hands over a number of bytes other than bytes().
size_t write(const std::vector<Tensor>& tensors, const std::map<std::string, std::string>& metadata,
             const ExportByteSink& sink);

}  // namespace meshtrain::safetensors
