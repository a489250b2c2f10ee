#include "layers/layer.hpp"

#include <algorithm>

#include "base/error.hpp"

namespace meshtrain {

void LayerScratchNeeds::merge(const LayerScratchNeeds& o) {
  weight = std::max(weight, o.weight);
  grad = std::max(grad, o.grad);
  stage = std::max(stage, o.stage);
  bias = std::max(bias, o.bias);
  matmul = std::max(matmul, o.matmul);
  prefetch = std::max(prefetch, o.prefetch);
  weight_16bit = std::max(weight_16bit, o.weight_16bit);
}

LayerScratch::LayerScratch(const LayerScratchNeeds& needs, bool with_prefetch)
    : weight("meshtrain::scratch_weight", needs.weight),
      prefetch("meshtrain::scratch_prefetch", with_prefetch ? needs.prefetch : 0),
      grad("meshtrain::scratch_grad", needs.grad),
      stage("meshtrain::scratch_stage", needs.stage),
      bias("meshtrain::scratch_bias", needs.bias),
      weight_16bit("meshtrain::scratch_weight_16bit", with_prefetch ? needs.weight_16bit : 0) {
  if (needs.matmul > 0) matmul.reserve(needs.matmul);
}

MatrixView Layer::forward_tangents(MatrixView, const LayerPass&) {
  MESHTRAIN_REQUIRE(false, "layer '", describe(), "' has no forward-mode tangent pass");
  return MatrixView();
}

void Layer::reserve_tangents(int64_t directions) {
  MESHTRAIN_REQUIRE(false, "layer '", describe(), "' has no forward-mode tangent pass (asked for ",
                    directions, " directions)");
}

MatrixView Layer::backward_cotangents(MatrixView, const LayerPass& pass) {
  cotangent_block_rows(pass, 0, describe());  // a block: refused as such
  MESHTRAIN_REQUIRE(false, "layer '", describe(), "' has no reverse-mode cotangent pass");
  return MatrixView();
}

Layer::RowBlock Layer::cotangent_block_rows(const LayerPass& pass, int64_t rows,
                                            const std::string& who) const {
  if (pass.cotangent_rows == 0 && pass.cotangent_first_row == 0) return {0, rows};
  MESHTRAIN_REQUIRE(cotangents_by_rows(), "layer '", who, "': a cotangent pass over value rows [",
                    pass.cotangent_first_row, ", ", pass.cotangent_first_row + pass.cotangent_rows,
                    "), which this layer takes only whole (cotangents_by_rows() is false)");
  MESHTRAIN_REQUIRE(pass.cotangent_rows > 0 && pass.cotangent_first_row >= 0 &&
                        pass.cotangent_first_row + pass.cotangent_rows <= rows,
                    "layer '", who, "': a cotangent pass over value rows [",
                    pass.cotangent_first_row, ", ", pass.cotangent_first_row + pass.cotangent_rows,
                    ") of ", rows);
  return {pass.cotangent_first_row, pass.cotangent_rows};
}

void Layer::reserve_cotangents(int64_t directions) {
  MESHTRAIN_REQUIRE(false, "layer '", describe(),
                    "' has no reverse-mode cotangent pass (asked for ", directions, " directions)");
}

MatrixView Layer::backward_with_tangents(MatrixView, MatrixView, bool, const LayerPass&,
                                         MatrixView*) {
  MESHTRAIN_BAD_INPUT("layer '", describe(), "' cannot be trained on derivatives");
  return MatrixView();
}

void Layer::reserve_tangent_backward(int64_t) {
  MESHTRAIN_BAD_INPUT("layer '", describe(), "' cannot be trained on derivatives");
}

namespace {
int64_t directions_of(int64_t stacked, int64_t rows, int64_t capacity, const char* kind,
                      const std::string& who) {
  MESHTRAIN_REQUIRE(
      rows > 0 && stacked % rows == 0 && stacked / rows >= 1 && stacked / rows <= capacity, who,
      ": a ", kind, " input of ", stacked, " rows for ", rows, " rows of values, with room for ",
      capacity, " directions per row");
  return stacked / rows;
}
}  // namespace

int64_t Layer::tangent_directions(int64_t tangent_rows, int64_t rows,
                                  const std::string& who) const {
  return directions_of(tangent_rows, rows, tangent_capacity_, "tangent", who);
}

int64_t Layer::cotangent_directions(int64_t cotangent_rows, int64_t rows,
                                    const std::string& who) const {
  return directions_of(cotangent_rows, rows, cotangent_capacity_, "cotangent", who);
}

}  // namespace meshtrain
