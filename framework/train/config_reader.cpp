// Reads a run's parsed TOML (docs/design.md, "Configuration (TOML)") into a RunConfig. Every key
// is checked here, once, and every named option becomes its enum (framework/core/choices.hpp), so
// the rest of the program can trust the values: an unknown section or key, a wrong type or an
// out-of-range value is a bad_input Error that names the file, the line and the key
// ("configs/x.toml:12: [optimizer] lr must be positive, got -0.1"). Values set with --set carry
// their override as their source, so their errors name it.

#include <algorithm>
#include <cmath>
#include <optional>
#include <regex>
#include <sstream>

#include "base/error.hpp"
#include "base/text.hpp"
#include "framework/core/choices.hpp"
#include "framework/train/config_toml.hpp"
#include "partition/linear_layout.hpp"
#include "partition/logical_axes.hpp"

namespace meshtrain {
namespace {

const char* const kFashionMnistDefaultPath = "/usr/share/datasets/fashion-mnist";

}  // namespace

const ConfigSchema& config_schema() {
  static const ConfigSchema sections = {
      {"run", {"name", "seed", "output_dir", "peak_tflops"}},
      {"mesh", {"dp", "fsdp", "ep", "tp", "sp"}},
      {"model",
       {"kind", "sizes", "inputs", "outputs", "width", "hidden", "depth", "norm", "activation",
        "init", "loss", "moe_layers", "experts", "top_k", "aux_loss_coef", "dropout"}},
      {"partition", {"preset", "min_sharding_size", "rules", "logical_axes", "collective_matmul"}},
      {"data",
       {"source", "path", "test_path", "batch_size", "eval_batch_size", "shuffle", "block_rows",
        "shuffle_window", "prefetch", "synthetic_samples", "x_key", "y_key", "normalize_inputs",
        "normalize_targets"}},
      {"optimizer",
       {"kind", "lr", "momentum", "betas", "eps", "weight_decay", "clip_norm", "schedule",
        "warmup_steps", "min_lr", "zero_stage"}},
      {"train",
       {"epochs", "steps", "log_every", "eval_every", "accumulation_steps", "early_stopping"}},
      {"checkpoint", {"every_steps", "keep", "resume", "dir", "async", "keep_best", "init_from"}},
      {"runtime",
       {"backend", "matmul_precision", "overlap", "bucket_mb", "comm_thread", "reductions",
        "trace_steps", "flight_records"}},
      {"mixed_precision", {"param_dtype", "reduce_dtype"}},
  };
  return sections;
}

const std::vector<std::string>* config_schema_keys(const std::string& section) {
  for (const auto& [name, keys] : config_schema()) {
    if (name == section) return &keys;
  }
  return nullptr;
}

std::vector<std::string> config_section_names() {
  std::vector<std::string> names;
  for (const auto& [name, keys] : config_schema()) names.push_back(name);
  return names;
}

const char* toml_type_name(toml::node_type type) {
  switch (type) {
    case toml::node_type::table:
      return "a table";
    case toml::node_type::array:
      return "an array";
    case toml::node_type::string:
      return "a string";
    case toml::node_type::integer:
      return "an integer";
    case toml::node_type::floating_point:
      return "a float";
    case toml::node_type::boolean:
      return "a boolean";
    case toml::node_type::date:
      return "a date";
    case toml::node_type::time:
      return "a time";
    case toml::node_type::date_time:
      return "a date-time";
    default:
      return "nothing";
  }
}

namespace {

// A value as it would be written in TOML ("-0.1", "\"relu\"", "[1, 2]").
std::string render(const toml::node& node) {
  if (node.is_table()) return "a table";
  std::ostringstream out;
  node.visit([&](const auto& concrete) { out << concrete; });
  return out.str();
}

// Reads the sections of one parsed file. Holds the file name for messages.
class Reader {
 public:
  explicit Reader(std::string file) : file_(std::move(file)) {}

  // "file:line" for a node read from the file; "file (--set k=v)" for one from an override.
  std::string at(const toml::source_region& source) const {
    if (source.path && *source.path != file_) return file_ + " (" + *source.path + ")";
    if (source.begin.line > 0) return file_ + ":" + std::to_string(source.begin.line);
    return file_;
  }

