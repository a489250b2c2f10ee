// The counting global operator new and delete of tests/support/counting_allocator.hpp, and its
// AllocationWindow. Linked into the test programs that count allocations (an object library:
// replacing operator new is a whole-program choice, so never in a program that does not ask).

#include "tests/support/counting_allocator.hpp"

#include "tests/support/onednn_allocations.hpp"

#include <execinfo.h>

#include <Kokkos_Core.hpp>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <thread>

namespace {

std::atomic<bool> g_window_open{false};
// When set, only allocations of g_counted_thread count.
std::atomic<bool> g_one_thread{false};
std::thread::id g_counted_thread;
std::atomic<bool> g_leave_out_onednn{false};
std::atomic<long> g_heap_allocations{0};
std::atomic<long> g_kokkos_allocations{0};
// With oneDNN left out: its allocations in the window, and the addresses of those not freed
// yet, in an open-addressing table (linear probing from the address's hash; slots claimed by
// compare-and-swap, so any thread may record or clear one without a lock or an allocation). A
// freed block's slot becomes a tombstone, never empty again in the window, so a lookup stops at
// the first empty slot. Blocks the table has no room for count as kept (g_onednn_unrecorded).
std::atomic<long> g_onednn_allocations{0};
constexpr std::size_t kOneDnnSlots = 4096;
constexpr uintptr_t kEmpty = 0, kFreed = 1;
std::atomic<uintptr_t> g_onednn_blocks[kOneDnnSlots];
std::atomic<long> g_onednn_live{0};
std::atomic<long> g_onednn_unrecorded{0};

std::size_t slot_of(uintptr_t p) {
  return static_cast<std::size_t>((p >> 4) * 0x9E3779B97F4A7C15ull >> 32) % kOneDnnSlots;
}

void record_onednn_block(void* block) {
  const auto p = reinterpret_cast<uintptr_t>(block);
  const std::size_t first = slot_of(p);
  for (std::size_t i = 0; i < kOneDnnSlots; ++i) {
    std::atomic<uintptr_t>& slot = g_onednn_blocks[(first + i) % kOneDnnSlots];
    uintptr_t seen = slot.load(std::memory_order_relaxed);
    while (seen == kEmpty || seen == kFreed) {
      if (slot.compare_exchange_weak(seen, p, std::memory_order_acq_rel)) {
        g_onednn_live.fetch_add(1, std::memory_order_relaxed);
        return;
      }
    }
  }
  g_onednn_unrecorded.fetch_add(1, std::memory_order_relaxed);
}

// Clears `block`'s slot if it was recorded (whichever code frees it).
void clear_onednn_block(void* block) {
  const auto p = reinterpret_cast<uintptr_t>(block);
  const std::size_t first = slot_of(p);
  for (std::size_t i = 0; i < kOneDnnSlots; ++i) {
    std::atomic<uintptr_t>& slot = g_onednn_blocks[(first + i) % kOneDnnSlots];
    uintptr_t seen = slot.load(std::memory_order_acquire);
    if (seen == kEmpty) return;
    if (seen == p && slot.compare_exchange_strong(seen, kFreed, std::memory_order_acq_rel)) {
      g_onednn_live.fetch_sub(1, std::memory_order_relaxed);
      return;
    }
  }
}
int g_trace_left = 0;
thread_local bool g_tracing = false;  // no counting while a trace is printed

void count_kokkos_allocation(Kokkos::Profiling::SpaceHandle, const char*, const void*, uint64_t) {
  if (g_window_open.load(std::memory_order_relaxed)) {
    g_kokkos_allocations.fetch_add(1, std::memory_order_relaxed);
  }
}

// Counts an allocation about to be made; returns whether oneDNN makes it (left out: its
// address is recorded once made).
bool on_allocation(std::size_t bytes) {
  if (!g_window_open.load(std::memory_order_relaxed) || g_tracing) return false;
  if (g_one_thread.load(std::memory_order_relaxed) &&
      std::this_thread::get_id() != g_counted_thread) {
    return false;
  }
  if (g_leave_out_onednn.load(std::memory_order_relaxed) &&
      meshtrain::testing::allocation_made_by_onednn()) {
    g_onednn_allocations.fetch_add(1, std::memory_order_relaxed);
    return true;
  }
  g_heap_allocations.fetch_add(1, std::memory_order_relaxed);
  if (g_trace_left <= 0) return false;
  --g_trace_left;
  g_tracing = true;
  void* frames[32];
  const int depth = backtrace(frames, 32);
  std::fprintf(stderr, "heap allocation of %zu bytes inside a counted window:\n", bytes);
  backtrace_symbols_fd(frames, depth, 2);  // writes to stderr without allocating
  g_tracing = false;
  return false;
}

// A block freed while oneDNN's allocations are left out: its record cleared, if it has one
// (by any thread: a block oneDNN made on the counted thread may be freed on another).
void on_free(void* p) {
  if (p == nullptr || g_onednn_live.load(std::memory_order_relaxed) == 0 ||
      !g_window_open.load(std::memory_order_relaxed)) {
    return;
  }
  clear_onednn_block(p);
}

void release(void* p) {
  on_free(p);
  std::free(p);
}

void* allocate(std::size_t bytes) {
  const bool onednn = on_allocation(bytes);
  if (void* p = std::malloc(bytes ? bytes : 1)) {
    if (onednn) record_onednn_block(p);
    return p;
  }
  throw std::bad_alloc();
}

void* allocate_aligned(std::size_t bytes, std::size_t alignment) {
  const bool onednn = on_allocation(bytes);
  const std::size_t rounded = (bytes + alignment - 1) / alignment * alignment;
  if (void* p = std::aligned_alloc(alignment, rounded ? rounded : alignment)) {
    if (onednn) record_onednn_block(p);
    return p;
  }
  throw std::bad_alloc();
}

}  // namespace

