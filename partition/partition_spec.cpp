#include "partition/partition_spec.hpp"

#include <algorithm>
#include <cctype>
#include <sstream>

#include "base/error.hpp"
#include "base/text.hpp"

namespace meshtrain {

namespace {

// A small recursive-descent reader for `P(a, (b, c), None)`. Every error names the whole
// text and the column where reading stopped.
class SpecReader {
 public:
  explicit SpecReader(std::string_view text) : text_(text) {}

  PartitionSpec read() {
    skip_spaces();
    if (at_end()) fail("it is empty");
    // Optional leading P, then either a parenthesized list or a bare list.
    bool leading_p = false;
    if (peek() == 'P' && !is_identifier_char(peek_at(pos_ + 1))) {
      ++pos_;
      skip_spaces();
      if (at_end() || peek() != '(') fail("expected '(' after P");
      leading_p = true;
    }
    std::vector<SpecEntry> entries;
    if (peek() == '(' && (leading_p || wraps_everything())) {
      ++pos_;
      entries = read_list(')');
      expect(')');
    } else {
      entries = read_list('\0');
    }
    skip_spaces();
    if (!at_end()) fail("unexpected '", std::string(1, peek()), "'");
    return PartitionSpec(std::move(entries));
  }

 private:
  // True when the '(' at pos_ is closed by the last non-space character of the text, i.e.
  // it encloses the whole spec rather than being a tuple entry of a bare list.
  bool wraps_everything() const {
    int depth = 0;
    for (size_t i = pos_; i < text_.size(); ++i) {
      if (text_[i] == '(') ++depth;
      if (text_[i] == ')' && --depth == 0) {
        for (size_t j = i + 1; j < text_.size(); ++j) {
          if (!std::isspace(static_cast<unsigned char>(text_[j]))) return false;
        }
        return true;
      }
    }
    return true;  // unbalanced: let read_list report the missing ')'
  }

  // Entries separated by commas, up to (not consuming) `close` or the end of the text.
  std::vector<SpecEntry> read_list(char close) {
    std::vector<SpecEntry> entries;
    skip_spaces();
    while (!at_end() && peek() != close) {
      entries.push_back(read_entry());
      if (!take_comma()) break;
    }
    return entries;
  }

  SpecEntry read_entry() {
    SpecEntry entry;
    if (peek() == '(') {
      ++pos_;
      skip_spaces();
      while (!at_end() && peek() != ')') {
        const std::string name = read_name();
        if (name == "None") fail("None cannot be part of a tuple of axes");
        entry.axes.push_back(name);
        if (!take_comma()) break;
      }
      expect(')');
      read_placement(entry);
      return entry;  // `()` is None, as in JAX
    }
    const std::string name = read_name();
    if (name != "None") entry.axes.push_back(name);
    read_placement(entry);
    return entry;
  }

  // An optional `@table` or `@<member>` after an entry (table-wise placement).
  void read_placement(SpecEntry& entry) {
    skip_spaces();
    if (at_end() || peek() != '@') return;
    if (entry.axes.empty()) fail("table-wise placement '@' needs an axis, not None");
    ++pos_;
    skip_spaces();
    const size_t start = pos_;
    while (!at_end() && is_identifier_char(peek())) ++pos_;
    const std::string word(text_.substr(start, pos_ - start));
    entry.table = true;
    if (word == "table") return;
    if (!word.empty() && word.size() < 9 && std::all_of(word.begin(), word.end(), [](char c) {
          return std::isdigit(static_cast<unsigned char>(c)) != 0;
        })) {
      entry.member = std::stoi(word);
      return;
    }
    pos_ = start;
    fail("expected 'table' or a member index after '@' (e.g. fsdp@table or fsdp@1)");
  }

  // An axis name or None, optionally quoted ('tp' or "tp", as written in Python).
  std::string read_name() {
    if (at_end()) fail("expected an axis name, None or '(' at the end");
    char quote = 0;
    if (peek() == '\'' || peek() == '"') quote = text_[pos_++];
    const size_t start = pos_;
    while (!at_end() && is_identifier_char(peek())) ++pos_;
    if (pos_ == start || std::isdigit(static_cast<unsigned char>(text_[start]))) {
      pos_ = start;
      if (at_end()) fail("expected an axis name, None or '(' at the end");
      fail("expected an axis name, None or '(' but found '", std::string(1, peek()), "'");
    }
    std::string name(text_.substr(start, pos_ - start));
    if (quote) {
      if (at_end() || peek() != quote) fail("unterminated quote after '", name, "'");
      ++pos_;
    }
    return name;
  }

