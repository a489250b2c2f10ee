# gemm() GFLOP/s per host library (oneDNN, OpenBLAS), kernel, input dtype, shape and epilogue;
# JSON lines, one process, one thread:
#   source scripts/env.sh; build/bin/bench_gemm_rates --shapes 256x4096x4096 --rounds 7
add_executable(bench_gemm_rates ${CMAKE_CURRENT_SOURCE_DIR}/gemm_rates.cpp)
target_link_libraries(bench_gemm_rates PRIVATE meshtrain_framework CLI11::CLI11
                      nlohmann_json::nlohmann_json)
