#pragma once
// A mixture-of-experts layer in -> out with E experts, each a linear layer x W_e + b_e, of
// which every row uses its top k (Mixtral's routing, Switch Transformer's balancing loss).
//
// Forward, for this rank's rows x [rows, in]:
//   logits = x Wr (router [in, E]); p = softmax(logits) per row;
//   the k largest p (ties: the lower expert index) are the row's experts, their gates
//   g_s = p_{e_s} / sum over the k chosen (renormalized);
//   y = sum_s g_s (x W_{e_s} + b_{e_s}).
//   Dropless: every (row, expert) pair is computed, so the result does not depend on the mesh.
//   The load-balancing loss aux_loss_coef * E * sum_e f_e P_e, with f_e the fraction of the
//   global batch's rows routed to e (a row counts once for each of its k experts, so the f_e
//   sum to k) and P_e the mean of p_e over the global batch, is added to the training loss;
//   its gradient flows through P only (f is a count).
//
// Expert parallelism (partition/moe_layout.hpp decides the layout): the experts are split
//   over the expert axes (ep), E / ep per rank. Each rank sends every (row, expert) pair to
//   the rank holding the expert: the per-expert counts are all-gathered over the expert
//   group first, then the rows travel by all_to_all_v, are put in expert-major order (one
//   GEMM per local expert), come back by all_to_all_v and are combined with the gates.
//   Backward mirrors it: the output gradients times the gates go out, the input gradients of
//   the expert GEMMs come back. Expert gradients are summed over the batch axes that do not
//   split the experts; the router's over every batch axis. Parameters stored split over
//   other axes (FSDP) are gathered before use and their gradients reduce-scattered back
//   (ShardedParameter, layers/sharded_parameter.hpp, as_blocks).
//
// Buffers: every dispatch buffer is sized at construction for the worst case, all of the
//   expert group's rows routed to this rank (ep x rows x k rows), so forward() and backward()
//   allocate nothing; the plan counts them (PlanTotals::moe_buffer_bytes).
//
// Feed-forward experts (a residual_mlp block listed in model.moe_layers; the second
//   constructor, partition/moe_layout.hpp): expert e is FFN_e(x) = act(x U_e + bu_e) D_e + bd_e
//   (SwiGLU: (silu(x G_e + bg_e) * (x U_e + bu_e)) D_e + bd_e), y = sum_s g_s FFN_{e_s}(x), with
//   the same router, dispatch and combination: a row goes out once and comes back once, the
//   hidden activations stay on the expert's rank. A split input (tp) gives a split output:
//   every tp rank computes the whole layer and keeps its feature block; backward all-gathers
//   the output gradient over tp first.
//
// Mixed precision (docs/mixed_precision.md): the router logits, the dispatched rows, the
//   expert outputs and every gradient are rounded to the compute dtype and travel in it;
//   the softmax, the gates and the combination are computed in fp32 and the output rounded.

#include <cstdint>
#include <string>
#include <vector>

#include "framework/core/choices.hpp"
#include "framework/core/sharded_tensor.hpp"
#include "layers/context.hpp"
#include "layers/layer.hpp"
#include "layers/sharded_parameter.hpp"
#include "partition/moe_layout.hpp"

namespace meshtrain {

// The parameters of feed-forward experts (moe_layout.hpp's names): gate_* with a null value
// unless SwiGLU; `activation` between up and down (unused with a gate: silu(gate) * up).
struct MoeFeedForward {
  ParameterRef router, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias;
  Activation activation = Activation::relu;
};

class MoeLayer : public Layer {
 public:
  // router [in, E], experts_weight [E, in, out], experts_bias [E, out] as allocated; `rows`
  // the local batch. Asks the context for its communicators (collective, see context.hpp).
  MoeLayer(ParameterRef router, ParameterRef experts_weight, ParameterRef experts_bias,
           int64_t top_k, double aux_loss_coef, FeatureLayout input_layout, int64_t rows,
           ParallelContext& context);
  // Feed-forward experts; the input [rows, input_width()] in `input_layout`, the output in
  // output_layout() (split like the input under tp).
  MoeLayer(const MoeFeedForward& experts, int64_t top_k, double aux_loss_coef,
           FeatureLayout input_layout, int64_t rows, ParallelContext& context);
  MoeLayer(MoeLayer&&) = default;

