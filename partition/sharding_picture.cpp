#include "partition/sharding_picture.hpp"

#include <algorithm>
#include <sstream>

#include "base/error.hpp"

namespace meshtrain {

std::vector<std::vector<std::vector<int>>> block_owners(const std::vector<int64_t>& shape,
                                                        const PartitionSpec& spec,
                                                        const Mesh& mesh) {
  MESHTRAIN_REQUIRE(shape.size() <= 2, "block_owners draws tensors of rank 2 or less, got rank ",
                    shape.size());
  // Number of blocks along each drawn dimension: rows = dim 0 of a 2-D tensor.
  auto splits = [&](size_t d) -> int64_t {
    if (d >= spec.size() || !spec.entries[d].splits()) return 1;  // table-wise: one block
    return mesh.size_of(spec.entries[d].axes);
  };
  const int64_t rows = shape.size() == 2 ? splits(0) : 1;
  const int64_t cols = shape.size() == 2 ? splits(1) : (shape.size() == 1 ? splits(0) : 1);
  std::vector<std::vector<std::vector<int>>> owners(
      static_cast<size_t>(rows), std::vector<std::vector<int>>(static_cast<size_t>(cols)));
  for (int rank = 0; rank < mesh.world_size(); ++rank) {
    const ShardBox box = shard_box(shape, spec, mesh, rank);
    if (box.elements() == 0 && spec.table_entry() >= 0) continue;  // not its table-wise member
    int64_t row = 0, col = 0;
    if (shape.size() == 2) {
      row = box.extent[0] ? box.offset[0] / box.extent[0] : 0;
      col = box.extent[1] ? box.offset[1] / box.extent[1] : 0;
    } else if (shape.size() == 1) {
      col = box.extent[0] ? box.offset[0] / box.extent[0] : 0;
    }
    owners[static_cast<size_t>(row)][static_cast<size_t>(col)].push_back(rank);
  }
  return owners;
}

std::string rank_list_label(const std::vector<int>& input) {
  std::vector<int> ranks = input;
  std::sort(ranks.begin(), ranks.end());
  std::ostringstream out;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (i) out << ",";
    if (j - i >= 2) {
      out << ranks[i] << "-" << ranks[j];
    } else {
      for (size_t k = i; k <= j; ++k) out << (k > i ? "," : "") << ranks[k];
    }
    i = j + 1;
  }
  return out.str();
}

std::string sharding_picture(const std::vector<int64_t>& shape, const PartitionSpec& spec,
                             const Mesh& mesh, int max_ranks, int max_width) {
  if (shape.size() > 2 || mesh.world_size() > max_ranks) return "";
  const auto owners = block_owners(shape, spec, mesh);
  const size_t cols = owners.empty() ? 0 : owners[0].size();
  if (cols == 0) return "";

  std::vector<std::vector<std::string>> labels;
  size_t label_width = 1;
  for (const auto& row : owners) {
    labels.emplace_back();
    for (const auto& ranks : row) {
      labels.back().push_back(rank_list_label(ranks));
      label_width = std::max(label_width, labels.back().back().size());
    }
  }
  // Each cell is "| label " plus the closing "|": cols * (width + 3) + 1 columns.
  const int64_t budget = (static_cast<int64_t>(max_width) - 1) / static_cast<int64_t>(cols) - 3;
  if (budget < static_cast<int64_t>(label_width))
    label_width = static_cast<size_t>(std::max<int64_t>(budget, 1));

  std::string border = "+";
  for (size_t c = 0; c < cols; ++c) border += std::string(label_width + 2, '-') + "+";
  std::ostringstream out;
  out << border << "\n";
  for (const auto& row : labels) {
    out << "|";
    for (std::string label : row) {
      if (label.size() > label_width) {
        label = label_width > 2 ? label.substr(0, label_width - 2) + ".."
                                : label.substr(0, label_width);
      }
      // Centre the label in its cell.
      const size_t pad = label_width - label.size();
      out << " " << std::string(pad / 2, ' ') << label << std::string(pad - pad / 2, ' ') << " |";
    }
    out << "\n" << border << "\n";
  }
  return out.str();
}

}  // namespace meshtrain
