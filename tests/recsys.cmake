# scripts/make_recsys_data (issue 39): a small Criteo-shaped set written twice and checked
# against docs/recsys.md's layout (tests/recsys/check_recsys_data.py says what it checks).
meshtrain_add_command_test(NAME recsys_make_data TIMEOUT 120
  COMMAND ${MESHTRAIN_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/recsys/check_recsys_data.py
          ${PROJECT_SOURCE_DIR}/scripts/make_recsys_data ${CMAKE_CURRENT_BINARY_DIR}/recsys_data)


# `meshtrain train` and `evaluate` of a DLRM (docs/recsys.md): np 1, 2, 4 against np 1, the AUC,
# evaluate resharding np 2's checkpoint onto 1 and 4 ranks; a resume bit for bit; an id outside
# its table refused in one sentence on every rank (tests/recsys/check_dlrm_train.py says how);
# the same training and resumes with the tables updated sparsely (row-wise Adagrad, sparse AdamW);
# three tables column-wise on 2 ranks, resumed row-wise on 4, on 1, column-wise on 4 (columns*);
# four tables row-wise on 4 ranks, resumed table-wise on 2 (P(fsdp@table)), then on 1 (tablewise);
# the dlrm preset's plan at world 1, 2, 4 and np 2, 4 training as np 1 (preset); bf16 tables
# (model.table_dtype = "bf16"): np 2 and 4 column-wise bit for bit with np 1, the AUC against fp32
# tables (bf16), a resume bit for bit, resharded onto 4 ranks, into fp32 tables and from them
# (bf16_resume).
foreach(mode train resume bad_id train_rowwise_adagrad resume_rowwise_adagrad resume_sparse_adamw
        columns columns_rowwise_adagrad tablewise tablewise_rowwise_adagrad preset bf16
        bf16_resume)
  meshtrain_add_command_test(NAME recsys_dlrm_${mode} TIMEOUT 180
    COMMAND ${MESHTRAIN_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/recsys/check_dlrm_train.py ${mode}
            ${PROJECT_SOURCE_DIR}/scripts/make_recsys_data
            ${CMAKE_CURRENT_SOURCE_DIR}/recsys/dlrm_small.toml
            ${CMAKE_CURRENT_BINARY_DIR}/recsys_dlrm_${mode}
            -- ${MESHTRAIN_MPIEXEC} ${MESHTRAIN_MPIEXEC_TEST_FLAGS} $<TARGET_FILE:meshtrain>)
  set_tests_properties(recsys_dlrm_${mode} PROPERTIES PROCESSORS 2)
endforeach()

# `meshtrain plan` of a DLRM (docs/recsys.md, "The plan"): each table's placement, rows and
# columns per rank, bytes per rank and communication per step against hand-computed figures at
# world 1, 2 and 4 (a row-wise, a column-wise and a replicated table; tests/recsys/
# check_dlrm_plan.py says how), the --json keys, and the step cost's 4 all-to-all items per group
# of tables exchanging rows over the same axes (one and two groups). No MPI, no data.
meshtrain_add_command_test(NAME recsys_dlrm_plan TIMEOUT 60
  COMMAND ${MESHTRAIN_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/recsys/check_dlrm_plan.py
          $<TARGET_FILE:meshtrain> ${CMAKE_CURRENT_SOURCE_DIR}/recsys/dlrm_plan.toml)

# The flight recorder in a DLRM run: `meshtrain train` on 2 ranks writes <run.output_dir>/flight/
# rank-{0,1}.json on SIGUSR1 and SIGTERM, as a TrainingRun does (check_dlrm_train.py flight).
meshtrain_add_command_test(NAME recsys_dlrm_flight TIMEOUT 180 SIGTERM_GRACE
  COMMAND ${MESHTRAIN_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/recsys/check_dlrm_train.py flight
          ${PROJECT_SOURCE_DIR}/scripts/make_recsys_data
          ${CMAKE_CURRENT_SOURCE_DIR}/recsys/dlrm_small.toml
          ${CMAKE_CURRENT_BINARY_DIR}/recsys_dlrm_flight
          -- ${MESHTRAIN_MPIEXEC} ${MESHTRAIN_MPIEXEC_TEST_FLAGS} $<TARGET_FILE:meshtrain>)
set_tests_properties(recsys_dlrm_flight PROPERTIES PROCESSORS 2)

# Traces of a DLRM run ([runtime] trace_steps; check_dlrm_train.py trace): np 1, 2 and 4 trace
# steps 3 to 5; the files, the step and phase spans, the row-wise tables' all-to-alls per step
# against the plan, and the losses unchanged by tracing.
meshtrain_add_command_test(NAME recsys_dlrm_trace TIMEOUT 240
  COMMAND ${MESHTRAIN_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/recsys/check_dlrm_train.py trace
          ${PROJECT_SOURCE_DIR}/scripts/make_recsys_data
          ${CMAKE_CURRENT_SOURCE_DIR}/recsys/dlrm_small.toml
          ${CMAKE_CURRENT_BINARY_DIR}/recsys_dlrm_trace
          -- ${MESHTRAIN_MPIEXEC} ${MESHTRAIN_MPIEXEC_TEST_FLAGS} $<TARGET_FILE:meshtrain>)
set_tests_properties(recsys_dlrm_trace PROPERTIES PROCESSORS 2)

# `meshtrain calibrate CONFIG` of a DLRM (docs/cost_model.md, "The hardware profile"): the data
# read measured on the config's own file (hdf5_row_seconds, sparse_row_seconds,
# sparse_id_seconds and a [measured] line), read back by `meshtrain plan --hardware`, whose data
# read is those figures; a NaN dense row read by one rank ends every rank with one error line
# (tests/recsys/check_dlrm_calibrate.py). np 1 and 2 (two calibrates each): np 2 already has a
# rank that fails while another does not and the slowest-rank choice; np 4 added nothing of the
# data read's and took 7 s quiet, 24 s loaded, in calibrate's link measurements on 2 cores.
foreach(np 1 2)
  meshtrain_add_command_test(NAME recsys_dlrm_calibrate_np${np} TIMEOUT 120
    COMMAND ${MESHTRAIN_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/recsys/check_dlrm_calibrate.py
            ${PROJECT_SOURCE_DIR}/scripts/make_recsys_data
            ${CMAKE_CURRENT_SOURCE_DIR}/recsys/dlrm_small.toml
            ${CMAKE_CURRENT_BINARY_DIR}/recsys_dlrm_calibrate_np${np} ${np}
            -- ${MESHTRAIN_MPIEXEC} ${MESHTRAIN_MPIEXEC_TEST_FLAGS} $<TARGET_FILE:meshtrain>)
  set_tests_properties(recsys_dlrm_calibrate_np${np} PROPERTIES PROCESSORS 2)
endforeach()

# derive_dlrm_read_figures (calibrate's data-read figures from its timings) on hand-built
# timings: the slope, the rest, the tenth floor, no slope. No MPI collective: one rank.
meshtrain_add_test(NAME recsys_dlrm_read_timing_test SOURCES recsys/dlrm_read_timing_test.cpp
                   LIBS meshtrain_run NP 1 TIMEOUT 30)
