// What each type of value in the schema (config_schema.hpp) does: read from TOML, written,
// checked against its range or choices; the defaults derived from other keys; and how
// messages name keys and values.

#include <algorithm>
#include <cmath>
#include <sstream>
#include <type_traits>

#include "base/error.hpp"
#include "base/text.hpp"
#include "framework/train/config_schema.hpp"

namespace meshtrain {
std::string KeyNames::operator()(const std::string& section_key) const {
  const std::string prefix = section + ".";
  if (in_file && section_key.compare(0, prefix.size(), prefix) == 0) {
    return section_key.substr(prefix.size());
  }
  return section_key;
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

std::string config_bound_text(double value) {
  if (value == std::floor(value) && std::abs(value) < 1e15) {
    return std::to_string(static_cast<long long>(value));
  }
  return detail::concat(value);
}

std::string render_node(const toml::node& node) {
  if (node.is_table()) return "a table";
  std::ostringstream out;
  node.visit([&](const auto& concrete) { out << concrete; });
  return out.str();
}

// ---------------------------------------------------------------------------------------
// What each type of value does.

namespace {

// at() only takes the address of the value; reading through it from a const config is safe.
ValueRef value_of(const ConfigKey& key, const RunConfig& config) {
  return key.at(const_cast<RunConfig&>(config));
}

double number_of(const toml::node& node) {
  return node.is_integer() ? static_cast<double>(node.as_integer()->get())
                           : node.as_floating_point()->get();
}

// "positive", "at least 1", ...: what a value below the range's minimum must be.
std::string lower_bound_words(const Range& r) {
  if (r.min == 0 && r.min_open) {
    return r.unit ? std::string("a positive number of ") + r.unit : std::string("positive");
  }
  if (r.min == 0) return "non-negative";
  return (r.min_open ? "greater than " : "at least ") + config_bound_text(r.min);
}

// "must be positive", "must be in [0, 1)", ...: "" when `value` is in the range.
std::string range_words(const Range& r, double value, bool integer) {
  const std::string interval = std::string(r.min_open ? "(" : "[") + config_bound_text(r.min) +
                               ", " + config_bound_text(r.max) + ")";
  if (!integer && !std::isfinite(value)) {
    return r.has_max && r.max_open ? "must be a finite number in " + interval
                                   : std::string("must be a finite number");
  }
  const bool below = r.has_min && (r.min_open ? !(value > r.min) : !(value >= r.min));
  const bool above = r.has_max && (r.max_open ? !(value < r.max) : !(value <= r.max));
  if (!below && !above) return "";
  if (r.has_max && r.max_open) return "must be in " + interval;
  if (above) return "must be at most " + config_bound_text(r.max);
  return "must be " + lower_bound_words(r);
}

std::string zero_note(const Range& r) {
  return r.zero ? std::string(" (0: ") + r.zero + ")" : std::string();
}

template <class Value>
std::optional<KeyProblem> out_of_range(const Range& r, Value value) {
  const std::string words =
      range_words(r, static_cast<double>(value), std::is_integral<Value>::value);
  if (words.empty()) return std::nullopt;
  return problem(words, zero_note(r), ", got ", value);
}

std::optional<KeyProblem> read_choice(ChoiceRef& ref, const toml::node& node) {
  if (!node.is_string()) return wrong_type(node, "a string");
  const std::string& name = node.as_string()->get();
  if (ref.unset_name && name == ref.unset_name) {
    ref.set(ref.field, -1);
    return std::nullopt;
  }
  for (const auto& [option, value] : ref.options) {
    if (option == name) {
      ref.set(ref.field, value);
      return std::nullopt;
    }
  }
  std::vector<std::string> names;
  if (ref.unset_name) names.push_back(ref.unset_name);
  for (const auto& option : ref.options) names.push_back(option.first);
  return problem("must be one of ", join(names, " | "), ", got \"", name, "\"");
}

// What the entries of an array of integers must be: "positive integers", ...
std::string entries_words(const Range& range) {
  if (!range.has_min) return "integers";
  return lower_bound_words(range) == "at least 1" || lower_bound_words(range) == "positive"
             ? "positive integers"
             : "integers " + lower_bound_words(range);
}

std::optional<KeyProblem> read_integers(std::vector<int64_t>& values, const toml::node& node,
                                        const Range& range) {
  const std::string entries = entries_words(range);
  if (!node.is_array()) return wrong_type(node, "an array of " + entries);
  const toml::array& array = *node.as_array();
  values.clear();
  for (size_t i = 0; i < array.size(); ++i) {
    if (!array[i].is_integer()) {
      KeyProblem p =
          problem("entries must be ", entries, ", got ", render_node(array[i]), " at index ", i);
      p.index = i;
      return p;
    }
    values.push_back(array[i].as_integer()->get());
  }
  return std::nullopt;
}

// A file, or a list of files and globs (data.path, data.test_path).
std::optional<KeyProblem> read_paths(std::vector<std::string>& paths, const toml::node& node) {
  const char* expected = "a file name (or glob) or an array of them";
  if (node.is_string()) {
    paths = {node.as_string()->get()};
    return std::nullopt;
  }
  if (!node.is_array()) return wrong_type(node, expected);
  paths.clear();
  const toml::array& array = *node.as_array();
  for (size_t i = 0; i < array.size(); ++i) {
    if (!array[i].is_string() || array[i].as_string()->get().empty()) {
      KeyProblem p = problem("must be ", expected, ", got ", render_node(node));
      p.index = i;
      return p;
    }
    paths.push_back(array[i].as_string()->get());
  }
  if (paths.empty()) return problem("is an empty array: name at least one file");
  return std::nullopt;
}

}  // namespace

std::optional<KeyProblem> read_key(const ConfigKey& key, const toml::node& node,
                                   RunConfig& config) {
  if (key.read) return key.read(key, node, config);
  ValueRef value = key.at(config);
  if (auto* v = std::get_if<int64_t*>(&value)) {
    if (!node.is_integer()) return wrong_type(node, "an integer");
    **v = node.as_integer()->get();
  } else if (auto* v = std::get_if<std::optional<int64_t>*>(&value)) {
    if (!node.is_integer()) return wrong_type(node, "an integer");
    **v = node.as_integer()->get();
  } else if (auto* v = std::get_if<uint64_t*>(&value)) {
    if (!node.is_integer()) return wrong_type(node, "an integer");
    const int64_t read = node.as_integer()->get();
    if (read < 0) return problem("must be non-negative, got ", read);
    **v = static_cast<uint64_t>(read);
  } else if (auto* v = std::get_if<double*>(&value)) {
    if (!node.is_number()) return wrong_type(node, "a number");
    **v = number_of(node);
  } else if (auto* v = std::get_if<bool*>(&value)) {
    if (!node.is_boolean()) return wrong_type(node, "true or false");
    **v = node.as_boolean()->get();
  } else if (auto* v = std::get_if<std::string*>(&value)) {
    if (!node.is_string()) return wrong_type(node, "a string");
    **v = node.as_string()->get();
    if (key.empty_is_unset && (*v)->empty()) {
      return problem("must not be empty (leave the key out for its default)");
    }
  } else if (auto* v = std::get_if<std::vector<int64_t>*>(&value)) {
    return read_integers(**v, node, key.range);
  } else if (auto* v = std::get_if<std::vector<std::string>*>(&value)) {
    return read_paths(**v, node);
  } else if (auto* v = std::get_if<std::pair<double, double>*>(&value)) {
    const toml::array* array = node.as_array();
    if (!array || array->size() != 2 || !(*array)[0].is_number() || !(*array)[1].is_number()) {
      return problem("must be an array of two numbers, got ", render_node(node));
    }
    **v = {number_of((*array)[0]), number_of((*array)[1])};
  } else if (auto* v = std::get_if<ChoiceRef>(&value)) {
    return read_choice(*v, node);
  }
  return std::nullopt;
}

void write_value(const ConfigKey& key, const RunConfig& config, toml::table& section) {
  if (key.write) return key.write(key, config, section);
  const ValueRef value = value_of(key, config);
  const char* name = key.name;
  if (auto* v = std::get_if<int64_t*>(&value)) {
    section.insert(name, **v);
  } else if (auto* v = std::get_if<std::optional<int64_t>*>(&value)) {
    if (**v) section.insert(name, ***v);
  } else if (auto* v = std::get_if<uint64_t*>(&value)) {
    section.insert(name, static_cast<int64_t>(**v));
  } else if (auto* v = std::get_if<double*>(&value)) {
    section.insert(name, **v);
  } else if (auto* v = std::get_if<bool*>(&value)) {
    section.insert(name, **v);
  } else if (auto* v = std::get_if<std::string*>(&value)) {
    if (!(key.empty_is_unset && (*v)->empty())) section.insert(name, **v);
  } else if (auto* v = std::get_if<std::vector<int64_t>*>(&value)) {
    toml::array array;
    for (int64_t entry : **v) array.push_back(entry);
    section.insert(name, std::move(array));
  } else if (auto* v = std::get_if<std::vector<std::string>*>(&value)) {
    if ((*v)->size() == 1) section.insert(name, (*v)->front());
    if ((*v)->size() > 1) {
      toml::array array;
      for (const std::string& entry : **v) array.push_back(entry);
      section.insert(name, std::move(array));
    }
  } else if (auto* v = std::get_if<std::pair<double, double>*>(&value)) {
    section.insert(name, toml::array{(*v)->first, (*v)->second});
  } else if (auto* v = std::get_if<ChoiceRef>(&value)) {
    const int current = v->get(v->field);
    if (current < 0) {
      if (v->unset_name) section.insert(name, std::string(v->unset_name));
      return;
    }
    for (const auto& [option, option_value] : v->options) {
      if (option_value == current) section.insert(name, option);
    }
  }
}

bool same_value(const ConfigKey& key, const RunConfig& a, const RunConfig& b) {
  toml::table in_a, in_b;
  write_value(key, a, in_a);
  write_value(key, b, in_b);
  return in_a == in_b;
}

void write_key(const ConfigKey& key, const RunConfig& config, toml::table& section) {
  if (key.not_for && key.not_for(config)) return;
  if (key.omit_default && same_value(key, config, RunConfig{})) return;
  write_value(key, config, section);
}

std::optional<KeyProblem> check_key(const ConfigKey& key, const RunConfig& config, bool given,
                                    const KeyNames& names) {
  if (const char* reason = key.not_for ? key.not_for(config) : nullptr) {
    if (given) return problem(reason);
    return std::nullopt;  // a key of the other kind, unused: its value does not matter
  }
  if (key.required && !given) return problem(key.required);
  if (key.at) {
    const ValueRef value = value_of(key, config);
    std::optional<KeyProblem> found;
    if (auto* v = std::get_if<int64_t*>(&value)) {
      found = out_of_range(key.range, **v);
    } else if (auto* v = std::get_if<std::optional<int64_t>*>(&value)) {
      if (**v) found = out_of_range(key.range, ***v);
    } else if (auto* v = std::get_if<double*>(&value)) {
      found = out_of_range(key.range, **v);
    } else if (auto* v = std::get_if<std::string*>(&value)) {
      if (key.range.non_empty && (*v)->empty()) found = problem("must not be empty");
      if (!found && key.names && !(*v)->empty() && !contains(key.names(), **v)) {
        found = problem("must be one of ", join(key.names(), " | "), ", got \"", **v, "\"");
      }
    } else if (auto* v = std::get_if<std::vector<int64_t>*>(&value)) {
      for (size_t i = 0; i < (*v)->size() && !found; ++i) {
        if (!range_words(key.range, static_cast<double>((**v)[i]), true).empty()) {
          found = problem("entries must be ", entries_words(key.range), ", got ", (**v)[i],
                          " at index ", i);
          found->index = i;
        }
      }
    } else if (auto* v = std::get_if<std::pair<double, double>*>(&value)) {
      for (double entry : {(*v)->first, (*v)->second}) {
        const std::string words = range_words(key.range, entry, false);
        if (!found && !words.empty()) {
          found = problem("must each ", words.substr(std::string("must ").size()), ", got [",
                          (*v)->first, ", ", (*v)->second, "]");
        }
      }
    }
    if (found) return found;
  }
  if (key.check) return key.check(key, config, names);
  return std::nullopt;
}

void complete_config(RunConfig& config, bool from_file) {
  if (config.run.output_dir.empty()) config.run.output_dir = "runs/" + config.run.name;
  if (config.checkpoint.dir.empty()) config.checkpoint.dir = config.run.output_dir + "/checkpoints";
  config.data.x_key = canonical_dataset_key(config.data.x_key);
  config.data.y_key = canonical_dataset_key(config.data.y_key);
  if (!config.data.dy_key.empty()) config.data.dy_key = canonical_dataset_key(config.data.dy_key);
  config.data.sparse_key = canonical_dataset_key(config.data.sparse_key);
  if (!from_file) return;  // a run made in code resolves these from the data it loads
  if (!config.model.loss && config.model.kind == ModelKind::dlrm) {
    config.model.loss = LossKind::binary_cross_entropy;  // a click model
  }
  if (!config.model.loss) {
    config.model.loss =
        config.data.source == DataSource::synthetic ? LossKind::mse : LossKind::cross_entropy;
  }
  if (config.data.source == DataSource::fashion_mnist && config.data.path.empty()) {
    config.data.path = {kFashionMnistDefaultPath};
  }
}

}  // namespace meshtrain
