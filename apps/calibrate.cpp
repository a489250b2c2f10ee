#include "apps/calibrate.hpp"

#include <mpi.h>
#include <unistd.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <limits>
#include <map>
#include <sstream>

#include "base/error.hpp"
#include "base/text.hpp"
#include "framework/comm/exit_policy.hpp"
#include "framework/comm/failure_agreement.hpp"
#include "framework/comm/mesh_communicators.hpp"
#include "framework/comm/mpi_util.hpp"
#include "framework/comm/progress_thread.hpp"
#include "framework/comm/reduction_choice.hpp"
#include "framework/comm/runtime.hpp"
#include "framework/core/gemm.hpp"
#include "framework/core/kernel_label.hpp"
#include "framework/train/config.hpp"
#include "framework/train/hardware_file.hpp"
#include "layers/activation.hpp"
#include "layers/dlrm.hpp"  // dlrm_dot_interaction
#include "partition/cost_model.hpp"
#include "partition/dlrm_shape.hpp"
#include "run/dlrm_read_timing.hpp"

namespace meshtrain {
namespace {

// --clock cpu: every time below is this process's CPU time instead of wall time, which
// other jobs time-sharing the cores do not inflate (ranks waiting in MPI spin, so waits
// count too): the profile of the same machine idle, to compare with CPU-time step times.
bool g_cpu_clock = false;

double now() {
  if (!g_cpu_clock) return MPI_Wtime();
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The ranks on this rank's host (they share its cores and memory); set by calibrate_command.
MPI_Comm g_host_ranks = MPI_COMM_NULL;

// Median seconds of `fn` over `repeats` calls after one warm-up, all ranks starting together.
// Until::all_ends: each call is timed until every rank of this host has finished it (a
// closing barrier on the host, not across hosts, whose latency would count), what ranks
// computing side by side take: on cores shared by more ranks than there are cores, a short
// call runs within one scheduler slice, and a rank's own clock would time it alone.
// (Communication synchronizes the ranks itself.)
enum class Until { own_end, all_ends };
template <class Fn>
double timed(int repeats, Fn fn, Until until = Until::own_end) {
  fn();
  std::vector<double> t;
  for (int r = 0; r < repeats; ++r) {
    check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
    const double start = now();
    fn();
    if (until == Until::all_ends) check_mpi(MPI_Barrier(g_host_ranks), "MPI_Barrier");
    t.push_back(now() - start);
  }
  return median(t);
}

// The slowest rank's median seconds of `fn` (all ranks of the world start together).
template <class Fn>
double slowest_timed(int repeats, Fn fn, Until until = Until::own_end) {
  double t = timed(repeats, fn, until);
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD),
            "MPI_Allreduce");
  return t;
}

// Calls a second of `once` (its work queued, then fenced), every rank at once as in the step:
// repeated about 20 ms a timing (rank 0's count, so that every rank runs as many), the slowest
// rank's median of 5 timings.
template <class Once>
double calls_per_second(Once&& once) {
  int calls = 1;
  auto run = [&] {
    for (int i = 0; i < calls; ++i) once();
    Kokkos::fence();
  };
  const double first = timed(1, run, Until::all_ends);
  calls = static_cast<int>(std::clamp(0.02 / std::max(first, 1e-9), 1.0, 1000.0));
  check_mpi(MPI_Bcast(&calls, 1, MPI_INT, 0, MPI_COMM_WORLD), "MPI_Bcast");
  return calls / slowest_timed(5, run, Until::all_ends);
}

// The three GEMMs of a layer's training step at [256 rows, 2048 -> 2048]: forward x @ W,
// weight gradient xᵀ @ dY (K = the rows) and input gradient dY @ Wᵀ, timed together: their
// FLOPs over their time (a short K runs slower than the square case).
double measure_gemm_flops() {
  const int64_t rows = 256, in = 2048, out = 2048;
  Matrix x("meshtrain::calibrate_x", rows, in), w("meshtrain::calibrate_w", in, out),
      y("meshtrain::calibrate_y", rows, out), dw("meshtrain::calibrate_dw", in, out),
      dx("meshtrain::calibrate_dx", rows, in);
  Kokkos::deep_copy(x, 0.5f);
  Kokkos::deep_copy(w, 0.25f);
  const double t = slowest_timed(
      5,
      [&] {
        gemm(plain(x), plain(w), 0.0f, y);
        gemm(transposed(x), plain(y), 0.0f, dw);
        gemm(plain(y), transposed(w), 0.0f, dx);
        Kokkos::fence();
      },
      Until::all_ends);
  return 3 * 2.0 * rows * in * out / t;
}

// The rate of each GEMM shape a config's step runs (partition/cost_model.hpp's
// step_gemm_shapes), every rank at once as in the step: the slowest rank's median of 5
// timings of about 20 ms of calls each.
std::vector<GemmRate> measure_gemm_rates(const std::vector<GemmShape>& shapes) {
  std::vector<GemmRate> rates;
  for (const GemmShape& g : shapes) {
    Matrix a("meshtrain::calibrate_gemm_a", g.transpose_a ? g.k : g.m, g.transpose_a ? g.m : g.k);
    Matrix b("meshtrain::calibrate_gemm_b", g.transpose_b ? g.n : g.k, g.transpose_b ? g.k : g.n);
    Matrix c("meshtrain::calibrate_gemm_c", g.m, g.n);
    Kokkos::deep_copy(a, 0.5f);
    Kokkos::deep_copy(b, 0.25f);
    const GemmOperand op_a{a, g.transpose_a}, op_b{b, g.transpose_b};
    rates.push_back({g, g.flops() * calls_per_second([&] { gemm(op_a, op_b, 0.0f, c); })});
  }
  return rates;
}

// The rate (elements/s) of each elementwise kernel the plan's step runs after its layers
// (LayerPlan::output_op: the model's activation, forward and backward, or SwiGLU), the real
// kernels of layers/activation.hpp on the step's largest [rows, out_local] block, every rank
// at once: the slowest rank's median of 5 timings of about 20 ms of calls each.
std::map<std::string, double> measure_elementwise_rates(const ShardingPlan& plan,
                                                        const ModelSection& model) {
  int64_t cols = 0;
  for (size_t i = 0; i + 1 < plan.layers.size(); ++i) {
    const LayerPlan& l = plan.layers[i];
    if (!l.moe && l.output_op != LayerOutputOp::none) cols = std::max(cols, l.layout.out_local);
  }
  std::map<std::string, double> rates;
  const int64_t rows = plan.local_batch_rows;
  if (cols <= 0 || rows <= 0 || (!model.swiglu && model.activation == Activation::none)) {
    return rates;
  }
  Matrix a("meshtrain::calibrate_elementwise_a", rows, cols);
  Matrix b("meshtrain::calibrate_elementwise_b", rows, cols);
  Matrix c("meshtrain::calibrate_elementwise_c", rows, cols);
  Matrix d("meshtrain::calibrate_elementwise_d", rows, cols);
  Matrix e("meshtrain::calibrate_elementwise_e", rows, cols);
  // Values around the pre-activations of a trained layer, both signs.
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::calibrate_elementwise_fill"),
      Kokkos::MDRangePolicy<Kokkos::Rank<2>>({0, 0}, {rows, cols}),
      KOKKOS_LAMBDA(const int64_t i, const int64_t j) {
        a(i, j) = 0.01f * static_cast<float>((i * 131 + j * 7) % 401 - 200);
        b(i, j) = 0.5f;
        c(i, j) = 0.25f;
      });
  const std::string name = model.activation_name();
  auto measure = [&](const std::string& kernel, auto&& once) {
    rates[kernel] = static_cast<double>(rows * cols) * calls_per_second(once);
  };
  if (model.swiglu) {
    measure("swiglu_forward", [&] { swiglu_forward(a, b, d); });
    // dY in c is read, the gradients written to d and e (dY stays as it is: rerunnable).
    measure("swiglu_backward", [&] { swiglu_backward(a, b, c, d, e); });
  } else {
    measure(name + "_forward", [&] { activation_forward(model.activation, a, d); });
    // In place on the gradient, so each call starts from a fresh copy of dY (repeated
    // products would shrink it into subnormals): timed with the copy, less the copy alone.
    measure("copy", [&] { Kokkos::deep_copy(d, c); });
    measure(name + "_backward", [&] {
      Kokkos::deep_copy(d, c);
      activation_backward(model.activation, a, d);
    });
    const double elements = static_cast<double>(rows * cols);
    const double both = elements / rates[name + "_backward"], copy = elements / rates["copy"];
    rates.erase("copy");
    rates[name + "_backward"] = elements / std::max(both - copy, 0.1 * both);
  }
  return rates;
}

