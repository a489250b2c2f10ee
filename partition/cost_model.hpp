#pragma once
// The cost model: how long one training step of a plan takes on a hardware profile
// (partition/hardware.hpp), and its parts. Pure arithmetic on the plan, like the planner.
//
// What a step does (layers/linear.cpp, layers/moe.cpp, layers/loss.cpp,
// run/training_run.cpp), per rank, with r the local batch rows and each layer's compute block
// [in_c, out]:
//   GEMMs       forward r x in_c x out, backward weight in_c x r x out and (not the first
//               layer) input r x out x in_c: each at the profile's rate for its shape
//               (HardwareProfile::gemm_seconds: measured shapes, else gemm_flops).
//   collectives the plan's (LayerCollective), each costed as a ring on the slowest link of
//               its group, S the full (gathered / unreduced) operand in bytes, p ranks:
//                 all-gather, reduce-scatter   (p-1)/p * S / B + (p-1) * alpha
//                 all-reduce                   the cheaper of 2 * that (reduce-scatter then
//                                              all-gather) and recursive doubling,
//                                              ceil(log2 p) * (alpha + S / B)
//               B = the link's bandwidth of that collective (collective_bandwidth for the
//               all-gather, reduce_scatter_bandwidth, all_reduce_bandwidth), alpha = latency;
//               each call's latency terms ((p-1) alpha, 2 (p-1) alpha, ceil(log2 p) alpha) are
//               raised to the link's collective_overhead when that is more (what a small call
//               costs a step: the wait for the last rank to arrive, once per call). Run
//               one after the other with the GEMMs, except the FSDP weight prefetch below.
//   overlap     two parts a and c that run together (a transfer started before a GEMM and
//               waited for after it) take a + c - e * min(a, c), e = the profile's overlap
//               (1: max(a, c); 0: a + c; MPI on CPUs moves data only inside MPI calls).
//   collective matmuls  a TP layer with a split output replaces its output reduce-scatter
//               and its two output-gradient all-gathers, with their GEMMs, by
//               matmul_reduce_scatter / all_gather_matmul (framework/comm/
//               collective_matmul.hpp). b = the travelling block's bytes, n = tp, g = one
//               step's GEMM time (ring: the block's GEMM; bidirectional: two GEMMs of half
//               a block), one hop h = max(latency, collective_overhead) +
//               b / exchange_bandwidth (ring: every rank sends and receives a block at once)
//               or max(latency, collective_overhead) + b / bidirectional_bandwidth (both
//               halves at once, one each way), each step the hop beside the step's GEMMs,
//               s = g + h - e * min(g, h) (ring and bidirectional pay the overhead per hop,
//               naive once per collective: a larger overhead moves `automatic` to naive):
//                 naive          its GEMMs + the all-gather / reduce-scatter above
//                 ring, bidirectional  all-gather: (n-1) * s + g
//                                reduce-scatter: g + (n-1) * (s + 3b / memory_bandwidth)
//                                (each hop's partial sum is added: read two, write one)
//               `automatic` takes the simplest (naive, then ring, then bidirectional) of
//               those within kAutomaticMargin of the fastest: the model is a few per cent
//               from a measurement, and the more elaborate algorithm pays for more GEMM
//               calls and messages (bidirectional on 2 ranks sends both halves to the
//               same neighbour) than it models.
//   prefetch    with options.overlap ([runtime] overlap) a layer whose weight is gathered
//               over one group (FSDP) has that gather started by the layer before it
//               (forward: layer i-1 for i > 0; backward: layer j+1 for j below the last),
//               right after that layer's own weight is in place. The compute between the
//               start and the wait (GEMMs, collective matmuls, memory passes; not other
//               collectives, which share the link) hides e * min(compute, gather) of the
//               gather. StepCost::full_overlap_s is the step at e = 1: per layer
//               max(compute, gather).
//   ZeRO-1      with options.zero_stage = 1 and dp > 1 (framework/train/zero1.hpp): the
//               gradient all-reduces a layer defers (DP-stored layers) run once per step as
//               reduce-scatters over dp; the optimizer passes cover this rank's chunk of every
//               tensor not split over dp (partition/zero1_layout.hpp); each such tensor's chunk is
//               copied (2 chunk bytes) and all-gathered over dp (dp chunks).
//   memory      elementwise passes at memory_bandwidth, bytes read + written: per layer
//               bias add 2 * r * out_local, bias gradient r * out_local; after a layer whose
//               output_op (LayerPlan) says so, on E = r * out_local: the activation 2 E
//               (forward) and 3 E (backward), or SwiGLU 3 E (forward: gate and value read, the
//               product written) and 5 E (backward: gate, value, dY read, both gradients
//               written) plus the gate's and value's input gradients summed, 3 * r *
//               input_width at the gate; then dropout (options.dropout) 2 E each way. An
//               activation's or SwiGLU's kernel with a measured rate in the profile
//               (HardwareProfile::elementwise_rates, by "<activation>_forward" etc.) costs
//               E / rate instead. A residual block (ends_residual_block: its last layer) adds
//               3 W (forward: input and f(x) read, sum written) and, backward, dY copied
//               (2 W) before the block and added to its input gradient (3 W) after it, W = r *
//               its out_local. Norms (NormPlan, after the layer whose output they read), W = r
//               * local_width: forward RMSNorm's sum of squares 1 W (LayerNorm's sum and
//               centred sums 2 W), the statistics' all-reduce over tp (the plan's
//               collectives), the output 2 W; backward column sums 2 W, row sums 2 W, their
//               all-reduce, the input gradient 3 W; input slice
//               / gradient copy 2 * r * in_c where the layout needs it; the loss 4 * r *
//               out_local; the optimizer (3 + 2 * slots) * parameter bytes (AdamW: read p,
//               g, m, v, write p, m, v; SGD: read p, g, write p, plus 2 per momentum slot);
//               a matrix gathered or scattered along its columns (dim 1: FSDP weights split
//               on dim 1, TP inputs) passes through staging, 2 * its full bytes.
//   MoE layers  (layers/moe.cpp, partition/moe_layout.hpp) with r local rows, k = top_k,
//               E experts, e = experts_local per rank, ep = the expert group; memory passes
//               below in floats (4 B) read + written. Costed at uniform routing: a rank
//               receives r*k rows in all (what it keeps and what the other ep - 1 send), r*k/e
//               for each local expert (split as evenly as they go: one or two GEMM shapes).
//               Forward, in order: the input all-gathered over the feature axis when it
//               arrives split; the router gathered when stored split; router GEMM NN
//               [r x in x E]; softmax and top-k 3*r*E; routing counts and send positions
//               E*r*(1+2k) + r*k; the counts' all-gather over ep; the routing statistics'
//               all-reduce over the batch axes; the dispatch plan 3*r*k; pack the rows by
//               destination 2*r*k*in; all-to-all of the rows; permute to expert-major
//               2*r*k*in; expert weights gathered when stored split; per local expert GEMM NN
//               [r*k/e x in x out]; expert biases gathered when split; bias add 2*r*k*out;
//               permute back 2*r*k*out; all-to-all of the outputs; combine with the gates
//               r*k*out + r*out; the activation 2*r*out (not after the last layer).
//               Backward: activation gradient 3*r*out (not the last layer); gate gradients
//               r*k*out + r*out; pack the output gradients times the gates 2*r*k*out; their
//               all-to-all; permute 2*r*k*out; per expert GEMM TN [in x r*k/e x out]; bias
//               gradient r*k*out; with an input gradient (not the first layer): the expert
//               weights gathered again when split, per expert GEMM NT [r*k/e x out x in],
//               permute back 2*r*k*in, the return all-to-all; softmax backward 3*r*E; router
//               GEMM TN [in x r x E]; with an input gradient: the router gathered again when
//               split, GEMM NT [r x E x in], combine the input gradients r*k*in + 2*r*in and,
//               when the input was gathered, slice it 2*r*in/tp; then the gradients'
//               reduce-scatters and all-reduces (moe_step_collectives) and the gradient
//               scale (2 passes of the stored block) of a parameter gathered over non-batch
//               axes. A gathered parameter's blocks are placed into [d0, d1, d2] after the
//               all-gather, and its gradient cut into blocks before the reduce-scatter: 2 *
//               its compute block each. With ep = 1 each all-to-all is a copy, 2 * its rows.
//               all-to-all     (p-1)/p * S / B + (p-1) * alpha, S = what this rank sends
//                              (its r*k rows), B = collective_bandwidth of the group's link:
//                              a pairwise exchange moves through a rank what an all-gather's
//                              ring does.
//               Mixed precision adds the model input's cast (first layer), the cast of each
//               parameter it uses and does not gather (2 * its compute block), the rounding
//               of the expert and router weight gradients and (input gradient) of the
//               experts' input gradients 2*r*k*in.
//               An MoE layer reduces its gradients in its own backward (never deferred to the
//               step's end: also with accumulation or ZeRO-1), is never prefetched and starts
//               no FSDP prefetch of a neighbouring layer's weight (layers/mlp.cpp).
//   scalars     the loss's all-reduce of 3 numbers over every axis: its latency terms (or
//               the collective_overhead when more), no bandwidth to speak of.
// With accumulation_steps > 1 every part but the optimizer runs once per micro-batch, and
// the gradient sum adds 3 passes of the gradient per micro-batch.
// Not modelled: gradient clipping (one pass and a scalar all-reduce), kernel launches,
// evaluation, data loading, checkpoints.

