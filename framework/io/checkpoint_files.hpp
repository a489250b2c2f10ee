#pragma once
// Small POSIX file helpers of the checkpoint code: the checkpoint file name pattern, OS error
// text, fsync and rename that throw runtime Errors. Internal to the checkpoint code
// (checkpoint_save.cpp: completing a save, removing old checkpoints; checkpoint_load.cpp:
// finding the latest); the public interface is framework/io/checkpoint.hpp.

#include <optional>
#include <regex>
#include <string>

namespace meshtrain::checkpoint_format {

// "ckpt-<digits>.h5", the step in group 1.
const std::regex& checkpoint_name_pattern();
std::string os_error(int err);
void fsync_path(const std::string& path, bool directory);
void rename_path(const std::string& from, const std::string& to);
// The text of the pointer file `name` in `dir` without its line end; nullopt when there is
// none. Unchecked: bad_input only when it exists and cannot be read.
std::optional<std::string> read_pointer(const std::string& dir, const char* name);

}  // namespace meshtrain::checkpoint_format
