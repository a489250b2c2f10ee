#include "apps/checkpoint_mesh.hpp"

#include "base/error.hpp"

namespace meshtrain {

Mesh resolve_checkpoint_mesh(const MeshSection& mesh, int world, const std::string& command_uses) {
  try {
    return mesh.resolve(world);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::bad_input) throw;
    MESHTRAIN_BAD_INPUT(e.what(), "; ", command_uses,
                        " the checkpoint config's mesh: start it on that many ranks, or give it "
                        "another with --set mesh.AXIS=SIZE (a checkpoint loads onto any mesh)");
  }
}

}  // namespace meshtrain
