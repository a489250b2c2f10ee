// [model] kind = "dlrm" (docs/recsys.md): its keys read, written back and checked, each refusal
// one sentence naming the file, the line or key and the value.

#include <gtest/gtest.h>

#include <string>
#include <utility>

#include "framework/train/config.hpp"
#include "tests/support/expect_error.hpp"

namespace meshtrain {
namespace {

using testing::expect_bad_input;

// Lines 1-16; `model_extra` goes after line 6 (interaction), `extra` at the end.
std::string dlrm(const std::string& model_extra = "", const std::string& extra = "") {
  return "[model]\n"
         "kind = \"dlrm\"\n"
         "bottom = [13, 32, 8]\n"
         "top = [14, 16, 1]\n"
         "loss = \"binary_cross_entropy\"\n"
         "interaction = \"dot\"\n" +
         model_extra +
         "[[model.tables]]\n"
         "name = \"t00\"\n"
         "rows = 10\n"
         "[[model.tables]]\n"
         "name = \"t01\"\n"
         "rows = 1000\n"
         "pooling = \"mean\"\n"
         "dim = 8\n"
         "[[model.tables]]\n"
         "name = \"t02\"\n"
         "rows = 50\n"
         "[data]\n"
         "source = \"hdf5\"\n"
         "path = \"data/recsys/train.h5\"\n"
         "x_key = \"/dense\"\n"
         "y_key = \"/label\"\n"
         "[train]\n"
         "steps = 5\n" +
         extra;
}

RunConfig parse(const std::string& text, const std::vector<std::string>& overrides = {}) {
  return parse_config(text, "t.toml", overrides);
}

void expect_config_error(const std::string& text, std::initializer_list<std::string> fragments,
                         const std::vector<std::string>& overrides = {}) {
  SCOPED_TRACE(text);
  expect_bad_input([&] { parse(text, overrides); }, fragments);
}

TEST(DlrmConfig, ReadsTheModelAndItsData) {
  const RunConfig c = parse(dlrm());
  EXPECT_EQ(c.model.kind, ModelKind::dlrm);
  EXPECT_EQ(c.model.bottom, (std::vector<int64_t>{13, 32, 8}));
  EXPECT_EQ(c.model.top, (std::vector<int64_t>{14, 16, 1}));
  EXPECT_EQ(c.model.interaction, DlrmInteraction::dot);
  ASSERT_EQ(c.model.tables.size(), 3u);
  EXPECT_EQ(c.model.tables[1].name, "t01");
  EXPECT_EQ(c.model.tables[1].rows, 1000);
  EXPECT_EQ(c.model.tables[1].pooling, EmbeddingPooling::mean);
  EXPECT_EQ(c.model.tables[0].pooling, EmbeddingPooling::sum);
  EXPECT_EQ(c.model.tables[0].dim, 0);  // unset: bottom's last size
  const DlrmShape shape = c.model.dlrm();
  EXPECT_EQ(shape.tables[0].dim, 8);
  EXPECT_EQ(dlrm_interaction_width(shape), 8 + 3 * 4 / 2);
  EXPECT_EQ(c.data.x_key, "/dense");
  EXPECT_EQ(c.data.y_key, "/label");
  EXPECT_EQ(c.data.sparse_key, "/sparse");
  EXPECT_EQ(c.model.input_width(), 13);
  EXPECT_EQ(c.model.output_width(), 1);
  // The parameters the plan and checkpoints see.
  const std::vector<ParameterShape> shapes = model_parameter_shapes(c.model);
  ASSERT_EQ(shapes.size(), 4u + 3u + 4u);
  EXPECT_EQ(shapes[0].name, "bottom/0/weight");
  EXPECT_EQ(shapes[4].name, "embeddings/t00/weight");
  EXPECT_EQ(shapes[5].shape, (std::vector<int64_t>{1000, 8}));
  EXPECT_EQ(shapes[7].name, "top/0/weight");
  EXPECT_EQ(shapes[7].shape, (std::vector<int64_t>{14, 16}));
  // The loss defaults to binary cross-entropy.
  std::string text = dlrm();
  text.erase(text.find("loss = \"binary_cross_entropy\"\n"), 30);
  EXPECT_EQ(parse(text).model.loss, LossKind::binary_cross_entropy);
  // cat: the features side by side.
  const RunConfig cat = parse(dlrm(), {"model.interaction=\"cat\"", "model.top=[32, 16, 1]"});
  EXPECT_EQ(cat.model.interaction, DlrmInteraction::cat);
  const RunConfig sparse = parse(dlrm(), {"data.sparse_key=cats"});
  EXPECT_EQ(sparse.data.sparse_key, "/cats");
}

TEST(DlrmConfig, WritesBackTheSameValues) {
  const RunConfig a = parse(dlrm(), {"data.sparse_key=\"/cats\""});
  const RunConfig b = parse(config_to_toml(a));
  EXPECT_EQ(b.model.kind, a.model.kind);
  EXPECT_EQ(b.model.bottom, a.model.bottom);
  EXPECT_EQ(b.model.top, a.model.top);
  EXPECT_EQ(b.model.interaction, a.model.interaction);
  ASSERT_EQ(b.model.tables.size(), a.model.tables.size());
  for (size_t i = 0; i < a.model.tables.size(); ++i) {
    EXPECT_EQ(b.model.tables[i].name, a.model.tables[i].name);
    EXPECT_EQ(b.model.tables[i].rows, a.model.tables[i].rows);
    EXPECT_EQ(b.model.tables[i].dim, a.model.tables[i].dim);
    EXPECT_EQ(b.model.tables[i].pooling, a.model.tables[i].pooling);
  }
  EXPECT_EQ(b.data.sparse_key, "/cats");
}

// optimizer.embeddings (docs/recsys.md, "Sparse updates"): dense by default; the sparse
// optimizers with their rate and epsilon read and written back; a wrong name and the keys outside
// kind = "dlrm" refused naming the key.
TEST(DlrmConfig, ReadsTheTablesOptimizer) {
  const RunConfig plain = parse(dlrm());
  EXPECT_EQ(plain.optimizer.embeddings, EmbeddingOptimizer::dense);
  EXPECT_EQ(plain.optimizer.embeddings_lr, 0.0);
  for (const auto& [name, kind] : {std::pair<std::string, EmbeddingOptimizer>{
                                       "rowwise_adagrad", EmbeddingOptimizer::rowwise_adagrad},
                                   {"sparse_adamw", EmbeddingOptimizer::sparse_adamw}}) {
    const RunConfig a = parse(dlrm("", "[optimizer]\nembeddings = \"" + name +
                                           "\"\nembeddings_lr = 0.05\nembeddings_eps = 1e-6\n"));
    EXPECT_EQ(a.optimizer.embeddings, kind);
    EXPECT_EQ(a.optimizer.embeddings_lr, 0.05);
    EXPECT_EQ(a.optimizer.embeddings_eps, 1e-6);
    const RunConfig b = parse(config_to_toml(a));
    EXPECT_EQ(b.optimizer.embeddings, kind);
    EXPECT_EQ(b.optimizer.embeddings_lr, 0.05);
    EXPECT_EQ(b.optimizer.embeddings_eps, 1e-6);
  }
  expect_config_error(dlrm("", "[optimizer]\nembeddings = \"adagrad\"\n"),
                      {"[optimizer] embeddings", "\"adagrad\"", "rowwise_adagrad"});
  expect_config_error(dlrm("", "[optimizer]\nembeddings_eps = 0\n"), {"embeddings_eps"});
  expect_config_error(
      "[model]\nsizes = [4, 3]\n[train]\nsteps = 5\n[optimizer]\nembeddings = "
      "\"rowwise_adagrad\"\n",
      {"embeddings", "kind = \"dlrm\""});
}

// model.table_dtype (docs/recsys.md, "bf16 tables"): fp32 by default; bf16 read, written back
// and carried into the shape; another value refused naming the file, the key and the value; bf16
// with the dense optimizer.embeddings refused naming both keys; outside kind = "dlrm" refused.
TEST(DlrmConfig, ReadsTheTableDtype) {
  EXPECT_EQ(parse(dlrm()).model.table_dtype, Dtype::fp32);
  EXPECT_EQ(parse(dlrm()).model.dlrm().table_dtype, Dtype::fp32);
  const RunConfig a =
      parse(dlrm("table_dtype = \"bf16\"\n", "[optimizer]\nembeddings = \"rowwise_adagrad\"\n"));
  EXPECT_EQ(a.model.table_dtype, Dtype::bf16);
  EXPECT_EQ(a.model.dlrm().table_dtype, Dtype::bf16);
  EXPECT_EQ(parse(config_to_toml(a)).model.table_dtype, Dtype::bf16);
  expect_config_error(
      dlrm("table_dtype = \"fp16\"\n", "[optimizer]\nembeddings = \"sparse_adamw\"\n"),
      {"t.toml", "[model] table_dtype", "\"fp16\"", "fp32 | bf16"});
  expect_config_error(dlrm("table_dtype = \"bf16\"\n"),
                      {"t.toml", "[model] table_dtype", "bf16", "optimizer.embeddings", "dense"});
  expect_config_error("[model]\nsizes = [4, 3]\ntable_dtype = \"bf16\"\n[train]\nsteps = 5\n",
                      {"table_dtype", "kind = \"dlrm\""});
}

// Table-wise rules (docs/recsys.md): the text form and the array form's "axis@table" entry,
// written back as text; a bad placement names the rule.
TEST(DlrmConfig, ReadsTableWiseRules) {
  const RunConfig a = parse(dlrm(
      "", "[partition]\nrules = [[\"t01\", \"P(fsdp@table)\"], [\"t02\", [\"dp@1\", \"\"]]]\n"));
  ASSERT_EQ(a.partition.rules.size(), 2u);
  EXPECT_EQ(a.partition.rules[0].spec.to_string(), "P(fsdp@table)");
  EXPECT_EQ(a.partition.rules[1].spec.to_string(), "P(dp@1, None)");
  const RunConfig b = parse(config_to_toml(a));
  EXPECT_EQ(b.partition.rules[0].spec, a.partition.rules[0].spec);
  EXPECT_EQ(b.partition.rules[1].spec, a.partition.rules[1].spec);
  expect_config_error(dlrm("", "[partition]\nrules = [[\"t01\", [\"fsdp@tables\"]]]\n"),
                      {"t.toml", "rule 0", "fsdp@tables", "'table' or a member index"});
}

// The dlrm preset (docs/recsys.md, "The dlrm preset"): its rules over the batch axes the
// config's [mesh] gives a size other than 1 (in the logical order fsdp, dp), then the catch-all;
// min_sharding_size passed on as for any preset; refused for another model kind.
TEST(DlrmConfig, DlrmPresetRules) {
  auto rules_of = [](const std::string& mesh) {
    const RunConfig c =
        parse(dlrm("", "[partition]\npreset = \"dlrm\"\nmin_sharding_size = 5000\n" + mesh));
    EXPECT_EQ(plan_options(c).min_sharding_size, 5000);
    std::vector<std::string> out;
    for (const PartitionRule& rule : partition_rules(c)) {
      EXPECT_TRUE(rule.replicate_if_indivisible) << rule.pattern;
      out.push_back(rule.pattern + " -> " + rule.spec.to_string());
    }
    return out;
  };
  using Rules = std::vector<std::string>;
  EXPECT_EQ(rules_of("[mesh]\nfsdp = -1\n"),
            (Rules{"^embeddings/[^/]+/weight$ -> P(fsdp, None)", ".* -> P()"}));
  EXPECT_EQ(rules_of("[mesh]\ndp = 2\nfsdp = -1\n"),
            (Rules{"^embeddings/[^/]+/weight$ -> P((fsdp, dp), None)", ".* -> P()"}));
  EXPECT_EQ(rules_of("[mesh]\ndp = -1\ntp = 2\n"),
            (Rules{"^embeddings/[^/]+/weight$ -> P(dp, None)", ".* -> P()"}));
  // No [mesh]: every axis 1 (one rank), nothing to split over.
  EXPECT_EQ(rules_of(""), (Rules{"^embeddings/[^/]+/weight$ -> P()", ".* -> P()"}));
  // Only tp: no batch axis to split rows over, so the tables are replicated too.
  EXPECT_EQ(rules_of("[mesh]\ndp = 1\ntp = -1\n"),
            (Rules{"^embeddings/[^/]+/weight$ -> P()", ".* -> P()"}));
  // logical_axes.batch names the axes and their order.
  EXPECT_EQ(rules_of("logical_axes = { batch = [\"dp\", \"fsdp\"] }\n[mesh]\ndp = 2\nfsdp = -1\n"),
            (Rules{"^embeddings/[^/]+/weight$ -> P((dp, fsdp), None)", ".* -> P()"}));
  // User rules come first.
  const RunConfig user = parse(dlrm(
      "", "[partition]\npreset = \"dlrm\"\nrules = [[\"t01\", \"P()\"]]\n[mesh]\nfsdp = -1\n"));
  ASSERT_EQ(partition_rules(user).size(), 3u);
  EXPECT_EQ(partition_rules(user)[0].pattern, "t01");
  // Another kind.
  expect_config_error("[model]\nsizes = [4, 8, 2]\n[partition]\npreset = \"dlrm\"\n",
                      {"t.toml", "[partition] preset",
                       "\"dlrm\" is the preset of model.kind = \"dlrm\"", "not of \"mlp\""});
}

TEST(DlrmConfig, RefusesInconsistentShapesInOneSentence) {
  // top's first size against the interaction's width.
  expect_config_error(dlrm(),
                      {"[model] top starts with 15", "\"dot\" of d = 8 and 3 tables",
                       "gives 14 features", "top = [14, ...]"},
                      {"model.top=[15, 16, 1]"});
  expect_config_error(dlrm(), {"[model] top starts with 14", "\"cat\"", "gives 32 features"},
                      {"model.interaction=\"cat\""});
  expect_config_error(dlrm(), {"[model] top must end in 1", "got 2"}, {"model.top=[14, 2]"});
  // dot: every table's dim is bottom's last size.
  expect_config_error(dlrm(),
                      {"[model] tables entry 1 (\"t01\") has dim = 8",
                       "every table's dim equal to bottom's last size, 4"},
                      {"model.bottom=[13, 4]", "model.top=[10, 1]"});
  expect_config_error(dlrm(), {"[model] bottom needs at least 2 entries"}, {"model.bottom=[13]"});
  expect_config_error(
      dlrm(), {"[model] loss must be \"binary_cross_entropy\" with kind = \"dlrm\"", "got \"mse\""},
      {"model.loss=\"mse\""});
  expect_config_error(dlrm(),
                      {"[data] source must be \"hdf5\" with kind = \"dlrm\"", "got \"synthetic\""},
                      {"data.source=\"synthetic\""});
  expect_config_error(dlrm("dropout = 0.1\n"),
                      {"t.toml:7", "[model] dropout = 0.1", "kind = \"dlrm\""});
  expect_config_error(dlrm("moe_layers = [0]\n"),
                      {"t.toml:7", "[model] moe_layers must be empty with kind = \"dlrm\""});
  expect_config_error(dlrm(), {"[model] interaction", "dot | cat", "outer"},
                      {"model.interaction=\"outer\""});
  expect_config_error(dlrm(), {"[model] tables names table \"t00\" twice"},
                      {"model.tables=[{name = \"t00\", rows = 3}, {name = \"t00\", rows = 4}]",
                       "model.top=[11, 16, 1]"});
  expect_config_error(dlrm(), {"[model] tables entry 0 pooling must be \"sum\" or \"mean\"", "max"},
                      {"model.tables=[{name = \"a\", rows = 3, pooling = \"max\"}]"});
  expect_config_error(dlrm(), {"[model] tables entry 0 rows must be >= 1, got 0"},
                      {"model.tables=[{name = \"a\", rows = 0}]"});
  expect_config_error(dlrm(), {"[model] tables entry 0 has an unknown member 'size'"},
                      {"model.tables=[{name = \"a\", size = 3}]"});
  expect_config_error(dlrm(), {"[model] tables needs at least one table"}, {"model.tables=[]"});
  expect_config_error(dlrm(), {"[data] sparse_key", "same dataset as", "/dense"},
                      {"data.sparse_key=dense"});
  // The keys of the other kinds, and dlrm's without it.
  expect_config_error(dlrm("sizes = [13, 1]\n"),
                      {"t.toml:7", "[model] sizes is a key of kind = \"mlp\"", "bottom, top"});
  expect_config_error("[model]\nsizes = [4, 3]\nbottom = [4, 2]\n[train]\nsteps = 5\n",
                      {"t.toml:3", "[model] bottom is a key of kind = \"dlrm\""});
  // Required keys.
  std::string no_top = dlrm();
  no_top.erase(no_top.find("top = [14, 16, 1]\n"), 18);
  expect_config_error(no_top, {"[model] top is required with kind = \"dlrm\""});
}

}  // namespace
}  // namespace meshtrain
