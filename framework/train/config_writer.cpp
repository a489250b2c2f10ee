// What the schema (config_schema.hpp) writes: config_to_toml, the TOML text of a RunConfig
// (every key that has a value, each option by its name; checkpoints store it for runs made in
// code), and config_keys_markdown, the key table of docs/configs.md.

#include <sstream>

#include "base/text.hpp"
#include "framework/train/config_schema.hpp"

namespace meshtrain {

std::string config_to_toml(const RunConfig& config) {
  toml::table root;
  for (const ConfigSection& section : config_sections()) root.insert(section.name, toml::table{});
  for (const ConfigKey& key : config_keys()) {
    write_key(key, config, *root.get_as<toml::table>(key.section));
  }
  std::ostringstream out;
  out << root;
  return out.str();
}

std::string toml_string_value(const std::string& text) {
  std::ostringstream out;
  out << toml::value<std::string>(text);
  return out.str();
}

namespace {

// A Markdown table cell: '|' escaped.
std::string cell(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '|') out += '\\';
    out += c;
  }
  return out;
}

// A value as the docs write it: "relu" in double quotes, 0.9 rather than TOML's
// 0.90000000000000002.
std::string docs_value(const toml::node& value) {
  if (value.is_string()) return "\"" + value.as_string()->get() + "\"";
  if (value.is_floating_point()) {
    std::ostringstream out;
    out << value.as_floating_point()->get();
    return out.str();
  }
  if (const toml::array* array = value.as_array()) {
    std::vector<std::string> entries;
    for (const toml::node& entry : *array) entries.push_back(docs_value(entry));
    return "[" + join(entries) + "]";
  }
  return render_node(value);
}

// The default as the docs say it: the value a RunConfig starts with.
std::string default_text(const ConfigKey& key) {
  if (key.default_text) return key.default_text;
  toml::table section;
  write_value(key, RunConfig{}, section);
  const toml::node* value = section.get(key.name);
  return value ? "`" + docs_value(*value) + "`" : "unset";
}

std::string type_text(const ConfigKey& key) {
  if (key.type) return key.type;
  RunConfig scratch;
  const ValueRef value = key.at(scratch);
  if (std::holds_alternative<int64_t*>(value) ||
      std::holds_alternative<std::optional<int64_t>*>(value) ||
      std::holds_alternative<uint64_t*>(value)) {
    return "integer";
  }
  if (std::holds_alternative<double*>(value)) return "number";
  if (std::holds_alternative<bool*>(value)) return "boolean";
  if (std::holds_alternative<std::string*>(value)) return key.names ? "name" : "string";
  if (std::holds_alternative<std::vector<int64_t>*>(value)) return "[integer, ...]";
  if (std::holds_alternative<std::vector<std::string>*>(value)) return "string or [string, ...]";
  if (std::holds_alternative<std::pair<double, double>*>(value)) return "[number, number]";
  return "name";
}

std::string range_text(const Range& r) {
  const auto number = config_bound_text;
  std::string text;
  if (r.has_min && r.has_max && !r.min_open && !r.max_open && r.max - r.min == 1) {
    text = number(r.min) + " or " + number(r.max);
  } else if (r.has_min && r.has_max) {
    text = r.max_open ? (r.min_open ? "(" : "[") + number(r.min) + ", " + number(r.max) + ")"
                      : number(r.min) + " to " + number(r.max);
  } else if (r.has_min) {
    text = (r.min_open ? "> " : ">= ") + number(r.min);
  }
  if (r.unit) text += std::string(" ") + r.unit;
  if (r.non_empty) text = "not empty";
  if (r.zero) text += std::string(" (0: ") + r.zero + ")";
  return text;
}

std::string base_values_text(const ConfigKey& key) {
  if (key.values) return key.values;
  if (key.names) return join(key.names(), " | ");
  if (key.at) {
    RunConfig scratch;
    const ValueRef value = key.at(scratch);
    if (const auto* choice = std::get_if<ChoiceRef>(&value)) {
      std::vector<std::string> names;
      if (choice->unset_name) names.push_back(choice->unset_name);
      for (const auto& option : choice->options) names.push_back(option.first);
      return join(names, " | ");
    }
    if (std::holds_alternative<bool*>(value)) return "true | false";
    if (std::holds_alternative<std::vector<int64_t>*>(value) && key.range.has_min) {
      return "entries " + range_text(key.range);
    }
    if (std::holds_alternative<std::pair<double, double>*>(value)) {
      return "each " + range_text(key.range);
    }
  }
  return range_text(key.range);
}

// What the key may be, and its rule with other keys ("at most optimizer.lr").
std::string values_text(const ConfigKey& key) {
  const std::string values = base_values_text(key);
  if (!key.rule) return values;
  return values.empty() ? key.rule : values + "; " + key.rule;
}

std::string commands_text(CommandSet set_by) {
  if (set_by == kEveryCommand) return "every command";
  std::vector<std::string> names;
  for (ConfigCommand command : {ConfigCommand::train, ConfigCommand::plan, ConfigCommand::calibrate,
                                ConfigCommand::predict, ConfigCommand::evaluate}) {
    if (set_by & command_bit(command)) names.push_back(to_string(command));
  }
  return join(names);
}

}  // namespace

std::string config_keys_markdown() {
  std::ostringstream out;
  for (const ConfigSection& section : config_sections()) {
    out << "\n#### [" << section.name << "]\n\nExplained in " << section.explained << ".\n\n"
        << "| key | type | default | values | `--set` with | meaning |\n"
        << "|---|---|---|---|---|---|\n";
    for (const ConfigKey& key : config_keys()) {
      if (std::string(key.section) != section.name) continue;
      out << "| `" << key.name << "` | " << cell(type_text(key)) << " | " << cell(default_text(key))
          << " | " << cell(values_text(key)) << " | " << commands_text(key.set_by) << " | "
          << cell(key.doc) << " |\n";
    }
  }
  return out.str();
}

}  // namespace meshtrain
