# layers/ and the model-side framework pieces (init, optimizers): unit and multi-rank tests.
# The equivalence tests (MLP, mixed precision, MoE) build their meshes on the backend
# MESHTRAIN_TEST_BACKEND names (tests/support/backend.hpp): over MPI and, in a CUDA build with
# NCCL, over NCCL.
meshtrain_add_test(NAME layers_init_test SOURCES layers/init_test.cpp
                   LIBS meshtrain_framework NP 1 2 4 TIMEOUT 120)
# The activations' fast float32 exp and tanh (framework/core/fast_math.hpp): their ulp bounds
# against float64 over a dense sweep of every float32, and glibc's special values exactly; the
# SwiGLU layer's and MoE experts' silu jet (activation_math::silu_jet) against float64.
meshtrain_add_test(NAME layers_activation_fast_math_test SOURCES layers/activation_fast_math_test.cpp
                   LIBS meshtrain_framework TIMEOUT 300)
# The training step's 16-bit elementwise passes (layers/sixteen_bit_passes.hpp: the activations'
# forward keeping 16 bits and backward from them, the Linear's 16-bit bias add and bias
# gradient): the per-ISA host loops give the Kokkos kernels' bits on rounding edge cases, every
# activation, bf16 and fp16. One rank (no communication); skipped where the layers run no host
# kernels.
meshtrain_add_test(NAME layers_sixteen_bit_passes_test SOURCES layers/sixteen_bit_passes_test.cpp
                   LIBS meshtrain_layers TIMEOUT 60)
meshtrain_add_test(NAME layers_mlp_test SOURCES layers/mlp_test.cpp
                   LIBS meshtrain_layers NP 1 2 4 8 TIMEOUT 300 BACKENDS mpi nccl EMULATED)
# Training on derivatives (Sobolev training, docs/derivatives.md): the gradient of the derivative
# loss against float64 central differences for every mlp activation, every mesh against one rank
# after 3 steps, and a small Sobolev fit of y = sin(x1) x2; dropout's mask held fixed likewise.
meshtrain_add_test(NAME layers_sobolev_test SOURCES layers/sobolev_test.cpp
                   LIBS meshtrain_layers NP 1 2 4 TIMEOUT 300)
# The same through residual_mlps (LayerNorm + silu, RMSNorm + SwiGLU, no norm + tanh; norms
# perturbed): losses and every parameter gradient against float64 dual numbers and central
# differences, every mesh against one rank after 3 steps, no allocation per step; MoE blocks and
# dropout accepted.
meshtrain_add_test(NAME layers_sobolev_residual_test SOURCES layers/sobolev_residual_test.cpp
                   LIBS meshtrain_layers NP 1 2 4 TIMEOUT 300)
# Physics losses through the forward Laplacian (docs/derivatives.md): the network's Laplacian
# against finite differences, every parameter gradient against float64 central differences for
# every mlp activation, every mesh against one rank after 3 steps, no allocation per step; the
# same with dropout (its training pass's mask held fixed).
meshtrain_add_test(NAME layers_physics_loss_test SOURCES layers/physics_loss_test.cpp
                   LIBS meshtrain_layers NP 1 2 4 TIMEOUT 300)
meshtrain_add_test(NAME layers_mixed_precision_test SOURCES layers/mixed_precision_test.cpp
                   LIBS meshtrain_layers NP 1 2 4 8 TIMEOUT 420 BACKENDS mpi nccl EMULATED)
