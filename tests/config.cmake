# Config loading (framework/config.cpp) and the `meshtrain` command's argument and error
# handling: unit tests without mpiexec, command tests through tests/cli/expect_exit.sh.
meshtrain_add_test(NAME config_test SOURCES config/config_test.cpp LIBS meshtrain_framework)
target_compile_definitions(config_test PRIVATE MESHTRAIN_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
