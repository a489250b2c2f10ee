// Reads a run's parsed TOML (docs/design.md, "Configuration (TOML)") into a RunConfig, by the
// schema (config_schema.hpp): the sections and keys it knows, then each key's value by its
// type, then each key's checks, the ones check_config makes for a config made in code. Every
// error is a bad_input Error that names the file, the line and the key
// ("configs/x.toml:12: [optimizer] lr must be positive, got -0.1"). Values set with --set carry
// their override as their source, so their errors name it.

#include <sstream>

#include "base/error.hpp"
#include "base/text.hpp"
#include "framework/train/config_schema.hpp"

namespace meshtrain {
namespace {

// Reads one parsed file. Holds the file name for messages.
class Reader {
 public:
  Reader(const toml::table& root, std::string file) : root_(root), file_(std::move(file)) {}

  // "file:line" for a node read from the file; "file (--set k=v)" for one from an override.
  std::string at(const toml::source_region& source) const {
    if (source.path && *source.path != file_) return file_ + " (" + *source.path + ")";
    if (source.begin.line > 0) return file_ + ":" + std::to_string(source.begin.line);
    return file_;
  }

  const toml::node* find(const ConfigKey& key) const {
    const toml::table* section = root_.get_as<toml::table>(key.section);
    return section ? section->get(key.name) : nullptr;
  }

  // Unknown sections, keys outside a section and unknown keys, at the line of the key.
  void check_structure() const {
    const std::vector<std::string> sections = config_section_names();
    for (const auto& [key, node] : root_) {
      const std::string name(key.str());
      if (!contains(sections, name)) {
        if (node.is_table()) {
          MESHTRAIN_BAD_INPUT(at(key.source()), ": unknown section [", name,
                              "] (known sections: ", join(sections), ")");
        }
        MESHTRAIN_BAD_INPUT(at(key.source()), ": key '", name,
                            "' must be inside a section (known sections: ", join(sections), ")");
      }
      if (!node.is_table()) {
        MESHTRAIN_BAD_INPUT(at(key.source()), ": '", name, "' must be a section [", name, "], got ",
                            toml_type_name(node.type()), " ", render_node(node));
      }
      const std::vector<std::string> keys = config_key_names(name);
      for (const auto& [inner, value] : *node.as_table()) {
        if (!contains(keys, std::string(inner.str()))) {
          MESHTRAIN_BAD_INPUT(at(inner.source()), ": [", name, "] unknown key '", inner.str(),
                              "' (known keys: ", join(keys), ")");
        }
      }
    }
  }

  // Throws "<file:line>: [section] key <message>" at the key's value (at the entry or member
  // the problem is about), or at the section when the file does not give the key.
  [[noreturn]] void fail(const ConfigKey& key, const KeyProblem& problem) const {
    const toml::node* node = find(key);
    if (node && problem.index && node->is_array()) {
      const toml::array& array = *node->as_array();
      // Entries of an array given with --set may have no line of their own.
      if (*problem.index < array.size() && array[*problem.index].source().begin.line > 0) {
        node = &array[*problem.index];
      }
    }
    if (node && !problem.member.empty() && node->is_table()) {
      if (const toml::node* member = node->as_table()->get(problem.member)) node = member;
    }
    const toml::table* section = root_.get_as<toml::table>(key.section);
    const std::string where = node ? at(node->source()) : section ? at(section->source()) : file_;
    if (!problem.subject.empty()) {
      MESHTRAIN_BAD_INPUT(where, ": [", key.section, "] ", problem.subject, ": ", problem.message);
    }
    MESHTRAIN_BAD_INPUT(where, ": [", key.section, "] ", key.name, " ", problem.message);
  }

 private:
  const toml::table& root_;
  std::string file_;
};

}  // namespace

RunConfig read_config(const toml::table& root, const std::string& file) {
  const Reader reader(root, file);
  reader.check_structure();

  RunConfig config;
  config.file = file;
  std::ostringstream effective;
  effective << root;
  config.text = effective.str();
  // Every mesh axis, in mesh order; those the file does not give have size 1.
  for (const std::string& axis : Mesh::known_axes()) config.mesh.axes.emplace_back(axis, 1);
  config.mesh.source = file + " [mesh]";

  for (const ConfigKey& key : config_keys()) {
    if (const toml::node* node = reader.find(key)) {
      if (const std::optional<KeyProblem> problem = read_key(key, *node, config)) {
        reader.fail(key, *problem);
      }
    }
  }
  complete_config(config, /*from_file=*/true);
  for (const ConfigKey& key : config_keys()) {
    const KeyNames names{key.section, /*in_file=*/true};
    if (const auto problem = check_key(key, config, reader.find(key) != nullptr, names)) {
      reader.fail(key, *problem);
    }
  }
  check_config_products(config);
  return config;
}

}  // namespace meshtrain