# The weights' 16-bit copies where gemm() reads 16 bits (oneDNN's bf16 matmul on a CPU with
# AVX512_BF16, the default where oneDNN is built in: DP and one-rank weights have copies too, read
# by the GEMMs as they are) and where it does not (OpenBLAS: the copies test alone, GTEST_FILTER,
# at np 1 2 4 over MPI, with MESHTRAIN_CPU_GEMM=openblas). The MLP's equivalence tests on OpenBLAS
# as well (np 1 2 4 over MPI), so that both host libraries stay tested.
if(MESHTRAIN_GEMM_ONEDNN)
  meshtrain_add_test_variant(NAME layers_mixed_precision_test VARIANT openblas NP 1 2 4
                             BACKENDS mpi ENVIRONMENT MESHTRAIN_CPU_GEMM=openblas
                             GTEST_FILTER=MixedPrecision.SixteenBitCopies*)
  meshtrain_add_test_variant(NAME layers_mlp_test VARIANT openblas NP 1 2 4 BACKENDS mpi
                             ENVIRONMENT MESHTRAIN_CPU_GEMM=openblas)
endif()
# The layers' 16-bit operand paths (a Linear's kept 16-bit input, DP's packed weight, FSDP's
# gathered 16-bit blocks read by the GEMM: docs/mixed_precision.md) on any CPU: gemm() takes them
# where it reads 16 bits (oneDNN bf16 on AVX512_BF16 or AMX, cuBLAS), and elsewhere widens them
# itself; the 16-bit storage tests stay bit for bit the simulated path either way.
meshtrain_add_test_variant(NAME layers_mixed_precision_test VARIANT operands16 NP 2 4
                           BACKENDS mpi ENVIRONMENT MESHTRAIN_GEMM_16BIT_OPERANDS=always
                           GTEST_FILTER=*SixteenBit*BitIdentical*)
# Small unit tests of the MLP's pieces, among them the weight gradient's rounding left out where
# the wire rounds (WireRounding.*: DP all-reduce, FSDP reduce-scatter, buckets, bit for bit).
meshtrain_add_test(NAME layers_units_test SOURCES layers/units_test.cpp
                   LIBS meshtrain_layers NP 1 2 4 TIMEOUT 120)
meshtrain_add_test(NAME layers_moe_test SOURCES layers/moe_test.cpp
                   LIBS meshtrain_layers NP 1 2 4 8 TIMEOUT 300 BACKENDS mpi nccl EMULATED)
meshtrain_add_test(NAME layers_residual_block_test SOURCES layers/residual_block_test.cpp
                   LIBS meshtrain_layers NP 1 2 4 TIMEOUT 120 BACKENDS mpi nccl EMULATED)
# The derivative forward's kept slopes and x_hat (Mlp::reserve_derivative_forward): a plain
# forward after a derivative one gives the bits of a model that never reserved; kept against
# recomputed, bit for bit without norms, within 2e-6 with LayerNorm and RMSNorm.
meshtrain_add_test(NAME layers_derivative_forward_test SOURCES layers/derivative_forward_test.cpp
                   LIBS meshtrain_layers NP 1 2 4 TIMEOUT 60)
meshtrain_add_test(NAME layers_norm_test SOURCES layers/norm_test.cpp
                   LIBS meshtrain_layers meshtrain_test_counting_allocator NP 1 2 4 8 TIMEOUT 120
                   BACKENDS mpi nccl EMULATED)
# The regression losses (layers/loss.hpp): mse, huber, mae, weighted and not, outputs split and
# replicated, on dp, fsdp, tp and fsdp x tp against float64; the reference's gradients against
# central differences.
meshtrain_add_test(NAME layers_loss_test SOURCES layers/loss_test.cpp
                   LIBS meshtrain_layers NP 1 2 4 TIMEOUT 60 EMULATED)
# Evaluation metrics (layers/eval_metrics.hpp): accuracy, top-5 and per-class accuracy, and
# MSE / MAE / R^2 per output de-normalized, on dp, fsdp, tp and fsdp x tp against float64.
meshtrain_add_test(NAME layers_eval_metrics_test SOURCES layers/eval_metrics_test.cpp
                   LIBS meshtrain_layers NP 1 2 4 TIMEOUT 60 EMULATED)
