// An output that would replace a file the command reads (framework/io/output_file.hpp).

#include "framework/io/output_file.hpp"

#include <filesystem>
#include <system_error>

#include "base/error.hpp"
#include "framework/io/checkpoint.hpp"

namespace meshtrain {

std::vector<ReadFile> checkpoint_files_read(const std::string& checkpoint,
                                            const std::string& role) {
  namespace fs = std::filesystem;
  std::vector<ReadFile> files = {{resolve_checkpoint_path(checkpoint), role}};
  std::error_code ec;
  const std::string pointer = fs::is_directory(checkpoint, ec)
                                  ? (fs::path(checkpoint) / latest_pointer_name()).string()
                                  : checkpoint;
  files.push_back({pointer, "the checkpoint pointer file being read"});
  return files;
}

void refuse_output_that_is_read(const std::string& output, const std::string& option,
                                const std::vector<ReadFile>& inputs) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (output.empty() || !fs::exists(output, ec)) return;
  for (const ReadFile& input : inputs) {
    if (input.path.empty()) continue;
    std::error_code same_ec;
    // equivalent() compares st_dev and st_ino; an error (a path that does not exist) is
    // "not the same file".
    if (!fs::equivalent(output, input.path, same_ec) || same_ec) continue;
    const std::string spelled =
        input.path == output ? std::string() : " ('" + input.path + "' names the same file)";
    MESHTRAIN_BAD_INPUT(option, " '", output, "' is ", input.role, spelled, "; choose another ",
                        option);
  }
}

}  // namespace meshtrain
