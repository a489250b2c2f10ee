#include "partition/hardware.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "base/error.hpp"
#include "base/text.hpp"

namespace meshtrain {

const std::vector<std::string>& hardware_axes() {
  static const std::vector<std::string> axes = {"dp", "fsdp", "ep", "tp", "sp"};
  return axes;
}

const LinkProfile& HardwareProfile::link(const std::string& axis) const {
  const auto it = links.find(axis);
  if (it == links.end()) {
    MESHTRAIN_BAD_INPUT("the hardware profile (", source, ") has no link for mesh axis '", axis,
                        "'");
  }
  return it->second;
}

bool GemmShape::operator<(const GemmShape& o) const {
  return std::tie(m, k, n, transpose_a, transpose_b) <
         std::tie(o.m, o.k, o.n, o.transpose_a, o.transpose_b);
}

std::string to_string(const GemmShape& s) {
  return std::string(s.transpose_a ? "T" : "N") + (s.transpose_b ? "T" : "N") + " " +
         std::to_string(s.m) + " x " + std::to_string(s.k) + " x " + std::to_string(s.n);
}

double HardwareProfile::gemm_seconds(const GemmShape& shape) const {
  if (shape.m <= 0 || shape.k <= 0 || shape.n <= 0) return 0.0;
  double best = std::numeric_limits<double>::infinity(), rate = gemm_flops;
  for (const GemmRate& r : gemm_rates) {
    const GemmShape& g = r.shape;
    if (g.transpose_a != shape.transpose_a || g.transpose_b != shape.transpose_b) continue;
    auto ratio = [](int64_t a, int64_t b) {
      return std::abs(std::log(static_cast<double>(a) / static_cast<double>(b)));
    };
    const double m = ratio(g.m, shape.m), k = ratio(g.k, shape.k), n = ratio(g.n, shape.n);
    const double distance = m + k + n;
    if (std::max({m, k, n}) <= std::log(2.0) + 1e-12 && distance < best) {
      best = distance;
      rate = r.flops;
    }
  }
  return shape.flops() / rate;
}

LinkProfile HardwareProfile::group_link(const std::vector<std::string>& axes) const {
  if (axes.empty()) {
    const double inf = std::numeric_limits<double>::infinity();
    return {inf, 0.0, inf, inf, inf, inf, inf};
  }
  LinkProfile slowest = link(axes.front());
  for (const auto& axis : axes) {
    const LinkProfile& l = link(axis);
    slowest.bandwidth = std::min(slowest.bandwidth, l.bandwidth);
    slowest.collective_bandwidth = std::min(slowest.collective_bandwidth, l.collective_bandwidth);
    slowest.exchange_bandwidth = std::min(slowest.exchange_bandwidth, l.exchange_bandwidth);
    slowest.bidirectional_bandwidth =
        std::min(slowest.bidirectional_bandwidth, l.bidirectional_bandwidth);
    slowest.reduce_scatter_bandwidth =
        std::min(slowest.reduce_scatter_bandwidth, l.reduce_scatter_bandwidth);
    slowest.all_reduce_bandwidth = std::min(slowest.all_reduce_bandwidth, l.all_reduce_bandwidth);
    slowest.ring_reduce_scatter_bandwidth =
        std::min(slowest.ring_reduce_scatter_bandwidth, l.ring_reduce_scatter_bandwidth);
    slowest.ring_all_reduce_bandwidth =
        std::min(slowest.ring_all_reduce_bandwidth, l.ring_all_reduce_bandwidth);
    slowest.ring_reduce_scatter_from =
        std::max(slowest.ring_reduce_scatter_from, l.ring_reduce_scatter_from);
    slowest.ring_all_reduce_from = std::max(slowest.ring_all_reduce_from, l.ring_all_reduce_from);
    slowest.latency = std::max(slowest.latency, l.latency);
    slowest.collective_overhead = std::max(slowest.collective_overhead, l.collective_overhead);
  }
  return slowest;
}

void select_reduction_rates(HardwareProfile& profile, bool ring, bool library) {
  for (auto& [axis, link] : profile.links) {
    if (!link.ring_measured() || !ring) continue;
    link.reduce_scatter_bandwidth =
        library ? std::max(link.reduce_scatter_bandwidth, link.ring_reduce_scatter_bandwidth)
                : link.ring_reduce_scatter_bandwidth;
    link.all_reduce_bandwidth =
        library ? std::max(link.all_reduce_bandwidth, link.ring_all_reduce_bandwidth)
                : link.ring_all_reduce_bandwidth;
  }
}

HardwareProfile default_hardware_profile() {
  HardwareProfile p;
  p.gemm_flops = 100e9;
  p.memory_bandwidth = 10e9;
  p.overlap = 0.0;
  for (const auto& axis : hardware_axes()) {
    p.links[axis] = LinkProfile{5e9, 2e-6, 2.5e9, 2.5e9, 2.5e9, 2.5e9, 2.5e9};
    p.links[axis].collective_overhead = 2e-6;  // an idle node's: the latency
  }
  p.source = "defaults";
  return p;
}

namespace {
void check_value(const HardwareProfile& p, const std::string& key, double value, bool zero_ok) {
  if (!std::isfinite(value) || value < 0.0 || (!zero_ok && value == 0.0)) {
    MESHTRAIN_BAD_INPUT(p.source, ": ", key, " = ", value, " must be a finite number ",
                        zero_ok ? "of 0 or more" : "above 0");
  }
}
}  // namespace

const std::vector<std::string>& elementwise_kernel_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> all;
    for (const char* f : {"relu", "tanh", "gelu", "gelu_erf", "silu", "sigmoid", "swiglu"}) {
      all.push_back(std::string(f) + "_forward");
      all.push_back(std::string(f) + "_backward");
    }
    all.push_back("dlrm_dot_forward");  // a DLRM's dot interaction (layers/dlrm.hpp)
    all.push_back("dlrm_dot_backward");
    return all;
  }();
  return names;
}

