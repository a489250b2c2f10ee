#include "framework/comm/reduction_choice.hpp"

#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cmath>
#include <sstream>

namespace meshtrain {

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <class Fn>
double timed(Communicator& comm, Fn&& fn) {
  comm.barrier();
  const double start = MPI_Wtime();
  fn();
  return MPI_Wtime() - start;
}

// The sizes the start-up measurement of "auto" tries: a small and a larger message (kept
// small: every group of every run measures, tests included).
const std::vector<std::size_t>& startup_sizes() {
  static const std::vector<std::size_t> sizes = {std::size_t{64} << 10, std::size_t{1} << 20};
  return sizes;
}

std::string size_text(std::size_t bytes) {
  std::ostringstream out;
  if (bytes >= (std::size_t{1} << 20) && bytes % (std::size_t{1} << 20) == 0) {
    out << (bytes >> 20) << " MiB";
  } else if (bytes >= 1024 && bytes % 1024 == 0) {
    out << (bytes >> 10) << " KiB";
  } else {
    out << bytes << " B";
  }
  return out.str();
}

}  // namespace

ReductionTimings time_reductions(Communicator& comm, const std::vector<std::size_t>& bytes,
                                 int repeats) {
  const ReductionChoice saved = comm.reduction_choice();
  const std::size_t n = static_cast<std::size_t>(comm.size());
  ReductionTimings t;
  t.bytes = bytes;
  for (const std::size_t b : bytes) {
    const std::size_t block = std::max<std::size_t>(1, b / sizeof(float) / n);
    Kokkos::View<float*> send("meshtrain::reduction_timing_send", block * n),
        recv("meshtrain::reduction_timing_recv", block);
    Kokkos::deep_copy(send, 1.0f);
    std::vector<double> times[4];
    for (int round = 0; round <= repeats; ++round) {
      for (int which = 0; which < 4; ++which) {
        const bool ring = which % 2 == 1;
        comm.set_reduction_choice(ring ? ReductionChoice::ring() : ReductionChoice::library());
        const double s = timed(comm, [&] {
          if (which < 2) {
            comm.reduce_scatter(ConstVectorView(send.data(), block * n),
                                VectorView(recv.data(), block));
          } else {
            comm.all_reduce(VectorView(send.data(), block * n));
          }
        });
        if (round > 0) times[which].push_back(s);  // round 0 warms up
      }
    }
    t.library_reduce_scatter.push_back(median(times[0]));
    t.ring_reduce_scatter.push_back(median(times[1]));
    t.library_all_reduce.push_back(median(times[2]));
    t.ring_all_reduce.push_back(median(times[3]));
  }
  comm.set_reduction_choice(saved);
  return t;
}

std::size_t ring_from(const std::vector<std::size_t>& bytes, const std::vector<double>& library,
                      const std::vector<double>& ring) {
  std::size_t from = ReductionChoice::kNever;
  for (std::size_t i = bytes.size(); i-- > 0;) {
    if (!(ring[i] < library[i])) break;
    from = bytes[i];
  }
  return from;
}

ReductionChoice choice_from_timings(const ReductionTimings& t) {
  ReductionChoice c;
  c.reduce_scatter_ring_from = ring_from(t.bytes, t.library_reduce_scatter, t.ring_reduce_scatter);
  c.all_reduce_ring_from = ring_from(t.bytes, t.library_all_reduce, t.ring_all_reduce);
  return c;
}

ReductionChoice choice_from_link(const LinkProfile& link) {
  ReductionChoice c;
  if (!link.ring_measured()) return c;
  auto bytes = [](double from) {
    return std::isfinite(from) ? static_cast<std::size_t>(from) : ReductionChoice::kNever;
  };
  c.reduce_scatter_ring_from = bytes(link.ring_reduce_scatter_from);
  c.all_reduce_ring_from = bytes(link.ring_all_reduce_from);
  return c;
}

std::optional<ReductionChoice> planned_reduction_choice(ReductionAlgorithm requested,
                                                        const std::vector<std::string>& axes,
                                                        const HardwareProfile& hardware) {
  switch (requested) {
    case ReductionAlgorithm::mpi:
      return ReductionChoice::library();
    case ReductionAlgorithm::ring:
      return ReductionChoice::ring();
    case ReductionAlgorithm::automatic: {
      // The same profile on every rank (train --hardware reads it on each): no agreement.
      bool calibrated = !axes.empty();
      for (const auto& axis : axes) {
        calibrated =
            calibrated && hardware.links.count(axis) && hardware.link(axis).ring_measured();
      }
      if (calibrated) return choice_from_link(hardware.group_link(axes));
      return ReductionChoice{kDefaultRingFrom, kDefaultRingFrom};
    }
    case ReductionAlgorithm::measure:
      break;
  }
  return std::nullopt;
}

ReductionChoice choose_reductions(ReductionAlgorithm requested, Communicator& comm,
                                  const std::vector<std::string>& axes,
                                  const HardwareProfile& hardware) {
  if (auto planned = planned_reduction_choice(requested, axes, hardware)) return *planned;
  if (comm.size() < 2) return ReductionChoice::library();  // nothing moves
  const ReductionChoice measured = choice_from_timings(time_reductions(comm, startup_sizes(), 2));
  // Rank 0's decision on every rank: the sizes are powers of two (exact in a float), -1 is
  // never.
  Kokkos::View<float*> decision("meshtrain::reduction_decision", 2);
  auto host = Kokkos::create_mirror_view(decision);
  auto encode = [](std::size_t from) {
    return from == ReductionChoice::kNever ? -1.0f : static_cast<float>(from);
  };
  host(0) = encode(measured.reduce_scatter_ring_from);
  host(1) = encode(measured.all_reduce_ring_from);
  Kokkos::deep_copy(decision, host);
  comm.broadcast(VectorView(decision.data(), 2), 0);
  Kokkos::deep_copy(host, decision);
  auto decode = [](float from) {
    return from < 0.0f ? ReductionChoice::kNever : static_cast<std::size_t>(from);
  };
  ReductionChoice agreed;
  agreed.reduce_scatter_ring_from = decode(host(0));
  agreed.all_reduce_ring_from = decode(host(1));
  return agreed;
}

std::string describe(const ReductionChoice& c) {
  if (c == ReductionChoice::library()) return "library";
  if (c == ReductionChoice::ring()) return "ring";
  auto part = [](std::size_t from) {
    return from == ReductionChoice::kNever ? std::string("library")
                                           : "ring from " + size_text(from);
  };
  return part(c.reduce_scatter_ring_from) + " (reduce_scatter), " + part(c.all_reduce_ring_from) +
         " (all_reduce)";
}

}  // namespace meshtrain
