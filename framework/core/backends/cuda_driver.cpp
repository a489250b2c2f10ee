// The few CUDA driver API functions a CUDA build calls, resolved from libcuda.so.1 when
// first called, so that the executables do not list libcuda.so.1 as NEEDED. Built only
// when Kokkos has CUDA, as its own library meshtrain_cuda_driver, which takes the place of
// CUDA::cuda_driver in Kokkos' link interface (cmake/MeshtrainDependencies.cmake).
//
// Why: libcuda.so.1 comes with the NVIDIA driver, not with the CUDA toolkit; linking it
// stops the dynamic loader on a machine without the driver (a cluster's login node), where
// `meshtrain plan` and `meshtrain inspect` must run: they need no GPU. cudart, cuBLAS and
// NCCL already load the driver themselves with dlopen; only Kokkos' Cuda instance set-up
// (CudaInternal::initialize: cuStreamGetCtx, cuCtxPushCurrent, cuCtxGetDevice) calls the
// driver API directly. Each function below forwards to the driver's function of the same
// symbol name; it is first called after cudart has initialized (so the driver is loaded),
// and without a driver it returns CUDA_ERROR_NO_DEVICE. A Kokkos that calls another driver
// function fails to link with "undefined reference to cu...": add it here.
#include <cuda.h>
#include <dlfcn.h>

namespace {

#define MESHTRAIN_STRINGIFY_(name) #name
// The symbol's name after cuda.h's renaming macros (cuCtxPushCurrent is cuCtxPushCurrent_v2):
// the name the caller's object references, which the definition below also gets.
#define MESHTRAIN_SYMBOL_NAME(name) MESHTRAIN_STRINGIFY_(name)

void* driver_symbol(const char* name) {
  // The driver cudart has loaded already: this takes one more reference to it.
  static void* const library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  return library ? dlsym(library, name) : nullptr;
}

template <typename Function>
Function* resolve(const char* name) {
  return reinterpret_cast<Function*>(driver_symbol(name));
}

}  // namespace

// Declared extern "C" by cuda.h; these definitions get its (macro-renamed) names. Hidden:
// they resolve Kokkos' references inside the executable and are never exported (not even
// with -rdynamic), so they cannot interpose on the driver's own symbols once it is loaded.
#define MESHTRAIN_HIDDEN __attribute__((visibility("hidden")))
MESHTRAIN_HIDDEN CUresult CUDAAPI cuStreamGetCtx(CUstream stream, CUcontext* context) {
  static auto* const function =
      resolve<decltype(cuStreamGetCtx)>(MESHTRAIN_SYMBOL_NAME(cuStreamGetCtx));
  return function ? function(stream, context) : CUDA_ERROR_NO_DEVICE;
}

MESHTRAIN_HIDDEN CUresult CUDAAPI cuCtxPushCurrent(CUcontext context) {
  static auto* const function =
      resolve<decltype(cuCtxPushCurrent)>(MESHTRAIN_SYMBOL_NAME(cuCtxPushCurrent));
  return function ? function(context) : CUDA_ERROR_NO_DEVICE;
}

MESHTRAIN_HIDDEN CUresult CUDAAPI cuCtxGetDevice(CUdevice* device) {
  static auto* const function =
      resolve<decltype(cuCtxGetDevice)>(MESHTRAIN_SYMBOL_NAME(cuCtxGetDevice));
  return function ? function(device) : CUDA_ERROR_NO_DEVICE;
}