// A DLRM's dot interaction (layers/dlrm.hpp) at the config's shape and this rank's rows:
// dlrm_dot_forward and dlrm_dot_backward in multiply-adds per second (rows x pairs x d; twice
// that backward), every rank at once, the slowest rank's median of 5 timings of about 20 ms.
std::map<std::string, double> measure_dlrm_dot_rates(const DlrmShape& shape, int64_t rows) {
  std::map<std::string, double> rates;
  if (shape.interaction != DlrmInteraction::dot || rows <= 0) return rates;
  const int64_t d = shape.bottom.back();
  const auto blocks = static_cast<int64_t>(shape.tables.size()) + 1;
  const int64_t width = dlrm_interaction_width(shape), pairs = width - d;
  Matrix features("meshtrain::calibrate_dlrm_features", rows, blocks * d);
  Matrix out("meshtrain::calibrate_dlrm_out", rows, width);
  Matrix grads("meshtrain::calibrate_dlrm_grads", rows, blocks * d);
  Kokkos::parallel_for(
      MESHTRAIN_LABEL("meshtrain::calibrate_dlrm_fill"),
      Kokkos::MDRangePolicy<Kokkos::Rank<2>>({0, 0}, {rows, blocks * d}),
      KOKKOS_LAMBDA(const int64_t i, const int64_t j) {
        features(i, j) = 0.01f * static_cast<float>((i * 131 + j * 7) % 401 - 200);
      });
  Kokkos::deep_copy(out, 0.5f);
  const double multiply_adds = static_cast<double>(rows * pairs * d);
  auto measure = [&](const std::string& kernel, double elements, auto&& once) {
    rates[kernel] = elements * calls_per_second(once);
  };
  // The forward writes `out`; the backward reads it as the gradient (values near 0.5) and
  // writes `grads` whole, so every call is the same work.
  measure("dlrm_dot_backward", 2.0 * multiply_adds,
          [&] { dlrm_dot_interaction_backward(features, out, grads, d, blocks); });
  measure("dlrm_dot_forward", multiply_adds,
          [&] { dlrm_dot_interaction(features, out, d, blocks); });
  return rates;
}

