# Collective matmul benchmark (JSON lines on rank 0); run with mpirun -np N.
add_executable(bench_collective_matmul ${CMAKE_CURRENT_SOURCE_DIR}/collective_matmul.cpp)
target_link_libraries(bench_collective_matmul PRIVATE meshtrain_framework CLI11::CLI11
                      nlohmann_json::nlohmann_json)
