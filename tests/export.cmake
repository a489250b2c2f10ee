# `meshtrain export --format onnx` end to end (tests/export/export_test.py, one test per case):
# tiny models trained by `meshtrain train` under mpirun (1, 2 and 4 ranks), exported, checked
# with onnx.checker, run in ONNX Runtime (npm onnxruntime-node through tests/export/run_onnx.js)
# and compared with a float64 numpy forward from the checkpoint's datasets and with `meshtrain
# predict` of the same rows; and the command's errors. Python: MESHTRAIN_PYTHON (tests/CMakeLists.txt), the Debian interpreter with python3-numpy, python3-h5py and python3-onnx
# (scripts/setup). ONNX Runtime: scripts/install-onnxruntime (scripts/setup runs it; a test
# installs it when missing). Exit status 77 = skipped, only when ONNX Runtime cannot be
# installed (no network); cli_errors needs no ONNX Runtime.
set(_export_runs ${CMAKE_CURRENT_BINARY_DIR}/export_runs)
foreach(_case classification regression_normalized activation_relu activation_tanh
              activation_gelu activation_none activation_gelu_erf
              activation_silu activation_sigmoid residual_layernorm_silu
              residual_rmsnorm_swiglu residual_classification
              residual_activations residual_moe moe moe_ties meshes cli_errors)
  meshtrain_add_command_test(NAME export_${_case} TIMEOUT 120
    COMMAND ${MESHTRAIN_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/export/export_test.py ${_case}
            --meshtrain $<TARGET_FILE:meshtrain> --source-dir ${PROJECT_SOURCE_DIR}
            --work ${_export_runs}/${_case} --predict
            -- ${MESHTRAIN_MPIEXEC} ${MESHTRAIN_MPIEXEC_TEST_FLAGS})
  set_tests_properties(export_${_case} PROPERTIES PROCESSORS 2 SKIP_RETURN_CODE 77)
endforeach()

# A DLRM checkpoint's ONNX export (tests/export/dlrm_export_test.py): a tiny DLRM trained on 1
# and 2 ranks (two tables row-wise), exported (fp32, fp16, bf16), run in ONNX Runtime through
# tests/export/run_onnx_inputs.js on rows with repeated ids, empty and padded bags, sum and mean
# pooling, dot and cat, and compared with a float64 forward from the checkpoint. 77 = skipped,
# as above, only when ONNX Runtime cannot be installed. export_dlrm_predict: `meshtrain predict`
# of such a checkpoint on 1, 2, 3 (the default batch) and 4 ranks (fsdp 4; fsdp 2 x tp 2 with
# --flight-dir) against the same forward, a checkpoint of bf16 tables (model.table_dtype) on 1
# and 2 ranks against the forward of its widened values, and its refusals (a bad id, --jacobian,
# two inputs, a mesh that does not fit, a --batch-size the shards do not divide).
# export_dlrm_predictor: meshtrain::DlrmPredictor (run/dlrm_predictor.hpp) on one rank through
# tests/predict/dlrm_predictor_tool.cpp, of checkpoints trained on 2 ranks (row-wise), 4
# (row-wise and table-wise) and 2 (column-wise over tp), against the same forward and `meshtrain
# predict`, no allocation in any call, the same values and allocations with device memory
# emulated (MESHTRAIN_EMULATE_DEVICE_MEMORY=1), the same values on each of 2 ranks holding their
# own, and its refusals (a dense checkpoint, a bad id, a wrong feature count, too many ids or
# rows, mesh.* and mixed_precision.* overrides). Only dot and cat may exit 77.
add_executable(dlrm_predictor_tool predict/dlrm_predictor_tool.cpp)
target_link_libraries(dlrm_predictor_tool PRIVATE meshtrain_run meshtrain_test_counting_allocator)
foreach(_case dot cat predict predictor)
  meshtrain_add_command_test(NAME export_dlrm_${_case} TIMEOUT 180
    COMMAND ${MESHTRAIN_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/export/dlrm_export_test.py ${_case}
            --meshtrain $<TARGET_FILE:meshtrain> --source-dir ${PROJECT_SOURCE_DIR}
            --work ${_export_runs}/dlrm_${_case}
            --predictor-tool $<TARGET_FILE:dlrm_predictor_tool>
            -- ${MESHTRAIN_MPIEXEC} ${MESHTRAIN_MPIEXEC_TEST_FLAGS})
  set_tests_properties(export_dlrm_${_case} PROPERTIES PROCESSORS 2)
  if(_case STREQUAL "dot" OR _case STREQUAL "cat")  # the others need no ONNX Runtime: no skip
    set_tests_properties(export_dlrm_${_case} PROPERTIES SKIP_RETURN_CODE 77)
  endif()
endforeach()

# The protobuf encoder against the wire format's own examples (no MPI, no Python).
meshtrain_add_test(NAME export_protobuf_test SOURCES export/protobuf_test.cpp
                   LIBS meshtrain_framework)

# The safetensors writer byte for byte and its refusals; the PyTorch export's tensor names,
# shapes and bytes (transposed weights, across streamed pieces) of a model made in code.
meshtrain_add_test(NAME export_safetensors_test SOURCES export/safetensors_test.cpp
                   LIBS meshtrain_framework)

# The export of a checkpoint saved with its parameters split over 1, 2 and 4 ranks (dp, fsdp,
# tp, fsdp x tp) is byte for byte the graph of the same global values built on one rank.
meshtrain_add_test(NAME export_mesh_test SOURCES export/export_mesh_test.cpp
                   LIBS meshtrain_framework NP 1 2 4 TIMEOUT 60)

# The exported file is the held model's encoding byte for byte, the weights held once at the
# peak (operator new counted), and shared constants named by their value.
meshtrain_add_test(NAME export_stream_test SOURCES export/export_stream_test.cpp
                   LIBS meshtrain_framework NP 1 TIMEOUT 60)

# Export initializes no MPI: launched as several ranks it refuses (each would write the file),
# rank 0 saying so once.
meshtrain_add_command_test(NAME export_under_mpirun_np2 TIMEOUT 30
  COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/cli/expect_exit.sh 2
          "^meshtrain: error: meshtrain export runs as one process, without mpirun \\(it was launched as 2 ranks" --error-line
          -- ${MESHTRAIN_MPIEXEC} ${MPIEXEC_NUMPROC_FLAG} 2 ${MESHTRAIN_MPIEXEC_TEST_FLAGS}
          $<TARGET_FILE:meshtrain> export ${CMAKE_CURRENT_BINARY_DIR}/no_such_checkpoint
          --format onnx --output ${CMAKE_CURRENT_BINARY_DIR}/export_under_mpirun.onnx)
set_tests_properties(export_under_mpirun_np2 PROPERTIES PROCESSORS 2)

# Without ONNX Runtime (an empty package cache and npm offline: it cannot be installed) a case
# still runs what needs none of it, `meshtrain predict` against the float64 forward included,
# then exits 77 (skipped) saying why; it once skipped at the first ONNX Runtime call.
set(_no_ort ${_export_runs}/without_onnxruntime_cache)
meshtrain_add_command_test(NAME export_regression_normalized_without_onnxruntime TIMEOUT 120
  COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/cli/expect_exit.sh 77 - --any-lines
          --stdout "^regression_normalized meshtrain predict vs float64 forward: largest relative error"
          -- env MESHTRAIN_CACHE=${_no_ort} npm_config_cache=${_no_ort}/npm npm_config_offline=true
          ${MESHTRAIN_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/export/export_test.py regression_normalized
          --meshtrain $<TARGET_FILE:meshtrain> --source-dir ${PROJECT_SOURCE_DIR}
          --work ${_export_runs}/regression_normalized_without_onnxruntime --predict
          -- ${MESHTRAIN_MPIEXEC} ${MESHTRAIN_MPIEXEC_TEST_FLAGS})
set_tests_properties(export_regression_normalized_without_onnxruntime PROPERTIES PROCESSORS 2)

# `meshtrain export --format pytorch` end to end (tests/export/pytorch_export_test.py, one test
# per case; export_test.py's models, meshes and float64 forward): model.safetensors read with
# plain Python (the format, every tensor bit for bit), model.py's imports, and with Debian's
# python3-torch `import model; m = model.load()` in a fresh interpreter, m(x) against `meshtrain
# predict` and the float64 forward to 1e-5 relative: mlp (every activation, a classifier, raw
# inputs with normalization), residual_mlp (LayerNorm + SiLU, RMSNorm + SwiGLU, no norm), MoE
# layers and blocks (ties included); dlrm: DLRMs (dot trained on 2 ranks, cat on 4, tables
# row-wise) as nn.EmbeddingBag modules, m(dense, indices, offsets) against `meshtrain predict` and
# dlrm_export_test.py's float64 forward; cli_errors: the output folder's refusals. Exit status
# 77 = skipped, only when python3 cannot import torch, after every other check passed.
foreach(_case mlp_classification mlp_regression_normalized mlp_activations
              residual_layernorm_silu residual_rmsnorm_swiglu moe residual_moe dlrm cli_errors)
  meshtrain_add_command_test(NAME export_pytorch_${_case} TIMEOUT 120
    COMMAND ${MESHTRAIN_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/export/pytorch_export_test.py ${_case}
            --meshtrain $<TARGET_FILE:meshtrain> --source-dir ${PROJECT_SOURCE_DIR}
            --work ${_export_runs}/pytorch_${_case}
            -- ${MESHTRAIN_MPIEXEC} ${MESHTRAIN_MPIEXEC_TEST_FLAGS})
  set_tests_properties(export_pytorch_${_case} PROPERTIES PROCESSORS 2 SKIP_RETURN_CODE 77)
endforeach()

# Without PyTorch (a stand-in `torch` package that fails to import, first on PYTHONPATH) a case
# still checks model.safetensors with plain Python and `meshtrain predict` against the float64
# forward, then exits 77 saying why.
meshtrain_add_command_test(NAME export_pytorch_mlp_regression_normalized_without_torch TIMEOUT 120
  COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/cli/expect_exit.sh 77 - --any-lines
          --stdout "^SKIP: .* cannot import torch: ModuleNotFoundError: No module named 'torch' \\(hidden by tests/export/without_torch\\) \\(the checks that need no PyTorch passed\\)"
          -- env PYTHONPATH=${CMAKE_CURRENT_SOURCE_DIR}/export/without_torch
          ${MESHTRAIN_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/export/pytorch_export_test.py
          mlp_regression_normalized --meshtrain $<TARGET_FILE:meshtrain>
          --source-dir ${PROJECT_SOURCE_DIR}
          --work ${_export_runs}/pytorch_mlp_regression_normalized_without_torch
          -- ${MESHTRAIN_MPIEXEC} ${MESHTRAIN_MPIEXEC_TEST_FLAGS})
set_tests_properties(export_pytorch_mlp_regression_normalized_without_torch PROPERTIES PROCESSORS 2)