  // One section of the file (an empty table when the section is absent).
  class Section {
   public:
    Section(const Reader& reader, std::string name, const toml::table* table)
        : reader_(reader), name_(std::move(name)), table_(table ? table : &empty_) {}

    const toml::node* find(const std::string& key) const { return table_->get(key); }
    bool has(const std::string& key) const { return find(key) != nullptr; }

    // Throws bad_input "<file:line>: [section] key <parts>" at the key's value, or at the
    // section (file only) when the key is absent.
    template <class... Parts>
    [[noreturn]] void fail(const std::string& key, Parts&&... parts) const {
      const toml::node* node = find(key);
      fail_at(node ? node->source() : table_->source(), key, std::forward<Parts>(parts)...);
    }
    template <class... Parts>
    [[noreturn]] void fail_at(const toml::source_region& source, const std::string& key,
                              Parts&&... parts) const {
      MESHTRAIN_BAD_INPUT(reader_.at(source), ": [", name_, "] ", key, " ",
                          std::forward<Parts>(parts)...);
    }
    // "<file:line>: [section] <subject>: <parts>", for entries such as "rule 0".
    template <class... Parts>
    [[noreturn]] void fail_about(const toml::source_region& source, const std::string& subject,
                                 Parts&&... parts) const {
      MESHTRAIN_BAD_INPUT(reader_.at(source), ": [", name_, "] ", subject, ": ",
                          std::forward<Parts>(parts)...);
    }
    [[noreturn]] void wrong_type(const std::string& key, const toml::node& node,
                                 const char* expected) const {
      fail_at(node.source(), key, "must be ", expected, ", got ", toml_type_name(node.type()), " ",
              render(node));
    }

    std::optional<int64_t> integer(const std::string& key) const {
      const toml::node* node = find(key);
      if (!node) return std::nullopt;
      if (!node->is_integer()) wrong_type(key, *node, "an integer");
      return node->as_integer()->get();
    }
    int64_t integer(const std::string& key, int64_t fallback, int64_t minimum) const {
      int64_t value = integer(key).value_or(fallback);
      if (value < minimum) {
        fail(key, "must be ", minimum == 1 ? "at least 1" : "non-negative", ", got ", value);
      }
      return value;
    }
    std::optional<double> number(const std::string& key) const {
      const toml::node* node = find(key);
      if (!node) return std::nullopt;
      if (node->is_integer()) return static_cast<double>(node->as_integer()->get());
      if (!node->is_floating_point()) wrong_type(key, *node, "a number");
      double value = node->as_floating_point()->get();
      if (!std::isfinite(value)) fail(key, "must be a finite number, got ", render(*node));
      return value;
    }
    std::optional<std::string> string(const std::string& key) const {
      const toml::node* node = find(key);
      if (!node) return std::nullopt;
      if (!node->is_string()) wrong_type(key, *node, "a string");
      return node->as_string()->get();
    }
    // The value of the name the key gives (`fallback` when absent), from `table`.
    template <class Value>
    Value choice(const std::string& key, Value fallback, const ChoiceTable<Value>& table) const {
      const std::optional<std::string> name = string(key);
      if (!name) return fallback;
      for (const auto& [text, value] : table) {
        if (text == *name) return value;
      }
      fail(key, "must be one of ", join(choice_names(table), " | "), ", got \"", *name, "\"");
    }
    bool boolean(const std::string& key, bool fallback) const {
      const toml::node* node = find(key);
      if (!node) return fallback;
      if (!node->is_boolean()) wrong_type(key, *node, "true or false");
      return node->as_boolean()->get();
    }

    const std::string& name() const { return name_; }
    const toml::table& table() const { return *table_; }

   private:
    static inline const toml::table empty_{};
    const Reader& reader_;
    std::string name_;
    const toml::table* table_;
  };

  Section section(const toml::table& root, const std::string& name) const {
    return Section(*this, name, root.get_as<toml::table>(name));
  }

