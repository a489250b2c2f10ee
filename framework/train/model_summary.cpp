// A model's one-line summary (framework/train/model_summary.hpp).

#include "framework/train/model_summary.hpp"

#include <sstream>

#include "framework/core/choices.hpp"

namespace meshtrain {

std::string model_summary(const ModelSection& model) {
  std::ostringstream out;
  const bool residual = model.kind == ModelKind::residual_mlp;
  if (model.kind == ModelKind::dlrm) {
    // "dlrm bottom 13-64-16, 26 tables, dot, top 367-64-1 relu"
    auto sizes = [&out](const std::vector<int64_t>& s) {
      for (size_t i = 0; i < s.size(); ++i) out << (i ? "-" : "") << s[i];
    };
    out << "dlrm bottom ";
    sizes(model.bottom);
    out << ", " << model.tables.size() << " tables, " << to_string(model.interaction) << ", top ";
    sizes(model.top);
    out << " " << to_string(model.activation);
  } else if (residual) {
    out << "residual_mlp " << model.inputs << "-" << model.width << "x" << model.depth << "-"
        << model.outputs << ", hidden " << model.hidden << ", " << to_string(model.norm) << ", "
        << model.activation_name();
  } else {
    out << "mlp ";
    for (size_t i = 0; i < model.sizes.size(); ++i) out << (i ? "-" : "") << model.sizes[i];
    out << " " << to_string(model.activation);
  }
  if (!model.moe_layers.empty()) {
    out << (residual ? ", MoE blocks" : ", MoE layers");
    for (int64_t l : model.moe_layers) out << " " << l;
    out << " (" << model.experts << " experts, top " << model.top_k << ")";
  }
  out << ", loss " << (model.loss ? to_string(*model.loss) : "auto");
  return out.str();
}

}  // namespace meshtrain
