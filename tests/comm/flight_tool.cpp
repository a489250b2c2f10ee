// The flight recorder under faults, driven by flight_fault_test.sh (framework/comm/
// flight_recorder.hpp). Usage:
//   flight_tool run FAULT RANK K DIR   collectives 1, 2, ... alternate between an all_reduce on
//                                      the world (odd) and an all_gather on the tp axis of a
//                                      (dp, tp=2) mesh (even); rank RANK meets FAULT before
//                                      collective K: stop (SIGSTOP, then hangs when continued),
//                                      kill (SIGKILL), skip (it
//                                      goes on with collective K+1), none. The recorder writes
//                                      to DIR/flight/. Ends every rank with the error of a
//                                      timeout (MESHTRAIN_COLLECTIVE_TIMEOUT) through
//                                      run_or_abort, as the meshtrain command does.
//   flight_tool grid FAULT RANK K DIR  the same on a 2-D (fsdp, tp=2) mesh: collectives alternate
//                                      between an all_gather on the fsdp axis (odd) and one on
//                                      the tp axis (even), so the partners of a stopped rank on
//                                      one axis wait on it directly and the ranks of the next
//                                      collective on the other axis wait on those (a wait chain).
//   flight_tool report DIR             prints what the records in DIR/flight say
//                                      (find_stuck_collectives, then find_hang_roots), one
//                                      finding a line.

#include <signal.h>
#include <unistd.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "framework/comm/exit_policy.hpp"
#include "framework/comm/mesh_communicators.hpp"
#include "framework/observe/flight_recorder.hpp"
#include "framework/observe/flight_report.hpp"
#include "partition/mesh.hpp"

namespace {

int report(const std::string& dir) {
  const auto records = meshtrain::read_flight_records(dir + "/flight");
  std::printf("%zu flight records in %s/flight\n", records.size(), dir.c_str());
  for (const auto& finding : meshtrain::find_stuck_collectives(records)) {
    std::printf("%s\n", finding.sentence().c_str());
  }
  const std::string roots = meshtrain::find_hang_roots(records).sentence();
  if (!roots.empty()) std::printf("%s\n", roots.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "report" && argc == 3) {
    try {
      return report(argv[2]);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "flight_tool: %s\n", e.what());
      return 2;
    }
  }
  if ((mode != "run" && mode != "grid") || argc != 6) {
    std::fprintf(stderr,
                 "usage: flight_tool run|grid stop|kill|skip|none RANK K DIR | report DIR\n");
    return 2;
  }
  const bool grid = mode == "grid";
  const std::string fault = argv[2];
  const int fault_rank = std::atoi(argv[3]);
  const int fault_at = std::atoi(argv[4]);
  const std::string dir = argv[5];
  const auto runtime = meshtrain::start_runtime_or_abort(argc, argv);
  return meshtrain::run_or_abort([&] {
    const int rank = runtime->world_rank(), size = runtime->world_size();
    meshtrain::flight_recorder().configure(64, dir, rank, size);
    const meshtrain::Mesh mesh =
        meshtrain::Mesh::create({{grid ? "fsdp" : "dp", -1}, {"tp", size >= 2 ? 2 : 1}}, size);
    meshtrain::MeshCommunicators comms(mesh);
    meshtrain::Communicator& odd = grid ? comms.get({"fsdp"}) : runtime->world();
    meshtrain::Communicator& tp = comms.get({"tp"});
    Kokkos::View<float*, Kokkos::LayoutRight> data("flight_tool::data", 16);
    Kokkos::View<float*, Kokkos::LayoutRight> gathered(
        "flight_tool::gathered", 16 * static_cast<std::size_t>(std::max(tp.size(), odd.size())));
    const int collectives = fault_at + 3;
    for (int k = 1; k <= collectives; ++k) {
      if (k == fault_at && rank == fault_rank) {
        if (fault == "stop") {
          // Stopped, then hung outside any collective once continued (mpirun sends SIGCONT
          // before SIGTERM when it ends the job): a rank that makes no progress.
          raise(SIGSTOP);
          for (;;) pause();
        }
        if (fault == "kill") raise(SIGKILL);
        if (fault == "skip") continue;
      }
      if (k % 2 == 1 && grid) {
        odd.all_gather(meshtrain::ConstVectorView(data.data(), data.extent(0)),
                       meshtrain::VectorView(gathered.data(), 16 * odd.size()));
      } else if (k % 2 == 1) {
        odd.all_reduce(data);
      } else {
        tp.all_gather(meshtrain::ConstVectorView(data.data(), data.extent(0)),
                      meshtrain::VectorView(gathered.data(), 16 * tp.size()));
      }
    }
    std::printf("rank %d: %d collectives done\n", rank, collectives);
    return 0;
  });
}
