#pragma once
// DLRM's shape (layers/dlrm.hpp, docs/recsys.md): the bottom and top MLP sizes, the tables and
// the interaction, its checks and its parameters. Pure arithmetic, as mlp_parameter_shapes is,
// so that the config, the planner and the model agree on one definition.

#include <cstdint>
#include <string>
#include <vector>

#include "base/dtype.hpp"
#include "partition/embedding_layout.hpp"  // EmbeddingPooling
#include "partition/planner.hpp"           // ParameterShape

namespace meshtrain {

enum class DlrmInteraction { dot, cat };
// "dot" | "cat"; anything else is bad_input naming `key` and the value.
DlrmInteraction parse_dlrm_interaction(const std::string& name, const std::string& key);
const char* to_string(DlrmInteraction interaction);

struct DlrmTable {
  std::string name;  // the parameter is embeddings/<name>/weight [rows, dim]
  int64_t rows = 0, dim = 0;
  EmbeddingPooling pooling = EmbeddingPooling::sum;
};

struct DlrmShape {
  std::vector<int64_t> bottom;  // [dense features, hidden..., d]
  std::vector<int64_t> top;     // [interaction width, hidden..., 1]
  std::vector<DlrmTable> tables;
  DlrmInteraction interaction = DlrmInteraction::dot;
  // How the tables are stored (model.table_dtype): fp32, or bf16 (2 bytes an element, updated
  // by a sparse optimizer with stochastic rounding; docs/recsys.md, "bf16 tables").
  Dtype table_dtype = Dtype::fp32;
};

// The interaction's output width for `shape`'s bottom and tables (top[0] must equal it).
int64_t dlrm_interaction_width(const DlrmShape& shape);
// bad_input, one sentence naming what is wrong: bottom or top with fewer than two sizes or a
// size below 1, no table, a table without a name, twice, or with rows or dim below 1, dot with a
// table dim other than bottom's last size, top's first size other than the interaction's
// width, top's last size other than 1. `where`: what names the shape in messages ("model").
void check_dlrm_shape(const DlrmShape& shape, const std::string& where = "model");
// bottom/<i>/weight, bottom/<i>/bias, ..., embeddings/<t>/weight, ..., top/<i>/weight, ...
std::vector<ParameterShape> dlrm_parameter_shapes(const DlrmShape& shape);
// The linear layers for the planner: bottom's then top's (each fed whole rows: the bottom's
// output goes through the interaction, which needs it whole), the activation after every one
// but the last top layer.
std::vector<LinearLayerParameters> dlrm_linear_layers(const DlrmShape& shape);

}  // namespace meshtrain
