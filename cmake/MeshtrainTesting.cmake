# meshtrain_add_test(NAME <name> SOURCES <files...> [NP <n...>] [LIBS <targets...>]
#                    [TIMEOUT <seconds>] [ARGS <args...>] [BACKENDS <backend...>] [EMULATED])
#
# Builds one GoogleTest executable, build/bin/<name>, from SOURCES (linked with the shared MPI
# test main, tests/mpi_test_main.cpp) and registers it with ctest once per backend this build
# runs it on and per process count in NP, named by where it runs (<base> is <name> without
# its "_test"):
#   <base>_<backend>_np<n>  ->  mpiexec -n <n> <flags> build/bin/<name> <args>
# Without NP it runs once, without mpiexec (MPI initializes as a singleton): <base>_<backend>.
# The backends come from the build configuration, not from the call:
#   mpi       every build (a CUDA build stages MPI through pinned memory)
#   emulated  a CPU build, for the tests marked EMULATED: the same program over MPI with
#             MESHTRAIN_EMULATE_DEVICE_MEMORY=1 (host memory treated as a GPU's:
#             base/device_memory_emulation.hpp), at the counts in NP up to 4
#   nccl      a build with NCCL, for tests whose BACKENDS name it. A test that runs over MPI
#             too chooses NCCL as runtime.backend does, which also needs a CUDA Kokkos.
# BACKENDS (default mpi) are the backends the test can run on; each registration sets
# MESHTRAIN_TEST_BACKEND to its communication backend (mpi or nccl: tests/support/backend.hpp).
# NCCL ranks start through tests/nccl/share_gpu.sh, so ranks beyond a node's GPUs share one.
# Every test is labelled with its backend (`ctest -L nccl`), and with gpu in a CUDA build;
# tests registered any other way are labelled command (meshtrain_finish_tests).
# Every registered test has a ctest timeout (default 120 s) so a hang fails, never blocks,
# and reserves one ctest slot per rank, at most 2 (PROCESSORS), so `ctest -j2` does not overload.
# A program whose every case skipped (GTEST_SKIP) on every rank exits with
# MESHTRAIN_TEST_SKIP_CODE (tests/mpi_test_main.cpp, after a "SKIP: <reason>" line per reason),
# which is the test's SKIP_RETURN_CODE: ctest counts it as skipped, not passed. A program that
# skips some cases and runs others passes.
#
# meshtrain_add_test_variant(NAME <name> VARIANT <variant> ENVIRONMENT <VAR=value...>
#                            [NP <n...>] [BACKENDS <backend...>])
# registers test <name> again wherever it is registered (or at the process counts NP, on those of
# its backends in BACKENDS: mpi, nccl, emulated), with more environment, as
# <base>_<variant>_<backend>_np<n>.

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
  # Faster job start-up, the same MPI: ob1 named (the PML Open MPI picks here anyway: Debian's
  # openmpi-mca-params.conf excludes UCX) so that the others are not opened and queried, and
  # PMIx keeping the job's data in each process (gds hash) instead of its shared-memory store.
  # Together about 0.25 s less per mpirun on 2 cores (checkpoint_crash_np2, 36 jobs: 32 s ->
  # 22 s); 270 registrations start under mpiexec and 153 script tests run it, most of them
  # many times. A test environment only: meshtrain's own runs keep the MPI's defaults.
  list(APPEND MESHTRAIN_TEST_ENVIRONMENT OMPI_MCA_pml=ob1 PMIX_MCA_gds=hash)
  # A job with a rank that failed or died: mpirun sends the other ranks SIGTERM and waits
  # odls_base_sigkill_timeout (1 s) before SIGKILL, and then once more, so every such job took
  # 2 s longer even when all its ranks had already exited (the crash, resume and bad-input tests
  # run hundreds of them). 0 sends SIGKILL right after SIGTERM. Only a program that handles
  # SIGTERM can tell: the flight recorder's tests (meshtrain_add_command_test SIGTERM_GRACE)
  # keep mpirun's default, under which a rank has 1 s to write its record.
  set(MESHTRAIN_TEST_SIGTERM_GRACE_ENVIRONMENT ${MESHTRAIN_TEST_ENVIRONMENT}
      OMPI_MCA_odls_base_sigkill_timeout=1)
  list(APPEND MESHTRAIN_TEST_ENVIRONMENT OMPI_MCA_odls_base_sigkill_timeout=0)
else()
  set(MESHTRAIN_TEST_SIGTERM_GRACE_ENVIRONMENT ${MESHTRAIN_TEST_ENVIRONMENT})
endif()
set(MESHTRAIN_MPIEXEC_TEST_FLAGS ${_mpi_flags} CACHE INTERNAL "")
# The exit status of a test that skipped as a whole: the GoogleTest main's kSkippedExitCode, and
# what the script tests (export, resume, math, ...) exit with when they skip.
set(MESHTRAIN_TEST_SKIP_CODE 77)

