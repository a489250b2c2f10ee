# `meshtrain sweep` (issue 40 item 5, docs/sweeps.md): a grid's runs on groups of ranks of one
# MPI job. tests/sweep/sweep_check.py runs the sweep and, in the same test, each grid point
# alone with `meshtrain train --set ...` on as many ranks as a group has: every logged loss and
# every evaluation equal bit for bit, and the table (sweep.jsonl) equal to each run's
# metrics.jsonl. A run that diverges fails alone: the sweep reports it, its group goes on to
# its next run, and the sweep exits 1. Bad --grid text, an unknown key, a value the schema
# refuses and --ranks-per-run not dividing the job: one sentence, exit 2, before any run.
set(_sweep ${CMAKE_CURRENT_SOURCE_DIR}/sweep)
set(_sweep_runs ${CMAKE_CURRENT_BINARY_DIR}/sweep_runs)
set(_sweep_config ${_sweep}/small.toml)
set(_sweep_mpiexec ${MESHTRAIN_MPIEXEC} ${MESHTRAIN_MPIEXEC_TEST_FLAGS})

function(_sweep_slots test np)
  set(slots ${np})
  if(slots GREATER 2)
    set(slots 2)
  endif()
  set_tests_properties(${test} PROPERTIES PROCESSORS ${slots})
endfunction()

# (np, ranks per run): side by side on 1-rank groups, on 2-rank groups, and one group of the
# whole job (the runs one after another).
foreach(mode match failure)
  foreach(case "1;1" "2;1" "4;2" "4;1")
    list(GET case 0 np)
    list(GET case 1 per_run)
    set(test sweep_${mode}_np${np}_r${per_run})
    meshtrain_add_command_test(NAME ${test} TIMEOUT 240
      COMMAND ${MESHTRAIN_PYTHON} ${_sweep}/sweep_check.py ${mode} ${_sweep_runs}/${mode}_np${np}_r${per_run}
              ${_sweep_config} ${np} ${per_run} -- ${_sweep_mpiexec} $<TARGET_FILE:meshtrain>)
    _sweep_slots(${test} ${np})
  endforeach()
endforeach()

# Refused before any run starts: exactly one "meshtrain: error" line for the job, exit 2.
set(_sweep_expect_exit ${CMAKE_CURRENT_SOURCE_DIR}/cli/expect_exit.sh)
function(sweep_error_test name regex)
  set(test sweep_${name}_np2)
  meshtrain_add_command_test(NAME ${test} TIMEOUT 60
    COMMAND sh ${_sweep_expect_exit} 2 ${regex} --error-line -- ${_sweep_mpiexec}
            ${MPIEXEC_NUMPROC_FLAG} 2 $<TARGET_FILE:meshtrain> sweep ${_sweep_config}
            --set run.output_dir=${_sweep_runs}/${name} ${ARGN})
  _sweep_slots(${test} 2)
endfunction()
sweep_error_test(grid_without_values
  "^meshtrain: error: --grid 'optimizer\\.lr' must look like section\\.key=v1,v2"
  --grid optimizer.lr)
sweep_error_test(grid_unknown_key
  "^meshtrain: error: .*'optimizer\\.lrr=0\\.1,0\\.2' names unknown key 'optimizer\\.lrr'"
  --grid optimizer.lrr=0.1,0.2)
sweep_error_test(grid_empty_value
  "^meshtrain: error: --grid 'optimizer\\.lr=0\\.1,,0\\.2' has an empty value"
  --grid optimizer.lr=0.1,,0.2)
sweep_error_test(grid_value_out_of_range
  "^meshtrain: error: .*optimizer\\.lr=-1.*must be positive, got -1"
  --grid data.batch_size=32,64 --grid optimizer.lr=0.1,-1)
sweep_error_test(grid_value_wrong_type
  "^meshtrain: error: .*optimizer\\.lr=fast.*'fast'"
  --grid optimizer.lr=fast)
sweep_error_test(grid_key_twice
  "^meshtrain: error: --grid names optimizer\\.lr twice"
  --grid optimizer.lr=0.1 --grid optimizer.lr=0.2)
sweep_error_test(grid_output_dir
  "^meshtrain: error: --grid 'run\\.output_dir=a,b': the sweep gives each run its own"
  --grid run.output_dir=a,b)
sweep_error_test(ranks_per_run_not_dividing
  "^meshtrain: error: --ranks-per-run 3 does not divide the job's 2 ranks"
  --grid optimizer.lr=0.1,0.2 --ranks-per-run 3)
# A mesh a group cannot hold (tp = 2 on 1-rank groups): refused for the run it concerns.
sweep_error_test(mesh_larger_than_group
  "^meshtrain: error: run 0 \\(optimizer\\.lr=0\\.1\\) on --ranks-per-run 1 ranks: "
  --grid optimizer.lr=0.1,0.2 --ranks-per-run 1 --set mesh.dp=1 --set mesh.tp=2
  --set partition.preset=tp)

# A value with commas of its own (a TOML array) stays one value: two runs of different models.
meshtrain_add_command_test(NAME sweep_grid_array_values_np1 TIMEOUT 60
  PASS_REGULAR_EXPRESSION "1  +\\[16, 32, 32, 4\\] +ok .*2 of 2 runs ok"
  COMMAND ${_sweep_mpiexec} ${MPIEXEC_NUMPROC_FLAG} 1 $<TARGET_FILE:meshtrain> sweep
          ${_sweep_config} --set run.output_dir=${_sweep_runs}/grid_array_values
          "--grid=model.sizes=[16, 8, 4],[16, 32, 32, 4]")