  // Skips spaces, then a ',' and the spaces after it; false when no ',' follows (the end of
  // a list).
  bool take_comma() {
    skip_spaces();
    if (at_end() || peek() != ',') return false;
    ++pos_;
    skip_spaces();
    return true;
  }

  void expect(char c) {
    skip_spaces();
    if (at_end()) fail("expected '", std::string(1, c), "' at the end");
    if (peek() != c)
      fail("expected '", std::string(1, c), "' but found '", std::string(1, peek()), "'");
    ++pos_;
  }

  template <class... Parts>
  [[noreturn]] void fail(Parts&&... parts) const {
    MESHTRAIN_BAD_INPUT("cannot read partition spec '", text_, "' at column ", pos_ + 1, ": ",
                        std::forward<Parts>(parts)...,
                        " (expected e.g. P(fsdp, tp), P((fsdp, dp), None) or P())");
  }

  static bool is_identifier_char(char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_';
  }
  void skip_spaces() {
    while (!at_end() && std::isspace(static_cast<unsigned char>(peek()))) ++pos_;
  }
  bool at_end() const { return pos_ >= text_.size(); }
  char peek() const { return text_[pos_]; }
  char peek_at(size_t i) const { return i < text_.size() ? text_[i] : '\0'; }

  std::string_view text_;
  size_t pos_ = 0;
};

// The phrase after "spec ..." or "partition spec '...'" for an axis named twice.
std::string twice_text(const std::string& axis) {
  return "names mesh axis '" + axis + "' twice; an axis may split only one dimension, once";
}

}  // namespace

PartitionSpec PartitionSpec::parse(std::string_view text) {
  PartitionSpec spec = SpecReader(text).read();
  const std::string axis = spec.repeated_axis();
  if (!axis.empty()) MESHTRAIN_BAD_INPUT("partition spec '", text, "' ", twice_text(axis));
  return spec;
}

std::string PartitionSpec::to_string() const {
  std::ostringstream out;
  out << "P(";
  for (size_t i = 0; i < entries.size(); ++i) {
    if (i) out << ", ";
    const auto& axes = entries[i].axes;
    if (axes.empty()) {
      out << "None";
    } else if (axes.size() == 1) {
      out << axes[0];
    } else {
      out << "(" << join(axes) << ")";
    }
    if (entries[i].table) {
      out << "@";
      if (entries[i].member < 0) {
        out << "table";
      } else {
        out << entries[i].member;
      }
    }
  }
  out << ")";
  return out.str();
}

bool PartitionSpec::is_replicated() const {
  return std::all_of(entries.begin(), entries.end(),
                     [](const SpecEntry& e) { return e.is_none(); });
}

int PartitionSpec::table_entry() const {
  for (size_t d = 0; d < entries.size(); ++d) {
    if (entries[d].table) return static_cast<int>(d);
  }
  return -1;
}

std::vector<std::string> PartitionSpec::axes() const {
  std::vector<std::string> all;
  for (const auto& entry : entries) all.insert(all.end(), entry.axes.begin(), entry.axes.end());
  return all;
}

std::string PartitionSpec::repeated_axis() const {
  std::vector<std::string> seen;
  for (const auto& axis : axes()) {
    if (std::find(seen.begin(), seen.end(), axis) != seen.end()) return axis;
    seen.push_back(axis);
  }
  return "";
}

std::string PartitionSpec::axes_problem(const Mesh& mesh) const {
  for (const auto& axis : axes()) {
    if (!mesh.has_axis(axis)) {
      return "names mesh axis '" + axis + "', which the mesh (" + mesh.describe() +
             ") does not have";
    }
  }
  const std::string axis = repeated_axis();
  return axis.empty() ? "" : twice_text(axis);
}

void PartitionSpec::check_axes(const Mesh& mesh, const std::string& parameter) const {
  const std::string problem = axes_problem(mesh);
  if (!problem.empty()) {
    MESHTRAIN_BAD_INPUT("parameter '", parameter, "': spec ", to_string(), " ", problem);
  }
}

PartitionSpec PartitionSpec::with_rank(size_t rank) const {
  PartitionSpec out = *this;
  out.entries.resize(rank);
  return out;
}

int64_t ShardBox::elements() const {
  int64_t n = 1;
  for (int64_t e : extent) n *= e;
  return n;
}

std::string format_shape(const std::vector<int64_t>& shape) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << "]";
  return out.str();
}

