#include "framework/observe/pass_counter.hpp"

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <tuple>

namespace meshtrain {
namespace {

using BeginFn = Kokkos_Profiling_beginFunction;
using BeginCopyFn = Kokkos_Profiling_beginDeepCopyFunction;
using BeginFenceFn = Kokkos_Profiling_beginFenceFunction;

// The labels seen: open addressing on (kind, text), linear probing, never deleted (a reset
// zeroes the counts), filled to 3/4 at most.
constexpr int kCapacity = 2 * kMaxPassLabels;
constexpr int kLabelChars = 64;

struct Slot {
  bool used = false;
  PassKind kind = PassKind::kernel;
  char label[kLabelChars] = {};
  int64_t count = 0;
  int64_t bytes = 0;
};

struct Counter {
  Slot slots[kCapacity];
  int used = 0;
  int64_t kernels = 0, copies = 0, copy_bytes = 0, fences = 0;
  bool complete = true;
  bool installed = false;
  BeginFn next_for = nullptr, next_reduce = nullptr, next_scan = nullptr;
  BeginCopyFn next_copy = nullptr;
  BeginFenceFn next_fence = nullptr;
};

Counter g_counter;
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

// FNV-1a of the label's first kLabelChars - 1 characters and the kind.
uint32_t home_of(PassKind kind, const char* label) {
  uint32_t h = 2166136261u ^ static_cast<uint32_t>(kind);
  for (int i = 0; i < kLabelChars - 1 && label[i] != '\0'; ++i) {
    h = (h ^ static_cast<unsigned char>(label[i])) * 16777619u;
  }
  return h % kCapacity;
}

bool same_label(const Slot& slot, PassKind kind, const char* label) {
  return slot.kind == kind && std::strncmp(slot.label, label, kLabelChars - 1) == 0;
}

// Adds one pass of `kind` under `label` (and `bytes`); under the lock.
void count(PassKind kind, const char* label, int64_t bytes) {
  Counter& c = g_counter;
  switch (kind) {
    case PassKind::kernel:
      ++c.kernels;
      break;
    case PassKind::copy:
      ++c.copies;
      c.copy_bytes += bytes;
      break;
    case PassKind::fence:
      ++c.fences;
      break;
  }
  if (label == nullptr) label = "";
  int i = static_cast<int>(home_of(kind, label));
  while (c.slots[i].used && !same_label(c.slots[i], kind, label)) i = (i + 1) % kCapacity;
  Slot& slot = c.slots[i];
  if (!slot.used) {
    if (c.used >= kMaxPassLabels) {
      c.complete = false;  // counted in the totals only
      return;
    }
    slot.used = true;
    slot.kind = kind;
    std::strncpy(slot.label, label, kLabelChars - 1);
    slot.label[kLabelChars - 1] = '\0';
    ++c.used;
  }
  ++slot.count;
  slot.bytes += bytes;
}

void on_kernel(const char* label, uint32_t device, uint64_t* kernel_id, BeginFn next) {
  {
    Locked lock;
    count(PassKind::kernel, label, 0);
  }
  if (next != nullptr) {
    next(label, device, kernel_id);
  } else if (kernel_id != nullptr) {
    *kernel_id = 0;
  }
}

void on_parallel_for(const char* label, const uint32_t device, uint64_t* kernel_id) {
  on_kernel(label, device, kernel_id, g_counter.next_for);
}
void on_parallel_reduce(const char* label, const uint32_t device, uint64_t* kernel_id) {
  on_kernel(label, device, kernel_id, g_counter.next_reduce);
}
void on_parallel_scan(const char* label, const uint32_t device, uint64_t* kernel_id) {
  on_kernel(label, device, kernel_id, g_counter.next_scan);
}

void on_deep_copy(Kokkos_Profiling_SpaceHandle dst_space, const char* dst_label, const void* dst,
                  Kokkos_Profiling_SpaceHandle src_space, const char* src_label, const void* src,
                  uint64_t size) {
  char label[kLabelChars];
  std::snprintf(label, sizeof label, "%s <- %s", dst_label != nullptr ? dst_label : "",
                src_label != nullptr ? src_label : "");
  {
    Locked lock;
    count(PassKind::copy, label, static_cast<int64_t>(size));
  }
  if (BeginCopyFn next = g_counter.next_copy) {
    next(dst_space, dst_label, dst, src_space, src_label, src, size);
  }
}

void on_fence(const char* label, const uint32_t device, uint64_t* fence_id) {
  {
    Locked lock;
    count(PassKind::fence, label, 0);
  }
  if (BeginFenceFn next = g_counter.next_fence) {
    next(label, device, fence_id);
  } else if (fence_id != nullptr) {
    *fence_id = 0;
  }
}

}  // namespace

const char* to_string(PassKind kind) {
  switch (kind) {
    case PassKind::kernel:
      return "kernel";
    case PassKind::copy:
      return "copy";
    case PassKind::fence:
      return "fence";
  }
  return "?";
}

void install_pass_counter() {
  namespace tools = Kokkos::Tools::Experimental;
  const tools::EventSet events = tools::get_callbacks();
  Counter& c = g_counter;
  {
    Locked lock;
    if (events.begin_parallel_for != &on_parallel_for) c.next_for = events.begin_parallel_for;
    if (events.begin_parallel_reduce != &on_parallel_reduce) {
      c.next_reduce = events.begin_parallel_reduce;
    }
    if (events.begin_parallel_scan != &on_parallel_scan) c.next_scan = events.begin_parallel_scan;
    if (events.begin_deep_copy != &on_deep_copy) c.next_copy = events.begin_deep_copy;
    if (events.begin_fence != &on_fence) c.next_fence = events.begin_fence;
    c.installed = true;
  }
  tools::set_begin_parallel_for_callback(&on_parallel_for);
  tools::set_begin_parallel_reduce_callback(&on_parallel_reduce);
  tools::set_begin_parallel_scan_callback(&on_parallel_scan);
  tools::set_begin_deep_copy_callback(&on_deep_copy);
  tools::set_begin_fence_callback(&on_fence);
}

void uninstall_pass_counter() {
  namespace tools = Kokkos::Tools::Experimental;
  const tools::EventSet events = tools::get_callbacks();
  Counter& c = g_counter;
  if (events.begin_parallel_for == &on_parallel_for) {
    tools::set_begin_parallel_for_callback(c.next_for);
  }
  if (events.begin_parallel_reduce == &on_parallel_reduce) {
    tools::set_begin_parallel_reduce_callback(c.next_reduce);
  }
  if (events.begin_parallel_scan == &on_parallel_scan) {
    tools::set_begin_parallel_scan_callback(c.next_scan);
  }
  if (events.begin_deep_copy == &on_deep_copy) tools::set_begin_deep_copy_callback(c.next_copy);
  if (events.begin_fence == &on_fence) tools::set_begin_fence_callback(c.next_fence);
  Locked lock;
  c.installed = false;
}

bool pass_counter_installed() {
  const auto events = Kokkos::Tools::Experimental::get_callbacks();
  return events.begin_parallel_for == &on_parallel_for &&
         events.begin_parallel_reduce == &on_parallel_reduce &&
         events.begin_parallel_scan == &on_parallel_scan &&
         events.begin_deep_copy == &on_deep_copy && events.begin_fence == &on_fence;
}

void reset_pass_counts() {
  Counter& c = g_counter;
  Locked lock;
  for (Slot& slot : c.slots) slot.count = slot.bytes = 0;
  c.kernels = c.copies = c.copy_bytes = c.fences = 0;
  c.complete = c.used < kMaxPassLabels;
}

PassTotals pass_totals() {
  const Counter& c = g_counter;
  Locked lock;
  PassTotals totals;
  totals.kernels = c.kernels;
  totals.copies = c.copies;
  totals.copy_bytes = c.copy_bytes;
  totals.fences = c.fences;
  return totals;
}

PassCounts pass_counts() {
  // Copied under the lock into storage reserved before it, formatted after it.
  std::vector<Slot> seen(kMaxPassLabels);
  int n = 0;
  PassCounts counts;
  {
    const Counter& c = g_counter;
    Locked lock;
    counts.kernels = c.kernels;
    counts.copies = c.copies;
    counts.copy_bytes = c.copy_bytes;
    counts.fences = c.fences;
    counts.complete = c.complete;
    for (const Slot& slot : c.slots) {
      if (slot.used && slot.count > 0 && n < kMaxPassLabels) seen[n++] = slot;
    }
  }
  for (int i = 0; i < n; ++i) {
    counts.labels.push_back({seen[i].kind, seen[i].label, seen[i].count, seen[i].bytes});
  }
  std::sort(counts.labels.begin(), counts.labels.end(),
            [](const LabelPasses& a, const LabelPasses& b) {
              return std::tie(a.kind, a.label) < std::tie(b.kind, b.label);
            });
  return counts;
}

}  // namespace meshtrain
