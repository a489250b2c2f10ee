// A program one of whose ranks fails while the others wait for it; the job must end at once
// with that rank's message and exit status, never leave the others hanging. Driven by
// expect_abort.sh. Modes (the first argument):
//   run      rank 1 throws bad input inside run_or_abort while rank 0 waits in a barrier
//   startup  rank 1 fails while its Runtime starts (as a rank without a usable GPU does),
//            after MPI_Init, while rank 0 has started and waits in a barrier

#include <string>

#include "framework/comm/exit_policy.hpp"

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "run";
  const auto fail_on_rank_1 = [&](int world_rank) {
    if (mode == "startup" && world_rank == 1) {
      MESHTRAIN_FAIL("no usable GPU on this rank (test)");
    }
  };
  const auto runtime = meshtrain::start_runtime_or_abort(argc, argv, fail_on_rank_1);
  return meshtrain::run_or_abort([&] {
    if (mode == "run" && runtime->world_rank() == 1) {
      MESHTRAIN_BAD_INPUT("config key 'mesh.tp' = 3 does not divide the world (test)");
    }
    runtime->world().barrier();  // the other ranks wait here for rank 1, which never comes
    return 0;
  });
}
