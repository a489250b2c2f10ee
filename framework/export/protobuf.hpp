#pragma once
// A minimal Protocol Buffers encoder: just what writing an ONNX model needs, so that meshtrain
// has no build dependency on protobuf. It writes the binary wire format
// (https://protobuf.dev/programming-guides/encoding/) field by field:
//
//   every field    key = (field_number << 3 | wire_type), as a varint, then the value
//   wire type 0    varint: 7 bits per byte, least significant group first, high bit set on
//                  every byte but the last (int32, int64, enums, bool). A negative int64 or
//                  int32 is its 64-bit two's complement: ten bytes.
//   wire type 2    length-delimited: the byte count as a varint, then the bytes (string,
//                  bytes, and embedded messages, whose bytes are their own encoding)
//   wire type 5    fixed32: four bytes, little-endian (float)
//
// Repeated scalar fields are written unpacked (one key per element), proto2's default, which
// every parser accepts. Fields are written in the order the caller adds them; the output is a
// pure function of the calls, so the same model always gives the same bytes.

#include <cstddef>
#include <cstdint>
#include <string>

namespace meshtrain::protobuf {

// One message being encoded. Embedded messages are encoded first, then added whole with
// add_message (their bytes are copied once into the parent).
class Message {
 public:
  // int32, int64, uint64, enum and bool fields (wire type 0).
  void add_varint(int field, uint64_t value);
  void add_int64(int field, int64_t value) { add_varint(field, static_cast<uint64_t>(value)); }
  // float fields (wire type 5).
  void add_float(int field, float value);
  // string and bytes fields (wire type 2).
  void add_bytes(int field, const void* data, size_t size);
  void add_string(int field, const std::string& text) {
    add_bytes(field, text.data(), text.size());
  }
  // An embedded message field (wire type 2).
  void add_message(int field, const Message& message) {
    add_bytes(field, message.bytes_.data(), message.bytes_.size());
  }
  // Only the key and length of a length-delimited field whose `size` bytes the caller writes
  // right after this message's bytes (a large embedded message, not copied again).
  void add_length_prefix(int field, size_t size);

  const std::string& bytes() const { return bytes_; }
  size_t size() const { return bytes_.size(); }

 private:
  void add_key(int field, int wire_type);
  void add_raw_varint(uint64_t value);

  std::string bytes_;
};

}  // namespace meshtrain::protobuf
