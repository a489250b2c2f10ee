# NCCL backend (framework/comm/backends/nccl_communicator.*): every operation on device buffers
# against MPI, the View API, bad input, timeout and abort, the factory on mesh axes.
# Registered only when CUDA and NCCL are found; without a CUDA device at run time the GPU
# tests skip ("no CUDA device: NCCL backend compiled but not run") and only the check of
# the no-device error runs. NP 2 runs on two GPUs, or on one shared by ranks that pose as
# hosts of their own (tests/nccl/share_gpu.sh).
if(MESHTRAIN_HAVE_NCCL)
  meshtrain_add_test(NAME nccl_communicator_test SOURCES nccl/nccl_test.cpp
                     LIBS meshtrain_framework NP 1 2 TIMEOUT 120 BACKENDS nccl)
endif()
