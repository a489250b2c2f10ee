# docs/model_math.md reproduced from a checkpoint alone (tests/math/reproduce.py, numpy and
# h5py in float64): a run's last evaluation and `meshtrain predict`'s outputs to 1e-5 relative.
# The residual cases follow docs/models.md (residual_mlp: layernorm + swiglu on fsdp x tp at
# np 4, rmsnorm + silu with normalized targets at np 1).
# Skipped (exit 77) where python3 lacks numpy or h5py; scripts/setup installs both.
set(_math_runs ${CMAKE_CURRENT_BINARY_DIR}/math_runs)
foreach(case_np classification:2 regression:1 residual_classification:4 residual_regression:1)
  string(REPLACE ":" ";" _pair ${case_np})
  list(GET _pair 0 _case)
  list(GET _pair 1 _np)
  set(_test math_reproduce_${_case}_np${_np})
  meshtrain_add_command_test(NAME ${_test} TIMEOUT 120
    COMMAND ${MESHTRAIN_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/math/reproduce.py
            ${_math_runs}/${_case}_np${_np} ${_case} --
            ${MESHTRAIN_MPIEXEC} ${MPIEXEC_NUMPROC_FLAG} ${_np} ${MESHTRAIN_MPIEXEC_TEST_FLAGS}
            $<TARGET_FILE:meshtrain>)
  set_tests_properties(${_test} PROPERTIES SKIP_RETURN_CODE 77 PROCESSORS ${_np})
endforeach()
# A launcher whose `meshtrain predict` fails (tests/math/without_predict.sh) fails the
# reproduction (exit 1, the failed command named), where it once passed without comparing.
meshtrain_add_command_test(NAME math_reproduce_without_predict TIMEOUT 120
  COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/cli/expect_exit.sh 1 "unknown command 'predict'"
          --any-lines --stdout "FAIL: .*predict"
          -- env MESHTRAIN_BINARY=$<TARGET_FILE:meshtrain>
          ${MESHTRAIN_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/math/reproduce.py
          ${_math_runs}/without_predict regression -- ${CMAKE_CURRENT_SOURCE_DIR}/math/without_predict.sh)
