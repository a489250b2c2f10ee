#pragma once
// [runtime] reductions: which algorithm a communicator's blocking sums use (ReductionChoice,
// communicator.hpp). "mpi" keeps the MPI library's collectives, "ring" uses the MPI backend's
// own ring (backends/mpi_ring.hpp) at every size. "auto" uses the ring from the message size
// on where it measured faster: the sizes of the hardware file's link of the group's axes when
// `meshtrain calibrate` measured the ring there (train --hardware FILE), else a fixed 64 KiB
// (kDefaultRingFrom, where calibrate found the ring faster on a shared-memory node), so that a
// run's numerics do not depend on timing noise (bit-exact resume). "measure" times both on the
// group when it is built (tens of milliseconds: 64 KiB and 1 MiB per rank), decided by the
// group's rank 0 and broadcast, so every rank of the group holds the same choice; two runs may
// choose differently. NCCL communicators ignore the choice. docs/communication.md.

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "framework/comm/communicator.hpp"
#include "framework/core/choices.hpp"
#include "partition/hardware.hpp"

namespace meshtrain {

// Seconds of the library's and the ring's reduce-scatter and all-reduce on one group at
// message sizes (bytes each rank sends), ascending.
struct ReductionTimings {
  std::vector<std::size_t> bytes;
  std::vector<double> library_reduce_scatter, ring_reduce_scatter;
  std::vector<double> library_all_reduce, ring_all_reduce;
};

// Times both algorithms at `bytes` per rank on `comm` (fp32): for every size and operation the
// two interleaved, `repeats` rounds after a warm-up, the median of this rank's times after a
// barrier. Collective over the group; the communicator's choice is restored.
ReductionTimings time_reductions(Communicator& comm, const std::vector<std::size_t>& bytes,
                                 int repeats);

// Bytes per rank from which the ring is used: the smallest measured size at which the ring
// was faster there and at every larger measured size; ReductionChoice::kNever when it was not
// faster at the largest.
std::size_t ring_from(const std::vector<std::size_t>& bytes, const std::vector<double>& library,
                      const std::vector<double>& ring);
ReductionChoice choice_from_timings(const ReductionTimings& timings);

// The choice a link of a calibrated hardware profile gives (library where the ring was not
// measured).
ReductionChoice choice_from_link(const LinkProfile& link);

// Bytes per rank from which "auto" uses the ring when the hardware file did not measure it.
constexpr std::size_t kDefaultRingFrom = std::size_t{64} << 10;

// The choice `requested` gives a group over `axes` without timing anything (see the header
// comment): "mpi", "ring", and "auto" by `hardware`; nullopt for "measure", which is known only
// once the group has timed both. The one resolution of [runtime] reductions: choose_reductions
// uses it for the run's groups, and `meshtrain plan` (framework/train/plan_report.hpp) for the
// ring's buffers it counts, with the same hardware profile.
std::optional<ReductionChoice> planned_reduction_choice(ReductionAlgorithm requested,
                                                        const std::vector<std::string>& axes,
                                                        const HardwareProfile& hardware);

// The choice for `comm` (the group over `axes`) under `requested`; collective over the group
// for measure (see the header comment).
ReductionChoice choose_reductions(ReductionAlgorithm requested, Communicator& comm,
                                  const std::vector<std::string>& axes,
                                  const HardwareProfile& hardware);

// "library", "ring", or "ring from 1 MiB (reduce_scatter), 4 MiB (all_reduce)".
std::string describe(const ReductionChoice& choice);

}  // namespace meshtrain
