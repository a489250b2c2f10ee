# Inference (issue 26): Predictor and `meshtrain predict`.
# Predictor and the predict command against a float64 forward written in the test, on dp,
# fsdp, tp, fsdp x tp (2x4 at np 8) and an MoE model on ep; normalization; row order over
# shards and padding; no allocation per call.
meshtrain_add_test(NAME predict_predictor_test SOURCES predict/predictor_test.cpp
                   LIBS meshtrain_command meshtrain_test_counting_allocator NP 1 2 4 8 TIMEOUT 120
                   EMULATED)
# `meshtrain predict` from the command line (tests/cli/predict_cli.sh): a prediction at np 1
# and 2, an existing output refused unless --overwrite, no partial file after a bad input, a
# model-changing --set and an unknown checkpoint named.
foreach(np 1 2)
  meshtrain_add_command_test(NAME cli_predict_np${np} TIMEOUT 90
    COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/cli/predict_cli.sh $<TARGET_FILE:meshtrain>
            $<TARGET_FILE:data_write_hdf5> ${np} ${MESHTRAIN_MPIEXEC} ${MESHTRAIN_MPIEXEC_TEST_FLAGS})
  set_tests_properties(cli_predict_np${np} PROPERTIES PROCESSORS ${np})
endforeach()
