# `meshtrain predict`'s rate against the forward-only rate of the same Predictor on in-memory
# batches of the same size (issue 26: at least 0.9); one JSON line on rank 0:
#   OPENBLAS_NUM_THREADS=1 mpirun -np 2 build/bin/bench_predict CHECKPOINT --input FILE.h5 \
#       --batch 256
add_executable(bench_predict ${CMAKE_CURRENT_SOURCE_DIR}/predict_speed.cpp)
target_link_libraries(bench_predict PRIVATE meshtrain_command CLI11::CLI11
                      nlohmann_json::nlohmann_json)

# Predictor::jacobian against one forward of the same rows, per mode (issue 40); one JSON line
# per mode on rank 0. bench/jacobian_speed.sh runs it beside PyTorch's
# torch.autograd.functional.jacobian (bench/jacobian_speed_torch.py):
#   OPENBLAS_NUM_THREADS=1 build/bin/bench_jacobian CHECKPOINT --rows 10000 --mode all
add_executable(bench_jacobian ${CMAKE_CURRENT_SOURCE_DIR}/jacobian_speed.cpp)
target_link_libraries(bench_jacobian PRIVATE meshtrain_run CLI11::CLI11
                      nlohmann_json::nlohmann_json)

# One Predictor::predict call on a block of rows, timed (issue 37 item 7);
# bench/predictor_vs_onnxruntime.sh runs it beside ONNX Runtime and PyTorch on the same model:
#   OPENBLAS_NUM_THREADS=1 build/bin/bench_predictor_call CHECKPOINT --input ROWS.f32 --rows 1000
add_executable(bench_predictor_call ${CMAKE_CURRENT_SOURCE_DIR}/predictor_call.cpp)
target_link_libraries(bench_predictor_call PRIVATE meshtrain_run CLI11::CLI11
                      nlohmann_json::nlohmann_json)
