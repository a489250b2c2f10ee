// The hardware profile's TOML file (framework/train/hardware_file.hpp): what calibrate
// writes reads back the same, and bad files are one sentence naming the file and the key.
#include "framework/train/hardware_file.hpp"

#include <gtest/gtest.h>

#include <cmath>

#include "base/error.hpp"

namespace meshtrain {
namespace {

HardwareProfile measured_profile() {
  HardwareProfile p = default_hardware_profile();
  p.source = "measured.toml";
  p.gemm_flops = 91234567890.0;
  p.memory_bandwidth = 6.25e9;
  p.overlap = 0.125;
  p.storage_read_bandwidth = 3.5e8;
  p.storage_read_latency = 2.5e-3;
  p.hdf5_row_seconds = 1.25e-5;  // calibrate CONFIG's of a DLRM's data read
  p.sparse_row_seconds = 7.5e-8;
  p.sparse_id_seconds = 2.5e-8;
  p.links["fsdp"] =
      LinkProfile{3.75e7, 2.5e-4, 3.5e7, 1.9e7, 2.1e7, 1.2e7, 1.7e7};  // a 300 Mbit/s link
  p.links["tp"] = LinkProfile{4.1e9, 1.9e-6, 2.2e9, 1.5e9, 1.25e9, 6.5e8, 9e8};
  p.links["fsdp"].collective_overhead = 1.25e-3;  // calibrate's, after compute on every rank
  p.gemm_rates = {{{128, 2048, 1024, false, false}, 8.125e10},
                  {{2048, 128, 10, true, false}, 1.5e10}};
  p.elementwise_rates = {{"swiglu_forward", 3.125e8}, {"swiglu_backward", 2.5e8}};
  return p;
}

TEST(HardwareFile, RoundTrips) {
  const HardwareProfile p = measured_profile();
  const std::string text = hardware_profile_to_toml(p, "ranks = 2\nmesh = \"2 (fsdp=2)\"\n");
  const HardwareProfile back = parse_hardware_profile(text, "measured.toml");
  // Written with 6 significant digits.
  EXPECT_NEAR(back.gemm_flops, p.gemm_flops, 1e-5 * p.gemm_flops);
  EXPECT_DOUBLE_EQ(back.memory_bandwidth, p.memory_bandwidth);
  EXPECT_DOUBLE_EQ(back.overlap, p.overlap);
  EXPECT_DOUBLE_EQ(back.storage_read_bandwidth, p.storage_read_bandwidth);
  EXPECT_DOUBLE_EQ(back.storage_read_latency, p.storage_read_latency);
  EXPECT_DOUBLE_EQ(back.hdf5_row_seconds, p.hdf5_row_seconds);
  EXPECT_DOUBLE_EQ(back.sparse_row_seconds, p.sparse_row_seconds);
  EXPECT_DOUBLE_EQ(back.sparse_id_seconds, p.sparse_id_seconds);
  for (const auto& axis : hardware_axes()) {
    EXPECT_DOUBLE_EQ(back.link(axis).bandwidth, p.link(axis).bandwidth) << axis;
    EXPECT_DOUBLE_EQ(back.link(axis).latency, p.link(axis).latency) << axis;
    EXPECT_DOUBLE_EQ(back.link(axis).collective_overhead, p.link(axis).collective_overhead) << axis;
    EXPECT_DOUBLE_EQ(back.link(axis).collective_bandwidth, p.link(axis).collective_bandwidth)
        << axis;
    EXPECT_DOUBLE_EQ(back.link(axis).exchange_bandwidth, p.link(axis).exchange_bandwidth) << axis;
    EXPECT_DOUBLE_EQ(back.link(axis).reduce_scatter_bandwidth,
                     p.link(axis).reduce_scatter_bandwidth)
        << axis;
    EXPECT_DOUBLE_EQ(back.link(axis).all_reduce_bandwidth, p.link(axis).all_reduce_bandwidth)
        << axis;
    EXPECT_DOUBLE_EQ(back.link(axis).bidirectional_bandwidth, p.link(axis).bidirectional_bandwidth)
        << axis;
  }
  ASSERT_EQ(back.gemm_rates.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(back.gemm_rates[i].shape, p.gemm_rates[i].shape) << to_string(p.gemm_rates[i].shape);
    EXPECT_DOUBLE_EQ(back.gemm_rates[i].flops, p.gemm_rates[i].flops);
  }
  EXPECT_EQ(back.elementwise_rates, p.elementwise_rates);
  EXPECT_EQ(back.source, "measured.toml");
  // A profile written before [elementwise] existed reads back without rates.
  HardwareProfile old = p;
  old.elementwise_rates.clear();
  EXPECT_TRUE(parse_hardware_profile(hardware_profile_to_toml(old, ""), "old.toml")
                  .elementwise_rates.empty());
}

TEST(HardwareFile, CollectiveBandwidthDefaultsToBandwidth) {
  std::string text = "gemm_flops = 1e11\nmemory_bandwidth = 1e10\n";
  for (const auto& axis : hardware_axes()) {
    text += "[links." + axis +
            "]\nbandwidth = 5e9\nlatency = " + std::string(axis == "dp" ? "3e-6" : "0") + "\n";
  }
  const HardwareProfile p = parse_hardware_profile(text, "hand.toml");
  // Written before calibrate measured collective_overhead: the latency (an idle node's).
  EXPECT_DOUBLE_EQ(p.link("dp").collective_overhead, 3e-6);
  EXPECT_DOUBLE_EQ(p.link("sp").collective_overhead, 0.0);
  EXPECT_DOUBLE_EQ(p.link("sp").collective_bandwidth, 5e9);
  EXPECT_DOUBLE_EQ(p.link("sp").exchange_bandwidth, 5e9);
  EXPECT_DOUBLE_EQ(p.link("sp").reduce_scatter_bandwidth, 5e9);
  EXPECT_DOUBLE_EQ(p.link("sp").all_reduce_bandwidth, 5e9);
  EXPECT_DOUBLE_EQ(p.link("sp").bidirectional_bandwidth, 5e9);
  EXPECT_DOUBLE_EQ(p.link("sp").latency, 0.0);
  EXPECT_DOUBLE_EQ(p.overlap, 0.0);  // an older profile: no overlap
  // ... and no storage: the defaults' local SSD.
  EXPECT_DOUBLE_EQ(p.storage_read_bandwidth, default_hardware_profile().storage_read_bandwidth);
  EXPECT_DOUBLE_EQ(p.storage_read_latency, default_hardware_profile().storage_read_latency);
  // ... and no data-read figures: the estimate kHdf5RowSeconds per dense row, the sparse reader
  // not measured (0: at memory bandwidth), as before calibrate measured them.
  EXPECT_DOUBLE_EQ(p.hdf5_row_seconds, kHdf5RowSeconds);
  EXPECT_DOUBLE_EQ(p.sparse_row_seconds, 0.0);
  EXPECT_DOUBLE_EQ(p.sparse_id_seconds, 0.0);
  // Not measured is not written: the file reads back the same.
  const HardwareProfile back = parse_hardware_profile(hardware_profile_to_toml(p), "hand.toml");
  EXPECT_DOUBLE_EQ(back.sparse_row_seconds, 0.0);
  EXPECT_DOUBLE_EQ(back.hdf5_row_seconds, kHdf5RowSeconds);
}

// The ring's keys (calibrate measures meshtrain's ring against the library): written only
// where measured, read back; a profile without them (older) has none measured, and
// select_reduction_rates then keeps the library's rates.
TEST(HardwareFile, RingReductionsRoundTripAndOldFilesLoad) {
  HardwareProfile p = measured_profile();
  LinkProfile& fsdp = p.links["fsdp"];
  fsdp.ring_reduce_scatter_bandwidth = 4.5e7;
  fsdp.ring_all_reduce_bandwidth = 1.0e7;  // slower than the library's 1.7e7
  fsdp.ring_reduce_scatter_from = 65536;   // all_reduce: never (infinite, not written)
  const std::string text = hardware_profile_to_toml(p);
  EXPECT_EQ(text.find("ring_all_reduce_from"), std::string::npos) << text;
  const HardwareProfile back = parse_hardware_profile(text, "measured.toml");
  const LinkProfile& l = back.link("fsdp");
  ASSERT_TRUE(l.ring_measured());
  EXPECT_DOUBLE_EQ(l.ring_reduce_scatter_bandwidth, 4.5e7);
  EXPECT_DOUBLE_EQ(l.ring_all_reduce_bandwidth, 1.0e7);
  EXPECT_DOUBLE_EQ(l.ring_reduce_scatter_from, 65536);
  EXPECT_TRUE(std::isinf(l.ring_all_reduce_from));
  EXPECT_FALSE(back.link("tp").ring_measured());
  // A group runs the ring only where every axis measured it: tp did not.
  EXPECT_FALSE(back.group_link({"fsdp", "tp"}).ring_measured());

  // The chosen algorithm's rates: ring only, library only, the faster of the two.
  HardwareProfile ring = back, library = back, faster = back;
  select_reduction_rates(ring, true, false);
  select_reduction_rates(library, false, true);
  select_reduction_rates(faster, true, true);
  EXPECT_DOUBLE_EQ(ring.link("fsdp").reduce_scatter_bandwidth, 4.5e7);
  EXPECT_DOUBLE_EQ(ring.link("fsdp").all_reduce_bandwidth, 1.0e7);
  EXPECT_DOUBLE_EQ(library.link("fsdp").reduce_scatter_bandwidth, 1.2e7);
  EXPECT_DOUBLE_EQ(faster.link("fsdp").reduce_scatter_bandwidth, 4.5e7);
  EXPECT_DOUBLE_EQ(faster.link("fsdp").all_reduce_bandwidth, 1.7e7);
  EXPECT_DOUBLE_EQ(ring.link("tp").reduce_scatter_bandwidth, 6.5e8);  // not measured: library

  // An older file (no ring keys) loads with nothing measured.
  std::string old_text = "gemm_flops = 1e11\nmemory_bandwidth = 1e10\n";
  for (const auto& axis : hardware_axes()) {
    old_text += "[links." + axis + "]\nbandwidth = 5e9\nlatency = 0\n";
  }
  EXPECT_FALSE(parse_hardware_profile(old_text, "old.toml").link("dp").ring_measured());
}

// One sentence naming the file and the key.
void expect_rejected(const std::string& text, const std::string& key) {
  try {
    parse_hardware_profile(text, "bad.toml");
    FAIL() << "accepted:\n" << text;
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_EQ(e.kind(), ErrorKind::bad_input);
    EXPECT_NE(message.find("bad.toml"), std::string::npos) << message;
    EXPECT_NE(message.find(key), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
}

TEST(HardwareFile, BadFilesNameFileAndKey) {
  const std::string good = hardware_profile_to_toml(measured_profile());
  auto replaced = [&](const std::string& from, const std::string& to) {
    std::string text = good;
    const size_t at = text.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return text.replace(at, from.size(), to);
  };
  expect_rejected(replaced("gemm_flops = ", "gemm_flop = "), "gemm_flop");
  expect_rejected(replaced("gemm_flops = 9.12346e+10", "gemm_flops = \"fast\""), "gemm_flops");
  expect_rejected(replaced("gemm_flops = 9.12346e+10", "gemm_flops = -1.0"), "gemm_flops");
  expect_rejected(replaced("[links.tp]\nbandwidth = 4.1e+09", "[links.tp]\nbandwidth = 0"),
                  "links.tp.bandwidth");
  expect_rejected(replaced("[links.sp]", "[links.pp]"), "links.pp");
  expect_rejected(replaced("latency = 0.00025", "latncy = 0.00025"), "links.fsdp.latncy");
  expect_rejected(replaced("[links.dp]\nbandwidth = 5e+09", "[links.dp]\n"), "links.dp.bandwidth");
  expect_rejected("gemm_flops = 1e11\nmemory_bandwidth = 1e10\n", "links.dp");
  expect_rejected("gemm_flops = [1", "bad.toml:1");
  expect_rejected(replaced("overlap = 0.125", "overlap = 1.5"), "overlap");
  expect_rejected(replaced("storage_read_bandwidth = 3.5e+08", "storage_read_bandwidth = 0"),
                  "storage_read_bandwidth");
  expect_rejected(replaced("storage_read_latency = 0.0025", "storage_read_latency = -1"),
                  "storage_read_latency");
  expect_rejected(replaced("hdf5_row_seconds = 1.25e-05", "hdf5_row_seconds = 0"),
                  "hdf5_row_seconds");
  expect_rejected(replaced("hdf5_row_seconds = 1.25e-05", "hdf5_row_seconds = \"slow\""),
                  "hdf5_row_seconds");
  expect_rejected(replaced("sparse_row_seconds = 7.5e-08", "sparse_row_seconds = -7.5e-08"),
                  "sparse_row_seconds");
  expect_rejected(replaced("sparse_id_seconds = 2.5e-08", "sparse_id_seconds = inf"),
                  "sparse_id_seconds");
  expect_rejected(replaced("sparse_id_seconds = 2.5e-08", "sparse_ids_seconds = 2.5e-08"),
                  "sparse_ids_seconds");
  // A per-id figure without the per-row one (missing or 0) would be ignored by the model and
  // dropped on a rewrite: refused, naming both keys.
  for (const std::string& row : {"", "sparse_row_seconds = 0"}) {
    for (const std::string key : {"sparse_id_seconds", "sparse_row_seconds"}) {
      expect_rejected(replaced("sparse_row_seconds = 7.5e-08", row), key);
    }
  }
  expect_rejected(replaced("collective_overhead = 0.00125", "collective_overhead = -0.001"),
                  "links.fsdp.collective_overhead");
  expect_rejected(replaced("collective_overhead = 0.00125", "collective_overhead = \"slow\""),
                  "links.fsdp.collective_overhead");
  expect_rejected(replaced("collective_overhead = 0.00125", "collective_overhead = nan"),
                  "links.fsdp.collective_overhead");
  expect_rejected(replaced("collective_overhead = 0.00125", "colective_overhead = 0.00125"),
                  "links.fsdp.colective_overhead");
  expect_rejected(replaced("exchange_bandwidth = 1.9e+07", "exchange_bandwidth = 0"),
                  "links.fsdp.exchange_bandwidth");
  expect_rejected(replaced("shape = [128, 2048, 1024]", "shape = [128, 2048]"), "gemm.shape");
  expect_rejected(replaced("shape = [128, 2048, 1024]", "shape = [128, 0, 1024]"), "gemm.shape");
  expect_rejected(replaced("transpose = \"TN\"", "transpose = \"TX\""), "gemm.transpose");
  expect_rejected(replaced("flops = 8.125e+10", "flops = -8.0"), "gemm shape NN 128 x 2048 x 1024");
  expect_rejected(replaced("flops = 8.125e+10", "flop = 8.0"), "gemm.flop");
  expect_rejected(replaced("[[gemm]]", "[gemm]"), "gemm");
  expect_rejected(replaced("swiglu_forward = 3.125e+08", "swiglu_forwrd = 3.125e+08"),
                  "elementwise.swiglu_forwrd");
  expect_rejected(replaced("swiglu_forward = 3.125e+08", "swiglu_forward = 0"),
                  "elementwise.swiglu_forward");
  expect_rejected(replaced("swiglu_forward = 3.125e+08", "swiglu_forward = \"fast\""),
                  "elementwise.swiglu_forward");
}

TEST(HardwareFile, MissingFileIsBadInput) {
  try {
    read_hardware_profile("/nonexistent/hardware.toml");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::bad_input);
    EXPECT_NE(std::string(e.what()).find("/nonexistent/hardware.toml"), std::string::npos);
  }
}

}  // namespace
}  // namespace meshtrain
