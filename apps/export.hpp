#pragma once
// `meshtrain export CHECKPOINT --format onnx --output FILE.onnx [--dtype fp32|fp16|bf16]
// [--overwrite]`: the checkpoint's model as one self-contained ONNX file
// (framework/export/onnx_export.hpp); `--format pytorch --output DIR`: DIR/model.py and
// DIR/model.safetensors, a PyTorch module and its weights (framework/export/pytorch_export.hpp).
// docs/export.md. No MPI: it reads the checkpoint serially.

#include <iosfwd>
#include <string>

namespace meshtrain {

struct ExportArgs {
  std::string checkpoint;
  std::string format;  // onnx | pytorch
  std::string output;  // the file (onnx) or the folder (pytorch)
  std::string dtype = "fp32";
  bool overwrite = false;
};

// Exports and prints one line saying what was written. Throws bad_input (naming the value)
// for an unknown format or dtype, a dtype other than fp32 with pytorch, an existing output without
// overwrite, and a checkpoint that cannot be read.
int export_command(const ExportArgs& args, std::ostream& out);

}  // namespace meshtrain
