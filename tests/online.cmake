# Online training (docs/online.md): one program whose ranks split into producers and a trainer
# (1 + 1, 1 + 2, 2 + 2): every row sent counted, the window and reservoir bounds exact, the run
# equal to the same rows from an HDF5 file, a shape mismatch one sentence on both sides. The
# timeout ends any hang of the rendezvous or the close.
meshtrain_add_test(NAME online_stream_test SOURCES online/stream_test.cpp LIBS meshtrain_run
                   NP 2 3 4 TIMEOUT 180)

# Two producers feeding one batch group (np 3: trainer 1 rank on dp; np 4: 2 ranks on tp):
# stream.merge = "round_robin" gives the same buffer, losses and parameters bit for bit in two
# runs whose producers sleep at random between sends, and the same as one producer sending the
# merged order; the statistics of the first min_rows rows the same in both; stream.held_out_rows
# sizes the held-out window (its newest rows, evaluated whole, counted by the plan). The timeout
# ends any hang of the merge, a rendezvous or a close.
meshtrain_add_test(NAME online_order_test SOURCES online/order_test.cpp LIBS meshtrain_run
                   NP 3 4 TIMEOUT 120)

# Checkpoints of an online run (its buffers under /stream) and resuming with them, at trainers 1
# and 2 x producers 1 and 2 (np 2: 1 + 1; np 3: 1 + 2 and 2 + 1; np 4: 2 + 2): the resumed run
# equal bit for bit to the uninterrupted one, the key that turns it off, another trainer count
# refused. The timeout ends any hang of a rendezvous, a resume or a close. Emulated too: the
# buffers are copied to and from checkpoint tensors where device memory is separate.
meshtrain_add_test(NAME online_resume_test SOURCES online/resume_test.cpp LIBS meshtrain_run
                   NP 2 3 4 TIMEOUT 180 EMULATED)

# MPMD, as a simulation runs beside `meshtrain train`: a C producer using only stream.h
# (c_producer.c) as the first program, the trainer on two ranks as the second; each takes its
# part of MPI_COMM_WORLD by MPI_APPNUM. The run ends when the producer closes and its last log
# line counts every row (50 x 16 = 800; each rank keeps 256 of its 400); inputs of another width end both programs with the
# same sentence, the trainer's exit 2.
add_executable(online_c_producer online/c_producer.c)
target_include_directories(online_c_producer PRIVATE ${PROJECT_SOURCE_DIR})
target_link_libraries(online_c_producer PRIVATE meshtrain_framework m)
set_target_properties(online_c_producer PROPERTIES LINKER_LANGUAGE CXX)
set(_online_mpmd ${MESHTRAIN_MPIEXEC} ${MESHTRAIN_MPIEXEC_TEST_FLAGS}
    ${MPIEXEC_NUMPROC_FLAG} 1 $<TARGET_FILE:online_c_producer>)
set(_online_dir ${CMAKE_CURRENT_BINARY_DIR}/online_runs)
meshtrain_add_command_test(NAME online_mpmd_c_producer TIMEOUT 60
  COMMAND ${_online_mpmd} : ${MPIEXEC_NUMPROC_FLAG} 2 $<TARGET_FILE:meshtrain> train
          ${CMAKE_CURRENT_SOURCE_DIR}/online/online_c.toml
          --set run.output_dir=${_online_dir}/c_producer
  PASS_REGULAR_EXPRESSION "stream 800 rows \\(288 overwritten, 512 buffered\\)")
set_tests_properties(online_mpmd_c_producer PROPERTIES PROCESSORS 2)
# Two C producers (800 rows each) into one batch group through `meshtrain train` (1 rank on dp,
# 2 on tp), merged round robin, with a held-out window of its own size: the keys read from the
# command line, every row counted, the 421 rows the hash holds out (computed once from
# stream_row_held_out's definition: splitmix64, fraction 0.25) never trained on, and the last
# evaluation taking the window's 16 rows (held_out_window.sh reads metrics.jsonl; the default
# window would give 64). That the merge is round robin is not visible here (the counts are
# those of arrival too): for round_robin these are no-hang checks of the app's path, its order
# is checked by online_order_test.
set(_online_mpmd_p2 ${MESHTRAIN_MPIEXEC} ${MESHTRAIN_MPIEXEC_TEST_FLAGS}
    ${MPIEXEC_NUMPROC_FLAG} 2 $<TARGET_FILE:online_c_producer>)
