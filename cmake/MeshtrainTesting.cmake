# meshtrain_add_test(NAME <name> SOURCES <files...> [NP <n...>] [LIBS <targets...>]
#                    [TIMEOUT <seconds>] [ARGS <args...>])
#
# Builds one GoogleTest executable from SOURCES (linked with the shared MPI test main,
# tests/mpi_test_main.cpp) and registers it with ctest once per process count in NP:
#   <name>_np<n>  ->  mpiexec -n <n> <flags> build/bin/<name> <args>
# Without NP the test runs once, without mpiexec (MPI initializes as a singleton).
# Every registered test has a ctest timeout (default 120 s) so a hang fails, never blocks,
# and reserves one ctest slot per rank (PROCESSORS) so `ctest -j2` does not overload.

find_program(MESHTRAIN_MPIEXEC NAMES ${MPIEXEC_EXECUTABLE} mpiexec mpirun REQUIRED)
set(MESHTRAIN_MPIEXEC_FLAGS "" CACHE STRING "Extra flags for mpiexec in tests")
execute_process(COMMAND ${MESHTRAIN_MPIEXEC} --version OUTPUT_VARIABLE _mpiexec_version
                ERROR_QUIET)
set(_mpi_flags ${MESHTRAIN_MPIEXEC_FLAGS})
# A hung collective fails with an error naming the operation well before ctest's timeout.
set(MESHTRAIN_TEST_ENVIRONMENT OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 MESHTRAIN_COLLECTIVE_TIMEOUT=60)
# Debian's OpenBLAS mistakes some AVX-512 virtual CPUs for "Prescott" and uses generic kernels.
if(EXISTS /proc/cpuinfo)
  file(READ /proc/cpuinfo _cpuinfo)
  if(_cpuinfo MATCHES "avx512f")
    list(APPEND MESHTRAIN_TEST_ENVIRONMENT OPENBLAS_CORETYPE=SkylakeX)
  endif()
endif()
if(_mpiexec_version MATCHES "Open MPI|OpenRTE")
  # Run as root in containers, more ranks than cores, and let waiting ranks yield the core.
  list(APPEND _mpi_flags --oversubscribe --bind-to none --mca mpi_yield_when_idle 1)
  list(APPEND MESHTRAIN_TEST_ENVIRONMENT OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
       OMPI_MCA_rmaps_base_oversubscribe=1)
endif()
set(MESHTRAIN_MPIEXEC_TEST_FLAGS ${_mpi_flags} CACHE INTERNAL "")

function(meshtrain_add_test)
  cmake_parse_arguments(T "" "NAME;TIMEOUT" "SOURCES;NP;LIBS;ARGS" ${ARGN})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 120)
  endif()
  add_executable(${T_NAME} ${T_SOURCES})
  target_link_libraries(${T_NAME} PRIVATE meshtrain_test_main ${T_LIBS})
  if(NOT T_NP)
    add_test(NAME ${T_NAME} COMMAND ${T_NAME} ${T_ARGS})
    set_tests_properties(${T_NAME} PROPERTIES TIMEOUT ${T_TIMEOUT}
                         ENVIRONMENT "${MESHTRAIN_TEST_ENVIRONMENT}")
    return()
  endif()
  foreach(np IN LISTS T_NP)
    set(test_name ${T_NAME}_np${np})
    add_test(NAME ${test_name}
             COMMAND ${MESHTRAIN_MPIEXEC} ${MPIEXEC_NUMPROC_FLAG} ${np} ${MESHTRAIN_MPIEXEC_TEST_FLAGS}
                     $<TARGET_FILE:${T_NAME}> ${T_ARGS})
    set(slots ${np})
    if(slots GREATER 2)
      set(slots 2)
    endif()
    set_tests_properties(${test_name} PROPERTIES TIMEOUT ${T_TIMEOUT} PROCESSORS ${slots}
                         ENVIRONMENT "${MESHTRAIN_TEST_ENVIRONMENT}")
  endforeach()
endfunction()

# Registers a command-line test of build/bin/meshtrain (or any command) with the same
# environment and timeout as the GoogleTest ones.
function(meshtrain_add_command_test)
  cmake_parse_arguments(T "WILL_FAIL" "NAME;TIMEOUT;PASS_REGULAR_EXPRESSION" "COMMAND" ${ARGN})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 120)
  endif()
  add_test(NAME ${T_NAME} COMMAND ${T_COMMAND})
  set_tests_properties(${T_NAME} PROPERTIES TIMEOUT ${T_TIMEOUT}
                       ENVIRONMENT "${MESHTRAIN_TEST_ENVIRONMENT}")
  if(T_PASS_REGULAR_EXPRESSION)
    set_tests_properties(${T_NAME} PROPERTIES PASS_REGULAR_EXPRESSION "${T_PASS_REGULAR_EXPRESSION}")
  endif()
endfunction()
