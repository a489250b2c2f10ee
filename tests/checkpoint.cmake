# Checkpoints: resharding round trips, keep/latest, bad input, corruption, inspect, h5dump.
find_program(MESHTRAIN_H5DUMP h5dump)
if(NOT MESHTRAIN_H5DUMP)
  message(WARNING "h5dump not found (Debian: hdf5-tools): the h5dump checkpoint test will be skipped")
  set(MESHTRAIN_H5DUMP "")
endif()
meshtrain_add_test(NAME checkpoint_test SOURCES checkpoint/checkpoint_test.cpp
                   LIBS meshtrain_framework NP 1 2 4 TIMEOUT 120 EMULATED)
find_program(MESHTRAIN_H5REPACK h5repack)
if(NOT MESHTRAIN_H5REPACK)
  set(MESHTRAIN_H5REPACK "")
endif()
target_compile_definitions(checkpoint_test PRIVATE MESHTRAIN_H5DUMP="${MESHTRAIN_H5DUMP}"
                                                   MESHTRAIN_H5REPACK="${MESHTRAIN_H5REPACK}")
# The same tests with asynchronous saves (checkpoint_async_<backend>_np<n>).
meshtrain_add_test_variant(NAME checkpoint_test VARIANT async
                           ENVIRONMENT MESHTRAIN_TEST_CHECKPOINT_ASYNC=1)

# The checkpoint save with its test-only fault hook (framework/io/checkpoint_testing.hpp):
# checkpoint_save.cpp compiled again with MESHTRAIN_CHECKPOINT_FAULTS. A program that links it
# gets this object ahead of the static meshtrain_framework, so the archive's hook-less
# checkpoint_save.cpp.o is never pulled in; meshtrain and the installed library have no hook.
add_library(meshtrain_checkpoint_faults OBJECT
            ${PROJECT_SOURCE_DIR}/framework/io/checkpoint_save.cpp)
target_link_libraries(meshtrain_checkpoint_faults PUBLIC meshtrain_framework)
target_compile_definitions(meshtrain_checkpoint_faults PUBLIC MESHTRAIN_CHECKPOINT_FAULTS=1)

# Crash tests: a save killed (sync, or one rank during an async save) or failing on one rank
# at each fault point leaves the previous checkpoint latest and loadable. Every part runs at
# np 2, the smallest job where one rank can fail alone; np 1 runs the saves killed on every
# rank (one writer: the file's own code, no collective), np 4 the parts where one rank of
# several fails or is killed (the last, rank 3, while ranks 0-2 go on). Each mpirun costs about
# a second on 2 cores, and the script runs one per save, kill and check: running every part at
# every count took 138 of them (121 s of CI); these take 73.
add_executable(checkpoint_fault_tool checkpoint/checkpoint_fault_tool.cpp)
target_link_libraries(checkpoint_fault_tool PRIVATE meshtrain_checkpoint_faults meshtrain_framework)
foreach(case "1;sync" "2;all" "4;async,one_rank")
  list(GET case 0 np)
  list(GET case 1 parts)
  meshtrain_add_command_test(NAME checkpoint_crash_np${np} TIMEOUT 240
    COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/checkpoint/crash_test.sh $<TARGET_FILE:checkpoint_fault_tool>
            ${np} ${parts} ${MESHTRAIN_MPIEXEC} ${MESHTRAIN_MPIEXEC_TEST_FLAGS})
  set_tests_properties(checkpoint_crash_np${np} PROPERTIES PROCESSORS ${np})
endforeach()

# The plan counts the asynchronous checkpoint's staging buffer (parameters + optimizer state
# per rank for FSDP AdamW on 2 ranks: 1339412 + 2678824 bytes), and nothing when saves are
# sync, except in device memory (a CUDA build), where a sync save stages through host memory
# too (checkpoint_stages_tensors).
if(Kokkos_ENABLE_CUDA)
  set(_sync_staging 4018236)
else()
  set(_sync_staging 0)
endif()
meshtrain_add_command_test(NAME checkpoint_plan_counts_staging
  COMMAND $<TARGET_FILE:meshtrain> plan ${PROJECT_SOURCE_DIR}/configs/fashion_mnist_fsdp.toml
          --world 2 --json
  PASS_REGULAR_EXPRESSION "\"checkpoint_staging_bytes\": 4018236")
meshtrain_add_command_test(NAME checkpoint_plan_sync_has_no_staging
  COMMAND $<TARGET_FILE:meshtrain> plan ${PROJECT_SOURCE_DIR}/configs/fashion_mnist_fsdp.toml
          --world 2 --json --set checkpoint.async=false
  PASS_REGULAR_EXPRESSION "\"checkpoint_staging_bytes\": ${_sync_staging},?\n")
