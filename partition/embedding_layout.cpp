#include "partition/embedding_layout.hpp"

#include <algorithm>

#include "base/error.hpp"
#include "partition/collectives.hpp"
#include "partition/partition_spec.hpp"

namespace meshtrain {

namespace {
const std::string kTablePrefix = "embeddings/", kTableSuffix = "/weight";
}  // namespace

std::string embedding_weight_name(const std::string& table) {
  return kTablePrefix + table + kTableSuffix;
}

bool is_embedding_weight_name(const std::string& name) {
  return name.size() > kTablePrefix.size() + kTableSuffix.size() &&
         name.compare(0, kTablePrefix.size(), kTablePrefix) == 0 &&
         name.compare(name.size() - kTableSuffix.size(), kTableSuffix.size(), kTableSuffix) == 0 &&
         name.find('/', kTablePrefix.size()) == name.size() - kTableSuffix.size();
}

EmbeddingPooling parse_embedding_pooling(const std::string& name, const std::string& key) {
  if (name == "sum") return EmbeddingPooling::sum;
  if (name == "mean") return EmbeddingPooling::mean;
  MESHTRAIN_BAD_INPUT(key, " = '", name, "' is not a pooling: use 'sum' or 'mean'");
}

const char* to_string(EmbeddingPooling pooling) {
  return pooling == EmbeddingPooling::sum ? "sum" : "mean";
}

namespace {

std::string axes_text(const std::vector<std::string>& axes) {
  std::string text = "(";
  for (size_t i = 0; i < axes.size(); ++i) text += (i ? ", " : "") + axes[i];
  return text + ")";
}

bool contains(const std::vector<std::string>& axes, const std::string& axis) {
  return std::find(axes.begin(), axes.end(), axis) != axes.end();
}

}  // namespace

const char* to_string(EmbeddingSharding sharding) {
  switch (sharding) {
    case EmbeddingSharding::replicated:
      return "replicated";
    case EmbeddingSharding::row_wise:
      return "row-wise";
    case EmbeddingSharding::table_wise:
      return "table-wise";
  }
  return "?";
}

int64_t EmbeddingLayout::all_to_all_floats(int64_t ids) const {
  if (sharding == EmbeddingSharding::replicated) return 0;
  return ids * 3 + 2 * ids * dim_per_slice;
}

EmbeddingLayout embedding_layout(const std::string& table, const LinearParameter& weight,
                                 const Mesh& mesh, const LayerAxes& axes) {
  EmbeddingLayout l;
  l.table = table;
  l.weight = weight.name;
  if (weight.shape.size() != 2 || weight.shape[0] < 1 || weight.shape[1] < 1) {
    MESHTRAIN_BAD_INPUT("embedding table '", table, "': parameter '", weight.name, "' has shape ",
                        format_shape(weight.shape), ", not [rows, dim] with both at least 1");
  }
  l.rows = weight.shape[0];
  l.dim = weight.shape[1];
  const PartitionSpec spec = weight.spec.with_rank(2);
  const auto refuse = [&] {
    MESHTRAIN_BAD_INPUT("embedding table '", table, "': parameter '", weight.name, "' has spec ",
                        weight.spec.to_string(),
                        ", which embedding bags do not support: use P() (replicated), "
                        "P(axis, None) (row-wise) with batch axes ",
                        axes_text(axes.batch), ", P(axis@table) (table-wise) with batch axes ",
                        axes_text(axes.batch), ", or P(None, axis) (column-wise) with an axis ",
                        "that is not a batch axis (e.g. tp)");
  };
  spec.check_axes(mesh, weight.name);  // a misspelt axis is named before any layout is refused
  // Rows: batch axes only (their ranks hold different bags, each id goes to its row's owner).
  for (const std::string& axis : spec.entries[0].axes) {
    if (!contains(axes.batch, axis)) refuse();
  }
  // Columns: no batch axis (every rank of the slices must look up the same bags).
  for (const std::string& axis : spec.entries[1].axes) {
    if (contains(axes.batch, axis)) refuse();
  }
  if (spec.entries[1].table) refuse();
  if (spec.entries[0].table) {
    // Table-wise: whole on one member of the row axes (the planner placed it).
    if (!spec.entries[1].is_none()) refuse();
    const int members = mesh.size_of(spec.entries[0].axes);
    if (spec.entries[0].member < 0 || spec.entries[0].member >= members) {
      MESHTRAIN_BAD_INPUT("embedding table '", table, "': parameter '", weight.name, "' has spec ",
                          weight.spec.to_string(), ", a table-wise placement not on a member of ",
                          axis_product_text(spec.entries[0], mesh),
                          " (the plan places P(axis@table) on one)");
    }
    l.dim_per_slice = l.dim;
    l.owners = members;
    l.rows_per_owner = l.rows;
    if (members > 1) {
      l.sharding = EmbeddingSharding::table_wise;
      l.row_axes = spec.entries[0].axes;
      l.holder = spec.entries[0].member;
    } else {
      l.notes.push_back("table-wise over " + axes_text(spec.entries[0].axes) +
                        ", axes of size 1: replicated");
    }
    for (const std::string& axis : mesh.active_axes(axes.batch)) {
      if (!contains(l.row_axes, axis)) l.gradient_allreduce.push_back(axis);
    }
    l.gradient_ranks = mesh.size_of(l.gradient_allreduce);
    return l;
  }
  if (!spec.entries[1].is_none()) {
    l.column_axes = spec.entries[1].axes;
    l.column_slices = mesh.size_of(l.column_axes);
    if (l.dim % l.column_slices != 0) {
      // No uneven slices: the pooled slices are all-gathered side by side in equal widths.
      MESHTRAIN_BAD_INPUT("embedding table '", table, "': its dim ", l.dim,
                          " does not divide into the ", l.column_slices, " column slices of ",
                          axes_text(l.column_axes), " that spec ", weight.spec.to_string(),
                          " asks for; choose a dim divisible by ", l.column_slices,
                          " or a smaller column axis");
    }
    if (l.column_slices == 1) {
      l.notes.push_back("column-wise over " + axes_text(l.column_axes) +
                        ", axes of size 1: whole rows");
    }
  }
  l.dim_per_slice = l.dim / l.column_slices;
  if (!spec.entries[0].is_none()) {
    check_divisible(weight.shape, spec, mesh, weight.name);
    l.owners = mesh.size_of(spec.entries[0].axes);
    if (l.owners > 1) {
      l.sharding = EmbeddingSharding::row_wise;
      l.row_axes = spec.entries[0].axes;
    } else {
      l.notes.push_back("row-wise over " + axes_text(spec.entries[0].axes) +
                        ", axes of size 1: replicated");
    }
  }
  l.rows_per_owner = l.rows / l.owners;
  // The batch axes that do not hold rows hold copies computed from other bags: summed.
  for (const std::string& axis : mesh.active_axes(axes.batch)) {
    if (!contains(l.row_axes, axis)) l.gradient_allreduce.push_back(axis);
  }
  l.gradient_ranks = mesh.size_of(l.gradient_allreduce);
  return l;
}

EmbeddingStepBytes embedding_step_bytes(const EmbeddingLayout& l, int64_t bags, int64_t ids_per_bag,
                                        bool sparse_gradient) {
  MESHTRAIN_REQUIRE(bags >= 0 && ids_per_bag >= 0, "embedding_step_bytes: ", bags, " bags of ",
                    ids_per_bag, " ids");
  constexpr int64_t kFloat = sizeof(float);
  EmbeddingStepBytes b;
  b.ids = bags * ids_per_bag;
  const int64_t slice_floats = l.dim_per_slice;
  if (l.sharding != EmbeddingSharding::replicated) {
    // Table-wise: the same exchange with one owner (a bag is one part there).
    const int n = l.owners;
    b.parts =
        bags * std::min<int64_t>(ids_per_bag, l.sharding == EmbeddingSharding::table_wise ? 1 : n);
    b.counts_all_to_all = collective_bytes_per_rank(CollectiveKind::all_to_all, n * 4 * kFloat, n);
    b.ids_all_to_all = collective_bytes_per_rank(CollectiveKind::all_to_all, b.ids * 3 * kFloat, n);
    b.partial_sums_all_to_all =
        collective_bytes_per_rank(CollectiveKind::all_to_all, b.parts * slice_floats * kFloat, n);
    b.backward_all_to_all = b.partial_sums_all_to_all;
  }
  if (l.column_slices > 1) {
    b.column_all_gather = collective_bytes_per_rank(CollectiveKind::all_gather,
                                                    bags * l.dim * kFloat, l.column_slices);
  }
  if (l.gradient_ranks > 1) {
    int64_t rows = l.rows_per_owner;
    if (sparse_gradient) {
      // As EmbeddingBag::use_sparse_gradient: the rows this rank's step can touch (an owner
      // receives the whole group's ids), then those of every holder, capped at the local rows.
      const int64_t arriving =
          l.sharding != EmbeddingSharding::replicated ? l.owners * b.ids : b.ids;
      const int64_t local_touch = std::min(l.rows_per_owner, arriving);
      rows = std::min(l.rows_per_owner, l.gradient_ranks * local_touch);
      // Each rank's list: a count and its rows, 2 floats each (a row split in two exact parts).
      b.touched_rows_all_gather = collective_bytes_per_rank(
          CollectiveKind::all_gather, l.gradient_ranks * (local_touch + 1) * 2 * kFloat,
          l.gradient_ranks);
    }
    b.gradient_all_reduce = collective_bytes_per_rank(
        CollectiveKind::all_reduce, rows * slice_floats * kFloat, l.gradient_ranks);
  }
  return b;
}

}  // namespace meshtrain