  // x [rows, input_width()] (must stay valid until backward) -> [rows, out] (owned by the
  // layer, valid until the next forward).
  MatrixView forward(MatrixView x, const LayerPass& pass) override;
  // dY [rows, out] (already times pass.loss_scale): writes the three gradients (the aux
  // loss's part times loss_scale too), reduced whatever pass.deferred says (nothing is
  // deferred), and, when need_input_grad, returns dX [rows, input_width()].
  MatrixView backward(MatrixView dy, bool need_input_grad, const LayerPass& pass) override;
  // The layer's derivative along k directions per row (docs/derivatives.md), with the routing of
  // the last forward (piecewise constant: the chosen experts stay chosen):
  //   dy = sum over the row's experts s of dg_s y_s + g_s dy_s,
  //   dg_s = (dp_s - g_s sum_t dp_t) / sum_t p_t over the chosen, dp = p * (dl - p . dl),
  //   dl = dx Wr, and dy_s the expert's own tangent (dx W_s; feed-forward: through its
  //   activation or SwiGLU and down projection, without biases).
  // A row's k tangents travel to its experts' ranks with it, as one wide row per (row, expert)
  // pair of the forward's dispatch plan (the same all-to-all counts and permutations).
  MatrixView forward_tangents(MatrixView dx, const LayerPass& pass) override;
  void reserve_tangents(int64_t directions) override;
  // backward's input gradient for k cotangents per row, with the routing of the last forward:
  // gate x dy to the experts (wide rows of the same dispatch plan), their input cotangents
  // back, and the router's part from dg_s = dy . y_s through the renormalized gates and the
  // softmax; no parameter gradient, no balancing-loss term.
  MatrixView backward_cotangents(MatrixView dy, const LayerPass& pass) override;
  void reserve_cotangents(int64_t directions) override;
  // Training on derivatives (Sobolev training, docs/derivatives.md): backward through the value
  // and the first-order tangents of the last forward and forward_tangents, the routing held
  // fixed. The renormalized gates are the softmax of the chosen logits (g = softmax(l_S)), so
  // per row, with a_s = dl_s (the tangent logits), m = sum_s g_s a_s, c_s = dt . y_s and
  // w = sum_s g_s c_s per direction: the tangent logits' gradient is g_s (c_s - w) on the
  // chosen experts, the gates' gradient gains sum_d dt . t_s + c_s (a_s - m) - a_s w, each expert's
  // value gradient is g_s dy + sum_d dg_s dt and its tangents' g_s dt; the experts' tangent passes
  // are differentiated as Linear's (feed-forward: f'' times the hidden tangents joins the
  // pre-activation's gradient; SwiGLU: its second derivatives likewise). The tangent gradients
  // travel as wide rows of the forward's dispatch plan. Gradients reduced as backward's; fp32;
  // linear, activation and SwiGLU experts.
  // The forward Laplacian (pass.second_order, docs/derivatives.md "MoE layers"): each row's 2k
  // stream rows (k tangents t, then k diagonal second derivatives q) through the router
  // (s_l = q Wr), the gates' second order d2g_s = dg_s (a_s - m) + g_s (b_s - n) (a, b the
  // tangent and second-order logits of the chosen experts, m = sum_s g_s a_s, n = sum_s dg_s a_s
  // + g_s b_s), the experts' second-order rules (activation, SwiGLU) and the combination
  // q_y = sum_s d2g_s y_s + 2 dg_s t_s + g_s q_s, all 2k streams as one wide row per pair; the
  // backward is its reverse (the same kinds of pass must alternate: forward_laplacian, then
  // backward_with_laplacian).
  MatrixView backward_with_tangents(MatrixView dy, MatrixView dt, bool need_input_grad,
                                    const LayerPass& pass, MatrixView* dt_in) override;
  void reserve_tangent_backward(int64_t directions) override;
  bool supports_tangent_backward() const override { return true; }
  bool supports_laplacian() const override { return true; }
  // Router, experts weight, bias; feed-forward: router, (gate weight, bias,) up weight, bias,
  // down weight, bias.
  size_t parameter_count() const override { return layout_.storages().size(); }
  // Backward reduces every gradient itself (can_leave_gradients_partial() is false).
  std::vector<ShardedParameter*> sharded_parameters() override;

