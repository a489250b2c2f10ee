# `meshtrain evaluate` end to end (tests/evaluate/evaluate_test.sh): a tiny run trained to
# its end under `meshtrain train` on HDF5 data, then `meshtrain evaluate` of its checkpoint on
# the test file gives JSON equal to the run's last eval line of metrics.jsonl in every field
# (classification with top-5 and per-class accuracy; regression with per-output metrics);
# np 1 (dp), np 2 (tp, fsdp, an MoE model on ep) and np 4 (fsdp x tp, dp); and resharded onto
# another mesh of the same ranks, to rounding. Bad input: an unknown
# checkpoint, data of another width, float labels under cross_entropy and a model-changing
# --set each end with one sentence and exit 2, leaving no --json file; a --json that is the
# checkpoint is refused.
add_executable(evaluate_write_data evaluate/write_data_tool.cpp)
target_link_libraries(evaluate_write_data PRIVATE meshtrain::hdf5)
find_package(Python3 COMPONENTS Interpreter)
if(NOT Python3_Interpreter_FOUND)
  message(WARNING "python3 not found: the evaluate tests are not registered")
  return()
endif()

set(_evaluate_runs ${CMAKE_CURRENT_BINARY_DIR}/evaluate_runs)
function(evaluate_test name np)
  meshtrain_add_command_test(NAME evaluate_${name}_np${np} TIMEOUT 120
    COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/evaluate/evaluate_test.sh ${name}
            $<TARGET_FILE:meshtrain> $<TARGET_FILE:evaluate_write_data> ${Python3_EXECUTABLE}
            ${CMAKE_CURRENT_SOURCE_DIR}/cli/expect_exit.sh ${_evaluate_runs}/${name}_np${np}
            ${MESHTRAIN_MPIEXEC} ${MPIEXEC_NUMPROC_FLAG} ${np} ${MESHTRAIN_MPIEXEC_TEST_FLAGS})
  set(slots ${np})
  if(slots GREATER 2)
    set(slots 2)
  endif()
  set_tests_properties(evaluate_${name}_np${np} PROPERTIES PROCESSORS ${slots})
endfunction()
evaluate_test(matches_training 1)
evaluate_test(matches_training 2)
evaluate_test(matches_training 4)
evaluate_test(bad_input 2)
# A run's folder (its flight records and trace) is left as it was by evaluate and predict of
# its checkpoint; --flight-dir puts their records elsewhere.
evaluate_test(leaves_run_folder 2)
