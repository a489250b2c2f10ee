# `cmake --install` puts the `meshtrain` command (bin/), the libraries, the headers
# (include/meshtrain/, umbrella meshtrain.hpp) and a package config in the prefix, so that
# `PREFIX/bin/meshtrain train CONFIG` runs and another project does
#   find_package(meshtrain REQUIRED)
#   target_link_libraries(app PRIVATE meshtrain::meshtrain)
# The config finds Kokkos, the BLAS (OpenBLAS; cuBLAS with a CUDA Kokkos), MPI, parallel
# HDF5, toml++, nlohmann_json and zlib for it (examples/train_mlp is such a project).
include(CMakePackageConfigHelpers)

# The one target users link: the training run and everything under it.
add_library(meshtrain_library INTERFACE)
add_library(meshtrain::meshtrain ALIAS meshtrain_library)
target_link_libraries(meshtrain_library INTERFACE meshtrain_run)
target_include_directories(meshtrain_library INTERFACE
                           $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)

set(_meshtrain_exported
    meshtrain_library:meshtrain meshtrain_run:run meshtrain_layers:layers
    meshtrain_framework:framework meshtrain_partition:partition meshtrain_base:base
    meshtrain_kokkos:kokkos meshtrain_blas:blas meshtrain_mpi:mpi meshtrain_hdf5:hdf5)
if(MESHTRAIN_HAVE_NCCL)
  list(APPEND _meshtrain_exported meshtrain_nccl:nccl)
endif()
set(_meshtrain_targets)
foreach(_entry IN LISTS _meshtrain_exported)
  string(REPLACE ":" ";" _pair ${_entry})
  list(GET _pair 0 _target)
  list(GET _pair 1 _name)
  set_target_properties(${_target} PROPERTIES EXPORT_NAME ${_name})
  list(APPEND _meshtrain_targets ${_target})
endforeach()

install(TARGETS ${_meshtrain_targets} EXPORT meshtrainTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/base ${PROJECT_SOURCE_DIR}/partition ${PROJECT_SOURCE_DIR}/framework
                  ${PROJECT_SOURCE_DIR}/layers ${PROJECT_SOURCE_DIR}/run
        DESTINATION ${MESHTRAIN_INSTALL_INCLUDEDIR}
        FILES_MATCHING PATTERN "*.hpp"
        # Test-only: the checkpoint fault hook is not in the installed library.
        PATTERN "checkpoint_testing.hpp" EXCLUDE
        # Internal to the config's TOML files (and the only header that includes toml++).
        PATTERN "config_schema.hpp" EXCLUDE)
install(FILES ${PROJECT_SOURCE_DIR}/meshtrain.hpp ${PROJECT_SOURCE_DIR}/stream.hpp
              ${PROJECT_SOURCE_DIR}/stream.h DESTINATION ${MESHTRAIN_INSTALL_INCLUDEDIR})
# The command itself (apps/): it links meshtrain's libraries statically and the rest from the
# system, so it runs from the prefix as it does from build/bin/.
install(TARGETS meshtrain RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})

set(_meshtrain_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/meshtrain)
install(EXPORT meshtrainTargets NAMESPACE meshtrain:: DESTINATION ${_meshtrain_cmake_dir})
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/meshtrainConfig.cmake.in
                              ${CMAKE_CURRENT_BINARY_DIR}/meshtrainConfig.cmake
                              INSTALL_DESTINATION ${_meshtrain_cmake_dir})
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/meshtrainConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/meshtrainConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/meshtrainConfigVersion.cmake
        DESTINATION ${_meshtrain_cmake_dir})
