#pragma once
// `meshtrain plan`: how each parameter of a run is sharded over the mesh and how many bytes
// every rank holds. Pure planning (no MPI), so it answers for any world size.

#include <nlohmann/json.hpp>

#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "framework/comm/communicator.hpp"  // ReductionChoice
#include "framework/io/data.hpp"            // DataFootprint
#include "framework/train/memory_plan.hpp"
#include "partition/cost_model.hpp"
#include "partition/planner.hpp"
#include "partition/rules.hpp"

namespace meshtrain {

struct RunConfig;

// Prints the plan of `config` for `world_size` ranks: header, table, totals, the layers
// (compute layout, notes, collectives per training step with bytes per rank; for an MoE layer
// its experts per rank and dispatch buffers, its all-to-alls' bytes at uniform routing),
// unused rules and sharding pictures (meshes of up to 16 ranks; a 3-D tensor drawn as
// [d0, d1 x d2]), or with `json` one JSON document.
// Throws meshtrain::Error on bad input.
// The plan also predicts the step time (partition/cost_model.hpp) on `hardware` (nullptr:
// default_hardware_profile()), with a table extrapolated to 64, 256 and 1024 ranks
// (text: "step time" and "scaling" sections; JSON: "cost" and "scaling"). The JSON totals add
// the staging and data bytes to "bytes_per_rank" (PlannedMemory::total_bytes) and give
// "kokkos_bytes_per_rank" (PlannedMemory::kokkos_bytes).
void print_plan(const RunConfig& config, int world_size, bool json, std::ostream& out,
                const HardwareProfile* hardware = nullptr);
// The step the cost model predicts for `config` on `world_size` ranks with `hardware` (the
// one print_plan shows); none when the global batch does not divide by the batch shards.
std::optional<StepCost> predict_run_step(const RunConfig& config, int world_size,
                                         const HardwareProfile& hardware);

// The ranks of the scaling table.
const std::vector<int>& scaling_ranks();

// The text form of `plan`; `source` names the config file in the header.
// `staging_bytes`: the asynchronous checkpoint's staging buffer per rank (0 when saves are
// synchronous), shown and counted in the per-rank total; `data` (may be null): the data
// path's host memory per rank (data_footprint), shown and counted too; `ring` (may be null):
// the ring reductions' buffers, shown and counted too; `workspace` (may be null): the training
// step's workspace, one line per item, counted; `staging_on_some_ranks`: the staging figure is
// the largest rank's (some ranks stage less), said so.
void write_plan_text(const ShardingPlan& plan, const std::vector<PartitionRule>& rules,
                     const PlanOptions& options, const std::string& source, std::ostream& out,
                     int64_t staging_bytes = 0, const DataFootprint* data = nullptr,
                     const RingReductionBytes* ring = nullptr,
                     const TrainingWorkspace* workspace = nullptr,
                     bool staging_on_some_ranks = false);

// The JSON form: {"config", "mesh": {"world_size", "axes": {name: size, ...} in mesh order},
// "options", "rules", "parameters": [{"name", "shape", "rule", "spec", "local_shape",
// "bytes_per_rank", "replicas", "notes"}], "local_batch_rows", "layers": [{"name", "compute",
// "moe", "tensor_parallel", "column_parallel", "input_layout", "output_layout", "collectives":
// [{"phase", "kind", "operand", "axes", "ranks", "shape", "bytes_per_rank", and for an all-to-all
// "at_uniform_routing": true}], "collective_bytes_per_step", "notes", and for an MoE layer
// "moe_layout": {"in", "out", "experts", "top_k", "experts_per_rank", "expert_axes", "ep",
// "batch_axes", "feature_axis", "gathers_input", "router", "experts_weight", "experts_bias"
// (each {"name", "compute_shape", "stored_shape", "bytes_per_rank", "gather_axes",
// "gradient_allreduce_axes", "nonbatch_replication", "all_experts"}),
// "buffer_bytes_per_rank"}}], "notes" (about the whole plan), "totals" (with
// "collective_bytes_per_step" and "moe_buffer_bytes"), "unused_rules"}. A spec entry is null,
// an axis name, or a list of axis names.
nlohmann::ordered_json plan_to_json(const ShardingPlan& plan,
                                    const std::vector<PartitionRule>& rules,
                                    const PlanOptions& options, const std::string& source);

}  // namespace meshtrain
