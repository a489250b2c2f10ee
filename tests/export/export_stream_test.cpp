// `meshtrain export` writes the weights straight from the checkpoint's values into the file
// (issue 36): checked on checkpoints saved in the test (one rank).
//
//  - The file is, byte for byte, the in-memory encoding of the model with every initializer
//    held (onnx::serialize(build_onnx_model(...)), the path every export took before): an MLP
//    with GELU and an MoE layer, and a residual_mlp with RMSNorm, SwiGLU and normalization
//    statistics; fp32, fp16 and bf16 weights.
//  - Memory: operator new is counted (live bytes and their peak). Exporting an MLP of 4.7 MB
//    adds at most 1.5 times the weights' bytes at the peak: the checkpoint's values read once
//    (plus the read's buffer of one dataset, 1 MiB), nothing per copy of an encoding. Before, each
//    weight was held up to four times (the values read, the initializer's copy, the encoded tensor
//    message, the encoded graph and its copy): a peak above three times.
//  - Shared constants are named by their value ("constants/width=8"), so two constants of
//    different values can never share a name: every constants/* initializer's bytes are the
//    value its name spells.

#include <gtest/gtest.h>
#include <mpi.h>
#include <stdlib.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <new>
#include <sstream>
#include <string>
#include <vector>

#include "framework/export/onnx_export.hpp"
#include "framework/io/checkpoint.hpp"
#include "framework/train/config.hpp"
#include "tests/support/checkpoint_contents.hpp"
#include "tests/support/world.hpp"

// --- live heap bytes and their peak, through operator new ----------------------------------

namespace {
std::atomic<long long> g_live{0};
std::atomic<long long> g_peak{0};
constexpr std::size_t kHeader = alignof(std::max_align_t);  // holds the block's size

void* counted_allocate(std::size_t bytes) {
  char* block = static_cast<char*>(std::malloc(bytes + kHeader));
  if (!block) throw std::bad_alloc();
  std::memcpy(block, &bytes, sizeof bytes);
  const long long live = g_live.fetch_add(static_cast<long long>(bytes)) + bytes;
  long long peak = g_peak.load();
  while (live > peak && !g_peak.compare_exchange_weak(peak, live)) {
  }
  return block + kHeader;
}
void counted_free(void* p) noexcept {
  if (!p) return;
  char* block = static_cast<char*>(p) - kHeader;
  std::size_t bytes = 0;
  std::memcpy(&bytes, block, sizeof bytes);
  g_live.fetch_sub(static_cast<long long>(bytes));
  std::free(block);
}
}  // namespace

void* operator new(std::size_t bytes) {
  return counted_allocate(bytes);
}
void* operator new[](std::size_t bytes) {
  return counted_allocate(bytes);
}
void operator delete(void* p) noexcept {
  counted_free(p);
}
void operator delete[](void* p) noexcept {
  counted_free(p);
}
void operator delete(void* p, std::size_t) noexcept {
  counted_free(p);
}
void operator delete[](void* p, std::size_t) noexcept {
  counted_free(p);
}

namespace meshtrain {
namespace {

namespace fs = std::filesystem;

// An MLP 64-96-96-96-96-8 with GELU (its constants) and an MoE layer (layer 2: 4 experts,
// top 2); or a residual_mlp of 64 inputs, width 96, hidden 128, 3 RMSNorm SwiGLU blocks
// and 8 outputs, with normalization statistics for inputs and targets (a regression).
RunConfig model_config(bool residual) {
  RunConfig config;
  if (residual) {
    config.model.kind = ModelKind::residual_mlp;
    config.model.inputs = 64;
    config.model.width = 96;
    config.model.hidden = 128;
    config.model.depth = 3;
    config.model.outputs = 8;
    config.model.norm = ModelNorm::rmsnorm;
    config.model.activation = Activation::silu;
    config.model.swiglu = true;
    config.model.loss = LossKind::mse;
  } else {
    config.model.sizes = {64, 96, 96, 96, 96, 8};
    config.model.activation = Activation::gelu;
    config.model.loss = LossKind::cross_entropy;
    config.model.moe_layers = {2};
    config.model.experts = 4;
    config.model.top_k = 2;
  }
  check_config(config);
  return config;
}

class ExportStreamTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/meshtrain-export-stream-XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Saves the model of `config` (values of support/checkpoint_contents.hpp) on one rank; returns the
  // checkpoint directory and adds the parameters' bytes to *weight_bytes when given.
  std::string save(const std::string& name, const RunConfig& config, int64_t* weight_bytes) {
    std::vector<testing::ParamShape> model;
    for (const ParameterShape& p : model_parameter_shapes(config.model)) {
      model.push_back({p.name, p.shape});
      int64_t n = 1;
      for (int64_t d : p.shape) n *= d;
      if (weight_bytes) *weight_bytes += n * static_cast<int64_t>(sizeof(float));
    }
    const Mesh mesh = Mesh::create({{"dp", 1}}, 1);
    CheckpointContents c = testing::test_contents(mesh, 0, "dp", 5, true, model);
    c.opt_state.clear();  // parameters only: what export reads
    c.config_text = config_to_toml(config);
    if (config.model.kind == ModelKind::residual_mlp) {
      for (int64_t i = 0; i < config.model.inputs; ++i) {
        c.normalization.input_mean.push_back(1000.0 + 0.37 * static_cast<double>(i));
        c.normalization.input_std.push_back(2.0 + 0.01 * static_cast<double>(i));
      }
      for (int64_t i = 0; i < config.model.outputs; ++i) {
        c.normalization.target_mean.push_back(-3.0 * static_cast<double>(i));
        c.normalization.target_std.push_back(0.5 + static_cast<double>(i));
      }
    }
    const std::string dir = dir_ + "/" + name;
    save_checkpoint(c, dir, 1, MPI_COMM_WORLD);
    return dir;
  }

