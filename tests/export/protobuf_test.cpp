// The protobuf encoder of the ONNX export (framework/export/protobuf.hpp) against the wire
// format's own examples (https://protobuf.dev/programming-guides/encoding/), and the ONNX
// messages' field numbers against onnx.proto. Python's onnx then parses whole models in
// tests/export/export_test.py.

#include <gtest/gtest.h>

#include <string>

#include "framework/export/onnx_proto.hpp"
#include "framework/export/protobuf.hpp"

namespace {

using meshtrain::protobuf::Message;

std::string hex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    if (!out.empty()) out += ' ';
    out += digits[c >> 4];
    out += digits[c & 15];
  }
  return out;
}

TEST(Protobuf, VarintsAsInTheEncodingGuide) {
  Message m;
  m.add_varint(1, 150);  // the guide's "Test1 { a: 150 }"
  EXPECT_EQ(hex(m.bytes()), "08 96 01");
  Message small;
  small.add_varint(2, 1);
  small.add_varint(3, 0);
  small.add_varint(15, 127);
  small.add_varint(16, 128);  // a field number needing a two-byte key
  EXPECT_EQ(hex(small.bytes()), "10 01 18 00 78 7f 80 01 80 01");
}

TEST(Protobuf, NegativeInt64IsTenBytesOfTwosComplement) {
  Message m;
  m.add_int64(3, -1);
  EXPECT_EQ(hex(m.bytes()), "18 ff ff ff ff ff ff ff ff ff 01");
  Message n;
  n.add_int64(3, -2);
  EXPECT_EQ(hex(n.bytes()), "18 fe ff ff ff ff ff ff ff ff 01");
}

TEST(Protobuf, LengthDelimitedAndNested) {
  Message s;
  s.add_string(2, "testing");  // the guide's "Test2 { b: "testing" }"
  EXPECT_EQ(hex(s.bytes()), "12 07 74 65 73 74 69 6e 67");
  Message inner;
  inner.add_varint(1, 150);
  Message outer;
  outer.add_message(3, inner);  // the guide's "Test3 { c: { a: 150 } }"
  EXPECT_EQ(hex(outer.bytes()), "1a 03 08 96 01");
  Message empty;
  empty.add_string(1, "");
  EXPECT_EQ(hex(empty.bytes()), "0a 00");
  // A length above 127 takes a two-byte varint.
  Message long_bytes;
  long_bytes.add_string(9, std::string(300, 'x'));
  EXPECT_EQ(hex(long_bytes.bytes().substr(0, 3)), "4a ac 02");
  EXPECT_EQ(long_bytes.size(), 3u + 300u);
}

TEST(Protobuf, FloatIsFixed32LittleEndian) {
  Message m;
  m.add_float(2, 1.0f);  // 0x3f800000
  EXPECT_EQ(hex(m.bytes()), "15 00 00 80 3f");
  Message n;
  n.add_float(2, -2.5f);  // 0xc0200000
  EXPECT_EQ(hex(n.bytes()), "15 00 00 20 c0");
}

TEST(OnnxProto, TensorAndNodeUseOnnxFieldNumbers) {
  meshtrain::onnx::Graph g;
  g.name = "g";
  g.nodes.push_back({"Relu", "r", {"x"}, {"y"}, {meshtrain::onnx::Attribute::integer("axis", -1)}});
  g.initializers.push_back({"w", meshtrain::onnx::ElementType::float32, {2}, std::string(8, '\0')});
  const std::string bytes = meshtrain::onnx::serialize(g);
  // The bytes python's onnx (protobuf) serializes for the same GraphProto.
  // GraphProto.node (1): NodeProto input "x" (1), output "y" (2), name "r" (3), op_type (4),
  // attribute (5): name "axis" (1), i = -1 (3), type INT = 2 (20).
  const std::string node =
      "0a 25 0a 01 78 12 01 79 1a 01 72 22 04 52 65 6c 75 2a 14 0a 04 61 78 69 73 18 ff ff ff "
      "ff ff ff ff ff ff 01 a0 01 02";
  EXPECT_EQ(hex(bytes.substr(0, 39)), node);  // 2 + 37 bytes; the attribute 2 + 20
  // Then name (2) "g", and initializer (5): dims 2 (1), data_type FLOAT = 1 (2), name "w" (8),
  // raw_data (9) of 8 bytes.
  EXPECT_EQ(hex(bytes.substr(39)),
            "12 01 67 2a 11 08 02 10 01 42 01 77 4a 08 00 00 00 00 00 00 00 00");
}

}  // namespace

namespace {

TEST(OnnxProto, ModelPiecesAreOneModelProto) {
  meshtrain::onnx::Model model;
  model.ir_version = 8;
  model.opset_version = 17;
  model.producer_name = "p";
  model.producer_version = "1";
  model.graph.name = std::string(200, 'g');  // a graph longer than 127 bytes
  model.metadata = {{"k", "v"}};
  const meshtrain::onnx::SerializedModel parts = meshtrain::onnx::serialize(model);
  EXPECT_EQ(parts.graph, meshtrain::onnx::serialize(model.graph));
  // The bytes python's onnx writes for the same ModelProto. ir_version (1) 8, producer_name (2)
  // "p", producer_version (3) "1", then graph (7) with its 203-byte length (name (2): key, 200 as
  // "c8 01", 200 bytes).
  EXPECT_EQ(hex(parts.head), "08 08 12 01 70 1a 01 31 3a cb 01");
  EXPECT_EQ(parts.graph.size(), 203u);
  // opset_import (8): domain "" (1), version 17 (2); metadata_props (14): key "k", value "v".
  EXPECT_EQ(hex(parts.tail), "42 04 0a 00 10 11 72 06 0a 01 6b 12 01 76");
  EXPECT_EQ(parts.size(), parts.head.size() + 203u + parts.tail.size());
}

}  // namespace
