#pragma once
// Element types of a mixed-precision run ([mixed_precision], docs/mixed_precision.md) and
// the policy itself, FSDP2's MixedPrecisionPolicy(param_dtype, reduce_dtype): masters and
// optimizer state stay fp32; param_dtype is what layers compute with and gather weights and
// move activations in; reduce_dtype is what gradients are reduced in. Their names are in
// framework/core/choices.hpp; the conversions in framework/core/precision.hpp.

#include <cstddef>

namespace meshtrain {

enum class Dtype { fp32, bf16, fp16 };

constexpr std::size_t bytes_of(Dtype dtype) {
  return dtype == Dtype::fp32 ? 4 : 2;
}

struct MixedPrecision {
  Dtype param = Dtype::fp32;
  Dtype reduce = Dtype::fp32;
  bool operator==(const MixedPrecision& o) const { return param == o.param && reduce == o.reduce; }
  bool is_fp32() const { return param == Dtype::fp32 && reduce == Dtype::fp32; }
  // fp16 anywhere needs loss scaling (its 5-bit exponent underflows small gradients).
  bool needs_loss_scaling() const { return param == Dtype::fp16 || reduce == Dtype::fp16; }
};

}  // namespace meshtrain
