// StepGraph's CUDA backend (step_graph_backend.hpp): the region captured on device_space()'s
// stream (Kokkos 4's default instance's, made by cudaStreamCreate; the legacy default stream
// cannot be captured, and capture() refuses it). Thread-local capture mode: what this thread does
// inside the region must be capturable (kernels, cuBLAS/cuBLASLt on the same stream, NCCL
// collectives on a stream joined to it through events, asynchronous copies between device buffers);
// other threads (a checkpoint writer) may go on with their own CUDA calls. Built with a CUDA Kokkos
// only (framework/CMakeLists.txt). Compiled with nvcc, not yet run on a GPU (docs/gpu.md).

#include <cuda_runtime.h>

#include <exception>
#include <string>

#include "base/error.hpp"
#include "framework/core/backends/step_graph_backend.hpp"
#include "framework/core/exec_space.hpp"

namespace meshtrain::step_graph_backend {
namespace {

void check_cuda(cudaError_t code, const std::string& name, const char* call) {
  if (code != cudaSuccess) {
    MESHTRAIN_FAIL("StepGraph '", name, "': ", call, " failed: ", cudaGetErrorString(code), " (",
                   cudaGetErrorName(code), ")");
  }
}

cudaStream_t stream() {
  return device_space().cuda_stream();
}

}  // namespace

Graph::~Graph() {
  // Not checked: a destructor does not throw, and the context may be gone at exit.
  if (exec != nullptr) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec));
  if (graph != nullptr) cudaGraphDestroy(static_cast<cudaGraph_t>(graph));
}

void capture(Graph& graph, const std::string& name, const StepRegion& step_fn) {
  MESHTRAIN_REQUIRE(graph.exec == nullptr, "StepGraph '", name, "' is captured already");
  cudaStream_t s = stream();
  MESHTRAIN_REQUIRE(s != nullptr && s != cudaStreamLegacy && s != cudaStreamPerThread,
                    "StepGraph '", name,
                    "': device_space() runs on a default stream, which cannot be captured");
  check_cuda(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), name,
             "cudaStreamBeginCapture");
  cudaGraph_t captured = nullptr;
  try {
    step_fn();
  } catch (const std::exception& error) {
    // End the capture so that the stream is usable again; the region's error comes first, and
    // EndCapture's own, where it failed too (often why the region failed), is appended.
    const cudaError_t ended = cudaStreamEndCapture(s, &captured);
    if (captured != nullptr) cudaGraphDestroy(captured);
    if (ended == cudaSuccess) throw;
    const std::string message =
        detail::concat(error.what(), "; ending the capture, cudaStreamEndCapture failed too: ",
                       cudaGetErrorString(ended), " (", cudaGetErrorName(ended), ")");
    if (const auto* e = dynamic_cast<const Error*>(&error)) {
      throw Error(e->kind(), message, e->file(), e->line());
    }
    MESHTRAIN_FAIL(message);
  } catch (...) {
    cudaStreamEndCapture(s, &captured);
    if (captured != nullptr) cudaGraphDestroy(captured);
    throw;
  }
  // A region that did something illegal during capture (a synchronize, a synchronous copy, a
  // cudaMalloc) invalidated it: EndCapture says so (cudaErrorStreamCaptureInvalidated).
  check_cuda(cudaStreamEndCapture(s, &captured), name, "cudaStreamEndCapture");
  graph.graph = captured;
  cudaGraphExec_t exec = nullptr;
  check_cuda(cudaGraphInstantiate(&exec, captured, 0), name, "cudaGraphInstantiate");
  graph.exec = exec;
  // Uploaded now, so that the first launch does not pay for it.
  check_cuda(cudaGraphUpload(exec, s), name, "cudaGraphUpload");
}

void launch(Graph& graph, const std::string& name) {
  MESHTRAIN_REQUIRE(graph.exec != nullptr, "StepGraph '", name, "' launched before its capture");
  check_cuda(cudaGraphLaunch(static_cast<cudaGraphExec_t>(graph.exec), stream()), name,
             "cudaGraphLaunch");
}

}  // namespace meshtrain::step_graph_backend
