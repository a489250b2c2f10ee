// Small unit tests of the pieces under the MLP: activation derivatives (central finite
// differences in double, tolerance 2e-3 relative: float forward), option parsing, the
// optimizer's state layout, and that a training step allocates nothing (Kokkos
// allocation callbacks counted over steps 2 and 3, after the first step warmed up).

#include <gtest/gtest.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <cmath>
#include <string>
#include <vector>

#include "framework/comm/mesh_communicators.hpp"
#include "framework/train/init.hpp"
#include "framework/train/optimizer.hpp"
#include "layers/activation.hpp"
#include "layers/loss.hpp"
#include "layers/mlp.hpp"
#include "partition/planner.hpp"
#include "partition/rules.hpp"
#include "tests/test_support.hpp"

namespace meshtrain {
namespace {

TEST(Activation, BackwardMatchesFiniteDifferences) {
  const int n = 41;
  Matrix z("z", 1, n), out("out", 1, n), g("g", 1, n);
  auto zh = Kokkos::create_mirror_view(z);
  for (int j = 0; j < n; ++j) zh(0, j) = -3.0f + 0.15f * j + 0.01f;  // avoids 0 for relu
  Kokkos::deep_copy(z, zh);
  for (Activation a : {Activation::relu, Activation::tanh, Activation::gelu, Activation::none}) {
    SCOPED_TRACE(to_string(a));
    Kokkos::deep_copy(g, 1.0f);
    activation_backward(a, z, g);
    auto gh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), g);
    const double h = 1e-2;
    Matrix zp("zp", 1, n), zm("zm", 1, n), fp("fp", 1, n), fm("fm", 1, n);
    auto zph = Kokkos::create_mirror_view(zp);
    auto zmh = Kokkos::create_mirror_view(zm);
    for (int j = 0; j < n; ++j) {
      zph(0, j) = zh(0, j) + static_cast<float>(h);
      zmh(0, j) = zh(0, j) - static_cast<float>(h);
    }
    Kokkos::deep_copy(zp, zph);
    Kokkos::deep_copy(zm, zmh);
    activation_forward(a, zp, fp);
    activation_forward(a, zm, fm);
    auto fph = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), fp);
    auto fmh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), fm);
    for (int j = 0; j < n; ++j) {
      const double numeric = (double(fph(0, j)) - double(fmh(0, j))) / (2 * h);
      EXPECT_NEAR(gh(0, j), numeric, 2e-3 * std::max(1.0, std::abs(numeric)) + 1e-3)
          << "at z = " << zh(0, j);
    }
  }
  // gelu is the tanh approximation: gelu(1) = 0.841192.
  Matrix one("one", 1, 1), r("r", 1, 1);
  Kokkos::deep_copy(one, 1.0f);
  activation_forward(Activation::gelu, one, r);
  auto rh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), r);
  EXPECT_NEAR(rh(0, 0), 0.841192, 1e-5);
}

TEST(Options, UnknownNamesAreBadInput) {
  testing::expect_bad_input([] { parse_activation("swish"); }, {"model.activation", "swish"});
  testing::expect_bad_input([] { parse_loss_kind("hinge"); }, {"model.loss", "hinge"});
  testing::expect_bad_input([] { parse_optimizer_kind("lion"); }, {"optimizer.kind", "lion"});
  EXPECT_EQ(parse_activation("gelu"), Activation::gelu);
  EXPECT_EQ(parse_loss_kind("mse"), LossKind::mse);
  EXPECT_EQ(parse_optimizer_kind("sgd"), OptimizerKind::sgd);
}

