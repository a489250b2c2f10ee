# framework/data: loading (Fashion-MNIST, synthetic, HDF5), schedule and evaluation as
# unit tests; batch slicing over meshes at several world sizes.
meshtrain_add_test(NAME data_test SOURCES data/data_test.cpp LIBS meshtrain_framework TIMEOUT 120
                   EMULATED)
meshtrain_add_test(NAME data_slicing_test SOURCES data/data_slicing_test.cpp
                   LIBS meshtrain_framework NP 1 2 4 8 TIMEOUT 120)
# The training order: IndexShuffle and DataOrder are bijections for many sizes, depend on
# (seed, epoch) alone, differ between epochs; blocks mode keeps a batch inside its window.
meshtrain_add_test(NAME data_order_test SOURCES data/data_order_test.cpp
                   LIBS meshtrain_framework TIMEOUT 60)
# BatchStream: batches in order, after an out-of-order take, padding zeroed, a read error
# thrown by the take of its batch only, read ahead on its own thread, destroyed promptly.
meshtrain_add_test(NAME data_batch_stream_test SOURCES data/batch_stream_test.cpp
                   LIBS meshtrain_framework TIMEOUT 60 EMULATED)
# HDF5 streaming equals the in-memory rows: contiguous (pread) and gzip-chunked files
# (through HDF5), float64 inputs, int32 and int64 labels, regression targets, shards, globs;
# shards unlike the first are bad input and leave nothing open; bad rows and files that
# change size are runtime errors naming the file and row; 8 gzip shards hold the memory of
# one file, and at most open_shards shards are open.
meshtrain_add_test(NAME data_hdf5_source_test SOURCES data/hdf5_source_test.cpp
                   LIBS meshtrain_framework TIMEOUT 60)
# TrainingRun on streamed HDF5 data: bit for bit the run on the same rows in memory (dp,
# fsdp; prefetch 0 and 2; one file and gzip-chunked shards by a glob) and like one rank;
# exact resume mid-epoch and across epochs; the data wait is the slowest rank's on every
# rank; a file that changes size and a read that fails on one rank end the run on every
# rank with the same AgreedError (every mesh, no hang).
meshtrain_add_test(NAME data_streaming_run_test SOURCES data/streaming_run_test.cpp
                   LIBS meshtrain_run NP 1 2 4 TIMEOUT 240 EMULATED)

# --- `meshtrain train` on bad HDF5 data, at NP 2: ONE "meshtrain: error" sentence for the
# whole job (tests/cli/expect_exit.sh --error-line), exit 2 for a set-up error (missing
# shard, a shard of another width or dtype, a glob matching nothing) and 1 for a row that
# fails while streaming (a NaN input); the timeout proves no rank hangs. -------------------
add_executable(data_write_hdf5 data/write_hdf5_tool.cpp)
target_link_libraries(data_write_hdf5 PRIVATE meshtrain::hdf5)

set(_data_runs ${CMAKE_CURRENT_BINARY_DIR}/data_runs)
set(_data_files ${_data_runs}/files)
set(_data_write $<TARGET_FILE:data_write_hdf5>)
meshtrain_add_command_test(NAME data_cli_write_files TIMEOUT 30
  COMMAND sh -c "mkdir -p ${_data_files} && rm -f ${_data_files}/*.h5 \
&& ${_data_write} ${_data_files}/good-0.h5 64 16 10 \
&& ${_data_write} ${_data_files}/good-1.h5 64 16 10 --chunked \
&& ${_data_write} ${_data_files}/wide.h5 64 17 10 \
&& ${_data_write} ${_data_files}/float64.h5 64 16 10 --x-float64 \
&& ${_data_write} ${_data_files}/nan.h5 64 16 10 --nan 37 3")
set_tests_properties(data_cli_write_files PROPERTIES FIXTURES_SETUP data_cli_files)

# NAME STATUS REGEX PATH: `meshtrain train` of a small model on PATH (a TOML value or a
# bare word), 4 steps of 32 rows; a failing run prints one error line (--error-line), a
# good one nothing on stderr.
function(data_cli_error_test name status regex path)
  set(test data_cli_${name}_np2)
  set(lines --error-line)
  if(status EQUAL 0)
    set(lines --stdout "step +4/4 .*data wait [0-9.]+ ms")
  endif()
  add_test(NAME ${test}
    COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/cli/expect_exit.sh ${status} ${regex} ${lines} --
            ${MESHTRAIN_MPIEXEC} ${MPIEXEC_NUMPROC_FLAG} 2 ${MESHTRAIN_MPIEXEC_TEST_FLAGS}
            $<TARGET_FILE:meshtrain> train ${PROJECT_SOURCE_DIR}/configs/fashion_mnist_dp.toml
            --set data.source=hdf5 --set data.path=${path} --set "model.sizes=[16, 32, 10]"
            --set data.batch_size=32 --set train.steps=4 --set train.log_every=2
            --set run.output_dir=${_data_runs}/${name})
  set_tests_properties(${test} PROPERTIES TIMEOUT 60 PROCESSORS 2
                       ENVIRONMENT "${MESHTRAIN_TEST_ENVIRONMENT}"
                       FIXTURES_REQUIRED data_cli_files)
endfunction()

# The good shards train (exit 0), one contiguous and one gzip-chunked, named by a glob.
data_cli_error_test(two_good_shards 0 - "${_data_files}/good-*.h5")
data_cli_error_test(missing_shard 2
  "^meshtrain: error: .*'.*/files/missing\\.h5'.*No such file"
  "[\"${_data_files}/good-0.h5\", \"${_data_files}/missing.h5\"]")
data_cli_error_test(shard_of_another_width 2
  "^meshtrain: error: .*'.*/files/wide\\.h5': has 17 features per row but '.*good-0\\.h5'"
  "[\"${_data_files}/good-0.h5\", \"${_data_files}/wide.h5\"]")
data_cli_error_test(shard_of_another_dtype 2
  "^meshtrain: error: .*'.*/files/float64\\.h5': has 64-bit floats .*dtype of /x"
  "[\"${_data_files}/good-0.h5\", \"${_data_files}/float64.h5\"]")
data_cli_error_test(glob_matches_nothing 2
  "^meshtrain: error: data\\.path entry '.*/files/none-\\*\\.h5' matches no file"
  "${_data_files}/none-*.h5")
data_cli_error_test(nan_input_row 1
  "^meshtrain: error: .*'.*/files/nan\\.h5': /x\\[37, 3\\] is -?nan. inputs must be finite"
  "${_data_files}/nan.h5")
# Sparse features from HDF5 (framework/io/sparse_hdf5.hpp, issue 39): every rank's CSR of each
# batch (shuffled and a range) on dp, fsdp, fsdp x dp and dp x tp equals its slice of a one-rank
# read, and through EmbeddingBag (replicated, row-wise) the one-rank layer's output and gradient;
# bad ids, offsets, a missing table and the capacity: one sentence on every rank.
meshtrain_add_test(NAME data_sparse_hdf5_test SOURCES data/sparse_hdf5_test.cpp
                   LIBS meshtrain_layers meshtrain_test_counting_allocator NP 1 2 4 TIMEOUT 120)
