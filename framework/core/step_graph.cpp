#include "framework/core/step_graph.hpp"

#include <Kokkos_Core.hpp>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <thread>

#include "base/error.hpp"
#include "framework/core/backends/step_graph_backend.hpp"
#include "framework/core/exec_space.hpp"

namespace meshtrain {
namespace {

// The host checker's state: one region at a time, per process. The callbacks record only
// what the checked thread does (a checkpoint writer's or data reader's copies on their own
// threads are not the region's: a thread-local capture allows them too).
using BeginFn = Kokkos_Profiling_beginFunction;
using BeginCopyFn = Kokkos_Profiling_beginDeepCopyFunction;
using BeginFenceFn = Kokkos_Profiling_beginFenceFunction;
using AllocateFn = Kokkos_Profiling_allocateDataFunction;

struct Checker {
  std::atomic<bool> open{false};
  std::thread::id thread;
  int64_t problems = 0;
  char first[320] = {};
  uint64_t hash = 1469598103934665603ull;  // FNV-1a over the kernels' labels, in order
  int64_t kernels = 0;
  BeginFn next_for = nullptr, next_reduce = nullptr, next_scan = nullptr;
  BeginCopyFn next_copy = nullptr;
  BeginFenceFn next_fence = nullptr;
  AllocateFn next_allocate = nullptr;
};

Checker g_checker;

std::atomic<uint64_t> g_scratch_generation{0};

thread_local int t_host_library_fences = 0;  // HostLibraryFence's depth on this thread

bool watching() {
  return g_checker.open.load(std::memory_order_acquire) &&
         std::this_thread::get_id() == g_checker.thread;
}

// Counts one problem; the first one's sentence is kept (the caller fills `first` through
// snprintf, into static storage: no allocation).
bool first_problem() {
  return g_checker.problems++ == 0;
}

const char* text(const char* s) {
  return s != nullptr ? s : "";
}

void hash_kernel(const char* label) {
  uint64_t h = g_checker.hash;
  for (const char* c = label != nullptr ? label : ""; *c != '\0'; ++c) {
    h = (h ^ static_cast<unsigned char>(*c)) * 1099511628211ull;
  }
  g_checker.hash = (h ^ 0xffu) * 1099511628211ull;  // a separator between labels
  ++g_checker.kernels;
}

void on_kernel(const char* label, uint32_t device, uint64_t* id, BeginFn next) {
  if (watching()) hash_kernel(label);
  if (next != nullptr) {
    next(label, device, id);
  } else if (id != nullptr) {
    *id = 0;
  }
}
void on_for(const char* label, const uint32_t device, uint64_t* id) {
  on_kernel(label, device, id, g_checker.next_for);
}
void on_reduce(const char* label, const uint32_t device, uint64_t* id) {
  on_kernel(label, device, id, g_checker.next_reduce);
}
void on_scan(const char* label, const uint32_t device, uint64_t* id) {
  on_kernel(label, device, id, g_checker.next_scan);
}

void on_copy(Kokkos_Profiling_SpaceHandle dst_space, const char* dst_label, const void* dst,
             Kokkos_Profiling_SpaceHandle src_space, const char* src_label, const void* src,
             uint64_t size) {
  if (watching() && first_problem()) {
    std::snprintf(g_checker.first, sizeof g_checker.first,
                  "a deep copy '%s <- %s' (%llu bytes; a copy to the host waits for the device)",
                  text(dst_label), text(src_label), static_cast<unsigned long long>(size));
  }
  if (BeginCopyFn next = g_checker.next_copy) {
    next(dst_space, dst_label, dst, src_space, src_label, src, size);
  }
}

void on_fence(const char* label, const uint32_t device, uint64_t* id) {
  if (watching() && t_host_library_fences == 0 && first_problem()) {
    std::snprintf(g_checker.first, sizeof g_checker.first, "a fence '%s'", text(label));
  }
  if (BeginFenceFn next = g_checker.next_fence) {
    next(label, device, id);
  } else if (id != nullptr) {
    *id = 0;
  }
}

void on_allocate(Kokkos_Profiling_SpaceHandle space, const char* label, const void* ptr,
                 uint64_t size) {
  if (watching() && first_problem()) {
    std::snprintf(g_checker.first, sizeof g_checker.first, "an allocation '%s' in %s (%llu bytes)",
                  text(label), space.name, static_cast<unsigned long long>(size));
  }
  if (AllocateFn next = g_checker.next_allocate) next(space, label, ptr, size);
}

void on_meshtrain_fence(const char* label) {
  if (watching() && t_host_library_fences == 0 && first_problem()) {
    std::snprintf(g_checker.first, sizeof g_checker.first, "a fence '%s'", text(label));
  }
}

// Opens the checker on this thread: installs the callbacks (chaining those set before:
// the pass counter's, the memory tracker's, a test's counting allocator) and the observer
// of meshtrain's own fences.
void open_checker() {
  namespace tools = Kokkos::Tools::Experimental;
  MESHTRAIN_REQUIRE(!g_checker.open.load(), "StepGraph: a region is already being checked");
  const tools::EventSet events = tools::get_callbacks();
  Checker& c = g_checker;
  c.next_for = events.begin_parallel_for;
  c.next_reduce = events.begin_parallel_reduce;
  c.next_scan = events.begin_parallel_scan;
  c.next_copy = events.begin_deep_copy;
  c.next_fence = events.begin_fence;
  c.next_allocate = events.allocate_data;
  c.thread = std::this_thread::get_id();
  c.problems = 0;
  c.first[0] = '\0';
  c.hash = 1469598103934665603ull;
  c.kernels = 0;
  tools::set_begin_parallel_for_callback(&on_for);
  tools::set_begin_parallel_reduce_callback(&on_reduce);
  tools::set_begin_parallel_scan_callback(&on_scan);
  tools::set_begin_deep_copy_callback(&on_copy);
  tools::set_begin_fence_callback(&on_fence);
  tools::set_allocate_data_callback(&on_allocate);
  exec_space_detail::fence_observer.store(&on_meshtrain_fence, std::memory_order_release);
  c.open.store(true, std::memory_order_release);
}

void close_checker() {
  namespace tools = Kokkos::Tools::Experimental;
  Checker& c = g_checker;
  c.open.store(false, std::memory_order_release);
  exec_space_detail::fence_observer.store(nullptr, std::memory_order_release);
  const tools::EventSet events = tools::get_callbacks();
  if (events.begin_parallel_for == &on_for) tools::set_begin_parallel_for_callback(c.next_for);
  if (events.begin_parallel_reduce == &on_reduce) {
    tools::set_begin_parallel_reduce_callback(c.next_reduce);
  }
  if (events.begin_parallel_scan == &on_scan) tools::set_begin_parallel_scan_callback(c.next_scan);
  if (events.begin_deep_copy == &on_copy) tools::set_begin_deep_copy_callback(c.next_copy);
  if (events.begin_fence == &on_fence) tools::set_begin_fence_callback(c.next_fence);
  if (events.allocate_data == &on_allocate) tools::set_allocate_data_callback(c.next_allocate);
}

}  // namespace

void note_host_read(const char* what) {
  if (watching() && first_problem()) {
    std::snprintf(g_checker.first, sizeof g_checker.first, "a host read of %s", text(what));
  }
}

HostLibraryFence::HostLibraryFence() {
  ++t_host_library_fences;
}
HostLibraryFence::~HostLibraryFence() {
  --t_host_library_fences;
}

uint64_t device_scratch_generation() {
  return g_scratch_generation.load(std::memory_order_acquire);
}

void note_device_scratch_regrown() {
  g_scratch_generation.fetch_add(1, std::memory_order_acq_rel);
}

bool step_graph_checking() {
  return g_checker.open.load(std::memory_order_acquire);
}

struct StepGraph::Backend {
  step_graph_backend::Graph graph;
};

StepGraph::StepGraph(std::string name, int warm_up)
    : name_(std::move(name)), warm_up_(warm_up), backend_(std::make_unique<Backend>()) {
  MESHTRAIN_REQUIRE(warm_up_ >= 1, "StepGraph '", name_, "': warm_up must be at least 1, not ",
                    warm_up_);
}

StepGraph::~StepGraph() = default;

bool StepGraph::replays_cuda_graphs() {
  return step_graph_backend::available();
}

void StepGraph::check_buffers() const {
  if (device_scratch_generation() != captured_generation_) {
    MESHTRAIN_FAIL("StepGraph '", name_, "': device scratch was freed and reallocated ",
                   device_scratch_generation() - captured_generation_,
                   " time(s) since the capture (a larger GEMM grew its staging buffers); a "
                   "replay would read and write freed memory");
  }
  if (buffers_.size() != captured_buffers_.size()) {
    MESHTRAIN_FAIL("StepGraph '", name_, "': the region names ", buffers_.size(),
                   " buffers, the captured one ", captured_buffers_.size(),
                   "; a replay would read and write the captured ones");
  }
  for (size_t i = 0; i < buffers_.size(); ++i) {
    if (buffers_[i] != captured_buffers_[i]) {
      MESHTRAIN_FAIL("StepGraph '", name_, "': buffer ", i, " moved since the capture (",
                     captured_buffers_[i], " then, ", buffers_[i],
                     " now); a replay would read and write the old one");
    }
  }
}

// step_fn under the host checker: the capture (capturing) records the kernels' sequence, a
// replay compares with it.
void StepGraph::checked_call(const StepRegion& step_fn, bool capturing) {
  open_checker();
  try {
    step_fn();
  } catch (...) {
    close_checker();
    throw;
  }
  close_checker();
  last_call_ran_ = true;  // a refusal below comes after the work was done
  const Checker& c = g_checker;
  if (c.problems > 0) {
    MESHTRAIN_FAIL("StepGraph '", name_, "' cannot be captured as a CUDA graph: ", c.problems,
                   " operation", c.problems == 1 ? "" : "s",
                   " inside the region would wait for the device or allocate during capture, "
                   "the first ",
                   c.first);
  }
  if (capturing) {
    kernel_sequence_ = c.hash;
    kernel_count_ = c.kernels;
  } else if (c.hash != kernel_sequence_ || c.kernels != kernel_count_) {
    MESHTRAIN_FAIL("StepGraph '", name_, "': this step launched ", c.kernels,
                   " kernels, not the captured step's ", kernel_count_,
                   " in the same order; a replay would run the captured ones");
  }
}

void StepGraph::run_region(const StepRegion& step_fn) {
  MESHTRAIN_REQUIRE(!broken_, "StepGraph '", name_,
                    "' failed to capture or replay at an earlier step and does not run again");
  ++calls_;
  last_call_ran_ = false;
  if (calls_ <= warm_up_) {
    step_fn();
    return;
  }
  try {
    if (!captured_) {
      captured_buffers_ = buffers_;  // once, outside the steady state
      captured_generation_ = device_scratch_generation();
      if (step_graph_backend::available()) {
        step_graph_backend::capture(backend_->graph, name_, step_fn);
        step_graph_backend::launch(backend_->graph, name_);
      } else {
        checked_call(step_fn, /*capturing=*/true);
      }
      captured_ = true;
      return;
    }
    check_buffers();
    if (step_graph_backend::available()) {
      step_graph_backend::launch(backend_->graph, name_);
    } else {
      checked_call(step_fn, /*capturing=*/false);
    }
    ++replays_;
  } catch (...) {
    broken_ = true;
    throw;
  }
}

}  // namespace meshtrain
