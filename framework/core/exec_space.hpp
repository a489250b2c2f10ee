#pragma once
// The execution space instances that meshtrain's kernels, copies and fences run on, made
// once. With Kokkos 4 a default-constructed instance (Kokkos::Serial(), Kokkos::Cuda(),
// Kokkos::OpenMP()) allocates on the heap (a reference-count block; Cuda() also builds a
// std::string), and every policy made without an instance (RangePolicy<>(0, n),
// MDRangePolicy(...), TeamPolicy<>(league, team), parallel_for(label, n, f)) and every
// two-argument deep_copy makes one. Copying an instance only bumps its reference count.
// Kokkos 4 fences also take `const std::string&`: fence labels go through MESHTRAIN_LABEL
// (kernel_label.hpp), and the unlabelled Kokkos::fence() / instance.fence() build their
// default label at every call. Kokkos 3.4 has no labelled fences; there the label is
// dropped.
//
// The instances are function-local statics made at the first call, which must come after
// Kokkos::initialize: Runtime (and Predictor) call both right after it, so that no step pays
// for them. Their destructors run at exit, after Kokkos::finalize, and only drop a reference
// count (Kokkos 4: the default instance's deleter is empty; Kokkos 3.4: nothing to free).

#include <atomic>
#include <string>
#include <type_traits>

#include <Kokkos_Core.hpp>

#include "framework/core/kernel_label.hpp"

namespace meshtrain {

// Whether the default execution space is the default host execution space (Serial, OpenMP):
// only then may a kernel on the default space's memory run as host loops (host_chunks.hpp; the
// layers' host kernels, layers/inference.hpp). A GPU build's memory is not the host's, or, with
// unified memory, its other kernels would not be waited for.
constexpr bool kDefaultSpaceIsHost =
    std::is_same_v<Kokkos::DefaultExecutionSpace, Kokkos::DefaultHostExecutionSpace>;

// The default (device) execution space instance: every kernel of meshtrain runs on it; cuBLAS
// and NCCL take their stream from it. With CUDA that is the stream Kokkos 4 creates for its
// default instance (cudaStreamCreate at initialize), not the legacy default stream, so a
// CUDA graph can capture it (step_graph.hpp; backends/step_graph_cuda.cpp checks).
const Kokkos::DefaultExecutionSpace& device_space();
// The default host execution space instance (copies between host buffers).
const Kokkos::DefaultHostExecutionSpace& host_space();

namespace exec_space_detail {
// Set while StepGraph's host checker watches a region (framework/core/step_graph.hpp):
// meshtrain's own fences are reported to it (Kokkos 3.4's Serial space reports none to the
// tools). One atomic load otherwise.
extern std::atomic<void (*)(const char*)> fence_observer;
inline void observe_fence(const std::string& label) {
  if (void (*observer)(const char*) = fence_observer.load(std::memory_order_acquire)) {
    observer(label.c_str());
  }
}
}  // namespace exec_space_detail

// Waits for everything queued on every instance of every execution space (Kokkos::fence()).
inline void fence_all(const std::string& label) {
  exec_space_detail::observe_fence(label);
#if KOKKOS_VERSION >= 30500
  Kokkos::fence(label);
#else
  (void)label;
  Kokkos::fence();
#endif
}

// Waits for what is queued on the instance `space` only.
template <class Space>
void fence_space(const Space& space, const std::string& label) {
  exec_space_detail::observe_fence(label);
#if KOKKOS_VERSION >= 30500
  space.fence(label);
#else
  (void)label;
  space.fence();
#endif
}
inline void fence_device(const std::string& label) {
  fence_space(device_space(), label);
}

// The long-lived instance of `Space` (the default or the default host execution space).
template <class Space>
const Space& space_instance() {
  if constexpr (std::is_same_v<Space, Kokkos::DefaultExecutionSpace>) {
    return device_space();
  } else {
    static_assert(std::is_same_v<Space, Kokkos::DefaultHostExecutionSpace>,
                  "space_instance: neither the default nor the default host execution space");
    return host_space();
  }
}

// A range policy on device_space(): [begin, end).
inline Kokkos::RangePolicy<> device_range(int64_t begin, int64_t end) {
  return Kokkos::RangePolicy<>(device_space(), begin, end);
}

// Kokkos::parallel_reduce(label, policy, functor, result) into a View `result` (a scalar
// on the device: no fence, the host reads it through a copy). Kokkos 4's parallel_reduce
// builds the label of a fence (a 66-character std::string: a heap allocation) at every call,
// even for a View result, which it does not fence for; this calls the dispatch that
// parallel_reduce calls (Kokkos::Impl::ParallelReduceAdaptor, unchanged from Kokkos 4.0 to
// 4.6), without that. Kokkos 3 goes through parallel_reduce, which allocates nothing there.
template <class Policy, class Functor, class Result>
void reduce_into(const std::string& label, const Policy& policy, const Functor& functor,
                 const Result& result) {
  static_assert(Kokkos::is_view<Result>::value, "reduce_into: the result must be a View");
#if KOKKOS_VERSION >= 40000
  Result result_copy = result;
  Kokkos::Impl::ParallelReduceAdaptor<Policy, Functor, Result>::execute(label, policy, functor,
                                                                        result_copy);
#else
  Kokkos::parallel_reduce(label, policy, functor, result);
#endif
}

}  // namespace meshtrain
