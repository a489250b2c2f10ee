# Precompiled headers for a build without a compiler cache (CI's clean clone: 2 cores, no ccache).
# Parsing Kokkos_Core.hpp and gtest/gtest.h costs about 1.5 s of CPU each per translation unit,
# and every library and test source includes one or both: one precompiled header for the
# library's sources (Kokkos, MPI, the standard library) and one for the test programs' (the same
# and GoogleTest), each built once per build directory, cut that to loading the header.
#
# MESHTRAIN_PRECOMPILE_HEADERS: AUTO (default) is ON with GCC when no compiler launcher is set,
# OFF otherwise: ccache does not cache a compilation that uses a precompiled header unless told
# to (sloppiness), so a developer's ccache build is better off without, and nvcc_wrapper (a CUDA
# build) and Clang (which refuses a header built under other macros) are left out. ON and OFF
# force it. The headers are included ahead of every source of the targets that use them; the
# sources still include what they need themselves (a build without them, any ccache build,
# checks that).
set(MESHTRAIN_PRECOMPILE_HEADERS AUTO CACHE STRING
    "Precompiled headers for Kokkos, MPI and GoogleTest: AUTO, ON or OFF")
set_property(CACHE MESHTRAIN_PRECOMPILE_HEADERS PROPERTY STRINGS AUTO ON OFF)
if(MESHTRAIN_PRECOMPILE_HEADERS STREQUAL "AUTO")
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND NOT CMAKE_CXX_COMPILER_LAUNCHER
     AND NOT CMAKE_CXX_COMPILER MATCHES "nvcc_wrapper")
    set(MESHTRAIN_USE_PCH ON)
  else()
    set(MESHTRAIN_USE_PCH OFF)
  endif()
elseif(MESHTRAIN_PRECOMPILE_HEADERS)
  set(MESHTRAIN_USE_PCH ON)
else()
  set(MESHTRAIN_USE_PCH OFF)
endif()
message(STATUS "meshtrain: precompiled headers ${MESHTRAIN_USE_PCH} "
               "(MESHTRAIN_PRECOMPILE_HEADERS=${MESHTRAIN_PRECOMPILE_HEADERS})")

# Third-party and standard headers only: none of them reads a macro of meshtrain's, so one
# header serves every target whose compile flags match (GCC checks that when it loads the
# header, -Winvalid-pch says when it does not, and it then reads the headers as text).
set(_meshtrain_pch_standard <algorithm> <cmath> <cstdint> <cstring> <functional> <map>
    <memory> <optional> <sstream> <string> <utility> <vector>)
set(MESHTRAIN_LIBRARY_PCH_HEADERS <Kokkos_Core.hpp> <mpi.h> ${_meshtrain_pch_standard})
set(MESHTRAIN_TEST_PCH_HEADERS <gtest/gtest.h> <Kokkos_Core.hpp> <mpi.h> ${_meshtrain_pch_standard})

# The library's precompiled header, built with meshtrain_framework's flags, for the library
# targets on top of it (same flags: they link it publicly and add none that a header reads).
function(meshtrain_library_precompiled_headers)
  if(NOT MESHTRAIN_USE_PCH)
    return()
  endif()
  target_precompile_headers(meshtrain_framework PRIVATE ${MESHTRAIN_LIBRARY_PCH_HEADERS})
  foreach(target meshtrain_layers meshtrain_run meshtrain_command)
    target_precompile_headers(${target} REUSE_FROM meshtrain_framework)
  endforeach()
endfunction()

# The test programs' precompiled header: built by an object library of its own whose flags are
# those every test program has (GoogleTest, MPI and Kokkos: meshtrain_test_main's public ones),
# since GCC refuses a header built with a macro on the command line that the user lacks
# (meshtrain_test_main's own MESHTRAIN_TEST_SKIP_CODE, say). meshtrain_add_test has every test
# program reuse it. Call after meshtrain_test_main is defined (tests/CMakeLists.txt).
function(meshtrain_test_precompiled_headers)
  if(NOT MESHTRAIN_USE_PCH)
    return()
  endif()
  set(source ${CMAKE_CURRENT_BINARY_DIR}/meshtrain_test_pch.cpp)
  file(CONFIGURE OUTPUT ${source} CONTENT "// Builds the test programs' precompiled header.\n")
  add_library(meshtrain_test_pch OBJECT ${source})
  target_link_libraries(meshtrain_test_pch PRIVATE GTest::gtest meshtrain::mpi meshtrain::kokkos)
  target_precompile_headers(meshtrain_test_pch PRIVATE ${MESHTRAIN_TEST_PCH_HEADERS})
endfunction()

function(meshtrain_reuse_test_precompiled_headers target)
  if(MESHTRAIN_USE_PCH)
    target_precompile_headers(${target} REUSE_FROM meshtrain_test_pch)
  endif()
endfunction()
