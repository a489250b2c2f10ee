#pragma once
// The mesh a command that serves a checkpoint (`meshtrain evaluate`, `meshtrain predict` of a
// DLRM) runs on: the checkpoint config's [mesh] (after --set), resolved on the command's ranks.

#include <string>

#include "framework/train/config.hpp"
#include "partition/mesh.hpp"

namespace meshtrain {

// `mesh` resolved on `world` ranks. A mesh that does not fit throws bad_input: the mesh's own
// sentence, then that `command_uses` (e.g. "evaluate uses") the checkpoint config's mesh and
// how to give it another (--set mesh.AXIS=SIZE: a checkpoint loads onto any mesh).
Mesh resolve_checkpoint_mesh(const MeshSection& mesh, int world, const std::string& command_uses);

}  // namespace meshtrain
