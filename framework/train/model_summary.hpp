#pragma once
// A model's one-line summary, the same wherever a model is named: the `model` metadata and
// doc string of an ONNX export, the `model` attribute of `meshtrain predict`'s output, the
// predictor's description.
//
//   mlp 784-512-512-10 gelu, loss cross_entropy
//   mlp 8-12-8-4 gelu, MoE layers 1 (4 experts, top 2), loss cross_entropy
//   residual_mlp 16-32x2-4, hidden 64, rmsnorm, swiglu, MoE blocks 1 (4 experts, top 2), loss mse

#include <string>

#include "framework/train/config.hpp"

namespace meshtrain {

std::string model_summary(const ModelSection& model);

}  // namespace meshtrain
