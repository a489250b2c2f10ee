#pragma once
// The collective-matmul algorithms (framework/comm/collective_matmul.hpp runs them; the cost
// model, partition/cost_model.hpp, predicts their times and makes `automatic`'s choice).
// Their names are in framework/core/choices.hpp.

namespace meshtrain {

enum class CollectiveMatmulAlgorithm { naive, ring, bidirectional, automatic };

}  // namespace meshtrain