double measure_memory_bandwidth() {
  const int64_t count = int64_t{16} << 20;  // 64 MiB per vector
  Vector a("meshtrain::calibrate_va", count), b("meshtrain::calibrate_vb", count),
      c("meshtrain::calibrate_vc", count);
  Kokkos::deep_copy(b, 1.0f);
  Kokkos::deep_copy(c, 2.0f);
  const double t = slowest_timed(
      5,
      [&] {
        Kokkos::parallel_for(
            MESHTRAIN_LABEL("meshtrain::calibrate_triad"), Kokkos::RangePolicy<>(0, count),
            KOKKOS_LAMBDA(const int64_t i) { a(i) = b(i) + 0.5f * c(i); });
        Kokkos::fence();
      },
      Until::all_ends);
  return 12.0 * count / t;
}

// Ping-pong between ranks 0 and 1 of `group` (the others wait): half the median round trip
// (the median, not the mean: a rank descheduled by another job on a shared core for a
// scheduler tick would otherwise add milliseconds to a microsecond figure).
double half_round_trip(MPI_Comm group, std::vector<char>& buffer, int bytes, int repeats) {
  int rank = 0;
  check_mpi(MPI_Comm_rank(group, &rank), "MPI_Comm_rank");
  const int count = checked_int(static_cast<size_t>(bytes), "ping-pong bytes");
  auto once = [&] {
    if (rank == 0) {
      check_mpi(MPI_Send(buffer.data(), count, MPI_BYTE, 1, 7, group), "MPI_Send");
      check_mpi(MPI_Recv(buffer.data(), count, MPI_BYTE, 1, 7, group, MPI_STATUS_IGNORE),
                "MPI_Recv");
    } else if (rank == 1) {
      check_mpi(MPI_Recv(buffer.data(), count, MPI_BYTE, 0, 7, group, MPI_STATUS_IGNORE),
                "MPI_Recv");
      check_mpi(MPI_Send(buffer.data(), count, MPI_BYTE, 0, 7, group), "MPI_Send");
    }
  };
  once();
  check_mpi(MPI_Barrier(group), "MPI_Barrier");
  std::vector<double> trips;
  for (int r = 0; r < repeats; ++r) {
    const double start = now();
    once();
    trips.push_back(now() - start);
  }
  const double t = median(trips) / 2;
  check_mpi(MPI_Barrier(group), "MPI_Barrier");
  double slowest = 0.0;  // rank 0's figure, the slowest group's
  check_mpi(MPI_Allreduce(&t, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD), "MPI_Allreduce");
  return slowest;
}

// What one axis' link does, for the profile and for [measured].
struct LinkMeasurement {
  LinkProfile link;
  double overlap = 1.0;  // of a ring hop beside GEMMs of about its length
  // What the latency came from: the ping-pong, an 8-byte hop alone, a GEMM, the GEMM then
  // the hop.
  double ping_pong_latency = 0.0, small_hop_s = 0.0, compute_s = 0.0, compute_hop_s = 0.0;
  // What collective_overhead came from: the mean call of a small all-to-all and of an 8-byte
  // all-reduce entered after each rank's own compute (overhead_compute_s, one GEMM).
  double overhead_all_to_all_s = 0.0, overhead_all_reduce_s = 0.0, overhead_compute_s = 0.0;
  int overhead_tries = 0;
  double hop_s = 0.0, gemms_s = 0.0, both_s = 0.0, all_gather_s = 0.0, reduce_scatter_s = 0.0,
         all_reduce_s = 0.0, bidirectional_s = 0.0, small_all_reduce_s = 0.0;
  int gemms = 0;
  ReductionTimings reductions;  // the library's and the ring's at a few sizes
};

