# framework/ communicators, runtime and collective matmuls: every collective and every
# collective-matmul algorithm against a one-rank reference, on the world and on the groups
# of an fsdp x tp mesh; timeouts; workspace memory.
meshtrain_add_test(NAME comm_communicator_test SOURCES comm/communicator_test.cpp
                   LIBS meshtrain_framework NP 1 2 4 8 TIMEOUT 120 EMULATED)
meshtrain_add_test(NAME comm_collective_matmul_test SOURCES comm/collective_matmul_test.cpp
                   LIBS meshtrain_framework NP 1 2 4 8 TIMEOUT 180 EMULATED)

# The MPI backend's own ring reduce-scatter and all-reduce (backends/mpi_ring.hpp): the
# documented summation order bit for bit, a float64 bound, any count, 16-bit wires, the same
# bits on every rank, the timeout of a rank that never joins, no allocation when repeated.
meshtrain_add_test(NAME comm_ring_test SOURCES comm/ring_test.cpp
                   LIBS meshtrain_framework NP 1 2 3 4 8 TIMEOUT 120 EMULATED)

# A failing rank ends the job (its exit status, its message on stderr) instead of leaving the
# others waiting in a collective: a failure inside the program, and one while the Runtime
# starts (a rank without a usable GPU).
add_executable(comm_abort_tool comm/abort_tool.cpp)
target_link_libraries(comm_abort_tool PRIVATE meshtrain_framework)
meshtrain_add_command_test(NAME comm_abort_np2 TIMEOUT 90
  COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/comm/expect_abort.sh $<TARGET_FILE:comm_abort_tool>
          run 2 "config key 'mesh.tp' = 3" ${MESHTRAIN_MPIEXEC} ${MESHTRAIN_MPIEXEC_TEST_FLAGS})
meshtrain_add_command_test(NAME comm_abort_at_startup_np2 TIMEOUT 90
  COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/comm/expect_abort.sh $<TARGET_FILE:comm_abort_tool>
          startup 1 "no usable GPU on this rank (test)" ${MESHTRAIN_MPIEXEC}
          ${MESHTRAIN_MPIEXEC_TEST_FLAGS})
set_tests_properties(comm_abort_np2 comm_abort_at_startup_np2 PROPERTIES PROCESSORS 2)
# run_agreed: the lowest failing rank's error on every rank; a rank that never joins times out.
meshtrain_add_test(NAME comm_failure_agreement_test SOURCES comm/failure_agreement_test.cpp
                   LIBS meshtrain_framework NP 1 2 4 TIMEOUT 60)
# all_reduce in double, pooled shift requests, a throwing communicator factory, the
# communication backend choice.
meshtrain_add_test(NAME comm_runtime_test SOURCES comm/runtime_test.cpp
                   LIBS meshtrain_framework NP 1 2 4 TIMEOUT 60)
# The free list of the communicators' started operations and 16-bit buffers: best fit by
# capacity (framework/comm/slot_pool.hpp).
meshtrain_add_test(NAME comm_slot_pool_test SOURCES comm/slot_pool_test.cpp
                   LIBS meshtrain_framework)
# NCCL ordering (framework/comm/backends/nccl_state.hpp, rule 7): the communicators of a device
# share one stream, and started and blocking operations of two groups interleaved as in the
# overlapped step complete. Runs in a CUDA build with a GPU per rank; skipped otherwise.
if(MESHTRAIN_HAVE_NCCL)
  meshtrain_add_test(NAME comm_nccl_ordering_test SOURCES comm/nccl_ordering_test.cpp
                     LIBS meshtrain_framework NP 1 2 TIMEOUT 120 BACKENDS nccl)
endif()
# The communication thread ([runtime] comm_thread, framework/comm/progress_thread.hpp): started
# operations against references, progress while the starting rank computes without MPI calls,
# timeouts as without the thread, the generic progress queue.
meshtrain_add_test(NAME comm_thread_test SOURCES comm/comm_thread_test.cpp
                   LIBS meshtrain_framework NP 1 2 3 4 TIMEOUT 120 EMULATED)
