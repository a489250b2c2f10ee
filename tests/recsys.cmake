# scripts/make_recsys_data (issue 39): a small Criteo-shaped set written twice and checked
# against docs/recsys.md's layout (tests/recsys/check_recsys_data.py says what it checks).
meshtrain_add_command_test(NAME recsys_make_data TIMEOUT 120
  COMMAND ${MESHTRAIN_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/recsys/check_recsys_data.py
          ${PROJECT_SOURCE_DIR}/scripts/make_recsys_data ${CMAKE_CURRENT_BINARY_DIR}/recsys_data)

