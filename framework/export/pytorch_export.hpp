#pragma once
// `meshtrain export --format pytorch --output DIR`: a checkpoint as a PyTorch module
// (docs/export.md): DIR/model.py, a plain torch.nn.Module following docs/model_math.md with
// the normalization included and no meshtrain in it, and DIR/model.safetensors, its state
// dict. `import model; m = model.load()` gives the module in eval mode; `m(x)` takes float32
// inputs [rows, inputs] in the user's units and returns the outputs in the targets' units
// (logits for a classifier), what `meshtrain predict` computes.
//
// model.py is framework/export/pytorch_model.py (embedded at build time) with the model's
// CONFIG, its SOURCE and summary filled in. The state dict holds the checkpoint's float32
// master weights (whatever [mixed_precision] trained them) under PyTorch's names and layouts:
//
//   checkpoint (docs/model_math.md)       model.safetensors (F32 unless said)
//   layers/<i>/weight [in, out]           network.layers.<i>.weight [out, in] (nn.Linear)
//   layers/<i>/bias                       network.layers.<i>.bias
//   layers/<i>/router/weight [in, E]      network.layers.<i>.router.weight [E, in]
//   layers/<i>/experts/weight [E, in, out]  network.layers.<i>.experts.<e>.weight [out, in]
//   layers/<i>/experts/bias [E, out]      network.layers.<i>.experts.<e>.bias [out]
//   input/{weight,bias}                   network.input.{weight,bias}
//   blocks/<i>/norm/{scale,bias}          network.blocks.<i>.norm.{weight,bias}
//   blocks/<i>/{gate,up,down}/...         network.blocks.<i>.feed_forward.{gate,up,down}....
//   blocks/<i>/router/weight              network.blocks.<i>.feed_forward.router.weight
//   blocks/<i>/experts/{gate,up,down}/...
//   network.blocks.<i>.feed_forward.experts.<e>.{gate,up,down}.... output_norm/{scale,bias}
//   network.output_norm.{weight,bias} output/{weight,bias} network.output.{weight,bias}
//   /normalization/<name> (float64)       <name> (F64 buffers: input_mean, input_std,
//                                         target_mean, target_std; absent when off)
//
// A DLRM (model.py's Dlrm: m(dense, indices, offsets), one nn.EmbeddingBag per table):
//   bottom/<i>/weight [in, out], bias     network.bottom.<i>.weight [out, in], .bias
//   embeddings/<table>/weight [rows, dim] network.embeddings.<t>.weight, as it is (t: the
//                                         table's index in model.tables)
//   top/<i>/weight [in, out], bias        network.top.<i>.weight [out, in], .bias
//
// Weights are streamed from the checkpoint's values to the file (transposed in pieces):
// memory holds them once.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "framework/export/export_source.hpp"
#include "framework/export/safetensors.hpp"

namespace meshtrain {

// The files of an export, in its output folder.
inline const char* pytorch_code_file() {
  return "model.py";
}
inline const char* pytorch_weights_file() {
  return "model.safetensors";
}

// model.py for `source`.
std::string pytorch_model_code(const ExportSource& source);

// model.safetensors' tensors (the table above), streamed from `source`, which must outlive
// them; and its __metadata__ (format "pt", producer, checkpoint, step, mesh,
// framework_version, model, normalization, config).
std::vector<safetensors::Tensor> pytorch_tensors(const ExportSource& source);
std::map<std::string, std::string> pytorch_metadata(const ExportSource& source);

struct PytorchExportResult {
  std::string checkpoint;  // the file read
  int64_t step = 0;
  std::string code;     // the files written: DIR/model.py
  std::string weights;  // DIR/model.safetensors
  int64_t weight_bytes = 0;
  int64_t tensors = 0;
};

// Exports `checkpoint` into the folder `output` (created when missing, with its parents).
// Both files are written to "<file>.tmp" and renamed once both are whole. Refused (bad_input
// naming it) before the checkpoint is read: `output` being an existing file, and an existing
// model.py or model.safetensors in it unless `overwrite`; either of them being the checkpoint
// (or its pointer file) always.
PytorchExportResult export_pytorch(const std::string& checkpoint, const std::string& output,
                                   bool overwrite);

}  // namespace meshtrain
