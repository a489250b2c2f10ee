// Encoding the ONNX messages (framework/export/onnx_proto.hpp).

#include "framework/export/onnx_proto.hpp"

#include "framework/export/protobuf.hpp"

namespace meshtrain::onnx {
namespace {

using protobuf::Message;

// AttributeProto.AttributeType values.
constexpr int64_t kAttributeFloat = 1;
constexpr int64_t kAttributeInt = 2;
constexpr int64_t kAttributeInts = 7;

Message encode(const Attribute& a) {
  Message m;
  m.add_string(1, a.name);
  switch (a.kind) {
    case Attribute::Kind::float_value:
      m.add_float(2, a.f);
      m.add_int64(20, kAttributeFloat);
      break;
    case Attribute::Kind::int_value:
      m.add_int64(3, a.i);
      m.add_int64(20, kAttributeInt);
      break;
    case Attribute::Kind::ints:
      for (int64_t v : a.ints) m.add_int64(8, v);
      m.add_int64(20, kAttributeInts);
      break;
  }
  return m;
}

Message encode(const Node& n) {
  Message m;
  for (const auto& input : n.inputs) m.add_string(1, input);
  for (const auto& output : n.outputs) m.add_string(2, output);
  m.add_string(3, n.name);
  m.add_string(4, n.op_type);
  for (const auto& a : n.attributes) m.add_message(5, encode(a));
  return m;
}

Message encode(const Tensor& t) {
  Message m;
  for (int64_t d : t.dims) m.add_int64(1, d);
  m.add_int64(2, static_cast<int64_t>(t.type));
  m.add_string(8, t.name);
  m.add_string(9, t.raw_data);
  return m;
}

Message encode(const ValueInfo& v) {
  Message shape;
  for (const auto& d : v.shape) {
    Message dim;
    if (d.symbol.empty()) {
      dim.add_int64(1, d.value);
    } else {
      dim.add_string(2, d.symbol);
    }
    shape.add_message(1, dim);
  }
  Message tensor_type;
  tensor_type.add_int64(1, static_cast<int64_t>(v.type));
  tensor_type.add_message(2, shape);
  Message type;
  type.add_message(1, tensor_type);
  Message m;
  m.add_string(1, v.name);
  m.add_message(2, type);
  return m;
}

Message encode(const Graph& g) {
  Message m;
  for (const auto& n : g.nodes) m.add_message(1, encode(n));
  m.add_string(2, g.name);
  for (const auto& t : g.initializers) m.add_message(5, encode(t));
  if (!g.doc_string.empty()) m.add_string(10, g.doc_string);
  for (const auto& v : g.inputs) m.add_message(11, encode(v));
  for (const auto& v : g.outputs) m.add_message(12, encode(v));
  return m;
}

}  // namespace

const char* to_string(ElementType type) {
  switch (type) {
    case ElementType::float32:
      return "float32";
    case ElementType::int64:
      return "int64";
    case ElementType::float16:
      return "float16";
    case ElementType::bfloat16:
      return "bfloat16";
  }
  return "unknown";
}

Attribute Attribute::integer(std::string name, int64_t value) {
  Attribute a;
  a.name = std::move(name);
  a.kind = Kind::int_value;
  a.i = value;
  return a;
}

Attribute Attribute::integers(std::string name, std::vector<int64_t> values) {
  Attribute a;
  a.name = std::move(name);
  a.kind = Kind::ints;
  a.ints = std::move(values);
  return a;
}

Attribute Attribute::real(std::string name, float value) {
  Attribute a;
  a.name = std::move(name);
  a.kind = Kind::float_value;
  a.f = value;
  return a;
}

std::string serialize(const Graph& graph) {
  return encode(graph).bytes();
}

SerializedModel serialize(const Model& model) {
  SerializedModel out;
  out.graph = serialize(model.graph);
  Message head;
  head.add_int64(1, model.ir_version);
  head.add_string(2, model.producer_name);
  head.add_string(3, model.producer_version);
  if (!model.doc_string.empty()) head.add_string(6, model.doc_string);
  head.add_length_prefix(7, out.graph.size());
  out.head = head.bytes();
  Message tail;
  Message opset;
  opset.add_string(1, "");
  opset.add_int64(2, model.opset_version);
  tail.add_message(8, opset);
  for (const auto& [key, value] : model.metadata) {
    Message entry;
    entry.add_string(1, key);
    entry.add_string(2, value);
    tail.add_message(14, entry);
  }
  out.tail = tail.bytes();
  return out;
}

}  // namespace meshtrain::onnx
