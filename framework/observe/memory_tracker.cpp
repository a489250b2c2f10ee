#include "framework/observe/memory_tracker.hpp"

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace meshtrain {
namespace {

using AllocateFn = Kokkos_Profiling_allocateDataFunction;
using DeallocateFn = Kokkos_Profiling_deallocateDataFunction;

// The live allocations: an open-addressing table keyed by the data pointer (linear probing,
// backward-shift deletion), in static storage. Filled to 3/4 at most.
constexpr int kCapacityBits = 14;
constexpr uint64_t kCapacity = uint64_t{1} << kCapacityBits;
constexpr uint64_t kMaxLive = kCapacity / 4 * 3;
constexpr int kLabelChars = 48;
constexpr int kMaxSpaces = 8;

struct Slot {
  const void* ptr = nullptr;
  int64_t bytes = 0;
  int space = 0;
  char label[kLabelChars] = {};
};

struct Tracker {
  Slot slots[kCapacity];
  uint64_t used = 0;
  char space_names[kMaxSpaces][64] = {};
  int spaces = 0;
  int64_t live[kMaxSpaces] = {};
  int64_t peak[kMaxSpaces] = {};
  int64_t live_total = 0;
  int64_t peak_total = 0;
  bool complete = true;
  bool installed = false;
  AllocateFn next_allocate = nullptr;  // the callbacks found at installation, called after ours
  DeallocateFn next_deallocate = nullptr;
};

Tracker g_tracker;
std::atomic_flag g_lock = ATOMIC_FLAG_INIT;

class Locked {
 public:
  Locked() {
    while (g_lock.test_and_set(std::memory_order_acquire)) {
    }
  }
  ~Locked() { g_lock.clear(std::memory_order_release); }
  Locked(const Locked&) = delete;
  Locked& operator=(const Locked&) = delete;
};

uint64_t home_of(const void* ptr) {
  const uint64_t h = (reinterpret_cast<uintptr_t>(ptr) >> 4) * 0x9E3779B97F4A7C15ull;
  return h >> (64 - kCapacityBits);
}

int space_index(const char* name) {  // under the lock
  Tracker& t = g_tracker;
  for (int i = 0; i < t.spaces; ++i) {
    if (std::strncmp(t.space_names[i], name, sizeof t.space_names[i]) == 0) return i;
  }
  if (t.spaces == kMaxSpaces) return kMaxSpaces - 1;  // more spaces than Kokkos has
  std::strncpy(t.space_names[t.spaces], name, sizeof t.space_names[t.spaces] - 1);
  return t.spaces++;
}

void add(const char* space_name, const char* label, const void* ptr, uint64_t size) {
  Tracker& t = g_tracker;
  Locked lock;
  if (t.used >= kMaxLive) {
    t.complete = false;  // not counted; its deallocation will find nothing to subtract
    return;
  }
  const int space = space_index(space_name);
  uint64_t i = home_of(ptr);
  while (t.slots[i].ptr != nullptr && t.slots[i].ptr != ptr) i = (i + 1) & (kCapacity - 1);
  Slot& slot = t.slots[i];
  if (slot.ptr == ptr) {  // reused without a deallocation seen: forget the old one
    t.live[slot.space] -= slot.bytes;
    t.live_total -= slot.bytes;
  } else {
    ++t.used;
  }
  slot.ptr = ptr;
  slot.bytes = static_cast<int64_t>(size);
  slot.space = space;
  std::strncpy(slot.label, label != nullptr ? label : "", kLabelChars - 1);
  slot.label[kLabelChars - 1] = '\0';
  t.live[space] += slot.bytes;
  t.live_total += slot.bytes;
  t.peak[space] = std::max(t.peak[space], t.live[space]);
  t.peak_total = std::max(t.peak_total, t.live_total);
}

void remove(const void* ptr) {
  Tracker& t = g_tracker;
  Locked lock;
  uint64_t i = home_of(ptr);
  while (t.slots[i].ptr != nullptr && t.slots[i].ptr != ptr) i = (i + 1) & (kCapacity - 1);
  if (t.slots[i].ptr == nullptr) return;  // allocated while the tracker was not installed
  t.live[t.slots[i].space] -= t.slots[i].bytes;
  t.live_total -= t.slots[i].bytes;
  --t.used;
  // Backward-shift deletion: move up every later entry of the run whose home slot is not
  // between the hole and itself, so lookups never stop at the hole.
  uint64_t j = i;
  while (true) {
    j = (j + 1) & (kCapacity - 1);
    if (t.slots[j].ptr == nullptr) break;
    const uint64_t k = home_of(t.slots[j].ptr);
    const bool stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
    if (stays) continue;
    t.slots[i] = t.slots[j];
    i = j;
  }
  t.slots[i].ptr = nullptr;
}

void on_allocate(const Kokkos_Profiling_SpaceHandle handle, const char* label, const void* ptr,
                 const uint64_t size) {
  if (ptr != nullptr) add(handle.name, label, ptr, size);
  if (AllocateFn next = g_tracker.next_allocate) next(handle, label, ptr, size);
}

void on_deallocate(const Kokkos_Profiling_SpaceHandle handle, const char* label, const void* ptr,
                   const uint64_t size) {
  if (ptr != nullptr) remove(ptr);
  if (DeallocateFn next = g_tracker.next_deallocate) next(handle, label, ptr, size);
}

// "VmHWM:    123456 kB" -> bytes; -1 when the key is absent.
int64_t status_kib(const char* text, const char* key) {
  const char* at = std::strstr(text, key);
  if (at == nullptr) return -1;
  return std::strtoll(at + std::strlen(key), nullptr, 10) * 1024;
}

}  // namespace

void install_memory_tracker() {
  namespace tools = Kokkos::Tools::Experimental;
  const tools::EventSet events = tools::get_callbacks();
  Tracker& t = g_tracker;
  const bool allocate_ours = events.allocate_data == &on_allocate;
  const bool deallocate_ours = events.deallocate_data == &on_deallocate;
  if (allocate_ours && deallocate_ours) return;
  {
    Locked lock;
    // Replaced since it was installed: what was allocated meanwhile went uncounted.
    if (t.installed) t.complete = false;
    if (!allocate_ours) t.next_allocate = events.allocate_data;
    if (!deallocate_ours) t.next_deallocate = events.deallocate_data;
    t.installed = true;
  }
  if (!allocate_ours) tools::set_allocate_data_callback(&on_allocate);
  if (!deallocate_ours) tools::set_deallocate_data_callback(&on_deallocate);
}

bool memory_tracker_installed() {
  const auto events = Kokkos::Tools::Experimental::get_callbacks();
  return events.allocate_data == &on_allocate && events.deallocate_data == &on_deallocate;
}

void reset_kokkos_peak() {
  Tracker& t = g_tracker;
  Locked lock;
  for (int i = 0; i < t.spaces; ++i) t.peak[i] = t.live[i];
  t.peak_total = t.live_total;
  t.complete = t.used < kMaxLive;
}

KokkosMemory kokkos_memory(int largest) {
  // Copied under the lock (no allocation there), formatted after it.
  struct Top {
    const void* data;
    int64_t bytes;
    int space;
    char label[kLabelChars];
  };
  // Allocated before the lock (up to every slot of the table: a test sums them all).
  largest = static_cast<int>(std::min<int64_t>(std::max(largest, 0), kCapacity));
  std::vector<Top> top(static_cast<size_t>(largest));
  int tops = 0;
  KokkosMemory m;
  int spaces = 0;
  char names[kMaxSpaces][64];
  int64_t live[kMaxSpaces], peak[kMaxSpaces];
  {
    Tracker& t = g_tracker;
    Locked lock;
    m.live_bytes = t.live_total;
    m.peak_bytes = t.peak_total;
    m.complete = t.complete;
    spaces = t.spaces;
    std::memcpy(names, t.space_names, sizeof names);
    std::memcpy(live, t.live, sizeof live);
    std::memcpy(peak, t.peak, sizeof peak);
    for (uint64_t i = 0; i < kCapacity && largest > 0; ++i) {
      const Slot& s = t.slots[i];
      if (s.ptr == nullptr) continue;
      if (tops == largest && s.bytes <= top[tops - 1].bytes) continue;
      int at = tops < largest ? tops++ : tops - 1;  // insertion into the sorted top list
      while (at > 0 && top[at - 1].bytes < s.bytes) {
        top[at] = top[at - 1];
        --at;
      }
      top[at].data = s.ptr;
      top[at].bytes = s.bytes;
      top[at].space = s.space;
      std::memcpy(top[at].label, s.label, kLabelChars);
    }
  }
  for (int i = 0; i < spaces; ++i) m.spaces.push_back({names[i], live[i], peak[i]});
  for (int i = 0; i < tops; ++i)
    m.largest.push_back({top[i].label, names[top[i].space], top[i].bytes, top[i].data});
  return m;
}

HostMemory host_memory() {
  HostMemory h;
  char text[4096];
  const int fd = ::open("/proc/self/status", O_RDONLY);
  if (fd >= 0) {
    const ssize_t n = ::read(fd, text, sizeof text - 1);
    ::close(fd);
    if (n > 0) {
      text[n] = '\0';
      h.peak_rss_bytes = std::max<int64_t>(status_kib(text, "VmHWM:"), 0);
      h.current_rss_bytes = std::max<int64_t>(status_kib(text, "VmRSS:"), 0);
    }
  }
  if (h.peak_rss_bytes == 0) {
    rusage usage{};
    if (getrusage(RUSAGE_SELF, &usage) == 0) h.peak_rss_bytes = int64_t{usage.ru_maxrss} * 1024;
  }
  return h;
}

}  // namespace meshtrain
