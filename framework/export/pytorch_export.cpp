// A checkpoint as a PyTorch module (framework/export/pytorch_export.hpp, docs/export.md).

#include "framework/export/pytorch_export.hpp"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <filesystem>
#include <set>
#include <sstream>
#include <system_error>
#include <utility>

#include "base/error.hpp"
#include "framework/core/choices.hpp"
#include "framework/core/version.hpp"
#include "framework/export/output_writer.hpp"
#include "framework/export/pytorch_model_text.hpp"  // generated from pytorch_model.py
#include "framework/io/checkpoint.hpp"
#include "framework/io/output_file.hpp"
#include "framework/train/config.hpp"
#include "framework/train/model_summary.hpp"
#include "partition/dlrm_shape.hpp"
#include "partition/embedding_layout.hpp"  // embedding_weight_name
#include "partition/norm_layout.hpp"       // the norms' eps

namespace meshtrain {
namespace {

namespace fs = std::filesystem;
using safetensors::ElementType;
using safetensors::Tensor;

// --- model.safetensors ----------------------------------------------------------------------

constexpr size_t kStreamElements = size_t{1} << 14;  // 64 KiB of float32 per piece

// Builds the tensor list, each checkpoint parameter used once.
class TensorList {
 public:
  explicit TensorList(const ExportSource& source) : source_(source) {}

  // `name` = the checkpoint's `parameter` as it is stored (a norm's scale, a bias).
  void copy(const std::string& name, const std::string& parameter) {
    const CheckpointArray& array = take(parameter);
    slice(name, array.values, 0, array.shape);
  }
  // A linear layer's [in, out] weight as nn.Linear's [out, in] and its bias.
  void linear(const std::string& name, const std::string& parameter) {
    const CheckpointArray& weight = take(parameter + "/weight");
    transposed(name + ".weight", weight.values, 0, weight.shape[0], weight.shape[1]);
    copy(name + ".bias", parameter + "/bias");
  }
  // A router [in, E] as nn.Linear(in, E, bias=False).
  void router(const std::string& name, const std::string& parameter) {
    const CheckpointArray& weight = take(parameter);
    transposed(name + ".weight", weight.values, 0, weight.shape[0], weight.shape[1]);
  }
  // Experts' weights [E, in, out] and biases [E, out] as one nn.Linear per expert:
  // "<prefix><e><suffix>.weight" [out, in] and ".bias".
  void experts(const std::string& prefix, const std::string& suffix, const std::string& parameter) {
    const CheckpointArray& weight = take(parameter + "/weight");
    const CheckpointArray& bias = take(parameter + "/bias");
    const int64_t experts = weight.shape[0], in = weight.shape[1], out = weight.shape[2];
    for (int64_t e = 0; e < experts; ++e) {
      const std::string name = prefix + std::to_string(e) + suffix;
      transposed(name + ".weight", weight.values, static_cast<size_t>(e * in * out), in, out);
      slice(name + ".bias", bias.values, static_cast<size_t>(e * out), {out});
    }
  }
  void statistics(const std::string& name, const std::vector<double>& values) {
    Tensor t{name, ElementType::float64, {static_cast<int64_t>(values.size())}, {}};
    t.write = [&values](const ExportByteSink& sink) {
      // little-endian, as every machine meshtrain builds for (x86-64, arm64)
      sink(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(double));
    };
    tensors_.push_back(std::move(t));
  }

  std::vector<Tensor> finish() {
    for (const auto& [name, array] : source_.params) {
      MESHTRAIN_REQUIRE(taken_.count(name), "export: parameter '", name, "' has no PyTorch name");
    }
    return std::move(tensors_);
  }