foreach(_t 1 2)
  if(_t EQUAL 1)
    set(_mesh --set mesh.dp=1)
  else()
    set(_mesh --set mesh.dp=1 --set mesh.tp=2 --set partition.preset=tp)
  endif()
  meshtrain_add_command_test(NAME online_mpmd_round_robin_p2_t${_t} TIMEOUT 60
    COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/online/held_out_window.sh
            ${_online_dir}/round_robin_t${_t} 16
            ${_online_mpmd_p2} : ${MPIEXEC_NUMPROC_FLAG} ${_t} $<TARGET_FILE:meshtrain> train
            ${CMAKE_CURRENT_SOURCE_DIR}/online/online_c.toml ${_mesh}
            --set stream.merge=round_robin --set stream.test_fraction=0.25
            --set stream.held_out_rows=16
            --set run.output_dir=${_online_dir}/round_robin_t${_t}
    PASS_REGULAR_EXPRESSION "stream 1600 rows \\(923 overwritten, 256 buffered\\), 421 held out.*held_out_window: the last evaluation took 16 held-out rows")
  math(EXPR _procs "2 + ${_t}")
  set_tests_properties(online_mpmd_round_robin_p2_t${_t} PROPERTIES PROCESSORS ${_procs})
endforeach()
# `meshtrain plan` counts the held-out window at its own size: (256 + 16) rows x 6 floats x 4 B
# = 6.38 KiB (ceil(256 x 0.25) = 64 rows without the key: 7.50 KiB).
meshtrain_add_command_test(NAME online_plan_held_out_rows TIMEOUT 30
  COMMAND $<TARGET_FILE:meshtrain> plan ${CMAKE_CURRENT_SOURCE_DIR}/online/online_c.toml
          --set mesh.dp=1 --set stream.test_fraction=0.25 --set stream.held_out_rows=16
  PASS_REGULAR_EXPRESSION "data +6.38 KiB a stream's buffer and held-out window")
meshtrain_add_command_test(NAME online_mpmd_shape_mismatch TIMEOUT 60
  COMMAND ${_online_mpmd} 5 : ${MPIEXEC_NUMPROC_FLAG} 2 $<TARGET_FILE:meshtrain> train
          ${CMAKE_CURRENT_SOURCE_DIR}/online/online_c.toml
          --set run.output_dir=${_online_dir}/mismatch
  PASS_REGULAR_EXPRESSION "meshtrain: error: stream \"c-demo\": the producers send rows of 5 inputs and 2 outputs as float32, but the trainer takes rows of 4 inputs and 2 outputs as float32")
set_tests_properties(online_mpmd_shape_mismatch PROPERTIES PROCESSORS 2)
# The trainer fails at set-up (a bad key): the producer's connect fails with the trainer's
# sentence instead of waiting for it.
meshtrain_add_command_test(NAME online_mpmd_trainer_fails_at_setup TIMEOUT 60
  COMMAND ${_online_mpmd} : ${MPIEXEC_NUMPROC_FLAG} 2 $<TARGET_FILE:meshtrain> train
          ${CMAKE_CURRENT_SOURCE_DIR}/online/online_c.toml --set optimizer.lr=-1
          --set run.output_dir=${_online_dir}/setup_error
  PASS_REGULAR_EXPRESSION "producer: error: stream \"c-demo\": the trainer stopped before it trained: [^\n]*optimizer\\.lr")
set_tests_properties(online_mpmd_trainer_fails_at_setup PROPERTIES PROCESSORS 2)

# The trainer's model back in the simulation (stream.publish_every, LiveModel; 1 + 1, 1 + 2,
# 2 + 2 ranks, the trainer on dp, fsdp and tp): versions and steps, refresh() allocating
# nothing, the LiveModel bit for bit predict on the checkpoint of its step, a producer that
# takes no publish not holding the trainer, a bf16 trainer's publish leaving its 16-bit weight
# copies current. The timeout ends any hang of a publish or a close.
meshtrain_add_test(NAME online_live_test SOURCES online/live_test.cpp
                   LIBS meshtrain_run meshtrain_test_counting_allocator NP 2 3 4 TIMEOUT 180)

