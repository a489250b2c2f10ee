# Resuming training from checkpoints (issue 5), end to end through `meshtrain train` under
# mpirun (tests/resume/resume_test.py): bit-exact resume on the same mesh (AdamW and SGD
# with momentum), resume onto other meshes and world sizes to tolerance, a save killed
# half-way, and corrupt checkpoints refused by `inspect --verify` and by `train`.
# Each case runs a small model for 12 steps a few times (seconds); exit status 77 = skipped
# when the HDF5 command-line tools (Debian: hdf5-tools) are missing.
find_package(Python3 COMPONENTS Interpreter)
find_program(MESHTRAIN_H5DUMP h5dump)
find_program(MESHTRAIN_H5LS h5ls)
if(NOT Python3_Interpreter_FOUND)
  message(WARNING "python3 not found: the resume tests are not registered")
  return()
endif()
foreach(_tool MESHTRAIN_H5DUMP MESHTRAIN_H5LS)
  if(NOT ${_tool})
    message(WARNING "${_tool} not found (Debian: hdf5-tools): resume tests using it skip")
    set(${_tool} "")
  endif()
endforeach()

# The command with the checkpoint fault hook (test only), for the interrupted-save cases.
add_executable(meshtrain_with_faults resume/meshtrain_with_faults.cpp
               ${PROJECT_SOURCE_DIR}/apps/main.cpp)
target_link_libraries(meshtrain_with_faults PRIVATE meshtrain_checkpoint_faults meshtrain_command)
set_source_files_properties(${PROJECT_SOURCE_DIR}/apps/main.cpp TARGET_DIRECTORY meshtrain_with_faults
                            PROPERTIES COMPILE_DEFINITIONS main=meshtrain_command_main)

set(_resume_runs ${CMAKE_CURRENT_BINARY_DIR}/resume_runs)
function(resume_test name case)
  meshtrain_add_command_test(NAME resume_${name} TIMEOUT 90
    COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/resume/resume_test.py ${case}
            --meshtrain $<TARGET_FILE:meshtrain> --configs ${PROJECT_SOURCE_DIR}/configs
            --meshtrain-with-faults $<TARGET_FILE:meshtrain_with_faults>
            --work ${_resume_runs}/${name} --h5dump "${MESHTRAIN_H5DUMP}"
            --h5ls "${MESHTRAIN_H5LS}" ${ARGN}
            -- ${MESHTRAIN_MPIEXEC} ${MESHTRAIN_MPIEXEC_TEST_FLAGS})
  set_tests_properties(resume_${name} PROPERTIES PROCESSORS 2 SKIP_RETURN_CODE 77)
endfunction()

# Saves are asynchronous (the default) unless a case says --sync.
# 1. Same mesh (np 2), bit for bit: losses of steps 7..12 and the final checkpoint.
resume_test(same_mesh_fsdp_adamw same_mesh --preset fsdp --optimizer adamw)
resume_test(same_mesh_fsdp_adamw_sync same_mesh --preset fsdp --optimizer adamw --sync)
resume_test(same_mesh_fsdp_sgd same_mesh --preset fsdp --optimizer sgd)
resume_test(same_mesh_fsdp_tp_adamw same_mesh --preset fsdp_tp --optimizer adamw)
# 2. Saved on np 4 (fsdp=2 x tp=2), resumed on np 2 and np 1 (dp), to 1e-4.
resume_test(other_mesh other_mesh)
resume_test(other_mesh_sync other_mesh --sync)
# 3. A save killed while writing step 12 leaves step 6 loadable; the next run resumes:
#    synchronous, every rank aborting; asynchronous, rank 1 killed while its writer thread
#    writes and its main thread waits for it.
resume_test(interrupted_save interrupted --preset fsdp --sync)
resume_test(interrupted_async_save interrupted --preset fsdp --fault-rank 1 --fault-action kill)
# 4. inspect shows the trainer's checkpoint; a flipped byte is refused by inspect and train.
resume_test(inspect_corrupt inspect --preset fsdp)
resume_test(inspect_corrupt_sync inspect --preset fsdp --sync)
# 5. A resumed run keeps the saved data order and model (issue 9, bug 3); at or past the
#    run's last step.
resume_test(compatibility compatibility --preset fsdp)
# 6. A learning-rate schedule (cosine with warm-up) and gradient accumulation resume bit for
#    bit from the middle of the warm-up and of the decay (issue 12).
resume_test(schedule schedule --preset fsdp)
# 7. Mixed precision (issue 18): bf16 and fp16 (its loss scale included) resume bit for bit
#    on the same mesh, also under TP; a run changes precision across a resume either way.
resume_test(same_mesh_fsdp_bf16 same_mesh --preset fsdp --precision bf16)
resume_test(same_mesh_fsdp_tp_fp16 same_mesh --preset fsdp_tp --precision fp16)
resume_test(precision precision --preset fsdp)
# 8. MoE layers (issue 19): bit for bit on the same mesh (ep=2), and resharded ep 4 -> 2 -> 1.
resume_test(same_mesh_moe same_mesh --preset dp --moe)
resume_test(moe_reshard moe_reshard --preset dp)
# 9. checkpoint.keep_best with keep = 1 (issue 26, item 5): the save of a new best killed at
#    each fault point (every rank aborting in a synchronous save; one rank SIGKILLed in an
#    asynchronous one) leaves `best` naming a complete, loadable checkpoint that rotation
#    kept, and the resumed run ends with the right `best`; predict, evaluate and export
#    given <dir>/best use the best checkpoint, not the latest.
set(_best_data --write-hdf5 $<TARGET_FILE:data_write_hdf5>)
resume_test(best_abort_writing_np2 best --np 2 --best-mode abort
            --points after_dataset:1,before_close,before_rename ${_best_data})
resume_test(best_abort_pointers_np2 best --np 2 --best-mode abort
            --points before_best,before_latest,before_cleanup ${_best_data})
resume_test(best_kill_np2 best --np 2 --best-mode kill ${_best_data})
resume_test(best_abort_np1 best --np 1 --best-mode abort
            --points after_dataset:1,before_best,before_latest ${_best_data})
foreach(np 1 2)
  resume_test(best_pointer_np${np} best_pointer --np ${np} ${_best_data})
endforeach()
# 10. checkpoint.keep_best changed across a resume (issue 36, item 6): the checkpoint names the
#     metric of its best, and the resume line says the best starts afresh.
resume_test(best_metric best_metric --preset dp)
