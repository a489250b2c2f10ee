#pragma once
// `meshtrain export --format onnx`: a checkpoint as one self-contained ONNX model
// (docs/export.md), written without MPI and without a protobuf library (onnx_proto.hpp).
//
// The model is rebuilt from what read_export_source reads from the checkpoint
// (framework/export/export_source.hpp): the config, the parameters and the normalization
// statistics. Checkpoints are of the gathered model whatever mesh saved them, so an export
// does not depend on the mesh.
//
// The graph (opset 17, IR version 8), for a batch of rows ("batch" is a symbolic dimension):
//   input        "input" [batch, sizes[0]] float32, in the user's units
//   normalize    when the checkpoint has input statistics: ((x - mean_hi) - mean_lo) * inv_std,
//                mean_hi = float32(mean), mean_lo = float32(mean - mean_hi) and
//                inv_std = float32(1 / std), each computed in float64 and rounded once; the
//                subtraction of the split mean keeps the float64 mean's precision where
//                features sit far from zero (x' is within a few float32 ulps of float32((x -
//                mean) / std) computed in float64)
//   layer i      Linear: MatMul(x, W [in, out]) + b; MoE: see below
//   activation   after every layer but the last: Relu | Tanh | GELU's tanh form written out
//                in the order training evaluates it (opset 17 has no Gelu):
//                (0.5 x) (1 + tanh(sqrt(2/pi) (x + ((0.044715 x) x) x))) | none
//   de-normalize when the checkpoint has target statistics: y = y' * float32(std) +
//                float32(mean)
//   outputs      "output" [batch, out] float32 (regression: in the user's units;
//                classification: the logits); classification (loss cross_entropy) also
//                "probability" = Softmax(output) [batch, out] float32 and "class" =
//                ArgMax(output) [batch] int64 (the first of equal maxima)
// MoE layer i (layers/moe.hpp), densely: p = Softmax(x Wr); (v, e) = TopK(p, k) (largest,
//   sorted; equal values: the lower expert first, as training chooses); g = v / sum(v);
//   G = ScatterElements(zeros [batch, E], e, g) (the gate of each chosen expert, 0 elsewhere);
//   y = sum over e of G[:, e] * (x W_e + b_e), every expert computed for every row (E / k
//   times the FLOPs of routing the rows; the same result).
// kind = "dlrm" (layers/dlrm.hpp): inputs "dense" [batch, bottom[0]] float32 and per table
//   "sparse/<table>" [batch, k] int64 (k symbolic per table; a negative id is padding); each
//   bag: Gather of the clamped ids times a mask of the real ones, ReduceSum over the ids (mean:
//   divided by max(count of real ids, 1), so an empty bag is 0); interaction dot: the strictly
//   lower triangle of F F^T (F = [z, e_1 .. e_T]) gathered row by row after z, or cat; outputs
//   "logit" [batch, 1] and "probability" = Sigmoid(logit). 16-bit tables are gathered, then the
//   gathered rows Cast.
// Weights (every /params dataset) are initializers in the export's dtype; fp16 and bf16 ones
// are Cast to float32 (rounded to nearest even once, at export), so all arithmetic is
// float32 and the model runs on any ONNX Runtime CPU. Normalization constants are float32.

#include <cstdint>
#include <string>
#include <vector>

#include "base/dtype.hpp"
#include "framework/export/export_source.hpp"
#include "framework/export/onnx_proto.hpp"

namespace meshtrain {

constexpr int64_t kOnnxOpset = 17;     // ONNX 1.12; ONNX Runtime >= 1.13, TensorRT >= 8.6
constexpr int64_t kOnnxIrVersion = 8;  // the IR version of opset 17

// The graph's value names (docs/export.md).
inline const char* onnx_input_name() {
  return "input";
}
inline const char* onnx_output_name() {
  return "output";
}
inline const char* onnx_probability_name() {
  return "probability";
}
inline const char* onnx_class_name() {
  return "class";
}
// A DLRM's logit [batch, 1] (its probability is onnx_probability_name's Sigmoid of it).
inline const char* onnx_logit_name() {
  return "logit";
}

// The ONNX model of `source` with weights stored as `weights` (fp32, fp16 or bf16), each
// initializer holding a copy of its bytes (the model stands alone). Throws bad_input naming
// the parameter when the checkpoint's parameters do not match its config (missing, extra,
// other shape), a value is not finite, or does not fit fp16.
onnx::Model build_onnx_model(const ExportSource& source, Dtype weights);

struct OnnxExportResult {
  std::string checkpoint;  // the file read
  int64_t step = 0;
  int64_t bytes = 0;                // of the written file
  std::vector<std::string> inputs;  // the graph's inputs ("input"; a DLRM: "dense", "sparse/<t>"..)
  std::vector<std::string> outputs;  // the graph's outputs ("output", "probability", "class")
};

// Exports `checkpoint` to `output`: written to "<output>.tmp", synced and renamed, so a failed
// export leaves no file that looks whole. An existing output is refused (bad_input naming it)
// unless `overwrite`; an output that is the checkpoint (or the pointer file naming it) always.
// The file holds the bytes onnx::serialize(build_onnx_model(...)) gives, but the weights are
// written straight from the checkpoint's values read into memory (converted to 16 bits in
// small pieces): memory holds them once, not once per copy of an encoding.
OnnxExportResult export_onnx(const std::string& checkpoint, const std::string& output,
                             Dtype weights, bool overwrite);

}  // namespace meshtrain