#include <cstdint>
#include <string>
#include <vector>

#include "partition/collective_matmul_algorithm.hpp"
#include "partition/hardware.hpp"
#include "partition/linear_layout.hpp"
#include "partition/planner.hpp"

namespace meshtrain {

// a + c - overlap * min(a, c): two parts run beside each other.
double overlapped_seconds(double a, double c, double overlap);

// Seconds of a ring collective of `kind` on a full operand of `bytes` over `ranks` on `link`
// (0 for one rank); an all-to-all's `bytes` are what this rank sends. Its bytes at the link's
// bandwidth plus max(its latency terms, link.collective_overhead).
double collective_seconds(CollectiveKind kind, double bytes, int ranks, const LinkProfile& link);

// The buckets layers/gradient_buckets.cpp cuts a DLRM's (options.gradient_bucket_mb) bucketed
// gradients into: `gradients` in the order backward finishes them, each its group (any key
// that is equal for the same communicator, e.g. its axes) and elements; the cap bucket_mb MiB
// in floats, floored, at least 1 and at most INT_MAX (one MPI count); a new bucket when the
// last is full or the group changes. Returns the buckets, each its group and elements, in
// the order they start.
struct GradientBucketRun {
  std::vector<std::string> group;
  int64_t elements = 0;
};
std::vector<GradientBucketRun> gradient_bucket_elements(
    const std::vector<GradientBucketRun>& gradients, double bucket_mb);

// One collective matmul on this rank: the GEMMs each algorithm runs, the travelling
// block, the ranks (framework/comm/collective_matmul.cpp builds it from its operands,
// layer_matmul_shapes for a TP layer).
enum class CollectiveMatmulKind { all_gather, reduce_scatter };
struct CollectiveMatmulShape {
  CollectiveMatmulKind kind = CollectiveMatmulKind::all_gather;
  GemmShape naive;  // naive: naive_calls of these beside the collective
  int naive_calls = 1;
  GemmShape block;  // ring: one per step, `ranks` steps
  GemmShape half;   // bidirectional: two per step (the block split in halves)
  double block_bytes = 0.0;
  int ranks = 1;
  double flops() const { return naive_calls * naive.flops(); }
};
// Seconds of `shape` with `algorithm` (naive, ring or bidirectional; automatic: the fastest).
double collective_matmul_seconds(const CollectiveMatmulShape& shape,
                                 CollectiveMatmulAlgorithm algorithm, const LinkProfile& link,
                                 const HardwareProfile& hardware);
// `requested` unless it is automatic; then the first of naive, ring and bidirectional whose
// predicted time is within kAutomaticMargin of the fastest (naive for one rank).
constexpr double kAutomaticMargin = 0.03;
CollectiveMatmulAlgorithm choose_collective_matmul(const CollectiveMatmulShape& shape,
                                                   CollectiveMatmulAlgorithm requested,
                                                   const LinkProfile& link,
                                                   const HardwareProfile& hardware);

// The algorithms of a split-output TP layer's three collective matmuls (forward output
// reduce-scatter, backward weight gradient, backward input gradient), as layers/linear.cpp
// runs them and the plan prints them. For other layers all are naive (unused).
struct LayerMatmulAlgorithms {
  CollectiveMatmulAlgorithm forward = CollectiveMatmulAlgorithm::naive;
  CollectiveMatmulAlgorithm weight_grad = CollectiveMatmulAlgorithm::naive;
  CollectiveMatmulAlgorithm input_grad = CollectiveMatmulAlgorithm::naive;
};
// The three shapes of layer `layout` for `rows` local rows, blocks moving as `wire`
// elements (the compute dtype of mixed precision), as
// layers/linear.cpp calls them: forward x @ W (NN, output reduce-scattered by column
// blocks), weight gradient xᵀ @ dY (TN, dY all-gathered by column blocks, bidirectional
// halves split K), input gradient dY @ Wᵀ (NT, the same dY, halves split M).
std::vector<CollectiveMatmulShape> layer_matmul_shapes(const LinearLayout& layout, int64_t rows,
                                                       Dtype wire = Dtype::fp32);
LayerMatmulAlgorithms layer_matmul_algorithms(const LinearLayout& layout, int64_t rows,
                                              CollectiveMatmulAlgorithm requested,
                                              const HardwareProfile& hardware,
                                              Dtype wire = Dtype::fp32);

struct CostItem {
  std::string layer;     // "layers/0", or "loss", "optimizer"
  std::string phase;     // "forward", "backward", "update"
  std::string category;  // "gemm", "collective", "collective matmul", "memory"
  std::string what;      // "x @ W [256 x 784 x 4096]", "all-gather weight", ...
  std::string group;     // "fsdp=2" for communication, "" otherwise
  double seconds = 0.0;
};

struct StepCost {
  std::vector<CostItem> items;                 // in the order the step runs them (one micro-batch)
  std::vector<LayerMatmulAlgorithms> matmuls;  // per layer of the plan
  // Totals of the step (all micro-batches), by category; total = their sum.
  double gemm_s = 0.0, collective_s = 0.0, collective_matmul_s = 0.0, memory_s = 0.0;
  double total_s = 0.0;
  int64_t accumulation_steps = 1;
  // FSDP prefetch (options.overlap): communication hidden at the profile's overlap, and at
  // overlap 1; the step without any overlap (serial_s) and at overlap 1 (full_overlap_s,
  // per layer max(compute, gather)). Without prefetch: 0, 0, total_s, total_s.
  double overlap_hidden_s = 0.0, full_overlap_hidden_s = 0.0;
  double serial_s = 0.0, full_overlap_s = 0.0;
  // Reading the step's batches (add_data_read): all of it, and the part a reader thread
  // running ahead of the step does not hide (included in total_s).
  double data_read_s = 0.0, data_exposed_s = 0.0;
  double data_agree_s = 0.0;  // of both: a DLRM's agreement on the ids' checks
};

// How one rank reads the batches of a step (what `meshtrain plan` knows from [data]).
enum class ReadPattern {
  memory,       // rows copied from an in-memory data set
  sequential,   // data.shuffle = false: the rank's slice is one run of consecutive rows
  random_rows,  // data.shuffle = true: every row a random read
  blocks,       // data.shuffle = "blocks": rows from a window of blocks, read ahead by the OS
};
struct DataRead {
  ReadPattern pattern = ReadPattern::memory;
  int64_t rows = 0;         // this rank's rows per optimizer step (all micro-batches)
  int64_t global_rows = 0;  // rows of the step's global batch
  int64_t row_bytes = 0;    // bytes of one row as stored (inputs and target)
  int64_t block_rows = 1;   // blocks: rows of one block
  int64_t prefetch = 0;     // batches read ahead by a thread; 0: read inside the step
  // A DLRM's reads (run/dlrm_run.cpp; 0: not a DLRM): its tables, and the ids of one row over
  // all of them. Its files stay in memory once read (the sparse reader holds its tables whole,
  // the dense source keeps its chunks in HDF5's cache), so a step's read is HDF5's work per dense
  // row (HardwareProfile::hdf5_row_seconds) and the sparse reader's per row and table and per id
  // (sparse_row_seconds, sparse_id_seconds; not measured: a cache line per offset and id at
  // memory bandwidth), not the storage's.
  int64_t tables = 0;
  int64_t ids_per_row = 0;
  // The ranks whose readers agree on the ids' checks (SparseHdf5Reader::agree: one all-reduce
  // of 5 int64 on the main thread every step, read ahead or not) and the mesh axes they span
  // (its link); 1 or fewer: no agreement charged.
  int agree_ranks = 0;
  std::vector<std::string> agree_axes;
};

// Seconds one rank spends reading a step's rows: memory bandwidth for in-memory rows; for
// files, a sequential run costs one latency plus its bytes at storage_read_bandwidth, a
// random row one latency plus a 4 KiB page, and blocks the whole global batch's bytes
// (every rank's rows are spread over the same window, whose pages the OS reads ahead) plus
// one latency per block started. A DLRM's (read.tables > 0): rows * hdf5_row_seconds + rows *
// tables * sparse_row_seconds + rows * ids_per_row * sparse_id_seconds (unmeasured sparse
// figures: 128 and 64 bytes at memory bandwidth) + its rows' bytes twice at memory bandwidth
// (the copy into the batch views); read.pattern does not enter: the chunks stay cached (no
// storage read), and what the order of the rows costs HDF5 is in hdf5_row_seconds, which
// calibrate measures on the config's own data.shuffle (kHdf5RowSeconds: an estimate for random
// rows), so a profile is for configs of that shuffle. Not the agreement (data_agree_seconds).
double data_read_seconds(const DataRead& read, const HardwareProfile& hardware);
// The ids' agreement of a DLRM's read: one all-reduce of 40 bytes over read.agree_ranks on the
// link of read.agree_axes (0 for one rank or not a DLRM).
double data_agree_seconds(const DataRead& read, const HardwareProfile& hardware);
// Adds the step's data read to `cost`: with prefetch the reader thread hides it up to the
// rest of the step (exposed: what exceeds it), without it is all exposed; a DLRM's agreement
// runs in the step either way (data_read_s and data_exposed_s include it).
void add_data_read(StepCost& cost, const DataRead& read, const HardwareProfile& hardware);

// Every GEMM shape predict_step costs for `plan` (each collective matmul's under every
// algorithm), sorted, without repeats: what `meshtrain calibrate CONFIG` measures.
std::vector<GemmShape> step_gemm_shapes(const ShardingPlan& plan);

// Predicts one optimizer step of `plan` (made with `options` and layers, and a known
// global batch that divides: bad_input otherwise) on `hardware`, the collective matmuls
// with `algorithm` (automatic: chosen per layer and direction as above).
StepCost predict_step(const ShardingPlan& plan, const PlanOptions& options,
                      const HardwareProfile& hardware, CollectiveMatmulAlgorithm algorithm);

}  // namespace meshtrain