# The same hand-off under ThreadSanitizer (no MPI: the progress queue alone), where the
# compiler has it. A data race fails the program (TSAN_OPTIONS exitcode).
include(CheckCXXSourceCompiles)
set(CMAKE_REQUIRED_FLAGS "-fsanitize=thread")
set(CMAKE_REQUIRED_LINK_OPTIONS "-fsanitize=thread")
check_cxx_source_compiles("int main() { return 0; }" MESHTRAIN_HAVE_TSAN)
unset(CMAKE_REQUIRED_FLAGS)
unset(CMAKE_REQUIRED_LINK_OPTIONS)
if(MESHTRAIN_HAVE_TSAN)
  # The thread records its spans through the tracer (framework/observe/trace.cpp, and
  # device_timer.cpp's host branch, without Kokkos' library): compiled in as well, so its
  # lanes are checked too.
  add_executable(comm_progress_thread_tsan comm/progress_thread_tsan.cpp
                 ${PROJECT_SOURCE_DIR}/framework/comm/progress_thread.cpp
                 ${PROJECT_SOURCE_DIR}/framework/observe/trace.cpp
                 ${PROJECT_SOURCE_DIR}/framework/observe/device_timer.cpp)
  target_include_directories(comm_progress_thread_tsan PRIVATE ${PROJECT_SOURCE_DIR}
    $<TARGET_PROPERTY:meshtrain::kokkos,INTERFACE_INCLUDE_DIRECTORIES>)
  target_compile_options(comm_progress_thread_tsan PRIVATE -fsanitize=thread -O1 -g)
  target_compile_definitions(comm_progress_thread_tsan PRIVATE MESHTRAIN_DEVICE_TIMER_WITHOUT_KOKKOS=1)
  target_link_options(comm_progress_thread_tsan PRIVATE -fsanitize=thread)
  find_package(Threads REQUIRED)
  target_link_libraries(comm_progress_thread_tsan PRIVATE Threads::Threads
                        nlohmann_json::nlohmann_json)
  meshtrain_add_command_test(NAME comm_progress_thread_tsan TIMEOUT 120
    COMMAND $<TARGET_FILE:comm_progress_thread_tsan>)
  set_property(TEST comm_progress_thread_tsan APPEND PROPERTY ENVIRONMENT
               "TSAN_OPTIONS=halt_on_error=1 exitcode=66")
endif()

# The flight recorder (framework/observe/flight_recorder.hpp): the record holds exactly the
# collectives run, wraps after its capacity, and SIGUSR1 writes it while the program goes on;
# the program's own SIGTERM/SIGUSR1 handlers are chained and restored; configure() waits for
# a write in progress; the wait-chain analysis (find_hang_roots) on synthetic records.
meshtrain_add_test(NAME comm_flight_recorder_test SOURCES comm/flight_recorder_test.cpp
                   LIBS meshtrain_framework NP 1 2 4 TIMEOUT 60)
# A rank stopped, killed, or skipping a collective: the job ends within a bound, the other
# ranks' records are written, and the error (or the records compared after the fact) names
# the rank and the collective it never entered, and the rank at the root of the wait (or the
# cycle, for a skipped collective) (flight_fault_test.sh). stop_fsdp and stop_tp: world rank
# 3 of a (fsdp=2, tp=2) mesh stopped before a collective of either axis, a wait chain of
# length 2 whose root both the timeout error and the report name.
add_executable(comm_flight_tool comm/flight_tool.cpp)
target_link_libraries(comm_flight_tool PRIVATE meshtrain_framework)
foreach(np 2 4)
  set(faults stop kill skip)
  if(np EQUAL 4)
    list(APPEND faults stop_fsdp stop_tp)
  endif()
  foreach(fault ${faults})
    meshtrain_add_command_test(NAME comm_flight_${fault}_np${np} TIMEOUT 90 SIGTERM_GRACE
      COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/comm/flight_fault_test.sh
              $<TARGET_FILE:comm_flight_tool> ${np} ${fault} ${MESHTRAIN_MPIEXEC}
              ${MESHTRAIN_MPIEXEC_TEST_FLAGS})
    set_tests_properties(comm_flight_${fault}_np${np} PROPERTIES PROCESSORS ${np})
  endforeach()
endforeach()
# The recorder in a real `meshtrain train` (np 2): SIGUSR1 writes the records while the run
# goes on, SIGTERM writes them and ends it, `meshtrain flight-report` reads them.
meshtrain_add_command_test(NAME cli_flight_signals_np2 TIMEOUT 90 SIGTERM_GRACE
  COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/cli/flight_signals.sh $<TARGET_FILE:meshtrain>
          ${MESHTRAIN_MPIEXEC} ${MESHTRAIN_MPIEXEC_TEST_FLAGS})
set_tests_properties(cli_flight_signals_np2 PROPERTIES PROCESSORS 2)
