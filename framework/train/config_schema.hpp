#pragma once
// The run config's schema: every key of a run's TOML, once, in one table (config_keys(), in
// config_schema.cpp). Not installed: it includes toml++.
//
// A ConfigKey is plain data: its section and name, where its value lives in a RunConfig (and
// so its type), its range or choices, a one-line meaning, which commands may change it with
// --set and, where they exist, its rules with other keys. From the table come
//   - the TOML reader (config_reader.cpp): unknown sections and keys, then each key's type,
//     then each key's checks, every error at the key's line;
//   - check_config (config_check.cpp): the same checks for a RunConfig made in code;
//   - config_to_toml (config_writer.cpp), and docs/configs.md's key table (config_keys_markdown);
//   - --set for every command (config_overrides.cpp): one parser, and each key's commands.
// What each type of value does (read, write, check) is config_values.cpp. A key's rules live
// here only: code that uses a checked RunConfig trusts its values.
//
// Adding a key: its field in config.hpp's section struct (with its default) and one entry in
// config_keys(); docs/configs.md's table is then regenerated (docs/configs.md says how).

#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include <toml++/toml.h>

#include "base/error.hpp"
#include "framework/core/choices.hpp"
#include "framework/train/config.hpp"

namespace meshtrain {

// data.path when data.source = "fashion_mnist" and the config gives none.
inline constexpr char kFashionMnistDefaultPath[] = "/usr/share/datasets/fashion-mnist";

// A set of ConfigCommand bits: which commands may change a key with --set.
using CommandSet = unsigned;
constexpr CommandSet command_bit(ConfigCommand command) {
  return 1u << static_cast<unsigned>(command);
}
// train, plan and calibrate read a config file: they may change every key.
constexpr CommandSet kFileCommands = command_bit(ConfigCommand::train) |
                                     command_bit(ConfigCommand::plan) |
                                     command_bit(ConfigCommand::calibrate);
// predict and evaluate too: keys that change neither the model nor what its data means.
constexpr CommandSet kEveryCommand =
    kFileCommands | command_bit(ConfigCommand::predict) | command_bit(ConfigCommand::evaluate);

// What an integer or number key may be (both bounds inclusive unless open), and the words its
// messages and the docs use.
struct Range {
  bool has_min = false, has_max = false;
  double min = 0, max = 0;
  bool min_open = false, max_open = false;
  const char* unit = nullptr;  // "MiB": "must be a positive number of MiB"
  const char* zero = nullptr;  // what 0 means where it means something: "off"
  bool non_empty = false;      // a string key: "" is refused
};
constexpr Range any_value() {
  return {};
}
constexpr Range at_least(double min, const char* zero = nullptr) {
  Range r;
  r.has_min = true;
  r.min = min;
  r.zero = zero;
  return r;
}
constexpr Range non_negative(const char* zero = nullptr) {
  return at_least(0, zero);
}
constexpr Range positive(const char* unit = nullptr) {
  Range r = at_least(0);
  r.min_open = true;
  r.unit = unit;
  return r;
}
// [min, max], or [min, max) with max_open.
constexpr Range between(double min, double max, bool max_open, const char* zero = nullptr) {
  Range r = at_least(min, zero);
  r.has_max = true;
  r.max = max;
  r.max_open = max_open;
  return r;
}
constexpr Range not_empty() {
  Range r;
  r.non_empty = true;
  return r;
}

// An enum key: its value as an int, and the names of its values (framework/core/choices.hpp).
struct ChoiceRef {
  void* field = nullptr;
  int (*get)(const void* field) = nullptr;  // -1: unset (an optional enum)
  void (*set)(void* field, int value) = nullptr;
  std::vector<std::pair<std::string, int>> options;
  bool optional = false;
  const char* unset_name = nullptr;  // the name that means unset ("auto"); nullptr: left out
};

// Where a key's value lives in a RunConfig, by its type. monostate: the key reads and writes
// itself (ConfigKey::read, ConfigKey::write).
using ValueRef = std::variant<std::monostate, int64_t*, std::optional<int64_t>*, uint64_t*, double*,
                              bool*, std::string*, std::vector<int64_t>*, std::vector<std::string>*,
                              std::pair<double, double>*, ChoiceRef>;

template <class Enum>
ChoiceRef choice(Enum& field, const ChoiceTable<Enum>& table) {
  ChoiceRef ref;
  ref.field = &field;
  ref.get = [](const void* f) { return static_cast<int>(*static_cast<const Enum*>(f)); };
  ref.set = [](void* f, int v) { *static_cast<Enum*>(f) = static_cast<Enum>(v); };
  for (const auto& [name, value] : table) ref.options.emplace_back(name, static_cast<int>(value));
  return ref;
}
template <class Enum>
ChoiceRef choice(std::optional<Enum>& field, const ChoiceTable<Enum>& table,
                 const char* unset_name) {
  ChoiceRef ref;
  ref.field = &field;
  ref.get = [](const void* f) {
    const auto& value = *static_cast<const std::optional<Enum>*>(f);
    return value ? static_cast<int>(*value) : -1;
  };
  ref.set = [](void* f, int v) {
    auto& value = *static_cast<std::optional<Enum>*>(f);
    if (v < 0) {
      value.reset();
    } else {
      value = static_cast<Enum>(v);
    }
  };
  for (const auto& [name, value] : table) ref.options.emplace_back(name, static_cast<int>(value));
  ref.optional = true;
  ref.unset_name = unset_name;
  return ref;
}

// What is wrong with a key's value: the words that follow the key ("must be positive, got 0"),
// and where in the value, when it is about one entry (its line in a file).
struct KeyProblem {
  std::string message;
  std::optional<size_t> index;  // the array entry it is about (model.moe_layers, a rule)
  std::string member;           // the table member it is about (partition.logical_axes)
  // Said instead of the key, followed by ": ": "rule 1" ("[partition] rule 1: ...",
  // "partition.rules rule 1: ..."), or "logical_axes.batch".
  std::string subject;
};

// The problem whose words are `parts`.
template <class... Parts>
KeyProblem problem(Parts&&... parts) {
  return KeyProblem{detail::concat(std::forward<Parts>(parts)...), {}, {}, {}};
}

// How a message names another key: in a file, one of the same section by its name ("lr"),
// any other as section.key; for a config made in code always section.key.
struct KeyNames {
  std::string section;
  bool in_file = true;
  std::string operator()(const std::string& section_key) const;
};

struct ConfigKey;
using ReadFn = std::optional<KeyProblem> (*)(const ConfigKey&, const toml::node&, RunConfig&);
using WriteFn = void (*)(const ConfigKey&, const RunConfig&, toml::table& section);
using CheckFn = std::optional<KeyProblem> (*)(const ConfigKey&, const RunConfig&, const KeyNames&);
using ReasonFn = const char* (*)(const RunConfig&);

struct ConfigKey {
  const char* section = "";
  const char* name = "";
  ValueRef (*at)(RunConfig&) = nullptr;  // where the value lives (see ValueRef)
  Range range;
  CommandSet set_by = kFileCommands;
  const char* doc = "";  // its meaning, one line of Markdown (docs/configs.md)

