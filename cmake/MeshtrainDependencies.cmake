# Finds every dependency of meshtrain and exposes it as a target named meshtrain::<dep>,
# so the rest of the build does not care which layout (Debian or upstream) was found.

# --- Kokkos ------------------------------------------------------------------------------
# An upstream install (Kokkos 4.x, e.g. built with CUDA: pass -DKokkos_ROOT=<prefix> and
# its bin/nvcc_wrapper as CMAKE_CXX_COMPILER) exports Kokkos::kokkos. Debian's Trilinos
# packages (Kokkos 3.4, Serial) export trilinos_kokkoscore with the headers in
# <prefix>/include/trilinos, and a Kokkos::kokkos whose include dir is wrong.
find_package(Kokkos REQUIRED)
add_library(meshtrain_kokkos INTERFACE)
add_library(meshtrain::kokkos ALIAS meshtrain_kokkos)
find_path(MESHTRAIN_KOKKOS_TRILINOS_INCLUDE_DIR Kokkos_Core.hpp PATH_SUFFIXES trilinos
          NO_CACHE)
if(TARGET trilinos_kokkoscore AND MESHTRAIN_KOKKOS_TRILINOS_INCLUDE_DIR)
  message(STATUS "meshtrain: Debian Trilinos Kokkos ${Kokkos_VERSION} (${MESHTRAIN_KOKKOS_TRILINOS_INCLUDE_DIR})")
  target_include_directories(meshtrain_kokkos SYSTEM INTERFACE ${MESHTRAIN_KOKKOS_TRILINOS_INCLUDE_DIR})
  target_link_libraries(meshtrain_kokkos INTERFACE trilinos_kokkoscore)
elseif(TARGET Kokkos::kokkos)
  message(STATUS "meshtrain: Kokkos ${Kokkos_VERSION} (devices: ${Kokkos_DEVICES})")
  target_link_libraries(meshtrain_kokkos INTERFACE Kokkos::kokkos)
else()
  message(FATAL_ERROR "Kokkos was found but exports neither Kokkos::kokkos nor trilinos_kokkoscore")
endif()
# Set by upstream Kokkos' package config when it was built with CUDA (never by Debian's).
set(MESHTRAIN_KOKKOS_CUDA OFF)
if(Kokkos_ENABLE_CUDA)
  set(MESHTRAIN_KOKKOS_CUDA ON)
endif()

# --- GEMM: oneDNN or CBLAS (OpenBLAS) on host memory, cuBLAS/cuBLASLt on CUDA memory -------
# MESHTRAIN_CPU_GEMM picks the library of gemm() on host memory (framework/core/gemm.hpp):
#   auto      oneDNN 2.6 or later where found (Debian: libdnnl-dev): its matmul (fused bias and
#             activation post-ops, bf16 kernels on AVX512_BF16 and AMX), OpenBLAS selectable at
#             run time (MESHTRAIN_CPU_GEMM=openblas in the environment); OpenBLAS elsewhere
#   onednn    the same, but configuring fails without oneDNN
#   openblas  cblas_sgemm; oneDNN is not used at all
# OpenBLAS is linked in every build (the benchmarks compare against it; other code calls it).
# A build with a CUDA Kokkos multiplies on the GPU only, so it uses no oneDNN.
set(MESHTRAIN_CPU_GEMM auto CACHE STRING "GEMM library on host memory: auto | onednn | openblas")
set_property(CACHE MESHTRAIN_CPU_GEMM PROPERTY STRINGS auto onednn openblas)
if(NOT MESHTRAIN_CPU_GEMM MATCHES "^(auto|onednn|openblas)$")
  message(FATAL_ERROR "MESHTRAIN_CPU_GEMM is '${MESHTRAIN_CPU_GEMM}'; it must be auto, onednn or openblas")
