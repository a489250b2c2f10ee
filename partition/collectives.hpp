#pragma once
// The vocabulary of collectives that the layouts, the planner, the cost model, the layers and
// the communicators share: which kind, over which axes, on what operand, and the bytes one
// rank moves. Pure arithmetic, no MPI.
//
// Cost model (per rank, ring algorithms, as NCCL and most MPI libraries use for large
// messages): over a group of n ranks, an all-gather or a reduce-scatter whose full
// (gathered / unreduced) operand is S bytes moves S * (n - 1) / n bytes through each rank;
// an all-reduce of S bytes moves 2 * S * (n - 1) / n (a reduce-scatter then an all-gather).
// Rounded down to whole bytes. The collective matmuls (ring, bidirectional) move the same
// blocks as the plain collective they replace, so they count the same.
// all_to_all: a variable all-to-all (MoE dispatch, partition/moe_layout.hpp); its operand is
// what this rank sends, of which (n - 1) / n leaves it at uniform routing.

#include <cstdint>
#include <string>
#include <vector>

#include "base/dtype.hpp"
#include "base/error.hpp"
#include "partition/mesh.hpp"

namespace meshtrain {

enum class CollectiveKind { all_gather, reduce_scatter, all_reduce, all_to_all };
const char* to_string(CollectiveKind kind);

struct LayerCollective {
  std::string phase;  // "forward" or "backward"
  CollectiveKind kind;
  std::string operand;            // "weight", "bias", "input", "output", "output gradient", ...
  std::vector<std::string> axes;  // the group (active axes)
  int ranks = 1;                  // its size
  std::vector<int64_t> shape;     // the full operand (gathered / unreduced), elements
  int64_t element_bytes = 4;      // what one element moves as (mixed precision: 2 for 16 bits)
  int64_t bytes_per_rank = 0;     // per the cost model above
  int dim = 0;                    // of a matrix gathered or scattered along dim 1 (columns): 1; the
                // communicator then moves the columns through [n][rows][cols] staging
};

// Bytes one rank moves in a collective of `kind` on a full operand of `bytes` over `ranks`.
int64_t collective_bytes_per_rank(CollectiveKind kind, int64_t bytes, int ranks);

// One collective over the active `axes` of `mesh` on a full operand of `shape` elements of
// `element_bytes` each, with its bytes per rank (bad_input when they overflow 64 bits).
LayerCollective layer_collective(const std::string& phase, CollectiveKind kind,
                                 const std::string& operand, const std::vector<std::string>& axes,
                                 std::vector<int64_t> shape, int64_t element_bytes,
                                 const Mesh& mesh, int dim = 0);

// What one element of `dtype` moves as: `fp32_bytes` for fp32 data (4, or 8 where a plan
// counts float64), 2 for the 16-bit formats.
inline int64_t wire_element_bytes(Dtype dtype, int64_t fp32_bytes) {
  return dtype == Dtype::fp32 ? fp32_bytes : 2;
}

// The collectives of one layer's training step, in the order the layer runs them: the
// layouts' *_step_collectives add to it; a collective over no active axis is not one and is
// left out.
struct StepCollectives {
  // `rows`: the local batch rows (0 = unknown); `fp32_bytes`: of one fp32 element as the plan
  // counts it. Both checked here for every layout's *_step_collectives.
  StepCollectives(const Mesh& mesh, int64_t rows, int64_t fp32_bytes)
      : mesh(mesh), fp32_bytes(fp32_bytes) {
    MESHTRAIN_REQUIRE(rows >= 0 && fp32_bytes >= 1, "rows ", rows, ", bytes_per_element ",
                      fp32_bytes);
  }

  const Mesh& mesh;
  int64_t fp32_bytes;
  std::vector<LayerCollective> list;

  void add(const std::string& phase, CollectiveKind kind, const std::string& operand,
           const std::vector<std::string>& axes, std::vector<int64_t> shape, Dtype dtype,
           int dim = 0) {
    add_bytes(phase, kind, operand, axes, std::move(shape), wire_element_bytes(dtype, fp32_bytes),
              dim);
  }
  void add_bytes(const std::string& phase, CollectiveKind kind, const std::string& operand,
                 const std::vector<std::string>& axes, std::vector<int64_t> shape,
                 int64_t element_bytes, int dim = 0) {
    if (axes.empty()) return;
    list.push_back(
        layer_collective(phase, kind, operand, axes, std::move(shape), element_bytes, mesh, dim));
  }
};

}  // namespace meshtrain
