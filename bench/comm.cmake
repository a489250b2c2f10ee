# Collective matmul benchmark (JSON lines on rank 0); run with mpirun -np N.
add_executable(bench_collective_matmul ${CMAKE_CURRENT_SOURCE_DIR}/collective_matmul_speed.cpp)
target_link_libraries(bench_collective_matmul PRIVATE meshtrain_framework CLI11::CLI11
                      nlohmann_json::nlohmann_json)
# Reduce-scatter and all-reduce, the MPI library against meshtrain's ring (JSON lines on
# rank 0); bench/reductions.sh runs it with calibrate's memory bandwidth and the training
# steps beside it.
add_executable(bench_reductions ${CMAKE_CURRENT_SOURCE_DIR}/reductions.cpp)
target_link_libraries(bench_reductions PRIVATE meshtrain_framework CLI11::CLI11
                      nlohmann_json::nlohmann_json)
# The flight recorder's cost per collective, off and on (JSON lines); run on one rank.
add_executable(bench_flight_record ${CMAKE_CURRENT_SOURCE_DIR}/flight_record.cpp)
target_link_libraries(bench_flight_record PRIVATE meshtrain_framework)
