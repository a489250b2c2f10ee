#pragma once
// An output that would replace a file the command reads. `predict --overwrite`, `export
// --overwrite` and `evaluate --json` write their output under a temporary name and rename it
// over the target, so an output naming the checkpoint (or a `latest` pointer, or an input
// file) would replace it. Every command that writes a file checks it here, before any work.

#include <string>
#include <vector>

namespace meshtrain {

// A file a command reads, and what it is to the command ("the checkpoint being exported",
// "an --input file").
struct ReadFile {
  std::string path;
  std::string role;
};

// What a checkpoint argument (a checkpoint file, a `latest` / `best` pointer file, or a
// checkpoint directory meaning its latest) makes a command read: the checkpoint file (as
// `role`: "the checkpoint being exported"), and the pointer file naming it when there is one
// ("the checkpoint pointer file being read"). Throws bad_input as resolve_checkpoint_path.
std::vector<ReadFile> checkpoint_files_read(const std::string& checkpoint, const std::string& role);

// Throws bad_input when `output` is the same file as one of `inputs`: "<option> 'OUT' is
// <role>[ ('IN' names the same file)]; choose another <option>". Compared by file-system
// identity (the same device and inode, std::filesystem::equivalent), not by the path's
// text: another spelling of the path, a symbolic link or a hard link is the same file.
// Paths that do not exist (an output not yet written) are not the same file as anything.
void refuse_output_that_is_read(const std::string& output, const std::string& option,
                                const std::vector<ReadFile>& inputs);

}  // namespace meshtrain