  // The load-balancing loss of the last forward, times aux_loss_coef (the same on every rank).
  double aux_loss() const override { return aux_loss_; }
  // Of the last forward: the global rows routed to each expert (k per row in all).
  const std::vector<double>& expert_rows() const { return expert_rows_; }

  const MoeLayout& layout() const { return layout_; }
  int64_t output_width() const override { return layout_.output_width(); }
  int64_t output_offset() const override {
    return layout_.splits_output() ? feature_index_ * layout_.output_width() : 0;
  }
  FeatureLayout output_layout() const override { return layout_.output_layout(); }
  MatrixView output() const override { return out_; }
  std::string describe() const override;

 private:
  // Counts -> send/receive rows per rank and the expert-major permutation (host), then the
  // permutation tables to the device.
  // The constructors' common part, after layout_: communicators, the router and the
  // experts' (up) weight and bias, and the buffers.
  void build(ParameterRef router, ParameterRef weight, ParameterRef bias, ParallelContext& context);
  // The experts on their rows in expert-major order: expert_x_ -> expert_y_ (forward);
  // expert_y_ (output gradients) -> the parameters' gradients and, when need_input_grad,
  // expert_dx_ (backward).
  void experts_forward(LayerScratch& scratch);
  void experts_backward(LayerScratch& scratch, bool need_input_grad);
  // The experts' tangents on their rows: tangent_expert_x_ -> tangent_expert_y_, `directions`
  // rows per (row, expert) pair, in expert-major order (second_order: k tangents then k
  // second-order streams, directions = 2k).
  void experts_tangents(LayerScratch& scratch, int64_t directions, bool second_order);
  // The experts' cotangents: cotangent_expert_y_ -> cotangent_expert_x_, likewise.
  void experts_cotangents(LayerScratch& scratch, int64_t directions);
  // Training on derivatives: the experts' value gradients (expert_y_) and tangent gradients
  // (cotangent_expert_y_, `directions` rows per pair) -> every expert parameter's gradient,
  // and, when need_input_grad, the input's (expert_dx_) and the input tangents'
  // (cotangent_expert_x_).
  // second_order: `directions` is 2k, k tangents then k second-order streams per pair (the
  // forward Laplacian's rules for the activation or SwiGLU).
  void experts_backward_with_tangents(LayerScratch& scratch, int64_t directions,
                                      bool need_input_grad, bool second_order);
  // The router's gates' gradients in dlogits_(r, 0..k) -> the logits' gradient in dlogits_
  // (renormalized gates, the balancing loss's term times loss_scale, then the softmax).
  void router_logit_gradients(float loss_scale);
  // Gathered, split and FSDP-stored gradients reduced as their storage says (backward's end).
  void reduce_gradients(LayerScratch& scratch);
  void plan_dispatch();
  // Sends `send` [assignments, c] out and receives into `recv` [received, c] (forward
  // direction), or the reverse; a copy without an expert group.
  void dispatch(MatrixView send, MatrixView recv, bool forward_direction);
  // Row i of src -> row map(i) of dst (rows of the used prefix).
  void permute(MatrixView src, MatrixView dst, bool to_expert_major);

  MoeLayout layout_;
  int64_t rows_ = 0, assignments_ = 0, capacity_ = 0;  // rows x k; ep x rows x k
  double aux_loss_coef_ = 0.0;
  int64_t global_rows_ = 0;   // rows x batch_parallel
  int64_t first_expert_ = 0;  // global index of this rank's first expert
  int feature_index_ = 0;
  Dtype compute_dtype_ = Dtype::fp32;

  Communicator* expert_comm_ = nullptr;   // all-to-all group
  Communicator* batch_comm_ = nullptr;    // routing statistics
  Communicator* feature_comm_ = nullptr;  // a split input's gather

  // Gathered and reduced as their storage says (as_blocks: all three are in use together).
  ShardedParameter router_, weight_, bias_;
  ShardedParameter gate_weight_, gate_bias_, down_weight_, down_bias_;  // feed-forward only
  Activation activation_ = Activation::relu;