void check_hardware_profile(const HardwareProfile& p) {
  check_value(p, "gemm_flops", p.gemm_flops, false);
  for (const GemmRate& r : p.gemm_rates) {
    if (r.shape.m <= 0 || r.shape.k <= 0 || r.shape.n <= 0) {
      MESHTRAIN_BAD_INPUT(p.source, ": gemm shape ", to_string(r.shape),
                          " must have positive extents");
    }
    check_value(p, "the flops of gemm shape " + to_string(r.shape), r.flops, false);
  }
  check_value(p, "memory_bandwidth", p.memory_bandwidth, false);
  const std::vector<std::string>& kernels = elementwise_kernel_names();
  for (const auto& [kernel, rate] : p.elementwise_rates) {
    if (std::find(kernels.begin(), kernels.end(), kernel) == kernels.end()) {
      MESHTRAIN_BAD_INPUT(p.source, ": elementwise.", kernel, " names no elementwise kernel (",
                          join(kernels), ")");
    }
    check_value(p, "elementwise." + kernel, rate, false);
  }
  check_value(p, "overlap", p.overlap, true);
  check_value(p, "storage_read_bandwidth", p.storage_read_bandwidth, false);
  check_value(p, "storage_read_latency", p.storage_read_latency, true);
  check_value(p, "hdf5_row_seconds", p.hdf5_row_seconds, false);
  check_value(p, "sparse_row_seconds", p.sparse_row_seconds, true);
  check_value(p, "sparse_id_seconds", p.sparse_id_seconds, true);
  if (p.overlap > 1.0) {
    MESHTRAIN_BAD_INPUT(p.source, ": overlap = ", p.overlap, " must be between 0 and 1");
  }
  for (const auto& axis : hardware_axes()) {
    const auto it = p.links.find(axis);
    if (it == p.links.end()) {
      MESHTRAIN_BAD_INPUT(p.source, ": [links.", axis, "] is missing (every axis of ",
                          "dp, fsdp, ep, tp, sp needs bandwidth and latency)");
    }
    const std::string key = "links." + axis + ".";
    check_value(p, key + "bandwidth", it->second.bandwidth, false);
    check_value(p, key + "latency", it->second.latency, true);
    check_value(p, key + "collective_overhead", it->second.collective_overhead, true);
    check_value(p, key + "collective_bandwidth", it->second.collective_bandwidth, false);
    check_value(p, key + "exchange_bandwidth", it->second.exchange_bandwidth, false);
    check_value(p, key + "bidirectional_bandwidth", it->second.bidirectional_bandwidth, false);
    check_value(p, key + "reduce_scatter_bandwidth", it->second.reduce_scatter_bandwidth, false);
    check_value(p, key + "all_reduce_bandwidth", it->second.all_reduce_bandwidth, false);
  }
}

}  // namespace meshtrain
