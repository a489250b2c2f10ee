#pragma once
// The layout of an embedding table `embeddings/<table>/weight` [rows, dim] (layers/
// embedding_bag.hpp, docs/recsys.md), decided from its spec alone, as linear_layout.hpp decides a
// Linear's: pure arithmetic, no MPI or Kokkos, so that the layer builds its communicators from
// this decision and a planner can report the same one.
//
// The decision (batch axes B; "active" = in the mesh, size > 1):
//   replicated  P(), or P(axes, None) whose axes are all of size 1 (the note says so): every
//               rank holds the table; the gradient is all-reduced over the active batch axes.
//   row-wise    P(axes, None) with `axes` (one axis or a tuple) all batch axes: group index j
//               over `axes` holds rows [j rows / n, (j + 1) rows / n) (n = their product, which
//               must divide rows: check_divisible's error otherwise); ids go to their owners by
//               an all-to-all-v over the active ones, and the gradient is all-reduced over the
//               active batch axes that `axes` does not name.
//   column-wise P(None, axes) with `axes` (one axis or a tuple) none of them a batch axis (e.g.
//               tp: its ranks hold the same bags): group index k over `axes` holds columns
//               [k dim / m, (k + 1) dim / m) of every row (m = their product, which must divide
//               dim: bad_input naming the table and its dim otherwise, no uneven slices); each
//               rank pools its columns and the pooled slices are all-gathered over the active
//               ones. Composes with row-wise: P(batch axes, tp) is row-wise over the batch axes
//               in each column slice.
//   table-wise  P(axes@k) (written P(axes@table) in a rule; the planner places it on member k,
//               planner.hpp) with `axes` all batch axes: group index k over `axes` holds the
//               whole table, the other members none of it. The layer runs row-wise's
//               all-to-all with one owner: every id goes to member k, which pools each bag's
//               partial sum (the whole bag) and returns it; the gradient is all-reduced over
//               the active batch axes that `axes` does not name (among the holders).
//   Anything else is bad_input naming the table, the parameter and its spec: row-wise or
//   table-wise over an axis that does not split the batch (its ranks hold the same bags: every
//   row's gradient would arrive once per rank), column-wise over a batch axis (its ranks hold
//   different bags, whose ids every slice would need), and table-wise with columns split.

#include <cstdint>
#include <string>
#include <vector>

#include "partition/linear_layout.hpp"  // LayerAxes, LinearParameter
#include "partition/mesh.hpp"

namespace meshtrain {

// An embedding table's weight parameter, "embeddings/<table>/weight" (EmbeddingBag, the DLRM's
// shapes, the planner's table-wise check), and whether a parameter name is one.
std::string embedding_weight_name(const std::string& table);
bool is_embedding_weight_name(const std::string& name);

enum class EmbeddingSharding { replicated, row_wise, table_wise };
// How a bag's rows are pooled (layers/embedding_bag.hpp); here so that shapes (dlrm_shape.hpp)
// can name it without the layer.
enum class EmbeddingPooling { sum, mean };
// "sum" | "mean"; anything else is bad_input naming `key` and the value.
EmbeddingPooling parse_embedding_pooling(const std::string& name, const std::string& key);
const char* to_string(EmbeddingPooling pooling);
const char* to_string(EmbeddingSharding sharding);  // "replicated", "row-wise", "table-wise"

struct EmbeddingLayout {
  std::string table;   // "cat"
  std::string weight;  // "embeddings/cat/weight"
  int64_t rows = 0, dim = 0;
  EmbeddingSharding sharding = EmbeddingSharding::replicated;
  // Row-wise and table-wise: the spec's axes (major to minor); else empty.
  std::vector<std::string> row_axes;
  int owners = 1;              // their product (1: replicated)
  int64_t rows_per_owner = 0;  // rows / owners; table-wise: rows (on the holder, 0 elsewhere)
  int holder = -1;             // table-wise: the member of row_axes that holds the table
  // Column-wise: the spec's dim axes (active or not); empty when the table is whole in dim.
  std::vector<std::string> column_axes;
  int column_slices = 1;      // their product (1: every rank holds whole rows)
  int64_t dim_per_slice = 0;  // dim / column_slices
  // The active batch axes the gradient is all-reduced over after backward, and their size.
  std::vector<std::string> gradient_allreduce;
  int gradient_ranks = 1;
  std::vector<std::string> notes;  // for a plan: row-wise over axes of size 1

  // Floats this rank sends in a step's all-to-alls for `ids` ids in at most `ids` parts (the
  // worst case: every id its own part): 3 per id out, dim_per_slice per part back (owner), as
  // many per part out in backward. 0 when no rows are split (the column-wise all-gather is not
  // an all-to-all: step_bytes counts it).
  int64_t all_to_all_floats(int64_t ids) const;
};

// What one rank moves for one table in one training step (`meshtrain plan`), in bytes, by the
// cost model of partition/collectives.hpp (an all-to-all: what the rank sends, of which
// (n - 1) / n leaves it at uniform ids; an all-gather of S gathered bytes: S (n - 1) / n; an
// all-reduce: 2 S (n - 1) / n), for `bags` bags in this rank's batch of `ids_per_bag` ids each.
// A bag sends one part (a partial sum, and its dy in backward) to each owner of its ids: at most
// min(ids_per_bag, owners) parts; the figures take that bound, and the owner's returns as many
// parts as it was sent (uniform ids). fp32 throughout (the layer's only precision).
struct EmbeddingStepBytes {
  int64_t ids = 0;    // bags x ids_per_bag
  int64_t parts = 0;  // row-wise: bags x min(ids_per_bag, owners); else 0
  // Forward.
  int64_t counts_all_to_all = 0;        // row-wise: 4 floats per owner, before the ids
  int64_t ids_all_to_all = 0;           // row-wise: 3 floats per id (the local row, its part)
  int64_t partial_sums_all_to_all = 0;  // row-wise: dim_per_slice floats per part, back
  int64_t column_all_gather = 0;  // column-wise: the pooled slices [bags, dim] over the slices
  // Backward.
  int64_t backward_all_to_all = 0;      // row-wise: dy of each part to its owner
  int64_t gradient_all_reduce = 0;      // over gradient_allreduce (sparse: the touched rows only)
  int64_t touched_rows_all_gather = 0;  // sparse gradients: the touched row lists
  int64_t forward() const {
    return counts_all_to_all + ids_all_to_all + partial_sums_all_to_all + column_all_gather;
  }
  int64_t backward() const {
    return backward_all_to_all + gradient_all_reduce + touched_rows_all_gather;
  }
  int64_t total() const { return forward() + backward(); }
};

// `sparse_gradient`: the tables are updated in the rows a step touched (optimizer.embeddings
// other than "dense"): the gradient all-reduce then carries at most the rows the step's ids can
// touch (every rank's ids distinct), after an all-gather of the touched lists, as
// EmbeddingBag::use_sparse_gradient sizes them; dense: the whole local block.
EmbeddingStepBytes embedding_step_bytes(const EmbeddingLayout& layout, int64_t bags,
                                        int64_t ids_per_bag, bool sparse_gradient);

// The layout of table `table` whose weight is `weight` ([rows, dim], its spec) on `mesh` with the
// layer axes `axes` (layer_axes_on). bad_input as described above, and for a shape that is not
// [rows, dim] with both at least 1.
EmbeddingLayout embedding_layout(const std::string& table, const LinearParameter& weight,
                                 const Mesh& mesh, const LayerAxes& axes);

}  // namespace meshtrain