  static std::string file_bytes(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }

  std::string dir_;
};

TEST_F(ExportStreamTest, FileIsTheEncodingOfTheModelWithItsWeightsHeld) {
  for (const bool residual : {false, true}) {
    const std::string checkpoint =
        save(residual ? "residual" : "mlp", model_config(residual), nullptr);
    for (const Dtype dtype : {Dtype::fp32, Dtype::fp16, Dtype::bf16}) {
      SCOPED_TRACE(std::string(residual ? "residual_mlp" : "mlp") + ", " + to_string(dtype));
      const std::string out = dir_ + "/model.onnx";
      const OnnxExportResult r = export_onnx(checkpoint, out, dtype, /*overwrite=*/true);
      const onnx::SerializedModel held =
          onnx::serialize(build_onnx_model(read_export_source(checkpoint), dtype));
      const std::string written = file_bytes(out);
      EXPECT_EQ(static_cast<size_t>(r.bytes), written.size());
      ASSERT_EQ(written.size(), held.size());
      EXPECT_TRUE(written == held.head + held.graph + held.tail)
          << "the exported file differs from the held model's encoding";
    }
  }
}

TEST_F(ExportStreamTest, HoldsTheWeightsOnceAtItsPeak) {
  // 4.7 MB of weights in layers of 1 MiB at most: reading holds the values and one dataset.
  RunConfig config = model_config(false);
  config.model.sizes = {256, 512, 512, 512, 512, 512, 8};
  config.model.moe_layers.clear();
  check_config(config);
  int64_t weight_bytes = 0;
  const std::string checkpoint = save("large", config, &weight_bytes);
  for (const Dtype dtype : {Dtype::fp32, Dtype::bf16}) {
    SCOPED_TRACE(to_string(dtype));
    const std::string out = dir_ + "/model.onnx";
    const long long before = g_live.load();
    g_peak = before;
    export_onnx(checkpoint, out, dtype, /*overwrite=*/true);
    const long long added = g_peak.load() - before;
    std::cout << "export " << to_string(dtype) << " of " << weight_bytes
              << " bytes of fp32 weights: peak heap " << added << " bytes above the start ("
              << static_cast<double>(added) / static_cast<double>(weight_bytes)
              << " x the weights)\n";
    EXPECT_GE(added, weight_bytes) << "the checkpoint's values are read into memory";
    EXPECT_LT(static_cast<double>(added), 1.5 * static_cast<double>(weight_bytes))
        << "the export held more than one copy of the weights";
  }
}

// "constants/width=96" -> the float 96; "constants/axes=[-1]" -> {-1}.
TEST_F(ExportStreamTest, SharedConstantsAreNamedByTheirValue) {
  for (const bool residual : {false, true}) {
    SCOPED_TRACE(residual ? "residual_mlp" : "mlp");
    const std::string checkpoint =
        save(residual ? "residual" : "mlp", model_config(residual), nullptr);
    const onnx::Model model = build_onnx_model(read_export_source(checkpoint), Dtype::fp32);
    int constants = 0;
    for (const onnx::Tensor& t : model.graph.initializers) {
      if (t.name.rfind("constants/", 0) != 0) continue;
      ++constants;
      const size_t equals = t.name.find('=');
      ASSERT_NE(equals, std::string::npos) << t.name << " does not spell its value";
      const std::string value = t.name.substr(equals + 1);
      if (t.type == onnx::ElementType::float32) {
        ASSERT_EQ(t.raw_data.size(), sizeof(float)) << t.name;
        float held = 0.0f;
        std::memcpy(&held, t.raw_data.data(), sizeof held);
        char* end = nullptr;
        const float spelled = std::strtof(value.c_str(), &end);
        EXPECT_EQ(*end, '\0') << t.name;
        EXPECT_EQ(std::memcmp(&held, &spelled, sizeof held), 0)
            << t.name << " holds " << held << ", not " << spelled;
      } else {
        ASSERT_EQ(t.type, onnx::ElementType::int64) << t.name;
        std::vector<int64_t> held(t.raw_data.size() / sizeof(int64_t));
        std::memcpy(held.data(), t.raw_data.data(), t.raw_data.size());
        std::string text = "[";
        for (size_t i = 0; i < held.size(); ++i) text += (i ? ", " : "") + std::to_string(held[i]);
        EXPECT_EQ(value, text + "]") << t.name;
      }
    }
    // GELU's four and MoE's axes and top_k; RMSNorm's width, eps, one and the axes.
    EXPECT_GE(constants, 4);
    if (residual) {
      bool width = false;
      for (const onnx::Tensor& t : model.graph.initializers)
        width |= t.name == "constants/width=96";
      EXPECT_TRUE(width) << "no constants/width=96 in the residual model";
    }
  }
}

}  // namespace
}  // namespace meshtrain
