#include "framework/train/hardware_file.hpp"

#include <toml++/toml.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include "base/error.hpp"

namespace meshtrain {

namespace {

std::string at(const std::string& source, const toml::node* node) {
  if (node && node->source().begin.line > 0) {
    return source + ":" + std::to_string(node->source().begin.line);
  }
  return source;
}

// The number at `key` of `table` (an integer is taken as a number too).
double number(const toml::table& table, const std::string& key, const std::string& full_key,
              const std::string& source, bool required, double fallback) {
  const toml::node* node = table.get(key);
  if (!node) {
    if (required) MESHTRAIN_BAD_INPUT(source, ": the hardware profile has no key ", full_key);
    return fallback;
  }
  if (const auto v = node->value<double>()) return *v;
  MESHTRAIN_BAD_INPUT(at(source, node), ": hardware profile key ", full_key, " must be a number");
}

void reject_unknown(const toml::table& table, std::initializer_list<const char*> known,
                    const std::string& prefix, const std::string& source) {
  for (const auto& [key, node] : table) {
    bool ok = false;
    for (const char* k : known) ok = ok || key.str() == k;
    if (!ok) {
      MESHTRAIN_BAD_INPUT(
          at(source, &node), ": unknown hardware profile key ", prefix, std::string(key.str()),
          " (keys: gemm_flops, memory_bandwidth, overlap, storage_read_bandwidth, ",
          "storage_read_latency, hdf5_row_seconds, sparse_row_seconds, sparse_id_seconds, ",
          "[[gemm]] shape, transpose, flops, ", "[links.<axis>] ",
          "bandwidth, latency, collective_overhead, collective_bandwidth, "
          "reduce_scatter_bandwidth, ",
          "all_reduce_bandwidth, exchange_bandwidth, bidirectional_bandwidth, ",
          "ring_reduce_scatter_bandwidth, ring_all_reduce_bandwidth, ring_reduce_scatter_from, ",
          "ring_all_reduce_from, [measured])");
    }
  }
}

// One [[gemm]] entry: shape = [m, k, n], transpose = "NN" | "NT" | "TN" | "TT", flops.
GemmRate gemm_rate(const toml::table& t, const std::string& source) {
  reject_unknown(t, {"shape", "transpose", "flops"}, "gemm.", source);
  GemmRate r;
  const toml::node* shape = t.get("shape");
  const toml::array* extents = shape ? shape->as_array() : nullptr;
  int64_t mkn[3] = {0, 0, 0};
  bool ok = extents && extents->size() == 3;
  for (size_t i = 0; ok && i < 3; ++i) {
    const auto v = extents->get(i)->value<int64_t>();
    ok = v && *v > 0;
    if (ok) mkn[i] = *v;
  }
  if (!ok) {
    MESHTRAIN_BAD_INPUT(at(source, shape ? shape : &t),
                        ": hardware profile key gemm.shape must be [m, k, n], three positive "
                        "integers");
  }
  r.shape = {mkn[0], mkn[1], mkn[2], false, false};
  const toml::node* transpose = t.get("transpose");
  const auto flags = transpose ? transpose->value<std::string>() : std::optional<std::string>();
  if (!flags || flags->size() != 2 || ((*flags)[0] != 'N' && (*flags)[0] != 'T') ||
      ((*flags)[1] != 'N' && (*flags)[1] != 'T')) {
    MESHTRAIN_BAD_INPUT(at(source, transpose ? transpose : &t),
                        ": hardware profile key gemm.transpose must be \"NN\", \"NT\", \"TN\" or "
                        "\"TT\"");
  }
  r.shape.transpose_a = (*flags)[0] == 'T';
  r.shape.transpose_b = (*flags)[1] == 'T';
  r.flops = number(t, "flops", "gemm.flops", source, true, 0);
  return r;
}

std::string number_text(double value) {
  char text[64];
  std::snprintf(text, sizeof text, "%.6g", value);
  std::string s = text;
  // TOML needs a float to have a dot or an exponent.
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return s;
}

}  // namespace

HardwareProfile parse_hardware_profile(const std::string& text, const std::string& source) {
  toml::table root;
  try {
    root = toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    MESHTRAIN_BAD_INPUT(source, ":", e.source().begin.line, ":", e.source().begin.column,
                        ": invalid TOML: ", e.description());
  }
  reject_unknown(root,
                 {"gemm_flops", "memory_bandwidth", "overlap", "storage_read_bandwidth",
                  "storage_read_latency", "hdf5_row_seconds", "sparse_row_seconds",
                  "sparse_id_seconds", "links", "gemm", "elementwise", "measured"},
                 "", source);
  HardwareProfile p;
  p.source = source;
  p.gemm_flops = number(root, "gemm_flops", "gemm_flops", source, true, 0);
  p.memory_bandwidth = number(root, "memory_bandwidth", "memory_bandwidth", source, true, 0);
  p.overlap = number(root, "overlap", "overlap", source, false, 0.0);
  // Profiles written before data files were costed lack these: the defaults' local SSD.
  const HardwareProfile defaults = default_hardware_profile();
  p.storage_read_bandwidth = number(root, "storage_read_bandwidth", "storage_read_bandwidth",
                                    source, false, defaults.storage_read_bandwidth);
  p.storage_read_latency = number(root, "storage_read_latency", "storage_read_latency", source,
                                  false, defaults.storage_read_latency);
  // Profiles written before calibrate measured a DLRM's data read lack these: the estimate
  // kHdf5RowSeconds and the sparse reader's work at memory bandwidth (0: not measured).
  p.hdf5_row_seconds = number(root, "hdf5_row_seconds", "hdf5_row_seconds", source, false,
                              defaults.hdf5_row_seconds);
  p.sparse_row_seconds =
      number(root, "sparse_row_seconds", "sparse_row_seconds", source, false, 0.0);
  p.sparse_id_seconds = number(root, "sparse_id_seconds", "sparse_id_seconds", source, false, 0.0);
  // The per-id figure is a measured one only beside a measured per-row one (calibrate writes
  // both); alone the model would ignore it and a rewrite would drop it.
  if (p.sparse_id_seconds > 0.0 && p.sparse_row_seconds == 0.0) {
    MESHTRAIN_BAD_INPUT(source, ": sparse_id_seconds = ", p.sparse_id_seconds,
                        " needs sparse_row_seconds above 0 (missing or 0 here), as calibrate ",
                        "writes them together");
  }
  if (const toml::node* gemm_node = root.get("gemm")) {
    const toml::array* entries = gemm_node->as_array();
    if (!entries || !entries->is_array_of_tables()) {
      MESHTRAIN_BAD_INPUT(at(source, gemm_node),
                          ": hardware profile key gemm must be an array of tables ([[gemm]])");
    }
    for (const toml::node& entry : *entries) {
      p.gemm_rates.push_back(gemm_rate(*entry.as_table(), source));
    }
  }
  // Profiles written before elementwise kernels were measured lack the table: every pass is
  // then charged at memory_bandwidth.
  if (const toml::node* node = root.get("elementwise")) {
    const toml::table* rates = node->as_table();
    if (!rates) {
      MESHTRAIN_BAD_INPUT(at(source, node), ": hardware profile key elementwise must be a table");
    }
    for (const auto& [key, value] : *rates) {
      const std::string name(key.str());
      p.elementwise_rates[name] = number(*rates, name, "elementwise." + name, source, true, 0);
    }
  }
  const toml::node* links_node = root.get("links");
  const toml::table* links = links_node ? links_node->as_table() : nullptr;
  if (links_node && !links) {
    MESHTRAIN_BAD_INPUT(at(source, links_node), ": hardware profile key links must be a table");
  }
  if (links) {
    std::initializer_list<const char*> axes = {"dp", "fsdp", "ep", "tp", "sp"};
    reject_unknown(*links, axes, "links.", source);
  }
  for (const auto& axis : hardware_axes()) {
    const std::string prefix = "links." + axis;
    const toml::node* node = links ? links->get(axis) : nullptr;
    if (!node) MESHTRAIN_BAD_INPUT(source, ": the hardware profile has no table [", prefix, "]");
    const toml::table* t = node->as_table();
    if (!t)
      MESHTRAIN_BAD_INPUT(at(source, node), ": hardware profile key ", prefix, " must be a table");
    reject_unknown(
        *t,
        {"bandwidth", "latency", "collective_overhead", "collective_bandwidth",
         "reduce_scatter_bandwidth", "all_reduce_bandwidth", "exchange_bandwidth",
         "bidirectional_bandwidth", "ring_reduce_scatter_bandwidth", "ring_all_reduce_bandwidth",
         "ring_reduce_scatter_from", "ring_all_reduce_from"},
        prefix + ".", source);
    LinkProfile l;
    l.bandwidth = number(*t, "bandwidth", prefix + ".bandwidth", source, true, 0);
    l.latency = number(*t, "latency", prefix + ".latency", source, true, 0);
    // Files written before calibrate measured it: the latency (an idle node's).
    l.collective_overhead = number(*t, "collective_overhead", prefix + ".collective_overhead",
                                   source, false, l.latency);
    l.collective_bandwidth = number(*t, "collective_bandwidth", prefix + ".collective_bandwidth",
                                    source, false, l.bandwidth);
    l.reduce_scatter_bandwidth =
        number(*t, "reduce_scatter_bandwidth", prefix + ".reduce_scatter_bandwidth", source, false,
               l.collective_bandwidth);
    l.all_reduce_bandwidth = number(*t, "all_reduce_bandwidth", prefix + ".all_reduce_bandwidth",
                                    source, false, l.collective_bandwidth);
    l.exchange_bandwidth = number(*t, "exchange_bandwidth", prefix + ".exchange_bandwidth", source,
                                  false, l.bandwidth);
    l.bidirectional_bandwidth =
        number(*t, "bidirectional_bandwidth", prefix + ".bidirectional_bandwidth", source, false,
               l.exchange_bandwidth);
    // The ring's figures (files written before it lack them: not measured).
    l.ring_reduce_scatter_bandwidth =
        number(*t, "ring_reduce_scatter_bandwidth", prefix + ".ring_reduce_scatter_bandwidth",
               source, false, 0.0);
    l.ring_all_reduce_bandwidth = number(*t, "ring_all_reduce_bandwidth",
                                         prefix + ".ring_all_reduce_bandwidth", source, false, 0.0);
    l.ring_reduce_scatter_from =
        number(*t, "ring_reduce_scatter_from", prefix + ".ring_reduce_scatter_from", source, false,
               l.ring_reduce_scatter_from);
    l.ring_all_reduce_from = number(*t, "ring_all_reduce_from", prefix + ".ring_all_reduce_from",
                                    source, false, l.ring_all_reduce_from);
    for (const double v : {l.ring_reduce_scatter_bandwidth, l.ring_all_reduce_bandwidth,
                           l.ring_reduce_scatter_from, l.ring_all_reduce_from}) {
      if (!(v >= 0.0)) {
        MESHTRAIN_BAD_INPUT(at(source, t), ": hardware profile table ", prefix,
                            " has a negative or NaN ring_* value");
      }
    }
    p.links[axis] = l;
  }
  check_hardware_profile(p);
  return p;
}

HardwareProfile read_hardware_profile(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    MESHTRAIN_BAD_INPUT("hardware profile '", path, "' does not exist or is not a file");
  }
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  if (!in) MESHTRAIN_BAD_INPUT("cannot read hardware profile '", path, "': ", std::strerror(errno));
  return parse_hardware_profile(text.str(), path);
}

