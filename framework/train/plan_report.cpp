#include "framework/train/plan_report.hpp"

#include <algorithm>
#include <cstdio>
#include <map>
#include <optional>
#include <sstream>

#include "base/error.hpp"
#include "base/text.hpp"
#include "framework/comm/backend.hpp"
#include "framework/comm/reduction_choice.hpp"
#include "framework/core/choices.hpp"
#include "framework/core/views.hpp"
#include "framework/io/checkpoint.hpp"
#include "framework/io/data.hpp"
#include "framework/train/config.hpp"
#include "partition/dlrm_shape.hpp"
#include "partition/embedding_layout.hpp"
#include "partition/sharding_picture.hpp"

namespace meshtrain {

namespace {

// Meshes up to this many ranks get a picture per parameter in the text output.
constexpr int kMaxPictureRanks = 16;
constexpr int kPictureWidth = 80;

std::string joined_notes(const std::vector<std::string>& notes) {
  std::string out;
  for (const auto& note : notes) out += (out.empty() ? "" : "; ") + note;
  return out;
}

nlohmann::ordered_json spec_json(const PartitionSpec& spec) {
  nlohmann::ordered_json entries = nlohmann::ordered_json::array();
  for (const auto& entry : spec.entries) {
    if (entry.is_none()) {
      entries.push_back(nullptr);
    } else if (entry.table) {
      // Table-wise: its text, "fsdp@1" (PartitionSpec::parse reads it back).
      const std::string text = PartitionSpec({entry}).to_string();
      entries.push_back(text.substr(2, text.size() - 3));
    } else if (entry.axes.size() == 1) {
      entries.push_back(entry.axes[0]);
    } else {
      entries.push_back(entry.axes);
    }
  }
  return entries;
}

// The spec of a 3-D tensor [d0, d1, d2] seen as [d0, d1 x d2]: dims 1 and 2 merged into one
// entry, d1's axes major (the block of (i1, i2) is column block i1 * |d2 axes| + i2).
PartitionSpec flattened_spec(const PartitionSpec& spec) {
  const PartitionSpec full = spec.with_rank(3);
  SpecEntry merged = full.entries[1];
  merged.axes.insert(merged.axes.end(), full.entries[2].axes.begin(), full.entries[2].axes.end());
  return PartitionSpec({full.entries[0], merged});
}

// Left-aligned columns separated by two spaces; the last column is not padded.
void write_table(const std::vector<std::vector<std::string>>& rows, std::ostream& out) {
  std::vector<size_t> widths;
  for (const auto& row : rows) {
    widths.resize(std::max(widths.size(), row.size()), 0);
    for (size_t c = 0; c < row.size(); ++c) widths[c] = std::max(widths[c], row[c].size());
  }
  for (const auto& row : rows) {
    std::string line;
    for (size_t c = 0; c < row.size(); ++c) {
      line += row[c];
      if (c + 1 < row.size()) line += std::string(widths[c] - row[c].size() + 2, ' ');
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out << line << "\n";
  }
}

// The group of a collective: "tp=4", "(fsdp, dp)=8".
std::string group_text(const LayerCollective& c, const Mesh& mesh) {
  return axis_product_text(SpecEntry{c.axes}, mesh);
}

// An MoE layer's experts on this rank (bytes as stored, from the parameter table) and its
// dispatch buffers.
void write_moe_layer_text(const ShardingPlan& plan, const LayerPlan& l, std::ostream& out) {
  const MoeLayout& m = l.moe_layout;
  out << "  experts per rank: " << m.experts_local << " of " << m.experts;
  if (m.ep > 1) out << " (split over " << join(m.expert_axes) << ", " << m.ep << " ranks)";
  // Feed-forward experts (an MoE block): the weights and biases of all their projections.
  int64_t weights = plan.find(m.experts_weight.name).bytes_per_rank;
  int64_t biases = plan.find(m.experts_bias.name).bytes_per_rank;
  if (m.feed_forward()) {
    weights += plan.find(m.experts_down_weight.name).bytes_per_rank;
    biases += plan.find(m.experts_down_bias.name).bytes_per_rank;
  }
  if (m.gated) {
    weights += plan.find(m.experts_gate_weight.name).bytes_per_rank;
    biases += plan.find(m.experts_gate_bias.name).bytes_per_rank;
  }
  out << "; stored per rank: expert weights " << format_bytes(weights) << ", expert biases "
      << format_bytes(biases) << ", router "
      << format_bytes(plan.find(m.router.name).bytes_per_rank) << "\n";
  if (l.moe_buffer_bytes > 0) {
    out << "  dispatch buffers: " << format_bytes(l.moe_buffer_bytes)
        << " per rank (worst case: all rows to one rank; allocated once at construction)\n";
  }
}

void write_layers_text(const ShardingPlan& plan, const PlanOptions& options, std::ostream& out) {
  out << "\nlayers (collectives per training step, bytes moved per rank";
  if (plan.local_batch_rows > 0) {
    out << "; global batch " << options.global_batch << " = " << plan.local_batch_rows
        << " rows per rank";
  } else if (options.global_batch == 0) {
    out << "; global batch unknown: activation collectives left out";
  }
  out << "):\n";
  for (const auto& note : plan.notes) out << "note: " << note << "\n";
  for (const auto& l : plan.layers) {
    out << l.name << ": " << l.compute << "\n";
    for (const auto& note : l.notes) out << "  note: " << note << "\n";
    if (l.moe) write_moe_layer_text(plan, l, out);
    if (l.collectives.empty()) {
      out << "  no collectives\n";
      continue;
    }
    std::vector<std::vector<std::string>> rows = {
        {"  phase", "collective", "operand", "shape", "group", "bytes/rank"}};
    for (const auto& c : l.collectives) {
      rows.push_back({"  " + c.phase, to_string(c.kind), c.operand, format_shape(c.shape),
                      group_text(c, plan.mesh),
                      format_bytes(c.bytes_per_rank) +
                          (c.kind == CollectiveKind::all_to_all ? " at uniform routing" : "")});
    }
    rows.push_back({"  total", "", "", "", "", format_bytes(l.collective_bytes_per_step)});
    write_table(rows, out);
  }
  for (const NormPlan& n : plan.norms) {
    out << n.name << ": " << n.compute << "\n";
    if (n.collectives.empty()) {
      out << "  no collectives\n";
      continue;
    }
    std::vector<std::vector<std::string>> rows = {
        {"  phase", "collective", "operand", "shape", "group", "bytes/rank"}};
    for (const auto& c : n.collectives) {
      rows.push_back({"  " + c.phase, to_string(c.kind), c.operand, format_shape(c.shape),
                      group_text(c, plan.mesh), format_bytes(c.bytes_per_rank)});
    }
    rows.push_back({"  total", "", "", "", "", format_bytes(n.collective_bytes_per_step)});
    write_table(rows, out);
  }
  out << "collectives per rank per step: " << format_bytes(plan.totals.collective_bytes_per_step)
      << "\n";
}

std::string seconds_text(double s) {
  char text[32];
  if (s >= 1.0) {
    std::snprintf(text, sizeof text, "%.3f s", s);
  } else if (s >= 1e-3) {
    std::snprintf(text, sizeof text, "%.2f ms", s * 1e3);
  } else {
    std::snprintf(text, sizeof text, "%.1f us", s * 1e6);
  }
  return text;
}

// One row of the scaling table: the config's mesh with its batch axis grown to `ranks`.
struct ScalingRow {
  int ranks = 0;
  std::string mesh;
  int64_t global_batch = 0;
  StepCost cost;
  bool fits = false;
  std::string problem;  // why the config does not plan at this size
};

// Weak scaling as Megatron and JAX users read it: the rows per rank stay fixed and the
// data-parallel axis grows (fsdp when the mesh shards over fsdp, dp otherwise), the other
// axes (tp, ...) keep their sizes, so the global batch grows with the ranks. Each axis
// keeps its link of the profile.
std::string grown_axis(const Mesh& mesh) {
  return mesh.has_axis("fsdp") && mesh.axis_size("fsdp") > 1 ? "fsdp" : "dp";
}

ScalingRow scaled_cost(const ShardingPlan& plan, const std::vector<ParameterShape>& shapes,
                       const std::vector<PartitionRule>& rules, const PlanOptions& options,
                       const std::vector<LinearLayerParameters>& layers, const HardwareProfile& hw,
                       CollectiveMatmulAlgorithm algorithm, int ranks) {
  ScalingRow row;
  row.ranks = ranks;
  const std::string grow = grown_axis(plan.mesh);
  std::vector<std::pair<std::string, int>> axes;
  int others = 1;
  for (const auto& a : plan.mesh.axes()) {
    if (a.name == grow) continue;
    axes.push_back({a.name, a.size});
    others *= a.size;
  }
  if (ranks % others != 0) {
    row.problem = "the other axes' product " + std::to_string(others) + " does not divide it";
    return row;
  }
  // Put the grown axis back at its place in mesh order.
  std::vector<std::pair<std::string, int>> ordered;
  for (const auto& name : Mesh::known_axes()) {
    if (name == grow) {
      ordered.push_back({grow, ranks / others});
      continue;
    }
    for (const auto& a : axes) {
      if (a.first == name) ordered.push_back(a);
    }
  }
  const Mesh mesh = Mesh::create(ordered, ranks, "scaling");
  PlanOptions scaled = options;
  const LayerAxes layer = layer_axes_on(mesh, {options.batch_axes, options.feature_axis});
  scaled.global_batch = plan.local_batch_rows * mesh.size_of(layer.batch);
  scaled.eval_global_batch = 0;
  row.mesh = mesh.short_description();
  std::optional<ShardingPlan> p;
  try {
    p = make_plan(shapes, mesh, rules, scaled, layers);
  } catch (const Error& e) {  // e.g. a rule's dim that does not divide at this size
    row.problem = e.what();
    return row;
  }
  row.cost = predict_step(*p, scaled, hw, algorithm);
  // A step's rows: every micro-batch of it.
  row.global_batch = scaled.global_batch * row.cost.accumulation_steps;
  row.fits = true;
  return row;
}

void write_cost_text(const ShardingPlan& plan, int64_t global_batch, const StepCost& cost,
                     const HardwareProfile& hw, CollectiveMatmulAlgorithm algorithm,
                     const std::vector<ScalingRow>& scaling, std::ostream& out) {
  out << "\nstep time (cost model, partition/cost_model.hpp; hardware: " << hw.source
      << (hw.source == "defaults" ? ", default_hardware_profile(): 1 CPU core, MPI in one node"
                                  : "")
      << "):\n";
  out << "  predicted " << seconds_text(cost.total_s) << " per step";
  if (cost.accumulation_steps > 1) out << " (" << cost.accumulation_steps << " micro-batches)";
  out << ": GEMMs (outside collective matmuls) " << seconds_text(cost.gemm_s) << ", collectives "
      << seconds_text(cost.collective_s) << ", collective matmuls "
      << seconds_text(cost.collective_matmul_s) << ", memory passes " << seconds_text(cost.memory_s)
      << ", data read " << seconds_text(cost.data_exposed_s) << " not hidden (of "
      << seconds_text(cost.data_read_s) << ")\n";
  if (cost.full_overlap_hidden_s > 0.0) {
    char e[16];
    std::snprintf(e, sizeof e, "%.2f", hw.overlap);
    out << "  overlap ([runtime] overlap: FSDP weight prefetch; profile overlap " << e
        << "): predicted " << seconds_text(cost.total_s) << ", "
        << seconds_text(cost.overlap_hidden_s) << " of communication hidden; without overlap "
        << seconds_text(cost.serial_s) << "; at full overlap, per layer max(compute, gather): "
        << seconds_text(cost.full_overlap_s) << "\n";
  }
  std::vector<std::vector<std::string>> rows = {
      {"  layer", "phase", "part", "what", "group", "time"}};
  for (const auto& item : cost.items) {
    rows.push_back({"  " + item.layer, item.phase, item.category, item.what, item.group,
                    seconds_text(item.seconds)});
  }
  write_table(rows, out);
  bool any = false;
  for (size_t i = 0; i < plan.layers.size(); ++i) {
    if (!plan.layers[i].layout.runs_collective_matmuls()) continue;
    if (!any) {
      out << "collective matmul algorithms (partition.collective_matmul = " << to_string(algorithm)
          << "):\n";
    }
    any = true;
    const LayerMatmulAlgorithms& m = cost.matmuls[i];
    out << "  " << plan.layers[i].name << ": forward " << to_string(m.forward)
        << ", backward weight gradient " << to_string(m.weight_grad);
    if (i > 0) out << ", backward input gradient " << to_string(m.input_grad);
    out << "\n";
  }
  if (scaling.empty()) return;
  out << "\nscaling (cost model; " << grown_axis(plan.mesh) << " grows, " << plan.local_batch_rows
      << " rows per rank fixed so the global batch grows, other axes fixed, links as in the "
         "profile):\n";
  // Samples/s per rank of the config's own mesh (ranks that split features share rows), of
  // whole steps (every micro-batch).
  const double base = static_cast<double>(global_batch * cost.accumulation_steps) / cost.total_s /
                      plan.mesh.world_size();
  std::vector<std::vector<std::string>> table = {{"  ranks", "mesh", "global batch", "step time",
                                                  "compute", "communication", "samples/s",
                                                  "per-rank efficiency"}};
  for (const auto& r : scaling) {
    if (!r.fits) {
      table.push_back({"  " + std::to_string(r.ranks), r.mesh, "not planned: " + r.problem});
      continue;
    }
    const double samples = r.global_batch / r.cost.total_s;
    char eff[32], sps[32];
    std::snprintf(sps, sizeof sps, "%.0f", samples);
    std::snprintf(eff, sizeof eff, "%.0f%%", 100.0 * samples / r.ranks / base);
    table.push_back({"  " + std::to_string(r.ranks), r.mesh, std::to_string(r.global_batch),
                     seconds_text(r.cost.total_s), seconds_text(r.cost.gemm_s + r.cost.memory_s),
                     seconds_text(r.cost.collective_s + r.cost.collective_matmul_s), sps, eff});
  }
  write_table(table, out);
}

// An MoE layer's decision (partition/moe_layout.hpp) for the JSON document.
nlohmann::ordered_json moe_storage_json(const MoeParameterStorage& p, const ShardingPlan& plan) {
  return {{"name", p.name},
          {"compute_shape", p.compute},
          {"stored_shape", p.stored},
          {"bytes_per_rank", plan.find(p.name).bytes_per_rank},
          {"gather_axes", p.gather()},
          {"gradient_allreduce_axes", p.allreduce},
          {"nonbatch_replication", p.nonbatch_replication},
          {"all_experts", p.all_experts}};
}

nlohmann::ordered_json moe_layout_json(const ShardingPlan& plan, const LayerPlan& l) {
  const MoeLayout& m = l.moe_layout;
  nlohmann::ordered_json json = {{"in", m.in},
                                 {"out", m.out},
                                 {"experts", m.experts},
                                 {"top_k", m.top_k},
                                 {"experts_per_rank", m.experts_local},
                                 {"expert_axes", m.expert_axes},
                                 {"ep", m.ep},
                                 {"batch_axes", m.batch_axes},
                                 {"feature_axis", m.feature_axis},
                                 {"gathers_input", m.gathers_input()},
                                 {"router", moe_storage_json(m.router, plan)},
                                 {"experts_weight", moe_storage_json(m.experts_weight, plan)},
                                 {"experts_bias", moe_storage_json(m.experts_bias, plan)},
                                 {"buffer_bytes_per_rank", l.moe_buffer_bytes}};
  // Feed-forward experts (an MoE block): experts_weight / experts_bias are the up projection.
  if (m.feed_forward()) {
    json["hidden"] = m.hidden;
    json["experts_down_weight"] = moe_storage_json(m.experts_down_weight, plan);
    json["experts_down_bias"] = moe_storage_json(m.experts_down_bias, plan);
  }
  if (m.gated) {
    json["experts_gate_weight"] = moe_storage_json(m.experts_gate_weight, plan);
    json["experts_gate_bias"] = moe_storage_json(m.experts_gate_bias, plan);
  }
  return json;
}

nlohmann::ordered_json cost_json(const StepCost& cost, const HardwareProfile& hw) {
  nlohmann::ordered_json items = nlohmann::ordered_json::array();
  for (const auto& i : cost.items) {
    items.push_back({{"layer", i.layer},
                     {"phase", i.phase},
                     {"category", i.category},
                     {"what", i.what},
                     {"group", i.group},
                     {"seconds", i.seconds}});
  }
  nlohmann::ordered_json matmuls = nlohmann::ordered_json::array();
  for (const auto& m : cost.matmuls) {
    matmuls.push_back({{"forward", to_string(m.forward)},
                       {"weight_grad", to_string(m.weight_grad)},
                       {"input_grad", to_string(m.input_grad)}});
  }
  return {{"hardware", hw.source},
          {"step_s", cost.total_s},
          {"gemm_s", cost.gemm_s},
          {"collective_s", cost.collective_s},
          {"collective_matmul_s", cost.collective_matmul_s},
          {"memory_s", cost.memory_s},
          {"overlap", hw.overlap},
          {"overlap_hidden_s", cost.overlap_hidden_s},
          {"serial_s", cost.serial_s},
          {"full_overlap_s", cost.full_overlap_s},
          {"data_read_s", cost.data_read_s},
          {"data_exposed_s", cost.data_exposed_s},
          {"data_agree_s", cost.data_agree_s},
          {"items", items},
          {"collective_matmuls", matmuls}};
}

}  // namespace

const std::vector<int>& scaling_ranks() {
  static const std::vector<int> ranks = {64, 256, 1024};
  return ranks;
}

void write_plan_text(const ShardingPlan& plan, const std::vector<PartitionRule>& rules,
                     const PlanOptions& options, const std::string& source, std::ostream& out,
                     int64_t staging_bytes, const DataFootprint* data,
                     const RingReductionBytes* ring, const TrainingWorkspace* workspace,
                     bool staging_on_some_ranks) {
  const Mesh& mesh = plan.mesh;
  out << "plan of " << (source.empty() ? "(config)" : source) << " for " << mesh.world_size()
      << (mesh.world_size() == 1 ? " rank" : " ranks") << "\n";
  out << "mesh: " << mesh.short_description() << "  [" << mesh.describe() << "]\n";
  out << "options: min_sharding_size " << options.min_sharding_size << ", "
      << options.bytes_per_element << " bytes per element, " << options.optimizer_slots
      << " optimizer slot" << (options.optimizer_slots == 1 ? "" : "s") << " per parameter\n";
  if (!options.precision.is_fp32()) {
    out << "mixed precision: param_dtype " << to_string(options.precision.param)
        << ", reduce_dtype " << to_string(options.precision.reduce)
        << " (masters, gradients and optimizer state fp32; the collectives below move "
           "16-bit elements where the dtype is 16-bit)\n";
  }
  out << "rules:\n";
  for (size_t i = 0; i < rules.size(); ++i) {
    out << "  " << describe_rule(rules, static_cast<int>(i))
        << (rules[i].replicate_if_indivisible && !rules[i].spec.is_replicated()
                ? "  (preset: dims that do not divide are replicated)"
                : "")
        << "\n";
  }
  out << "\n";

  std::vector<std::vector<std::string>> rows = {
      {"parameter", "shape", "rule", "spec", "local shape", "bytes/rank", "replicas", "notes"}};
  for (const auto& p : plan.parameters) {
    rows.push_back({p.name, format_shape(p.shape), p.rule < 0 ? "-" : std::to_string(p.rule),
                    p.spec.to_string(), format_shape(p.local_shape), format_bytes(p.bytes_per_rank),
                    std::to_string(p.replicas), joined_notes(p.notes)});
  }
  write_table(rows, out);

  const PlanTotals& t = plan.totals;
  out << "\nper rank:\n";
  std::vector<std::vector<std::string>> totals = {
      {"  parameters", format_bytes(t.parameter_bytes)},
      {"  gradients", format_bytes(t.gradient_bytes)},
      {"  optimizer state", format_bytes(t.optimizer_bytes)}};
  if (t.accumulation_bytes > 0) {
    totals.push_back({"  gradient accumulation", format_bytes(t.accumulation_bytes)});
  }
  if (t.evaluation_bytes > 0) {
    totals.push_back({"  evaluation batch", format_bytes(t.evaluation_bytes)});
  }
  if (t.zero1_buffer_bytes > 0) {
    totals.push_back({"  ZeRO-1 buffers", format_bytes(t.zero1_buffer_bytes)});
  }
  if (t.moe_buffer_bytes > 0) {
    totals.push_back({"  MoE buffers", format_bytes(t.moe_buffer_bytes) +
                                           " (dispatch buffers, worst case: all rows to one "
                                           "rank; allocated once at construction)"});
  }
  int64_t workspace_bytes = 0;
  if (workspace && workspace->total_bytes() > 0) {
    const auto item = [&](const char* name, int64_t bytes, const char* what) {
      if (bytes > 0) totals.push_back({std::string("  ") + name, format_bytes(bytes) + " " + what});
    };
    item("activations", workspace->activation_bytes,
         "(each layer's output, kept input and input gradient; the loss's)");
    item("batch buffers", workspace->batch_bytes, "(this rank's rows of a training batch)");
    item("gathered weights", workspace->gathered_weight_bytes,
         "(shared by the layers: gathered weight and its gradient, prefetch, stage, bias)");
    item("collective matmul workspace", workspace->collective_matmul_bytes, "");
    item("communicator scratch", workspace->comm_scratch_bytes, "(the largest per communicator)");
    workspace_bytes = workspace->total_bytes();
  }
  if (staging_bytes > 0) {
    totals.push_back(
        {"  staging (ckpt)",
         format_bytes(staging_bytes) +
             (staging_on_some_ranks ? " (on the ranks that write a block: the largest; others less)"
                                    : "")});
  }
  int64_t data_bytes = 0;
  if (data) {
    totals.push_back({"  data", format_bytes(data->source_bytes) + " " + data->source});
    totals.push_back(
        {"  data staging", format_bytes(data->staging_bytes) + " (" +
                               std::to_string(std::max<int64_t>(data->read.prefetch, 1)) +
                               " batches of train and eval)"});
    data_bytes = data->total_bytes();
    if (data->read.pattern != ReadPattern::memory) {
      totals.push_back({"  chunk cache", format_bytes(data->cache_bytes) +
                                             " at most (HDF5, shared by the shards a batch "
                                             "reads; none for contiguous files)"});
    }
  }
  const int64_t ring_bytes = ring ? ring->total() : 0;
  if (ring_bytes > 0) {
    totals.push_back({"  ring reductions", format_bytes(ring_bytes) +
                                               " (partial sums: " + format_bytes(ring->blocking) +
                                               " blocking, " + format_bytes(ring->started) +
                                               " DP buckets under overlap)"});
  }
  totals.push_back({"  total", format_bytes(t.bytes_per_rank() + workspace_bytes + staging_bytes +
                                            data_bytes + ring_bytes)});
  totals.push_back({"unsharded model", format_bytes(t.global_parameter_bytes)});
  write_table(totals, out);

  if (!plan.layers.empty()) write_layers_text(plan, options, out);

  if (!plan.unused_rules.empty()) {
    out << "\nunused rules (gave the spec of no parameter):\n";
    for (int i : plan.unused_rules) out << "  " << describe_rule(rules, i) << "\n";
  }

  if (mesh.world_size() <= kMaxPictureRanks) {
    bool first = true;
    for (const auto& p : plan.parameters) {
      // A 3-D tensor (MoE experts [E, in, out]) is drawn as [E, in x out].
      const bool flattened = p.shape.size() == 3;
      const std::string picture =
          flattened
              ? sharding_picture({p.shape[0], p.shape[1] * p.shape[2]}, flattened_spec(p.spec),
                                 mesh, kMaxPictureRanks, kPictureWidth)
              : sharding_picture(p.shape, p.spec, mesh, kMaxPictureRanks, kPictureWidth);
      if (picture.empty()) continue;
      if (first) out << "\nranks holding each block:\n";
      first = false;
      out << "\n"
          << p.name << " " << format_shape(p.shape) << " " << p.spec.to_string()
          << (flattened ? " (drawn as [" + std::to_string(p.shape[0]) + ", " +
                              std::to_string(p.shape[1]) + " x " + std::to_string(p.shape[2]) + "])"
                        : std::string())
          << "\n"
          << picture;
    }
  } else {
    out << "\n(no sharding pictures for meshes of more than " << kMaxPictureRanks << " ranks)\n";
  }
}

nlohmann::ordered_json plan_to_json(const ShardingPlan& plan,
                                    const std::vector<PartitionRule>& rules,
                                    const PlanOptions& options, const std::string& source) {
  using json = nlohmann::ordered_json;
  json doc;
  doc["config"] = source;
  json axes = json::object();
  for (const auto& axis : plan.mesh.axes()) axes[axis.name] = axis.size;
  doc["mesh"] = {{"world_size", plan.mesh.world_size()}, {"axes", axes}};
  doc["options"] = {{"min_sharding_size", options.min_sharding_size},
                    {"bytes_per_element", options.bytes_per_element},
                    {"optimizer_slots", options.optimizer_slots},
                    {"batch_axes", options.batch_axes},
                    {"feature_axis", options.feature_axis},
                    {"global_batch", options.global_batch},
                    {"param_dtype", to_string(options.precision.param)},
                    {"reduce_dtype", to_string(options.precision.reduce)}};
  json rule_list = json::array();
  for (size_t i = 0; i < rules.size(); ++i) {
    rule_list.push_back({{"index", i},
                         {"pattern", rules[i].pattern},
                         {"spec", spec_json(rules[i].spec)},
                         {"replicate_if_indivisible", rules[i].replicate_if_indivisible}});
  }
  doc["rules"] = rule_list;
  json parameters = json::array();
  for (const auto& p : plan.parameters) {
    parameters.push_back({{"name", p.name},
                          {"shape", p.shape},
                          {"rule", p.rule},
                          {"spec", spec_json(p.spec)},
                          {"local_shape", p.local_shape},
                          {"bytes_per_rank", p.bytes_per_rank},
                          {"replicas", p.replicas},
                          {"notes", p.notes}});
  }
  doc["parameters"] = parameters;
  doc["local_batch_rows"] = plan.local_batch_rows;
  json layers = json::array();
  for (const auto& l : plan.layers) {
    json collectives = json::array();
    for (const auto& c : l.collectives) {
      json entry = {{"phase", c.phase},
                    {"kind", to_string(c.kind)},
                    {"operand", c.operand},
                    {"axes", c.axes},
                    {"ranks", c.ranks},
                    {"shape", c.shape},
                    {"bytes_per_rank", c.bytes_per_rank}};
      // An all-to-all's bytes are those of uniform routing (partition/moe_layout.hpp).
      if (c.kind == CollectiveKind::all_to_all) entry["at_uniform_routing"] = true;
      collectives.push_back(std::move(entry));
    }
    json layer = {{"name", l.name},
                  {"compute", l.compute},
                  {"moe", l.moe},
                  {"tensor_parallel", l.layout.tensor_parallel},
                  {"column_parallel", l.layout.column_parallel},
                  {"input_layout", to_string(l.layout.input_layout)},
                  {"output_layout", to_string(l.layout.output_layout())},
                  {"collectives", collectives},
                  {"collective_bytes_per_step", l.collective_bytes_per_step},
                  {"notes", l.notes}};
    if (l.moe) layer["moe_layout"] = moe_layout_json(plan, l);
    layers.push_back(std::move(layer));
  }
  doc["layers"] = layers;
  doc["notes"] = plan.notes;
  const PlanTotals& t = plan.totals;
  doc["totals"] = {{"parameter_bytes", t.parameter_bytes},
                   {"gradient_bytes", t.gradient_bytes},
                   {"optimizer_bytes", t.optimizer_bytes},
                   {"accumulation_bytes", t.accumulation_bytes},
                   {"evaluation_bytes", t.evaluation_bytes},
                   {"zero1_buffer_bytes", t.zero1_buffer_bytes},
                   {"moe_buffer_bytes", t.moe_buffer_bytes},
                   {"bytes_per_rank", t.bytes_per_rank()},
                   {"global_parameter_bytes", t.global_parameter_bytes},
                   {"collective_bytes_per_step", t.collective_bytes_per_step}};
  doc["unused_rules"] = plan.unused_rules;
  return doc;
}

namespace {

// --- A DLRM's tables: placement, bytes per rank, communication per step -------------------

// The ids per bag the per-step figures assume: the plan reads no data, and a bag's id count is
// the data's (one id per bag is Criteo's; the figures grow linearly with it, see docs/recsys.md).
constexpr int64_t kPlannedIdsPerBag = 1;

struct TablePlan {
  EmbeddingLayout layout;
  std::string placement;  // "replicated", "row-wise over (fsdp)", "column-wise over (tp)", ...
  int64_t weight_bytes = 0, gradient_bytes = 0, optimizer_bytes = 0;
  std::string optimizer_state;  // what optimizer_bytes holds
  EmbeddingStepBytes step;
  int64_t bytes_per_rank() const { return weight_bytes + gradient_bytes + optimizer_bytes; }
};

std::string axes_list(const std::vector<std::string>& axes) {
  std::string text = "(";
  for (size_t i = 0; i < axes.size(); ++i) text += (i ? ", " : "") + axes[i];
  return text + ")";
}

// The tables' weight, gradient and optimizer bytes on the most loaded rank: every table counts on
// every rank except a table-wise one, which counts on its holder only; per group of row axes the
// member whose weights + gradients + optimizer state is largest is taken, with its own split (the
// three maxima taken separately can come from different members and overstate the total); an
// upper bound when groups of different axes meet on one rank.
struct RankBytes {
  int64_t weight = 0, gradient = 0, optimizer = 0;
  int64_t total() const { return weight + gradient + optimizer; }
  void add(const RankBytes& other) {
    weight += other.weight;
    gradient += other.gradient;
    optimizer += other.optimizer;
  }
};

RankBytes busiest_rank_bytes(const std::vector<TablePlan>& tables) {
  RankBytes everywhere;
  std::map<std::vector<std::string>, std::vector<RankBytes>> members;
  for (const TablePlan& t : tables) {
    const EmbeddingLayout& l = t.layout;
    const RankBytes bytes{t.weight_bytes, t.gradient_bytes, t.optimizer_bytes};
    if (l.sharding != EmbeddingSharding::table_wise) {
      everywhere.add(bytes);
      continue;
    }
    std::vector<RankBytes>& load = members[l.row_axes];
    load.resize(static_cast<size_t>(l.owners));
    load[static_cast<size_t>(l.holder)].add(bytes);
  }
  for (const auto& group : members) {
    everywhere.add(*std::max_element(
        group.second.begin(), group.second.end(),
        [](const RankBytes& a, const RankBytes& b) { return a.total() < b.total(); }));
  }
  return everywhere;
}

std::vector<TablePlan> table_plans(const RunConfig& config, const ShardingPlan& plan,
                                   const PlanOptions& options) {
  std::vector<TablePlan> tables;
  if (config.model.kind != ModelKind::dlrm) return tables;
  const LayerAxes axes{options.batch_axes, options.feature_axis};
  const EmbeddingOptimizer optimizer = config.optimizer.embeddings;
  const bool sparse = options.sparse_tables;
  const int64_t bags = std::max<int64_t>(plan.local_batch_rows, 0);
  for (const DlrmTable& table : config.model.dlrm().tables) {
    const ParameterPlan& p = plan.find(embedding_weight_name(table.name));
    TablePlan t;
    t.layout = embedding_layout(table.name, {p.name, p.shape, p.spec}, plan.mesh, axes);
    const EmbeddingLayout& l = t.layout;
    const bool rows_split = l.sharding == EmbeddingSharding::row_wise;
    const bool columns_split = l.column_slices > 1;
    if (l.sharding == EmbeddingSharding::table_wise) {
      t.placement =
          "table-wise on member " + std::to_string(l.holder) + " of " + axes_list(l.row_axes);
    } else if (rows_split && columns_split) {
      t.placement = "row-wise over " + axes_list(l.row_axes) + ", column-wise over " +
                    axes_list(l.column_axes);
    } else if (rows_split) {
      t.placement = "row-wise over " + axes_list(l.row_axes);
    } else if (columns_split) {
      t.placement = "column-wise over " + axes_list(l.column_axes);
    } else {
      t.placement = "replicated";
    }
    constexpr int64_t kFloat = sizeof(float);
    // The table's block as stored (model.table_dtype: 4 or 2 bytes an element); its gradient
    // and optimizer state are fp32 either way.
    const int64_t block = l.rows_per_owner * l.dim_per_slice * kFloat;
    t.weight_bytes = l.rows_per_owner * l.dim_per_slice * options.table_bytes_per_element;
    // Sparse updates allocate no dense gradient (TableGradients::sparse, layers/dlrm.hpp).
    t.gradient_bytes = sparse ? 0 : block;
    // Sparse updates also keep a host int32 row -> slot map of every local row
    // (EmbeddingBag::use_sparse_gradient), counted here with the optimizer's rows.
    const int64_t slot_map = sparse ? l.rows_per_owner * static_cast<int64_t>(sizeof(int32_t)) : 0;
    switch (optimizer) {
      case EmbeddingOptimizer::dense:
        t.optimizer_bytes = block * options.optimizer_slots;
        t.optimizer_state = std::string(to_string(config.optimizer.kind)) + ", " +
                            std::to_string(options.optimizer_slots) + " slot(s) like the table";
        break;
      case EmbeddingOptimizer::rowwise_adagrad:
        // One accumulator per local row, whole on every rank of the column slices.
        t.optimizer_bytes = l.rows_per_owner * kFloat + slot_map;
        t.optimizer_state = "rowwise_adagrad: 1 float per row, and a 4-byte row-to-slot map";
        break;
      case EmbeddingOptimizer::sparse_adamw:
        // m and v like the table, and each row's step count (whole on every column slice).
        t.optimizer_bytes = 2 * block + l.rows_per_owner * kFloat + slot_map;
        t.optimizer_state =
            "sparse_adamw: m, v like the table, 1 step count per row and a 4-byte row-to-slot map";
        break;
    }
    t.step = embedding_step_bytes(l, bags, kPlannedIdsPerBag, sparse);
    tables.push_back(std::move(t));
  }
  return tables;
}

void write_tables_text(const std::vector<TablePlan>& tables, int64_t bags, std::ostream& out) {
  if (tables.empty()) return;
  out << "\nembedding tables (per rank; communication per training step at " << bags << " bags of "
      << kPlannedIdsPerBag << " id each):\n";
  std::vector<std::vector<std::string>> rows = {{"table", "placement", "rows x cols held",
                                                 "weights", "optimizer", "ids a2a", "sums a2a",
                                                 "col gather", "backward"}};
  TablePlan sum;
  for (const TablePlan& t : tables) {
    const EmbeddingLayout& l = t.layout;
    const std::string held = std::to_string(l.rows_per_owner) + " x " +
                             std::to_string(l.dim_per_slice) +
                             (l.sharding == EmbeddingSharding::table_wise ? " (others: 0)" : "");
    rows.push_back({l.table, t.placement, held, format_bytes(t.weight_bytes),
                    format_bytes(t.optimizer_bytes),
                    format_bytes(t.step.counts_all_to_all + t.step.ids_all_to_all),
                    format_bytes(t.step.partial_sums_all_to_all),
                    format_bytes(t.step.column_all_gather), format_bytes(t.step.backward())});
  }
  const RankBytes busiest = busiest_rank_bytes(tables);
  sum.weight_bytes = busiest.weight;
  sum.gradient_bytes = busiest.gradient;
  sum.optimizer_bytes = busiest.optimizer;
  const bool table_wise = std::any_of(tables.begin(), tables.end(), [](const TablePlan& t) {
    return t.layout.sharding == EmbeddingSharding::table_wise;
  });
  std::ostringstream table_text;
  write_table(rows, table_text);
  std::istringstream lines(table_text.str());
  for (std::string line; std::getline(lines, line);) out << "  " << line << "\n";
  int64_t ids = 0, sums = 0, gather = 0, backward = 0;
  for (const TablePlan& t : tables) {
    ids += t.step.counts_all_to_all + t.step.ids_all_to_all;
    sums += t.step.partial_sums_all_to_all;
    gather += t.step.column_all_gather;
    backward += t.step.backward();
  }
  out << "  total: weights " << format_bytes(sum.weight_bytes) << ", gradients "
      << format_bytes(sum.gradient_bytes) << ", optimizer state "
      << format_bytes(sum.optimizer_bytes) << " (" << tables.front().optimizer_state
      << ") = " << format_bytes(sum.bytes_per_rank())
      << (table_wise ? " on the most loaded rank (a table-wise table is held by its member only)"
                     : " per rank")
      << "\n";
  out << "  per step: forward ids all-to-all " << format_bytes(ids) << ", partial sums all-to-all "
      << format_bytes(sums) << ", column all-gather " << format_bytes(gather)
      << "; backward (dy all-to-all, gradient all-reduce) " << format_bytes(backward) << "; total "
      << format_bytes(ids + sums + gather + backward) << "\n";
  out << "  (one id per bag: the plan reads no data; an all-to-all counts the (n - 1) / n of what "
         "a rank sends that leaves it; each further id per bag adds 12 x bags x (n - 1) / n "
         "bytes to the ids all-to-all and, up to one part per owner, a partial sum and its dy)\n";
}

nlohmann::ordered_json tables_json(const std::vector<TablePlan>& tables, int64_t bags) {
  using json = nlohmann::ordered_json;
  json list = json::array();
  EmbeddingStepBytes total_step;
  int64_t weights = 0, gradients = 0, optimizer = 0;
  for (const TablePlan& t : tables) {
    const EmbeddingLayout& l = t.layout;
    const EmbeddingStepBytes& s = t.step;
    list.push_back({{"table", l.table},
                    {"parameter", l.weight},
                    {"shape", {l.rows, l.dim}},
                    {"placement", t.placement},
                    {"sharding", to_string(l.sharding)},
                    {"row_axes", l.row_axes},
                    {"table_wise_member", l.holder},
                    {"column_axes", l.column_axes},
                    {"rows_per_rank", l.rows_per_owner},
                    {"columns_per_rank", l.dim_per_slice},
                    {"gradient_allreduce_axes", l.gradient_allreduce},
                    {"weight_bytes_per_rank", t.weight_bytes},
                    {"gradient_bytes_per_rank", t.gradient_bytes},
                    {"optimizer_bytes_per_rank", t.optimizer_bytes},
                    {"bytes_per_rank", t.bytes_per_rank()},
                    {"step",
                     {{"ids", s.ids},
                      {"parts", s.parts},
                      {"counts_all_to_all_bytes", s.counts_all_to_all},
                      {"ids_all_to_all_bytes", s.ids_all_to_all},
                      {"partial_sums_all_to_all_bytes", s.partial_sums_all_to_all},
                      {"column_all_gather_bytes", s.column_all_gather},
                      {"backward_all_to_all_bytes", s.backward_all_to_all},
                      {"gradient_all_reduce_bytes", s.gradient_all_reduce},
                      {"touched_rows_all_gather_bytes", s.touched_rows_all_gather},
                      {"forward_bytes", s.forward()},
                      {"backward_bytes", s.backward()},
                      {"total_bytes", s.total()}}},
                    {"notes", l.notes}});
    total_step.counts_all_to_all += s.counts_all_to_all;
    total_step.ids_all_to_all += s.ids_all_to_all;
    total_step.partial_sums_all_to_all += s.partial_sums_all_to_all;
    total_step.column_all_gather += s.column_all_gather;
    total_step.backward_all_to_all += s.backward_all_to_all;
    total_step.gradient_all_reduce += s.gradient_all_reduce;
    total_step.touched_rows_all_gather += s.touched_rows_all_gather;
  }
  const RankBytes busiest = busiest_rank_bytes(tables);
  weights = busiest.weight;
  gradients = busiest.gradient;
  optimizer = busiest.optimizer;
  return {{"bags_per_rank", bags},
          {"ids_per_bag", kPlannedIdsPerBag},
          {"optimizer_state", tables.empty() ? std::string() : tables.front().optimizer_state},
          {"tables", list},
          {"totals",
           {{"weight_bytes_per_rank", weights},
            {"gradient_bytes_per_rank", gradients},
            {"optimizer_bytes_per_rank", optimizer},
            {"bytes_per_rank", weights + gradients + optimizer},
            {"all_to_all_bytes_per_step", total_step.counts_all_to_all + total_step.ids_all_to_all +
                                              total_step.partial_sums_all_to_all +
                                              total_step.backward_all_to_all},
            {"column_all_gather_bytes_per_step", total_step.column_all_gather},
            {"forward_bytes_per_step", total_step.forward()},
            {"backward_bytes_per_step", total_step.backward()},
            {"total_bytes_per_step", total_step.total()}}}};
}

// A run's plan on `world_size` ranks, what it reads, and its predicted step (none when the
// global batch does not divide by the batch shards).
// A DLRM's tables' collectives in the step's cost at the plan's bytes (one id per bag:
// embedding_step_bytes): the forward's counts, ids and partial-sum all-to-alls and column
// all-gather, the backward's dy all-to-all, the touched rows' all-gather and the gradient's
// all-reduce. The tables that exchange rows over the same group share their all-to-alls (one
// EmbeddingExchange per communicator in layers/dlrm.cpp): 4 items per group (layer
// "embeddings", "all-to-all id counts (T tables)", ...), each at its tables' bytes summed; the
// column all-gather is one item per table. The plan's figures are the bytes that leave a rank (an
// all-to-all or all-gather of S: S (n - 1) / n; an all-reduce twice that): the operand given to
// collective_seconds is S. Then the table's memory passes: its lookups and pooling, its gradient
// scatter and, under sparse updates (`sparse`), the optimizer's touched rows, at `bags` bags of
// one id each. The table's own rows are read and written at `table_bytes` an element
// (model.table_dtype); sums, gradients and optimizer state at 4.
void add_table_collectives(const std::vector<TablePlan>& tables, const Mesh& mesh,
                           const HardwareProfile& hw, int64_t bags, bool sparse,
                           int64_t table_bytes, StepCost& cost) {
  const auto group_text = [&](const std::vector<std::string>& axes) {
    std::string text = axes.size() == 1 ? axes[0] : axes_list(axes);
    return text + "=" + std::to_string(mesh.size_of(axes));
  };
  struct SparseBucketCost {
    std::vector<std::string> axes;
    int64_t touched_rows = 0, gradients = 0, tables = 0;
  };
  std::vector<SparseBucketCost> buckets;
  // The row-exchanging tables' groups: their axes of size > 1 (the communicator's ranks) and
  // the bytes of each all-to-all, summed over the group's tables.
  struct RowExchangeCost {
    std::vector<std::string> axes;
    int64_t counts = 0, ids = 0, sums = 0, dy = 0, tables = 0;
  };
  std::vector<RowExchangeCost> exchanges;
  const auto add_on = [&](const std::string& layer, const char* phase, CollectiveKind kind,
                          const std::string& what, const std::vector<std::string>& axes,
                          int64_t leaving) {
    const int n = axes.empty() ? 1 : static_cast<int>(mesh.size_of(axes));
    if (leaving <= 0 || n <= 1) return;
    const double share =
        static_cast<double>(n - 1) / n * (kind == CollectiveKind::all_reduce ? 2 : 1);
    const double seconds =
        collective_seconds(kind, static_cast<double>(leaving) / share, n, hw.group_link(axes));
    cost.items.push_back({layer, phase, "collective", what, group_text(axes), seconds});
    cost.collective_s += seconds;
    cost.total_s += seconds;
    cost.serial_s += seconds;
    cost.full_overlap_s += seconds;
  };
  for (const TablePlan& t : tables) {
    const EmbeddingLayout& l = t.layout;
    const std::string layer = "embeddings/" + l.table;
    const auto add = [&](const char* phase, CollectiveKind kind, const char* what,
                         const std::vector<std::string>& axes,
                         int64_t leaving) { add_on(layer, phase, kind, what, axes, leaving); };
    const EmbeddingStepBytes& b = t.step;
    const std::vector<std::string> row_group = mesh.active_axes(l.row_axes);
    if (!row_group.empty() &&
        b.counts_all_to_all + b.ids_all_to_all + b.partial_sums_all_to_all + b.backward_all_to_all >
            0) {
      auto same = std::find_if(exchanges.begin(), exchanges.end(),
                               [&](const RowExchangeCost& c) { return c.axes == row_group; });
      if (same == exchanges.end()) {
        exchanges.push_back({row_group});
        same = exchanges.end() - 1;
      }
      same->counts += b.counts_all_to_all;
      same->ids += b.ids_all_to_all;
      same->sums += b.partial_sums_all_to_all;
      same->dy += b.backward_all_to_all;
      ++same->tables;
    }
    add("forward", CollectiveKind::all_gather, "all-gather pooled columns", l.column_axes,
        b.column_all_gather);
    if (sparse) {
      // Sparse updates: the tables summed over the same batch axes exchange their touched rows
      // in one all-gather and their compact gradients in one all-reduce per step (layers/
      // dlrm.cpp): charged once per group below, at the group's bytes.
      if (t.step.touched_rows_all_gather > 0 || t.step.gradient_all_reduce > 0) {
        auto same = std::find_if(buckets.begin(), buckets.end(), [&](const SparseBucketCost& c) {
          return c.axes == l.gradient_allreduce;
        });
        if (same == buckets.end()) {
          buckets.push_back({l.gradient_allreduce, 0, 0, 0});
          same = buckets.end() - 1;
        }
        same->touched_rows += b.touched_rows_all_gather;
        same->gradients += b.gradient_all_reduce;
        ++same->tables;
      }
    } else {
      add("backward", CollectiveKind::all_gather, "all-gather touched rows", l.gradient_allreduce,
          b.touched_rows_all_gather);
      add("backward", CollectiveKind::all_reduce, "all-reduce table gradient", l.gradient_allreduce,
          b.gradient_all_reduce);
    }
    // The table's memory passes (layers/embedding_bag.cpp), bytes at memory_bandwidth: the
    // lookups and pooling (each id's row slice read, its id, and each bag's or part's sum
    // written; row-wise, the owner sums its parts and the requester the parts it gets back),
    // the gradient scatter (each id's dy read and its row's gradient written), and under sparse
    // updates the optimizer's touched rows (weight, gradient and the row's state read, the
    // weight and state written).
    const auto pass = [&](const char* phase, const char* what, double bytes) {
      const double seconds = bytes / hw.memory_bandwidth;
      cost.items.push_back({layer, phase, "memory", what, "", seconds});
      cost.memory_s += seconds;
      cost.total_s += seconds;
      cost.serial_s += seconds;
      cost.full_overlap_s += seconds;
    };
    const auto ids = static_cast<double>(b.ids);
    const auto row = static_cast<double>(l.dim_per_slice) * 4.0;
    const double table_row =
        static_cast<double>(l.dim_per_slice) * static_cast<double>(table_bytes);
    const double sums = static_cast<double>(b.parts > 0 ? 2 * b.parts : bags) * row;
    pass("forward", "lookups and pooling", ids * (table_row + 8.0) + sums);
    pass("backward", "gradient scatter", ids * (2.0 * row + 8.0) + sums);
    // The weight read and written (table_row each), the gradient and the state read and the
    // state written (fp32).
    if (sparse) pass("update", "sparse optimizer rows", ids * (2.0 * table_row + 3.0 * row + 8.0));
  }
  for (const RowExchangeCost& c : exchanges) {
    const std::string tables_text =
        " (" + std::to_string(c.tables) + (c.tables == 1 ? " table)" : " tables)");
    add_on("embeddings", "forward", CollectiveKind::all_to_all,
           "all-to-all id counts" + tables_text, c.axes, c.counts);
    add_on("embeddings", "forward", CollectiveKind::all_to_all, "all-to-all ids" + tables_text,
           c.axes, c.ids);
    add_on("embeddings", "forward", CollectiveKind::all_to_all,
           "all-to-all partial sums" + tables_text, c.axes, c.sums);
    add_on("embeddings", "backward", CollectiveKind::all_to_all,
           "all-to-all dy of the parts" + tables_text, c.axes, c.dy);
  }
  for (const SparseBucketCost& c : buckets) {
    const std::string tables_text = " (" + std::to_string(c.tables) + " tables)";
    add_on("embeddings", "backward", CollectiveKind::all_gather,
           "all-gather touched rows" + tables_text, c.axes, c.touched_rows);
    add_on("embeddings", "backward", CollectiveKind::all_reduce,
           "all-reduce table gradients" + tables_text, c.axes, c.gradients);
  }
}

// A DLRM's interaction (layers/dlrm.cpp, Dlrm::interact and interact_backward) on `rows` local
// rows, layer "interaction": forward the features placed side by side (W = d + the tables' dims
// floats a row, read and written) and, for dot, the pairwise products (rows x pairs x d
// multiply-adds at the profile's "dlrm_dot_forward" rate; not measured: 2 flops each at
// gemm_flops, which a scalar loop does not reach) or, for cat, the copy into the top's input;
// backward the products' gradient (twice the multiply-adds, "dlrm_dot_backward") or cat's copy,
// then every block's gradient copied out of the features' gradient (W a row). Every item is in
// the "memory" category (memory_s), the dot products at gemm_flops too: as the cost model's
// elementwise kernels at their measured rates, "memory" holds every pass that is not a GEMM call
// or a collective; gemm_s counts the gemm() calls alone.
void add_dlrm_interaction(const DlrmShape& shape, int64_t rows, const HardwareProfile& hw,
                          StepCost& cost) {
  const auto add = [&](const char* phase, const std::string& what, double seconds) {
    cost.items.push_back({"interaction", phase, "memory", what, "", seconds});
    cost.memory_s += seconds;
    cost.total_s += seconds;
    cost.serial_s += seconds;
    cost.full_overlap_s += seconds;
  };
  int64_t width = shape.bottom.back();
  for (const DlrmTable& t : shape.tables) width += t.dim;
  const double r = static_cast<double>(rows);
  const double copy = 2.0 * r * static_cast<double>(width) * 4.0 / hw.memory_bandwidth;
  add("forward", "place features [" + std::to_string(rows) + " x " + std::to_string(width) + "]",
      copy);
  const auto rate = [&](const char* kernel) {
    const auto it = hw.elementwise_rates.find(kernel);
    return it == hw.elementwise_rates.end() ? 0.0 : it->second;
  };
  if (shape.interaction == DlrmInteraction::dot) {
    const int64_t d = shape.bottom.back();
    const int64_t pairs = dlrm_interaction_width(shape) - d;
    const double mads = r * static_cast<double>(pairs * d);
    const std::string shape_text = " [" + std::to_string(rows) + " x " + std::to_string(pairs) +
                                   " pairs x " + std::to_string(d) + "]";
    const double forward = rate("dlrm_dot_forward");
    const double backward = rate("dlrm_dot_backward");
    add("forward",
        "dot interaction" + shape_text +
            (forward > 0 ? " (dlrm_dot_forward at its measured rate)" : " (at gemm_flops)"),
        forward > 0 ? mads / forward : 2.0 * mads / hw.gemm_flops);
    add("backward",
        "dot interaction gradient" + shape_text +
            (backward > 0 ? " (dlrm_dot_backward at its measured rate)" : " (at gemm_flops)"),
        backward > 0 ? 2.0 * mads / backward : 4.0 * mads / hw.gemm_flops);
  } else {
    add("forward", "cat: copy into the top's input", copy);
    add("backward", "cat: copy out of the top's input gradient", copy);
  }
  add("backward", "take each block's gradient", copy);
}

// A DLRM's tables in the plan's totals: the planner counts every parameter as a dense one (a
// gradient like it and options.optimizer_slots like it); with sparse updates a table has no
// gradient and its own state (table_plans). The difference on the most loaded rank replaces
// the planner's count, so "per rank" and its total are the run's. All three figures move: with
// table-wise tables the most loaded member under sparse updates need not be the one the
// planner's dense count picked, and the totals must be one member's, not a mix.
void use_table_totals(const RunConfig& config, const PlanOptions& options, ShardingPlan& plan) {
  if (!options.sparse_tables || options.zero_stage != 0) return;
  const std::vector<TablePlan> actual = table_plans(config, plan, options);
  std::vector<TablePlan> dense = actual;
  for (TablePlan& t : dense) {
    t.gradient_bytes = t.weight_bytes;
    t.optimizer_bytes = t.weight_bytes * options.optimizer_slots;
  }
  const RankBytes now = busiest_rank_bytes(actual);
  const RankBytes planned = busiest_rank_bytes(dense);
  plan.totals.parameter_bytes += now.weight - planned.weight;
  plan.totals.gradient_bytes += now.gradient - planned.gradient;
  plan.totals.optimizer_bytes += now.optimizer - planned.optimizer;
}

struct PlannedStep {
  std::vector<PartitionRule> rules;
  PlanOptions options;
  std::vector<ParameterShape> shapes;
  std::vector<LinearLayerParameters> layers;
  ShardingPlan plan;
  PlannedMemory memory;
  std::optional<StepCost> cost;
};

PlannedStep plan_step(const RunConfig& config, int world_size, const HardwareProfile& hw) {
  const Mesh mesh = config.mesh.resolve(world_size);
  std::vector<PartitionRule> rules = partition_rules(config);
  PlanOptions options = plan_options(config);
  std::vector<ParameterShape> shapes = model_parameter_shapes(config.model);
  std::vector<LinearLayerParameters> layers = model_linear_layers(config.model);
  ShardingPlan plan =
      make_plan(shapes, mesh, rules, options, layers, model_norm_layers(config.model));
  use_table_totals(config, options, plan);
  PlannedMemory memory = planned_memory(config, plan, hw);
  // The plan's table shows the memory model's evaluation buffers.
  plan.totals.evaluation_bytes = memory.totals.evaluation_bytes;
  // And its gradients at their stored size (2 bytes an element where stored as 16 bits).
  plan.totals.gradient_bytes = memory.totals.gradient_bytes;
  const DataFootprint& data = memory.data;
  std::optional<StepCost> cost;
  if (plan.local_batch_rows > 0) {
    cost = predict_step(plan, options, hw, config.partition.collective_matmul);
    add_table_collectives(table_plans(config, plan, options), mesh, hw, plan.local_batch_rows,
                          options.sparse_tables, options.table_bytes_per_element, *cost);
    if (config.model.kind == ModelKind::dlrm) {
      add_dlrm_interaction(config.model.dlrm(), plan.local_batch_rows, hw, *cost);
    }
    // A DLRM's readers agree on the ids' checks over the run's communicator (the world).
    DataRead read = data.read;
    if (read.tables > 0) {
      read.agree_ranks = mesh.world_size();
      read.agree_axes = mesh.active_axes();
    }
    add_data_read(*cost, read, hw);
  }
  return {std::move(rules), std::move(options), std::move(shapes), std::move(layers),
          std::move(plan),  std::move(memory),  std::move(cost)};
}

}  // namespace

std::optional<StepCost> predict_run_step(const RunConfig& config, int world_size,
                                         const HardwareProfile& hardware) {
  return plan_step(config, world_size, hardware).cost;
}

void print_plan(const RunConfig& config, int world_size, bool json, std::ostream& out,
                const HardwareProfile* hardware) {
  const HardwareProfile hw = hardware ? *hardware : default_hardware_profile();
  const PlannedStep planned = plan_step(config, world_size, hw);
  const std::vector<PartitionRule>& rules = planned.rules;
  const PlanOptions& options = planned.options;
  const std::vector<ParameterShape>& shapes = planned.shapes;
  const std::vector<LinearLayerParameters>& layers = planned.layers;
  const ShardingPlan& plan = planned.plan;
  const DataFootprint& data = planned.memory.data;
  const int64_t staging = planned.memory.checkpoint_staging_bytes;
  const RingReductionBytes& ring = planned.memory.ring;
  const CollectiveMatmulAlgorithm algorithm = config.partition.collective_matmul;
  const std::optional<StepCost>& cost = planned.cost;
  std::vector<ScalingRow> scaling;
  if (cost) {
    for (int ranks : scaling_ranks()) {
      ScalingRow row = scaled_cost(plan, shapes, rules, options, layers, hw, algorithm, ranks);
      DataRead read = data.read;  // the same rows per rank, of a larger global batch
      read.global_rows = row.global_batch;
      if (row.fits) add_data_read(row.cost, read, hw);
      scaling.push_back(std::move(row));
    }
  }
  const std::vector<GroupReduction> reductions = planned_reductions(plan, config, hw);
  const char* algorithm_name = to_string(config.runtime.reductions);
  const bool measured = config.runtime.reductions == ReductionAlgorithm::measure;
  const std::vector<TablePlan> tables = table_plans(config, plan, options);
  if (json) {
    auto doc = plan_to_json(plan, rules, options, config.file);
    nlohmann::ordered_json groups = nlohmann::ordered_json::array();
    for (const GroupReduction& g : reductions) {
      const auto from = [&](std::size_t bytes) -> nlohmann::ordered_json {
        if (measured) return nullptr;
        if (bytes == ReductionChoice::kNever) return "never";
        return static_cast<int64_t>(bytes);
      };
      groups.push_back(
          {{"axes", g.axes},
           {"ranks", g.ranks},
           {"choice", measured ? std::string("measured at start") : describe(g.choice)},
           {"reduce_scatter_ring_from", from(g.choice.reduce_scatter_ring_from)},
           {"all_reduce_ring_from", from(g.choice.all_reduce_ring_from)}});
    }
    doc["reductions"] = {{"algorithm", algorithm_name}, {"groups", groups}};
    if (!tables.empty()) doc["embedding_tables"] = tables_json(tables, plan.local_batch_rows);
    const TrainingWorkspace& w = planned.memory.workspace;
    doc["totals"]["activation_bytes"] = w.activation_bytes;
    doc["totals"]["batch_buffer_bytes"] = w.batch_bytes;
    doc["totals"]["gathered_weight_bytes"] = w.gathered_weight_bytes;
    doc["totals"]["sixteen_bit_copy_bytes"] = w.sixteen_bit_copy_bytes;  // (of gathered weights)
    doc["totals"]["collective_matmul_workspace_bytes"] = w.collective_matmul_bytes;
    doc["totals"]["communicator_scratch_bytes"] = w.comm_scratch_bytes;
    doc["totals"]["checkpoint_staging_bytes"] = staging;
    doc["totals"]["checkpoint_staging_bytes_by_rank"] = planned.memory.checkpoint_staging_by_rank;
    doc["totals"]["data_source_bytes"] = data.source_bytes;
    doc["totals"]["data_staging_bytes"] = data.staging_bytes;
    doc["totals"]["data_chunk_cache_bytes"] = data.cache_bytes;
    doc["totals"]["ring_reduction_bytes"] = ring.total();
    doc["totals"]["bytes_per_rank"] = planned.memory.total_bytes();
    doc["totals"]["kokkos_bytes_per_rank"] = planned.memory.kokkos_bytes();
    if (cost) {
      doc["cost"] = cost_json(*cost, hw);
      nlohmann::ordered_json rows = nlohmann::ordered_json::array();
      for (const auto& r : scaling) {
        if (!r.fits) continue;
        rows.push_back({{"ranks", r.ranks},
                        {"mesh", r.mesh},
                        {"global_batch", r.global_batch},
                        {"step_s", r.cost.total_s},
                        {"compute_s", r.cost.gemm_s + r.cost.memory_s},
                        {"communication_s", r.cost.collective_s + r.cost.collective_matmul_s}});
      }
      doc["scaling"] = rows;
    }
    out << doc.dump(2) << "\n";
  } else {
    const std::vector<int64_t>& by_rank = planned.memory.checkpoint_staging_by_rank;
    const bool some_ranks =
        std::any_of(by_rank.begin(), by_rank.end(), [&](int64_t b) { return b != staging; });
    write_plan_text(plan, rules, options, config.file, out, staging, &data, &ring,
                    &planned.memory.workspace, some_ranks);
    write_tables_text(tables, plan.local_batch_rows, out);
    // The groups' reduction algorithm, as the run chooses it under the same profile.
    if (!reductions.empty()) {
      out << "reductions (runtime.reductions = \"" << algorithm_name
          << "\", hardware: " << hw.source << "):\n";
      for (const GroupReduction& g : reductions) {
        out << "  " << axis_product_text(SpecEntry{g.axes}, plan.mesh) << ": "
            << (measured ? "timed when the run starts (the ring's buffers counted)"
                         : describe(g.choice))
            << "\n";
      }
    }
    if (cost) {
      write_cost_text(plan, options.global_batch, *cost, hw, algorithm, scaling, out);
    } else {
      out << "\nstep time: not predicted (the global batch does not divide by the batch "
             "shards)\n";
    }
  }
}

}  // namespace meshtrain
