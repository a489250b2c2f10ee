// The safetensors format, written as its bytes come (framework/export/safetensors.hpp).

#include "framework/export/safetensors.hpp"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>

#include "base/error.hpp"

namespace meshtrain::safetensors {

namespace {

// The data's order: larger elements first, then as given (a stable sort).
std::vector<const Tensor*> data_order(const std::vector<Tensor>& tensors) {
  std::vector<const Tensor*> order;
  for (const Tensor& t : tensors) order.push_back(&t);
  std::stable_sort(order.begin(), order.end(), [](const Tensor* a, const Tensor* b) {
    return element_size(a->type) > element_size(b->type);
  });
  return order;
}

}  // namespace

const char* to_string(ElementType type) {
  switch (type) {
    case ElementType::float64:
      return "F64";
    case ElementType::float32:
      return "F32";
  }
  return "?";
}

size_t element_size(ElementType type) {
  return type == ElementType::float64 ? 8 : 4;
}

size_t Tensor::elements() const {
  size_t n = 1;
  for (int64_t d : shape) {
    MESHTRAIN_REQUIRE(d >= 0, "safetensors: tensor '", name, "' has a negative dimension ", d);
    n *= static_cast<size_t>(d);
  }
  return n;
}

std::string encode_header(const std::vector<Tensor>& tensors,
                          const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string> names;
  for (const Tensor& t : tensors) {
    MESHTRAIN_REQUIRE(!t.name.empty() && t.name != "__metadata__", "safetensors: tensor name '",
                      t.name, "' is not allowed");
    MESHTRAIN_REQUIRE(names.insert(t.name).second, "safetensors: tensor '", t.name,
                      "' given twice");
  }
  size_t offset = 0;
  for (const Tensor* t : data_order(tensors)) {
    const size_t end = offset + t->bytes();
    header[t->name] = {{"dtype", to_string(t->type)},
                       {"shape", t->shape},
                       {"data_offsets", nlohmann::json::array({offset, end})}};
    offset = end;
  }
  // Invalid UTF-8 (in metadata taken from a file) is replaced rather than refused.
  std::string json = header.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string bytes(8, '\0');
  uint64_t length = json.size();
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  return bytes + json;
}

size_t write(const std::vector<Tensor>& tensors, const std::map<std::string, std::string>& metadata,
             const ExportByteSink& sink) {
  const std::string header = encode_header(tensors, metadata);
  sink(header.data(), header.size());
  size_t written = header.size();
  for (const Tensor* t : data_order(tensors)) {
    size_t bytes = 0;
    t->write([&](const char* data, size_t size) {
      bytes += size;
      MESHTRAIN_REQUIRE(bytes <= t->bytes(), "safetensors: tensor '", t->name, "' wrote more than ",
                        t->bytes(), " bytes");
      sink(data, size);
    });
    MESHTRAIN_REQUIRE(bytes == t->bytes(), "safetensors: tensor '", t->name, "' wrote ", bytes,
                      " bytes of ", t->bytes());
    written += bytes;
  }
  return written;
}

}  // namespace meshtrain::safetensors
