#pragma once
// The planner (docs/design.md, "Partition rules"): model shapes + mesh + rules -> for every
// parameter the matched rule, final spec, local shape and bytes per rank, and the totals per rank;
// given the model's linear layers, also each layer's compute layout (decide_linear_layout,
// the same decision the layers make; decide_moe_layout for mixture-of-experts layers) and the
// collectives it runs per training step with the bytes each moves per rank.
// Pure arithmetic on shapes (no per-rank loops), so a 4096-rank plan is instant.

#include <cstdint>
#include <string>
#include <vector>

#include "partition/linear_layout.hpp"
#include "partition/mesh.hpp"
#include "partition/moe_layout.hpp"
#include "partition/norm_layout.hpp"
#include "partition/partition_spec.hpp"
#include "partition/rules.hpp"

namespace meshtrain {

struct ParameterShape {
  std::string name;
  std::vector<int64_t> shape;
};

// The MLP's parameters: layers/<i>/weight [in, out] and layers/<i>/bias [out], i = 0..n-2,
// weight before bias; an MoE layer i (moe.is_moe(i)) has layers/<i>/router/weight [in, E],
// layers/<i>/experts/weight [E, in, out] and layers/<i>/experts/bias [E, out] instead, in
// that order. Throws bad_input for fewer than two sizes or a size below 1.
std::vector<ParameterShape> mlp_parameter_shapes(const std::vector<int64_t>& sizes,
                                                 const MoeSettings& moe = {});

// The elementwise operation after a linear layer (LinearLayerParameters::output_op).
enum class LayerOutputOp { activation, swiglu, none };

// The linear layers of a model, in the order they run (each one's input is the previous
// one's output; the first one's input has all features and needs no gradient), by the
// names of their parameters. The layer is named after its weight ("layers/0/weight" ->
// "layers/0").
// An MoE layer (partition/moe_layout.hpp) has a router too: weight and bias are then its
// experts' and the layer is named after the router ("layers/1/router/weight" -> "layers/1").
struct LinearLayerParameters {
  std::string weight, bias;
  std::string router;  // "" for a linear layer
  int64_t top_k = 0;   // MoE layers only
  // The layer takes the previous layer's input, not its output (a SwiGLU block's up
  // projection beside its gate).
  bool same_input_as_previous = false;
  // Feed-forward experts (a residual_mlp MoE block): weight and bias are the up projection's,
  // these the down projection's and the gate's ("" when not SwiGLU).
  std::string gate_weight, gate_bias, down_weight, down_bias;
  // What the model does with the layer's output before the next layer (the cost model
  // charges it): the model's activation; SwiGLU over this layer's output (the value) and the
  // previous one's (the gate); nothing (a residual block's gate and down projections, the
  // last layer).
  LayerOutputOp output_op = LayerOutputOp::activation;
  // The layer ends a residual block: its output is added to the block's input.
  bool ends_residual_block = false;
  bool moe() const { return !router.empty(); }
};
// The MLP's: layers/<i>/weight and layers/<i>/bias for i = 0 .. sizes.size() - 2, or the
// MoE layer's three parameters where moe.is_moe(i).
std::vector<LinearLayerParameters> mlp_linear_layers(const std::vector<int64_t>& sizes,
                                                     const MoeSettings& moe = {});

// A norm over the features of a model (layers/norm.hpp): its parameters' names and the
// linear layer (index into make_plan's layers) whose output layout its input has.
struct NormLayerParameters {
  std::string name;  // "blocks/0/norm"
  NormKind kind = NormKind::rmsnorm;
  std::string scale, bias;  // bias "" for RMSNorm
  size_t after = 0;
};
// A norm's layout (decide_norm_layout) and its step's collectives (norm_step_collectives).
struct NormPlan {
  std::string name;
  size_t after = 0;  // NormLayerParameters::after: the layer whose output it reads
  NormLayout layout;
  std::string compute;  // describe_norm_layout
  std::vector<LayerCollective> collectives;
  int64_t collective_bytes_per_step = 0;
};

// [model] kind = "residual_mlp" (docs/models.md): inputs -> width, depth pre-norm blocks
// width -> hidden -> width, width -> outputs.
struct ResidualMlpShape {
  int64_t inputs = 0, outputs = 0, width = 0, hidden = 0, depth = 0;
  bool norm = true;  // false: no norms (model.norm = "none")
  NormKind norm_kind = NormKind::rmsnorm;
  bool gated = false;  // SwiGLU: blocks/<i>/gate beside blocks/<i>/up
  // moe.layers: the blocks whose feed-forward is a mixture of experts (block indices).
  MoeSettings moe;
};
// Its parameters, in the order the model takes them: input/weight [inputs, width],
// input/bias [width]; per block i: blocks/<i>/norm/scale [width] (and norm/bias for
// LayerNorm), blocks/<i>/gate/weight [width, hidden] and gate/bias [hidden] (SwiGLU),
// blocks/<i>/up/weight [width, hidden], up/bias [hidden], blocks/<i>/down/weight
// [hidden, width], down/bias [width]; output_norm/scale (and output_norm/bias) [width]; then
// output/weight [width, outputs], output/bias [outputs]. A block listed in moe.layers has,
// after its norm, blocks/<i>/router/weight [width, E], then blocks/<i>/experts/gate/weight
// [E, width, hidden] and experts/gate/bias [E, hidden] (SwiGLU), experts/up/weight
// [E, width, hidden], experts/up/bias [E, hidden], experts/down/weight [E, hidden, width],
// experts/down/bias [E, width] instead of gate, up and down. Throws bad_input for a size below
// 1 (naming the model key) and for a moe.layers entry that is not a block.
std::vector<ParameterShape> residual_mlp_parameter_shapes(const ResidualMlpShape& shape);
// Its linear layers in order: input, each block's (gate,) up and down (an MoE block: one
// entry, its feed-forward experts), output.
std::vector<LinearLayerParameters> residual_mlp_linear_layers(const ResidualMlpShape& shape);
// Its norms (none with norm = false): each block's, reading the residual stream as the input
// projection or the previous block's down projection leaves it, and output_norm.
std::vector<NormLayerParameters> residual_mlp_norm_layers(const ResidualMlpShape& shape);

struct PlanOptions {
  int64_t min_sharding_size = 16384;  // reference default: smaller tensors are replicated
  int64_t bytes_per_element = 4;      // float32
  // A DLRM's tables (embeddings/<t>/weight): 2 under model.table_dtype = "bf16".
  int64_t table_bytes_per_element = 4;
  int optimizer_slots = 2;  // AdamW m and v
  // optimizer.zero_stage: 1 splits the optimizer state over dp (partition/zero1_layout.hpp).
  int zero_stage = 0;
  // A DLRM's tables (embeddings/<t>/weight) updated in their touched rows only
  // (optimizer.embeddings other than "dense"): the cost model's optimizer pass leaves them out.
  bool sparse_tables = false;
  // For the layers' layouts and collectives (the logical axes `batch` and `hidden`).
  std::vector<std::string> batch_axes = {"fsdp", "dp"};
  std::string feature_axis = "tp";  // "" = none
  int64_t global_batch = 0;         // rows per step; 0 = unknown (activation collectives left out)
  // Micro-batches per optimizer step: more than 1 adds a gradient-sized accumulation buffer.
  int64_t accumulation_steps = 1;
  // runtime.overlap: a layer's FSDP weight gather starts under the layer before it (the
  // cost model hides it under that compute, partition/cost_model.hpp).
  bool overlap = false;
  // MiB cap of a gradient bucket when the layers that defer their gradient all-reduce run it in
  // buckets, one all-reduce per bucket of each group (a DLRM's linear layers: runtime.bucket_mb);
  // 0: each layer reduces its own (the cost model charges one all-reduce per gradient).
  double gradient_bucket_mb = 0.0;
  // Global rows of an evaluation batch; 0 or global_batch: evaluation uses the training
  // buffers. Otherwise its own buffers are counted (PlanTotals::evaluation_bytes).
  int64_t eval_global_batch = 0;
  // [mixed_precision]: what the layers' collectives move (masters and state stay
  // bytes_per_element).
  MixedPrecision precision;
  // model.activation ("relu", ..., "swiglu": ModelSection::activation_name) and model.dropout:
  // the elementwise kernels the cost model charges after the layers.
  std::string activation = "relu";
  double dropout = 0.0;
};

struct ParameterPlan {
  std::string name;
  std::vector<int64_t> shape;        // global
  int rule = -1;                     // index of the matched rule; -1 for scalars
  PartitionSpec spec;                // final spec (after replication/trim/fallback)
  std::vector<int64_t> local_shape;  // per rank
  int64_t bytes_per_rank = 0;
  std::vector<std::string> notes;  // why replicated / trimmed / fallback
  int64_t replicas = 1;            // ranks holding each block (world / split product)
};

// One layer: its compute layout and what it communicates per training step.
struct LayerPlan {
  std::string name;  // "layers/0"
  // A linear layer's layout. For an MoE layer (moe), a stand-in that code reading the chain
  // can use as is: in, out (out_local = out), feature axis, input layout, not tensor
  // parallel, output replicated; the MoE layer's own decision is moe_layout.
  LinearLayout layout;
  bool moe = false;
  MoeLayout moe_layout;  // MoE layers only (decide_moe_layout)
  // describe_linear_layout(layout) or describe_moe_layout(moe_layout), as the layer's
  // describe() after "name: "
  std::string compute;
  std::vector<LayerCollective> collectives;  // forward then backward, in the order run
  int64_t collective_bytes_per_step = 0;     // per rank, sum over `collectives`
  std::vector<std::string> notes;            // the layout's notes (e.g. the all-reduce fallback)
  // MoE layers: the dispatch buffers per rank (moe_buffer_bytes; 0 when the rows are unknown).
  int64_t moe_buffer_bytes = 0;
  // From LinearLayerParameters (what follows the layer; for the cost model).
  LayerOutputOp output_op = LayerOutputOp::activation;
  bool ends_residual_block = false;
};

// The bytes of an MoE layer's step buffers on one rank (layers/moe.cpp), for `rows` local
// rows: worst case (every row of the expert group routed to this rank), allocated once at
// construction. With R = rows, k = top_k, A = R*k routed rows sent, C = moe_dispatch_capacity (ep *
// R * min(k, E / ep)), E experts, floats of 4 bytes:
//   forward: send buffer A*in, received and expert-major inputs 2*C*in, expert outputs
//   (expert-major and in source order) 2*C*out, returned outputs A*out;
//   backward (the forward buffers reused where they can be): output gradients to send A*out,
//   the experts' input gradients C*in;
//   routing: logits, probabilities and their gradient 3*R*E floats, and per routed row its
//   gate (4 B), expert (4 B) and send position (8 B); per received row its expert-major row
//   (8 B) and local expert (4 B); with a 16-bit param_dtype and ep > 1, the communicator's
//   16-bit send and receive buffers, C rows of max(in, out) each; feed-forward experts: the
//   up pre-activations, activations and their gradient 3*C*hidden (SwiGLU: and the gate's
//   pre-activations and gradient, 5*C*hidden), and with a split output the whole output and
//   its gradient 2*R*out.
// Not counted (as for linear layers): the output, input gradient and gathered parameters,
// and the host mirrors and MPI staging a GPU build adds.
int64_t moe_buffer_bytes(const MoeLayout& layout, int64_t rows, const MixedPrecision& precision);

struct PlanTotals {  // bytes per rank
  int64_t parameter_bytes = 0, gradient_bytes = 0, optimizer_bytes = 0;
  int64_t global_parameter_bytes = 0;     // unsharded model size
  int64_t collective_bytes_per_step = 0;  // moved by the layers' collectives (cost model of
                                          // partition/linear_layout.hpp); 0 without layers
  int64_t accumulation_bytes = 0;         // the gradient sum of accumulation_steps > 1
  // An evaluation batch of its own size: its inputs and labels and each layer's output
  // (the forward-only model's activations), per rank; 0 when it shares the training buffers
  // or without layers.
  int64_t evaluation_bytes = 0;
  // ZeRO-1 with dp > 1 (framework/train/zero1.hpp): this rank's gradient chunks, the
  // padded block of a reduce-scatter or all-gather whose rows do not divide, and the send
  // chunk of the parameters' all-gather.
  int64_t zero1_buffer_bytes = 0;
  // MoE layers' dispatch buffers (moe_buffer_bytes, summed over the layers): worst case (all
  // rows to one rank), allocated once at construction; 0 without MoE layers or known rows.
  int64_t moe_buffer_bytes = 0;
  int64_t bytes_per_rank() const {
    return parameter_bytes + gradient_bytes + optimizer_bytes + accumulation_bytes +
           evaluation_bytes + zero1_buffer_bytes + moe_buffer_bytes;
  }
};

struct ShardingPlan {
  Mesh mesh;
  std::vector<ParameterPlan> parameters;  // in input order
  std::vector<LayerPlan> layers;          // in the order given to make_plan
  std::vector<NormPlan> norms;            // in the order given to make_plan
  int64_t local_batch_rows = 0;           // global_batch / batch shards; 0 = unknown
  std::vector<std::string> notes;         // about the plan as a whole (a batch that does not
                                          // divide by the batch shards, replicated axes)
  // Mesh axes of size > 1 that split no parameter (final specs), are not batch axes and are
  // not the feature axis of a tensor-parallel layer: every rank along them computes the same
  // thing. Each has a note (replicated_axis_note) in `notes`.
  std::vector<std::string> replicated_axes;
  PlanTotals totals;
  std::vector<int> unused_rules;  // indices of rules that gave the spec of no parameter
  const ParameterPlan& find(const std::string& name) const;  // throws bad_input if absent
};

// Applies the rules in order (docs/design.md, "Partition rules"):
// 1. a scalar is replicated (rule -1);
// 2. the first rule whose regex is found in the name gives the spec; none: bad_input
//    naming the parameter and listing the rules;
// 3. fewer elements than min_sharding_size: replicated (noted);
// 4. a spec longer than the rank is trimmed (noted);
// then a dim that does not divide by its axis product is bad_input naming parameter, dim,
// size and product, or replicated with a note when the rule has replicate_if_indivisible.
// Also bad_input: an invalid regex (all checked up front, naming index and pattern), a
// spec axis the mesh lacks or an axis repeated in a spec (naming parameter and rule),
// duplicate parameter names, negative sizes, and nonsensical options.
// With `layers`, each layer's layout and collectives are planned too (options' batch axes,
// feature axis and global batch); bad_input also for a layer naming a parameter the model
// lacks and what decide_linear_layout (decide_moe_layout for an MoE layer) rejects. A global
// batch that does not divide by the product of the batch axes is noted (plan.notes) and the
// activation collectives left out. Layers chain as the MLP runs them: each input is laid out
// as the previous output; an MoE layer's output is replicated. An MoE layer's experts that do
// not divide by the axes splitting them (a rule without the replicate fallback) are bad_input
// naming model.experts, the ranks and the layer.
// Every mesh axis of size > 1 that splits no parameter, is not a batch axis and is not the
// feature axis of a tensor-parallel layer is noted (replicated_axes, replicated_axis_note).
ShardingPlan make_plan(const std::vector<ParameterShape>& parameters, const Mesh& mesh,
                       const std::vector<PartitionRule>& rules, const PlanOptions& options,
                       const std::vector<LinearLayerParameters>& layers = {},
                       const std::vector<NormLayerParameters>& norms = {});

// "mesh axis 'ep' (size 2) splits no parameter and no batch rows: every ep rank computes the
// same thing (compute replicated over ep)".
std::string replicated_axis_note(const std::string& axis, int size);

// format_shape ("[784, 512]") is declared in partition_spec.hpp.
// "512 B", "1.50 KiB", "3.06 MiB", "2.00 GiB" (binary units).
std::string format_bytes(int64_t bytes);

}  // namespace meshtrain
