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
          {"items", items},
          {"collective_matmuls", matmuls}};
}

}  // namespace

const std::vector<int>& scaling_ranks() {
  static const std::vector<int> ranks = {64, 256, 1024};
  return ranks;
}

namespace {

// Whether the run's groups are MPI communicators, whose reductions follow [runtime] reductions
// (NCCL's ignore it).
bool mpi_reductions(const RuntimeSection& runtime) {
  return runtime.backend == CommBackendChoice::mpi ||
         (runtime.backend == CommBackendChoice::automatic && !build_supports_nccl());
}

// The choice the run's group over `axes` makes (reduction_choice.hpp, the one resolution);
// "measure", decided by timing at run time, counted as the ring everywhere (an upper bound).
ReductionChoice group_choice(const RunConfig& config, const std::vector<std::string>& axes,
                             const HardwareProfile& hardware) {
  return planned_reduction_choice(config.runtime.reductions, axes, hardware)
      .value_or(ReductionChoice::ring());
}

bool is_reduction(const LayerCollective& c) {
  return c.ranks >= 2 &&
         (c.kind == CollectiveKind::reduce_scatter || c.kind == CollectiveKind::all_reduce);
}

// Every collective of the plan's layers and norms, in order.
template <class Fn>
void for_each_collective(const ShardingPlan& plan, Fn&& fn) {
  for (const LayerPlan& l : plan.layers) {
    for (const LayerCollective& c : l.collectives) fn(c);
  }
  for (const NormPlan& n : plan.norms) {
    for (const LayerCollective& c : n.collectives) fn(c);
  }
}

}  // namespace

std::vector<GroupReduction> planned_reductions(const ShardingPlan& plan, const RunConfig& config,
                                               const HardwareProfile& hardware) {
  std::vector<GroupReduction> groups;
  if (!mpi_reductions(config.runtime)) return groups;
  std::map<std::vector<std::string>, bool> seen;
  for_each_collective(plan, [&](const LayerCollective& c) {
    if (!is_reduction(c)) return;
    std::vector<std::string> key = c.axes;
    std::sort(key.begin(), key.end());
    if (seen[key]) return;
    seen[key] = true;
    groups.push_back({c.axes, c.ranks, group_choice(config, c.axes, hardware)});
  });
  return groups;
}

RingReductionBytes ring_reduction_bytes(const ShardingPlan& plan, const RunConfig& config,
                                        const HardwareProfile& hardware) {
  RingReductionBytes bytes;
  const RuntimeSection& runtime = config.runtime;
  if (!mpi_reductions(runtime)) return bytes;
  // DP buckets: overlap with the gradients reduced in backward (not ZeRO-1, not accumulated).
  const bool buckets =
      runtime.overlap && config.optimizer.zero_stage != 1 && config.train.accumulation_steps == 1;
  std::map<std::vector<std::string>, int64_t> largest;  // per group: its largest buffers
  // `evaluation`: a collective of the evaluation model (below), which reserves only its layers'
  // blocking reductions at its rows (the gradients' are the training model's sizes).
  const auto count = [&](const LayerCollective& c, bool evaluation) {
    if (!is_reduction(c)) return;
    int64_t elements = 1;
    for (int64_t d : c.shape) elements *= d;
    const std::size_t message = static_cast<std::size_t>(elements * c.element_bytes);
    const ReductionChoice choice = group_choice(config, c.axes, hardware);
    const int64_t block = (elements + c.ranks - 1) / c.ranks * c.element_bytes;
    const int64_t buffers = c.ranks == 2 ? 1 : 2;
    const bool gradient = c.operand == "weight gradient" || c.operand == "bias gradient";
    if (evaluation && gradient) return;
    if (buckets && gradient && c.kind == CollectiveKind::all_reduce) {
      // A started all-reduce keeps its own partial sums when it runs on the ring.
      if (message >= choice.all_reduce_ring_from) bytes.started += block * buffers;
      return;
    }
    // A blocking reduction reserves the ring's buffers when either kind would take the ring at
    // its size (MpiCommunicator::raw_reserve_reductions).
    if (message < std::min(choice.reduce_scatter_ring_from, choice.all_reduce_ring_from)) return;
    std::vector<std::string> group = c.axes;
    std::sort(group.begin(), group.end());
    int64_t& most = largest[group];
    most = std::max(most, block * buffers);
  };
  for_each_collective(plan, [&](const LayerCollective& c) { count(c, false); });
  // A separate evaluation model (data.eval_batch_size of other rows per rank) reserves its
  // layers' reductions at its rows on the same communicators, and under overlap builds DP
  // gradient buckets of its own, each with its started ring, though it never runs backward.
  const int64_t eval_rows = evaluation_rows(config, plan);
  if (eval_rows > 0 && eval_rows != plan.local_batch_rows) {
    PlanOptions options = plan_options(config);
    options.global_batch = eval_rows * (config.data.batch_size / plan.local_batch_rows);
    options.eval_global_batch = 0;
    // With norms when `plan` has them (a run's own plan is made without).
    const ShardingPlan evaluation = make_plan(
        model_parameter_shapes(config.model), plan.mesh, partition_rules(config), options,
        model_linear_layers(config.model),
        plan.norms.empty() ? std::vector<NormLayerParameters>{} : model_norm_layers(config.model));
    for_each_collective(evaluation, [&](const LayerCollective& c) { count(c, true); });
    bytes.started *= 2;
  }
  for (const auto& [group, most] : largest) bytes.blocking += most;
  return bytes;
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

// A run's plan on `world_size` ranks, what it reads, and its predicted step (none when the
// global batch does not divide by the batch shards).
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
  PlannedMemory memory = planned_memory(config, plan, hw);
  // The plan's table shows the memory model's evaluation buffers.
  plan.totals.evaluation_bytes = memory.totals.evaluation_bytes;
  const DataFootprint& data = memory.data;
  std::optional<StepCost> cost;
  if (plan.local_batch_rows > 0) {
    cost = predict_step(plan, options, hw, config.partition.collective_matmul);
    add_data_read(*cost, data.read, hw);
  }
  return {std::move(rules), std::move(options), std::move(shapes), std::move(layers),
          std::move(plan),  std::move(memory),  std::move(cost)};
}

}  // namespace

