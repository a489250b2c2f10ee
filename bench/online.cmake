# Online training's ingest and publish delay (issue 38; bench/online_ingest.sh runs it): rows/s a
# trainer receives from 2 producers against the same rows through HDF5 and a plain memcpy, and
# the delay from a publish to the LiveModel's use of it:
#   mpirun -np 4 build/bin/bench_online_ingest ingest 262144 63 4096 /tmp/scratch
#   mpirun -np 4 build/bin/bench_online_ingest publish 20
add_executable(bench_online_ingest ${CMAKE_CURRENT_SOURCE_DIR}/online_ingest.cpp)
target_include_directories(bench_online_ingest PRIVATE ${PROJECT_SOURCE_DIR})
target_link_libraries(bench_online_ingest PRIVATE meshtrain_run meshtrain::hdf5)

# Online training against offline at equal wall clock (issue 38; bench/online_vs_offline.sh runs
# it): examples/online_heat's simulation with finer substeps, streaming its rows beside
# `meshtrain train` or writing them to HDF5, and the held-out rows both models are evaluated on.
add_executable(bench_online_vs_offline ${CMAKE_CURRENT_SOURCE_DIR}/online_vs_offline.cpp)
target_include_directories(bench_online_vs_offline PRIVATE ${PROJECT_SOURCE_DIR})
target_link_libraries(bench_online_vs_offline PRIVATE meshtrain_run meshtrain::hdf5)
