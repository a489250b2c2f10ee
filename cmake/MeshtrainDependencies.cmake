# Finds every dependency of meshtrain and exposes it as a target named meshtrain::<dep>,
# so the rest of the build does not care which layout (Debian or upstream) was found.

# --- Kokkos + KokkosKernels -------------------------------------------------------------
# Upstream installs export Kokkos::kokkos and Kokkos::kokkoskernels. Debian's Trilinos
# packages export trilinos_kokkoskernels (pulling in the Kokkos core libraries) with the
# headers in <prefix>/include/trilinos, and a Kokkos::kokkos whose include dir is wrong.
find_package(KokkosKernels REQUIRED)
add_library(meshtrain_kokkos INTERFACE)
add_library(meshtrain::kokkos ALIAS meshtrain_kokkos)
if(TARGET Kokkos::kokkoskernels)
  message(STATUS "meshtrain: upstream Kokkos/KokkosKernels")
  target_link_libraries(meshtrain_kokkos INTERFACE Kokkos::kokkoskernels)
elseif(TARGET trilinos_kokkoskernels)
  find_path(MESHTRAIN_KOKKOS_INCLUDE_DIR Kokkos_Core.hpp PATH_SUFFIXES trilinos REQUIRED)
  message(STATUS "meshtrain: Debian Trilinos Kokkos/KokkosKernels (${MESHTRAIN_KOKKOS_INCLUDE_DIR})")
  target_include_directories(meshtrain_kokkos SYSTEM INTERFACE ${MESHTRAIN_KOKKOS_INCLUDE_DIR})
  target_link_libraries(meshtrain_kokkos INTERFACE trilinos_kokkoskernels)
else()
  message(FATAL_ERROR "KokkosKernels was found but exports neither Kokkos::kokkoskernels nor trilinos_kokkoskernels")
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