  Matrix x_full_;                     // the input with all features (gathered), or empty
  MatrixView x_used_;                 // what the layer computed on
  Matrix logits_, probs_;             // [rows, E]
  Kokkos::View<int**> chosen_;        // [rows, k] expert indices
  Matrix gates_;                      // [rows, k]
  Kokkos::View<int64_t**> position_;  // [rows, k] -> row of the send buffer
  Kokkos::View<double*> stats_;       // [2E]: rows per expert, probability sums
  Vector counts_;                     // [E] this rank's rows per expert (for the gather)
  Vector all_counts_;                 // [ep x E] every group member's
  Vector::HostMirror all_counts_host_;
  Kokkos::View<double*>::HostMirror stats_host_;
  Matrix send_x_, recv_x_, expert_x_;      // [assignments, in], [capacity, in] x 2
  Matrix expert_y_, back_y_, returned_y_;  // [capacity, out] x 2, [assignments, out]
  Matrix send_dy_;                         // [assignments, out]
  Matrix expert_dx_;                       // [capacity, in]
  Matrix dlogits_;                         // [rows, E]
  Matrix out_, dx_full_, dx_;              // [rows, output_width], [rows, in], [rows, input_width]
  // Feed-forward experts: [capacity, hidden] pre-activations of up (and gate), the
  // activations, their gradient (and the gate's); with a split output the whole output and
  // output gradient [rows, out].
  Matrix ffn_up_, ffn_gate_, ffn_h_, ffn_dh_, ffn_dgate_;
  Matrix out_full_, dy_full_;
  // The dispatch plan of the last forward (host, then device).
  std::vector<int64_t> send_rows_, recv_rows_;  // per group rank
  int64_t received_ = 0;
  Kokkos::View<int64_t*> to_expert_major_;  // received row -> expert-major row
  Kokkos::View<int64_t*>::HostMirror to_expert_major_host_;
  Kokkos::View<int*> local_expert_;  // expert-major row -> local expert
  Kokkos::View<int*>::HostMirror local_expert_host_;
  Kokkos::View<int64_t*> expert_offsets_;  // [El + 1] expert-major row offsets (host: planned)
  Kokkos::View<int64_t*>::HostMirror expert_offsets_host_;

  double aux_loss_ = 0.0;
  std::vector<double> expert_rows_;

  // Tangents (reserve_tangents, k directions): the gathered input's [rows * k, in]; the router
  // logits' [rows * k, E] and gates' [rows * k, top_k]; per (row, expert) pair k rows through
  // the dispatch ([assignments * k, in], [capacity * k, in] x 2), the experts ([capacity * k,
  // hidden] x 3) and back ([capacity * k, out] x 2, [assignments * k, out]); the output's
  // [rows * k, out] (split output: the whole one first).
  Matrix tangent_x_full_, tangent_logits_, tangent_gates_;
  Matrix tangent_send_x_, tangent_recv_x_, tangent_expert_x_;
  Matrix tangent_up_, tangent_gate_, tangent_h_;
  Matrix tangent_expert_y_, tangent_back_y_, tangent_returned_;
  Matrix tangent_out_full_, tangents_;
  MatrixView tangent_x_used_;  // the last forward_tangents' whole input tangents
  bool second_order_ = false;  // whether the last forward_tangents carried second-order streams
  // Cotangents (reserve_cotangents), the same path backwards: the whole output's [rows * k,
  // out] (split output), the gates' and logits', [assignments * k, out] and [capacity * k,
  // out] x 2 to the experts, [capacity * k, hidden] x 3 inside, [capacity * k, in] x 2 and
  // [assignments * k, in] back, the input's (whole [rows * k, in] first when split).
  Matrix cotangent_y_full_, cotangent_gates_, cotangent_logits_;
  Matrix cotangent_send_y_, cotangent_recv_y_, cotangent_expert_y_;
  Matrix cotangent_h_, cotangent_up_, cotangent_gate_;
  Matrix cotangent_expert_x_, cotangent_back_x_, cotangent_returned_x_;
  Matrix cotangent_x_full_, cotangents_;
};

}  // namespace meshtrain
