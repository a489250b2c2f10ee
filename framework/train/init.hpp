#pragma once
// Parameter initialization that gives the same global tensor on every mesh.
//
// Each rank fills only its own block (ShardedTensor::box), never the full tensor: the value
// of an element depends only on (seed, parameter name, global flat index), through a
// counter-based generator (splitmix64 hashes). So the block of a rank equals, bit for bit,
// the same block of the tensor a single rank would generate.
//
// Schemes (fan_in = shape[0], fan_out = shape[1] of a weight [in, out]):
//   he_normal       weights ~ N(0, 2 / fan_in);                     biases 0
//   xavier_uniform  weights ~ U(-a, a), a = sqrt(6 / (fan_in + fan_out)); biases 0
//   normal          weights ~ N(0, 1 / fan_in) (the reference notebook's W / sqrt(n_in));
//                   biases ~ N(0, 1) (as the notebook)
//   zeros           everything 0
// A tensor of rank 1 is a bias; a tensor of rank 0 is treated like a bias. MoE experts are
// stacks over their leading dim: a name ending in "bias" is a bias at any rank
// (experts/bias [E, out]), and a weight of rank 3 ([E, in, out]) has fan_in = in, fan_out = out.

#include <cstdint>
#include <string>

#include "framework/core/choices.hpp"  // InitScheme, its names
#include "framework/core/sharded_tensor.hpp"

namespace meshtrain {

// 64-bit FNV-1a hash of a name: the stream of a tensor.
uint64_t name_stream(const std::string& name);

// Fills t.local with this rank's block of the global tensor named t.name under `scheme`.
void initialize(ShardedTensor& t, InitScheme scheme, uint64_t seed);

// Counter-based random numbers, usable for synthetic data too. `stream` separates tensors
// (e.g. name_stream(name)); `index` is the global flat index. Deterministic and stateless.
// uniform in [0, 1) with 24 random bits (exactly representable in float).
float counter_uniform(uint64_t seed, uint64_t stream, uint64_t index);
// standard normal: Box-Muller on the pair (2k, 2k+1) of uniforms, element 2k takes the
// cosine branch and 2k+1 the sine branch, so both halves of a pair are used.
float counter_normal(uint64_t seed, uint64_t stream, uint64_t index);

}  // namespace meshtrain