std::string axis_product_text(const SpecEntry& entry, const Mesh& mesh) {
  const std::string axes = entry.axes.size() == 1 ? entry.axes[0] : "(" + join(entry.axes) + ")";
  return axes + "=" + std::to_string(mesh.size_of(entry.axes));
}

int first_indivisible_dim(const std::vector<int64_t>& shape, const PartitionSpec& spec,
                          const Mesh& mesh) {
  MESHTRAIN_REQUIRE(spec.size() <= shape.size(), "spec ", spec.to_string(),
                    " is longer than the shape ", format_shape(shape));
  for (size_t d = 0; d < spec.size(); ++d) {
    const SpecEntry& entry = spec.entries[d];
    if (entry.splits() && shape[d] % mesh.size_of(entry.axes) != 0) return static_cast<int>(d);
  }
  return -1;
}

std::string indivisible_dim_text(const std::vector<int64_t>& shape, const PartitionSpec& spec,
                                 const Mesh& mesh, int dim) {
  const SpecEntry& entry = spec.entries.at(static_cast<size_t>(dim));
  std::ostringstream out;
  out << "dim " << dim << " (size " << shape.at(static_cast<size_t>(dim)) << ") does not divide by "
      << axis_product_text(entry, mesh) << " (axis product " << mesh.size_of(entry.axes);
  for (size_t i = 0; entry.axes.size() > 1 && i < entry.axes.size(); ++i) {
    out << (i ? " x " : ": ") << entry.axes[i] << "=" << mesh.axis_size(entry.axes[i]);
  }
  out << ")";
  return out.str();
}

void check_divisible(const std::vector<int64_t>& shape, const PartitionSpec& spec, const Mesh& mesh,
                     const std::string& parameter) {
  if (spec.size() > shape.size()) {
    MESHTRAIN_BAD_INPUT("parameter '", parameter, "': spec ", spec.to_string(), " has ",
                        spec.size(), " entries but the tensor ", format_shape(shape), " has rank ",
                        shape.size());
  }
  spec.check_axes(mesh, parameter);
  const int dim = first_indivisible_dim(shape, spec, mesh);
  if (dim >= 0) {
    MESHTRAIN_BAD_INPUT("parameter '", parameter, "' ", format_shape(shape), ": ",
                        indivisible_dim_text(shape, spec, mesh, dim), " under spec ",
                        spec.to_string());
  }
}

std::vector<int64_t> local_shape(const std::vector<int64_t>& shape, const PartitionSpec& spec,
                                 const Mesh& mesh) {
  check_divisible(shape, spec, mesh, "(unnamed)");
  std::vector<int64_t> local = shape;
  for (size_t d = 0; d < spec.size(); ++d) {
    if (spec.entries[d].splits()) local[d] /= mesh.size_of(spec.entries[d].axes);
  }
  return local;
}

ShardBox shard_box(const std::vector<int64_t>& shape, const PartitionSpec& spec, const Mesh& mesh,
                   int rank) {
  ShardBox box;
  box.extent = local_shape(shape, spec, mesh);
  box.offset.assign(shape.size(), 0);
  for (size_t d = 0; d < spec.size(); ++d) {
    const SpecEntry& entry = spec.entries[d];
    if (entry.is_none()) continue;
    if (entry.table) {
      MESHTRAIN_REQUIRE(entry.member >= 0 && entry.member < mesh.size_of(entry.axes), "spec ",
                        spec.to_string(), ": a table-wise entry not placed on a member of ",
                        axis_product_text(entry, mesh));
      if (mesh.group_index(rank, entry.axes) != entry.member) box.extent[d] = 0;
      continue;
    }
    box.offset[d] = static_cast<int64_t>(mesh.group_index(rank, entry.axes)) * box.extent[d];
  }
  return box;
}

bool owns_block(const Mesh& mesh, int rank, const PartitionSpec& spec) {
  const std::vector<std::string> used = spec.axes();
  const std::vector<int> coords = mesh.coordinates(rank);
  for (size_t a = 0; a < mesh.axes().size(); ++a) {
    const bool in_spec = std::find(used.begin(), used.end(), mesh.axes()[a].name) != used.end();
    if (!in_spec && coords[a] != 0) return false;
  }
  for (const SpecEntry& entry : spec.entries) {
    if (entry.table && mesh.group_index(rank, entry.axes) != entry.member) return false;
  }
  return true;
}

}  // namespace meshtrain
