#pragma once
// Counting Kokkos allocations (any memory space: device memory in a CUDA build) through
// Kokkos' allocate-data tool callback, for the tests that a step allocates nothing. Kokkos has
// one such callback: a counter replaces any other while it lives (the memory tracker's too).

#include <Kokkos_Core.hpp>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>

namespace meshtrain::testing {

// Counts from construction to stop() or destruction. One at a time.
class KokkosAllocationCounter {
 public:
  KokkosAllocationCounter() {
    State& s = state();
    s.count = 0;
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      s.described.clear();
    }
    Kokkos::Tools::Experimental::set_allocate_data_callback(on_allocate);
  }
  ~KokkosAllocationCounter() { stop(); }
  KokkosAllocationCounter(const KokkosAllocationCounter&) = delete;
  KokkosAllocationCounter& operator=(const KokkosAllocationCounter&) = delete;

  void stop() { Kokkos::Tools::Experimental::set_allocate_data_callback(nullptr); }
  int64_t count() const { return state().count.load(); }
  // The first kDescribed counted allocations, each as " space 'label' (bytes)", for a failure
  // message.
  std::string described() const {
    std::lock_guard<std::mutex> lock(state().mutex);
    return state().described;
  }

 private:
  static constexpr int64_t kDescribed = 16;
  struct State {
    std::atomic<int64_t> count{0};
    std::mutex mutex;
    std::string described;
  };
  static State& state() {
    static State s;
    return s;
  }
  static void on_allocate(Kokkos::Profiling::SpaceHandle space, const char* label, const void*,
                          uint64_t bytes) {
    State& s = state();
    if (s.count.fetch_add(1) >= kDescribed) return;
    std::lock_guard<std::mutex> lock(s.mutex);
    s.described +=
        std::string(" ") + space.name + " '" + label + "' (" + std::to_string(bytes) + " bytes)";
  }
};

}  // namespace meshtrain::testing
