# Inference (issue 26): Predictor and `meshtrain predict`.
# Predictor and the predict command against a float64 forward written in the test, on dp,
# fsdp, tp, fsdp x tp (2x4 at np 8) and an MoE model on ep; normalization; row order over
# shards and padding; no allocation per call.
meshtrain_add_test(NAME predict_predictor_test SOURCES predict/predictor_test.cpp
                   LIBS meshtrain_command meshtrain_test_counting_allocator NP 1 2 4 8 TIMEOUT 120
                   EMULATED)
# Predictor::predict's inference forward (issue 37 item 7, layers/inference.hpp) against the
# forward Predictor::jacobian runs, every activation and norm, dp, fsdp, tp, fsdp x tp, ep; the
# kernels of one call within the model's pass budget.
meshtrain_add_test(NAME predict_inference_test SOURCES predict/inference_test.cpp
                   LIBS meshtrain_run NP 1 2 4 TIMEOUT 180 EMULATED)
# Predictor::jacobian (issue 40, docs/derivatives.md): forward against reverse mode, every mesh
# (dp, fsdp, tp, fsdp x tp, ep) against one rank, central differences of predict(), several
# passes of each mode against one (also the norm cotangents' groups of 1 to 4 directions: a
# width-40 LayerNorm model with 5 outputs on dp), reverse mode blocked over rows against one
# block, no
# allocation per call, the refusals; MLP, residual_mlp
# (LayerNorm + SiLU, RMSNorm + SwiGLU, RMSNorm + SiLU + dropout) and MoE models.
meshtrain_add_test(NAME predict_jacobian_test SOURCES predict/jacobian_test.cpp
                   LIBS meshtrain_run meshtrain_test_counting_allocator NP 1 2 4 TIMEOUT 300
                   EMULATED)
# `meshtrain predict --jacobian` against float64 (tests/predict/jacobian_reference.py, one test
# per case, export_test.py's models and data): a numpy float64 Jacobian from the layers'
# tangents against central differences of the float64 forward, and /jacobian of both modes on
# dp (np 1), fsdp and tp (np 2), fsdp x tp (np 4) and ep (np 2, MoE) against it; cli_errors:
# --jacobian's refusals.
set(_jacobian_runs ${CMAKE_CURRENT_BINARY_DIR}/jacobian_runs)
foreach(_case mlp mlp_activations residual_layernorm_silu residual_rmsnorm_swiglu moe residual_moe
              cli_errors)
  meshtrain_add_command_test(NAME predict_jacobian_float64_${_case} TIMEOUT 300
    COMMAND ${MESHTRAIN_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/predict/jacobian_reference.py ${_case}
            --meshtrain $<TARGET_FILE:meshtrain> --source-dir ${PROJECT_SOURCE_DIR}
            --work ${_jacobian_runs}/${_case}
            -- ${MESHTRAIN_MPIEXEC} ${MESHTRAIN_MPIEXEC_TEST_FLAGS})
  set_tests_properties(predict_jacobian_float64_${_case} PROPERTIES PROCESSORS 4)
endforeach()
# `meshtrain predict` from the command line (tests/cli/predict_cli.sh): a prediction at np 1
# and 2, an existing output refused unless --overwrite, no partial file after a bad input, a
# model-changing --set and an unknown checkpoint named.
foreach(np 1 2)
  meshtrain_add_command_test(NAME cli_predict_np${np} TIMEOUT 90
    COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/cli/predict_cli.sh $<TARGET_FILE:meshtrain>
            $<TARGET_FILE:data_write_hdf5> ${np} ${MESHTRAIN_MPIEXEC} ${MESHTRAIN_MPIEXEC_TEST_FLAGS})
  set_tests_properties(cli_predict_np${np} PROPERTIES PROCESSORS ${np})
endforeach()