# The labels every test of this build carries besides its backend.
set(MESHTRAIN_TEST_LABELS)
if(MESHTRAIN_KOKKOS_CUDA)
  set(MESHTRAIN_TEST_LABELS gpu)
endif()

function(meshtrain_add_test)
  cmake_parse_arguments(T "EMULATED" "NAME;TIMEOUT" "SOURCES;NP;LIBS;ARGS;BACKENDS" ${ARGN})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 120)
  endif()
  if(NOT T_BACKENDS)
    set(T_BACKENDS mpi)
  endif()
  add_executable(${T_NAME} ${T_SOURCES})
  target_link_libraries(${T_NAME} PRIVATE meshtrain_test_main ${T_LIBS})
  meshtrain_reuse_test_precompiled_headers(${T_NAME})
  # Read by _meshtrain_register_test, now and for meshtrain_add_test_variant.
  set_target_properties(${T_NAME} PROPERTIES
    MESHTRAIN_TEST_NP "${T_NP}" MESHTRAIN_TEST_TIMEOUT ${T_TIMEOUT} MESHTRAIN_TEST_ARGS "${T_ARGS}"
    MESHTRAIN_TEST_BACKENDS "${T_BACKENDS}" MESHTRAIN_TEST_EMULATED ${T_EMULATED})
  _meshtrain_register_test(${T_NAME} "")
endfunction()

function(meshtrain_add_test_variant)
  cmake_parse_arguments(T "" "NAME;VARIANT" "ENVIRONMENT;NP;BACKENDS" ${ARGN})
  # NP and BACKENDS, when given, narrow the test's own (read by _meshtrain_register_test).
  set(_variant_counts ${T_NP})
  set(_variant_backends ${T_BACKENDS})
  _meshtrain_register_test(${T_NAME} ${T_VARIANT} ${T_ENVIRONMENT})
endfunction()

# The backends this build runs the test `target` on (see the top of this file).
function(_meshtrain_test_backends out target)
  get_property(wanted TARGET ${target} PROPERTY MESHTRAIN_TEST_BACKENDS)
  get_property(emulated TARGET ${target} PROPERTY MESHTRAIN_TEST_EMULATED)
  set(backends)
  if("mpi" IN_LIST wanted)
    list(APPEND backends mpi)
  endif()
  if("nccl" IN_LIST wanted AND MESHTRAIN_HAVE_NCCL
     AND (MESHTRAIN_KOKKOS_CUDA OR NOT "mpi" IN_LIST wanted))
    list(APPEND backends nccl)
  endif()
  # Device memory is emulated by an environment variable of the same programs, so a CPU build
  # runs them both ways without building them twice.
  if(emulated AND "mpi" IN_LIST wanted AND NOT MESHTRAIN_KOKKOS_CUDA)
    list(APPEND backends emulated)
  endif()
  set(${out} ${backends} PARENT_SCOPE)
endfunction()

