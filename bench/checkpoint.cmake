# Checkpoint save/load throughput against plain POSIX sequential I/O:
#   mpirun -np 2 build/bin/checkpoint_bench [--dir DIR] [--repeats N]
add_executable(checkpoint_bench ${CMAKE_CURRENT_SOURCE_DIR}/checkpoint_speed.cpp)
target_link_libraries(checkpoint_bench PRIVATE meshtrain_framework nlohmann_json::nlohmann_json)
