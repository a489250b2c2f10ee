#pragma once
// What TrainingRun and DlrmRun both need from their config at set-up (run/ internal).

#include <string>

#include "framework/train/config.hpp"
#include "framework/train/optimizer.hpp"

namespace meshtrain {

// The optimizer's settings from [optimizer].
OptimizerSettings optimizer_settings(const OptimizerSection& section);

// Creates `dir` (and its parents) and checks that a file can be made in it; bad_input naming
// the config key otherwise.
void ensure_writable_directory(const std::string& dir, const char* key);

}  // namespace meshtrain