// Every rank runs `gemms` times x @ W [256 x 2048 x 2048] (calibrate's forward GEMM).
struct GemmLoad {
  Matrix x{"meshtrain::calibrate_ox", 256, 2048}, w{"meshtrain::calibrate_ow", 2048, 2048},
      y{"meshtrain::calibrate_oy", 256, 2048};
  GemmLoad() {
    Kokkos::deep_copy(x, 0.5f);
    Kokkos::deep_copy(w, 0.25f);
  }
  void run(int gemms) {
    for (int i = 0; i < gemms; ++i) gemm(plain(x), plain(w), 0.0f, y);
    Kokkos::fence();
  }
};

LinkMeasurement measure_link(const Mesh& mesh, MeshCommunicators& comms, const std::string& axis,
                             int world_rank, GemmLoad& load) {
  const int p = mesh.axis_size(axis);
  MPI_Comm group = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split(MPI_COMM_WORLD, mesh.group_color(world_rank, {axis}),
                           mesh.group_index(world_rank, {axis}), &group),
            "MPI_Comm_split");
  const int big = 8 << 20;
  std::vector<char> buffer(static_cast<size_t>(big), 1);
  LinkMeasurement m;
  LinkProfile& link = m.link;
  link.latency = half_round_trip(group, buffer, 8, 100);
  const double t_big = half_round_trip(group, buffer, big, 5);
  link.bandwidth = big / std::max(t_big - link.latency, 1e-9);
  check_mpi(MPI_Comm_free(&group), "MPI_Comm_free");

  Communicator& comm = comms.get({axis});
  // Latency as a step sees it: an 8-byte ring hop right after every rank computed (a GEMM
  // of a few ms), less the GEMM alone. On cores shared by more ranks than cores this is the
  // wait for the neighbour to be scheduled (milliseconds), far above the ping-pong's.
  {
    Matrix x("meshtrain::calibrate_sync_x", 128, 1024),
        w("meshtrain::calibrate_sync_w", 1024, 1024), y("meshtrain::calibrate_sync_y", 128, 1024);
    Kokkos::deep_copy(x, 0.5f);
    Kokkos::deep_copy(w, 0.25f);
    Vector token("meshtrain::calibrate_token", 2), token_in("meshtrain::calibrate_token_in", 2);
    auto compute = [&] {
      gemm(plain(x), plain(w), 0.0f, y);
      Kokkos::fence();
    };
    m.compute_s = slowest_timed(21, compute, Until::all_ends);
    m.compute_hop_s = slowest_timed(
        21,
        [&] {
          compute();
          comm.shift(ConstVectorView(token.data(), 2), VectorView(token_in.data(), 2), +1).wait();
        },
        Until::all_ends);
    m.ping_pong_latency = link.latency;
    m.small_hop_s = slowest_timed(51, [&] {
      comm.shift(ConstVectorView(token.data(), 2), VectorView(token_in.data(), 2), +1).wait();
    });
    link.latency = std::max(link.latency, m.compute_hop_s - m.compute_s);
  }
  // What a small collective costs a step (collective_overhead): every rank runs a GEMM of
  // about the compute between two of a loaded DLRM step's collectives (x [128 x 512] @ W [512 x
  // 512], 67 MFLOP: 0.45-0.7 ms at load 11-16 here), then
  // enters a small collective, and again, with no barrier between tries: each rank arrives
  // after its own compute, and a rank the scheduler delayed makes the others wait, as in a
  // step. Only the call is timed (what a trace's collective span holds), alternating an
  // all-to-all of 256 floats to each rank (all_to_all_v, as a DLRM's row-wise tables run it)
  // and an 8-byte all-reduce, kOverheadTries of each. The key: the mean over both kinds, the
  // tries and the ranks (a step pays the mean, spikes included), at least the latency.
  {
    constexpr int kOverheadTries = 200;
    constexpr int64_t kFloatsPerRank = 256;
    Matrix x("meshtrain::calibrate_overhead_x", 128, 512),
        w("meshtrain::calibrate_overhead_w", 512, 512),
        y("meshtrain::calibrate_overhead_y", 128, 512);
    Kokkos::deep_copy(x, 0.5f);
    Kokkos::deep_copy(w, 0.25f);
    Matrix send("meshtrain::calibrate_overhead_send", p * kFloatsPerRank, 1),
        recv("meshtrain::calibrate_overhead_recv", p * kFloatsPerRank, 1);
    Kokkos::deep_copy(send, 1.0f);
    Vector token("meshtrain::calibrate_overhead_token", 2);
    Kokkos::deep_copy(token, 1.0f);
    const std::vector<int64_t> rows(static_cast<size_t>(p), kFloatsPerRank);
    auto compute = [&] {
      gemm(plain(x), plain(w), 0.0f, y);
      Kokkos::fence();
    };
    compute();
    comm.all_to_all_v(send, rows, recv, rows);  // warm-up
    comm.barrier();
    double a2a = 0.0, ar = 0.0, busy = 0.0;
    for (int t = 0; t < kOverheadTries; ++t) {
      double start = now();
      compute();
      double end = now();
      busy += end - start;
      comm.all_to_all_v(send, rows, recv, rows);
      start = now();
      a2a += start - end;
      compute();
      end = now();
      busy += end - start;
      comm.all_reduce(VectorView(token.data(), 2));
      ar += now() - end;
    }
    // Every group of the axis measured at once: the mean over all ranks.
    double sums[3] = {a2a, ar, busy};
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, sums, 3, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD),
              "MPI_Allreduce");
    int world = 1;
    check_mpi(MPI_Comm_size(MPI_COMM_WORLD, &world), "MPI_Comm_size");
    const double calls = static_cast<double>(kOverheadTries) * world;
    m.overhead_tries = kOverheadTries;
    m.overhead_all_to_all_s = sums[0] / calls;
    m.overhead_all_reduce_s = sums[1] / calls;
    m.overhead_compute_s = sums[2] / (2 * calls);
    link.collective_overhead =
        std::max(link.latency, 0.5 * (m.overhead_all_to_all_s + m.overhead_all_reduce_s));
  }
  // A ring hop: every rank sends 8 MiB to its next neighbour and receives 8 MiB from its
  // previous one at once (Communicator::shift, as the ring collective matmuls do).
  const size_t block = static_cast<size_t>(big) / sizeof(float);
  Vector send("meshtrain::calibrate_send", block), recv("meshtrain::calibrate_recv", block),
      recv2("meshtrain::calibrate_recv2", block);
  Kokkos::deep_copy(send, 1.0f);
  auto hop = [&] {
    comm.shift(ConstVectorView(send.data(), block), VectorView(recv.data(), block), +1).wait();
  };
  m.hop_s = slowest_timed(5, hop);
  link.exchange_bandwidth = big / std::max(m.hop_s - link.latency, 1e-9);
  // A bidirectional hop: the two halves at once, one each way round the ring.
  const size_t half = block / 2;
  const double t_bidir = m.bidirectional_s = slowest_timed(5, [&] {
    Request lo = comm.shift(ConstVectorView(send.data(), half), VectorView(recv.data(), half), +1);
    Request hi = comm.shift(ConstVectorView(send.data() + half, block - half),
                            VectorView(recv2.data(), block - half), -1);
    lo.wait();
    hi.wait();
  });
  link.bidirectional_bandwidth = big / std::max(t_bidir - link.latency, 1e-9);

  // Collectives of a 16 MiB full operand (a [2048, 2048] weight): all-gather and
  // reduce-scatter, (p-1)/p * bytes / (time - (p-1) latency); and an all-reduce, reported.
  const size_t full = size_t{4} << 20;
  const size_t chunk = full / static_cast<size_t>(p);
  Vector data("meshtrain::calibrate_collective", full), part("meshtrain::calibrate_part", chunk);
  Kokkos::deep_copy(data, 1.0f);
  Kokkos::deep_copy(part, 1.0f);
  const double t_ag = m.all_gather_s = slowest_timed(5, [&] {
    comm.all_gather(ConstVectorView(part.data(), chunk), VectorView(data.data(), chunk * p));
  });
  const double t_rs = m.reduce_scatter_s = slowest_timed(5, [&] {
    comm.reduce_scatter(ConstVectorView(data.data(), chunk * p), VectorView(part.data(), chunk));
  });
  const double moved = (p - 1.0) / p * static_cast<double>(chunk * p * sizeof(float));
  link.collective_bandwidth = moved / std::max(t_ag - (p - 1) * link.latency, 1e-9);
  link.reduce_scatter_bandwidth = moved / std::max(t_rs - (p - 1) * link.latency, 1e-9);
  m.small_all_reduce_s = slowest_timed(51, [&] { comm.all_reduce(VectorView(data.data(), 2)); });
  const double t_ar = m.all_reduce_s =
      slowest_timed(5, [&] { comm.all_reduce(VectorView(data.data(), full)); });
  link.all_reduce_bandwidth = 2.0 * moved / std::max(t_ar - 2.0 * (p - 1) * link.latency, 1e-9);
  // meshtrain's ring against the library at a few sizes (bytes each rank sends; the last is
  // the 16 MiB above): its rates at 16 MiB by the same formulas, and the size from which it
  // is faster ([runtime] reductions = "auto").
  m.reductions =
      time_reductions(comm, {std::size_t{64} << 10, std::size_t{1} << 20, full * sizeof(float)}, 3);
  const ReductionTimings& r = m.reductions;
  link.ring_reduce_scatter_bandwidth =
      moved / std::max(r.ring_reduce_scatter.back() - (p - 1) * link.latency, 1e-9);
  link.ring_all_reduce_bandwidth =
      2.0 * moved / std::max(r.ring_all_reduce.back() - 2.0 * (p - 1) * link.latency, 1e-9);
  const ReductionChoice faster = choice_from_timings(r);
  auto from = [](std::size_t bytes) {
    return bytes == ReductionChoice::kNever ? std::numeric_limits<double>::infinity()
                                            : static_cast<double>(bytes);
  };
  link.ring_reduce_scatter_from = from(faster.reduce_scatter_ring_from);
  link.ring_all_reduce_from = from(faster.all_reduce_ring_from);

  // Overlap: the hop alone, k GEMMs of about the hop's length alone, and the hop started
  // before the GEMMs and waited for after them: e = (gemms + hop - both) / min(gemms, hop).
  const double one_gemm = slowest_timed(5, [&] { load.run(1); });
  double k = std::round(m.hop_s / std::max(one_gemm, 1e-9));
  m.gemms = static_cast<int>(std::min(64.0, std::max(1.0, k)));
  check_mpi(MPI_Bcast(&m.gemms, 1, MPI_INT, 0, MPI_COMM_WORLD), "MPI_Bcast");
  m.gemms_s = slowest_timed(5, [&] { load.run(m.gemms); });
  m.both_s = slowest_timed(5, [&] {
    Request moving =
        comm.shift(ConstVectorView(send.data(), block), VectorView(recv.data(), block), +1);
    load.run(m.gemms);
    moving.wait();
  });
  const double hideable = std::min(m.gemms_s, m.hop_s);
  m.overlap = std::clamp((m.gemms_s + m.hop_s - m.both_s) / std::max(hideable, 1e-9), 0.0, 1.0);
  return m;
}