  // Optional, set with the functions below.
  ReadFn read = nullptr;       // a value with a shape of its own: read it ...
  WriteFn write = nullptr;     // ... and write it
  const char* type = nullptr;  // the docs' type of such a value
  // Why the key must not be given, given the other keys (model.width with kind = "mlp");
  // nullptr when it may be.
  ReasonFn not_for = nullptr;
  // When the key applies but is not given: the words after the key ("is required ...").
  const char* required = nullptr;
  CheckFn check = nullptr;     // rules beyond the range, most with other keys
  const char* rule = nullptr;  // the docs' words for `check` ("at most optimizer.lr")
  std::vector<std::string> (*names)() = nullptr;  // a string key's allowed values ("" too)
  const char* values = nullptr;  // the docs' allowed values, where range and choices say too little
  const char* default_text = nullptr;  // the docs' default, where the default is derived
  bool empty_is_unset = false;  // a string: "" means the default, and a file may not write it
  bool omit_default = false;    // the writer leaves the key out at its default
  bool members = false;  // a table whose members --set may name (partition.logical_axes.batch)

  ConfigKey& reads(ReadFn r, WriteFn w, const char* type_text) {
    read = r;
    write = w;
    type = type_text;
    return *this;
  }
  ConfigKey& only_when(ReasonFn reason, const char* required_text = nullptr) {
    not_for = reason;
    required = required_text;
    return *this;
  }
  ConfigKey& checked_by(CheckFn c, const char* rule_text = nullptr) {
    check = c;
    rule = rule_text;
    return *this;
  }
  ConfigKey& one_of(std::vector<std::string> (*allowed)()) {
    names = allowed;
    return *this;
  }
  ConfigKey& shown_as(const char* values_text) {
    values = values_text;
    return *this;
  }
  ConfigKey& defaults_to(const char* text) {
    default_text = text;
    return *this;
  }
  ConfigKey& unset_when_empty() {
    empty_is_unset = true;
    return *this;
  }
  ConfigKey& left_out_at_default() {
    omit_default = true;
    return *this;
  }
  ConfigKey& with_members() {
    members = true;
    return *this;
  }
};

// Every key, section by section in the documentation's order.
const std::vector<ConfigKey>& config_keys();
// The sections, in that order, and where each is explained (a Markdown link).
struct ConfigSection {
  const char* name;
  const char* explained;
};
const std::vector<ConfigSection>& config_sections();
std::vector<std::string> config_section_names();
std::vector<std::string> config_key_names(const std::string& section);
// nullptr for a key the schema does not have.
const ConfigKey* find_config_key(const std::string& section, const std::string& name);

// A range's bound as messages and the docs write it: 1048576, not 1.04858e+06.
std::string config_bound_text(double value);

// "a table", "an integer", ...: what a message says a node is.
const char* toml_type_name(toml::node_type type);
// A value as it would be written in TOML ("-0.1", "'relu'", "[ 1, 2 ]").
std::string render_node(const toml::node& node);
// "must be <expected>, got a string 'fast'".
inline KeyProblem wrong_type(const toml::node& node, const std::string& expected) {
  return problem("must be ", expected, ", got ", toml_type_name(node.type()), " ",
                 render_node(node));
}

// The key's value in `config` from `node` (a type error: the problem).
std::optional<KeyProblem> read_key(const ConfigKey& key, const toml::node& node, RunConfig& config);
// The key's value into `section` as TOML: nothing when it is unset, when it does not apply to
// this config (ConfigKey::not_for) or, for a key written only when it differs, at its default.
void write_key(const ConfigKey& key, const RunConfig& config, toml::table& section);
// The value whatever it is (for comparing two configs and for messages).
void write_value(const ConfigKey& key, const RunConfig& config, toml::table& section);
// Whether two configs hold the same value for the key.
bool same_value(const ConfigKey& key, const RunConfig& a, const RunConfig& b);

// Everything wrong with the key's value in `config`, in this order: given though it does not
// apply, required and not given, outside its range or choices, against another key. `given`:
// the file has the key (for a config made in code: its value is not the default).
std::optional<KeyProblem> check_key(const ConfigKey& key, const RunConfig& config, bool given,
                                    const KeyNames& names);

// The defaults derived from other keys, in place: run.output_dir ("runs/<name>"),
// checkpoint.dir, canonical data.x_key and y_key; for a file (`from_file`) also model.loss
// "auto" (mse for synthetic data, cross_entropy otherwise) and data.path for fashion_mnist.
void complete_config(RunConfig& config, bool from_file);

// One "section.key=value" override, parsed the one way every command parses it.
struct ConfigOverride {
  std::vector<std::string> path;  // {"data", "batch_size"}, or 3 parts for a table member
  std::string value;              // the value's text, spaces around it trimmed
  const ConfigKey* key = nullptr;
  std::string key_name() const { return path[0] + "." + path[1]; }
};
// Throws bad_input "<file>: override '<text>' ..." for text that names no key of the schema.
ConfigOverride parse_override(const std::string& override_text, const std::string& file);

// Applies each override to the parsed `file` (docs/configs.md). An override of train.steps
// drops the file's train.epochs (and the other way round) unless both are overridden; returns
// a note saying so for each.
std::vector<std::string> apply_overrides(toml::table& root,
                                         const std::vector<std::string>& overrides,
                                         const std::string& file);

// Reads and checks every key of a parsed file into a RunConfig (config.text is the file's
// text as `root` holds it).
RunConfig read_config(const toml::table& root, const std::string& file);

}  // namespace meshtrain
