# The pass budget (issue 37, item 6): the Kokkos kernels, deep copies and fences of one
# steady-state training step of an MLP of two hidden layers and a residual SwiGLU model, fp32
# and bf16, on dp, fsdp and tp, against the committed tests/train/pass_budget/*.json; the
# counter against known launches beside another tool's callback, allocating nothing. Rewrite the budget with
#   MESHTRAIN_UPDATE_BUDGET=1 ctest --test-dir build -R train_pass_budget
meshtrain_add_test(NAME train_pass_budget_test SOURCES train/pass_budget_test.cpp
                   LIBS meshtrain_run meshtrain_test_counting_allocator NP 1 2 TIMEOUT 120)
target_compile_definitions(train_pass_budget_test PRIVATE
                           MESHTRAIN_PASS_BUDGET_DIR="${PROJECT_SOURCE_DIR}/tests/train/pass_budget")
# The OpenBLAS budget too where oneDNN is the default (each library has its file).
if(MESHTRAIN_GEMM_ONEDNN)
  meshtrain_add_test_variant(NAME train_pass_budget_test VARIANT openblas NP 1 2
                             ENVIRONMENT MESHTRAIN_CPU_GEMM=openblas)
  # oneDNN's fp32 budget (a CPU without bf16 instructions, CI's perhaps) on a CPU with them too:
  # ONEDNN_MAX_CPU_ISA caps the kernels oneDNN picks below AVX512_BF16.
  meshtrain_add_test_variant(NAME train_pass_budget_test VARIANT avx512core NP 1 2
                             ENVIRONMENT ONEDNN_MAX_CPU_ISA=AVX512_CORE)
endif()
