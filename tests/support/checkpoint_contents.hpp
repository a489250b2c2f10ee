#pragma once
// Deterministic checkpoint contents for the checkpoint tests: a small MLP (two Linear
// layers and a scalar) with AdamW slots m and v, laid out under any mesh. Every global
// value is a function of (tensor id, global flat index, salt), so a restored block can be
// compared exactly with what was saved, whatever the meshes.

#include <mpi.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "framework/io/checkpoint.hpp"
#include "partition/mesh.hpp"
#include "partition/partition_spec.hpp"

namespace meshtrain::testing {

struct ParamShape {
  std::string name;
  std::vector<int64_t> shape;
};

// Divisible by 4 on every split dimension.
inline std::vector<ParamShape> test_model() {
  return {{"layers/0/weight", {8, 12}},
          {"layers/0/bias", {12}},
          {"layers/1/weight", {12, 4}},
          {"layers/1/bias", {4}},
          {"scale", {}}};
}

// Storage layout per preset: "dp" (replicated), "fsdp", "tp", "fsdp_tp".
inline PartitionSpec test_spec(const std::string& layout, const ParamShape& p) {
  const bool weight = p.shape.size() == 2;
  if (p.shape.empty() || layout == "dp") return PartitionSpec::parse("P()");
  if (layout == "fsdp") return PartitionSpec::parse(weight ? "P(fsdp, None)" : "P(fsdp)");
  if (layout == "tp") return PartitionSpec::parse(weight ? "P(tp, None)" : "P(tp)");
  return PartitionSpec::parse(weight ? "P(fsdp, tp)" : "P(tp)");  // fsdp_tp
}

// The global value of element `index` of tensor `id`.
inline float test_value(int id, int64_t index, int64_t salt) {
  uint64_t x = static_cast<uint64_t>(id) * 0x9E3779B97F4A7C15ull +
               static_cast<uint64_t>(index) * 0xBF58476D1CE4E5B9ull +
               static_cast<uint64_t>(salt) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  x *= 0xD6E8FEB86659FD93ull;
  x ^= x >> 29;
  return static_cast<float>(static_cast<int64_t>(x % 2000001) - 1000000) / 1024.0f;
}

// Calls fn(local index, global flat index) for every element of a tensor's block.
template <class Fn>
void for_each_element(const ShardedTensor& t, Fn&& fn) {
  const size_t rank = t.global_shape.size();
  const int64_t n = t.box.elements();
  std::vector<int64_t> pos(rank, 0);  // position inside the box
  for (int64_t local = 0; local < n; ++local) {
    int64_t global = 0;
    for (size_t d = 0; d < rank; ++d)
      global = global * t.global_shape[d] + t.box.offset[d] + pos[d];
    fn(local, global);
    for (size_t d = rank; d-- > 0;) {
      if (++pos[d] < t.box.extent[d]) break;
      pos[d] = 0;
    }
  }
}

// Allocates a tensor of `layout` for `rank` of `mesh`; fills it with the test values when
// fill is true (otherwise zero, ready to be loaded into).
inline ShardedTensor test_tensor(const ParamShape& p, int id, const std::string& layout,
                                 const Mesh& mesh, int rank, int64_t salt, bool fill) {
  ShardedTensor t = ShardedTensor::allocate(p.name, p.shape, test_spec(layout, p), mesh, rank);
  if (fill) {
    auto host = Kokkos::create_mirror_view(t.local);  // the block itself on host memory
    for_each_element(
        t, [&](int64_t local, int64_t global) { host(local) = test_value(id, global, salt); });
    Kokkos::deep_copy(t.local, host);
  }
  return t;
}

// Parameters (ids 0..), slots m (ids 100..) and v (ids 200..).
inline CheckpointContents test_contents(const Mesh& mesh, int rank, const std::string& layout,
                                        int64_t step, bool fill,
                                        const std::vector<ParamShape>& model = test_model()) {
  CheckpointContents c;
  c.mesh = mesh;
  c.train_state = TrainState{step, step / 3, step % 3, 1234, static_cast<uint64_t>(step) * 7, step};
  c.config_text = "[run]\nname = \"checkpoint-test\"\nseed = 1234\n";
  c.opt_state = {{"m", {}}, {"v", {}}};
  for (size_t i = 0; i < model.size(); ++i) {
    const int id = static_cast<int>(i);
    c.params.push_back(test_tensor(model[i], id, layout, mesh, rank, step, fill));
    c.opt_state[0].tensors.push_back(
        test_tensor(model[i], 100 + id, layout, mesh, rank, step, fill));
    c.opt_state[1].tensors.push_back(
        test_tensor(model[i], 200 + id, layout, mesh, rank, step, fill));
  }
  if (!fill) c.train_state = TrainState{};
  return c;
}

// Number of elements of `t` that differ from the test values of (id, salt).
inline int64_t count_mismatches(const ShardedTensor& t, int id, int64_t salt) {
  int64_t wrong = 0;
  const auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), t.local);
  for_each_element(t, [&](int64_t local, int64_t global) {
    if (host(local) != test_value(id, global, salt)) ++wrong;
  });
  return wrong;
}

// Mismatches over every tensor of contents built by test_contents.
inline int64_t count_all_mismatches(const CheckpointContents& c, int64_t salt) {
  int64_t wrong = 0;
  for (size_t i = 0; i < c.params.size(); ++i) {
    wrong += count_mismatches(c.params[i], static_cast<int>(i), salt);
    wrong += count_mismatches(c.opt_state[0].tensors[i], 100 + static_cast<int>(i), salt);
    wrong += count_mismatches(c.opt_state[1].tensors[i], 200 + static_cast<int>(i), salt);
  }
  return wrong;
}

}  // namespace meshtrain::testing
