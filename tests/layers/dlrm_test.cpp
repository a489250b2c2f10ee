// DLRM (layers/dlrm.hpp): the forward and every parameter gradient
//  * of the model on one rank (MPI_COMM_SELF) against a float64 reference written here from the
//    same parameters (the definition in the header: bottom MLP with its activation after every
//    layer, pooled bags, the dot or cat interaction, top MLP), within kReferenceTolerance;
//  * of the model on every mesh below against that one-rank model in the same test, each rank
//    comparing its rows of the logits and its block of each gradient, within kMeshTolerance
//    (sums reorder: DP all-reduces, FSDP's per-rank GEMMs, row-wise pooling over owners).
// Meshes: np 1 dp 1; np 2 and 4: dp n (linear layers replicated), fsdp n (weights P(fsdp, None)
// where their first dimension divides, FSDP storage); np 4 also fsdp 2 x dp 2. Each with the
// tables replicated P() and row-wise over the mesh's batch axes. Meshes with a tp axis (np 1
// dp1 x tp1, np 2 tp2, np 4 dp2 x tp2 and tp4) also run a mixed model: "a" column-wise
// P(None, tp) (its 4 columns sliced over tp, the pooled slices all-gathered), "b" row-wise over
// the batch axes (replicated where there are none), "c" replicated. Every mesh also runs the
// tables table-wise over its batch axes, placed by the planner (P(axes@table), checked: with dot
// b (384 B) on member 0, a (256 B) on 1; with cat a (256 B) on 0, b (192 B) on 1; c on 1 of 2 or
// on 2 of 4; replicated where there are no batch axes). And every mesh under the dlrm preset
// (partition/rules.hpp: its rules over the mesh's batch axes, min_sharding_size 64): "a" and,
// with dot, "b" row-wise over the batch axes, the rest (the linear layers too) replicated, each
// spec checked.
//
// Data: 16 rows of 8 dense features in [-1, 1); three tables: "a" [16, 4] sum, one id per row;
// "b" [24, 4] mean, bags of 0 to 3 ids (rows 2, 7, 12 empty, row 3 with a repeated id); "c"
// [8, 4] sum, two ids per row. cat uses dims 4, 2 and 6 instead. The activation is tanh (smooth:
// no kink for a float64 reference to land on the other side of). Parameters from
// Dlrm::initialize (the same global values on every mesh), dy random in [-1, 1).
// A second forward and backward allocate nothing. Sparse table gradients (TableGradients::sparse,
// dp n with row-wise tables; and bucketed, dp n and at np 4 fsdp 2 x dp 2): no table gradient is
// allocated (each tensor empty; the memory tracker's live allocations under a table's name are its
// weights only, the dense model's gradient blocks fewer bytes), and the logits and linear layers'
// gradients still equal the one-rank dense model's. A model built to predict only
// (TableGradients::none, DlrmPredictor's): the tracker's live bytes are the dense model's less its
// table and interaction gradients, the logits the one-rank model's, backward refused. Refusals: the
// shape checks (one sentence each), 16-bit precision, a tp split of a linear layer's output, a
// column split of a table's dim that tp does not divide, a 16-bit reduce dtype. Tables that
// exchange rows over one communicator share their all-to-alls: 4 a step per group, counted
// (RowExchangingTablesShareFourAllToAllsAStep says how).

#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "framework/comm/mesh_communicators.hpp"
#include "framework/observe/flight_recorder.hpp"
#include "framework/observe/memory_tracker.hpp"
#include "layers/context.hpp"
#include "layers/dlrm.hpp"
#include "partition/mesh.hpp"
#include "partition/partition_spec.hpp"
#include "partition/planner.hpp"
#include "partition/rules.hpp"
#include "tests/support/backend.hpp"
#include "tests/support/counting_allocator.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/support/full_tensor.hpp"
#include "tests/support/mesh_cases.hpp"
#include "tests/support/world.hpp"

