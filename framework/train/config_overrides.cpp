// The --set overrides of a run's TOML (docs/configs.md): "section.key=value", the value read
// as a TOML value or, when it is not one, as a bare string.

#include <algorithm>
#include <set>
#include <sstream>

#include "base/error.hpp"
#include "base/text.hpp"
#include "framework/train/config_toml.hpp"

namespace meshtrain {
namespace {

// Applies one "section.key=value" override to the parsed file. The value keeps the
// override text as its source, so later errors about it name the override. Returns
// "section.key".
std::string apply_override(toml::table& root, const std::string& override_text,
                           const std::string& file) {
  const std::string origin = "--set " + override_text;
  const size_t equals = override_text.find('=');
  if (equals == std::string::npos) {
    MESHTRAIN_BAD_INPUT(file, ": override '", override_text,
                        "' must look like section.key=value (e.g. train.steps=20)");
  }
  auto trim = [](std::string text) {
    const char* space = " \t";
    text.erase(0, text.find_first_not_of(space));
    text.erase(text.find_last_not_of(space) + 1);
    return text;
  };
  const std::string path = trim(override_text.substr(0, equals));
  const std::string value_text = trim(override_text.substr(equals + 1));

  std::vector<std::string> parts;
  std::stringstream split(path);
  for (std::string part; std::getline(split, part, '.');) parts.push_back(part);
  if (parts.size() < 2 || !config_schema_keys(parts[0])) {
    MESHTRAIN_BAD_INPUT(file, ": override '", override_text, "' does not name a section.key (",
                        "known sections: ", join(config_section_names()), ")");
  }
  const std::vector<std::string>& keys = *config_schema_keys(parts[0]);
  const bool logical_axis =
      parts.size() == 3 && parts[0] == "partition" && parts[1] == "logical_axes";
  const bool known = std::find(keys.begin(), keys.end(), parts[1]) != keys.end();
  if (!known || (parts.size() > 2 && !logical_axis)) {
    MESHTRAIN_BAD_INPUT(file, ": override '", override_text, "' names unknown key '", path, "' ([",
                        parts[0], "] keys: ", join(keys), ")");
  }

  // The value as TOML ("20", "[784, 256, 10]", "\"runs/a\""), else as a bare string.
  toml::table parsed;
  bool is_toml = false;
  try {
    parsed = toml::parse("v = " + value_text + "\n", origin);
    is_toml = parsed.size() == 1 && parsed.contains("v");
  } catch (const toml::parse_error&) {
  }
  if (!is_toml) {
    toml::table as_string;
    as_string.insert("v", value_text);
    std::ostringstream text;
    text << as_string;
    parsed = toml::parse(text.str(), origin);
  }
  toml::node* value = parsed.get("v");

  toml::table* target = &root;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    toml::node* existing = target->get(parts[i]);
    if (!existing) {
      target = target->insert(parts[i], toml::table{}).first->second.as_table();
    } else if (existing->is_table()) {
      target = existing->as_table();
    } else {
      MESHTRAIN_BAD_INPUT(file, ": override '", override_text, "' cannot set a key inside '",
                          parts[i], "', which is ", toml_type_name(existing->type()));
    }
  }
  // Moving the node keeps its source (the override); copying would drop it.
  value->visit(
      [&](auto& concrete) { target->insert_or_assign(parts.back(), std::move(concrete)); });
  return parts[0] + "." + parts[1];
}

}  // namespace

void apply_overrides(toml::table& root, const std::vector<std::string>& overrides,
                     const std::string& file) {
  std::set<std::string> overridden;
  for (const std::string& override_text : overrides) {
    overridden.insert(apply_override(root, override_text, file));
  }
  // Overriding one of train.epochs / train.steps replaces the other.
  if (toml::table* train = root.get_as<toml::table>("train")) {
    const bool steps = overridden.count("train.steps") > 0;
    const bool epochs = overridden.count("train.epochs") > 0;
    if (steps && !epochs) train->erase("epochs");
    if (epochs && !steps) train->erase("steps");
  }
}

}  // namespace meshtrain
