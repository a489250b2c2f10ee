// An export does not depend on the mesh that saved the checkpoint: a model with a Linear and
// an MoE layer (and a residual_mlp with LayerNorm and SwiGLU), its parameters stored split over the
// world (dp, fsdp, tp, fsdp x tp, as the world size allows), saved with save_checkpoint, exports to
// the byte-identical ONNX graph of the same global values assembled on one rank in the test
// (build_onnx_model of an ExportSource made in code, no checkpoint involved). Runs at NP 1, 2
// and 4.

#include <gtest/gtest.h>
#include <mpi.h>

#include <string>
#include <utility>
#include <vector>

#include "framework/export/onnx_export.hpp"
#include "framework/io/checkpoint.hpp"
#include "framework/train/config.hpp"
#include "tests/support/checkpoint_contents.hpp"
#include "tests/support/temp_dir.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

using testing::ParamShape;

// sizes [8, 12, 8, 4]: layer 1 is an MoE layer of 4 experts, top 2; or a residual_mlp of
// 8 inputs, width 8, hidden 12, one LayerNorm SwiGLU block and 4 outputs. Split dimensions
// divide by 4 (tests/support/checkpoint_contents.hpp's layouts split dimension 0, or 0 and 1).
std::vector<ParamShape> export_model(bool residual) {
  if (residual) {
    return {{"input/weight", {8, 8}},          {"input/bias", {8}},
            {"blocks/0/norm/scale", {8}},      {"blocks/0/norm/bias", {8}},
            {"blocks/0/gate/weight", {8, 12}}, {"blocks/0/gate/bias", {12}},
            {"blocks/0/up/weight", {8, 12}},   {"blocks/0/up/bias", {12}},
            {"blocks/0/down/weight", {12, 8}}, {"blocks/0/down/bias", {8}},
            {"output_norm/scale", {8}},        {"output_norm/bias", {8}},
            {"output/weight", {8, 4}},         {"output/bias", {4}}};
  }
  return {{"layers/0/weight", {8, 12}},
          {"layers/0/bias", {12}},
          {"layers/1/router/weight", {12, 4}},
          {"layers/1/experts/weight", {4, 12, 8}},
          {"layers/1/experts/bias", {4, 8}},
          {"layers/2/weight", {8, 4}},
          {"layers/2/bias", {4}}};
}

RunConfig export_config(bool residual) {
  RunConfig config;
  if (residual) {
    config.model.kind = ModelKind::residual_mlp;
    config.model.inputs = 8;
    config.model.width = 8;
    config.model.hidden = 12;
    config.model.depth = 1;
    config.model.outputs = 4;
    config.model.norm = ModelNorm::layernorm;
    config.model.activation = Activation::silu;
    config.model.swiglu = true;
    config.model.loss = LossKind::cross_entropy;
    check_config(config);
    return config;
  }
  config.model.sizes = {8, 12, 8, 4};
  config.model.activation = Activation::gelu;
  config.model.loss = LossKind::cross_entropy;
  config.model.moe_layers = {1};
  config.model.experts = 4;
  config.model.top_k = 2;
  check_config(config);  // the defaults load_config gives (output_dir, ...)
  return config;
}

constexpr int64_t kStep = 7;

// What every mesh must export: the global values, on this rank alone.
ExportSource reference_source(const std::string& config_text, bool residual) {
  ExportSource s;
  s.path = "reference";
  s.info.train_state.step = kStep;
  s.info.config_text = config_text;
  s.config = parse_config(config_text, "the reference config");
  const auto model = export_model(residual);
  for (size_t i = 0; i < model.size(); ++i) {
    CheckpointArray a;
    a.name = model[i].name;
    a.shape = model[i].shape;
    int64_t n = 1;
    for (int64_t d : a.shape) n *= d;
    for (int64_t g = 0; g < n; ++g)
      a.values.push_back(testing::test_value(static_cast<int>(i), g, kStep));
    s.params.emplace(a.name, std::move(a));
  }
  return s;
}

class ExportMeshTest : public ::testing::Test {
 protected:
  // Saves the model stored as `layout` on `axes` over the whole world; rank 0 exports it and
  // compares the graph with the reference's.
  void check_layout(const std::vector<std::pair<std::string, int>>& axes, const std::string& layout,
                    bool residual = false) {
    const Mesh mesh = Mesh::create(axes, world_size());
    const std::string dir = dir_ + "/" + layout + (residual ? "_residual" : "");
    CheckpointContents c =
        testing::test_contents(mesh, world_rank(), layout, kStep, true, export_model(residual));
    c.opt_state.clear();  // parameters only: what export reads
    c.config_text = config_to_toml(export_config(residual));
    const std::string path = save_checkpoint(c, dir, 1, MPI_COMM_WORLD);
    // Rank 0 alone exports: an exception must not leave it a collective behind the others.
    if (world_rank() == 0) try {
        const ExportSource source = read_export_source(dir);
        EXPECT_EQ(source.path, path);
        const onnx::Model exported = build_onnx_model(source, Dtype::fp32);
        const onnx::Model reference =
            build_onnx_model(reference_source(c.config_text, residual), Dtype::fp32);
        EXPECT_EQ(onnx::serialize(exported.graph), onnx::serialize(reference.graph))
            << "saved on " << mesh.describe() << " as " << layout;
        EXPECT_EQ(exported.graph.name, residual ? "meshtrain_residual_mlp" : "meshtrain_mlp");
        // Only the metadata says where it came from.
        bool mesh_named = false;
        for (const auto& [key, value] : exported.metadata)
          mesh_named = mesh_named || (key == "mesh" && value == mesh.describe());
        EXPECT_TRUE(mesh_named) << "the metadata does not name " << mesh.describe();
        // And 16-bit weights too: the same rounding whatever the mesh.
        EXPECT_EQ(
            onnx::serialize(build_onnx_model(source, Dtype::bf16).graph),
            onnx::serialize(
                build_onnx_model(reference_source(c.config_text, residual), Dtype::bf16).graph));
      } catch (const std::exception& e) {
        ADD_FAILURE() << "saved on " << mesh.describe() << " as " << layout << ": " << e.what();
      }
    MPI_Barrier(MPI_COMM_WORLD);
  }

  // A fresh directory shared by all ranks (made by rank 0), removed after the test.
  const testing::TempDir tmp_{/*shared=*/true, "meshtrain-export"};
  const std::string dir_ = tmp_.path();
};

TEST_F(ExportMeshTest, ReplicatedEqualsOneRank) {
  check_layout({{"dp", world_size()}}, "dp");
}

TEST_F(ExportMeshTest, FsdpEqualsOneRank) {
  check_layout({{"fsdp", world_size()}}, "fsdp");
}

TEST_F(ExportMeshTest, TpEqualsOneRank) {
  check_layout({{"tp", world_size()}}, "tp");
}

TEST_F(ExportMeshTest, FsdpTpEqualsOneRank) {
  const int tp = world_size() >= 2 ? 2 : 1;
  check_layout({{"fsdp", world_size() / tp}, {"tp", tp}}, "fsdp_tp");
}

TEST_F(ExportMeshTest, ResidualMlpOnEveryLayoutEqualsOneRank) {
  const int tp = world_size() >= 2 ? 2 : 1;
  check_layout({{"dp", world_size()}}, "dp", true);
  check_layout({{"fsdp", world_size()}}, "fsdp", true);
  check_layout({{"tp", world_size()}}, "tp", true);
  check_layout({{"fsdp", world_size() / tp}, {"tp", tp}}, "fsdp_tp", true);
}

}  // namespace
}  // namespace meshtrain