# The same with a Fortran producer (fortran_producer.f90: stream.h through iso_c_binding, the
# interface block docs/online.md shows): every row counted, and a shape mismatch's sentence read
# back in Fortran through mt_stream_last_error. Fortran comes with Debian's libopenmpi-dev
# (gfortran, mpi_f08); without a Fortran compiler the tests are not built.
include(CheckLanguage)
check_language(Fortran)
if(CMAKE_Fortran_COMPILER)
  enable_language(Fortran)
  find_package(MPI REQUIRED COMPONENTS Fortran)
  add_executable(online_fortran_producer online/fortran_producer.f90)
  target_link_libraries(online_fortran_producer PRIVATE meshtrain_framework MPI::MPI_Fortran)
  set_target_properties(online_fortran_producer PROPERTIES LINKER_LANGUAGE CXX
                        Fortran_MODULE_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR}/fortran_modules)
  set(_online_mpmd_fortran ${MESHTRAIN_MPIEXEC} ${MESHTRAIN_MPIEXEC_TEST_FLAGS}
      ${MPIEXEC_NUMPROC_FLAG} 1 $<TARGET_FILE:online_fortran_producer>)
  meshtrain_add_command_test(NAME online_mpmd_fortran_producer TIMEOUT 60
    COMMAND ${_online_mpmd_fortran} : ${MPIEXEC_NUMPROC_FLAG} 2 $<TARGET_FILE:meshtrain> train
            ${CMAKE_CURRENT_SOURCE_DIR}/online/online_c.toml
            --set run.output_dir=${_online_dir}/fortran_producer
    PASS_REGULAR_EXPRESSION "stream 800 rows \\(288 overwritten, 512 buffered\\)")
  set_tests_properties(online_mpmd_fortran_producer PROPERTIES PROCESSORS 2)
  meshtrain_add_command_test(NAME online_mpmd_fortran_shape_mismatch TIMEOUT 60
    COMMAND ${_online_mpmd_fortran} 5 : ${MPIEXEC_NUMPROC_FLAG} 2 $<TARGET_FILE:meshtrain> train
            ${CMAKE_CURRENT_SOURCE_DIR}/online/online_c.toml
            --set run.output_dir=${_online_dir}/fortran_mismatch
    PASS_REGULAR_EXPRESSION "fortran producer: error: stream \"c-demo\": the producers send rows of 5 inputs and 2 outputs as float32, but the trainer takes rows of 4 inputs and 2 outputs as float32")
  set_tests_properties(online_mpmd_fortran_shape_mismatch PROPERTIES PROCESSORS 2)
else()
  message(STATUS "meshtrain: no Fortran compiler, so the Fortran producer tests are not built")
endif()

# examples/online_heat (docs/online.md) built in-tree (its <meshtrain/...> includes through a
# link to the source tree) and run as its README line says, 2 simulation ranks beside the
# trainer on 1: the Kokkos simulation streams every cell's row each step, trusts the published
# LiveModel once its error on a step's rows is under 5%, then takes every other step's update
# from it, and the field must stay within 2% (relative L2) of the full solver's. The program
# prints "under the tolerance" only then (and exits 1 otherwise); the timeout ends any hang.
set(_online_example_include ${CMAKE_BINARY_DIR}/example_include)
if(NOT EXISTS ${_online_example_include}/meshtrain)
  file(MAKE_DIRECTORY ${_online_example_include})
  file(CREATE_LINK ${PROJECT_SOURCE_DIR} ${_online_example_include}/meshtrain SYMBOLIC)
endif()
add_executable(online_heat ${PROJECT_SOURCE_DIR}/examples/online_heat/online_heat.cpp)
target_include_directories(online_heat PRIVATE ${_online_example_include})
target_link_libraries(online_heat PRIVATE meshtrain_run)
meshtrain_add_command_test(NAME example_online_heat TIMEOUT 120
  COMMAND ${MESHTRAIN_MPIEXEC} ${MESHTRAIN_MPIEXEC_TEST_FLAGS} ${MPIEXEC_NUMPROC_FLAG} 2
          $<TARGET_FILE:online_heat> : ${MPIEXEC_NUMPROC_FLAG} 1 $<TARGET_FILE:meshtrain> train
          ${PROJECT_SOURCE_DIR}/examples/online_heat/online.toml
          --set run.output_dir=${_online_dir}/online_heat
  PASS_REGULAR_EXPRESSION "relative L2 error [0-9.e+-]+ against the full solver \\(the field itself changed by [0-9.e+-]+\\), under the tolerance 0.02")
set_tests_properties(example_online_heat PROPERTIES PROCESSORS 3)

# A producer that ends without close() (tests/online/producer_gone.sh): two C producers, the
# last returning from main unclosed, beside a trainer on one rank with stream.producer_timeout
# = 2: one warning names it, every row is counted and the run ends by itself (before the fix it
# waited for that close for ever: the timeout ends the hang).
meshtrain_add_command_test(NAME online_mpmd_producer_gone TIMEOUT 60
  COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/online/producer_gone.sh
          $<TARGET_FILE:online_c_producer> $<TARGET_FILE:meshtrain>
          ${CMAKE_CURRENT_SOURCE_DIR}/online/online_c.toml ${_online_dir}/producer_gone
          ${MESHTRAIN_MPIEXEC} ${MESHTRAIN_MPIEXEC_TEST_FLAGS})
