# scripts/make_recsys_data (issue 39): a small Criteo-shaped set written twice and checked
# against docs/recsys.md's layout (tests/recsys/check_recsys_data.py says what it checks).
meshtrain_add_command_test(NAME recsys_make_data TIMEOUT 120
  COMMAND ${MESHTRAIN_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/recsys/check_recsys_data.py
          ${PROJECT_SOURCE_DIR}/scripts/make_recsys_data ${CMAKE_CURRENT_BINARY_DIR}/recsys_data)


# `meshtrain train` and `evaluate` of a DLRM (docs/recsys.md): np 1, 2, 4 against np 1, the AUC,
# evaluate resharding np 2's checkpoint onto 1 and 4 ranks; a resume bit for bit; an id outside
# its table refused in one sentence on every rank (tests/recsys/check_dlrm_train.py says how);
# the same training and resumes with the tables updated sparsely (row-wise Adagrad, sparse AdamW);
# three tables column-wise on 2 ranks, resumed row-wise on 4, on 1, column-wise on 4 (columns*).
foreach(mode train resume bad_id train_rowwise_adagrad resume_rowwise_adagrad resume_sparse_adamw
        columns columns_rowwise_adagrad)
  meshtrain_add_command_test(NAME recsys_dlrm_${mode} TIMEOUT 180
    COMMAND ${MESHTRAIN_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/recsys/check_dlrm_train.py ${mode}
            ${PROJECT_SOURCE_DIR}/scripts/make_recsys_data
            ${CMAKE_CURRENT_SOURCE_DIR}/recsys/dlrm_small.toml
            ${CMAKE_CURRENT_BINARY_DIR}/recsys_dlrm_${mode}
            -- ${MESHTRAIN_MPIEXEC} ${MESHTRAIN_MPIEXEC_TEST_FLAGS} $<TARGET_FILE:meshtrain>)
  set_tests_properties(recsys_dlrm_${mode} PROPERTIES PROCESSORS 2)
endforeach()