TEST(Optimizer, StateIsShardedLikeItsParameter) {
  const Mesh mesh = Mesh::create({{"fsdp", world_size()}}, world_size());
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::vector<ShardedTensor> params = {
      ShardedTensor::allocate("layers/0/weight", {8, 4}, PartitionSpec::parse("P(fsdp, None)"),
                              mesh, rank),
      ShardedTensor::allocate("layers/0/bias", {4}, PartitionSpec(), mesh, rank)};
  OptimizerSettings adamw;
  Optimizer opt(adamw, params);
  EXPECT_EQ(opt.slot_names(), (std::vector<std::string>{"m", "v"}));
  for (const auto& slot : opt.slot_names()) {
    for (size_t i = 0; i < params.size(); ++i) {
      const ShardedTensor& s = opt.slot(slot)[i];
      EXPECT_EQ(s.name, params[i].name);
      EXPECT_EQ(s.spec, params[i].spec);
      EXPECT_EQ(s.box.offset, params[i].box.offset);
      EXPECT_EQ(s.local.extent(0), params[i].local.extent(0));
    }
  }
  testing::expect_bad_input([&] { opt.slot("momentum"); }, {"momentum"});
  OptimizerSettings sgd;
  sgd.kind = OptimizerKind::sgd;
  Optimizer opt2(sgd, params);
  EXPECT_EQ(opt2.slot_names(), (std::vector<std::string>{"momentum"}));
  std::vector<ShardedTensor> grads = params;  // shares storage: g = p
  Kokkos::deep_copy(params[0].local, 1.0f);
  opt2.step(params, grads, 0.5f);  // p = 1 - 0.5 * 1
  EXPECT_EQ(opt2.step_count(), 1);
  auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), params[0].local);
  EXPECT_FLOAT_EQ(h(0), 0.5f);
}

int64_t g_allocations = 0;
void count_allocation(const Kokkos::Profiling::SpaceHandle, const char*, const void*,
                      const uint64_t) {
  ++g_allocations;
}

TEST(Mlp, TrainingStepsAllocateNothing) {
  const int n = world_size();
  std::vector<std::pair<std::vector<std::pair<std::string, int>>, std::string>> cases = {
      {{{"dp", n}}, "dp"}, {{{"fsdp", n}}, "fsdp"}, {{{"tp", n}}, "tp"}};
  if (n == 4) cases.push_back({{{"fsdp", 2}, {"tp", 2}}, "fsdp_tp"});
  for (const auto& c : cases) {
    SCOPED_TRACE(c.second);
    const Mesh mesh = Mesh::create(c.first, n);
    MeshCommunicators comms(mesh);
    std::vector<std::string> all;
    for (const auto& a : mesh.axes()) all.push_back(a.name);
    Communicator& world = comms.get(all);
    ParallelContext context(comms, {"fsdp", "dp"}, "tp", CollectiveMatmulAlgorithm::bidirectional);
    const std::vector<int64_t> sizes = {64, 32, 32, 10};
    const ShardingPlan plan =
        make_plan(mlp_parameter_shapes(sizes), mesh, preset_rules(c.second), PlanOptions{0});
    const int64_t rows = 16 / context.batch_parallel();
    Mlp model(sizes, Activation::gelu, specs_from_plan(plan), context, rows);
    model.initialize(InitScheme::he_normal, 1);
    Loss loss(LossKind::cross_entropy, context, rows, sizes.back(), model.output_layout());
    Optimizer opt(OptimizerSettings{}, model.parameters());
    GradientClipper clipper(mesh, context.rank(), model.gradients());
    Matrix x("x", rows, sizes[0]);
    Kokkos::deep_copy(x, 0.5f);
    Kokkos::View<int32_t*> labels("labels", rows);
    Kokkos::deep_copy(labels, 3);
    auto step = [&] {
      MatrixView out = model.forward(x);
      loss.cross_entropy(out, labels);
      model.backward(loss.gradient());
      clipper.clip(model.gradients(), 1.0, world);
      opt.step(model.parameters(), model.gradients(), 1e-3f);
    };
    step();  // warm-up
    g_allocations = 0;
    Kokkos::Tools::Experimental::set_allocate_data_callback(count_allocation);
    step();
    step();
    Kokkos::Tools::Experimental::set_allocate_data_callback(nullptr);
    EXPECT_EQ(g_allocations, 0) << "Kokkos allocations inside training steps";
  }
}

// The callback really fires (so the test above can fail).
TEST(Mlp, AllocationCounterSeesAllocations) {
  g_allocations = 0;
  Kokkos::Tools::Experimental::set_allocate_data_callback(count_allocation);
  { Vector v("probe", 10); }
  Kokkos::Tools::Experimental::set_allocate_data_callback(nullptr);
  EXPECT_GE(g_allocations, 1);
}

}  // namespace
}  // namespace meshtrain
