# `cmake --install` into a temporary prefix, then examples/train_mlp built against the
# installed package alone (find_package(meshtrain)) and run at np 2: it must train and
# save a checkpoint; then examples/predict_surrogate, built the same way, predicts from that
# checkpoint inside its own time loop at np 2. Installing needs the whole build, so this
# runs after the other tests are built (as ctest always does).
meshtrain_add_command_test(NAME install_example_np2 TIMEOUT 600
  COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/install/install_example.sh ${CMAKE_BINARY_DIR}
          ${PROJECT_SOURCE_DIR}/examples/train_mlp ${MESHTRAIN_MPIEXEC}
          ${MESHTRAIN_MPIEXEC_TEST_FLAGS})
set_tests_properties(install_example_np2 PROPERTIES PROCESSORS 2)

# What scripts/run and scripts/test build: scripts/run only the command and write_hdf5_dataset
# (the targets its job and the README's tour use), scripts/test everything (stubbed cmake, ctest
# and mpirun log the calls; tests/install/script_targets.sh).
meshtrain_add_command_test(NAME scripts_build_targets TIMEOUT 60
  COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/install/script_targets.sh ${PROJECT_SOURCE_DIR}
          ${CMAKE_BINARY_DIR})

# examples/online_c (a C simulation using only <meshtrain/stream.h>) built against the installed
# package and run beside the installed `meshtrain train` in one MPMD job of 2 + 2 ranks
# (tests/install/online_example.sh says what it checks).
meshtrain_add_command_test(NAME install_online_example TIMEOUT 300
  COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/install/online_example.sh ${PROJECT_SOURCE_DIR}
          ${CMAKE_BINARY_DIR} ${MESHTRAIN_MPIEXEC} ${MESHTRAIN_MPIEXEC_TEST_FLAGS})
set_tests_properties(install_online_example PROPERTIES PROCESSORS 2)