namespace meshtrain {
namespace {

using testing::Tensor;

constexpr int64_t kBatch = 16, kDense = 8;
constexpr double kReferenceTolerance = 1e-4;
constexpr double kMeshTolerance = 2e-5;
constexpr uint64_t kSeed = 5;

DlrmShape make_shape(DlrmInteraction interaction) {
  DlrmShape s;
  s.interaction = interaction;
  const bool dot = interaction == DlrmInteraction::dot;
  s.bottom = {kDense, 8, 4};
  s.tables = {{"a", 16, dot ? 4 : 4, EmbeddingPooling::sum},
              {"b", 24, dot ? 4 : 2, EmbeddingPooling::mean},
              {"c", 8, dot ? 4 : 6, EmbeddingPooling::sum}};
  s.top = {dlrm_interaction_width(s), 8, 1};
  return s;
}

// The global batch: dense [kBatch, kDense], per table CSR, dy [kBatch].
struct Data {
  std::vector<double> dense, dy;
  std::vector<std::vector<int64_t>> offsets, ids;
};

Data make_data(const DlrmShape& shape) {
  std::mt19937_64 rng(17);
  auto uniform = [&] { return static_cast<double>(rng() >> 11) * 0x1.0p-53 * 2.0 - 1.0; };
  Data d;
  for (int64_t i = 0; i < kBatch * kDense; ++i) d.dense.push_back(uniform());
  for (int64_t i = 0; i < kBatch; ++i) d.dy.push_back(uniform());
  for (size_t t = 0; t < shape.tables.size(); ++t) {
    const auto rows = static_cast<uint64_t>(shape.tables[t].rows);
    std::vector<int64_t> offsets{0}, ids;
    for (int64_t r = 0; r < kBatch; ++r) {
      int64_t count = t == 0   ? 1
                      : t == 2 ? 2
                               : (r % 5 == 2 ? 0 : 1 + static_cast<int64_t>(rng() % 3));
      for (int64_t k = 0; k < count; ++k) ids.push_back(static_cast<int64_t>(rng() % rows));
      if (t == 1 && r == 3) ids.push_back(ids.back());  // a repeated id
      offsets.push_back(static_cast<int64_t>(ids.size()));
    }
    d.offsets.push_back(offsets);
    d.ids.push_back(ids);
  }
  return d;
}

// The most ids one table's rows of any batch slice of `parts` hold (every rank's capacity).
int64_t most_ids(const Data& d, int parts) {
  const int64_t rows = kBatch / parts;
  int64_t most = 1;
  for (const auto& offsets : d.offsets)
    for (int p = 0; p < parts; ++p)
      most = std::max(most, offsets[(p + 1) * rows] - offsets[p * rows]);
  return most;
}

struct LocalBags {
  Kokkos::View<int64_t*, Kokkos::LayoutRight> offsets, ids;
};
LocalBags local_bags(const std::vector<int64_t>& all_offsets, const std::vector<int64_t>& all_ids,
                     int64_t first, int64_t rows) {
  const int64_t begin = all_offsets[first], end = all_offsets[first + rows];
  LocalBags l{
      Kokkos::View<int64_t*, Kokkos::LayoutRight>("offsets", rows + 1),
      Kokkos::View<int64_t*, Kokkos::LayoutRight>("ids", std::max<int64_t>(end - begin, 1))};
  auto o = Kokkos::create_mirror_view(l.offsets);
  auto v = Kokkos::create_mirror_view(l.ids);
  for (int64_t r = 0; r <= rows; ++r) o(r) = all_offsets[first + r] - begin;
  for (int64_t k = begin; k < end; ++k) v(k - begin) = all_ids[k];
  Kokkos::deep_copy(l.offsets, o);
  Kokkos::deep_copy(l.ids, v);
  return l;
}

// One rank's batch of the data: its dense rows, its dy rows and each table's bags, rows
// [first_row, first_row + rows) of the global batch.
struct RankBatch {
  Matrix dense, dy;
  std::vector<LocalBags> local;
  std::vector<SparseBags> bags;  // views of `local`
};
RankBatch rank_batch(const Data& d, int64_t first_row, int64_t rows) {
  RankBatch b;
  b.dense = testing::block_matrix("dense", rows, kDense, first_row, 0,
                                  [&](int64_t i, int64_t j) { return d.dense[i * kDense + j]; });
  b.dy = testing::block_matrix("dy", rows, 1, first_row, 0,
                               [&](int64_t i, int64_t) { return d.dy[i]; });
  for (size_t t = 0; t < d.offsets.size(); ++t) {
    b.local.push_back(local_bags(d.offsets[t], d.ids[t], first_row, rows));
  }
  for (const LocalBags& l : b.local) b.bags.push_back({l.offsets, l.ids});
  return b;
}

// What one rank computed: its logits (rows from first_row), and each parameter's value and
// gradient block with the global flat index of every element.
struct Result {
  std::vector<double> logits;
  int64_t first_row = 0;
  std::vector<Tensor> values, grads;
  std::vector<std::vector<int64_t>> indices;
  std::vector<std::string> names;
  long allocations = -1;
};

enum class Tables { replicated, row_wise, mixed, table_wise, preset };

// The dlrm preset's min_sharding_size here: "a" (64 elements) and, with dot, "b" (96) row-wise,
// the smaller ones replicated.
constexpr int64_t kPresetMinSharding = 64;

Result run(MeshCommunicators& comms, const DlrmShape& shape, const Data& d, Tables tables) {
  ParallelContext context(comms, {"fsdp", "dp"}, "tp");
  const Mesh& mesh = comms.mesh();
  const int parts = context.batch_parallel();
  // The batch axes of size > 1, for the row-wise tables.
  std::vector<std::string> batch;
  for (const char* axis : {"fsdp", "dp"})
    if (mesh.has_axis(axis) && mesh.axis_size(axis) > 1) batch.push_back(axis);
  const bool fsdp = mesh.has_axis("fsdp") && mesh.axis_size("fsdp") > 1;
  const int fsdp_size = fsdp ? mesh.axis_size("fsdp") : 1;
  const std::vector<ParameterShape> shapes = dlrm_parameter_shapes(shape);
  // Table-wise: the planner places the tables over the batch axes (P(axes@table), balanced by
  // bytes: b, a, c in decreasing size onto the least loaded member).
  ShardingPlan placed;
  if (tables == Tables::table_wise && !batch.empty()) {
    const std::string axes = batch.size() == 1 ? batch[0] : "(" + batch[0] + ", " + batch[1] + ")";
    PlanOptions options;
    options.min_sharding_size = 0;
    placed = make_plan(shapes, mesh,
                       {{"embeddings/", PartitionSpec::parse("P(" + axes + "@table)"), false},
                        {".*", PartitionSpec(), false}},
                       options);
    // Largest first onto the least loaded member (the config's order among equals: cat's b
    // and c are both 192 B).
    const int group = parts;
    const bool dot = shape.interaction == DlrmInteraction::dot;
    const std::vector<std::pair<std::string, int>> members = {
        {"a", dot ? 1 : 0}, {"b", dot ? 0 : 1}, {"c", group == 2 ? 1 : 2}};
    for (const auto& [table, member] : members) {
      EXPECT_EQ(placed.find(embedding_weight_name(table)).spec.to_string(),
                "P(" + axes + "@" + std::to_string(member) + ")")
          << table;
    }
  }
  // The dlrm preset (partition/rules.hpp): its rules over the mesh's batch axes, planned.
  ShardingPlan preset;
  if (tables == Tables::preset) {
    PlanOptions options;
    options.min_sharding_size = kPresetMinSharding;
    preset = make_plan(shapes, mesh, preset_rules("dlrm", false, false, false, batch), options);
    for (const ParameterPlan& p : preset.parameters) {
      const bool row_wise = p.name.rfind("embeddings/", 0) == 0 && !batch.empty() &&
                            p.shape[0] * p.shape[1] >= kPresetMinSharding;
      const std::string axes = batch.empty()       ? ""
                               : batch.size() == 1 ? batch[0]
                                                   : "(" + batch[0] + ", " + batch[1] + ")";
      EXPECT_EQ(p.spec.to_string(), row_wise ? "P(" + axes + ", None)" : "P()") << p.name;
    }
  }
  auto spec_of = [&](const std::string& name) -> PartitionSpec {
    if (tables == Tables::preset) return preset.find(name).spec;
    const auto it = std::find_if(shapes.begin(), shapes.end(),
                                 [&](const ParameterShape& p) { return p.name == name; });
    if (name.rfind("embeddings/", 0) == 0) {
      if (tables == Tables::table_wise) {
        return batch.empty() ? PartitionSpec::parse("P()") : placed.find(name).spec;
      }
      if (tables == Tables::mixed) {
        if (name == "embeddings/a/weight") return PartitionSpec::parse("P(None, tp)");
        if (name == "embeddings/c/weight" || batch.empty()) return PartitionSpec::parse("P()");
      }
      if (tables == Tables::replicated || batch.empty()) return PartitionSpec::parse("P()");
      std::string axes = batch.size() == 1 ? batch[0] : "(" + batch[0] + ", " + batch[1] + ")";
      return PartitionSpec::parse("P(" + axes + ", None)");
    }
    if (fsdp && it->shape[0] % fsdp_size == 0) {
      return PartitionSpec::parse(it->shape.size() == 2 ? "P(fsdp, None)" : "P(fsdp)");
    }
    return PartitionSpec::parse("P()");
  };
  const int64_t rows = kBatch / parts;
  Result r;
  r.first_row = context.batch_index() * rows;
  Dlrm model(shape, Activation::tanh, spec_of, context, rows, most_ids(d, parts));
  model.initialize(InitScheme::he_normal, kSeed);
  const RankBatch local_batch = rank_batch(d, r.first_row, rows);
  const Matrix& dense = local_batch.dense;
  const Matrix& dy = local_batch.dy;
  const std::vector<SparseBags>& bags = local_batch.bags;
  auto step = [&] {
    model.forward(dense, bags);
    model.backward(dy);
  };
  step();
  r.logits = testing::host_matrix(model.forward(dense, bags));
  model.backward(dy);
  for (size_t p = 0; p < model.parameters().size(); ++p) {
    r.names.push_back(model.parameters()[p].name);
    r.values.push_back(testing::to_host(model.parameters()[p]));
    r.grads.push_back(testing::to_host(model.gradients()[p]));
    r.indices.push_back(testing::global_indices(model.parameters()[p]));
  }
  // oneDNN's own blocks inside its executions (its argument map; the GEMMs' library where the
  // build has it) counted apart, and none of them kept (tests/support/onednn_allocations.hpp).
  testing::AllocationWindow window(testing::AllocationWindow::Threads::all,
                                   testing::AllocationWindow::OneDnn::left_out);
  step();
  const long heap = window.close();  // oneDNN's blocks kept included
  r.allocations = heap + window.kokkos_allocations();
  return r;
}

Result one_rank(const DlrmShape& shape, const Data& d) {
  MeshCommunicators single(Mesh::single(), MPI_COMM_SELF);
  return run(single, shape, d, Tables::replicated);
}

// The float64 reference from the one-rank model's parameters (whole there): the logits and
// every gradient of sum(logit * dy).
struct Reference {
  std::vector<double> logits;
  std::vector<Tensor> grads;
};

Reference reference(const DlrmShape& shape, const Data& d, const Result& one) {
  Reference ref;
  for (const Tensor& v : one.values) ref.grads.emplace_back(v.size(), 0.0);
  const size_t bottom_layers = shape.bottom.size() - 1, tables = shape.tables.size();
  const size_t top_first = 2 * bottom_layers + tables;
  const int64_t dd = shape.bottom.back();
  for (int64_t r = 0; r < kBatch; ++r) {
    // bottom
    std::vector<std::vector<double>> bottom_in;   // each layer's input
    std::vector<std::vector<double>> bottom_act;  // each layer's tanh output
    std::vector<double> x(d.dense.begin() + r * kDense, d.dense.begin() + (r + 1) * kDense);
    for (size_t i = 0; i < bottom_layers; ++i) {
      bottom_in.push_back(x);
      const Tensor& w = one.values[2 * i];
      const Tensor& b = one.values[2 * i + 1];
      const size_t out = b.size();
      std::vector<double> y(out);
      for (size_t j = 0; j < out; ++j) {
        y[j] = b[j];
        for (size_t c = 0; c < x.size(); ++c) y[j] += x[c] * w[c * out + j];
        y[j] = std::tanh(y[j]);
      }
      bottom_act.push_back(y);
      x = y;
    }
    // pooled bags
    std::vector<std::vector<double>> features{x};
    for (size_t t = 0; t < tables; ++t) {
      const Tensor& w = one.values[2 * bottom_layers + t];
      const int64_t dim = shape.tables[t].dim;
      const int64_t begin = d.offsets[t][r], end = d.offsets[t][r + 1];
      std::vector<double> e(dim, 0.0);
      for (int64_t k = begin; k < end; ++k)
        for (int64_t c = 0; c < dim; ++c) e[c] += w[d.ids[t][k] * dim + c];
      if (shape.tables[t].pooling == EmbeddingPooling::mean && end > begin)
        for (double& v : e) v /= static_cast<double>(end - begin);
      features.push_back(e);
    }
    // interaction
    std::vector<double> h(x);
    if (shape.interaction == DlrmInteraction::dot) {
      for (size_t i = 1; i < features.size(); ++i)
        for (size_t j = 0; j < i; ++j) {
          double s = 0.0;
          for (int64_t k = 0; k < dd; ++k) s += features[i][k] * features[j][k];
          h.push_back(s);
        }
    } else {
      for (size_t t = 1; t < features.size(); ++t)
        h.insert(h.end(), features[t].begin(), features[t].end());
    }
    // top
    const size_t top_layers = shape.top.size() - 1;
    std::vector<std::vector<double>> top_in, top_out;
    std::vector<double> y = h;
    for (size_t i = 0; i < top_layers; ++i) {
      top_in.push_back(y);
      const Tensor& w = one.values[top_first + 2 * i];
      const Tensor& b = one.values[top_first + 2 * i + 1];
      const size_t out = b.size();
      std::vector<double> z(out);
      for (size_t j = 0; j < out; ++j) {
        z[j] = b[j];
        for (size_t c = 0; c < y.size(); ++c) z[j] += y[c] * w[c * out + j];
        if (i + 1 < top_layers) z[j] = std::tanh(z[j]);
      }
      top_out.push_back(z);
      y = z;
    }
    ref.logits.push_back(y[0]);
    // backward of sum(logit * dy)
    std::vector<double> g{d.dy[r]};
    for (size_t i = top_layers; i-- > 0;) {
      if (i + 1 < top_layers)
        for (size_t j = 0; j < g.size(); ++j) g[j] *= 1.0 - top_out[i][j] * top_out[i][j];
      const Tensor& w = one.values[top_first + 2 * i];
      Tensor& gw = ref.grads[top_first + 2 * i];
      Tensor& gb = ref.grads[top_first + 2 * i + 1];
      const std::vector<double>& in = top_in[i];
      std::vector<double> gin(in.size(), 0.0);
      for (size_t c = 0; c < in.size(); ++c)
        for (size_t j = 0; j < g.size(); ++j) {
          gw[c * g.size() + j] += in[c] * g[j];
          gin[c] += w[c * g.size() + j] * g[j];
        }
      for (size_t j = 0; j < g.size(); ++j) gb[j] += g[j];
      g = gin;
    }
    std::vector<std::vector<double>> fg;
    fg.emplace_back(g.begin(), g.begin() + dd);
    if (shape.interaction == DlrmInteraction::dot) {
      for (size_t t = 1; t < features.size(); ++t) fg.emplace_back(dd, 0.0);
      size_t column = static_cast<size_t>(dd);
      for (size_t i = 1; i < features.size(); ++i)
        for (size_t j = 0; j < i; ++j, ++column)
          for (int64_t k = 0; k < dd; ++k) {
            fg[i][k] += g[column] * features[j][k];
            fg[j][k] += g[column] * features[i][k];
          }
    } else {
      size_t column = static_cast<size_t>(dd);
      for (size_t t = 0; t < tables; ++t) {
        fg.emplace_back(g.begin() + column, g.begin() + column + shape.tables[t].dim);
        column += shape.tables[t].dim;
      }
    }
    for (size_t t = 0; t < tables; ++t) {
      Tensor& gw = ref.grads[2 * bottom_layers + t];
      const int64_t dim = shape.tables[t].dim;
      const int64_t begin = d.offsets[t][r], end = d.offsets[t][r + 1];
      const double scale = shape.tables[t].pooling == EmbeddingPooling::mean && end > begin
                               ? 1.0 / static_cast<double>(end - begin)
                               : 1.0;
      for (int64_t k = begin; k < end; ++k)
        for (int64_t c = 0; c < dim; ++c) gw[d.ids[t][k] * dim + c] += fg[t + 1][c] * scale;
    }
    g = fg[0];
    for (size_t i = bottom_layers; i-- > 0;) {
      for (size_t j = 0; j < g.size(); ++j) g[j] *= 1.0 - bottom_act[i][j] * bottom_act[i][j];
      const Tensor& w = one.values[2 * i];
      Tensor& gw = ref.grads[2 * i];
      Tensor& gb = ref.grads[2 * i + 1];
      const std::vector<double>& in = bottom_in[i];
      std::vector<double> gin(in.size(), 0.0);
      for (size_t c = 0; c < in.size(); ++c)
        for (size_t j = 0; j < g.size(); ++j) {
          gw[c * g.size() + j] += in[c] * g[j];
          gin[c] += w[c * g.size() + j] * g[j];
        }
      for (size_t j = 0; j < g.size(); ++j) gb[j] += g[j];
      g = gin;
    }
  }
  return ref;
}

// A gradient that is all zeros would make the comparisons vacuous.
bool any_nonzero(const Tensor& t) {
  return std::any_of(t.begin(), t.end(), [](double v) { return std::abs(v) > 1e-6; });
}

TEST(Dlrm, OneRankEqualsFloat64Reference) {
  for (DlrmInteraction interaction : {DlrmInteraction::dot, DlrmInteraction::cat}) {
    SCOPED_TRACE(to_string(interaction));
    const DlrmShape shape = make_shape(interaction);
    const Data d = make_data(shape);
    const Result one = one_rank(shape, d);
    const Reference ref = reference(shape, d, one);
    ASSERT_EQ(one.logits.size(), ref.logits.size());
    for (size_t r = 0; r < ref.logits.size(); ++r)
      EXPECT_NEAR(one.logits[r], ref.logits[r], kReferenceTolerance) << "logit " << r;
    ASSERT_EQ(one.grads.size(), ref.grads.size());
    for (size_t p = 0; p < ref.grads.size(); ++p) {
      EXPECT_TRUE(any_nonzero(ref.grads[p])) << one.names[p];
      for (size_t i = 0; i < ref.grads[p].size(); ++i)
        ASSERT_NEAR(one.grads[p][i], ref.grads[p][i], kReferenceTolerance)
            << one.names[p] << " element " << i;
    }
    EXPECT_EQ(one.allocations, 0) << "allocations in a second forward and backward";
  }
}

TEST(Dlrm, EveryMeshEqualsOneRank) {
  const int n = world_size();
  std::vector<testing::Axes> meshes;
  if (n == 1)
    meshes = {{{"dp", 1}}};
  else
    meshes = {{{"dp", n}}, {{"fsdp", n}}};
  if (n == 4) meshes.push_back({{"fsdp", 2}, {"dp", 2}});
  // Meshes with tp, for the column-wise table.
  if (n == 1) meshes.push_back({{"dp", 1}, {"tp", 1}});
  if (n == 2) meshes.push_back({{"tp", 2}});
  if (n == 4) meshes.push_back({{"dp", 2}, {"tp", 2}});
  if (n == 4) meshes.push_back({{"tp", 4}});
  int mixed_runs = 0;
  for (const testing::Axes& axes : meshes) {
    const Mesh mesh = Mesh::create(axes, n);
    MeshCommunicators comms(mesh, MPI_COMM_WORLD, testing::test_communicator_factory());
    std::vector<Tables> kinds = {Tables::replicated, Tables::row_wise, Tables::table_wise,
                                 Tables::preset};
    if (mesh.has_axis("tp")) kinds.push_back(Tables::mixed);
    for (DlrmInteraction interaction : {DlrmInteraction::dot, DlrmInteraction::cat}) {
      for (Tables tables : kinds) {
        const char* kind_text = tables == Tables::row_wise     ? " row-wise tables"
                                : tables == Tables::mixed      ? " mixed tables"
                                : tables == Tables::table_wise ? " table-wise tables"
                                : tables == Tables::preset     ? " the dlrm preset"
                                                               : " replicated tables";
        SCOPED_TRACE(mesh.describe() + " " + to_string(interaction) + kind_text);
        mixed_runs += tables == Tables::mixed ? 1 : 0;
        const DlrmShape shape = make_shape(interaction);
        const Data d = make_data(shape);
        const Result one = one_rank(shape, d);
        const Result got = run(comms, shape, d, tables);
        for (size_t r = 0; r < got.logits.size(); ++r)
          ASSERT_NEAR(got.logits[r], one.logits[got.first_row + static_cast<int64_t>(r)],
                      kMeshTolerance)
              << "logit " << got.first_row + static_cast<int64_t>(r);
        ASSERT_EQ(got.grads.size(), one.grads.size());
        for (size_t p = 0; p < got.grads.size(); ++p) {
          ASSERT_EQ(got.names[p], one.names[p]);
          for (size_t i = 0; i < got.grads[p].size(); ++i) {
            const auto global = static_cast<size_t>(got.indices[p][i]);
            ASSERT_EQ(got.values[p][i], one.values[p][global]) << got.names[p] << " value";
            ASSERT_NEAR(got.grads[p][i], one.grads[p][global], kMeshTolerance)
                << got.names[p] << " element " << global;
          }
        }
        EXPECT_EQ(got.allocations, 0) << "allocations in a second forward and backward";
      }
    }
  }
  EXPECT_GT(mixed_runs, 0);
}

TEST(Dlrm, SparseTableGradientsAreNeverAllocated) {
  const int n = world_size();
  const Mesh mesh = Mesh::create({{"dp", n}}, n);
  MeshCommunicators comms(mesh, MPI_COMM_WORLD, testing::test_communicator_factory());
  ParallelContext context(comms, {"fsdp", "dp"}, "tp");
  const DlrmShape shape = make_shape(DlrmInteraction::dot);
  const Data d = make_data(shape);
  const Result one = one_rank(shape, d);
  auto spec_of = [](const std::string& name) {
    return PartitionSpec::parse(name.rfind("embeddings/", 0) == 0 ? "P(dp, None)" : "P()");
  };
  const int64_t rows = kBatch / n;
  const int64_t first_row = context.batch_index() * rows;
  install_memory_tracker();
  // The live bytes of the tracker's allocations labelled with a table's weight name (the
  // weights and, in a dense model, the gradients: both carry the parameter's name).
  auto table_named_bytes = [&] {
    int64_t bytes = 0;
    for (const TrackedAllocation& a : kokkos_memory(1 << 20).largest) {
      for (const DlrmTable& t : shape.tables) {
        if (a.label == "embeddings/" + t.name + "/weight") bytes += a.bytes;
      }
    }
    return bytes;
  };
  const int64_t before = table_named_bytes();
  int64_t dense_bytes = 0, gradient_blocks = 0;
  {
    Dlrm dense(shape, Activation::tanh, spec_of, context, rows, most_ids(d, n));
    dense_bytes = table_named_bytes() - before;
    for (const ShardedTensor& g : dense.gradients()) {
      if (g.name.rfind("embeddings/", 0) == 0) {
        gradient_blocks += static_cast<int64_t>(g.local.extent(0) * sizeof(float));
      }
    }
  }
  ASSERT_GT(gradient_blocks, 0);
  Dlrm model(shape, Activation::tanh, spec_of, context, rows, most_ids(d, n),
             TableGradients::sparse);
  EXPECT_EQ(model.table_gradients(), TableGradients::sparse);
  EXPECT_TRUE(kokkos_memory(0).complete) << "the tracker missed allocations";
  EXPECT_EQ(table_named_bytes() - before, dense_bytes - gradient_blocks)
      << "live bytes under the tables' names: the weights only";
  for (size_t p = 0; p < model.gradients().size(); ++p) {
    const ShardedTensor& g = model.gradients()[p];
    if (g.name.rfind("embeddings/", 0) != 0) continue;
    EXPECT_EQ(g.local.extent(0), 0u) << g.name;
    EXPECT_EQ(g.box.elements(), 0) << g.name;
    EXPECT_EQ(g.matrix().size(), 0u) << g.name;
    EXPECT_EQ(g.spec.to_string(), model.parameters()[p].spec.to_string()) << g.name;
  }
  // It still computes: the logits and the linear layers' gradients are the one-rank dense
  // model's (the same parameters; within kMeshTolerance: DP sums reorder).
  model.initialize(InitScheme::he_normal, kSeed);
  const RankBatch local_batch = rank_batch(d, first_row, rows);
  const Matrix& dense_in = local_batch.dense;
  const Matrix& dy = local_batch.dy;
  const std::vector<SparseBags>& bags = local_batch.bags;
  const std::vector<double> logits = testing::host_matrix(model.forward(dense_in, bags));
  model.backward(dy);
  ASSERT_EQ(static_cast<int64_t>(logits.size()), rows);
  for (int64_t r = 0; r < rows; ++r) {
    EXPECT_NEAR(logits[static_cast<size_t>(r)], one.logits[static_cast<size_t>(first_row + r)],
                kMeshTolerance)
        << "logit " << first_row + r;
  }
  int compared = 0;
  for (size_t p = 0; p < model.gradients().size(); ++p) {
    const ShardedTensor& g = model.gradients()[p];
    if (g.name.rfind("embeddings/", 0) == 0) continue;
    ASSERT_EQ(g.name, one.names[p]);
    const Tensor got = testing::to_host(g);
    const std::vector<int64_t> index = testing::global_indices(g);
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_NEAR(got[i], one.grads[p][static_cast<size_t>(index[i])], kMeshTolerance)
          << g.name << " element " << index[i];
    }
    ++compared;
  }
  EXPECT_EQ(compared, static_cast<int>(model.gradients().size() - shape.tables.size()));
}

// Sparse table gradients on dp n, tables a and c replicated and b row-wise over dp (a and c
// the same at n = 1), and at np 4 also on fsdp 2 x dp 2 with b row-wise over fsdp (two groups:
// b summed over dp, a and c over (fsdp, dp)). One step's collectives, counted by the flight
// recorder, are b's four all-to-alls (counts, ids and partial sums forward; dy backward), one
// all-gather of the touched rows per group, one all-reduce of the compact gradients per group
// and one of the linear layers' gradients (bucketed): seven on dp n > 1, nine on fsdp 2 x dp 2,
// whatever the number of replicated tables and linear layers (unbucketed: an all-gather and an
// all-reduce per table and the linear layers' own all-reduces). Their values: each table's
// touched rows are the rows its dense gradient (a TableGradients::dense model built the same way,
// each table all-reduced on its own) has non-zero, and the compact gradients equal those rows bit
// for bit: the sums are elementwise, so packing a table's rows beside the others' changes no
// element's addends, which holds bit for bit at np <= 2 and with Open MPI's elementwise sums at
// np 4 (an MPI library that chose another summation order for the longer message could change
// last bits at more than 2 ranks: docs/recsys.md, "Collectives per step"). The linear layers'
// gradients equal the one-rank model's within kMeshTolerance (DP sums reorder). A further step
// allocates nothing.
TEST(Dlrm, SparseGradientsAreExchangedInOneCollectiveEach) {
  const int n = world_size();
  const DlrmShape shape = make_shape(DlrmInteraction::dot);
  const Data d = make_data(shape);
  const Result one = one_rank(shape, d);
  std::vector<testing::Axes> meshes = {{{"dp", n}}};
  if (n == 4) meshes.push_back({{"fsdp", 2}, {"dp", 2}});
  for (const testing::Axes& axes : meshes) {
    const Mesh mesh = Mesh::create(axes, n);
    SCOPED_TRACE(mesh.describe());
    const bool two_groups = mesh.has_axis("fsdp");
    MeshCommunicators comms(mesh, MPI_COMM_WORLD, testing::test_communicator_factory());
    ParallelContext context(comms, {"fsdp", "dp"}, "tp");
    auto spec_of = [&](const std::string& name) {
      if (name == "embeddings/b/weight") {
        return PartitionSpec::parse(two_groups ? "P(fsdp, None)" : "P(dp, None)");
      }
      return PartitionSpec::parse("P()");
    };
    const int64_t rows = kBatch / n;
    const int64_t first_row = context.batch_index() * rows;
    Dlrm dense(shape, Activation::tanh, spec_of, context, rows, most_ids(d, n));
    Dlrm sparse(shape, Activation::tanh, spec_of, context, rows, most_ids(d, n),
                TableGradients::sparse);
    dense.initialize(InitScheme::he_normal, kSeed);
    sparse.initialize(InitScheme::he_normal, kSeed);
    const RankBatch local_batch = rank_batch(d, first_row, rows);
    const Matrix& dense_in = local_batch.dense;
    const Matrix& dy = local_batch.dy;
    const std::vector<SparseBags>& bags = local_batch.bags;
    dense.forward(dense_in, bags);
    dense.backward(dy);
    sparse.forward(dense_in, bags);
    sparse.backward(dy);  // a first step: whatever a first use sets up is not counted

    const std::string dir = std::filesystem::temp_directory_path().string() +
                            "/meshtrain_dlrm_collectives_" + std::to_string(getppid());
    flight_recorder().configure(1024, dir, world_rank(), world_size());
    MPI_Barrier(MPI_COMM_WORLD);
    sparse.forward(dense_in, bags);
    sparse.backward(dy);
    std::map<std::string, int> ops;
    for (const FlightEntry& e : flight_recorder().entries()) ++ops[e.op];
    flight_recorder().configure(0, "", world_rank(), world_size());
    MPI_Barrier(MPI_COMM_WORLD);
    if (world_rank() == 0) {
      std::error_code ignored;
      std::filesystem::remove_all(dir, ignored);
    }
    int total = 0;
    std::string seen;
    for (const auto& [op, count] : ops) {
      total += count;
      seen += " " + op + " x" + std::to_string(count);
    }
    SCOPED_TRACE("collectives:" + seen);
    const int groups = two_groups ? 2 : 1;
    if (n == 1) {
      EXPECT_EQ(total, 0);
    } else {
      EXPECT_EQ(ops["all_to_all"], 1) << "b's counts";
      EXPECT_EQ(ops["all_to_all_v"], 3) << "b's ids, partial sums and dy";
      EXPECT_EQ(ops["all_gather"], groups) << "the touched rows, one per group";
      EXPECT_EQ(ops["all_reduce"], groups + 1)
          << "the compact gradients, one per group; the linear layers'";
      EXPECT_EQ(total, 5 + 2 * groups);
    }

    for (size_t t = 0; t < shape.tables.size(); ++t) {
      const EmbeddingBag& table = sparse.tables()[t];
      SCOPED_TRACE("table " + table.table());
      EXPECT_EQ(table.bucketed(), n > 1 && (two_groups || table.table() != "b"));
      const size_t p = static_cast<size_t>(
          std::find_if(dense.parameters().begin(), dense.parameters().end(),
                       [&](const ShardedTensor& x) {
                         return x.name == "embeddings/" + table.table() + "/weight";
                       }) -
          dense.parameters().begin());
      ASSERT_LT(p, dense.parameters().size());
      const testing::Tensor grad = testing::to_host(dense.gradients()[p]);
      const int64_t dim = table.local_dim();
      std::vector<int64_t> want;
      for (int64_t r = 0; r < table.local_rows(); ++r) {
        bool nonzero = false;
        for (int64_t c = 0; c < dim; ++c) nonzero = nonzero || grad[r * dim + c] != 0.0f;
        if (nonzero) want.push_back(r);
      }
      // Every nonzero row is touched (a touched row may sum to zero: none does with these data).
      ASSERT_EQ(table.touched_count(), static_cast<int64_t>(want.size()));
      auto touched = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), table.touched_rows());
      const testing::Tensor got = testing::host_matrix(table.row_gradients());
      for (size_t i = 0; i < want.size(); ++i) {
        ASSERT_EQ(touched(i), want[i]) << "touched row " << i;
        for (int64_t c = 0; c < dim; ++c) {
          ASSERT_EQ(got[i * dim + c], grad[want[i] * dim + c]) << "row " << want[i] << " col " << c;
        }
      }
    }
    int compared = 0;
    for (size_t p = 0; p < sparse.gradients().size(); ++p) {
      const ShardedTensor& g = sparse.gradients()[p];
      if (g.name.rfind("embeddings/", 0) == 0) continue;
      ASSERT_EQ(g.name, one.names[p]);
      const Tensor got = testing::to_host(g);
      const std::vector<int64_t> index = testing::global_indices(g);
      ASSERT_FALSE(got.empty()) << g.name;
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_NEAR(got[i], one.grads[p][static_cast<size_t>(index[i])], kMeshTolerance)
            << g.name << " element " << index[i];
      }
      ++compared;
    }
    EXPECT_EQ(compared, static_cast<int>(sparse.gradients().size() - shape.tables.size()));

    // A further sparse step allocates nothing (oneDNN's own blocks counted apart, as in run()).
    testing::AllocationWindow window(testing::AllocationWindow::Threads::all,
                                     testing::AllocationWindow::OneDnn::left_out);
    sparse.forward(dense_in, bags);
    sparse.backward(dy);
    const long heap = window.close();
    EXPECT_EQ(heap + window.kokkos_allocations(), 0) << "allocations in a further sparse step";
  }
}