// A DLRM config's data read (run/dlrm_read_timing.hpp) on its own training file at this
// rank's rows of a batch: every rank measures at once (as the step's ranks read); the figures
// are the slowest rank's (the most dense and sparse time; the step's ids' agreement waits for
// it), its times and its ids together.
void measure_data_read(const RunConfig& config, int64_t rows, int world, HardwareProfile& profile,
                       std::ostringstream& measured) {
  if (rows <= 0) rows = std::max<int64_t>(config.data.batch_size / std::max(world, 1), 1);
  // Collective, its errors agreed inside (the same AgreedError on every rank).
  DlrmReadTiming t = measure_dlrm_read(config, rows, MPI_COMM_WORLD, 20, &now);
  struct {
    double seconds;
    int rank;
  } slowest_rank{t.dense_s + t.sparse_s, 0};
  check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &slowest_rank.rank), "MPI_Comm_rank");
  check_mpi(
      MPI_Allreduce(MPI_IN_PLACE, &slowest_rank, 1, MPI_DOUBLE_INT, MPI_MAXLOC, MPI_COMM_WORLD),
      "MPI_Allreduce");
  std::vector<double> figures = {t.dense_s, t.sparse_s, t.ids_per_batch};
  figures.insert(figures.end(), t.table_s.begin(), t.table_s.end());
  figures.insert(figures.end(), t.table_ids.begin(), t.table_ids.end());
  check_mpi(MPI_Bcast(figures.data(), static_cast<int>(figures.size()), MPI_DOUBLE,
                      slowest_rank.rank, MPI_COMM_WORLD),
            "MPI_Bcast");
  // How far the slowest rank's dense read of a batch runs past the ranks' mean (every rank reads
  // at once, as in the step, where the first collective after the read waits for the slowest):
  // the mean over the batches. Recorded, not charged (docs/recsys.md, the share's section).
  std::vector<double> slowest = t.dense_batches, sum = t.dense_batches;
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, slowest.data(), static_cast<int>(slowest.size()),
                          MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD),
            "MPI_Allreduce");
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, sum.data(), static_cast<int>(sum.size()), MPI_DOUBLE,
                          MPI_SUM, MPI_COMM_WORLD),
            "MPI_Allreduce");
  double spread = 0.0;
  for (size_t b = 0; b < slowest.size(); ++b) {
    spread += (slowest[b] - sum[b] / world) / static_cast<double>(slowest.size());
  }
  const size_t k = t.table_s.size();
  t.dense_s = figures[0];
  t.sparse_s = figures[1];
  t.ids_per_batch = figures[2];
  std::copy(figures.begin() + 3, figures.begin() + 3 + k, t.table_s.begin());
  std::copy(figures.begin() + 3 + k, figures.end(), t.table_ids.begin());
  derive_dlrm_read_figures(t);
  profile.hdf5_row_seconds = t.hdf5_row_seconds;
  profile.sparse_row_seconds = t.sparse_row_seconds;
  profile.sparse_id_seconds = t.sparse_id_seconds;
  std::ostringstream line;  // any data.path, TOML-escaped
  line << std::setprecision(4) << t.file << ": " << t.rows << " rows a batch (data.shuffle "
       << t.shuffle << ", in file order), " << t.batches << " batches, rank " << slowest_rank.rank
       << "'s medians (the slowest): dense rows " << t.dense_s << " s, sparse reader " << t.sparse_s
       << " s (" << t.tables << " tables, " << std::setprecision(0) << std::fixed << t.ids_per_batch
       << " ids), each table alone " << std::defaultfloat << std::setprecision(4)
       << *std::min_element(t.table_s.begin(), t.table_s.end()) << " to "
       << *std::max_element(t.table_s.begin(), t.table_s.end()) << " s (" << std::fixed
       << std::setprecision(0) << *std::min_element(t.table_ids.begin(), t.table_ids.end())
       << " to " << *std::max_element(t.table_ids.begin(), t.table_ids.end()) << " ids)";
  measured << "data_read = " << toml_string_value(line.str()) << "\n";
  char spread_line[256];
  std::snprintf(spread_line, sizeof spread_line,
                "data_read_spread = %.4g  # s the slowest rank's dense read of a batch ran past "
                "the ranks' mean (mean over the batches; not charged)\n",
                spread);
  measured << spread_line;
}