# Registers `target`'s tests (<base>[_<variant>]_<backend>[_np<n>]); ARGN: more environment.
function(_meshtrain_register_test target variant)
  get_property(counts TARGET ${target} PROPERTY MESHTRAIN_TEST_NP)
  get_property(timeout TARGET ${target} PROPERTY MESHTRAIN_TEST_TIMEOUT)
  get_property(args TARGET ${target} PROPERTY MESHTRAIN_TEST_ARGS)
  string(REGEX REPLACE "_test$" "" base ${target})
  if(variant)
    string(APPEND base _${variant})
  endif()
  if(NOT counts)
    set(counts 0)  # once, without mpiexec
  endif()
  _meshtrain_test_backends(backends ${target})
  if(_variant_counts)
    set(counts ${_variant_counts})
  endif()
  if(_variant_backends)
    set(narrowed)
    foreach(backend IN LISTS backends)
      if(backend IN_LIST _variant_backends)
        list(APPEND narrowed ${backend})
      endif()
    endforeach()
    set(backends ${narrowed})
  endif()
  foreach(backend IN LISTS backends)
    set(comm mpi)
    set(launch)
    if(backend STREQUAL "nccl")
      set(comm nccl)
      set(launch sh ${PROJECT_SOURCE_DIR}/tests/nccl/share_gpu.sh)
    endif()
    # Emulated device memory checks the copies between host and device, which do not depend on
    # how many ranks take part: it runs at the counts up to 4 (unless a test has only larger
    # ones), so CI does not run 8 oversubscribed ranks twice (about 45 s on 2 cores).
    set(backend_counts ${counts})
    if(backend STREQUAL "emulated")
      set(small_counts)
      foreach(np IN LISTS counts)
        if(np LESS_EQUAL 4)
          list(APPEND small_counts ${np})
        endif()
      endforeach()
      if(small_counts)
        set(backend_counts ${small_counts})
      endif()
    endif()
    foreach(np IN LISTS backend_counts)
      if(np EQUAL 0)
        set(test ${base}_${backend})
        set(command $<TARGET_FILE:${target}>)
        set(slots 1)
      else()
        set(test ${base}_${backend}_np${np})
        set(command ${MESHTRAIN_MPIEXEC} ${MPIEXEC_NUMPROC_FLAG} ${np}
                    ${MESHTRAIN_MPIEXEC_TEST_FLAGS} ${launch} $<TARGET_FILE:${target}>)
        set(slots ${np})
        if(slots GREATER 2)
          set(slots 2)
        endif()
      endif()
      # MESHTRAIN_TEST_REGISTRATION: which registration runs (mpi, nccl, emulated), so a test can
      # check that its registration was given the environment it stands for.
      set(environment ${MESHTRAIN_TEST_ENVIRONMENT} MESHTRAIN_TEST_BACKEND=${comm}
                      MESHTRAIN_TEST_REGISTRATION=${backend} ${ARGN})
      if(backend STREQUAL "emulated")
        list(APPEND environment MESHTRAIN_EMULATE_DEVICE_MEMORY=1)
      endif()
      set(labels ${backend} ${MESHTRAIN_TEST_LABELS})
      add_test(NAME ${test} COMMAND ${command} ${args})
      # RESOURCE_LOCK: two registrations of one program (its emulated one, a variant) never run
      # at the same time; some programs write fixed paths named by mesh and rank count only
      # (/tmp/meshtrain_memory_plan_dp_np1), which its mpi and emulated np 1 runs would share.
      set_tests_properties(${test} PROPERTIES TIMEOUT ${timeout} PROCESSORS ${slots}
                           ENVIRONMENT "${environment}" LABELS "${labels}"
                           SKIP_RETURN_CODE ${MESHTRAIN_TEST_SKIP_CODE}
                           RESOURCE_LOCK ${target})
      set_property(GLOBAL APPEND PROPERTY MESHTRAIN_REGISTERED_TESTS ${test})
      set_property(GLOBAL APPEND PROPERTY MESHTRAIN_TEST_PROGRAMS ${target})
    endforeach()
  endforeach()
endfunction()

# Registers a command-line test of build/bin/meshtrain (or any command) with the same
# environment and timeout as the GoogleTest ones. SIGTERM_GRACE: a test of what ranks do on the
# SIGTERM mpirun sends them when another rank dies (the flight recorder) gets mpirun's default
# second before SIGKILL (the others get none; see MESHTRAIN_TEST_ENVIRONMENT above).
function(meshtrain_add_command_test)
  cmake_parse_arguments(T "WILL_FAIL;SIGTERM_GRACE" "NAME;TIMEOUT;PASS_REGULAR_EXPRESSION" "COMMAND"
                        ${ARGN})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 120)
  endif()
  set(environment ${MESHTRAIN_TEST_ENVIRONMENT})
  if(T_SIGTERM_GRACE)
    set(environment ${MESHTRAIN_TEST_SIGTERM_GRACE_ENVIRONMENT})
  endif()
  add_test(NAME ${T_NAME} COMMAND ${T_COMMAND})
  set_tests_properties(${T_NAME} PROPERTIES TIMEOUT ${T_TIMEOUT} ENVIRONMENT "${environment}")
  if(T_PASS_REGULAR_EXPRESSION)
    set_tests_properties(${T_NAME} PROPERTIES PASS_REGULAR_EXPRESSION "${T_PASS_REGULAR_EXPRESSION}")
  endif()
endfunction()

# Called once after every test list (tests/CMakeLists.txt). The tests not registered by
# meshtrain_add_test (command tests, anything added with add_test) are labelled command.
# The target meshtrain_test_programs builds the programs of the tests this build registers.
function(meshtrain_finish_tests)
  get_property(others DIRECTORY PROPERTY TESTS)
  get_property(registered GLOBAL PROPERTY MESHTRAIN_REGISTERED_TESTS)
  get_property(programs GLOBAL PROPERTY MESHTRAIN_TEST_PROGRAMS)
  if(registered)
    list(REMOVE_ITEM others ${registered})
  endif()
  foreach(test IN LISTS others)
    set_property(TEST ${test} APPEND PROPERTY LABELS command ${MESHTRAIN_TEST_LABELS})
  endforeach()
  list(REMOVE_DUPLICATES programs)
  add_custom_target(meshtrain_test_programs)
  if(programs)
    add_dependencies(meshtrain_test_programs ${programs})
  endif()
endfunction()