endif()
set(BLA_VENDOR OpenBLAS)
find_package(BLAS REQUIRED)
find_path(MESHTRAIN_CBLAS_INCLUDE_DIR cblas.h PATH_SUFFIXES openblas REQUIRED)
add_library(meshtrain_blas INTERFACE)
add_library(meshtrain::blas ALIAS meshtrain_blas)
target_include_directories(meshtrain_blas SYSTEM INTERFACE ${MESHTRAIN_CBLAS_INCLUDE_DIR})
target_link_libraries(meshtrain_blas INTERFACE BLAS::BLAS)
set(MESHTRAIN_GEMM_ONEDNN OFF)
if(NOT MESHTRAIN_KOKKOS_CUDA AND NOT MESHTRAIN_CPU_GEMM STREQUAL "openblas")
  # Found by its header and library rather than by its CMake package: Debian's (libdnnl-dev
  # 2.6, `dnnl` / DNNL::dnnl) requires OpenCL's development files (its GPU runtime) before it
  # loads, which a CPU-only user of the library does not need (libdnnl.so links OpenCL itself).
  find_path(MESHTRAIN_ONEDNN_INCLUDE_DIR oneapi/dnnl/dnnl.hpp)
  find_library(MESHTRAIN_ONEDNN_LIBRARY NAMES dnnl)
  if(MESHTRAIN_ONEDNN_INCLUDE_DIR AND MESHTRAIN_ONEDNN_LIBRARY)
    file(STRINGS ${MESHTRAIN_ONEDNN_INCLUDE_DIR}/oneapi/dnnl/dnnl_version.h _dnnl_version_lines
         REGEX "#define DNNL_VERSION_(MAJOR|MINOR|PATCH) ")
    set(MESHTRAIN_ONEDNN_VERSION "")
    foreach(_line IN LISTS _dnnl_version_lines)
      string(REGEX MATCH "[0-9]+" _number "${_line}")
      list(APPEND MESHTRAIN_ONEDNN_VERSION ${_number})
    endforeach()
    list(JOIN MESHTRAIN_ONEDNN_VERSION "." MESHTRAIN_ONEDNN_VERSION)
    if(MESHTRAIN_ONEDNN_VERSION VERSION_LESS 2.6)
      message(STATUS "meshtrain: oneDNN ${MESHTRAIN_ONEDNN_VERSION} is older than 2.6; not used")
    else()
      set(dnnl_FOUND TRUE)
      set(dnnl_VERSION ${MESHTRAIN_ONEDNN_VERSION})
    endif()
  endif()
  if(MESHTRAIN_CPU_GEMM STREQUAL "onednn" AND NOT dnnl_FOUND)
    message(FATAL_ERROR "MESHTRAIN_CPU_GEMM=onednn, but no oneDNN 2.6 or later was found "
                        "(apt-get install libdnnl-dev, or scripts/setup)")
  endif()
  if(dnnl_FOUND)
    set(MESHTRAIN_GEMM_ONEDNN ON)
    target_include_directories(meshtrain_blas SYSTEM INTERFACE ${MESHTRAIN_ONEDNN_INCLUDE_DIR})
    target_link_libraries(meshtrain_blas INTERFACE ${MESHTRAIN_ONEDNN_LIBRARY} ${CMAKE_DL_LIBS})
    # gemm() runs oneDNN by default wherever it is built in (auto and onednn; issue 37).
    target_compile_definitions(meshtrain_blas INTERFACE MESHTRAIN_GEMM_ONEDNN=1)
    message(STATUS "meshtrain: GEMM on host memory through oneDNN ${dnnl_VERSION} "
                   "(${MESHTRAIN_ONEDNN_LIBRARY}, MESHTRAIN_CPU_GEMM=${MESHTRAIN_CPU_GEMM}; "
                   "its ISA is chosen at run time; =openblas for OpenBLAS)")
  else()
    message(STATUS "meshtrain: GEMM on host memory through OpenBLAS (oneDNN not found: "
                   "apt-get install libdnnl-dev, or scripts/setup)")
  endif()
elseif(NOT MESHTRAIN_KOKKOS_CUDA)
  message(STATUS "meshtrain: GEMM on host memory through OpenBLAS (MESHTRAIN_CPU_GEMM=openblas)")
endif()
if(MESHTRAIN_KOKKOS_CUDA)
  if(NOT CUDAToolkit_ROOT AND EXISTS /usr/local/cuda)
    set(CUDAToolkit_ROOT /usr/local/cuda)
  endif()
  find_package(CUDAToolkit REQUIRED)
  target_link_libraries(meshtrain_blas INTERFACE CUDA::cublasLt CUDA::cublas CUDA::cudart)
  message(STATUS "meshtrain: GEMM through cuBLAS and cuBLASLt ${CUDAToolkit_VERSION} on CUDA memory")
endif()

# --- MPI -----------------------------------------------------------------------------------
find_package(MPI REQUIRED COMPONENTS C)
add_library(meshtrain_mpi INTERFACE)
add_library(meshtrain::mpi ALIAS meshtrain_mpi)
target_link_libraries(meshtrain_mpi INTERFACE MPI::MPI_C)
# The C API only: keep the deprecated C++ bindings out of C++ translation units.
target_compile_definitions(meshtrain_mpi INTERFACE OMPI_SKIP_MPICXX=1 MPICH_SKIP_MPICXX=1)

# --- parallel HDF5 -------------------------------------------------------------------------
set(HDF5_PREFER_PARALLEL TRUE)
find_package(HDF5 REQUIRED COMPONENTS C)
if(NOT HDF5_IS_PARALLEL)
  message(FATAL_ERROR "meshtrain needs a parallel (MPI-IO) HDF5; found a serial one at "
                      "'${HDF5_INCLUDE_DIRS}'. On Debian: apt-get install libhdf5-openmpi-dev")
