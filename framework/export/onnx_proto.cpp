// Encoding the ONNX messages (framework/export/onnx_proto.hpp).

#include "framework/export/onnx_proto.hpp"

#include "base/error.hpp"
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

// A TensorProto's fields before raw_data (9), then raw_data's key and length: its bytes
// follow (held or streamed).
Message encode_header(const Tensor& t) {
  Message m;
  for (int64_t d : t.dims) m.add_int64(1, d);
  m.add_int64(2, static_cast<int64_t>(t.type));
  m.add_string(8, t.name);
  m.add_length_prefix(9, t.raw_bytes());
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

// A GraphProto as consecutive pieces: each piece's bytes, then (when it has one) the raw
// data of an initializer. The weights are written from where they are (raw_data, or the
// caller's memory through write_raw), never copied into the encoding.
struct Piece {
  std::string bytes;
  const Tensor* raw = nullptr;
};

std::vector<Piece> encode_pieces(const Graph& g) {
  std::vector<Piece> pieces;
  Message m;  // the fields since the last piece
  for (const auto& n : g.nodes) m.add_message(1, encode(n));
  m.add_string(2, g.name);
  for (const auto& t : g.initializers) {
    const Message header = encode_header(t);
    m.add_length_prefix(5, header.size() + t.raw_bytes());
    pieces.push_back({m.bytes() + header.bytes(), &t});
    m = Message();
  }
  if (!g.doc_string.empty()) m.add_string(10, g.doc_string);
  for (const auto& v : g.inputs) m.add_message(11, encode(v));
  for (const auto& v : g.outputs) m.add_message(12, encode(v));
  pieces.push_back({m.bytes(), nullptr});
  return pieces;
}

size_t size_of(const std::vector<Piece>& pieces) {
  size_t size = 0;
  for (const Piece& p : pieces) size += p.bytes.size() + (p.raw ? p.raw->raw_bytes() : 0);
  return size;
}

void write_pieces(const std::vector<Piece>& pieces, const ByteSink& sink) {
  for (const Piece& p : pieces) {
    sink(p.bytes.data(), p.bytes.size());
    if (!p.raw) continue;
    if (!p.raw->streamed()) {
      sink(p.raw->raw_data.data(), p.raw->raw_data.size());
      continue;
    }
    size_t written = 0;
    p.raw->write_raw([&](const char* data, size_t size) {
      written += size;
      sink(data, size);
    });
    MESHTRAIN_REQUIRE(written == p.raw->raw_size, "ONNX initializer '", p.raw->name, "' wrote ",
                      written, " bytes, but its length says ", p.raw->raw_size);
  }
}

// The ModelProto's fields before the graph, with the graph's key and length; and after it.
std::string encode_head(const Model& model, size_t graph_size) {
  Message head;
  head.add_int64(1, model.ir_version);
  head.add_string(2, model.producer_name);
  head.add_string(3, model.producer_version);
  if (!model.doc_string.empty()) head.add_string(6, model.doc_string);
  head.add_length_prefix(7, graph_size);
  return head.bytes();
}

std::string encode_tail(const Model& model) {
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
  return tail.bytes();
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

size_t write(const Model& model, const ByteSink& sink) {
  const std::vector<Piece> pieces = encode_pieces(model.graph);
  const size_t graph_size = size_of(pieces);
  const std::string head = encode_head(model, graph_size);
  const std::string tail = encode_tail(model);
  sink(head.data(), head.size());
  write_pieces(pieces, sink);
  sink(tail.data(), tail.size());
  return head.size() + graph_size + tail.size();
}

size_t serialized_size(const Model& model) {
  const size_t graph_size = size_of(encode_pieces(model.graph));
  return encode_head(model, graph_size).size() + graph_size + encode_tail(model).size();
}

std::string serialize(const Graph& graph) {
  const std::vector<Piece> pieces = encode_pieces(graph);
  std::string bytes;
  bytes.reserve(size_of(pieces));
  write_pieces(pieces, [&](const char* data, size_t size) { bytes.append(data, size); });
  return bytes;
}

SerializedModel serialize(const Model& model) {
  SerializedModel out;
  out.graph = serialize(model.graph);
  out.head = encode_head(model, out.graph.size());
  out.tail = encode_tail(model);
  return out;
}

}  // namespace meshtrain::onnx
