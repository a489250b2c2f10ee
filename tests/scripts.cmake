# scripts/test_summary.py, the summary scripts/test prints after each ctest run (passed,
# skipped with reasons, failed), on a real ctest run of stand-in tests that pass, fail, time
# out, miss their executable, skip in each way and are disabled (a few seconds).
meshtrain_add_command_test(NAME scripts_test_summary TIMEOUT 60
  COMMAND ${MESHTRAIN_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/scripts/test_summary_test.py
          ${CMAKE_COMMAND} ${CMAKE_CTEST_COMMAND} ${CMAKE_CURRENT_BINARY_DIR}/test_summary_work)
