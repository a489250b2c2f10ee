// The named options (framework/core/choices.hpp): the config reader offers exactly the
// names the parse_* functions accept, and a RunConfig made in code is checked like one
// read from TOML (check_config), naming the key.

#include <gtest/gtest.h>

#include "framework/core/choices.hpp"
#include "framework/train/config.hpp"
#include "tests/support/expect_error.hpp"

namespace meshtrain {
namespace {

using testing::expect_bad_input;

const std::string kTrain = "[train]\nsteps = 5\n";

// Every name of a table round-trips through parse and to_string, and the TOML reader
// accepts it for `key`.
template <class Enum, class Parse>
void expect_config_and_parser_agree(const ChoiceTable<Enum>& table, Parse parse,
                                    const std::string& section, const std::string& key) {
  for (const auto& [name, value] : table) {
    SCOPED_TRACE(section + "." + key + " = " + name);
    EXPECT_EQ(parse(name), value);
    EXPECT_EQ(std::string(to_string(value)), name);
    const std::string entry = key + " = \"" + name + "\"\n";
    const std::string text = "[model]\nsizes = [4, 3]\n" + (section == "model" ? entry : "") +
                             kTrain + (section == "model" ? "" : "[" + section + "]\n" + entry);
    EXPECT_NO_THROW(parse_config(text, "t.toml"));
  }
}

TEST(Choices, TheConfigAcceptsExactlyWhatTheParsersAccept) {
  expect_config_and_parser_agree(
      activation_choices(), [](const std::string& n) { return parse_activation(n); }, "model",
      "activation");
  expect_config_and_parser_agree(
      init_scheme_choices(), [](const std::string& n) { return parse_init_scheme(n); }, "model",
      "init");
  expect_config_and_parser_agree(
      loss_kind_choices(), [](const std::string& n) { return parse_loss_kind(n); }, "model",
      "loss");
  expect_config_and_parser_agree(
      optimizer_kind_choices(), [](const std::string& n) { return parse_optimizer_kind(n); },
      "optimizer", "kind");
  expect_config_and_parser_agree(
      collective_matmul_choices(),
      [](const std::string& n) { return parse_collective_matmul_algorithm(n); }, "partition",
      "collective_matmul");
  expect_config_and_parser_agree(
      lr_schedule_choices(), [](const std::string& n) { return parse_lr_schedule(n); }, "optimizer",
      "schedule");
  expect_config_and_parser_agree(
      comm_backend_choices(), [](const std::string& n) { return parse_comm_backend(n); }, "runtime",
      "backend");
  expect_config_and_parser_agree(
      reduction_algorithm_choices(),
      [](const std::string& n) { return parse_reduction_algorithm(n); }, "runtime", "reductions");
  expect_config_and_parser_agree(
      matmul_precision_choices(), [](const std::string& n) { return parse_matmul_precision(n); },
      "runtime", "matmul_precision");
}

// The reader turns each name into its enum once; the writer gives the name back.
TEST(Choices, TheReaderAndTheWriterUseTheEnums) {
  const RunConfig c = parse_config(
      "[model]\nsizes = [4, 3]\nactivation = \"tanh\"\n[data]\nsource = \"synthetic\"\n"
      "[optimizer]\nkind = \"sgd\"\n" +
          kTrain,
      "t.toml");
  EXPECT_EQ(c.model.activation, Activation::tanh);
  EXPECT_EQ(c.data.source, DataSource::synthetic);
  EXPECT_EQ(c.model.loss, LossKind::mse);  // auto, for synthetic data
  EXPECT_EQ(c.optimizer.kind, OptimizerKind::sgd);

  RunConfig in_code;  // model.loss unset: written as "auto", resolved when read
  in_code.model.sizes = {4, 3};
  in_code.data.source = DataSource::synthetic;
  check_config(in_code);  // the output_dir and checkpoint.dir load_config would give
  const std::string text = config_to_toml(in_code);
  EXPECT_NE(text.find("loss = 'auto'"), std::string::npos) << text;
  EXPECT_EQ(parse_config(text, "t.toml").model.loss, LossKind::mse);
}

TEST(Choices, AnUnknownNameListsTheKnownOnes) {
  expect_bad_input(
      [] { parse_activation("swish"); },
      {"model.activation = 'swish'", "relu | tanh | gelu | gelu_erf | silu | sigmoid | none"});
  expect_bad_input([] { parse_optimizer_kind("lamb", "my.optimizer"); },
                   {"my.optimizer = 'lamb'", "sgd | adamw"});
}

RunConfig valid_config() {
  RunConfig config;
  config.mesh.axes = {{"fsdp", -1}};
  config.model.sizes = {8, 4, 2};
  config.partition.rules = {{"weight", PartitionSpec::parse("P(fsdp, None)")},
                            {"bias", PartitionSpec::parse("P()")}};
  config.train.steps = 10;
  return config;
}

TEST(CheckConfig, AConfigMadeInCodeGetsTheDefaultsOfLoadConfig) {
  RunConfig config = valid_config();
  config.run.name = "mine";
  check_config(config);
  EXPECT_EQ(config.run.output_dir, "runs/mine");
  EXPECT_EQ(config.checkpoint.dir, "runs/mine/checkpoints");
  EXPECT_EQ(config.file, "the run config");
}

TEST(CheckConfig, NamesTheKeyOfABadValue) {
  struct Case {
    void (*spoil)(RunConfig&);
    std::vector<std::string> fragments;
  };
  const std::vector<Case> cases = {
      {[](RunConfig& c) { c.model.sizes = {8}; }, {"model.sizes", "at least 2"}},
      {[](RunConfig& c) {
         c.model.sizes = {8, 0};
       },
       {"model.sizes", "index 1"}},
      {[](RunConfig& c) { c.optimizer.lr = 0; }, {"optimizer.lr", "positive"}},
      {[](RunConfig& c) { c.data.batch_size = 0; }, {"data.batch_size", "at least 1"}},
      {[](RunConfig& c) { c.train.epochs = 2; }, {"train.steps", "exactly one"}},
      {[](RunConfig& c) { c.partition.rules[0].pattern = "(["; },
       {"partition.rules", "rule 0", "does not compile"}},
      {[](RunConfig& c) { c.partition.rules[1].spec = PartitionSpec::parse("P(xp)"); },
       {"partition.rules", "rule 1", "unknown mesh axis 'xp'"}},
      {[](RunConfig& c) { c.checkpoint.keep = 0; }, {"checkpoint.keep", "at least 1"}},
      {[](RunConfig& c) { c.optimizer.warmup_steps = -1; }, {"optimizer.warmup_steps"}},
      {[](RunConfig& c) { c.optimizer.min_lr = 1.0; }, {"optimizer.min_lr", "[0, optimizer.lr"}},
      {[](RunConfig& c) { c.train.accumulation_steps = 0; },
       {"train.accumulation_steps", "at least 1"}},
      {[](RunConfig& c) { c.data.eval_batch_size = 0; }, {"data.eval_batch_size", "at least 1"}},
      {[](RunConfig& c) { c.run.peak_tflops = -1; }, {"run.peak_tflops", "non-negative"}},
      {[](RunConfig& c) { c.runtime.bucket_mb = 0; }, {"runtime.bucket_mb", "positive"}},
      // The MoE keys, checked by the TOML reader's own check (moe_settings_problem).
      {[](RunConfig& c) { c.model.moe_layers = {1}; },
       {"model.moe_layers entry 1 is not a hidden layer", "0 to 0"}},
      {[](RunConfig& c) {
         c.model.moe_layers = {0, 0};
       },
       {"model.moe_layers", "twice"}},
      {[](RunConfig& c) { c.model.top_k = 9; }, {"model.top_k = 9 must not exceed experts = 8"}},
      {[](RunConfig& c) { c.model.experts = 0; }, {"model.experts must be at least 1"}},
      {[](RunConfig& c) { c.model.aux_loss_coef = -1; },
       {"model.aux_loss_coef must be non-negative"}},
      {[](RunConfig& c) { c.model.dropout = 1.0; }, {"model.dropout must be in [0, 1)", "got 1"}},
      {[](RunConfig& c) { c.model.dropout = -0.5; }, {"model.dropout must be in [0, 1)"}},
  };
  for (const Case& c : cases) {
    RunConfig config = valid_config();
    config.file = "code.cpp";
    c.spoil(config);
    SCOPED_TRACE(c.fragments.front());
    try {
      check_config(config);
      ADD_FAILURE() << "check_config accepted a bad value";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::bad_input);
      const std::string message = e.what();
      EXPECT_EQ(message.rfind("code.cpp: ", 0), 0u) << message;
      for (const std::string& fragment : c.fragments) {
        EXPECT_NE(message.find(fragment), std::string::npos) << message;
      }
    }
  }
}

}  // namespace
}  // namespace meshtrain