 private:
  const CheckpointArray& take(const std::string& parameter) {
    const auto found = source_.params.find(parameter);
    MESHTRAIN_REQUIRE(found != source_.params.end(), "export: no parameter '", parameter, "'");
    MESHTRAIN_REQUIRE(taken_.insert(parameter).second, "export: parameter '", parameter,
                      "' used twice");
    return found->second;
  }
  // The elements of `shape` from values[offset], as they are.
  void slice(const std::string& name, const std::vector<float>& values, size_t offset,
             std::vector<int64_t> shape) {
    Tensor t{name, ElementType::float32, std::move(shape), {}};
    const size_t n = t.elements();
    MESHTRAIN_REQUIRE(offset + n <= values.size(), "export: '", name, "' beyond its parameter");
    t.write = [&values, offset, n](const ExportByteSink& sink) {
      sink(reinterpret_cast<const char*>(values.data() + offset), n * sizeof(float));
    };
    tensors_.push_back(std::move(t));
  }
  // The [rows, cols] block at values[offset] as its transpose [cols, rows], in pieces.
  void transposed(const std::string& name, const std::vector<float>& values, size_t offset,
                  int64_t rows, int64_t cols) {
    MESHTRAIN_REQUIRE(offset + static_cast<size_t>(rows * cols) <= values.size(), "export: '", name,
                      "' beyond its parameter");
    Tensor t{name, ElementType::float32, {cols, rows}, {}};
    t.write = [&values, offset, rows, cols](const ExportByteSink& sink) {
      float piece[kStreamElements];
      size_t used = 0;
      for (int64_t c = 0; c < cols; ++c) {
        for (int64_t r = 0; r < rows; ++r) {
          piece[used++] = values[offset + static_cast<size_t>(r * cols + c)];
          if (used == kStreamElements) {
            sink(reinterpret_cast<const char*>(piece), used * sizeof(float));
            used = 0;
          }
        }
      }
      if (used) sink(reinterpret_cast<const char*>(piece), used * sizeof(float));
    };
    tensors_.push_back(std::move(t));
  }