void* operator new(std::size_t bytes) {
  return allocate(bytes);
}
void* operator new[](std::size_t bytes) {
  return allocate(bytes);
}
void* operator new(std::size_t bytes, const std::nothrow_t&) noexcept {
  try {
    return allocate(bytes);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t bytes, const std::nothrow_t&) noexcept {
  try {
    return allocate(bytes);
  } catch (...) {
    return nullptr;
  }
}
void* operator new(std::size_t bytes, std::align_val_t a) {
  return allocate_aligned(bytes, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t bytes, std::align_val_t a) {
  return allocate_aligned(bytes, static_cast<std::size_t>(a));
}
void operator delete(void* p) noexcept {
  release(p);
}
void operator delete[](void* p) noexcept {
  release(p);
}
void operator delete(void* p, std::size_t) noexcept {
  release(p);
}
void operator delete[](void* p, std::size_t) noexcept {
  release(p);
}
void operator delete(void* p, std::align_val_t) noexcept {
  release(p);
}
void operator delete[](void* p, std::align_val_t) noexcept {
  release(p);
}
void operator delete(void* p, std::size_t, std::align_val_t) noexcept {
  release(p);
}
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept {
  release(p);
}

namespace meshtrain::testing {

AllocationWindow::AllocationWindow(Threads threads, OneDnn onednn) {
  // Before the window opens: finding libdnnl and warming up the unwinder allocate.
  if (onednn == OneDnn::left_out) find_onednn_code();
  g_leave_out_onednn = onednn == OneDnn::left_out;
  const char* trace = std::getenv("MESHTRAIN_TRACE_ALLOCATIONS");
  g_trace_left = trace != nullptr ? std::atoi(trace) : 0;
  g_heap_allocations = 0;
  g_kokkos_allocations = 0;
  g_onednn_allocations = 0;
  for (std::atomic<uintptr_t>& slot : g_onednn_blocks) slot.store(kEmpty);
  g_onednn_live = 0;
  g_onednn_unrecorded = 0;
  g_counted_thread = std::this_thread::get_id();
  g_one_thread = threads == Threads::this_thread;
  Kokkos::Tools::Experimental::set_allocate_data_callback(count_kokkos_allocation);
  g_window_open = true;
}

AllocationWindow::~AllocationWindow() {
  close();
}

long AllocationWindow::close() {
  if (g_window_open.exchange(false)) {
    Kokkos::Tools::Experimental::set_allocate_data_callback(nullptr);
    g_one_thread = false;
    onednn_left_out_ = g_leave_out_onednn.exchange(false);
  }
  // oneDNN's blocks still recorded stop changing here (frees clear them while open only).
  return g_heap_allocations.load() + (onednn_left_out_ ? onednn_blocks_kept() : 0);
}

long AllocationWindow::heap_allocations() const {
  return g_heap_allocations.load();
}

long AllocationWindow::kokkos_allocations() const {
  return g_kokkos_allocations.load();
}

long AllocationWindow::onednn_allocations() const {
  return g_onednn_allocations.load();
}

long AllocationWindow::onednn_blocks_kept() const {
  return g_onednn_live.load() + g_onednn_unrecorded.load();
}

}  // namespace meshtrain::testing