// The tables that exchange rows over the same communicator share one EmbeddingExchange (layers/
// embedding_bag.hpp): a step has 4 all-to-alls per group (one all_to_all of the counts, one
// all_to_all_v each of the ids and the partial sums forward, one of the parts' dy backward)
// whatever the number of its tables. All three tables exchange rows here: on dp n "a" and "c"
// row-wise P(dp, None) and "b" table-wise on the last member P(dp@n-1) (one group; 12
// all-to-alls if each table exchanged alone), and at np 4 also on fsdp 2 x dp 2 with "a" and
// "c" row-wise over fsdp and "b" over dp (two groups: 8). dot (every dim 4) and cat (dims 4, 2
// and 6: tables of different widths side by side in one message). Counted by the flight
// recorder in a step after a first one: n = 1 has none. With dense table gradients the logits
// and every gradient equal the one-rank model's within kMeshTolerance (sums reorder across
// ranks); with sparse ones (bucketed where a group sums them) each table's touched rows and
// compact gradients equal the dense model's rows bit for bit (the same sums, as in
// SparseGradientsAreExchangedInOneCollectiveEach). A further step allocates nothing.
TEST(Dlrm, RowExchangingTablesShareFourAllToAllsAStep) {
  const int n = world_size();
  std::vector<testing::Axes> meshes = {{{"dp", n}}};
  if (n == 4) meshes.push_back({{"fsdp", 2}, {"dp", 2}});
  int compared_tables = 0;
  for (const testing::Axes& axes : meshes) {
    const Mesh mesh = Mesh::create(axes, n);
    const bool two_groups = mesh.has_axis("fsdp");
    MeshCommunicators comms(mesh, MPI_COMM_WORLD, testing::test_communicator_factory());
    ParallelContext context(comms, {"fsdp", "dp"}, "tp");
    auto spec_of = [&](const std::string& name) {
      if (name == "embeddings/b/weight") {
        return PartitionSpec::parse(two_groups ? "P(dp, None)"
                                               : "P(dp@" + std::to_string(n - 1) + ")");
      }
      if (name.rfind("embeddings/", 0) == 0) {
        return PartitionSpec::parse(two_groups ? "P(fsdp, None)" : "P(dp, None)");
      }
      return PartitionSpec::parse("P()");
    };
    const int64_t rows = kBatch / n;
    const int64_t first_row = context.batch_index() * rows;
    for (DlrmInteraction interaction : {DlrmInteraction::dot, DlrmInteraction::cat}) {
      SCOPED_TRACE(mesh.describe() + " " + to_string(interaction));
      const DlrmShape shape = make_shape(interaction);
      const Data d = make_data(shape);
      const Result one = one_rank(shape, d);
      const RankBatch local_batch = rank_batch(d, first_row, rows);
      const std::vector<SparseBags>& bags = local_batch.bags;
      Dlrm dense(shape, Activation::tanh, spec_of, context, rows, most_ids(d, n));
      Dlrm sparse(shape, Activation::tanh, spec_of, context, rows, most_ids(d, n),
                  TableGradients::sparse);
      for (const EmbeddingBag& t : dense.tables()) {
        ASSERT_EQ(t.exchanges_rows(), n > 1) << t.table();
      }
      // One step, then a counted one: the all-to-alls of each kind on each communicator.
      const auto all_to_alls = [&](Dlrm& model) {
        model.forward(local_batch.dense, bags);
        model.backward(local_batch.dy);
        const std::string dir = std::filesystem::temp_directory_path().string() +
                                "/meshtrain_dlrm_exchange_" + std::to_string(getppid());
        flight_recorder().configure(1024, dir, world_rank(), world_size());
        MPI_Barrier(MPI_COMM_WORLD);
        model.forward(local_batch.dense, bags);
        model.backward(local_batch.dy);
        std::map<std::string, int> ops;
        for (const FlightEntry& e : flight_recorder().entries()) {
          const std::string op = e.op;
          if (op.rfind("all_to_all", 0) == 0) ++ops[op + " on group " + std::to_string(e.group)];
        }
        flight_recorder().configure(0, "", world_rank(), world_size());
        MPI_Barrier(MPI_COMM_WORLD);
        if (world_rank() == 0) {
          std::error_code ignored;
          std::filesystem::remove_all(dir, ignored);
        }
        return ops;
      };
      dense.initialize(InitScheme::he_normal, kSeed);
      sparse.initialize(InitScheme::he_normal, kSeed);
      for (Dlrm* model : {&dense, &sparse}) {
        const std::map<std::string, int> ops = all_to_alls(*model);
        std::string seen;
        int total = 0, counts = 0, variable = 0;
        for (const auto& [op, count] : ops) {
          seen += " " + op + " x" + std::to_string(count);
          total += count;
          (op.rfind("all_to_all_v", 0) == 0 ? variable : counts) += count;
        }
        SCOPED_TRACE(std::string(model == &dense ? "dense" : "sparse") + " table gradients," +
                     " all-to-alls:" + seen);
        const int groups = n == 1 ? 0 : two_groups ? 2 : 1;
        EXPECT_EQ(total, 4 * groups);
        EXPECT_EQ(counts, groups) << "the counts, one all_to_all per group";
        EXPECT_EQ(variable, 3 * groups) << "the ids, the partial sums and the dy, per group";
        EXPECT_EQ(static_cast<int>(ops.size()), 2 * groups) << "two kinds on each group";
      }

      // Dense: the logits and every gradient against the one-rank model (the second step's, on
      // the same parameters: no update between).
      const std::vector<double> logits =
          testing::host_matrix(dense.forward(local_batch.dense, bags));
      dense.backward(local_batch.dy);
      ASSERT_EQ(static_cast<int64_t>(logits.size()), rows);
      for (int64_t r = 0; r < rows; ++r) {
        ASSERT_NEAR(logits[static_cast<size_t>(r)], one.logits[static_cast<size_t>(first_row + r)],
                    kMeshTolerance)
            << "logit " << first_row + r;
      }
      ASSERT_EQ(dense.gradients().size(), one.grads.size());
      for (size_t p = 0; p < dense.gradients().size(); ++p) {
        const ShardedTensor& g = dense.gradients()[p];
        ASSERT_EQ(g.name, one.names[p]);
        const Tensor got = testing::to_host(g);
        const std::vector<int64_t> index = testing::global_indices(g);
        for (size_t i = 0; i < got.size(); ++i) {
          ASSERT_NEAR(got[i], one.grads[p][static_cast<size_t>(index[i])], kMeshTolerance)
              << g.name << " element " << index[i];
        }
      }

      // Sparse: each table's touched rows are the dense gradient's non-zero rows, their compact
      // gradients those rows bit for bit.
      sparse.forward(local_batch.dense, bags);
      sparse.backward(local_batch.dy);
      for (size_t t = 0; t < shape.tables.size(); ++t) {
        const EmbeddingBag& table = sparse.tables()[t];
        SCOPED_TRACE("sparse table " + table.table());
        const size_t p = static_cast<size_t>(
            std::find_if(dense.parameters().begin(), dense.parameters().end(),
                         [&](const ShardedTensor& x) {
                           return x.name == "embeddings/" + table.table() + "/weight";
                         }) -
            dense.parameters().begin());
        ASSERT_LT(p, dense.parameters().size());
        const testing::Tensor grad = testing::to_host(dense.gradients()[p]);
        const int64_t dim = table.local_dim();
        std::vector<int64_t> want;
        for (int64_t r = 0; r < table.local_rows(); ++r) {
          bool nonzero = false;
          for (int64_t c = 0; c < dim; ++c) nonzero = nonzero || grad[r * dim + c] != 0.0f;
          if (nonzero) want.push_back(r);
        }
        ASSERT_EQ(table.touched_count(), static_cast<int64_t>(want.size()));
        auto touched =
            Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), table.touched_rows());
        const testing::Tensor got = testing::host_matrix(table.row_gradients());
        for (size_t i = 0; i < want.size(); ++i) {
          ASSERT_EQ(touched(i), want[i]) << "touched row " << i;
          for (int64_t c = 0; c < dim; ++c) {
            ASSERT_EQ(got[i * dim + c], grad[want[i] * dim + c])
                << "row " << want[i] << " col " << c;
          }
        }
        compared_tables += want.empty() ? 0 : 1;
      }

      // A further step of each allocates nothing (oneDNN's own blocks counted apart, as in run()).
      testing::AllocationWindow window(testing::AllocationWindow::Threads::all,
                                       testing::AllocationWindow::OneDnn::left_out);
      for (Dlrm* model : {&dense, &sparse}) {
        model->forward(local_batch.dense, bags);
        model->backward(local_batch.dy);
      }
      const long heap = window.close();
      EXPECT_EQ(heap + window.kokkos_allocations(), 0) << "allocations in a further step";
    }
  }
  EXPECT_GT(compared_tables, 0);
}

