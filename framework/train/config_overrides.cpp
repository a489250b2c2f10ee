// The --set overrides of a run's TOML (docs/configs.md), parsed one way for every command:
// "section.key=value", spaces around the key and the value allowed, the value read as a TOML
// value or, when it is not one, as a bare string. Which commands may change which keys is the
// schema's (ConfigKey::set_by).

#include <algorithm>
#include <set>
#include <sstream>

#include "base/error.hpp"
#include "base/text.hpp"
#include "framework/train/config_schema.hpp"

namespace meshtrain {
namespace {

// The override's key and value, or what is wrong with it (the words after "override '...' ").
struct Split {
  std::vector<std::string> path;
  std::string value;
  const ConfigKey* key = nullptr;
  std::string problem;
};

Split split_override(const std::string& override_text) {
  Split split;
  const size_t equals = override_text.find('=');
  if (equals == std::string::npos) {
    split.problem = "must look like section.key=value (e.g. train.steps=20)";
    return split;
  }
  const std::string path = trim(override_text.substr(0, equals));
  split.value = trim(override_text.substr(equals + 1));
  std::stringstream parts(path);
  for (std::string part; std::getline(parts, part, '.');) split.path.push_back(trim(part));
  const std::vector<std::string> sections = config_section_names();
  const bool known_section = !split.path.empty() && std::find(sections.begin(), sections.end(),
                                                              split.path[0]) != sections.end();
  if (split.path.size() < 2 || !known_section) {
    split.problem = "does not name a section.key (known sections: " + join(sections) + ")";
    return split;
  }
  split.key = find_config_key(split.path[0], split.path[1]);
  if (!split.key || (split.path.size() > 2 && !(split.key->members && split.path.size() == 3))) {
    split.key = nullptr;
    split.problem = "names unknown key '" + path + "' ([" + split.path[0] +
                    "] keys: " + join(config_key_names(split.path[0])) + ")";
  }
  return split;
}

// Applies one override to the parsed file. The value keeps the override text as its source,
// so later errors about it name the override.
void apply_override(toml::table& root, const ConfigOverride& override_value,
                    const std::string& override_text, const std::string& file) {
  const std::string origin = "--set " + override_text;
  // The value as TOML ("20", "[784, 256, 10]", "\"runs/a\""), else as a bare string.
  toml::table parsed;
  bool is_toml = false;
  try {
    parsed = toml::parse("v = " + override_value.value + "\n", origin);
    is_toml = parsed.size() == 1 && parsed.contains("v");
  } catch (const toml::parse_error&) {
  }
  if (!is_toml) {
    toml::table as_string;
    as_string.insert("v", override_value.value);
    std::ostringstream text;
    text << as_string;
    parsed = toml::parse(text.str(), origin);
  }
  toml::node* value = parsed.get("v");

  const std::vector<std::string>& path = override_value.path;
  toml::table* target = &root;
  for (size_t i = 0; i + 1 < path.size(); ++i) {
    toml::node* existing = target->get(path[i]);
    if (!existing) {
      target = target->insert(path[i], toml::table{}).first->second.as_table();
    } else if (existing->is_table()) {
      target = existing->as_table();
    } else {
      MESHTRAIN_BAD_INPUT(file, ": override '", override_text, "' cannot set a key inside '",
                          path[i], "', which is ", toml_type_name(existing->type()));
    }
  }
  // Moving the node keeps its source (the override); copying would drop it.
  value->visit([&](auto& concrete) { target->insert_or_assign(path.back(), std::move(concrete)); });
}

}  // namespace

const char* to_string(ConfigCommand command) {
  switch (command) {
    case ConfigCommand::train:
      return "train";
    case ConfigCommand::plan:
      return "plan";
    case ConfigCommand::calibrate:
      return "calibrate";
    case ConfigCommand::predict:
      return "predict";
    case ConfigCommand::evaluate:
      return "evaluate";
  }
  return "?";
}

ConfigOverride parse_override(const std::string& override_text, const std::string& file) {
  Split split = split_override(override_text);
  if (!split.problem.empty()) {
    MESHTRAIN_BAD_INPUT(file, ": override '", override_text, "' ", split.problem);
  }
  return ConfigOverride{std::move(split.path), std::move(split.value), split.key};
}

std::string override_key(const std::string& override_text) {
  return join(split_override(override_text).path, ".");
}

std::string overridable_keys(ConfigCommand command) {
  std::vector<std::string> allowed;
  for (const std::string& section : config_section_names()) {
    std::vector<std::string> keys;
    bool all = true;
    for (const ConfigKey& key : config_keys()) {
      if (section != key.section) continue;
      const bool takes = (key.set_by & command_bit(command)) != 0;
      all = all && takes;
      if (takes) keys.push_back(section + "." + key.name);
    }
    if (all) keys = {section + ".*"};
    allowed.insert(allowed.end(), keys.begin(), keys.end());
  }
  return join(allowed);
}

void check_overrides(const std::vector<std::string>& overrides, ConfigCommand command) {
  for (const std::string& override_text : overrides) {
    const Split split = split_override(override_text);
    if (!split.key || (split.key->set_by & command_bit(command))) continue;
    const std::string key = split.path[0] + "." + split.path[1];
    const char* name = to_string(command);
    MESHTRAIN_BAD_INPUT("--set ", key, " is not allowed with ", name, ": ", key,
                        " cannot be changed when ", name,
                        " reads a checkpoint (its model, and what its data means, are the "
                        "checkpoint's); ",
                        name, " takes --set of ", overridable_keys(command));
  }
}

std::vector<std::string> apply_overrides(toml::table& root,
                                         const std::vector<std::string>& overrides,
                                         const std::string& file) {
  std::set<std::string> overridden;
  for (const std::string& override_text : overrides) {
    const ConfigOverride parsed = parse_override(override_text, file);
    apply_override(root, parsed, override_text, file);
    overridden.insert(parsed.key_name());
  }
  // Overriding one of train.epochs / train.steps replaces the other (docs/configs.md).
  std::vector<std::string> notes;
  if (toml::table* train = root.get_as<toml::table>("train")) {
    const bool steps = overridden.count("train.steps") > 0;
    const bool epochs = overridden.count("train.epochs") > 0;
    for (auto [set, replaced] :
         {std::pair{steps && !epochs, "epochs"}, std::pair{epochs && !steps, "steps"}}) {
      const toml::node* dropped = set ? train->get(replaced) : nullptr;
      if (!dropped) continue;
      const char* given = std::string(replaced) == "epochs" ? "steps" : "epochs";
      notes.push_back(detail::concat("--set train.", given, " = ", render_node(*train->get(given)),
                                     " replaces train.", replaced, " = ", render_node(*dropped),
                                     " of ", file));
      train->erase(replaced);
    }
  }
  return notes;
}

std::string override_key_path(const std::string& override_text, const std::string& file) {
  return join(parse_override(override_text, file).path, ".");
}

}  // namespace meshtrain
