// The safetensors writer (framework/export/safetensors.hpp) byte for byte on small files, its
// refusals, and the PyTorch export's tensors (framework/export/pytorch_export.hpp) of a model
// made in code: every checkpoint parameter under its PyTorch name, Linear weights transposed,
// also across the pieces a transposition streams in (a weight of more than 2^14 elements).
// tests/export/pytorch_export_test.py reads whole exported files with Python.

#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "base/error.hpp"
#include "framework/export/pytorch_export.hpp"
#include "framework/export/safetensors.hpp"
#include "framework/train/config.hpp"

namespace meshtrain {
namespace {

using safetensors::ElementType;
using safetensors::Tensor;

template <class T>
std::string bytes_of(const std::vector<T>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

Tensor held(const std::string& name, ElementType type, std::vector<int64_t> shape,
            const std::string& bytes) {
  Tensor t{name, type, std::move(shape), {}};
  t.write = [bytes](const ExportByteSink& sink) {
    // In two pieces, as a streamed tensor may hand them over.
    sink(bytes.data(), bytes.size() / 2);
    sink(bytes.data() + bytes.size() / 2, bytes.size() - bytes.size() / 2);
  };
  return t;
}

std::string write_all(const std::vector<Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  std::string file;
  const size_t n = safetensors::write(
      tensors, metadata, [&](const char* data, size_t size) { file.append(data, size); });
  EXPECT_EQ(n, file.size());
  return file;
}

TEST(Safetensors, FileIsLengthPaddedJsonHeaderThenDataLargestElementsFirst) {
  const std::vector<float> b = {1.5f, -2.0f};
  const std::vector<double> a = {0.25};
  const std::vector<Tensor> tensors = {
      held("b", ElementType::float32, {2}, bytes_of(b)),
      held("a", ElementType::float64, {1, 1}, bytes_of(a)),
  };
  const std::string file = write_all(tensors, {{"format", "pt"}});
  // The F64 tensor comes first in the data although given second: it starts at 0 (aligned).
  const std::string json =
      R"({"__metadata__":{"format":"pt"},"a":{"data_offsets":[0,8],"dtype":"F64","shape":[1,1]},)"
      R"("b":{"data_offsets":[8,16],"dtype":"F32","shape":[2]}})";
  std::string padded = json + std::string((8 - json.size() % 8) % 8, ' ');
  ASSERT_EQ(padded.size() % 8, 0u);
  std::string length(8, '\0');
  for (int i = 0; i < 8; ++i) length[i] = static_cast<char>((padded.size() >> (8 * i)) & 0xff);
  EXPECT_EQ(file, length + padded + bytes_of(a) + bytes_of(b));
  EXPECT_EQ(safetensors::encode_header(tensors, {{"format", "pt"}}), length + padded);
}

TEST(Safetensors, EmptyFileAndScalarsAndEmptyTensors) {
  EXPECT_EQ(write_all({}, {}), std::string("\x08\0\0\0\0\0\0\0{}      ", 16));
  const std::vector<float> one = {3.0f};
  const std::string file = write_all({held("scalar", ElementType::float32, {}, bytes_of(one)),
                                      held("empty", ElementType::float32, {0, 4}, "")},
                                     {});
  EXPECT_NE(file.find(R"("empty":{"data_offsets":[4,4],"dtype":"F32","shape":[0,4]})"),
            std::string::npos)
      << file;
  EXPECT_NE(file.find(R"("scalar":{"data_offsets":[0,4],"dtype":"F32","shape":[]})"),
            std::string::npos)
      << file;
  EXPECT_EQ(file.substr(file.size() - 4), bytes_of(one));  // the empty one adds no bytes
}

TEST(Safetensors, MetadataIsEscapedJson) {
  const std::string header = safetensors::encode_header({}, {{"config", "a = \"b\"\n\\"}});
  EXPECT_NE(header.find(R"("config":"a = \"b\"\n\\")"), std::string::npos) << header;
}

TEST(Safetensors, RefusesNamesTwiceReservedOrEmpty) {
  const std::string four(4, '\0');
  EXPECT_THROW(safetensors::encode_header({held("w", ElementType::float32, {1}, four),
                                           held("w", ElementType::float32, {1}, four)},
                                          {}),
               Error);
  EXPECT_THROW(
      safetensors::encode_header({held("__metadata__", ElementType::float32, {1}, four)}, {}),
      Error);
  EXPECT_THROW(safetensors::encode_header({held("", ElementType::float32, {1}, four)}, {}), Error);
  EXPECT_THROW(safetensors::encode_header({held("w", ElementType::float32, {-1}, four)}, {}),
               Error);
}

TEST(Safetensors, RefusesATensorWritingOtherThanItsBytes) {
  const auto sink = [](const char*, size_t) {};
  EXPECT_THROW(safetensors::write({held("short", ElementType::float32, {2}, std::string(4, '\0'))},
                                  {}, sink),
               Error);
  EXPECT_THROW(
      safetensors::write({held("long", ElementType::float32, {1}, std::string(8, '\0'))}, {}, sink),
      Error);
}

// --- the PyTorch export's tensors -----------------------------------------------------------

CheckpointArray array(const std::string& name, std::vector<int64_t> shape, float seed) {
  CheckpointArray a{name, std::move(shape), {}};
  size_t n = 1;
  for (int64_t d : a.shape) n *= static_cast<size_t>(d);
  for (size_t i = 0; i < n; ++i) a.values.push_back(seed + 0.001f * static_cast<float>(i));
  return a;
}

// [300, 60, 40, 3] with layer 1 an MoE layer of 3 experts (top 2), input and target statistics.
ExportSource mlp_source() {
  ExportSource s;
  s.path = "made in code";
  s.config.model.sizes = {300, 60, 40, 3};
  s.config.model.moe_layers = {1};
  s.config.model.experts = 3;
  s.config.model.top_k = 2;
  s.config.model.loss = LossKind::mse;
  for (CheckpointArray a : {array("layers/0/weight", {300, 60}, 1), array("layers/0/bias", {60}, 2),
                            array("layers/1/router/weight", {60, 3}, 3),
                            array("layers/1/experts/weight", {3, 60, 40}, 4),
                            array("layers/1/experts/bias", {3, 40}, 5),
                            array("layers/2/weight", {40, 3}, 6), array("layers/2/bias", {3}, 7)}) {
    std::string name = a.name;
    s.params.emplace(std::move(name), std::move(a));
  }
  s.normalization.input_mean.assign(300, 1.25);
  s.normalization.input_std.assign(300, 3.5);
  s.normalization.target_mean = {1, 2, 3};
  s.normalization.target_std = {4, 5, 6};
  return s;
}

std::map<std::string, std::pair<std::vector<int64_t>, std::string>> streamed(
    const std::vector<Tensor>& tensors) {
  std::map<std::string, std::pair<std::vector<int64_t>, std::string>> out;
  for (const Tensor& t : tensors) {
    std::string bytes;
    t.write([&](const char* data, size_t size) { bytes.append(data, size); });
    EXPECT_EQ(bytes.size(), t.bytes()) << t.name;
    out[t.name] = {t.shape, bytes};
  }
  return out;
}

// The [rows, cols] block at values[offset] transposed.
std::vector<float> transpose(const std::vector<float>& values, size_t offset, int64_t rows,
                             int64_t cols) {
  std::vector<float> t;
  for (int64_t c = 0; c < cols; ++c) {
    for (int64_t r = 0; r < rows; ++r)
      t.push_back(values[offset + static_cast<size_t>(r * cols + c)]);
  }
  return t;
}

TEST(PytorchExport, MlpTensorsArePytorchsNamesAndLayouts) {
  const ExportSource s = mlp_source();
  const auto got = streamed(pytorch_tensors(s));
  const auto& p = s.params;
  std::map<std::string, std::pair<std::vector<int64_t>, std::string>> want = {
      {"input_mean", {{300}, bytes_of(s.normalization.input_mean)}},
      {"input_std", {{300}, bytes_of(s.normalization.input_std)}},
      {"target_mean", {{3}, bytes_of(s.normalization.target_mean)}},
      {"target_std", {{3}, bytes_of(s.normalization.target_std)}},
      // 18000 elements: more than one piece of 2^14.
      {"network.layers.0.weight",
       {{60, 300}, bytes_of(transpose(p.at("layers/0/weight").values, 0, 300, 60))}},
      {"network.layers.0.bias", {{60}, bytes_of(p.at("layers/0/bias").values)}},
      {"network.layers.1.router.weight",
       {{3, 60}, bytes_of(transpose(p.at("layers/1/router/weight").values, 0, 60, 3))}},
      {"network.layers.2.weight",
       {{3, 40}, bytes_of(transpose(p.at("layers/2/weight").values, 0, 40, 3))}},
      {"network.layers.2.bias", {{3}, bytes_of(p.at("layers/2/bias").values)}},
  };
  const std::vector<float>& experts = p.at("layers/1/experts/weight").values;
  const std::vector<float>& biases = p.at("layers/1/experts/bias").values;
  for (int e = 0; e < 3; ++e) {
    const std::string name = "network.layers.1.experts." + std::to_string(e);
    want[name + ".weight"] = {{40, 60}, bytes_of(transpose(experts, e * 60 * 40, 60, 40))};
    want[name + ".bias"] = {
        {40}, bytes_of(std::vector<float>(biases.begin() + e * 40, biases.begin() + (e + 1) * 40))};
  }
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, expected] : want) {
    ASSERT_TRUE(got.count(name)) << name;
    EXPECT_EQ(got.at(name).first, expected.first) << name;
    EXPECT_TRUE(got.at(name).second == expected.second) << name << ": other bytes";
  }
}

TEST(PytorchExport, ModelCodeHasTheConfigFilledIn) {
  const std::string code = pytorch_model_code(mlp_source());
  for (const char* marker : {"@SUMMARY@", "@CONFIG@", "@SOURCE@"}) {
    EXPECT_EQ(code.find(marker), std::string::npos) << marker << " is left unfilled";
  }
  EXPECT_NE(
      code.find("The model: mlp 300-60-40-3 relu, MoE layers 1 (3 experts, top 2), loss mse."),
      std::string::npos);
  EXPECT_NE(code.find("    \"sizes\": [300, 60, 40, 3],\n"), std::string::npos) << code;
  EXPECT_NE(code.find("    \"moe_layers\": [1],\n    \"experts\": 3,\n    \"top_k\": 2,\n"),
            std::string::npos);
  EXPECT_NE(code.find("    \"normalize_inputs\": True,\n"), std::string::npos);
  EXPECT_NE(code.find("    \"checkpoint\": \"made in code\",\n"), std::string::npos);
}

}  // namespace
}  // namespace meshtrain
