#include "framework/core/tensor_values.hpp"

#include "framework/core/precision.hpp"

namespace meshtrain {

int64_t held_elements(const ShardedTensor& t) {
  return static_cast<int64_t>(t.stored_16bit() ? t.bits.extent(0) : t.local.extent(0));
}

const void* data_pointer(const ShardedTensor& t) {
  return t.stored_16bit() ? static_cast<const void*>(t.bits.data())
                          : static_cast<const void*>(t.local.data());
}

Vector values_fp32(const ShardedTensor& t) {
  if (!t.stored_16bit()) return t.local;
  Vector out(Kokkos::view_alloc(Kokkos::WithoutInitializing, t.name + ":fp32_values"),
             t.bits.extent(0));
  unpack_16bit(t.bits.data(), out.data(), t.bits.extent(0), t.storage);
  return out;
}

}  // namespace meshtrain
