#include "run/run_common.hpp"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "base/error.hpp"

namespace meshtrain {

OptimizerSettings optimizer_settings(const OptimizerSection& section) {
  OptimizerSettings settings;
  settings.kind = section.kind;
  settings.momentum = static_cast<float>(section.momentum);
  settings.beta1 = static_cast<float>(section.betas.first);
  settings.beta2 = static_cast<float>(section.betas.second);
  settings.eps = static_cast<float>(section.eps);
  settings.weight_decay = static_cast<float>(section.weight_decay);
  return settings;
}

void ensure_writable_directory(const std::string& dir, const char* key) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  const std::string probe = dir + "/.meshtrain-write-test";
  std::FILE* file = ec ? nullptr : std::fopen(probe.c_str(), "w");
  if (!file) {
    MESHTRAIN_BAD_INPUT("cannot write to the directory '", dir, "' (", key,
                        "): ", ec ? ec.message() : std::strerror(errno));
  }
  std::fclose(file);
  std::remove(probe.c_str());
}

}  // namespace meshtrain
