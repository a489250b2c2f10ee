// check_resume_compatible and the data order a checkpoint records (issue 17): a run resumes
// only the order it would reproduce; a checkpoint saved before orders were recorded resumes
// the unshuffled order (unchanged) and is refused, naming data.shuffle, when shuffled.
#include "framework/train/resume.hpp"

#include <gtest/gtest.h>

#include "framework/io/data_order.hpp"
#include "base/error.hpp"

namespace meshtrain {
namespace {

const char* kConfig = R"(
[model]
sizes = [4, 3]
[data]
source = "synthetic"
synthetic_samples = 64
batch_size = 8
[train]
steps = 20
)";

RunConfig config_with(const std::string& shuffle) {
  return parse_config(kConfig, "run.toml", {"data.shuffle=" + shuffle});
}

CheckpointInfo saved_by(const RunConfig& config, const std::string& data_order) {
  CheckpointInfo info;
  info.path = "ckpt-000004.h5";
  info.config_text = config_to_toml(config);
  info.train_state.step = 4;
  info.train_state.seed = config.run.seed;
  info.train_state.data_order = data_order;
  return info;
}

std::string order_of(const RunConfig& config) {
  return DataOrder(config.data.synthetic_samples, config.data.shuffle, config.run.seed,
                   config.data.block_rows, config.data.shuffle_window)
      .name();
}

void expect_refused(const RunConfig& config, const CheckpointInfo& info,
                    const std::vector<std::string>& fragments) {
  try {
    check_resume_compatible(config, info, 20, order_of(config));
    FAIL() << "resumed " << info.train_state.data_order;
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::bad_input);
    for (const std::string& f : fragments) {
      EXPECT_NE(std::string(e.what()).find(f), std::string::npos) << e.what() << "\nmissing " << f;
    }
  }
}

TEST(ResumeCheck, TheSameOrderResumes) {
  for (const char* shuffle : {"false", "true", "\"blocks\""}) {
    const RunConfig config = config_with(shuffle);
    EXPECT_NO_THROW(
        check_resume_compatible(config, saved_by(config, order_of(config)), 20, order_of(config)))
        << shuffle;
  }
}

TEST(ResumeCheck, ACheckpointWithoutAnOrderResumesOnlyUnshuffled) {
  const RunConfig plain = config_with("false");
  EXPECT_NO_THROW(check_resume_compatible(plain, saved_by(plain, ""), 20, order_of(plain)));
  const RunConfig shuffled = config_with("true");
  expect_refused(shuffled, saved_by(shuffled, ""),
                 {"ckpt-000004.h5", "records no data order", "data.shuffle"});
}

TEST(ResumeCheck, AnotherOrderIsRefused) {
  // The same config, but the training set had another number of rows when it was saved.
  const RunConfig config = config_with("true");
  expect_refused(config, saved_by(config, "index-shuffle-v1 samples=65"),
                 {"index-shuffle-v1 samples=65", "index-shuffle-v1 samples=64", "data.shuffle"});
  // Blocks of another size: named by its key.
  RunConfig blocks = config_with("\"blocks\"");
  const CheckpointInfo info = saved_by(blocks, order_of(blocks));
  blocks.data.block_rows = 16;
  expect_refused(blocks, info, {"data.block_rows"});
}

// A decaying schedule over another run length is stretched, not continued: a warning names
// both lengths and the rates; a constant schedule, or the same length, gives none.
TEST(ResumeCheck, AStretchedScheduleIsAWarning) {
  RunConfig config = parse_config(kConfig, "run.toml", {"optimizer.schedule=\"cosine\""});
  const CheckpointInfo info = saved_by(config, order_of(config));  // steps = 20, at step 4
  EXPECT_EQ(learning_rate_change_warning(config, info, 20, 8), "");
  config.train.steps = 40;
  const std::string warning = learning_rate_change_warning(config, info, 40, 8);
  for (const char* fragment : {"train.steps = 20 (20 steps)", "train.steps = 40 (40)",
                               "optimizer.schedule = \"cosine\"", "step 5", "stretched",
                               "resume with train.steps = 20"}) {
    EXPECT_NE(warning.find(fragment), std::string::npos) << warning << "\nmissing " << fragment;
  }
  RunConfig constant = parse_config(kConfig, "run.toml");
  const CheckpointInfo constant_info = saved_by(constant, order_of(constant));
  constant.train.steps = 40;
  EXPECT_EQ(learning_rate_change_warning(constant, constant_info, 40, 8), "");
}

// HDF5 data read from other datasets of the same files is other data: named by its key.
TEST(ResumeCheck, OtherDatasetKeysAreRefused) {
  RunConfig config = parse_config(kConfig, "run.toml",
                                  {"data.source=\"hdf5\"", "data.path=[\"train.h5\"]"});
  const CheckpointInfo info = saved_by(config, order_of(config));
  EXPECT_NO_THROW(check_resume_compatible(config, info, 20, order_of(config)));
  config.data.y_key = "/other_targets";
  expect_refused(config, info, {"data.y_key", "/other_targets", "other data"});
}

}  // namespace
}  // namespace meshtrain