// A model built to predict only (TableGradients::none, what DlrmPredictor builds), dp n with
// row-wise tables: the tracker's live bytes while it lives are the dense model's less exactly its
// table gradient blocks and the interaction's gradient buffers (feature gradients [rows, d + sum
// of dims], the bottom output's [rows, d], each table's pooled rows' [rows, dim]); every table
// gradient tensor is empty (the buffers of the dense model's bucketed reductions are counted out
// too); its logits are the one-rank dense model's (within kMeshTolerance: DP
// sums reorder); backward is refused.
TEST(Dlrm, PredictOnlyModelAllocatesNoTableOrInteractionGradient) {
  const int n = world_size();
  const Mesh mesh = Mesh::create({{"dp", n}}, n);
  MeshCommunicators comms(mesh, MPI_COMM_WORLD, testing::test_communicator_factory());
  ParallelContext context(comms, {"fsdp", "dp"}, "tp");
  const DlrmShape shape = make_shape(DlrmInteraction::dot);
  const Data d = make_data(shape);
  const Result one = one_rank(shape, d);
  auto spec_of = [](const std::string& name) {
    return PartitionSpec::parse(name.rfind("embeddings/", 0) == 0 ? "P(dp, None)" : "P()");
  };
  const int64_t rows = kBatch / n;
  const int64_t first_row = context.batch_index() * rows;
  install_memory_tracker();
  reset_kokkos_peak();  // `complete` counts from here (one_rank's allocation windows replaced it)
  // A first model, dropped: what the context makes at first use (communicators, their buffers)
  // and keeps is live before both measurements below.
  { Dlrm warm_up(shape, Activation::tanh, spec_of, context, rows, most_ids(d, n)); }
  const int64_t before = kokkos_memory(0).live_bytes;
  int64_t dense_bytes = 0, gradient_blocks = 0, reduction_buffers = 0;
  {
    Dlrm dense(shape, Activation::tanh, spec_of, context, rows, most_ids(d, n));
    dense_bytes = kokkos_memory(0).live_bytes - before;
    // The buffers of its bucketed reductions (as the tracker counts them, alignment included).
    for (const TrackedAllocation& a : kokkos_memory(1 << 20).largest) {
      if (a.label == "meshtrain::grad_bucket" || a.label.rfind("dlrm/sparse_bucket", 0) == 0) {
        reduction_buffers += a.bytes;
      }
    }
    EXPECT_GE(reduction_buffers, dense.reduction_buffer_bytes());
    for (const ShardedTensor& g : dense.gradients()) {
      if (g.name.rfind("embeddings/", 0) == 0) {
        gradient_blocks += static_cast<int64_t>(g.local.extent(0) * sizeof(float));
      }
    }
  }
  ASSERT_GT(gradient_blocks, 0);
  const int64_t d_width = shape.bottom.back();
  int64_t dims = 0;
  for (const DlrmTable& t : shape.tables) dims += t.dim;
  // feature_grads_ [rows, d + dims] + dz_ [rows, d] + the pooled rows' gradients [rows, dims].
  const int64_t interaction_grads =
      rows * (2 * d_width + 2 * dims) * static_cast<int64_t>(sizeof(float));
  Dlrm model(shape, Activation::tanh, spec_of, context, rows, most_ids(d, n), TableGradients::none);
  EXPECT_EQ(model.table_gradients(), TableGradients::none);
  EXPECT_TRUE(kokkos_memory(0).complete) << "the tracker missed allocations";
  EXPECT_EQ(model.reduction_buffer_bytes(), 0);
  EXPECT_EQ(kokkos_memory(0).live_bytes - before,
            dense_bytes - gradient_blocks - interaction_grads - reduction_buffers)
      << "live bytes: the dense model's less its table gradients, interaction gradients and "
         "gradient buckets";
  for (const ShardedTensor& g : model.gradients()) {
    if (g.name.rfind("embeddings/", 0) == 0) EXPECT_EQ(g.local.extent(0), 0u) << g.name;
  }
  model.initialize(InitScheme::he_normal, kSeed);
  const RankBatch local_batch = rank_batch(d, first_row, rows);
  const Matrix& dense_in = local_batch.dense;
  const std::vector<SparseBags>& bags = local_batch.bags;
  const std::vector<double> logits = testing::host_matrix(model.forward(dense_in, bags));
  ASSERT_EQ(static_cast<int64_t>(logits.size()), rows);
  for (int64_t r = 0; r < rows; ++r) {
    EXPECT_NEAR(logits[static_cast<size_t>(r)], one.logits[static_cast<size_t>(first_row + r)],
                kMeshTolerance)
        << "logit " << first_row + r;
  }
  const Matrix dy("dy", rows, 1);
  testing::expect_error([&] { model.backward(dy); }, ErrorKind::runtime,
                        {"dlrm backward", "prediction only"});
}

