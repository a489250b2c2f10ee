#pragma once
// The passes a program makes over memory, counted through Kokkos' tool callbacks
// (docs/observability.md, "Passes per step"): kernel launches (parallel_for, parallel_reduce,
// parallel_scan), deep copies (with their bytes) and fences, each by its label.
//
// Off (not installed) it costs nothing: Kokkos calls no callback. Installed, each callback
// looks its label up in a fixed table in static storage (open addressing on the label's text,
// at most kMaxPassLabels labels, each cut at 63 characters), adds one under a spin lock and
// calls the callback it found installed before it: it never allocates. GEMMs that go to BLAS,
// oneDNN or cuBLAS directly are not Kokkos launches and are not counted. A fence is counted
// only where this Kokkos reports it (Kokkos 3.4's Serial space reports none).
//
// Kokkos keeps one callback of each kind: install_pass_counter() chains the ones it finds
// (the memory tracker's allocation callbacks are of other kinds and are left as they are).

#include <cstdint>
#include <string>
#include <vector>

namespace meshtrain {

constexpr int kMaxPassLabels = 1024;

enum class PassKind { kernel, copy, fence };
const char* to_string(PassKind kind);

// One label's passes since reset_pass_counts().
struct LabelPasses {
  PassKind kind = PassKind::kernel;
  std::string label;  // the kernel's or fence's label; a copy's "<destination> <- <source>"
  int64_t count = 0;
  int64_t bytes = 0;  // copies only
};

struct PassTotals {
  int64_t kernels = 0;
  int64_t copies = 0;
  int64_t copy_bytes = 0;
  int64_t fences = 0;
};

struct PassCounts : PassTotals {
  // False when more distinct labels came than the table holds (the totals still count them).
  bool complete = true;
  std::vector<LabelPasses> labels;  // by kind, then label
};

// Installs (or reinstalls) the counter's callbacks, chaining those set before it. Call
// outside any step (it reads Kokkos' callback set).
void install_pass_counter();
// Puts back the callbacks the counter found at installation (where they are still its own).
void uninstall_pass_counter();
bool pass_counter_installed();
// Every count to zero (the labels seen stay in the table: no allocation on the next pass).
void reset_pass_counts();
// The totals since the last reset; allocates nothing (a step may read them).
PassTotals pass_totals();
// The totals and every label's counts since the last reset. Allocates: call outside the step.
PassCounts pass_counts();

}  // namespace meshtrain
