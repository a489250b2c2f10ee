# framework/data: loading (Fashion-MNIST, synthetic, HDF5), schedule and evaluation as
# unit tests; batch slicing over meshes at several world sizes.
meshtrain_add_test(NAME data_test SOURCES data/data_test.cpp LIBS meshtrain_framework TIMEOUT 120)
meshtrain_add_test(NAME data_slicing_test SOURCES data/data_slicing_test.cpp
                   LIBS meshtrain_framework NP 1 2 4 8 TIMEOUT 120)
# The training order: IndexShuffle and DataOrder are bijections for many sizes, depend on
# (seed, epoch) alone, differ between epochs; blocks mode keeps a batch inside its window.
meshtrain_add_test(NAME data_order_test SOURCES data/data_order_test.cpp
                   LIBS meshtrain_framework TIMEOUT 60)
# BatchStream: batches in order, after an out-of-order take, padding zeroed, a read error
# thrown by the take of its batch only, read ahead on its own thread, destroyed promptly.
meshtrain_add_test(NAME data_batch_stream_test SOURCES data/batch_stream_test.cpp
                   LIBS meshtrain_framework TIMEOUT 60)
# HDF5 streaming equals the in-memory rows: contiguous (pread) and gzip-chunked files
# (through HDF5), float64 inputs, int32 and int64 labels, regression targets, shards, globs;
# shards unlike the first are bad input; bad rows and files that change size are runtime
# errors naming the file and row.
meshtrain_add_test(NAME data_hdf5_source_test SOURCES data/hdf5_source_test.cpp
                   LIBS meshtrain_framework TIMEOUT 60)
# TrainingRun on streamed HDF5 data: bit for bit the run on the same rows in memory (dp,
# fsdp; prefetch 0 and 2; one file and gzip-chunked shards by a glob) and like one rank;
# exact resume mid-epoch and across epochs; a file that changes size and a read that fails
# on one rank end the run on every rank with the same AgreedError (every mesh, no hang).
meshtrain_add_test(NAME data_streaming_run_test SOURCES data/streaming_run_test.cpp
                   LIBS meshtrain_run NP 1 2 4 TIMEOUT 240)
