#pragma once
// What every export format reads from a checkpoint (docs/export.md): the config stored in it,
// its parameters whole (every dataset's CRC-32 checked) and its normalization statistics
// (framework/io/normalization.hpp), checked against each other. No MPI: a checkpoint holds the
// gathered model whatever mesh saved it, so an export does not depend on the mesh.

#include <map>
#include <string>

#include "framework/io/checkpoint.hpp"
#include "framework/io/normalization.hpp"
#include "framework/train/config.hpp"

namespace meshtrain {

struct ExportSource {
  std::string path;  // the checkpoint file read (a directory or pointer resolved)
  CheckpointInfo info;
  RunConfig config;                               // parsed from info.config_text
  std::map<std::string, CheckpointArray> params;  // by name ("layers/0/weight")
  Normalization normalization;
};

// Reads `checkpoint` (a file, a latest/best pointer file or a checkpoint directory). Throws
// bad_input naming the file, dataset or key when it cannot be read, a checksum fails, its
// config is not one export understands (a model.kind other than mlp, residual_mlp and dlrm, a
// model.loss left to "auto"), its parameters are not exactly its config's model's (missing,
// extra, other shape), or its statistics do not fit the model (a dlrm has none).
ExportSource read_export_source(const std::string& checkpoint);

}  // namespace meshtrain
