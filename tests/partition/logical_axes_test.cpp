#include "partition/logical_axes.hpp"

#include <gtest/gtest.h>

#include "tests/support/expect_error.hpp"

namespace meshtrain {
namespace {

using testing::expect_bad_input;
using V = std::vector<std::string>;

TEST(LogicalAxes, DefaultsFollowTheReference) {
  const LogicalAxes axes;
  EXPECT_EQ(axes.axes_of("batch"), (V{"fsdp", "dp"}));
  EXPECT_EQ(axes.axes_of("sequence"), (V{"sp"}));
  EXPECT_EQ(axes.axes_of("hidden"), (V{"tp"}));
  EXPECT_EQ(axes.axes_of("mlp_intermediate"), (V{"tp"}));
  EXPECT_EQ(axes.axes_of("expert"), (V{"ep"}));
  EXPECT_EQ(axes.axes_of("attention_dim"), V{});
  for (const auto& name : LogicalAxes::names()) EXPECT_NO_THROW(axes.axes_of(name)) << name;
}

TEST(LogicalAxes, OverridesReplaceOnlyTheirKeys) {
  const LogicalAxes axes = LogicalAxes::with_overrides({{"batch", {"dp"}}, {"hidden", {}}});
  EXPECT_EQ(axes.axes_of("batch"), (V{"dp"}));
  EXPECT_EQ(axes.axes_of("hidden"), V{});
  EXPECT_EQ(axes.axes_of("mlp_intermediate"), (V{"tp"}));
}

TEST(LogicalAxes, SpecsFromLogicalDims) {
  const LogicalAxes axes;
  EXPECT_EQ(axes.spec({"batch", "hidden"}).to_string(), "P((fsdp, dp), tp)");
  EXPECT_EQ(axes.spec({"batch", "", "None"}).to_string(), "P((fsdp, dp), None, None)");
  EXPECT_EQ(axes.spec({"hidden", "attention_dim"}).to_string(), "P(tp, None)");
  expect_bad_input(
      [&] {
        axes.spec({"hidden", "mlp_intermediate"});
      },
      {"'tp'", "twice", "mlp_intermediate"});
}

TEST(LogicalAxes, ErrorsNameTheWrongThing) {
  expect_bad_input(
      [] {
        LogicalAxes::with_overrides({{"batchh", {"dp"}}});
      },
      {"[partition.logical_axes]", "'batchh'", "batch"});
  expect_bad_input(
      [] {
        LogicalAxes::with_overrides({{"batch", {"data"}}}, "run.toml");
      },
      {"run.toml", "'batch'", "'data'"});
  expect_bad_input(
      [] {
        LogicalAxes::with_overrides({{"batch", {"dp", "dp"}}});
      },
      {"'batch'", "'dp'", "twice"});
  expect_bad_input([] { LogicalAxes().axes_of("heads"); }, {"'heads'"});
}

}  // namespace
}  // namespace meshtrain
