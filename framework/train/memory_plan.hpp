#pragma once
// The memory model of a run: what each rank allocates besides the tensors the sharding plan
// counts (the training step's workspace, the evaluation model's buffers, the ring reductions'
// partial sums, checkpoint staging, the data path), as the run's code allocates it. `meshtrain
// plan` prints it (plan_report.hpp) and the run compares its measured memory with it
// (docs/running.md, "Memory against the plan"). Pure planning, no MPI.

#include <cstdint>
#include <string>
#include <vector>

#include "framework/comm/communicator.hpp"  // ReductionChoice
#include "framework/io/data.hpp"            // DataFootprint
#include "partition/cost_model.hpp"         // HardwareProfile
#include "partition/planner.hpp"

namespace meshtrain {

struct RunConfig;

// The MPI backend's ring reductions' partial-sum buffers per rank (framework/comm/backends/
// mpi_ring.hpp) for a run of `plan` under `config`'s [runtime] reductions, backend, overlap
// and gradient reduction, with the hardware profile the run uses (train --hardware, plan
// --hardware; default_hardware_profile() without one): each communicator (mesh group) keeps,
// for its blocking reductions that run on the ring, one block (ceil(elements / ranks)) of the
// largest of them, twice beyond 2 ranks; under overlap each DP gradient bucket's started ring
// keeps its own (the gradient all-reduces' blocks summed: within one element per bucket of the
// buckets'). Which sizes run on the ring is the group's choice as the run makes it
// (planned_reduction_choice, framework/comm/reduction_choice.hpp): all with "ring", with
// "auto" from the profile's measured sizes for the group's links (64 KiB where the profile
// did not measure the ring), all with "measure" (an upper bound), none with "mpi" or the NCCL
// backend.
struct RingReductionBytes {
  int64_t blocking = 0;
  int64_t started = 0;
  int64_t total() const { return blocking + started; }
};
RingReductionBytes ring_reduction_bytes(const ShardingPlan& plan, const RunConfig& config,
                                        const HardwareProfile& hardware);

// The reduction algorithm of each mesh group that reduces in the plan's step (reduce-scatters
// and all-reduces over 2 or more ranks), in the plan's order, as the run chooses it under
// `hardware` ("measure": the ring, an upper bound); empty on the NCCL backend.
struct GroupReduction {
  std::vector<std::string> axes;
  int ranks = 0;
  ReductionChoice choice;
};
std::vector<GroupReduction> planned_reductions(const ShardingPlan& plan, const RunConfig& config,
                                               const HardwareProfile& hardware);

// What a training step works in besides the tensors, per rank: Kokkos Views a run allocates
// once at construction, counted from the code that allocates them (layers/, run/), so that the
// measured Kokkos peak can be compared with the plan (docs/running.md, "Memory against the
// plan"). Each field is one plan item; its labels are how the run matches allocations to it.
struct TrainingWorkspace {
  // "activations": every layer's buffers of a training step, for a dense layer (Linear) its
  // output, the input block it keeps for backward and its input gradient, an activation's
  // and dropout's output, a norm's statistics, a residual block's sum and gradient, the loss's
  // gradient and row statistics (labels "layers/...", "blocks/...", "output_norm/...",
  // "model/...", "meshtrain::loss_*"). MoE layers' own buffers are not counted here.
  int64_t activation_bytes = 0;
  // "batch buffers": this rank's rows of the training batch (meshtrain::batch_*).
  int64_t batch_bytes = 0;
  // "gathered weights": the layers' shared scratch (layers/layer.hpp LayerScratch): FSDP's
  // gathered weight block, its gradient, the prefetched weight under overlap, the stage of a
  // 2-D gather, the gathered bias / full-width bias gradient (meshtrain::scratch_*); with a
  // plain MLP's 16-bit storage, the 16-bit compute copies of the weights gathered over one group,
  // and of those stored whole where gemm() reads 16 bits (2 bytes an element of the stored block),
  // and the gathered ones' 16-bit landing, instead of the fp32 prefetch buffer.
  int64_t gathered_weight_bytes = 0;
  // Of which the weights' 16-bit compute copies (the training model's: a separate evaluation
  // model shares them).
  int64_t sixteen_bit_copy_bytes = 0;
  // "collective matmul workspace" (meshtrain::collective_matmul_workspace).
  int64_t collective_matmul_bytes = 0;
  // "communicator scratch": the largest scratch each communicator reserves
  // (Communicator::reserve_scratch; meshtrain::comm_scratch).
  int64_t comm_scratch_bytes = 0;
  int64_t total_bytes() const {
    return activation_bytes + batch_bytes + gathered_weight_bytes + collective_matmul_bytes +
           comm_scratch_bytes;
  }
};
// The workspace of `config` on the plan's mesh (zeros when the local batch is unknown). A
// separate evaluation model (below) shares the communicators: their scratch is the larger of
// the two models'.
TrainingWorkspace training_workspace(const RunConfig& config, const ShardingPlan& plan);

// This rank's rows of an evaluation batch (data.eval_batch_size, else data.batch_size, over the
// plan's batch shards; 0 when unknown or when they do not divide).
int64_t evaluation_rows(const RunConfig& config, const ShardingPlan& plan);

// "evaluation batch": when the evaluation batch's rows per rank differ from the training
// batch's, the run evaluates with a forward-only copy of the model built for those rows
// (sharing the parameters): its layers' buffers, as the training model's at those rows
// (matched to "activations" by their labels), its own LayerScratch, and its batch
// (meshtrain::eval_*). Zeros when evaluation uses the training buffers.
struct EvaluationBuffers {
  int64_t activation_bytes = 0;
  int64_t batch_bytes = 0;
  // The copy's own LayerScratch (layers/layer.hpp): gathered weights (the same size as the
  // training model's) and the collective matmul workspace (at its rows), matched to "gathered
  // weights" and "collective matmul workspace".
  int64_t gathered_weight_bytes = 0;
  int64_t collective_matmul_bytes = 0;
  int64_t total_bytes() const {
    return activation_bytes + batch_bytes + gathered_weight_bytes + collective_matmul_bytes;
  }
};
EvaluationBuffers evaluation_buffers(const RunConfig& config, const ShardingPlan& plan);

// The bytes per rank `meshtrain plan` predicts for a run (its "per rank" total), and which of
// them are Kokkos allocations: what a run's measured memory is compared with (docs/running.md,
// "Memory against the plan").
struct PlannedMemory {
  // Parameters, gradients, optimizer state, gradient accumulation, the evaluation batch,
  // ZeRO-1 and MoE buffers: Kokkos Views.
  PlanTotals totals;
  // The asynchronous checkpoint's staging buffer (a Kokkos View; 0 when saves do not stage).
  // The largest over the ranks; checkpoint_staging_by_rank has every rank's (a rank writes,
  // so stages, only the blocks it owns: under dp rank 0 alone).
  int64_t checkpoint_staging_bytes = 0;
  std::vector<int64_t> checkpoint_staging_by_rank;
  // The step's workspace (activations, gathered weights, collective scratch).
  TrainingWorkspace workspace;
  // The evaluation model's buffers; their total is totals.evaluation_bytes (which replaces the
  // planner's estimate).
  EvaluationBuffers evaluation;
  // The data path: its staging slots are Kokkos Views (with the sample lists, 8 bytes a row);
  // the rows in memory and HDF5's chunk caches are host memory outside Kokkos.
  DataFootprint data;
  // The ring reductions' partial sums (Kokkos Views reserved at build).
  RingReductionBytes ring;
  // The largest rank's Kokkos bytes (the plan's per-rank figure).
  int64_t kokkos_bytes() const {
    return totals.bytes_per_rank() + workspace.total_bytes() + checkpoint_staging_bytes +
           data.staging_bytes + ring.total();
  }
  // Rank `rank`'s: the same but with its own checkpoint staging.
  int64_t kokkos_bytes_of_rank(int rank) const {
    const int64_t staging = rank >= 0 && rank < static_cast<int>(checkpoint_staging_by_rank.size())
                                ? checkpoint_staging_by_rank[static_cast<size_t>(rank)]
                                : checkpoint_staging_bytes;
    return kokkos_bytes() - checkpoint_staging_bytes + staging;
  }
  int64_t host_bytes() const { return data.source_bytes + data.cache_bytes; }
  int64_t total_bytes() const { return kokkos_bytes() + host_bytes(); }  // the plan's total
};
// What `plan` (made from `config` on some mesh) predicts per rank, with the run's hardware
// profile (it decides which reductions take the ring under reductions = "auto").
PlannedMemory planned_memory(const RunConfig& config, const ShardingPlan& plan,
                             const HardwareProfile& hardware);

}  // namespace meshtrain