endif()
add_library(meshtrain_hdf5 INTERFACE)
add_library(meshtrain::hdf5 ALIAS meshtrain_hdf5)
target_include_directories(meshtrain_hdf5 SYSTEM INTERFACE ${HDF5_C_INCLUDE_DIRS} ${HDF5_INCLUDE_DIRS})
target_link_libraries(meshtrain_hdf5 INTERFACE ${HDF5_C_LIBRARIES} MPI::MPI_C)
target_compile_definitions(meshtrain_hdf5 INTERFACE ${HDF5_C_DEFINITIONS} ${HDF5_DEFINITIONS})

# --- small libraries ---------------------------------------------------------------------
find_package(tomlplusplus REQUIRED)
find_package(CLI11 REQUIRED)
find_package(nlohmann_json 3 REQUIRED)
find_package(ZLIB REQUIRED)
if(MESHTRAIN_ENABLE_TESTS)
  find_package(GTest REQUIRED)
endif()
if(MESHTRAIN_ENABLE_BENCHMARKS)
  find_package(benchmark REQUIRED)
endif()

# --- CUDA + NCCL (optional) ----------------------------------------------------------------
include(MeshtrainNCCL)

# --- Host-only translation units in a CUDA build ----------------------------------------
# nvcc's front end cannot parse toml++ 3, so in a build whose compiler is Kokkos'
# nvcc_wrapper the files that use toml++ (and no Kokkos) are compiled by the host compiler
# alone. Call from the CMakeLists.txt that adds the files to a target.
function(meshtrain_compile_on_host_only)
  if(CMAKE_CXX_COMPILER MATCHES "nvcc_wrapper")
    set_source_files_properties(${ARGN} PROPERTIES COMPILE_OPTIONS --host-only)
  endif()
endfunction()

if(MESHTRAIN_KOKKOS_CUDA)
  # --- The CUDA driver, loaded at run time ---------------------------------------------------
  # Kokkos links CUDA::cuda_driver (libcuda.so.1, which only the NVIDIA driver installs) for
  # three calls of its Cuda instance set-up. Linked, it stops the loader on a machine without
  # the driver, where `meshtrain plan` and `inspect` must run. meshtrain_cuda_driver takes
  # its place in Kokkos' link interface (so it follows libkokkoscore on the link line) and
  # resolves those functions from the driver when first called
  # (framework/core/backends/cuda_driver.cpp). cudart, cuBLAS and NCCL dlopen the driver.
  #
  # That works only with a static libkokkoscore.a, whose references the executable resolves.
  # A shared libkokkoscore.so was itself linked against libcuda.so.1 (it is listed as NEEDED
  # in the library, which no link line of ours can remove), so the executables need the
  # driver to start whatever is done here. Checked here rather than found on a login node:
  # a shared Kokkos keeps CUDA::cuda_driver (which also resolves the library's references
  # at link time) and the configure says what is lost and how to get it back.
  # MESHTRAIN_STARTS_WITHOUT_DRIVER records the outcome (scripts/gpu-check checks it).
  get_target_property(_kokkos_core_type Kokkos::kokkoscore TYPE)
  if(_kokkos_core_type STREQUAL "SHARED_LIBRARY")
    set(MESHTRAIN_STARTS_WITHOUT_DRIVER OFF CACHE INTERNAL "")
    message(WARNING "meshtrain: Kokkos' core library is shared (libkokkoscore.so), and it needs "
                    "the NVIDIA driver's libcuda.so.1 to load: the executables of this build will "
                    "not start on a machine without the driver (a login node running `meshtrain "
                    "plan` or `inspect`). To keep them starting there, build Kokkos with "
                    "-DBUILD_SHARED_LIBS=OFF (docs/gpu.md, \"Building for a GPU\").")
  else()
    set(MESHTRAIN_STARTS_WITHOUT_DRIVER ON CACHE INTERNAL "")
    add_library(meshtrain_cuda_driver STATIC
                ${PROJECT_SOURCE_DIR}/framework/core/backends/cuda_driver.cpp)
    target_link_libraries(meshtrain_cuda_driver PRIVATE CUDA::toolkit ${CMAKE_DL_LIBS})
    if(TARGET Kokkos::CUDA)
      get_target_property(_kokkos_cuda_links Kokkos::CUDA INTERFACE_LINK_LIBRARIES)
      if(_kokkos_cuda_links)
        list(TRANSFORM _kokkos_cuda_links REPLACE "^CUDA::cuda_driver$" meshtrain_cuda_driver)
        set_target_properties(Kokkos::CUDA PROPERTIES INTERFACE_LINK_LIBRARIES "${_kokkos_cuda_links}")
      endif()
    endif()
  endif()
endif()
