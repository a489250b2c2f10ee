#pragma once
// What the run config's TOML files share (not installed): the schema, the --set overrides
// (config_overrides.cpp) and the reader of a parsed file (config_reader.cpp), which
// parse_config (config.cpp) runs in this order.

#include <string>
#include <utility>
#include <vector>

#include <toml++/toml.h>

#include "framework/train/config.hpp"

namespace meshtrain {

// Every section of a run's TOML and its keys, in the order the documentation lists them.
using ConfigSchema = std::vector<std::pair<std::string, std::vector<std::string>>>;
const ConfigSchema& config_schema();
// The keys of `section`; nullptr for a section the schema does not have.
const std::vector<std::string>* config_schema_keys(const std::string& section);
std::vector<std::string> config_section_names();

// "a table", "an integer", ...: what a message says a node is.
const char* toml_type_name(toml::node_type type);

// Applies each "section.key=value" override to the parsed `file` (docs/configs.md). An
// override of train.steps drops the file's train.epochs (and the other way round) unless
// both are overridden.
void apply_overrides(toml::table& root, const std::vector<std::string>& overrides,
                     const std::string& file);

// Reads and checks every key of a parsed file into a RunConfig (config.text is the file's
// text as `root` holds it).
RunConfig read_config(const toml::table& root, const std::string& file);

}  // namespace meshtrain
