#pragma once
// Counting the allocations a piece of code makes: on the heap (every form of the global
// operator new, replaced by tests/support/counting_allocator.cpp, which a program that
// includes this header links: LIBS meshtrain_test_counting_allocator) and through Kokkos (the
// allocate-data tool callback, any memory space), while an AllocationWindow is open. C++
// allocations only: what MPI allocates with malloc inside its own calls is not counted.
// MESHTRAIN_TRACE_ALLOCATIONS=N prints the call stacks of the first N heap allocations counted.

namespace meshtrain::testing {

class AllocationWindow {
 public:
  // Which threads' heap allocations count: every thread's (a data reader thread's too), or only
  // the thread that opens the window (beside a checkpoint writer that builds its own records).
  enum class Threads { all, this_thread };

  // Which heap allocations count: all, or all but those made from inside oneDNN's code (its
  // matmul allocates a few small blocks in every execution, its execution context and the map
  // of its arguments, which its API cannot avoid: tests/support/onednn_allocations.hpp;
  // everything meshtrain allocates itself still counts). Those left out are counted apart, and
  // their addresses recorded until freed, so that the blocks oneDNN keeps count (close(),
  // onednn_blocks_kept). Only operator new's blocks: what oneDNN takes with posix_memalign (its
  // primitives' and memory objects' storage, scratchpads) is not seen at all.
  enum class OneDnn { counted, left_out };

  // Opens the window (one at a time); it closes at close() or destruction.
  explicit AllocationWindow(Threads threads = Threads::all, OneDnn onednn = OneDnn::counted);
  ~AllocationWindow();
  AllocationWindow(const AllocationWindow&) = delete;
  AllocationWindow& operator=(const AllocationWindow&) = delete;

  // Closes the window; returns the heap allocations counted in it, and with OneDnn::left_out
  // also the blocks oneDNN allocated in it and had not freed by the close (onednn_blocks_kept),
  // so that a caller checking close() == 0 checks both.
  long close();
  // Counted so far (or in the closed window).
  long heap_allocations() const;
  long kokkos_allocations() const;
  // With OneDnn::left_out: the heap allocations made from inside oneDNN, and how many of them
  // were not freed (by any code) before the close: each block's address is recorded when made
  // and cleared when freed, in a table of 4096 (a block it has no room for counts as kept).
  // Blocks allocated before the window and freed in it count nowhere.
  long onednn_allocations() const;
  long onednn_blocks_kept() const;

 private:
  bool onednn_left_out_ = false;
};

}  // namespace meshtrain::testing