  // Unknown sections, keys outside a section and unknown keys, at the line of the key.
  void check_structure(const toml::table& root) const {
    const std::vector<std::string> section_names = config_section_names();
    for (const auto& [key, node] : root) {
      const std::string name(key.str());
      const std::vector<std::string>* keys = config_schema_keys(name);
      if (!keys) {
        if (node.is_table()) {
          MESHTRAIN_BAD_INPUT(at(key.source()), ": unknown section [", name,
                              "] (known sections: ", join(section_names), ")");
        }
        MESHTRAIN_BAD_INPUT(at(key.source()), ": key '", name,
                            "' must be inside a section (known sections: ", join(section_names),
                            ")");
      }
      if (!node.is_table()) {
        MESHTRAIN_BAD_INPUT(at(key.source()), ": '", name, "' must be a section [", name, "], got ",
                            toml_type_name(node.type()), " ", render(node));
      }
      for (const auto& [inner, value] : *node.as_table()) {
        if (!contains(*keys, std::string(inner.str()))) {
          MESHTRAIN_BAD_INPUT(at(inner.source()), ": [", name, "] unknown key '", inner.str(),
                              "' (known keys: ", join(*keys), ")");
        }
      }
    }
  }

  const std::string& file() const { return file_; }

 private:
  std::string file_;
};

using Section = Reader::Section;

void read_run(const Section& s, RunSection& run) {
  run.name = s.string("name").value_or(run.name);
  if (run.name.empty()) s.fail("name", "must not be empty");
  run.seed = static_cast<uint64_t>(s.integer("seed", 0, 0));
  run.output_dir = s.string("output_dir").value_or("runs/" + run.name);
  if (run.output_dir.empty()) s.fail("output_dir", "must not be empty");
  run.peak_tflops = s.number("peak_tflops").value_or(run.peak_tflops);
  if (run.peak_tflops < 0) {
    s.fail("peak_tflops", "must be non-negative (0 = unknown), got ", run.peak_tflops);
  }
}

void read_mesh(const Section& s, const std::string& file, MeshSection& mesh) {
  mesh.axes.clear();
  mesh.source = file + " [mesh]";
  // Sizes are checked here, by Mesh's own rule, to name the key's line; the world size that
  // completes the check is known only when the mesh is resolved.
  std::string inferred;
  for (const std::string& axis : Mesh::known_axes()) {
    const int64_t size = s.integer(axis).value_or(1);
    const std::string problem = mesh_axis_size_problem(size, inferred);
    if (!problem.empty()) s.fail(axis, problem);
    if (size == -1) inferred = axis;
    mesh.axes.emplace_back(axis, static_cast<int>(size));
  }
}

// kind = "mlp": model.sizes; the residual_mlp keys are refused.
void read_mlp_sizes(const Section& s, ModelSection& model) {
  for (const char* key : {"inputs", "outputs", "width", "hidden", "depth", "norm"}) {
    if (s.has(key)) {
      s.fail(key,
             "is a key of kind = \"residual_mlp\"; kind = \"mlp\" gives its widths in "
             "sizes");
    }
  }
  const toml::node* sizes = s.find("sizes");
  if (!sizes) s.fail("sizes", "is required, e.g. sizes = [784, 512, 512, 10]");
  if (!sizes->is_array()) s.wrong_type("sizes", *sizes, "an array of layer widths");
  const toml::array& array = *sizes->as_array();
  if (array.size() < 2) {
    s.fail("sizes", "needs at least 2 entries (input and output width), got ", render(array));
  }
  model.sizes.clear();
  for (size_t i = 0; i < array.size(); ++i) {
    const toml::node& entry = array[i];
    if (!entry.is_integer() || entry.as_integer()->get() < 1) {
      s.fail_at(entry.source().begin.line > 0 ? entry.source() : array.source(), "sizes",
                "entries must be positive integers, got ", render(entry), " at index ", i);
    }
    model.sizes.push_back(entry.as_integer()->get());
  }
}

// kind = "residual_mlp": inputs, outputs, width, hidden, depth, norm; sizes refused (moe_layers
// name blocks, read with the other model keys).
void read_residual_model(const Section& s, ModelSection& model) {
  if (s.has("sizes")) {
    s.fail("sizes",
           "is a key of kind = \"mlp\"; kind = \"residual_mlp\" takes inputs, "
           "outputs, width, hidden and depth instead");
  }
  model.sizes.clear();
  for (auto [key, value] : {std::pair<const char*, int64_t*>{"inputs", &model.inputs},
                            {"outputs", &model.outputs},
                            {"width", &model.width},
                            {"hidden", &model.hidden},
                            {"depth", &model.depth}}) {
    if (!s.has(key) && *value < 1) s.fail(key, "is required with kind = \"residual_mlp\"");
    *value = s.integer(key, *value, 1);
  }
  model.norm = s.choice("norm", model.norm, model_norm_choices());
}

void read_model(const Section& s, DataSource data_source, ModelSection& model) {
  model.kind = s.choice("kind", model.kind, model_kind_choices());
  if (model.kind == ModelKind::residual_mlp) {
    read_residual_model(s, model);
  } else {
    read_mlp_sizes(s, model);
  }
  // "swiglu" is a residual_mlp activation (a gate projection in every block).
  ChoiceTable<std::optional<Activation>> activations;
  for (const auto& [name, kind] : activation_choices()) activations.emplace_back(name, kind);
  if (model.kind == ModelKind::residual_mlp) activations.emplace_back("swiglu", std::nullopt);
  const std::optional<Activation> fallback =
      model.swiglu ? std::nullopt : std::optional<Activation>(model.activation);
  const std::optional<Activation> activation = s.choice("activation", fallback, activations);
  model.swiglu = !activation;
  model.activation = activation.value_or(Activation::silu);
  model.init = s.choice("init", model.init, init_scheme_choices());
  ChoiceTable<std::optional<LossKind>> losses = {{"auto", std::nullopt}};
  for (const auto& [name, kind] : loss_kind_choices()) losses.emplace_back(name, kind);
  model.loss = s.choice("loss", model.loss, losses);
  if (!model.loss) {
    model.loss = data_source == DataSource::synthetic ? LossKind::mse : LossKind::cross_entropy;
  }

  const toml::node* layers = s.find("moe_layers");
  if (layers) {
    if (!layers->is_array()) s.wrong_type("moe_layers", *layers, "an array of layer indices");
    model.moe_layers.clear();
    for (const toml::node& entry : *layers->as_array()) {
      if (!entry.is_integer()) s.wrong_type("moe_layers", entry, "an array of layer indices");
      model.moe_layers.push_back(entry.as_integer()->get());
    }
  }
  model.experts = s.integer("experts").value_or(model.experts);
  model.top_k = s.integer("top_k").value_or(model.top_k);
  model.aux_loss_coef = s.number("aux_loss_coef").value_or(model.aux_loss_coef);
  model.dropout = s.number("dropout").value_or(model.dropout);
  if (const std::optional<ModelKeyProblem> problem = moe_settings_problem(model)) {
    if (problem->entry && layers) {
      s.fail_at((*layers->as_array())[*problem->entry].source(), problem->key, problem->message);
    }
    s.fail(problem->key, problem->message);
  }
}

// One spec entry: "" (None), "axis", or ["axis", ...] (a tuple, major to minor).
SpecEntry read_spec_entry(const Section& s, const std::string& what, const toml::node& node) {
  SpecEntry entry;
  if (node.is_string()) {
    const std::string& axis = node.as_string()->get();
    if (!axis.empty()) entry.axes.push_back(axis);
    return entry;
  }
  if (node.is_array()) {
    for (const toml::node& inner : *node.as_array()) {
      if (!inner.is_string() || inner.as_string()->get().empty()) {
        s.fail_about(node.source(), what, "a tuple entry must list mesh axis names, got ",
                     render(node));
      }
      entry.axes.push_back(inner.as_string()->get());
    }
    return entry;
  }
  s.fail_about(node.source(), what,
               "a spec entry must be \"\" (None), an axis name or an array of axis names, got ",
               render(node));
}

// An axis the mesh does not know, or one named twice, in a spec read from `source`.
void check_spec_axes(const Section& s, const std::string& what, const toml::source_region& source,
                     const PartitionSpec& spec, const std::string& text) {
  for (const std::string& axis : spec.axes()) {
    if (!contains(Mesh::known_axes(), axis)) {
      s.fail_about(source, what, text, " names unknown mesh axis '", axis,
                   "' (known axes: ", join(Mesh::known_axes()), ")");
    }
  }
  const std::string repeated = spec.repeated_axis();
  if (!repeated.empty()) {
    s.fail_about(source, what, text, " names mesh axis '", repeated,
                 "' more than once; an axis may split only one dimension");
  }
}

PartitionRuleText read_rule(const Section& s, size_t index, const toml::node& node) {
  const std::string what = "rule " + std::to_string(index);
  const toml::array* pair = node.as_array();
  if (!pair || pair->size() != 2 || !(*pair)[0].is_string()) {
    s.fail_about(node.source(), what, "must be [regex, spec], got ", render(node));
  }
  PartitionRuleText rule;
  rule.pattern = (*pair)[0].as_string()->get();
  try {
    std::regex compiled(rule.pattern, std::regex::ECMAScript);
  } catch (const std::regex_error& e) {
    s.fail_about(node.source(), what, "regex '", rule.pattern, "' does not compile (", e.what(),
                 ")");
  }
  const toml::node& spec = (*pair)[1];
  if (spec.is_string()) {
    try {
      rule.spec = PartitionSpec::parse(spec.as_string()->get());
    } catch (const Error& e) {
      s.fail_about(node.source(), what, e.what());
    }
  } else if (spec.is_array()) {
    for (const toml::node& entry : *spec.as_array()) {
      rule.spec.entries.push_back(read_spec_entry(s, what, entry));
    }
  } else {
    s.fail_about(node.source(), what,
                 "the spec must be an array like [\"fsdp\", \"tp\"] or a string like "
                 "\"P(fsdp, tp)\", got ",
                 render(spec));
  }
  check_spec_axes(s, what, node.source(), rule.spec, "spec " + rule.spec.to_string());
  return rule;
}

void read_partition(const Section& s, PartitionSection& partition) {
  std::vector<std::string> presets = preset_names();
  partition.preset = s.string("preset").value_or("");
  if (!partition.preset.empty() && !contains(presets, partition.preset)) {
    s.fail("preset", "must be one of ", join(presets, " | "), ", got \"", partition.preset, "\"");
  }
  partition.min_sharding_size = s.integer("min_sharding_size", partition.min_sharding_size, 0);
  partition.collective_matmul =
      s.choice("collective_matmul", partition.collective_matmul, collective_matmul_choices());

  partition.rules.clear();
  if (const toml::node* rules = s.find("rules")) {
    if (!rules->is_array()) s.wrong_type("rules", *rules, "an array of [regex, spec] pairs");
    const toml::array& array = *rules->as_array();
    for (size_t i = 0; i < array.size(); ++i) {
      partition.rules.push_back(read_rule(s, i, array[i]));
    }
  }

  partition.logical_axes.clear();
  if (const toml::node* axes = s.find("logical_axes")) {
    if (!axes->is_table())
      s.wrong_type("logical_axes", *axes, "a table like { batch = [\"fsdp\", \"dp\"] }");
    for (const auto& [key, node] : *axes->as_table()) {
      const std::string name(key.str());
      const std::string what = "logical_axes." + name;
      if (!contains(LogicalAxes::names(), name)) {
        s.fail_about(key.source(), "logical_axes", "unknown logical axis '", name,
                     "' (known: ", join(LogicalAxes::names()), ")");
      }
      std::vector<std::string> mesh_axes;
      if (node.is_string()) {
        if (!node.as_string()->get().empty()) mesh_axes.push_back(node.as_string()->get());
      } else if (node.is_array()) {
        for (const toml::node& inner : *node.as_array()) {
          if (!inner.is_string() || inner.as_string()->get().empty()) {
            s.fail_about(node.source(), what, "must be a mesh axis name or an array of them, got ",
                         render(node));
          }
          mesh_axes.push_back(inner.as_string()->get());
        }
      } else {
        s.fail_about(node.source(), what, "must be a mesh axis name or an array of them, got ",
                     render(node));
      }
      check_spec_axes(s, what, node.source(), PartitionSpec({SpecEntry{mesh_axes}}),
                      "mesh axes " + render(node));
      partition.logical_axes[name] = mesh_axes;
    }
  }
}

// A file, or a list of files and globs: data.path and data.test_path.
std::vector<std::string> read_paths(const Section& s, const std::string& key) {
  const toml::node* node = s.find(key);
  if (!node) return {};
  const char* expected = "a file name (or glob) or an array of them";
  if (node->is_string()) return {node->as_string()->get()};
  if (!node->is_array()) s.wrong_type(key, *node, expected);
  std::vector<std::string> paths;
  for (const toml::node& entry : *node->as_array()) {
    if (!entry.is_string() || entry.as_string()->get().empty()) {
      s.fail_at(entry.source(), key, "must be ", expected, ", got ", render(*node));
    }
    paths.push_back(entry.as_string()->get());
  }
  if (paths.empty()) s.fail(key, "is an empty array: name at least one file");
  return paths;
}

void read_data(const Section& s, DataSection& data) {
  data.source = s.choice("source", data.source, data_source_choices());
  data.path = read_paths(s, "path");
  data.test_path = read_paths(s, "test_path");
  if (data.source == DataSource::fashion_mnist) {
    if (data.path.empty()) data.path = {kFashionMnistDefaultPath};
    if (data.path.size() != 1)
      s.fail("path", "must be one directory when source = \"fashion_mnist\"");
  }
  if (data.source == DataSource::hdf5 && data.path.empty()) {
    s.fail("path", "is required when source = \"hdf5\" (the training file)");
  }
  data.batch_size = s.integer("batch_size", data.batch_size, 1);
  data.eval_batch_size = s.integer("eval_batch_size");
  if (data.eval_batch_size && *data.eval_batch_size < 1) {
    s.fail("eval_batch_size", "must be at least 1, got ", *data.eval_batch_size);
  }
  if (const toml::node* node = s.find("shuffle")) {
    if (node->is_boolean()) {
      data.shuffle = node->as_boolean()->get() ? ShuffleMode::rows : ShuffleMode::none;
    } else if (node->is_string() && node->as_string()->get() == "blocks") {
      data.shuffle = ShuffleMode::blocks;
    } else {
      s.fail("shuffle", "must be true, false or \"blocks\", got ", render(*node));
    }
  }
  data.block_rows = s.integer("block_rows", data.block_rows, 1);
  data.shuffle_window = s.integer("shuffle_window", data.shuffle_window, 1);
  data.prefetch = s.integer("prefetch", data.prefetch, 0);
  data.synthetic_samples = s.integer("synthetic_samples", data.synthetic_samples, 1);
  for (auto [key, value] : {std::pair{"x_key", &data.x_key}, std::pair{"y_key", &data.y_key}}) {
    *value = canonical_dataset_key(s.string(key).value_or(*value));
    if (value->empty()) s.fail(key, "must name a dataset, e.g. \"/x\"");
  }
  if (data.x_key == data.y_key)
    s.fail("y_key", "names the same dataset as x_key (", data.x_key, ")");
  data.normalize_inputs = s.choice("normalize_inputs", data.normalize_inputs, normalize_choices());
  data.normalize_targets =
      s.choice("normalize_targets", data.normalize_targets, normalize_choices());
}

// Targets are standardized for regression only: class labels are not numbers to scale.
void check_normalize_targets(const Section& s, const DataSection& data, const ModelSection& model) {
  if (data.normalize_targets == Normalize::standard && model.loss == LossKind::cross_entropy) {
    s.fail(
        "normalize_targets", "= \"standard\" needs regression targets (model.loss = \"mse\"), ",
        "but model.loss = \"cross_entropy\" reads class labels; set normalize_targets = \"none\"");
  }
}

void read_optimizer(const Section& s, OptimizerSection& opt) {
  opt.kind = s.choice("kind", opt.kind, optimizer_kind_choices());
  opt.lr = s.number("lr").value_or(opt.lr);
  if (!(opt.lr > 0)) s.fail("lr", "must be positive, got ", opt.lr);
  opt.momentum = s.number("momentum").value_or(opt.momentum);
  if (opt.momentum < 0 || opt.momentum >= 1)
    s.fail("momentum", "must be in [0, 1), got ", opt.momentum);
  if (const toml::node* betas = s.find("betas")) {
    const toml::array* array = betas->as_array();
    if (!array || array->size() != 2 || !(*array)[0].is_number() || !(*array)[1].is_number()) {
      s.fail("betas", "must be two numbers [beta1, beta2], got ", render(*betas));
    }
    auto value = [](const toml::node& n) {
      return n.is_integer() ? static_cast<double>(n.as_integer()->get())
                            : n.as_floating_point()->get();
    };
    opt.betas = {value((*array)[0]), value((*array)[1])};
    for (double beta : {opt.betas.first, opt.betas.second}) {
      if (!(beta >= 0 && beta < 1)) s.fail("betas", "must each be in [0, 1), got ", render(*betas));
    }
  }
  opt.eps = s.number("eps").value_or(opt.eps);
  if (!(opt.eps > 0)) s.fail("eps", "must be positive, got ", opt.eps);
  opt.weight_decay = s.number("weight_decay").value_or(opt.weight_decay);
  if (opt.weight_decay < 0) s.fail("weight_decay", "must be non-negative, got ", opt.weight_decay);
  opt.clip_norm = s.number("clip_norm").value_or(opt.clip_norm);
  if (opt.clip_norm < 0) s.fail("clip_norm", "must be non-negative (0 = off), got ", opt.clip_norm);
  opt.schedule = s.choice("schedule", opt.schedule, lr_schedule_choices());
  opt.warmup_steps = s.integer("warmup_steps", opt.warmup_steps, 0);
  opt.min_lr = s.number("min_lr").value_or(opt.min_lr);
  if (!(opt.min_lr >= 0 && opt.min_lr <= opt.lr)) {
    s.fail("min_lr", "must be in [0, lr = ", opt.lr, "], got ", opt.min_lr);
  }
  opt.zero_stage = s.integer("zero_stage").value_or(opt.zero_stage);
  if (opt.zero_stage != 0 && opt.zero_stage != 1) {
    s.fail("zero_stage",
           "must be 0 (optimizer state replicated over dp) or 1 (sharded over dp, "
           "ZeRO-1), got ",
           opt.zero_stage);
  }
}

void read_train(const Section& s, TrainSection& train) {
  train.epochs = s.integer("epochs");
  train.steps = s.integer("steps");
  if (train.epochs && train.steps) {
    s.fail("steps", "and epochs are both set; give exactly one of them");
  }
  if (train.epochs && *train.epochs < 1)
    s.fail("epochs", "must be at least 1, got ", *train.epochs);
  if (train.steps && *train.steps < 1) s.fail("steps", "must be at least 1, got ", *train.steps);
  train.log_every = s.integer("log_every", train.log_every, 1);
  train.eval_every = s.integer("eval_every", train.eval_every, 0);
  train.accumulation_steps = s.integer("accumulation_steps", train.accumulation_steps, 1);
  train.early_stopping = s.integer("early_stopping", train.early_stopping, 0);
  if (train.early_stopping > 0 && train.eval_every == 0) {
    s.fail("early_stopping", "needs evaluations during the run: set train.eval_every");
  }
}

void read_checkpoint(const Section& s, const std::string& output_dir, CheckpointSection& ckpt) {
  ckpt.every_steps = s.integer("every_steps", ckpt.every_steps, 0);
  ckpt.keep = s.integer("keep", ckpt.keep, 1);
  ckpt.resume = s.boolean("resume", ckpt.resume);
  ckpt.async = s.boolean("async", ckpt.async);
  if (s.has("keep_best")) {
    ckpt.keep_best = s.choice("keep_best", EvalMetric::test_loss, eval_metric_choices());
  }
  ckpt.dir = s.string("dir").value_or(output_dir + "/checkpoints");
  if (ckpt.dir.empty()) s.fail("dir", "must not be empty");
  ckpt.init_from = s.string("init_from").value_or("");
  if (s.has("init_from") && ckpt.init_from.empty()) {
    s.fail("init_from", "must name a checkpoint file, pointer or directory (or be left out)");
  }
}

void read_mixed_precision(const Section& s, MixedPrecisionSection& mp) {
  mp.param_dtype = s.choice("param_dtype", mp.param_dtype, dtype_choices());
  mp.reduce_dtype = s.choice("reduce_dtype", mp.reduce_dtype, dtype_choices());
  // One 16-bit format per run: a bf16 gradient reduced in fp16 would overflow where bf16
  // does not, and an fp16 one reduced in bf16 loses the mantissa loss scaling protects.
  const bool mixes = (mp.param_dtype == Dtype::bf16 && mp.reduce_dtype == Dtype::fp16) ||
                     (mp.param_dtype == Dtype::fp16 && mp.reduce_dtype == Dtype::bf16);
  if (mixes) {
    s.fail("reduce_dtype", "= \"", to_string(mp.reduce_dtype),
           "\" does not go with param_dtype = \"", to_string(mp.param_dtype),
           "\": use one 16-bit format (or fp32) for both");
  }
}

void read_runtime(const Section& s, RuntimeSection& runtime) {
  runtime.backend = s.choice("backend", runtime.backend, comm_backend_choices());
  runtime.matmul_precision =
      s.choice("matmul_precision", runtime.matmul_precision, matmul_precision_choices());
  runtime.overlap = s.boolean("overlap", runtime.overlap);
  runtime.reductions = s.choice("reductions", runtime.reductions, reduction_algorithm_choices());
  runtime.bucket_mb = s.number("bucket_mb").value_or(runtime.bucket_mb);
  runtime.flight_records = s.integer("flight_records", runtime.flight_records, 0);
  if (runtime.flight_records > RuntimeSection::kMaxFlightRecords) {
    s.fail("flight_records", "must be at most ", RuntimeSection::kMaxFlightRecords,
           " (0: off), got ", runtime.flight_records);
  }
  // comm_thread: true, false or "auto".
  if (const toml::node* node = s.table().get("comm_thread")) {
    if (node->is_boolean()) {
      runtime.comm_thread =
          node->as_boolean()->get() ? CommThreadChoice::on : CommThreadChoice::off;
    } else if (!node->is_string() || node->as_string()->get() != "auto") {
      s.fail("comm_thread", "must be true, false or \"auto\", got ", render(*node));
    } else {
      runtime.comm_thread = CommThreadChoice::automatic;
    }
  }
  if (!(runtime.bucket_mb > 0)) {
    s.fail("bucket_mb", "must be a positive number of MiB, got ", runtime.bucket_mb);
  }
  // trace_steps = [FIRST, LAST]: 1-based step numbers, FIRST <= LAST.
  if (const toml::node* node = s.find("trace_steps")) {
    const toml::array* array = node->as_array();
    const bool two_integers =
        array && array->size() == 2 && (*array)[0].is_integer() && (*array)[1].is_integer();
    if (!two_integers) {
      s.fail("trace_steps", "must be [FIRST, LAST], two step numbers, got ", render(*node));
    }
    runtime.trace_first = (*array)[0].as_integer()->get();
    runtime.trace_last = (*array)[1].as_integer()->get();
    if (runtime.trace_first < 1 || runtime.trace_last < runtime.trace_first) {
      s.fail("trace_steps", "must be [FIRST, LAST] with 1 <= FIRST <= LAST, got ", render(*node));
    }
  }
}

}  // namespace

RunConfig read_config(const toml::table& root, const std::string& file) {
  Reader reader(file);
  reader.check_structure(root);

  RunConfig config;
  config.file = file;
  std::ostringstream effective;
  effective << root;
  config.text = effective.str();

  read_run(reader.section(root, "run"), config.run);
  read_mesh(reader.section(root, "mesh"), file, config.mesh);
  read_data(reader.section(root, "data"), config.data);
  read_model(reader.section(root, "model"), config.data.source, config.model);
  check_normalize_targets(reader.section(root, "data"), config.data, config.model);
  read_partition(reader.section(root, "partition"), config.partition);
  read_optimizer(reader.section(root, "optimizer"), config.optimizer);
  read_train(reader.section(root, "train"), config.train);
  read_checkpoint(reader.section(root, "checkpoint"), config.run.output_dir, config.checkpoint);
  read_runtime(reader.section(root, "runtime"), config.runtime);
  read_mixed_precision(reader.section(root, "mixed_precision"), config.mixed_precision);
  check_config_products(config);
  return config;
}

}  // namespace meshtrain