namespace {

// The workspace of a model built for `rows` rows per rank (the training model, or the
// evaluation's forward-only copy), with each communicator's largest scratch in floats by its axes
// in `comm_scratch` (merged by maximum over models sharing the communicators).
TrainingWorkspace workspace_for_rows(const RunConfig& config, const ShardingPlan& plan,
                                     int64_t rows,
                                     std::map<std::vector<std::string>, int64_t>& comm_scratch) {
  TrainingWorkspace w;
  if (rows <= 0 || plan.layers.empty()) return w;
  constexpr int64_t kFloat = sizeof(float);
  const MixedPrecision precision = config.mixed_precision.policy();
  const bool fp32 = precision.param == Dtype::fp32;
  const bool residual = config.model.kind == ModelKind::residual_mlp;
  const bool gated = residual && config.model.residual().gated;
  // The shared scratch's needs in floats (LayerScratchNeeds, merged by maximum over the layers)
  // and each communicator's largest scratch, by its axes.
  int64_t weight = 0, prefetch = 0, grad = 0, stage = 0, bias = 0, matmul_bytes = 0;
  const auto reserve = [&](const std::vector<std::string>& axes, int64_t floats) {
    int64_t& most = comm_scratch[axes];
    most = std::max(most, floats);
  };
  int64_t activation_floats = 0;
  const size_t n = plan.layers.size();
  for (size_t i = 0; i < n; ++i) {
    const LayerPlan& layer = plan.layers[i];
    if (layer.moe) continue;  // an MoE layer's buffers: its dispatch buffers (totals) only
    const LinearLayout& l = layer.layout;
    // Linear's buffers (layers/linear.cpp).
    if (l.slices_input() || l.gathers_input()) activation_floats += rows * l.in_compute;  // input
    activation_floats += rows * l.out_local;                                              // output
    if (l.column_gathers_input()) {
      activation_floats += rows * l.input_width();  // input_grad
    } else {
      activation_floats += rows * l.in_compute;  // input_grad_compute
    }
    if (l.slices_input() || l.gathers_input()) activation_floats += rows * l.input_width();
    // The layer that follows it in a plain MLP: its activation (and dropout); in a residual
    // block, the up projection's activation or the gate's SwiGLU (layers/swiglu.cpp).
    const bool hidden =
        residual ? layer.name.size() > 3 && layer.name.compare(layer.name.size() - 3, 3, "/up") == 0
                 : i + 1 < n;
    const bool gate = residual && layer.name.size() > 5 &&
                      layer.name.compare(layer.name.size() - 5, 5, "/gate") == 0;
    if (hidden && !(residual && gated)) {
      activation_floats += rows * l.out_local;
      if (config.model.dropout > 0.0) activation_floats += rows * l.out_local;
    }
    if (gate) {
      // output, gate and value gradients; the input gradient: with a shared gather of the
      // input (both fed it replicated) the gathered input, its partial gradient and this
      // rank's block of it, else the input's width.
      activation_floats += 3 * rows * l.out_local;
      if (l.input_grad_partial) {
        activation_floats += 2 * rows * l.in + rows * l.in / l.tp;
      } else {
        activation_floats += rows * l.input_width();
      }
      if (config.model.dropout > 0.0) activation_floats += rows * l.out_local;
    }
    // Its parameters' needs of the shared scratch (ShardedParameter::scratch_needs).
    const int64_t d1 = l.in_compute, d2 = l.compute_cols(), s1 = l.stored_rows, s2 = l.stored_cols;
    const bool gathered = l.gathers_weight();
    if (gathered || !fp32) weight = std::max(weight, d1 * d2);
    if (gathered) grad = std::max(grad, d1 * d2);
    const bool two_gathers = !l.weight_gather_dim0.empty() && !l.weight_gather_dim1.empty();
    if (two_gathers) stage = std::max(stage, std::max(d1 * s2, s1 * d2));
    // Prefetched (overlap) when gathered over one group.
    if (config.runtime.overlap && gathered && !two_gathers) prefetch = std::max(prefetch, d1 * d2);
    if (!l.bias_gather.empty() || !l.bias_direct) bias = std::max(bias, l.out);
    int64_t matmul = 0;
    if (l.tensor_parallel) matmul = 3 * rows * l.out * kFloat;
    if (l.column_gathers_input()) matmul = 3 * rows * l.in * kFloat;
    matmul_bytes = std::max(matmul_bytes, matmul);
    if (!l.weight_gather_dim1.empty()) reserve(l.weight_gather_dim1, d1 * d2);
    if (l.tp > 1) reserve({l.feature_axis}, rows * std::max(l.in, l.out));
  }
  // Norms (layers/norm.cpp) and residual blocks (layers/residual_block.cpp): the stream's width
  // as the input projection leaves it.
  // (A run's plan is made without its norms: their layouts are decided here as `plan` does.)
  std::vector<NormPlan> norms = plan.norms;
  if (norms.empty() && config.model.has_norms()) {
    norms = make_plan(model_parameter_shapes(config.model), plan.mesh, partition_rules(config),
                      plan_options(config), model_linear_layers(config.model),
                      model_norm_layers(config.model))
                .norms;
  }
  for (const NormPlan& norm : norms) {
    const NormLayout& l = norm.layout;
    activation_floats += rows * (1 + 2 + 3) + 2 * rows * l.local_width;
    // Full-width gradients ([scale | bias], when not direct) and each gathered parameter's own
    // buffer (layers/norm.cpp, layers/sharded_parameter.cpp: full_width_sum).
    if (!l.direct) activation_floats += static_cast<int64_t>(l.params.size()) * l.width;
    for (const NormParameterLayout& p : l.params) {
      if (!p.gather.empty()) activation_floats += p.gathered;
    }
  }
  if (residual) {
    const int64_t width = plan.layers.front().layout.out_local;
    activation_floats += 2 * rows * width * config.model.residual().depth;
  }
  // The model's 16-bit input copy and output gradient (layers/mlp.cpp).
  const LinearLayout& last = plan.layers.back().layout;
  const int64_t outputs = config.model.output_width();
  if (!fp32) activation_floats += rows * config.model.input_width();
  if (!fp32 || precision.needs_loss_scaling()) activation_floats += rows * last.out_local;
  // The loss (layers/loss.cpp): gradient, row maxima, statistics, per-row losses.
  const bool split = last.tp > 1 && last.output_layout() == FeatureLayout::split;
  const int64_t local_width = split ? outputs / last.tp : outputs;
  activation_floats += rows * (local_width + 1 + (split ? last.tp : 1) + 3 + 1);
  if (split) reserve({last.feature_axis}, rows * last.tp);
  // The loss's three double sums, and their host mirror where device memory is separate.
  const int64_t loss_scalars = (kDeviceMemoryIsSeparate ? 2 : 1) * 3 * sizeof(double);
  w.activation_bytes = activation_floats * kFloat + loss_scalars;
  // The batch (run/training_run.cpp): inputs, and int32 labels or float targets.
  const bool labels = config.model.loss == LossKind::cross_entropy;
  w.batch_bytes = rows * config.model.input_width() * kFloat +
                  (labels ? rows * static_cast<int64_t>(sizeof(int32_t)) : rows * outputs * kFloat);
  w.gathered_weight_bytes = (weight + prefetch + grad + stage + bias) * kFloat;
  // CollectiveMatmulWorkspace::reserve rounds up to whole floats.
  w.collective_matmul_bytes = (matmul_bytes + kFloat - 1) / kFloat * kFloat;
  return w;
}

int64_t scratch_bytes(const std::map<std::vector<std::string>, int64_t>& comm_scratch) {
  int64_t bytes = 0;
  for (const auto& [axes, floats] : comm_scratch)
    bytes += floats * static_cast<int64_t>(sizeof(float));
  return bytes;
}

}  // namespace