std::string host_name() {
  char name[256] = {};
  gethostname(name, sizeof name - 1);
  return name;
}

}  // namespace

int calibrate_command(const std::string& config_path, const std::vector<std::string>& overrides,
                      const std::string& out_path, const std::string& clock) {
  if (clock != "wall" && clock != "cpu") {
    MESHTRAIN_BAD_INPUT("calibrate --clock must be wall or cpu, not '", clock, "'");
  }
  g_cpu_clock = clock == "cpu";
  check_mpi(
      MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &g_host_ranks),
      "MPI_Comm_split_type");
  struct FreeHostRanks {
    ~FreeHostRanks() { MPI_Comm_free(&g_host_ranks); }  // on every return and throw
  } free_host_ranks;
  int rank = 0, world = 1;
  check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &rank), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(MPI_COMM_WORLD, &world), "MPI_Comm_size");
  std::optional<Mesh> mesh;
  std::optional<ShardingPlan> plan;  // CONFIG's, when its global batch divides
  // CONFIG's [runtime] comm_thread as a training run resolves it: the overlap measured (a hop
  // started before GEMMs) is then the one the communication thread gives.
  std::optional<CommThreadLease> comm_thread;
  CommThreadChoice thread_choice = CommThreadChoice::off;
  bool overlap = false;
  std::optional<ModelSection> model;
  std::optional<RunConfig> dlrm;  // CONFIG when kind = "dlrm" (its data read is measured)
  if (auto error = run_agreed(MPI_COMM_WORLD, [&] {
        if (config_path.empty()) {
          mesh = Mesh::create({{"dp", -1}}, world, "calibrate (dp = the world)");
        } else {
          const RunConfig config = load_config(config_path, overrides);
          if (config.model.kind == ModelKind::dlrm) dlrm = config;
          mesh = config.mesh.resolve(world);
          plan = make_plan(model_parameter_shapes(config.model), *mesh, partition_rules(config),
                           plan_options(config), model_linear_layers(config.model));
          model = config.model;
          if (plan->local_batch_rows <= 0) plan.reset();
          if (config.runtime.backend != CommBackendChoice::nccl) {
            thread_choice = config.runtime.comm_thread;
            overlap = config.runtime.overlap;
          }
        }
      })) {
    throw *error;
  }
  std::string note;
  bool thread = false;  // decided by every rank (collective), failures agreed on
  if (auto error = run_agreed(MPI_COMM_WORLD, [&] {
        thread = want_comm_thread(thread_choice, overlap, MPI_COMM_WORLD,
                                  config_path + ": runtime.comm_thread", note);
      })) {
    throw *error;
  }
  if (thread) comm_thread.emplace();
  if (!note.empty() && rank == 0) std::fprintf(stderr, "meshtrain calibrate: %s\n", note.c_str());
  HardwareProfile profile = default_hardware_profile();
  profile.source = out_path.empty() ? "calibrate" : out_path;
  profile.gemm_flops = measure_gemm_flops();
  if (plan) profile.gemm_rates = measure_gemm_rates(step_gemm_shapes(*plan));
  if (plan) profile.elementwise_rates = measure_elementwise_rates(*plan, *model);
  if (dlrm) {
    for (const auto& [kernel, rate] :
         measure_dlrm_dot_rates(dlrm->model.dlrm(), plan->local_batch_rows)) {
      profile.elementwise_rates[kernel] = rate;
    }
  }
  profile.memory_bandwidth = measure_memory_bandwidth();
  std::ostringstream measured;
  if (dlrm) measure_data_read(*dlrm, plan->local_batch_rows, world, profile, measured);
  measured
      << "clock = \"" << clock << "\"\nranks = " << world << "\nmesh = \""
      << mesh->short_description() << "\"\nhost = \"" << host_name() << "\"\n"
      << "comm_thread = " << (thread ? "true" : "false")
      << "  # was the communication thread on (runtime.comm_thread) while overlap was measured\n";
  std::vector<std::string> measured_axes;
  {
    MeshCommunicators comms(*mesh);
    GemmLoad load;
    for (const auto& a : mesh->axes()) {
      if (a.size < 2) continue;
      const LinkMeasurement m = measure_link(*mesh, comms, a.name, rank, load);
      profile.links[a.name] = m.link;
      // The least overlap of any axis: a step's transfers run on all of them.
      profile.overlap = measured_axes.empty() ? m.overlap : std::min(profile.overlap, m.overlap);
      measured_axes.push_back(a.name);
      char line[1024];
      std::snprintf(line, sizeof line,
                    "%s_collective_overhead = \"after a %.4g s GEMM on every rank (%d tries "
                    "each): all-to-all of 1 KiB per rank %.4g s, 8-byte all-reduce %.4g s "
                    "(means)\"\n",
                    a.name.c_str(), m.overhead_compute_s, m.overhead_tries, m.overhead_all_to_all_s,
                    m.overhead_all_reduce_s);
      measured << line;
      std::snprintf(line, sizeof line,
                    "%s_latency = \"ping-pong %.4g s; 8-byte hop %.4g s; GEMM %.4g s, GEMM then "
                    "8-byte hop %.4g s\"\n"
                    "%s_overlap = %.3f  # 8 MiB hop %.4g s, %d GEMMs %.4g s, both %.4g s\n"
                    "%s_seconds = \"hop %.4g, bidirectional hop %.4g, all-gather %.4g, "
                    "reduce-scatter %.4g, all-reduce %.4g, 8-byte all-reduce %.4g\"\n",
                    a.name.c_str(), m.ping_pong_latency, m.small_hop_s, m.compute_s,
                    m.compute_hop_s, a.name.c_str(), m.overlap, m.hop_s, m.gemms, m.gemms_s,
                    m.both_s, a.name.c_str(), m.hop_s, m.bidirectional_s, m.all_gather_s,
                    m.reduce_scatter_s, m.all_reduce_s, m.small_all_reduce_s);
      measured << line;
      const ReductionTimings& r = m.reductions;
      for (std::size_t i = 0; i < r.bytes.size(); ++i) {
        std::snprintf(line, sizeof line,
                      "%s_reductions_%zu_bytes = \"reduce-scatter library %.4g s, ring %.4g s; "
                      "all-reduce library %.4g s, ring %.4g s\"\n",
                      a.name.c_str(), r.bytes[i], r.library_reduce_scatter[i],
                      r.ring_reduce_scatter[i], r.library_all_reduce[i], r.ring_all_reduce[i]);
        measured << line;
      }
    }
  }
  if (!measured_axes.empty()) {
    // Axes the mesh does not split: the slowest measured link.
    const LinkProfile slowest = profile.group_link(measured_axes);
    std::vector<std::string> copied;
    for (const auto& axis : hardware_axes()) {
      if (std::find(measured_axes.begin(), measured_axes.end(), axis) != measured_axes.end()) {
        continue;
      }
      profile.links[axis] = slowest;
      copied.push_back(axis);
    }
    measured << "links_measured = \"" << join(measured_axes) << "\"\nlinks_copied_from_slowest = \""
             << join(copied) << "\"\n";
  } else {
    measured << "links_measured = \"\"  # one rank: every link is the default\n";
  }
  if (rank == 0) {
    const std::string text = hardware_profile_to_toml(profile, measured.str());
    parse_hardware_profile(text, profile.source);  // what plan will read back
    if (out_path.empty()) {
      std::cout << text;
      std::cout.flush();
    } else {
      std::ofstream out(out_path);
      out << text;
      out.close();
      if (!out) MESHTRAIN_BAD_INPUT("cannot write the hardware profile to '", out_path, "'");
      std::printf("meshtrain calibrate: wrote %s (%d ranks, mesh %s)\n", out_path.c_str(), world,
                  mesh->short_description().c_str());
    }
  }
  return 0;
}

}  // namespace meshtrain
