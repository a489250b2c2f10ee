// The Protocol Buffers wire format (framework/export/protobuf.hpp).

#include "framework/export/protobuf.hpp"

#include <cstring>

#include "base/error.hpp"

namespace meshtrain::protobuf {
namespace {

constexpr int kVarint = 0;
constexpr int kLengthDelimited = 2;
constexpr int kFixed32 = 5;

}  // namespace

void Message::add_raw_varint(uint64_t value) {
  while (value >= 0x80) {
    bytes_.push_back(static_cast<char>((value & 0x7f) | 0x80));
    value >>= 7;
  }
  bytes_.push_back(static_cast<char>(value));
}

void Message::add_key(int field, int wire_type) {
  MESHTRAIN_REQUIRE(field >= 1 && field < (1 << 29), "protobuf: field number ", field,
                    " out of range");
  add_raw_varint((static_cast<uint64_t>(field) << 3) | static_cast<uint64_t>(wire_type));
}

void Message::add_varint(int field, uint64_t value) {
  add_key(field, kVarint);
  add_raw_varint(value);
}

void Message::add_float(int field, float value) {
  add_key(field, kFixed32);
  uint32_t bits = 0;
  std::memcpy(&bits, &value, sizeof bits);
  for (int i = 0; i < 4; ++i) bytes_.push_back(static_cast<char>((bits >> (8 * i)) & 0xff));
}

void Message::add_length_prefix(int field, size_t size) {
  add_key(field, kLengthDelimited);
  add_raw_varint(size);
}

void Message::add_bytes(int field, const void* data, size_t size) {
  add_key(field, kLengthDelimited);
  add_raw_varint(size);
  bytes_.append(static_cast<const char*>(data), size);
}

}  // namespace meshtrain::protobuf