std::string hardware_profile_to_toml(const HardwareProfile& p, const std::string& measured) {
  std::ostringstream out;
  out << "# meshtrain hardware profile (meshtrain plan CONFIG --hardware FILE)\n"
      << "gemm_flops = " << number_text(p.gemm_flops) << "  # FLOP/s per rank\n"
      << "memory_bandwidth = " << number_text(p.memory_bandwidth)
      << "  # B/s per rank, read + written\n"
      << "overlap = " << number_text(p.overlap)
      << "  # 0..1: share of a transfer hidden under a GEMM it runs beside\n"
      << "storage_read_bandwidth = " << number_text(p.storage_read_bandwidth)
      << "  # B/s per rank reading data files sequentially (not measured: set from fio or dd)\n"
      << "storage_read_latency = " << number_text(p.storage_read_latency)
      << "  # s per random read of a data file (not measured)\n"
      << "hdf5_row_seconds = " << number_text(p.hdf5_row_seconds)
      << "  # s per row of a batch from an HDF5 file's cached chunks (a DLRM's dense read)"
      << (p.hdf5_row_seconds == kHdf5RowSeconds && p.sparse_row_seconds == 0.0
              ? " (an estimate, not measured: calibrate CONFIG of a DLRM measures it)"
              : "")
      << "\n";
  if (p.sparse_row_seconds > 0.0) {
    out << "sparse_row_seconds = " << number_text(p.sparse_row_seconds)
        << "  # s the sparse reader spends per row and table (offsets, checks, copy)\n"
        << "sparse_id_seconds = " << number_text(p.sparse_id_seconds)
        << "  # s the sparse reader spends per id\n";
  }
  for (const auto& axis : hardware_axes()) {
    const LinkProfile& l = p.link(axis);
    out << "\n[links." << axis << "]\n"
        << "bandwidth = " << number_text(l.bandwidth) << "  # B/s point to point\n"
        << "latency = " << number_text(l.latency) << "  # s\n"
        << "collective_overhead = " << number_text(l.collective_overhead)
        << "  # s a small collective costs a step (entered after each rank's own compute)\n"
        << "collective_bandwidth = " << number_text(l.collective_bandwidth)
        << "  # B/s per rank in an all-gather\n"
        << "reduce_scatter_bandwidth = " << number_text(l.reduce_scatter_bandwidth)
        << "  # B/s per rank in a reduce-scatter\n"
        << "all_reduce_bandwidth = " << number_text(l.all_reduce_bandwidth)
        << "  # B/s per rank in an all-reduce (2 (p-1)/p bytes moved)\n"
        << "exchange_bandwidth = " << number_text(l.exchange_bandwidth)
        << "  # B/s per rank of a ring hop (send and receive at once)\n"
        << "bidirectional_bandwidth = " << number_text(l.bidirectional_bandwidth)
        << "  # B/s per rank of a bidirectional hop (halves both ways)\n";
    if (l.ring_measured()) {
      out << "ring_reduce_scatter_bandwidth = " << number_text(l.ring_reduce_scatter_bandwidth)
          << "  # B/s per rank in meshtrain's ring reduce-scatter\n"
          << "ring_all_reduce_bandwidth = " << number_text(l.ring_all_reduce_bandwidth)
          << "  # B/s per rank in meshtrain's ring all-reduce\n";
      if (std::isfinite(l.ring_reduce_scatter_from)) {
        out << "ring_reduce_scatter_from = " << number_text(l.ring_reduce_scatter_from)
            << "  # bytes per rank from which the ring was faster\n";
      }
      if (std::isfinite(l.ring_all_reduce_from)) {
        out << "ring_all_reduce_from = " << number_text(l.ring_all_reduce_from)
            << "  # bytes per rank from which the ring was faster\n";
      }
    }
  }
  for (const GemmRate& r : p.gemm_rates) {
    const GemmShape& g = r.shape;
    out << "\n[[gemm]]  # FLOP/s of one GEMM shape: op(A) [m x k] @ op(B) [k x n]\n"
        << "shape = [" << g.m << ", " << g.k << ", " << g.n << "]\n"
        << "transpose = \"" << (g.transpose_a ? "T" : "N") << (g.transpose_b ? "T" : "N") << "\"\n"
        << "flops = " << number_text(r.flops) << "\n";
  }
  if (!p.elementwise_rates.empty()) {
    out << "\n[elementwise]  # elements/s of elementwise kernels, measured at the step's shape\n";
    for (const auto& [kernel, rate] : p.elementwise_rates) {
      out << kernel << " = " << number_text(rate) << "\n";
    }
  }
  if (!measured.empty()) out << "\n[measured]\n" << measured;
  return out.str();
}

}  // namespace meshtrain
