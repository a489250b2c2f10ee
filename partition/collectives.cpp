#include "partition/collectives.hpp"

#include "base/error.hpp"
#include "base/text.hpp"
#include "partition/partition_spec.hpp"

namespace meshtrain {

namespace {

int64_t elements_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (__builtin_mul_overflow(n, d, &n)) {
      MESHTRAIN_BAD_INPUT("a collective operand ", format_shape(shape),
                          " has more elements than fit in 64 bits");
    }
  }
  return n;
}

}  // namespace

const char* to_string(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::all_gather:
      return "all-gather";
    case CollectiveKind::reduce_scatter:
      return "reduce-scatter";
    case CollectiveKind::all_to_all:
      return "all-to-all";
    default:
      return "all-reduce";
  }
}

int64_t collective_bytes_per_rank(CollectiveKind kind, int64_t bytes, int ranks) {
  MESHTRAIN_REQUIRE(bytes >= 0 && ranks >= 1, "collective of ", bytes, " bytes over ", ranks,
                    " ranks");
  const __int128 moved = static_cast<__int128>(bytes) * (ranks - 1) *
                         (kind == CollectiveKind::all_reduce ? 2 : 1) / ranks;
  if (moved > INT64_MAX) MESHTRAIN_BAD_INPUT("a collective of ", bytes, " bytes overflows 64 bits");
  return static_cast<int64_t>(moved);
}

LayerCollective layer_collective(const std::string& phase, CollectiveKind kind,
                                 const std::string& operand, const std::vector<std::string>& axes,
                                 std::vector<int64_t> shape, int64_t element_bytes,
                                 const Mesh& mesh, int dim) {
  LayerCollective c{phase,         kind, operand, axes, mesh.size_of(axes), std::move(shape),
                    element_bytes, 0,    dim};
  int64_t bytes = 0;
  if (__builtin_mul_overflow(elements_of(c.shape), element_bytes, &bytes)) {
    MESHTRAIN_BAD_INPUT("a collective operand ", format_shape(c.shape),
                        " has more bytes than fit in 64 bits");
  }
  c.bytes_per_rank = collective_bytes_per_rank(kind, bytes, c.ranks);
  return c;
}

}  // namespace meshtrain
