# HDF5 data sets for bench/data_stream.sh (streamed training data, issue 17): synthetic
# /x float32 [N, F] + /y int32 [N] of any size written in slabs (contiguous, or chunked with
# gzip and the shuffle filter; one file or several shards), or Fashion-MNIST as HDF5:
#   build/bin/write_hdf5_dataset synthetic /tmp/big.h5 --rows 58000000 --features 128
#   build/bin/write_hdf5_dataset fashion-mnist /tmp/fm-train.h5 /tmp/fm-test.h5
add_executable(write_hdf5_dataset ${CMAKE_CURRENT_SOURCE_DIR}/write_hdf5_dataset.cpp)
target_link_libraries(write_hdf5_dataset PRIVATE meshtrain::hdf5 ZLIB::ZLIB CLI11::CLI11)
