#pragma once
// The ONNX messages meshtrain writes, as plain structs, and their encoding with the
// protobuf encoder (framework/export/protobuf.hpp). Field numbers are those of onnx.proto
// (ONNX 1.12, IR version 8; Debian: libonnx-dev, /usr/include/onnx/onnx.proto):
//
//   ModelProto          ir_version 1, producer_name 2, producer_version 3, doc_string 6,
//                       graph 7, opset_import 8, metadata_props 14
//   OperatorSetIdProto  domain 1, version 2
//   StringStringEntryProto  key 1, value 2
//   GraphProto          node 1, name 2, initializer 5, doc_string 10, input 11, output 12
//   NodeProto           input 1, output 2, name 3, op_type 4, attribute 5
//   AttributeProto      name 1, f 2, i 3, ints 8, type 20 (FLOAT 1, INT 2, INTS 7)
//   TensorProto         dims 1, data_type 2, name 8, raw_data 9 (little-endian, row-major)
//   ValueInfoProto      name 1, type 2
//   TypeProto           tensor_type 1 -> TypeProto.Tensor: elem_type 1, shape 2
//   TensorShapeProto    dim 1 -> Dimension: dim_value 1 | dim_param 2

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace meshtrain::onnx {

// TensorProto.DataType values.
enum class ElementType : int32_t { float32 = 1, int64 = 7, float16 = 10, bfloat16 = 16 };
const char* to_string(ElementType type);

// A node attribute: one int, a list of ints, or one float.
struct Attribute {
  enum class Kind { int_value, ints, float_value };
  std::string name;
  Kind kind = Kind::int_value;
  int64_t i = 0;
  std::vector<int64_t> ints;
  float f = 0.0f;
  static Attribute integer(std::string name, int64_t value);
  static Attribute integers(std::string name, std::vector<int64_t> values);
  static Attribute real(std::string name, float value);
};

struct Node {
  std::string op_type;  // in the default domain ("ai.onnx")
  std::string name;
  std::vector<std::string> inputs;
  std::vector<std::string> outputs;
  std::vector<Attribute> attributes;
};

// Where a model's bytes go as they are written (a file): called with consecutive pieces.
using ByteSink = std::function<void(const char* data, size_t size)>;

// An initializer: its elements' little-endian bytes, row-major, either held in raw_data or,
// for a weight too large to copy, streamed: raw_size bytes that write_raw hands to the sink
// (in pieces, from memory the caller keeps alive) only when the model is written.
struct Tensor {
  std::string name;
  ElementType type = ElementType::float32;
  std::vector<int64_t> dims;  // empty: a scalar
  std::string raw_data;
  size_t raw_size = 0;                             // streamed: the bytes write_raw writes
  std::function<void(const ByteSink&)> write_raw;  // set: streamed (raw_data is unused)

  bool streamed() const { return static_cast<bool>(write_raw); }
  size_t raw_bytes() const { return streamed() ? raw_size : raw_data.size(); }
};

// A dimension of a graph input or output: a fixed size, or a named symbolic one ("batch").
struct Dimension {
  int64_t value = 0;
  std::string symbol;  // non-empty: symbolic
};

struct ValueInfo {
  std::string name;
  ElementType type = ElementType::float32;
  std::vector<Dimension> shape;
};

struct Graph {
  std::string name;
  std::string doc_string;
  std::vector<Node> nodes;  // in topological order
  std::vector<Tensor> initializers;
  std::vector<ValueInfo> inputs;
  std::vector<ValueInfo> outputs;
};

struct Model {
  int64_t ir_version = 0;
  int64_t opset_version = 0;  // of the default domain, the only one imported
  std::string producer_name;
  std::string producer_version;
  std::string doc_string;
  Graph graph;
  std::vector<std::pair<std::string, std::string>> metadata;  // metadata_props, in order
};

// Writes the ModelProto bytes of `model` (the content of a .onnx file) to `sink`, in order,
// and returns their count. Held initializers are written from raw_data; streamed ones by
// their write_raw, straight from the caller's memory: the weights are never copied into an
// encoded message (a length-delimited field's length is known before its bytes are, from
// raw_size). The bytes are the same whether an initializer is held or streamed.
size_t write(const Model& model, const ByteSink& sink);
// The byte count write() writes, without writing (nothing streamed is read).
size_t serialized_size(const Model& model);

// The same bytes in memory, in three pieces (tests): the fields before the graph and the
// graph's key and length, the GraphProto, then the fields after it.
struct SerializedModel {
  std::string head, graph, tail;
  size_t size() const { return head.size() + graph.size() + tail.size(); }
};
SerializedModel serialize(const Model& model);
// The GraphProto bytes of a graph alone.
std::string serialize(const Graph& graph);

}  // namespace meshtrain::onnx
