// A program whose rank 1 fails while the others wait in a collective: run_or_abort must end
// the whole job with the error's exit status (2 for bad input) instead of leaving the
// waiting ranks hanging. Driven by expect_abort.sh.

#include "framework/comm/exit_policy.hpp"
#include "framework/comm/runtime.hpp"

int main(int argc, char** argv) {
  meshtrain::Runtime runtime(argc, argv);
  return meshtrain::run_or_abort([&] {
    if (runtime.world_rank() == 1) {
      MESHTRAIN_BAD_INPUT("config key 'mesh.tp' = 3 does not divide the world (test)");
    }
    runtime.world().barrier();  // the other ranks wait here for rank 1, which never comes
    return 0;
  });
}