set_tests_properties(online_mpmd_producer_gone PROPERTIES PROCESSORS 3)
# The same with stream.merge = "round_robin": the merge waiting at the gone producer's turn
# goes on once the pulls' vote takes it for gone.
meshtrain_add_command_test(NAME online_mpmd_producer_gone_round_robin TIMEOUT 60
  COMMAND env STREAM_MERGE=round_robin bash ${CMAKE_CURRENT_SOURCE_DIR}/online/producer_gone.sh
          $<TARGET_FILE:online_c_producer> $<TARGET_FILE:meshtrain>
          ${CMAKE_CURRENT_SOURCE_DIR}/online/online_c.toml ${_online_dir}/producer_gone_round_robin
          ${MESHTRAIN_MPIEXEC} ${MESHTRAIN_MPIEXEC_TEST_FLAGS})
set_tests_properties(online_mpmd_producer_gone_round_robin PROPERTIES PROCESSORS 3)

# A trainer that fails while the producers send (tests/online/trainer_fails.sh), at producers 1
# and 2 x trainer ranks 1 and 2: its loss becomes infinite at its second step ("loss"), or its
# config is refused after the rendezvous ("refused": a checkpoint.init_from that does not exist);
# it tells the producers (a stop), so that their sends keep returning and drop their rows, their
# close() returns and they exit 0 with one warning naming the stream and the trainer's sentence,
# while the trainer exits non-zero with that sentence. Before the stop the producers were never
# told (they give up and exit 1); the timeout ends any hang. "closed": refused so too, but the
# producers close right after connect, before the failing trainer could take their close; each
# still takes the stop, as its close() waits for the trainer's last word (before that handshake
# close() returned at once, the stop was left unreceived and nothing was said).
foreach(_kind loss refused closed)
  foreach(_producers 1 2)
    foreach(_trainers 1 2)
      set(_name online_mpmd_trainer_fails_${_kind}_p${_producers}_t${_trainers})
      meshtrain_add_command_test(NAME ${_name} TIMEOUT 90
        COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/online/trainer_fails.sh ${_kind} ${_producers}
                ${_trainers} $<TARGET_FILE:online_c_producer> $<TARGET_FILE:meshtrain>
                ${CMAKE_CURRENT_SOURCE_DIR}/online/online_c.toml ${_online_dir}/${_name}
                ${MESHTRAIN_MPIEXEC} ${MESHTRAIN_MPIEXEC_TEST_FLAGS})
      math(EXPR _processes "${_producers} + ${_trainers}")
      set_tests_properties(${_name} PROPERTIES PROCESSORS ${_processes})
    endforeach()
  endforeach()
endforeach()

# Kokkos views in the producer's send (tests/online/views_test.cpp), at producers 1 and 2 x
# trainers 1 and 2 (np 2: 1 + 1; np 3: 1 + 2 and 2 + 1; np 4: 2 + 2): rows sent as views of
# every layout, float and double, equal the same rows sent as pointers, bit for bit in the
# trainer's buffer; no view send allocates (heap and Kokkos counted); shapes that disagree
# refused in one sentence. EMULATED: there the views are
# staged through the producer's host buffer as a CUDA view is. The timeout ends any hang.
meshtrain_add_test(NAME online_views_test SOURCES online/views_test.cpp
                   LIBS meshtrain_run meshtrain_test_counting_allocator NP 2 3 4 TIMEOUT 120
                   EMULATED)
# `meshtrain evaluate` and `predict` of an online run's checkpoint (the C producer beside a
# trainer on 1 and 2 ranks, evaluated and predicted on as many): evaluate takes the rows and its
# test_mse equals the MSE of predict's outputs (tests/online/evaluate_checkpoint.sh). The run
# normalizes inputs and targets (statistics frozen from its first rows, stored in the
# checkpoint) and holds a quarter of its rows out, so that evaluate must use the stored
# statistics and score --data, not the checkpoint's held-out window.
foreach(_t 1 2)
  meshtrain_add_command_test(NAME online_evaluate_checkpoint_t${_t} TIMEOUT 60
    COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/online/evaluate_checkpoint.sh
            ${_online_dir}/evaluate_t${_t} $<TARGET_FILE:meshtrain>
            $<TARGET_FILE:evaluate_write_data> ${MESHTRAIN_PYTHON} ${_t}
            ${MESHTRAIN_MPIEXEC} ${MESHTRAIN_MPIEXEC_TEST_FLAGS} --
            ${_online_mpmd} : ${MPIEXEC_NUMPROC_FLAG} ${_t} $<TARGET_FILE:meshtrain> train
            ${CMAKE_CURRENT_SOURCE_DIR}/online/online_c.toml
            --set run.output_dir=${_online_dir}/evaluate_t${_t}
            --set data.normalize_inputs=standard --set data.normalize_targets=standard
            --set stream.test_fraction=0.25
    PASS_REGULAR_EXPRESSION "evaluate_checkpoint: evaluate and predict agree")
  math(EXPR _procs "1 + ${_t}")
  set_tests_properties(online_evaluate_checkpoint_t${_t} PROPERTIES PROCESSORS ${_procs})
endforeach()