  const ExportSource& source_;
  std::vector<Tensor> tensors_;
  std::set<std::string> taken_;
};

// --- model.py --------------------------------------------------------------------------------

// A Python string literal of `text` (UTF-8 kept; quotes, backslashes and control characters
// escaped).
std::string python_string(const std::string& text) {
  std::string out = "\"";
  for (const char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (u < 0x20 || u == 0x7f) {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\x%02x", u);
      out += escaped;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

// The shortest text that reads back as exactly this float ("1e-05").
std::string python_float(float value) {
  char text[32];
  const auto [end, error] = std::to_chars(text, text + sizeof text, value);
  MESHTRAIN_REQUIRE(error == std::errc(), "export: cannot format ", value);
  return std::string(text, end);
}

std::string python_ints(const std::vector<int64_t>& values) {
  std::string text = "[";
  for (size_t i = 0; i < values.size(); ++i) text += (i ? ", " : "") + std::to_string(values[i]);
  return text + "]";
}

// A Python dict literal, one key per line.
std::string python_dict(const std::vector<std::pair<std::string, std::string>>& entries) {
  std::string text = "{\n";
  for (const auto& [key, value] : entries)
    text += "    " + python_string(key) + ": " + value + ",\n";
  return text + "}";
}

std::string python_bool(bool value) {
  return value ? "True" : "False";
}

std::string model_config(const ExportSource& source) {
  const ModelSection& m = source.config.model;
  std::vector<std::pair<std::string, std::string>> entries = {
      {"kind", python_string(to_string(m.kind))}};
  if (m.kind == ModelKind::dlrm) {
    const DlrmShape shape = m.dlrm();
    std::string tables = "[\n";
    for (const DlrmTable& t : shape.tables) {
      tables += "        {\"name\": " + python_string(t.name) +
                ", \"rows\": " + std::to_string(t.rows) + ", \"dim\": " + std::to_string(t.dim) +
                ", \"pooling\": " + python_string(to_string(t.pooling)) + "},\n";
    }
    entries.insert(entries.end(), {{"bottom", python_ints(shape.bottom)},
                                   {"top", python_ints(shape.top)},
                                   {"tables", tables + "    ]"},
                                   {"interaction", python_string(to_string(shape.interaction))},
                                   {"activation", python_string(to_string(m.activation))}});
  } else if (m.kind == ModelKind::residual_mlp) {
    entries.insert(entries.end(), {{"inputs", std::to_string(m.inputs)},
                                   {"outputs", std::to_string(m.outputs)},
                                   {"width", std::to_string(m.width)},
                                   {"hidden", std::to_string(m.hidden)},
                                   {"depth", std::to_string(m.depth)},
                                   {"norm", python_string(to_string(m.norm))},
                                   {"layernorm_eps", python_float(kLayerNormEps)},
                                   {"rmsnorm_eps", python_float(kRmsNormEps)},
                                   {"activation", python_string(m.activation_name())}});
  } else {
    entries.insert(entries.end(), {{"sizes", python_ints(m.sizes)},
                                   {"activation", python_string(to_string(m.activation))}});
  }
  entries.push_back({"moe_layers", python_ints(m.moe_layers)});
  if (!m.moe_layers.empty()) {
    entries.insert(entries.end(),
                   {{"experts", std::to_string(m.experts)}, {"top_k", std::to_string(m.top_k)}});
  }
  entries.insert(entries.end(),
                 {{"loss", python_string(to_string(*m.loss))},
                  {"normalize_inputs", python_bool(source.normalization.inputs())},
                  {"normalize_targets", python_bool(source.normalization.targets())}});
  return python_dict(entries);
}

// Replaces the one `marker` of `text` with `value` (the template's markers are Python strings,
// "@CONFIG@", so that pytorch_model.py is a Python file itself).
void fill(std::string& text, const std::string& marker, const std::string& value) {
  const size_t at = text.find(marker);
  MESHTRAIN_REQUIRE(at != std::string::npos && text.find(marker, at + 1) == std::string::npos,
                    "export: pytorch_model.py has not exactly one ", marker);
  text.replace(at, marker.size(), value);
}

std::string normalization_text(const Normalization& n) {
  return n.inputs() && n.targets() ? "inputs, targets"
         : n.inputs()              ? "inputs"
         : n.targets()             ? "targets"
                                   : "none";
}

}  // namespace

std::string pytorch_model_code(const ExportSource& source) {
  std::string code = kPytorchModelTemplate;
  fill(code, "@SUMMARY@", model_summary(source.config.model));
  fill(code, "\"@CONFIG@\"", model_config(source));
  fill(code, "\"@SOURCE@\"",
       python_dict(
           {{"checkpoint", python_string(source.path)},
            {"step", std::to_string(source.info.train_state.step)},
            {"mesh", python_string(source.info.mesh)},
            {"framework_version", python_string(source.info.framework_version)},
            {"exported_by", python_string(std::string("meshtrain ") + framework_version())}}));
  return code;
}

std::vector<safetensors::Tensor> pytorch_tensors(const ExportSource& source) {
  const ModelSection& model = source.config.model;
  const MoeSettings moe = model.moe();
  TensorList t(source);
  const Normalization& n = source.normalization;
  if (n.inputs()) {
    t.statistics("input_mean", n.input_mean);
    t.statistics("input_std", n.input_std);
  }
  if (n.targets()) {
    t.statistics("target_mean", n.target_mean);
    t.statistics("target_std", n.target_std);
  }
  if (model.kind == ModelKind::dlrm) {
    // nn.Linear's [out, in] weights; an nn.EmbeddingBag's weight is the table as it is.
    const DlrmShape shape = model.dlrm();
    for (size_t i = 0; i + 1 < shape.bottom.size(); ++i) {
      t.linear("network.bottom." + std::to_string(i), "bottom/" + std::to_string(i));
    }
    for (size_t i = 0; i < shape.tables.size(); ++i) {
      t.copy("network.embeddings." + std::to_string(i) + ".weight",
             embedding_weight_name(shape.tables[i].name));
    }
    for (size_t i = 0; i + 1 < shape.top.size(); ++i) {
      t.linear("network.top." + std::to_string(i), "top/" + std::to_string(i));
    }
    return t.finish();
  }
  if (model.kind == ModelKind::mlp) {
    for (size_t i = 0; i + 1 < model.sizes.size(); ++i) {
      const std::string p = "layers/" + std::to_string(i),
                        name = "network.layers." + std::to_string(i);
      if (moe.is_moe(static_cast<int64_t>(i))) {
        t.router(name + ".router", p + "/router/weight");
        t.experts(name + ".experts.", "", p + "/experts");
      } else {
        t.linear(name, p);
      }
    }
    return t.finish();
  }
  const bool norms = model.norm != ModelNorm::none;
  const auto norm = [&](const std::string& name, const std::string& p) {
    if (!norms) return;
    t.copy(name + ".weight", p + "/scale");
    if (model.norm == ModelNorm::layernorm) t.copy(name + ".bias", p + "/bias");
  };
  t.linear("network.input", "input");
  for (int64_t i = 0; i < model.depth; ++i) {
    const std::string p = "blocks/" + std::to_string(i),
                      name = "network.blocks." + std::to_string(i);
    norm(name + ".norm", p + "/norm");
    const std::string ff = name + ".feed_forward";
    if (moe.is_moe(i)) {
      t.router(ff + ".router", p + "/router/weight");
      for (const char* projection : {"gate", "up", "down"}) {
        if (!model.swiglu && std::string(projection) == "gate") continue;
        t.experts(ff + ".experts.", std::string(".") + projection, p + "/experts/" + projection);
      }
      continue;
    }
    if (model.swiglu) t.linear(ff + ".gate", p + "/gate");
    t.linear(ff + ".up", p + "/up");
    t.linear(ff + ".down", p + "/down");
  }
  norm("network.output_norm", "output_norm");
  t.linear("network.output", "output");
  return t.finish();
}

std::map<std::string, std::string> pytorch_metadata(const ExportSource& source) {
  return {
      {"format", "pt"},  // the safetensors convention for PyTorch state dicts
      {"producer", std::string("meshtrain ") + framework_version()},
      {"checkpoint", source.path},
      {"step", std::to_string(source.info.train_state.step)},
      {"mesh", source.info.mesh},
      {"framework_version", source.info.framework_version},
      {"model", model_summary(source.config.model)},
      {"normalization", normalization_text(source.normalization)},
      {"config", source.info.config_text},
  };
}

PytorchExportResult export_pytorch(const std::string& checkpoint, const std::string& output,
                                   bool overwrite) {
  std::error_code ec;
  const auto status = fs::status(output, ec);
  if (fs::exists(status) && !fs::is_directory(status)) {
    MESHTRAIN_BAD_INPUT("output '", output, "' is a file; --format pytorch writes a folder (",
                        pytorch_code_file(), " and ", pytorch_weights_file(), " in it)");
  }
  const std::string code_path = (fs::path(output) / pytorch_code_file()).string();
  const std::string weights_path = (fs::path(output) / pytorch_weights_file()).string();
  // Refused before the checkpoint is read: the common mistake costs nothing.
  for (const std::string& file : {weights_path, code_path}) refuse_existing_output(file, overwrite);
  const ExportSource source = read_export_source(checkpoint);
  const auto read = checkpoint_files_read(checkpoint, "the checkpoint being exported");
  for (const std::string& file : {weights_path, code_path}) {
    refuse_output_that_is_read(file, "--output", read);
  }
  const std::vector<Tensor> tensors = pytorch_tensors(source);
  const std::map<std::string, std::string> metadata = pytorch_metadata(source);
  const std::string code = pytorch_model_code(source);

  const bool created = !fs::exists(status);
  if (created) {
    fs::create_directories(output, ec);
    if (ec) MESHTRAIN_BAD_INPUT("cannot create the output folder '", output, "': ", ec.message());
  }
  PytorchExportResult result;
  try {
    size_t expected = 0;
    TemporaryOutput weights(weights_path, [&](const ExportByteSink& sink) {
      expected = safetensors::write(tensors, metadata, sink);
    });
    MESHTRAIN_REQUIRE(weights.bytes() == expected, "export: wrote ", weights.bytes(), " bytes of ",
                      expected);
    TemporaryOutput python(code_path,
                           [&](const ExportByteSink& sink) { sink(code.data(), code.size()); });
    weights.commit();
    python.commit();
    result.weight_bytes = static_cast<int64_t>(weights.bytes());
  } catch (...) {
    if (created) fs::remove(output, ec);  // only if still empty
    throw;
  }
  result.checkpoint = source.path;
  result.step = source.info.train_state.step;
  result.code = code_path;
  result.weights = weights_path;
  result.tensors = static_cast<int64_t>(tensors.size());
  return result;
}

}  // namespace meshtrain
