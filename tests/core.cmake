# framework/core/ pieces with no communication: the bf16 and fp16 conversions of
# precision.hpp against a reference in double (exhaustive over the 16-bit patterns, ties,
# subnormals, overflow, NaN, random floats) and the kernels built on them.
meshtrain_add_test(NAME core_precision_test SOURCES core/precision_test.cpp
                   LIBS meshtrain_framework TIMEOUT 60)
# gemm() against a float64 reference: transposes, row-strided views, beta, every epilogue
# (bias, activations, their derivatives, the bias gradient) and input dtype, on each host
# library of the build; oneDNN against OpenBLAS in fp32; no Kokkos allocation when repeated.
meshtrain_add_test(NAME core_gemm_test SOURCES core/gemm_test.cpp
                   LIBS meshtrain_framework meshtrain_test_counting_allocator TIMEOUT 300)
# The same on a CPU without AVX-512 as oneDNN sees it (ONEDNN_MAX_CPU_ISA caps the kernels it
# picks): its AVX2 kernels, and no bf16 matmul (bf16 inputs take the fp32 kernel).
if(MESHTRAIN_GEMM_ONEDNN)
  meshtrain_add_test_variant(NAME core_gemm_test VARIANT avx2 ENVIRONMENT ONEDNN_MAX_CPU_ISA=AVX2)
endif()
# Device memory emulated on a CPU, a run-time switch (base/device_memory_emulation.hpp): run
# with and without MESHTRAIN_EMULATE_DEVICE_MEMORY=1 (EMULATED), host mirrors, MPI and
# checkpoint staging and device spans follow it; a bad value is refused.
meshtrain_add_test(NAME core_device_memory_emulation_test
                   SOURCES core/device_memory_emulation_test.cpp
                   LIBS meshtrain_framework NP 1 2 TIMEOUT 60 EMULATED)
# No FMA in the per-ISA clones compiled without contraction (MESHTRAIN_HOST_CLONES_EXACT,
# framework/core/host_clones.hpp): the built libraries' x86-64-v3/v4 clones of the optimizer,
# precision, the MPI ring's sums, the activations' training kernels (their 16-bit passes too),
# the Linear's bias gradient and 16-bit bias add and the SwiGLU's 16-bit passes, disassembled by
# objdump
# (tests/core/host_clones_fma.py; about 1 s). Skipped (77) without objdump or where the build
# has no clones (clang, nvcc, GCC before 12, not x86-64). Where host_clones.hpp's #if makes
# clones (GCC >= 12, not clang, x86-64, no Kokkos CUDA so no nvcc), --expect-clones makes a
# build without them fail instead of skip. An object given MESHTRAIN_HOST_CLONES_EXACT functions
# is added to the list below (only objects whose clones are all EXACT: host_clones.hpp).
set(_host_clones_flags)
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_GREATER_EQUAL 12
   AND CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64)$" AND NOT MESHTRAIN_KOKKOS_CUDA)
  set(_host_clones_flags --expect-clones)
endif()
meshtrain_add_command_test(NAME core_host_clones_fma_selftest TIMEOUT 30
  COMMAND ${MESHTRAIN_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/core/host_clones_fma.py --self-test)
meshtrain_add_command_test(NAME core_host_clones_fma TIMEOUT 60
  COMMAND ${MESHTRAIN_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/core/host_clones_fma.py
          ${_host_clones_flags} "--objdump=${CMAKE_OBJDUMP}" "--ar=${CMAKE_AR}"
          $<TARGET_FILE:meshtrain_framework> optimizer.cpp.o precision.cpp.o mpi_ring.cpp.o --
          $<TARGET_FILE:meshtrain_layers> activation.cpp.o linear.cpp.o swiglu.cpp.o)
set_tests_properties(core_host_clones_fma PROPERTIES SKIP_RETURN_CODE ${MESHTRAIN_TEST_SKIP_CODE})
# Philox-4x32-10 (framework/core/philox.hpp) against Random123's known-answer vectors.
meshtrain_add_test(NAME core_philox_test SOURCES core/philox_test.cpp
                   LIBS meshtrain_framework TIMEOUT 60)
# A source check, not a program: no Kokkos device lambda directly in a GoogleTest body, inside a
# generic lambda or inside a private or protected member function, and no `if constexpr` inside
# one, which nvcc rejects and a host compiler accepts (tests/source/device_lambdas.py says why).
find_package(Python3 COMPONENTS Interpreter)
if(Python3_Interpreter_FOUND)
  meshtrain_add_command_test(NAME source_device_lambdas_selftest TIMEOUT 30
    COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/source/device_lambdas.py --self-test)
  meshtrain_add_command_test(NAME source_device_lambdas TIMEOUT 30
    COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/source/device_lambdas.py
            ${PROJECT_SOURCE_DIR}/base ${PROJECT_SOURCE_DIR}/partition
            ${PROJECT_SOURCE_DIR}/framework ${PROJECT_SOURCE_DIR}/layers ${PROJECT_SOURCE_DIR}/run
            ${PROJECT_SOURCE_DIR}/apps ${PROJECT_SOURCE_DIR}/tests ${PROJECT_SOURCE_DIR}/bench
            ${PROJECT_SOURCE_DIR}/examples)
  # The rooms of the source tree: no include runs back up (apps -> run -> layers -> framework
  # -> partition -> base, and inside framework/), and docs/layout.md's picture is the includes'.
  meshtrain_add_command_test(NAME source_dependencies_selftest TIMEOUT 30
    COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/source/dependencies.py --self-test)
  meshtrain_add_command_test(NAME source_dependencies TIMEOUT 30
    COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/source/dependencies.py
            ${PROJECT_SOURCE_DIR})
endif()
