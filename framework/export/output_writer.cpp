// An export's files, written whole or not at all (framework/export/output_writer.hpp).

#include "framework/export/output_writer.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <system_error>
#include <utility>

#include "base/error.hpp"

namespace meshtrain {

namespace {
namespace fs = std::filesystem;

std::string os_error(int err) {
  return std::strerror(err);
}
}  // namespace

void refuse_existing_output(const std::string& output, bool overwrite) {
  std::error_code ec;
  const auto status = fs::status(output, ec);
  if (!fs::exists(status)) return;
  if (fs::is_directory(status)) MESHTRAIN_BAD_INPUT("output '", output, "' is a directory");
  if (!overwrite)
    MESHTRAIN_BAD_INPUT("output '", output, "' exists; pass --overwrite to replace it");
}

TemporaryOutput::TemporaryOutput(std::string output, const ExportByteWriter& write)
    : output_(std::move(output)), tmp_(output_ + ".tmp") {
  const int fd = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) MESHTRAIN_BAD_INPUT("cannot write the output '", tmp_, "': ", os_error(errno));
  bool open = true;
  const auto close_and_remove = [&] {
    if (open) ::close(fd);
    open = false;
    ::unlink(tmp_.c_str());
  };
  auto fail = [&](const std::string& what, int err) {
    close_and_remove();
    MESHTRAIN_FAIL(what, " '", tmp_, "' failed: ", os_error(err));
  };
  try {
    write([&](const char* data, size_t size) {
      for (size_t done = 0; done < size;) {
        const ssize_t n = ::write(fd, data + done, size - done);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) fail("writing", errno);
        done += static_cast<size_t>(n);
      }
      bytes_ += size;
    });
  } catch (...) {
    close_and_remove();  // a failed write, or a streamed tensor that threw
    throw;
  }
  if (::fsync(fd) != 0) fail("syncing", errno);
  open = false;
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp_.c_str());
    MESHTRAIN_FAIL("closing '", tmp_, "' failed: ", os_error(err));
  }
}

TemporaryOutput::~TemporaryOutput() {
  if (!committed_) ::unlink(tmp_.c_str());
}

void TemporaryOutput::commit() {
  MESHTRAIN_REQUIRE(!committed_, "export: '", output_, "' committed twice");
  if (std::rename(tmp_.c_str(), output_.c_str()) != 0) {
    MESHTRAIN_FAIL("cannot rename '", tmp_, "' to '", output_, "': ", os_error(errno));
  }
  committed_ = true;
}

size_t write_atomically(const std::string& output, const ExportByteWriter& write, bool overwrite) {
  refuse_existing_output(output, overwrite);
  TemporaryOutput file(output, write);
  file.commit();
  return file.bytes();
}

}  // namespace meshtrain
