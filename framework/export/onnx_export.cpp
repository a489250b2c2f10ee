// A checkpoint as an ONNX model (framework/export/onnx_export.hpp, docs/export.md).

#include "framework/export/onnx_export.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <set>
#include <system_error>
#include <vector>

#include "base/error.hpp"
#include "framework/core/choices.hpp"
#include "framework/core/precision.hpp"
#include "framework/core/version.hpp"
#include "framework/export/output_writer.hpp"
#include "framework/io/output_file.hpp"
#include "framework/train/model_summary.hpp"
#include "partition/norm_layout.hpp"  // the norms' eps

namespace meshtrain {
namespace {

namespace fs = std::filesystem;
using onnx::Attribute;
using onnx::ElementType;

template <class T>
std::string raw_bytes(const std::vector<T>& values) {
  // ONNX raw_data is little-endian; so is every machine meshtrain builds for (x86-64, arm64).
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

// "0.5", "1e-06", "256": the shortest text that reads back as exactly this float.
std::string float_text(float value) {
  char text[32];
  const auto [end, error] = std::to_chars(text, text + sizeof text, value);
  MESHTRAIN_REQUIRE(error == std::errc(), "export: cannot format the constant ", value);
  return std::string(text, end);
}

// "[-1]", "[0, 2]".
std::string integers_text(const std::vector<int64_t>& values) {
  std::string text = "[";
  for (size_t i = 0; i < values.size(); ++i) text += (i ? ", " : "") + std::to_string(values[i]);
  return text + "]";
}

// How a parameter's initializer holds its bytes.
enum class WeightStorage {
  held,      // copied into the model (Tensor::raw_data): the model stands alone
  streamed,  // written from the source's values when the model is written (Tensor::write_raw):
             // the source must outlive the model
};

// Builds the graph: nodes in order, initializers, unique value names.
class GraphBuilder {
 public:
  GraphBuilder(const ExportSource& source, Dtype weights, WeightStorage storage)
      : source_(source), weights_(weights), storage_(storage) {}

  // Adds a node computing `output` from `inputs`; returns `output`.
  std::string node(const std::string& op, std::vector<std::string> inputs,
                   const std::string& output, std::vector<Attribute> attributes = {}) {
    claim(output);
    graph_.nodes.push_back({op, output, std::move(inputs), {output}, std::move(attributes)});
    return output;
  }
  // A node with several outputs; its name is the first.
  void node(const std::string& op, std::vector<std::string> inputs,
            std::vector<std::string> outputs, std::vector<Attribute> attributes = {}) {
    for (const auto& o : outputs) claim(o);
    const std::string name = outputs.front();
    graph_.nodes.push_back(
        {op, name, std::move(inputs), std::move(outputs), std::move(attributes)});
  }

  // A float32 constant used once, under its own name (normalization statistics).
  std::string constant(const std::string& name, const std::vector<float>& values,
                       std::vector<int64_t> dims) {
    claim(name);
    add_initializer(name, ElementType::float32, std::move(dims), raw_bytes(values));
    return name;
  }
  // Small constants shared by every node that uses the same value: named by what they are
  // and their value ("constants/width=256"), so two different values can never share a name
  // (a shared name is the same value).
  std::string scalar(const std::string& what, float value) {
    const std::string name = what + "=" + float_text(value);
    if (shared(name)) return name;
    add_initializer(name, ElementType::float32, {}, raw_bytes(std::vector<float>{value}));
    return name;
  }
  std::string int64_constant(const std::string& what, const std::vector<int64_t>& values) {
    const std::string name = what + "=" + integers_text(values);
    if (shared(name)) return name;
    add_initializer(name, ElementType::int64, {static_cast<int64_t>(values.size())},
                    raw_bytes(values));
    return name;
  }

  // The parameter `name` of the checkpoint as an initializer of the export's dtype, with
  // `dims` (the stored shape unless given: a reshape of the same row-major values), and the
  // name of its float32 value (a Cast for 16-bit weights).
  std::string parameter(const std::string& name, std::vector<int64_t> dims = {}) {
    const std::string stored = stored_parameter(name, std::move(dims));
    if (weights_ == Dtype::fp32) return stored;
    return to_float32(stored, name + "/fp32");
  }
  // The parameter `name` as an initializer of the export's dtype, without the Cast: for a
  // table, whose few gathered rows are cast (to_float32) rather than the whole table.
  std::string stored_parameter(const std::string& name, std::vector<int64_t> dims = {}) {
    const CheckpointArray& array = source_.params.at(name);
    if (dims.empty()) dims = array.shape;
    claim(name);  // its values are finite (read_export_source)
    if (weights_ == Dtype::fp32) {
      add_parameter(name, ElementType::float32, std::move(dims), array.values);
      return name;
    }
    for (size_t i = 0; i < array.values.size(); ++i) {
      if (std::isinf(from_16bit(to_16bit(array.values[i], weights_), weights_))) {
        MESHTRAIN_BAD_INPUT("parameter '", name, "' in checkpoint '", source_.path, "' holds ",
                            array.values[i], " at element ", i, ", beyond the range of ",
                            to_string(weights_), "; export with --dtype bf16 or fp32");
      }
    }
    const ElementType type = weights_ == Dtype::fp16 ? ElementType::float16 : ElementType::bfloat16;
    add_parameter(name, type, std::move(dims), array.values);
    return name;
  }
  // A value of the export's weight dtype as float32 (itself with fp32 weights).
  std::string to_float32(const std::string& value, const std::string& output) {
    if (weights_ == Dtype::fp32) return value;
    return node("Cast", {value}, output,
                {Attribute::integer("to", static_cast<int64_t>(ElementType::float32))});
  }

  // Renames the value the last node computes (nothing uses it yet) to `name`.
  std::string rename_last(const std::string& from, const std::string& name) {
    if (from == name) return name;
    onnx::Node& last = graph_.nodes.back();
    MESHTRAIN_REQUIRE(last.outputs.size() == 1 && last.outputs[0] == from, "export: '", from,
                      "' is not the last node's output");
    claim(name);
    last.outputs[0] = name;
    last.name = name;
    return name;
  }

  onnx::Graph& graph() { return graph_; }

 private:
  void claim(const std::string& name) {
    MESHTRAIN_REQUIRE(names_.insert(name).second, "export: value name '", name, "' used twice");
  }
  // True when the shared constant `name` exists; else claims it.
  bool shared(const std::string& name) {
    if (constants_.count(name)) return true;
    claim(name);
    constants_.insert(name);
    return false;
  }
  void add_initializer(const std::string& name, ElementType type, std::vector<int64_t> dims,
                       std::string bytes) {
    onnx::Tensor t;
    t.name = name;
    t.type = type;
    t.dims = std::move(dims);
    t.raw_data = std::move(bytes);
    graph_.initializers.push_back(std::move(t));
  }
  // A parameter's values as `type` (float32, or float16 / bfloat16 rounded to nearest even):
  // held, or streamed from `values` in pieces of kStreamElements when the model is written.
  void add_parameter(const std::string& name, ElementType type, std::vector<int64_t> dims,
                     const std::vector<float>& values) {
    const Dtype dtype = weights_;
    if (storage_ == WeightStorage::held) {
      if (type == ElementType::float32) {
        add_initializer(name, type, std::move(dims), raw_bytes(values));
        return;
      }
      std::vector<uint16_t> half(values.size());
      for (size_t i = 0; i < half.size(); ++i) half[i] = to_16bit(values[i], dtype);
      add_initializer(name, type, std::move(dims), raw_bytes(half));
      return;
    }
    onnx::Tensor t;
    t.name = name;
    t.type = type;
    t.dims = std::move(dims);
    const bool fp32 = type == ElementType::float32;
    t.raw_size = values.size() * (fp32 ? sizeof(float) : sizeof(uint16_t));
    t.write_raw = [&values, fp32, dtype](const onnx::ByteSink& sink) {
      if (fp32) {  // little-endian, as every machine meshtrain builds for (x86-64, arm64)
        sink(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
        return;
      }
      constexpr size_t kStreamElements = size_t{1} << 15;  // 64 KiB of 16-bit values
      uint16_t half[kStreamElements];
      for (size_t begin = 0; begin < values.size(); begin += kStreamElements) {
        const size_t n = std::min(kStreamElements, values.size() - begin);
        for (size_t i = 0; i < n; ++i) half[i] = to_16bit(values[begin + i], dtype);
        sink(reinterpret_cast<const char*>(half), n * sizeof(uint16_t));
      }
    };
    graph_.initializers.push_back(std::move(t));
  }

  const ExportSource& source_;
  Dtype weights_;
  WeightStorage storage_;
  onnx::Graph graph_;
  std::set<std::string> names_;
  std::set<std::string> constants_;
};

std::string activation(GraphBuilder& b, Activation kind, const std::string& x,
                       const std::string& prefix) {
  switch (kind) {
    case Activation::relu:
      return b.node("Relu", {x}, prefix + "/relu");
    case Activation::tanh:
      return b.node("Tanh", {x}, prefix + "/tanh");
    case Activation::gelu: {
      // layers/activation.cpp, in its order of evaluation:
      // (0.5f * x) * (1 + tanh(kSqrt2OverPi * (x + ((kGeluCubic * x) * x) * x))).
      const std::string p = prefix + "/gelu/";
      const std::string cubic = b.scalar("constants/gelu_cubic", 0.044715f);
      const std::string scale = b.scalar("constants/gelu_sqrt_2_over_pi", 0.7978845608028654f);
      const std::string half = b.scalar("constants/half", 0.5f);
      const std::string one = b.scalar("constants/one", 1.0f);
      std::string t = b.node("Mul", {x, cubic}, p + "cubic_x");
      t = b.node("Mul", {t, x}, p + "cubic_x2");
      t = b.node("Mul", {t, x}, p + "cubic_x3");
      t = b.node("Add", {x, t}, p + "sum");
      t = b.node("Mul", {t, scale}, p + "inner");
      t = b.node("Tanh", {t}, p + "tanh");
      t = b.node("Add", {t, one}, p + "one_plus_tanh");
      const std::string h = b.node("Mul", {x, half}, p + "half_x");
      return b.node("Mul", {h, t}, prefix + "/gelu");
    }
    case Activation::gelu_erf: {
      // 0.5 x (1 + erf(x / sqrt(2))); training evaluates the same value as 0.5 x erfc(-x /
      // sqrt(2)).
      const std::string p = prefix + "/gelu_erf/";
      const std::string inv_sqrt2 = b.scalar("constants/inv_sqrt_2", 0.7071067811865476f);
      const std::string half = b.scalar("constants/half", 0.5f);
      const std::string one = b.scalar("constants/one", 1.0f);
      std::string t = b.node("Mul", {x, inv_sqrt2}, p + "scaled");
      t = b.node("Erf", {t}, p + "erf");
      t = b.node("Add", {t, one}, p + "one_plus_erf");
      const std::string h = b.node("Mul", {x, half}, p + "half_x");
      return b.node("Mul", {h, t}, prefix + "/gelu_erf");
    }
    case Activation::silu: {
      const std::string s = b.node("Sigmoid", {x}, prefix + "/silu/sigmoid");
      return b.node("Mul", {x, s}, prefix + "/silu");
    }
    case Activation::sigmoid:
      return b.node("Sigmoid", {x}, prefix + "/sigmoid");
    case Activation::none:
      return x;
  }
  MESHTRAIN_FAIL("export: activation '", to_string(kind), "' has no ONNX form");
}

// x W + b with the parameters `<p>/weight` and `<p>/bias`.
std::string linear(GraphBuilder& b, const std::string& p, const std::string& x) {
  const std::string w = b.parameter(p + "/weight");
  const std::string bias = b.parameter(p + "/bias");
  const std::string xw = b.node("MatMul", {x, w}, p + "/matmul");
  return b.node("Add", {xw, bias}, p + "/linear");
}

std::string linear(GraphBuilder& b, int64_t i, const std::string& x) {
  return linear(b, "layers/" + std::to_string(i), x);
}

// A norm over the last axis with the parameters `<p>/scale` (and `<p>/bias`). LayerNorm is
// opset 17's LayerNormalization; RMSNorm is decomposed in training's order of evaluation
// (layers/norm.cpp): rstd = 1 / sqrt(sum(x * x) / F + eps), y = (x * rstd) * scale.
std::string norm(GraphBuilder& b, ModelNorm kind, const std::string& p, const std::string& x,
                 int64_t width) {
  const std::string scale = b.parameter(p + "/scale");
  if (kind == ModelNorm::layernorm) {
    const std::string bias = b.parameter(p + "/bias");
    return b.node("LayerNormalization", {x, scale, bias}, p + "/layernorm",
                  {Attribute::integer("axis", -1), Attribute::real("epsilon", kLayerNormEps)});
  }
  MESHTRAIN_REQUIRE(kind == ModelNorm::rmsnorm, "export: norm '", p, "' of unknown kind");
  const std::string squares = b.node("Mul", {x, x}, p + "/rmsnorm/squares");
  const std::string sum = b.node("ReduceSum", {squares, b.int64_constant("constants/axes", {-1})},
                                 p + "/rmsnorm/sum_squares", {Attribute::integer("keepdims", 1)});
  const std::string mean =
      b.node("Div", {sum, b.scalar("constants/width", static_cast<float>(width))},
             p + "/rmsnorm/mean_square");
  const std::string shifted = b.node("Add", {mean, b.scalar("constants/rmsnorm_eps", kRmsNormEps)},
                                     p + "/rmsnorm/plus_eps");
  const std::string root = b.node("Sqrt", {shifted}, p + "/rmsnorm/sqrt");
  const std::string rstd =
      b.node("Div", {b.scalar("constants/one", 1.0f), root}, p + "/rmsnorm/rstd");
  const std::string x_hat = b.node("Mul", {x, rstd}, p + "/rmsnorm/normalized");
  return b.node("Mul", {x_hat, scale}, p + "/rmsnorm");
}

// The routing of MoE layer (or block) `p`: the gates of every expert per row as [E, rows, 1]
// (zero for the experts a row does not use), training's top-k and renormalization.
std::string moe_gates(GraphBuilder& b, const std::string& p, const std::string& x,
                      const ModelSection& model) {
  const std::string router = b.parameter(p + "/router/weight");
  const std::string logits = b.node("MatMul", {x, router}, p + "/router/logits");
  const std::string probs =
      b.node("Softmax", {logits}, p + "/router/probs", {Attribute::integer("axis", -1)});
  const std::string top_values = p + "/router/top_probs", top_experts = p + "/router/top_experts";
  b.node("TopK", {probs, b.int64_constant("constants/top_k", {model.top_k})},
         {top_values, top_experts},
         {Attribute::integer("axis", -1), Attribute::integer("largest", 1),
          Attribute::integer("sorted", 1)});
  const std::string axis1 = b.int64_constant("constants/axes", {1});
  const std::string top_sum = b.node("ReduceSum", {top_values, axis1}, p + "/router/top_sum",
                                     {Attribute::integer("keepdims", 1)});
  const std::string gates = b.node("Div", {top_values, top_sum}, p + "/router/gates");
  const std::string shape = b.node("Shape", {probs}, p + "/router/shape");
  const std::string zeros = b.node("ConstantOfShape", {shape}, p + "/router/zeros");
  const std::string dense = b.node("ScatterElements", {zeros, top_experts, gates},
                                   p + "/router/dense_gates", {Attribute::integer("axis", 1)});
  const std::string by_expert = b.node("Transpose", {dense}, p + "/router/gates_by_expert",
                                       {Attribute::integers("perm", {1, 0})});
  return b.node("Unsqueeze", {by_expert, b.int64_constant("constants/axes", {2})},
                p + "/router/gates3");
}

// sum over the experts of gate x expert output ([E, rows, out] -> [rows, out]).
std::string moe_combine(GraphBuilder& b, const std::string& p, const std::string& experts_out,
                        const std::string& gate3) {
  const std::string weighted = b.node("Mul", {experts_out, gate3}, p + "/experts/gated");
  return b.node("ReduceSum", {weighted, b.int64_constant("constants/axes", {0})}, p + "/moe",
                {Attribute::integer("keepdims", 0)});
}

// x [rows, in] or [E, rows, in] times the experts' `<q>/weight` [E, in, out] plus `<q>/bias`
// [E, out] (read as [E, 1, out]): one GEMM per expert, broadcast -> [E, rows, out].
std::string experts_linear(GraphBuilder& b, const std::string& q, const std::string& x,
                           int64_t experts, int64_t out) {
  const std::string weight = b.parameter(q + "/weight");
  const std::string bias = b.parameter(q + "/bias", {experts, 1, out});
  const std::string y = b.node("MatMul", {x, weight}, q + "/matmul");
  return b.node("Add", {y, bias}, q + "/linear");
}

std::string moe(GraphBuilder& b, int64_t i, const std::string& x, const ModelSection& model,
                int64_t out) {
  const std::string p = "layers/" + std::to_string(i);
  const std::string gate3 = moe_gates(b, p, x, model);
  return moe_combine(b, p, experts_linear(b, p + "/experts", x, model.experts, out), gate3);
}

// An MoE block's feed-forward experts (docs/models.md): every expert on every row, the gated
// sum; the unused experts' gates are 0.
std::string moe_block(GraphBuilder& b, const std::string& p, const std::string& u,
                      const ModelSection& model) {
  const std::string gate3 = moe_gates(b, p, u, model);
  const std::string up = experts_linear(b, p + "/experts/up", u, model.experts, model.hidden);
  std::string a;
  if (model.swiglu) {
    const std::string gate = activation(
        b, Activation::silu, experts_linear(b, p + "/experts/gate", u, model.experts, model.hidden),
        p + "/experts/gate");
    a = b.node("Mul", {gate, up}, p + "/experts/swiglu");
  } else {
    a = activation(b, model.activation, up, p + "/experts");
  }
  return moe_combine(b, p, experts_linear(b, p + "/experts/down", a, model.experts, model.width),
                     gate3);
}

// kind = "residual_mlp" (docs/models.md): input projection, pre-norm blocks (an MoE block:
// moe_block), output norm and projection; dropout is training only and never appears.
std::string residual_mlp(GraphBuilder& b, const ModelSection& model, std::string h) {
  const bool norms = model.norm != ModelNorm::none;
  h = linear(b, "input", h);
  for (int64_t i = 0; i < model.depth; ++i) {
    const std::string p = "blocks/" + std::to_string(i);
    const std::string u = norms ? norm(b, model.norm, p + "/norm", h, model.width) : h;
    if (model.moe().is_moe(i)) {
      h = b.node("Add", {h, moe_block(b, p, u, model)}, p + "/residual");
      continue;
    }
    std::string a;
    if (model.swiglu) {  // silu(u W_gate + b_gate) * (u W_up + b_up)
      const std::string gate =
          activation(b, Activation::silu, linear(b, p + "/gate", u), p + "/gate");
      a = b.node("Mul", {gate, linear(b, p + "/up", u)}, p + "/swiglu");
    } else {
      a = activation(b, model.activation, linear(b, p + "/up", u), p);
    }
    h = b.node("Add", {h, linear(b, p + "/down", a)}, p + "/residual");
  }
  if (norms) h = norm(b, model.norm, "output_norm", h, model.width);
  return linear(b, "output", h);
}

// The graph inputs of a DLRM: the dense features, then one id array per table.
std::string dlrm_dense_input() {
  return "dense";
}
std::string dlrm_ids_input(const DlrmTable& table) {
  return "sparse/" + table.name;
}

// EmbeddingBag `t` of fixed-width bags `ids` [batch, k] (negative ids are padding): the rows of
// the real ids gathered and summed (layers/embedding_bag.hpp; mean: divided by the bag's count
// of real ids, an empty bag giving 0 either way). Padding ids gather row 0 and are multiplied
// by 0, so no zero row is appended to (and no copy made of) the table.
std::string embedding_bag(GraphBuilder& b, const DlrmTable& t, const std::string& ids) {
  const std::string p = "embeddings/" + t.name;
  const std::string table = b.stored_parameter(p + "/weight");
  const std::string zero_id = b.int64_constant("constants/zero_id", {0});
  const std::string real = b.node("GreaterOrEqual", {ids, zero_id}, p + "/real_ids");
  const std::string safe = b.node("Max", {ids, zero_id}, p + "/gather_ids");
  // [batch, k, dim]; with 16-bit weights only these rows are converted.
  const std::string rows =
      b.to_float32(b.node("Gather", {table, safe}, p + "/rows", {Attribute::integer("axis", 0)}),
                   p + "/rows_fp32");
  const std::string mask =
      b.node("Cast", {real}, p + "/mask",
             {Attribute::integer("to", static_cast<int64_t>(ElementType::float32))});
  const std::string mask3 =
      b.node("Unsqueeze", {mask, b.int64_constant("constants/axes", {2})}, p + "/mask3");
  const std::string kept = b.node("Mul", {rows, mask3}, p + "/kept_rows");
  const std::string axis1 = b.int64_constant("constants/axes", {1});
  const std::string sum =
      b.node("ReduceSum", {kept, axis1}, p + "/sum", {Attribute::integer("keepdims", 0)});
  if (t.pooling == EmbeddingPooling::sum) return sum;
  const std::string count =
      b.node("ReduceSum", {mask, axis1}, p + "/count", {Attribute::integer("keepdims", 1)});
  const std::string divisor =
      b.node("Max", {count, b.scalar("constants/one", 1.0f)}, p + "/count_or_one");
  return b.node("Div", {sum, divisor}, p + "/mean");
}

// kind = "dlrm" (layers/dlrm.hpp, docs/recsys.md): the bottom MLP (its activation after every
// layer), the embedding bags, the interaction, the top MLP (activation after all but the last).
std::string dlrm(GraphBuilder& b, const ModelSection& model) {
  const DlrmShape shape = model.dlrm();
  std::string z = dlrm_dense_input();
  for (size_t i = 0; i + 1 < shape.bottom.size(); ++i) {
    const std::string p = "bottom/" + std::to_string(i);
    z = activation(b, model.activation, linear(b, p, z), p);
  }
  std::vector<std::string> pooled;
  for (const DlrmTable& t : shape.tables) pooled.push_back(embedding_bag(b, t, dlrm_ids_input(t)));

  std::vector<std::string> features{z};
  features.insert(features.end(), pooled.begin(), pooled.end());
  std::string h;
  if (shape.interaction == DlrmInteraction::cat) {
    h = b.node("Concat", features, "interaction/cat", {Attribute::integer("axis", 1)});
  } else {
    // F = [z, e_1 .. e_T] as [batch, T + 1, d]; F F^T flattened; the strictly lower triangle
    // row by row (i = 1 .. T, j < i: index i (T + 1) + j), training's order; then [z, pairs].
    const std::string axis1 = b.int64_constant("constants/axes", {1});
    std::vector<std::string> blocks;
    for (size_t f = 0; f < features.size(); ++f) {
      blocks.push_back(
          b.node("Unsqueeze", {features[f], axis1}, "interaction/feature_" + std::to_string(f)));
    }
    const std::string stacked =
        b.node("Concat", blocks, "interaction/features", {Attribute::integer("axis", 1)});
    const std::string transposed = b.node("Transpose", {stacked}, "interaction/features_t",
                                          {Attribute::integers("perm", {0, 2, 1})});
    const std::string gram = b.node("MatMul", {stacked, transposed}, "interaction/gram");
    const std::string flat =
        b.node("Flatten", {gram}, "interaction/gram_flat", {Attribute::integer("axis", 1)});
    const int64_t n = static_cast<int64_t>(features.size());
    std::vector<int64_t> lower;
    for (int64_t i = 1; i < n; ++i) {
      for (int64_t j = 0; j < i; ++j) lower.push_back(i * n + j);
    }
    const std::string pairs =
        b.node("Gather", {flat, b.int64_constant("constants/lower_triangle", lower)},
               "interaction/pairs", {Attribute::integer("axis", 1)});
    h = b.node("Concat", {z, pairs}, "interaction/dot", {Attribute::integer("axis", 1)});
  }
  const size_t top_layers = shape.top.size() - 1;
  for (size_t i = 0; i < top_layers; ++i) {
    const std::string p = "top/" + std::to_string(i);
    h = linear(b, p, h);
    if (i + 1 < top_layers) h = activation(b, model.activation, h, p);
  }
  return h;
}

std::string normalize_inputs(GraphBuilder& b, const Normalization& n, const std::string& x) {
  const int64_t width = static_cast<int64_t>(n.input_mean.size());
  std::vector<float> hi(n.input_mean.size()), lo(hi.size()), inv_std(hi.size());
  bool any_lo = false;
  for (size_t i = 0; i < hi.size(); ++i) {
    hi[i] = static_cast<float>(n.input_mean[i]);
    lo[i] = static_cast<float>(n.input_mean[i] - static_cast<double>(hi[i]));
    inv_std[i] = static_cast<float>(1.0 / n.input_std[i]);
    any_lo = any_lo || lo[i] != 0.0f;
  }
  std::string t = b.node("Sub", {x, b.constant("normalization/input_mean_hi", hi, {width})},
                         "input/centered_hi");
  if (any_lo) {
    t = b.node("Sub", {t, b.constant("normalization/input_mean_lo", lo, {width})},
               "input/centered");
  }
  return b.node("Mul", {t, b.constant("normalization/input_inv_std", inv_std, {width})},
                "input/normalized");
}

std::string denormalize_outputs(GraphBuilder& b, const Normalization& n, const std::string& y) {
  const int64_t width = static_cast<int64_t>(n.target_mean.size());
  std::vector<float> mean(n.target_mean.begin(), n.target_mean.end());
  std::vector<float> std_dev(n.target_std.begin(), n.target_std.end());
  const std::string scaled =
      b.node("Mul", {y, b.constant("normalization/target_std", std_dev, {width})}, "output/scaled");
  return b.node("Add", {scaled, b.constant("normalization/target_mean", mean, {width})},
                onnx_output_name());
}

// The model's metadata (docs/export.md), `normalization` and `outputs` as given.
std::vector<std::pair<std::string, std::string>> model_metadata(const ExportSource& source,
                                                                Dtype weights,
                                                                const std::string& normalization,
                                                                const std::string& outputs) {
  return {
      {"checkpoint", source.path},
      {"step", std::to_string(source.info.train_state.step)},
      {"mesh", source.info.mesh},
      {"framework_version", source.info.framework_version},
      {"model", model_summary(source.config.model)},
      {"weights_dtype", to_string(weights)},
      {"normalization", normalization},
      {"outputs", outputs},
      {"config", source.info.config_text},
  };
}

onnx::Model dlrm_model(const ExportSource& source, Dtype weights, WeightStorage storage) {
  const ModelSection& model = source.config.model;
  const DlrmShape shape = model.dlrm();
  GraphBuilder b(source, weights, storage);
  const std::string logit = b.rename_last(dlrm(b, model), onnx_logit_name());
  b.node("Sigmoid", {logit}, onnx_probability_name());

  onnx::Graph& g = b.graph();
  g.name = "meshtrain_dlrm";
  const onnx::Dimension batch{0, "batch"};
  g.inputs.push_back(
      {dlrm_dense_input(), ElementType::float32, {batch, {shape.bottom.front(), ""}}});
  std::string tables;
  for (const DlrmTable& t : shape.tables) {
    // Each table's bag width is its own symbolic dimension: any number of ids per row.
    g.inputs.push_back({dlrm_ids_input(t), ElementType::int64, {batch, {0, "ids_" + t.name}}});
    tables += (tables.empty() ? "'" : ", '") + dlrm_ids_input(t) + "'";
  }
  g.outputs.push_back({onnx_logit_name(), ElementType::float32, {batch, {1, ""}}});
  g.outputs.push_back({onnx_probability_name(), ElementType::float32, {batch, {1, ""}}});
  g.doc_string = "meshtrain " + model_summary(model) + ". Inputs 'dense' [batch, " +
                 std::to_string(shape.bottom.front()) + "] float32 and " + tables +
                 " [batch, ids] int64 (a negative id is padding: a bag of fewer ids); outputs " +
                 "'logit' [batch, 1] and 'probability' (its sigmoid). See docs/export.md.";

  onnx::Model m;
  m.ir_version = kOnnxIrVersion;
  m.opset_version = kOnnxOpset;
  m.producer_name = "meshtrain";
  m.producer_version = framework_version();
  m.doc_string = g.doc_string;
  m.graph = std::move(g);
  m.metadata = model_metadata(source, weights, "none", "logit, probability");
  return m;
}

onnx::Model build_model(const ExportSource& source, Dtype weights, WeightStorage storage) {
  const ModelSection& model = source.config.model;
  if (model.kind == ModelKind::dlrm) return dlrm_model(source, weights, storage);
  const bool classifies = model.loss == LossKind::cross_entropy;
  const int64_t in = model.input_width(), out = model.output_width();

  GraphBuilder b(source, weights, storage);
  std::string x = onnx_input_name();
  if (source.normalization.inputs()) x = normalize_inputs(b, source.normalization, x);
  if (model.kind == ModelKind::residual_mlp) {
    x = residual_mlp(b, model, x);
  } else {
    const int64_t layers = static_cast<int64_t>(model.sizes.size()) - 1;
    const MoeSettings settings = model.moe();
    for (int64_t i = 0; i < layers; ++i) {
      x = settings.is_moe(i) ? moe(b, i, x, model, model.sizes[static_cast<size_t>(i) + 1])
                             : linear(b, i, x);
      if (i + 1 < layers) x = activation(b, model.activation, x, "layers/" + std::to_string(i));
    }
  }
  if (source.normalization.targets()) {
    x = denormalize_outputs(b, source.normalization, b.rename_last(x, "output/normalized"));
  } else {
    x = b.rename_last(x, onnx_output_name());
  }

  onnx::Graph& g = b.graph();
  const bool residual = model.kind == ModelKind::residual_mlp;
  g.name = residual ? "meshtrain_residual_mlp" : "meshtrain_mlp";
  const onnx::Dimension batch{0, "batch"};
  g.inputs.push_back({onnx_input_name(), ElementType::float32, {batch, {in, ""}}});
  g.outputs.push_back({onnx_output_name(), ElementType::float32, {batch, {out, ""}}});
  if (classifies) {
    b.node("Softmax", {x}, onnx_probability_name(), {Attribute::integer("axis", 1)});
    b.node("ArgMax", {x}, onnx_class_name(),
           {Attribute::integer("axis", 1), Attribute::integer("keepdims", 0)});
    g.outputs.push_back({onnx_probability_name(), ElementType::float32, {batch, {out, ""}}});
    g.outputs.push_back({onnx_class_name(), ElementType::int64, {batch}});
  }
  g.doc_string = "meshtrain " + model_summary(model) + ". Input 'input' [batch, " +
                 std::to_string(in) + "] in the user's units; output 'output' [batch, " +
                 std::to_string(out) + "]" +
                 (classifies ? " (logits), 'probability' (softmax) and 'class' (argmax, int64)"
                             : " in the user's units") +
                 ". See docs/export.md.";

  onnx::Model m;
  m.ir_version = kOnnxIrVersion;
  m.opset_version = kOnnxOpset;
  m.producer_name = "meshtrain";
  m.producer_version = framework_version();
  m.doc_string = g.doc_string;
  m.graph = std::move(g);
  const Normalization& n = source.normalization;
  m.metadata = model_metadata(source, weights,
                              n.inputs() && n.targets() ? "inputs, targets"
                              : n.inputs()              ? "inputs"
                              : n.targets()             ? "targets"
                                                        : "none",
                              classifies ? "output, probability, class" : "output");
  return m;
}

}  // namespace

onnx::Model build_onnx_model(const ExportSource& source, Dtype weights) {
  return build_model(source, weights, WeightStorage::held);
}

OnnxExportResult export_onnx(const std::string& checkpoint, const std::string& output,
                             Dtype weights, bool overwrite) {
  // Refused before the checkpoint is read: the common mistake costs nothing.
  std::error_code ec;
  if (!overwrite && fs::exists(output, ec)) {
    MESHTRAIN_BAD_INPUT("output '", output, "' exists; pass --overwrite to replace it");
  }
  const ExportSource source = read_export_source(checkpoint);
  refuse_output_that_is_read(output, "--output",
                             checkpoint_files_read(checkpoint, "the checkpoint being exported"));
  // The weights stay in `source` alone: the model's initializers refer to them and are
  // written from there, converted to 16 bits in small pieces when asked.
  const onnx::Model model = build_model(source, weights, WeightStorage::streamed);
  OnnxExportResult result;
  result.checkpoint = source.path;
  result.step = source.info.train_state.step;
  for (const auto& i : model.graph.inputs) result.inputs.push_back(i.name);
  for (const auto& o : model.graph.outputs) result.outputs.push_back(o.name);
  // A protobuf message cannot exceed 2 GiB; ONNX's external data files are not written. The
  // weights alone are checked, then the whole encoding, before anything is written.
  constexpr size_t kProtobufLimit = (size_t{1} << 31) - 1;
  auto refuse_size = [&](size_t bytes) {
    MESHTRAIN_BAD_INPUT("the ONNX model of checkpoint '", source.path, "' would be ", bytes,
                        " bytes or more, above protobuf's 2 GiB limit",
                        weights == Dtype::fp32 ? "; --dtype fp16 or bf16 halves it" : "");
  };
  size_t weight_bytes = 0;
  for (const auto& t : model.graph.initializers) weight_bytes += t.raw_bytes();
  if (weight_bytes > kProtobufLimit) refuse_size(weight_bytes);
  const size_t size = onnx::serialized_size(model);
  if (size > kProtobufLimit) refuse_size(size);
  size_t written = 0;
  write_atomically(
      output, [&](const ExportByteSink& sink) { written = onnx::write(model, sink); }, overwrite);
  MESHTRAIN_REQUIRE(written == size, "export: wrote ", written, " bytes of ", size);
  result.bytes = static_cast<int64_t>(written);
  return result;
}

}  // namespace meshtrain