int64_t evaluation_rows(const RunConfig& config, const ShardingPlan& plan) {
  if (plan.local_batch_rows <= 0) return 0;
  const int64_t eval_batch = config.data.eval_batch_size.value_or(config.data.batch_size);
  const int64_t shards = config.data.batch_size / plan.local_batch_rows;
  return shards > 0 && eval_batch % shards == 0 ? eval_batch / shards : 0;
}

TrainingWorkspace training_workspace(const RunConfig& config, const ShardingPlan& plan) {
  std::map<std::vector<std::string>, int64_t> comm_scratch;
  TrainingWorkspace w = workspace_for_rows(config, plan, plan.local_batch_rows, comm_scratch);
  // A separate evaluation model shares the communicators, whose scratch grows to its rows when
  // they are more.
  const int64_t eval_rows = evaluation_rows(config, plan);
  if (eval_rows > 0 && eval_rows != plan.local_batch_rows) {
    std::map<std::vector<std::string>, int64_t> eval_scratch;
    workspace_for_rows(config, plan, eval_rows, eval_scratch);
    for (const auto& [axes, floats] : eval_scratch) {
      int64_t& most = comm_scratch[axes];
      most = std::max(most, floats);
    }
  }
  w.comm_scratch_bytes = scratch_bytes(comm_scratch);
  return w;
}

