#include "apps/calibrate.hpp"

#include <mpi.h>
#include <unistd.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include "apps/exit_policy.hpp"
#include "framework/comm/failure_agreement.hpp"
#include "framework/comm/mesh_communicators.hpp"
#include "framework/comm/mpi_util.hpp"
#include "framework/core/gemm.hpp"
#include "framework/core/kernel_label.hpp"
#include "framework/train/config.hpp"
#include "framework/train/hardware_file.hpp"
#include "partition/error.hpp"

namespace meshtrain {
namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The smallest of `value` over the ranks: the slowest rank sets a step's pace.
double min_over_ranks(double value) {
  double out = 0.0;
  check_mpi(MPI_Allreduce(&value, &out, 1, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD), "MPI_Allreduce");
  return out;
}

// Median seconds of `fn` over `repeats` calls after one warm-up, all ranks starting together.
template <class Fn>
double timed(int repeats, Fn fn, MPI_Comm comm = MPI_COMM_WORLD) {
  fn();
  std::vector<double> t;
  for (int r = 0; r < repeats; ++r) {
    check_mpi(MPI_Barrier(comm), "MPI_Barrier");
    const double start = MPI_Wtime();
    fn();
    t.push_back(MPI_Wtime() - start);
  }
  return median(t);
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
  const double t = timed(5, [&] {
    gemm(plain(x), plain(w), 0.0f, y);
    gemm(transposed(x), plain(y), 0.0f, dw);
    gemm(plain(y), transposed(w), 0.0f, dx);
    Kokkos::fence();
  });
  return min_over_ranks(3 * 2.0 * rows * in * out / t);
}

double measure_memory_bandwidth() {
  const int64_t count = int64_t{16} << 20;  // 64 MiB per vector
  Vector a("meshtrain::calibrate_va", count), b("meshtrain::calibrate_vb", count),
      c("meshtrain::calibrate_vc", count);
  Kokkos::deep_copy(b, 1.0f);
  Kokkos::deep_copy(c, 2.0f);
  const double t = timed(5, [&] {
    Kokkos::parallel_for(
        MESHTRAIN_LABEL("meshtrain::calibrate_triad"), Kokkos::RangePolicy<>(0, count),
        KOKKOS_LAMBDA(const int64_t i) { a(i) = b(i) + 0.5f * c(i); });
    Kokkos::fence();
  });
  return min_over_ranks(12.0 * count / t);
}

// Ping-pong between ranks 0 and 1 of `group` (the others wait): half a round trip.
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
  const double start = MPI_Wtime();
  for (int r = 0; r < repeats; ++r) once();
  const double t = (MPI_Wtime() - start) / repeats / 2;
  check_mpi(MPI_Barrier(group), "MPI_Barrier");
  double slowest = 0.0;  // rank 0's figure, the slowest group's
  check_mpi(MPI_Allreduce(&t, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD), "MPI_Allreduce");
  return slowest;
}

LinkProfile measure_link(const Mesh& mesh, MeshCommunicators& comms, const std::string& axis,
                         int world_rank) {
  const int p = mesh.axis_size(axis);
  MPI_Comm group = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split(MPI_COMM_WORLD, mesh.group_color(world_rank, {axis}),
                           mesh.group_index(world_rank, {axis}), &group),
            "MPI_Comm_split");
  const int big = 8 << 20;
  std::vector<char> buffer(static_cast<size_t>(big), 1);
  LinkProfile link;
  link.latency = half_round_trip(group, buffer, 8, 100);
  const double t_big = half_round_trip(group, buffer, big, 5);
  link.bandwidth = big / std::max(t_big - link.latency, 1e-9);
  check_mpi(MPI_Comm_free(&group), "MPI_Comm_free");

  Communicator& comm = comms.get({axis});
  const size_t floats = static_cast<size_t>(big) / sizeof(float);
  Vector data("meshtrain::calibrate_allreduce", floats);
  Kokkos::deep_copy(data, 1.0f);
  double t = timed(5, [&] { comm.all_reduce(VectorView(data.data(), floats)); });
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD),
            "MPI_Allreduce");
  const double moved = 2.0 * (p - 1) / p * big;
  link.collective_bandwidth = moved / std::max(t - 2.0 * (p - 1) * link.latency, 1e-9);
  return link;
}

std::string host_name() {
  char name[256] = {};
  gethostname(name, sizeof name - 1);
  return name;
}

}  // namespace

int calibrate_command(const std::string& config_path, const std::vector<std::string>& overrides,
                      const std::string& out_path) {
  int rank = 0, world = 1;
  check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &rank), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(MPI_COMM_WORLD, &world), "MPI_Comm_size");
  std::optional<Mesh> mesh;
  if (auto error = run_agreed(MPI_COMM_WORLD, [&] {
        if (config_path.empty()) {
          mesh = Mesh::create({{"dp", -1}}, world, "calibrate (dp = the world)");
        } else {
          mesh = load_config(config_path, overrides).mesh.resolve(world);
        }
      })) {
    throw *error;
  }
  HardwareProfile profile = default_hardware_profile();
  profile.source = out_path.empty() ? "calibrate" : out_path;
  profile.gemm_flops = measure_gemm_flops();
  profile.memory_bandwidth = measure_memory_bandwidth();
  std::ostringstream measured;
  measured << "ranks = " << world << "\nmesh = \"" << mesh->short_description() << "\"\nhost = \""
           << host_name() << "\"\n";
  std::vector<std::string> measured_axes;
  {
    MeshCommunicators comms(*mesh);
    for (const auto& a : mesh->axes()) {
      if (a.size < 2) continue;
      profile.links[a.name] = measure_link(*mesh, comms, a.name, rank);
      measured_axes.push_back(a.name);
    }
  }
  if (!measured_axes.empty()) {
    // Axes the mesh does not split: the slowest measured link.
    const LinkProfile slowest = profile.group_link(measured_axes);
    std::string copied;
    for (const auto& axis : hardware_axes()) {
      if (std::find(measured_axes.begin(), measured_axes.end(), axis) != measured_axes.end()) {
        continue;
      }
      profile.links[axis] = slowest;
      copied += (copied.empty() ? "" : ", ") + axis;
    }
    measured << "links_measured = \"" <<
        [&] {
          std::string s;
          for (const auto& a : measured_axes) s += (s.empty() ? "" : ", ") + a;
          return s;
        }() << "\"\nlinks_copied_from_slowest = \""
             << copied << "\"\n";
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
