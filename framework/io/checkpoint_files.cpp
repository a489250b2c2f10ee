#include "framework/io/checkpoint_files.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "base/error.hpp"

namespace meshtrain::checkpoint_format {

const std::regex& checkpoint_name_pattern() {
  static const std::regex pattern(R"(ckpt-([0-9]+)\.h5)");
  return pattern;
}

std::string os_error(int err) {
  return std::strerror(err);
}

void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), directory ? (O_RDONLY | O_DIRECTORY) : O_RDONLY);
  if (fd < 0) MESHTRAIN_FAIL("cannot open '", path, "' to sync it: ", os_error(errno));
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    MESHTRAIN_FAIL("fsync of '", path, "' failed: ", os_error(err));
  }
  if (::close(fd) != 0) MESHTRAIN_FAIL("closing '", path, "' failed: ", os_error(errno));
}

void rename_path(const std::string& from, const std::string& to) {
  if (std::rename(from.c_str(), to.c_str()) != 0) {
    MESHTRAIN_FAIL("cannot rename '", from, "' to '", to, "': ", os_error(errno));
  }
}

std::optional<std::string> read_pointer(const std::string& dir, const char* name) {
  const std::filesystem::path pointer = std::filesystem::path(dir) / name;
  std::error_code ec;
  if (!std::filesystem::exists(pointer, ec)) return std::nullopt;
  std::ifstream in(pointer, std::ios::binary);
  if (!in) MESHTRAIN_BAD_INPUT("cannot read the checkpoint pointer '", pointer.string(), "'");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r' || text.back() == ' '))
    text.pop_back();
  return text;
}

}  // namespace meshtrain::checkpoint_format
