#pragma once
// For the tests that count heap allocations (replacing operator new): whether an allocation is
// made from inside oneDNN. oneDNN's matmul (gemm() on host memory where it runs oneDNN,
// framework/core/backends/gemm_onednn.cpp) allocates inside every execution, which no call of its
// API avoids: with operator new its execution context and argument map (3-5 blocks per call in
// the training step, up to 8 in 2.6.3), which those tests count apart and require freed
// (AllocationWindow::close); with its own posix_memalign the call's memory objects and its gemm
// kernel's workspace, which operator new's replacement does not see (docs/design.md, GEMM).
// What meshtrain allocates itself through operator new (the C++ handles of the GEMM's primitives
// and memory objects, its tables) is made from meshtrain's code and still counted; the blocks
// oneDNN makes inside their creation count as oneDNN's (kept ones seen by the window).
//
//   find_onednn_code();               // once, before counting (outside any counted window)
//   if (allocation_made_by_onednn()) ...  // inside the counting operator new

#include <execinfo.h>
#include <link.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace meshtrain::testing {

// libdnnl's executable code, where the process loaded it (0, 0 where it did not).
inline uintptr_t g_onednn_code_begin = 0, g_onednn_code_end = 0;

inline int find_onednn_segment(dl_phdr_info* info, std::size_t, void*) {
  if (info->dlpi_name == nullptr || std::strstr(info->dlpi_name, "libdnnl") == nullptr) return 0;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)& segment = info->dlpi_phdr[i];
    if (segment.p_type != PT_LOAD || (segment.p_flags & PF_X) == 0) continue;
    g_onednn_code_begin = info->dlpi_addr + segment.p_vaddr;
    g_onednn_code_end = g_onednn_code_begin + segment.p_memsz;
    return 1;
  }
  return 0;
}

// Finds libdnnl's code and loads the unwinder (backtrace() allocates at its first call only).
// Returns whether the process has oneDNN.
inline bool find_onednn_code() {
  static const bool found = [] {
    void* warm_up[4];
    backtrace(warm_up, 4);
    dl_iterate_phdr(find_onednn_segment, nullptr);
    return g_onednn_code_begin != 0;
  }();
  return found;
}

// Whether the allocation being made comes from oneDNN's code (a frame of its call stack lies
// in libdnnl). Allocates nothing once find_onednn_code() has run.
inline bool allocation_made_by_onednn() {
  if (g_onednn_code_begin == 0) return false;
  void* frames[32];
  const int depth = backtrace(frames, 32);
  for (int i = 0; i < depth; ++i) {
    const auto address = reinterpret_cast<uintptr_t>(frames[i]);
    if (address >= g_onednn_code_begin && address < g_onednn_code_end) return true;
  }
  return false;
}

}  // namespace meshtrain::testing
