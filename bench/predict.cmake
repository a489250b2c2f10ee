# `meshtrain predict`'s rate against the forward-only rate of the same Predictor on in-memory
# batches of the same size (issue 26: at least 0.9); one JSON line on rank 0:
#   OPENBLAS_NUM_THREADS=1 mpirun -np 2 build/bin/bench_predict CHECKPOINT --input FILE.h5 \
#       --batch 256
add_executable(bench_predict ${CMAKE_CURRENT_SOURCE_DIR}/predict_speed.cpp)
target_link_libraries(bench_predict PRIVATE meshtrain_command CLI11::CLI11
                      nlohmann_json::nlohmann_json)
