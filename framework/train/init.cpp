#include "framework/train/init.hpp"

#include <Kokkos_Core.hpp>
#include <cmath>

#include "base/error.hpp"
#include "framework/core/exec_space.hpp"
#include "framework/core/kernel_label.hpp"
#include "framework/core/kokkos_math.hpp"

namespace meshtrain {
namespace {

constexpr int kMaxRank = 4;

KOKKOS_INLINE_FUNCTION uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The key of a (seed, stream) pair; each element hashes (key, index).
KOKKOS_INLINE_FUNCTION uint64_t stream_key(uint64_t seed, uint64_t stream) {
  return splitmix64(splitmix64(seed) ^ stream);
}

KOKKOS_INLINE_FUNCTION float uniform_at(uint64_t key, uint64_t index) {
  const uint64_t bits = splitmix64(key ^ splitmix64(index)) >> 40;  // 24 bits
  return static_cast<float>(bits) * (1.0f / 16777216.0f);
}

KOKKOS_INLINE_FUNCTION float normal_at(uint64_t key, uint64_t index) {
  const uint64_t pair = index >> 1;
  // u1 in (0, 1] so the logarithm is finite.
  const double u1 = 1.0 - static_cast<double>(uniform_at(key, 2 * pair));
  const double u2 = static_cast<double>(uniform_at(key, 2 * pair + 1));
  const double radius = kmath::sqrt(-2.0 * kmath::log(u1));
  const double angle = 6.283185307179586 * u2;
  const double z = (index & 1) ? radius * kmath::sin(angle) : radius * kmath::cos(angle);
  return static_cast<float>(z);
}

// Maps the local flat index of a block to the global flat index of the tensor.
struct BlockIndexer {
  int rank = 0;
  int64_t offset[kMaxRank] = {0, 0, 0, 0};
  int64_t extent[kMaxRank] = {1, 1, 1, 1};
  int64_t global[kMaxRank] = {1, 1, 1, 1};

  KOKKOS_INLINE_FUNCTION uint64_t operator()(int64_t local) const {
    int64_t global_index = 0;
    int64_t stride = 1;
    for (int d = rank - 1; d >= 0; --d) {
      const int64_t coordinate = local % extent[d] + offset[d];
      local /= extent[d];
      global_index += coordinate * stride;
      stride *= global[d];
    }
    return static_cast<uint64_t>(global_index);
  }
};

BlockIndexer make_indexer(const ShardedTensor& t) {
  MESHTRAIN_REQUIRE(t.global_shape.size() <= static_cast<size_t>(kMaxRank), "initialize: tensor '",
                    t.name, "' has rank ", t.global_shape.size(), ", at most ", kMaxRank,
                    " is supported");
  MESHTRAIN_REQUIRE(
      t.box.offset.size() == t.global_shape.size() && t.box.extent.size() == t.global_shape.size(),
      "initialize: tensor '", t.name, "' has a box of the wrong rank");
  BlockIndexer ix;
  ix.rank = static_cast<int>(t.global_shape.size());
  for (int d = 0; d < ix.rank; ++d) {
    ix.offset[d] = t.box.offset[d];
    ix.extent[d] = t.box.extent[d];
    ix.global[d] = t.global_shape[d];
  }
  return ix;
}

enum class Draw { zero, normal, uniform };

void fill_block(ShardedTensor& t, Draw draw, uint64_t seed, float scale, float low, float high) {
  const BlockIndexer ix = make_indexer(t);
  const uint64_t key = stream_key(seed, name_stream(t.name));
  Vector out = t.local;
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::init_block"),
      Kokkos::RangePolicy<>(device_space(), 0, out.extent(0)), KOKKOS_LAMBDA(const int64_t i) {
        if (draw == Draw::zero) {
          out(i) = 0.0f;
        } else if (draw == Draw::normal) {
          out(i) = scale * normal_at(key, ix(i));
        } else {
          out(i) = low + (high - low) * uniform_at(key, ix(i));
        }
      });
}

}  // namespace

uint64_t name_stream(const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : name) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

float counter_uniform(uint64_t seed, uint64_t stream, uint64_t index) {
  return uniform_at(stream_key(seed, stream), index);
}

float counter_normal(uint64_t seed, uint64_t stream, uint64_t index) {
  return normal_at(stream_key(seed, stream), index);
}

void initialize(ShardedTensor& t, InitScheme scheme, uint64_t seed) {
  // MoE experts are stacks over their leading dim: experts/bias [E, out] is E biases and
  // experts/weight [E, in, out] is E weights [in, out].
  const size_t rank = t.global_shape.size();
  const bool named_bias = t.name.size() >= 4 && t.name.compare(t.name.size() - 4, 4, "bias") == 0;
  const bool is_weight = rank >= 2 && !named_bias;
  if (scheme == InitScheme::zeros || (!is_weight && scheme != InitScheme::normal)) {
    fill_block(t, Draw::zero, seed, 0.0f, 0.0f, 0.0f);
    return;
  }
  if (!is_weight) {  // normal scheme: biases ~ N(0, 1) like the reference notebook
    fill_block(t, Draw::normal, seed, 1.0f, 0.0f, 0.0f);
    return;
  }
  const size_t in_dim = rank >= 3 ? rank - 2 : 0;
  const double fan_in = static_cast<double>(t.global_shape[in_dim]);
  double fan_out = 1.0;
  for (size_t d = in_dim + 1; d < rank; ++d) fan_out *= static_cast<double>(t.global_shape[d]);
  switch (scheme) {
    case InitScheme::he_normal:
      fill_block(t, Draw::normal, seed, static_cast<float>(std::sqrt(2.0 / fan_in)), 0.0f, 0.0f);
      return;
    case InitScheme::normal:
      fill_block(t, Draw::normal, seed, static_cast<float>(1.0 / std::sqrt(fan_in)), 0.0f, 0.0f);
      return;
    case InitScheme::xavier_uniform: {
      const float a = static_cast<float>(std::sqrt(6.0 / (fan_in + fan_out)));
      fill_block(t, Draw::uniform, seed, 0.0f, -a, a);
      return;
    }
    case InitScheme::zeros:
      break;
  }
}

}  // namespace meshtrain
