#pragma once
// A region of the training step captured once and replayed ([runtime] cuda_graphs,
// docs/gpu.md "CUDA graphs"). StepGraph::run(step_fn) runs `step_fn` eagerly for the first
// warm_up calls (buffers made, GEMM primitives and handles cached), then:
//
// - CUDA build (backends/step_graph_cuda.cpp): the next call captures it on device_space()'s
//   stream (cudaStreamBeginCapture, thread-local mode; step_fn; cudaStreamEndCapture;
//   cudaGraphInstantiate) and launches the graph once, for that step's work; every later call
//   launches the graph (cudaGraphLaunch) without calling step_fn. device_space()'s stream is
//   the one Kokkos 4 creates for its default instance (exec_space.cpp): the legacy default
//   stream, which cannot be captured, is refused. Every CUDA error is thrown with
//   cudaGetErrorString's text.
// - Host build (what runs here and in CI; no CUDA): the same protocol with a capture-safety
//   checker. The capturing call and every later one run step_fn with the checker open: it
//   records every fence (meshtrain's fence_* functions and Kokkos' fence callback), deep copy
//   and Kokkos allocation made inside the region, and every host read a caller marks with
//   note_host_read; it checks that the buffers the caller names are at the same addresses as
//   at the capture and that the region launches the same kernels, by label and in the same
//   order, as the captured one. Any of these refuses the region with a sentence naming the
//   first (a runtime Error): on a GPU it would be illegal during capture (fences, host reads,
//   synchronous copies, cudaMalloc) or wrong on replay (moved buffers, other kernels). What it
//   cannot see: a value passed by value into a kernel that changes from step to step (a graph
//   replays the captured value); the region's code must read such values from memory
//   (TrainingRun's graph step does: the optimizer's rate and bias corrections), and a CUDA
//   build is the check of the capture itself.
//
// A region may not throw between steps on a GPU without the graph being dropped: run()
// rethrows step_fn's exception after ending the capture, and the StepGraph then refuses to
// run again (it says so). A caller that can go on without the graph (TrainingRun under
// runtime.cuda_graphs = "auto") catches that error and runs the region eagerly from then on;
// last_call_ran() tells it whether the failed call's work was done (the host checker refuses
// after running step_fn to its end) or must be done again.
//
// Device scratch that grows by free and reallocation (gemm_cublas.cpp's 16-bit staging) would
// leave a captured graph pointing at freed memory: every such growth calls
// note_device_scratch_regrown(), and a replay after one is refused (the capture recorded
// device_scratch_generation()).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace meshtrain {

// A callable by reference, without a copy or an allocation (a std::function of a lambda that
// captures more than two pointers allocates at every step).
class StepRegion {
 public:
  template <class F>
  explicit StepRegion(F& f)
      : object_(const_cast<void*>(static_cast<const void*>(&f))),
        call_([](void* o) { (*static_cast<F*>(o))(); }) {}
  void operator()() const { call_(object_); }

 private:
  void* object_;
  void (*call_)(void*);
};

class StepGraph {
 public:
  // `name`: the region, for messages ("forward and backward"). `warm_up`: eager calls before
  // the capture (>= 1).
  explicit StepGraph(std::string name, int warm_up = 2);
  ~StepGraph();
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;

  // The addresses the region reads and writes (each call's must equal the capture's; the
  // caller fills the vector in place, so that no call allocates). Optional.
  std::vector<const void*>& buffers() { return buffers_; }

  // One call of the region (above). Throws a runtime Error when the region cannot be captured
  // or replayed, naming what happened; after that, run() refuses.
  template <class F>
  void run(F&& step_fn) {
    run_region(StepRegion(step_fn));
  }
  void run_region(const StepRegion& step_fn);
  // step_fn eagerly, not through the graph: a step the captured region cannot stand for (one
  // that must first cast stale 16-bit copies, TrainingRun). Before the capture it counts as a
  // warm-up call.
  template <class F>
  void run_eagerly(F&& step_fn) {
    if (!captured_ && calls_ < warm_up_) ++calls_;
    step_fn();
  }

  // Whether the region has been captured (run() now replays), how many times it was replayed,
  // and whether run() replays a CUDA graph (true) or re-runs step_fn under the checker (false).
  bool captured() const { return captured_; }
  // After run() threw: whether that call's step_fn ran to its end (the host checker's refusal
  // of what it saw, after the fact); false where it did not run, threw, or was only recorded
  // into a CUDA graph (nothing ran), so its work is still to be done.
  bool last_call_ran() const { return last_call_ran_; }
  int64_t replays() const { return replays_; }
  static bool replays_cuda_graphs();
  // The host checker: the Kokkos kernels the captured region launched (0 before the capture
  // and on a CUDA build, where the graph holds them).
  int64_t captured_kernels() const { return kernel_count_; }
  const std::string& name() const { return name_; }

 private:
  struct Backend;
  std::string name_;
  int warm_up_;
  int64_t calls_ = 0;
  bool captured_ = false;
  bool broken_ = false;
  bool last_call_ran_ = false;
  uint64_t captured_generation_ = 0;  // device_scratch_generation() at the capture
  int64_t replays_ = 0;
  std::vector<const void*> buffers_;
  std::vector<const void*> captured_buffers_;
  uint64_t kernel_sequence_ = 0;  // the host checker's hash of the captured region's kernels
  int64_t kernel_count_ = 0;
  std::unique_ptr<Backend> backend_;  // CUDA: the graph and its executable
  void check_buffers() const;
  void checked_call(const StepRegion& step_fn, bool capturing);
};

// How many times device scratch that a captured graph may point at was freed and reallocated
// (a grow: gemm_cublas.cpp's 16-bit staging). Each grow calls note_device_scratch_regrown();
// a StepGraph refuses to replay a graph captured at another generation.
uint64_t device_scratch_generation();
void note_device_scratch_regrown();

// Marks a read of device data on the host (a loss read back, a norm checked): inside a region
// the checker watches, the region is refused with `what` named. Costs one load otherwise.
void note_host_read(const char* what);

// Whether a capture-safety check is open on this process (the host checker's region).
bool step_graph_checking();

// While one lives, the host checker does not count this thread's fences: those that only a
// host GEMM library needs (gemm.cpp: oneDNN and OpenBLAS read what Kokkos kernels wrote, and
// oneDNN's bf16 packing), which a CUDA build's step does not make (cuBLAS runs on the stream).
class HostLibraryFence {
 public:
  HostLibraryFence();
  ~HostLibraryFence();
  HostLibraryFence(const HostLibraryFence&) = delete;
  HostLibraryFence& operator=(const HostLibraryFence&) = delete;
};

}  // namespace meshtrain
