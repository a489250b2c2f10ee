#pragma once
// Temporary directories for the tests: TempDir, a fresh directory of a unique name, removed at
// the end of its scope; one rank's, or made by rank 0 and shared by every rank (so that runs of
// one test at the same time, ctest's at several process counts or another checkout's on the same
// machine, never share a directory).

#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

namespace meshtrain::testing {

// A fresh directory under $TMPDIR (or /tmp), <prefix>-XXXXXX, removed at the end of its scope.
// With `shared`, rank 0 makes it and every rank of MPI_COMM_WORLD gets its name, and it is
// removed after every rank is done with it (both collective).
class TempDir {
 public:
  explicit TempDir(bool shared = false, const std::string& prefix = "meshtrain-test")
      : shared_(shared) {
    int rank = 0;
    if (shared_) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    std::vector<char> buf(4096, '\0');
    if (rank == 0) {
      const char* base = std::getenv("TMPDIR");
      const std::string pattern =
          std::string(base && *base ? base : "/tmp") + "/" + prefix + "-XXXXXX";
      std::copy(pattern.begin(), pattern.end(), buf.begin());
      if (mkdtemp(buf.data()) == nullptr) ADD_FAILURE() << "mkdtemp failed for " << pattern;
    }
    if (shared_) MPI_Bcast(buf.data(), static_cast<int>(buf.size()), MPI_CHAR, 0, MPI_COMM_WORLD);
    path_ = buf.data();
  }
  ~TempDir() {
    int rank = 0;
    if (shared_) {
      MPI_Barrier(MPI_COMM_WORLD);
      MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    }
    if (rank == 0) {
      std::error_code ignored;
      std::filesystem::remove_all(path_, ignored);
    }
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  bool shared_;
  std::string path_;
};

}  // namespace meshtrain::testing
