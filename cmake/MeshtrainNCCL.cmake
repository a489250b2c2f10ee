# Optional CUDA toolkit + NCCL. MESHTRAIN_ENABLE_NCCL=AUTO turns the backend on when both
# are found; ON makes their absence a configure error. Sets MESHTRAIN_HAVE_NCCL.
set(MESHTRAIN_HAVE_NCCL OFF)
if(NOT MESHTRAIN_ENABLE_NCCL STREQUAL "OFF")
  if(NOT CUDAToolkit_ROOT AND EXISTS /usr/local/cuda)
    set(CUDAToolkit_ROOT /usr/local/cuda)
  endif()
  find_package(CUDAToolkit QUIET)
  find_path(MESHTRAIN_NCCL_INCLUDE_DIR nccl.h
            HINTS ${NCCL_ROOT} $ENV{NCCL_ROOT} ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda
            PATH_SUFFIXES include)
  find_library(MESHTRAIN_NCCL_LIBRARY nccl
               HINTS ${NCCL_ROOT} $ENV{NCCL_ROOT} ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda
               PATH_SUFFIXES lib lib64)
  if(CUDAToolkit_FOUND AND MESHTRAIN_NCCL_INCLUDE_DIR AND MESHTRAIN_NCCL_LIBRARY)
    set(MESHTRAIN_HAVE_NCCL ON)
    add_library(meshtrain_nccl INTERFACE)
    add_library(meshtrain::nccl ALIAS meshtrain_nccl)
    target_include_directories(meshtrain_nccl SYSTEM INTERFACE ${MESHTRAIN_NCCL_INCLUDE_DIR})
    target_link_libraries(meshtrain_nccl INTERFACE ${MESHTRAIN_NCCL_LIBRARY} CUDA::cudart CUDA::cublas)
    message(STATUS "meshtrain: NCCL backend on (${MESHTRAIN_NCCL_LIBRARY}, CUDA ${CUDAToolkit_VERSION})")
  elseif(MESHTRAIN_ENABLE_NCCL STREQUAL "ON")
    message(FATAL_ERROR "MESHTRAIN_ENABLE_NCCL=ON but CUDA (found: ${CUDAToolkit_FOUND}) or NCCL "
                        "(header: ${MESHTRAIN_NCCL_INCLUDE_DIR}, library: ${MESHTRAIN_NCCL_LIBRARY}) is missing")
  else()
    message(STATUS "meshtrain: NCCL backend off (CUDA or NCCL not found)")
  endif()
endif()
