#pragma once
// StepGraph's CUDA backend (framework/core/step_graph.hpp): capture of a region on
// device_space()'s stream into a CUDA graph, and its launch. Built with a CUDA Kokkos
// (step_graph_cuda.cpp); elsewhere available() is false and StepGraph checks the region on
// the host instead.

#include <string>

#include <Kokkos_Core.hpp>

#include "framework/core/step_graph.hpp"

namespace meshtrain::step_graph_backend {

#if defined(KOKKOS_ENABLE_CUDA)
// The captured graph and its executable (null until captured); destroyed with the StepGraph.
struct Graph {
  void* graph = nullptr;  // cudaGraph_t
  void* exec = nullptr;   // cudaGraphExec_t
  Graph() = default;
  ~Graph();
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
};
inline bool available() {
  return true;
}
// Captures step_fn's work on device_space()'s stream and instantiates it (nothing runs).
void capture(Graph& graph, const std::string& name, const StepRegion& step_fn);
// Launches the instantiated graph on device_space()'s stream (asynchronous).
void launch(Graph& graph, const std::string& name);
#else
struct Graph {};
inline bool available() {
  return false;
}
inline void capture(Graph&, const std::string&, const StepRegion&) {}
inline void launch(Graph&, const std::string&) {}
#endif

}  // namespace meshtrain::step_graph_backend