TEST(Dlrm, BadShapesAreOneSentence) {
  DlrmShape s = make_shape(DlrmInteraction::dot);
  EXPECT_NO_THROW(check_dlrm_shape(s));
  DlrmShape wrong_dim = s;
  wrong_dim.tables[1].dim = 3;
  testing::expect_bad_input([&] { check_dlrm_shape(wrong_dim); },
                            {"model.tables[1] 'b' has dim 3", "bottom's last size, 4"});
  DlrmShape wrong_top = s;
  wrong_top.top[0] = 9;
  testing::expect_bad_input([&] { check_dlrm_shape(wrong_top); },
                            {"model.top[0] = 9", "gives 10 features"});
  DlrmShape two_logits = s;
  two_logits.top.back() = 2;
  testing::expect_bad_input([&] { check_dlrm_shape(two_logits); }, {"model.top ends in 2"});
  DlrmShape twice = s;
  twice.tables[2].name = "a";
  testing::expect_bad_input([&] { check_dlrm_shape(twice); }, {"'a' names a table twice"});
  DlrmShape none = s;
  none.tables.clear();
  testing::expect_bad_input([&] { check_dlrm_shape(none); }, {"model.tables is empty"});
  DlrmShape short_bottom = s;
  short_bottom.bottom = {8};
  testing::expect_bad_input([&] { check_dlrm_shape(short_bottom); }, {"model.bottom has 1 sizes"});
  testing::expect_bad_input([] { parse_dlrm_interaction("outer", "model.interaction"); },
                            {"model.interaction = 'outer'", "'dot' or 'cat'"});
  // cat: top[0] is bottom's last size plus the dims.
  const DlrmShape cat = make_shape(DlrmInteraction::cat);
  EXPECT_EQ(cat.top[0], 4 + 4 + 2 + 6);
  EXPECT_EQ(dlrm_interaction_width(s), 4 + 3 * 4 / 2);
}