EvaluationBuffers evaluation_buffers(const RunConfig& config, const ShardingPlan& plan) {
  EvaluationBuffers e;
  const int64_t rows = evaluation_rows(config, plan);
  // The run builds a forward-only model for the evaluation batch only when its rows per rank
  // differ from the training batch's (run/training_run.cpp); it allocates what the training
  // model does at its rows.
  if (rows <= 0 || rows == plan.local_batch_rows) return e;
  std::map<std::vector<std::string>, int64_t> ignored;
  const TrainingWorkspace eval = workspace_for_rows(config, plan, rows, ignored);
  e.activation_bytes = eval.activation_bytes;
  e.batch_bytes = eval.batch_bytes;
  // Each model has a LayerScratch of its own: gathered weights and collective matmul workspace.
  e.gathered_weight_bytes = eval.gathered_weight_bytes;
  e.collective_matmul_bytes = eval.collective_matmul_bytes;
  return e;
}

PlannedMemory planned_memory(const RunConfig& config, const ShardingPlan& plan,
                             const HardwareProfile& hardware) {
  PlannedMemory memory;
  memory.totals = plan.totals;
  memory.workspace = training_workspace(config, plan);
  // The evaluation model's buffers as the memory model counts them (the planner's estimate,
  // its inputs and each layer's output, misses a residual model's norms and sums and every
  // layer's backward buffers, which the forward-only copy allocates too).
  memory.evaluation = evaluation_buffers(config, plan);
  memory.totals.evaluation_bytes = memory.evaluation.total_bytes();
  // A checkpoint that stages (asynchronous, or from device memory) copies the blocks a rank
  // writes: the blocks of its parameters and optimizer state it owns (owns_block: one replica
  // of each block writes it; under dp rank 0 alone). ZeRO-1's optimizer chunks are every
  // rank's own: counted on every rank.
  if (checkpoint_stages_tensors(config.checkpoint.async)) {
    const int world = plan.mesh.world_size();
    const bool zero1 = plan.totals.zero1_buffer_bytes > 0;
    const int64_t slots = plan_options(config).optimizer_slots;
    memory.checkpoint_staging_by_rank.assign(static_cast<size_t>(world), 0);
    for (int r = 0; r < world; ++r) {
      int64_t& bytes = memory.checkpoint_staging_by_rank[static_cast<size_t>(r)];
      if (zero1) bytes = plan.totals.optimizer_bytes;
      for (const auto& p : plan.parameters) {
        if (!owns_block(plan.mesh, r, p.spec)) continue;
        bytes += p.bytes_per_rank * (zero1 ? 1 : 1 + slots);
      }
      memory.checkpoint_staging_bytes = std::max(memory.checkpoint_staging_bytes, bytes);
    }
  }
  // This rank's rows of a batch and of an evaluation batch (the plan's batch shards).
  const int64_t eval_rows = evaluation_rows(config, plan);
  const DataUse use{config.model.input_width(), config.model.output_width(),
                    config.model.loss == LossKind::cross_entropy, config.train.accumulation_steps};
  memory.data =
      data_footprint(config.data, use, std::max<int64_t>(plan.local_batch_rows, 0), eval_rows);
  memory.ring = ring_reduction_bytes(plan, config, hardware);
  return memory;
}

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
    const TrainingWorkspace& w = planned.memory.workspace;
    doc["totals"]["activation_bytes"] = w.activation_bytes;
    doc["totals"]["batch_buffer_bytes"] = w.batch_bytes;
    doc["totals"]["gathered_weight_bytes"] = w.gathered_weight_bytes;
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