# The residual_mlp model (Mlp's second constructor): rmsnorm / layernorm / none, silu / swiglu,
# on dp, fsdp, tp, fsdp x tp and dp x tp (np 8: 2x4 fsdp x tp) with overlap off and on, under tp
# every collective-matmul algorithm (the column-/row-parallel pair), against float64.
meshtrain_add_test(NAME layers_residual_mlp_test SOURCES layers/residual_mlp_test.cpp
                   LIBS meshtrain_layers NP 1 2 4 8 TIMEOUT 120 BACKENDS mpi nccl EMULATED)
# MoE blocks in residual_mlp (model.moe_layers naming blocks): float64 reference and one rank.
meshtrain_add_test(NAME layers_moe_block_test SOURCES layers/moe_block_test.cpp
                   LIBS meshtrain_layers NP 1 2 4 TIMEOUT 120 BACKENDS mpi nccl EMULATED)
# The embedding bag (layers/embedding_bag.hpp, issue 39): replicated, row-wise, column-wise and
# table-wise tables on dp,
# fsdp, fsdp x dp and dp x tp, sum and mean, against the same layer on one rank (bit for bit
# where sums keep their order); empty bags, repeated ids, ids on one shard, bad ids and specs.
meshtrain_add_test(NAME layers_embedding_bag_test SOURCES layers/embedding_bag_test.cpp
                   LIBS meshtrain_layers meshtrain_test_counting_allocator NP 1 2 4 TIMEOUT 120
                   BACKENDS mpi nccl EMULATED)
# DLRM (layers/dlrm.hpp, issue 39): one rank against a float64 reference, and dp, fsdp and
# fsdp x dp with replicated and row-wise tables against one rank; dot and cat; sparse and
# predict-only (TableGradients::none) models' memory by the tracker; the refusals; row-wise and
# table-wise tables of one communicator in 4 all-to-alls a step (counted), equal to one rank.
meshtrain_add_test(NAME layers_dlrm_test SOURCES layers/dlrm_test.cpp
                   LIBS meshtrain_layers meshtrain_test_counting_allocator NP 1 2 4 TIMEOUT 120)
# Sparse table updates (layers/sparse_optimizer.hpp, issue 39 item 4): row-wise Adagrad of the
# touched rows only, replicated and row-wise on dp, fsdp, fsdp x dp and dp x tp, against a
# float64 reference; untouched rows bit for bit, empty bags, repeated ids, one shard's ids.
meshtrain_add_test(NAME layers_sparse_optimizer_test SOURCES layers/sparse_optimizer_test.cpp
                   LIBS meshtrain_layers meshtrain_test_counting_allocator NP 1 2 4 TIMEOUT 120
                   BACKENDS mpi nccl EMULATED)
# Training on derivatives through MoE layers (an mlp of linear experts, residual_mlp blocks of
# activation or SwiGLU experts): losses and every parameter gradient against float64 central
# differences with the routing held fixed, ep, dp, fsdp, tp, dp x ep, fsdp x ep, ep x tp against
# one rank after 3 steps (the residual_mlps with 4 inputs through the MoE block's split-input
# path under tp), no allocation per step; the Laplacian accepted for every kind of expert (its
# checks: layers_physics_moe_test).
meshtrain_add_test(NAME layers_sobolev_moe_test SOURCES layers/sobolev_moe_test.cpp
                   LIBS meshtrain_layers NP 1 2 4 TIMEOUT 300)
# Physics losses through MoE layers (linear, activation and SwiGLU experts, the latter two also
# after a plain block, their second-order input streams nonzero): u, du, d2u against a
# float64 reference of jets (itself against central differences), every parameter gradient
# against float64 central differences with the routing held fixed, the gates' second-order term
# seen; ep, dp, fsdp, tp, dp x ep, fsdp x ep, ep x tp against one rank after 3 steps, no
# allocation per step; the MoE block's split-input path on tp2 and ep2 x tp2 against float64.
meshtrain_add_test(NAME layers_physics_moe_test SOURCES layers/physics_moe_test.cpp
                   LIBS meshtrain_layers NP 1 2 4 TIMEOUT 300)