TEST(Dlrm, SixteenBitAndTensorParallelOutputsAreRefused) {
  const int n = world_size();
  const DlrmShape shape = make_shape(DlrmInteraction::dot);
  {
    MeshCommunicators single(Mesh::single(), MPI_COMM_SELF);
    ParallelContext context(single, {"fsdp", "dp"}, "tp");
    context.set_precision({Dtype::bf16, Dtype::fp32});
    testing::expect_bad_input(
        [&] {
          Dlrm model(
              shape, Activation::tanh, [](const std::string&) { return PartitionSpec(); }, context,
              kBatch, 4);
        },
        {"dlrm computes in fp32 only", "bf16"});
    // fp32 parameters with a 16-bit reduce dtype: the buckets and the tables' packed sums add in
    // fp32, so the model refuses it rather than sum some gradients in 16 bits and others not.
    context.set_precision({Dtype::fp32, Dtype::bf16});
    testing::expect_bad_input(
        [&] {
          Dlrm model(
              shape, Activation::tanh, [](const std::string&) { return PartitionSpec(); }, context,
              kBatch, 4);
        },
        {"dlrm sums its gradients in fp32 only", "bf16", "mixed_precision.reduce_dtype"});
  }
  {
    // bf16 tables with dense table gradients: the dense optimizer would size the table's state
    // from an empty fp32 block and never train it. Sparse gradients and a predict-only model
    // build.
    MeshCommunicators single(Mesh::single(), MPI_COMM_SELF);
    ParallelContext context(single, {"fsdp", "dp"}, "tp");
    DlrmShape bf16 = shape;
    bf16.table_dtype = Dtype::bf16;
    auto replicated = [](const std::string&) { return PartitionSpec(); };
    testing::expect_bad_input(
        [&] {
          Dlrm model(bf16, Activation::tanh, replicated, context, kBatch, 4, TableGradients::dense);
        },
        {"model.table_dtype = \"bf16\"", "optimizer.embeddings = \"dense\""});
    for (TableGradients g : {TableGradients::sparse, TableGradients::none}) {
      EXPECT_NO_THROW(Dlrm(bf16, Activation::tanh, replicated, context, kBatch, 4, g));
    }
  }
  if (n < 2) return;
  const Mesh mesh = Mesh::create({{"tp", n}}, n);
  MeshCommunicators comms(mesh, MPI_COMM_WORLD, testing::test_communicator_factory());
  ParallelContext context(comms, {"fsdp", "dp"}, "tp");
  auto spec_of = [](const std::string& name) {
    return PartitionSpec::parse(name == "bottom/0/weight" ? "P(None, tp)"
                                : name == "bottom/0/bias" ? "P(tp)"
                                                          : "P()");
  };
  testing::expect_bad_input(
      [&] { Dlrm model(shape, Activation::tanh, spec_of, context, kBatch, 4); },
      {"bottom/0", "whole on each rank", "P(None, tp)"});
  // A column split of a table dim that tp does not divide: refused naming the table and its dim
  // (before the generic divisibility check, which names only the parameter).
  DlrmShape odd = make_shape(DlrmInteraction::cat);
  odd.tables[1].dim = 3;
  odd.top[0] = dlrm_interaction_width(odd);
  auto columns = [](const std::string& name) {
    return PartitionSpec::parse(name.rfind("embeddings/", 0) == 0 ? "P(None, tp)" : "P()");
  };
  testing::expect_bad_input(
      [&] { Dlrm model(odd, Activation::tanh, columns, context, kBatch, 4); },
      {"embedding table 'b'", "dim 3", std::to_string(n) + " column slices of (tp)"});
}

}  // namespace
}  // namespace meshtrain
