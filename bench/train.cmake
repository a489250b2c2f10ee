# Timed training steps of a TrainingRun (forward, loss, backward, AdamW) against a single-thread
# sgemm roofline; one JSON line on rank 0:
#   OPENBLAS_NUM_THREADS=1 mpirun -np 2 build/bin/bench_train_step --sizes 784,4096,4096,10 \
#       --batch 256 --mode fsdp --steps 10 --warmup 2
add_executable(bench_train_step ${CMAKE_CURRENT_SOURCE_DIR}/train_step.cpp)
target_link_libraries(bench_train_step PRIVATE meshtrain_run CLI11::CLI11
                      nlohmann_json::nlohmann_json)
# Exported symbols, so --trace-allocations prints function names.
target_link_options(bench_train_step PRIVATE -rdynamic)

# A training step with a physics loss (the forward Laplacian) against a plain step of the same
# model and batch (issue 40 item 2b); bench/laplacian_speed.sh runs it beside PyTorch's double
# backward (bench/laplacian_speed_torch.py):
#   OPENBLAS_NUM_THREADS=1 build/bin/bench_laplacian --rows 4096 --width 64 --depth 3
add_executable(bench_laplacian ${CMAKE_CURRENT_SOURCE_DIR}/laplacian_speed.cpp)
target_link_libraries(bench_laplacian PRIVATE meshtrain_run CLI11::CLI11
                      nlohmann_json::nlohmann_json)

# The memory tracker's bytes by plan item against the plan's, after a run of a config (issue 37;
# bench/bf16_memory.sh):
#   mpirun -np 2 build/bin/bench_memory_items CONFIG [--set section.key=value ...]
add_executable(bench_memory_items ${CMAKE_CURRENT_SOURCE_DIR}/memory_items.cpp)
target_link_libraries(bench_memory_items PRIVATE meshtrain_run CLI11::CLI11
                      nlohmann_json::nlohmann_json)
