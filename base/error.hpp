#pragma once
// The one exception type of meshtrain. It lives in the lowest layer so every layer can
// throw it. Library code throws; only apps/ catches and turns it into an exit status.
//
// what() is one sentence for the user that names the file, key, parameter or value that
// is wrong. file()/line() say where in meshtrain it was thrown, for developers.

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace meshtrain {

enum class ErrorKind {
  bad_input,  // a config, rule, mesh, checkpoint or data file is wrong: exit status 2
  runtime,    // something failed while running (MPI, HDF5, NCCL, NaN loss): exit status 1
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message, const char* file, int line)
      : std::runtime_error(message), kind_(kind), file_(file), line_(line) {}

  ErrorKind kind() const noexcept { return kind_; }
  const char* file() const noexcept { return file_; }
  int line() const noexcept { return line_; }
  // "framework/comm.cpp:42"
  std::string where() const { return std::string(file_) + ":" + std::to_string(line_); }

 private:
  ErrorKind kind_;
  const char* file_;
  int line_;
};

namespace detail {
template <class... Parts>
std::string concat(Parts&&... parts) {
  std::ostringstream out;
  (out << ... << std::forward<Parts>(parts));
  return out.str();
}
}  // namespace detail

}  // namespace meshtrain

// MESHTRAIN_BAD_INPUT("mesh axis '", name, "' is repeated") throws Error{bad_input}.
#define MESHTRAIN_BAD_INPUT(...)                              \
  throw ::meshtrain::Error(::meshtrain::ErrorKind::bad_input, \
                           ::meshtrain::detail::concat(__VA_ARGS__), __FILE__, __LINE__)

// MESHTRAIN_FAIL("MPI_Allreduce failed: ", mpi_message) throws Error{runtime}.
#define MESHTRAIN_FAIL(...)                                 \
  throw ::meshtrain::Error(::meshtrain::ErrorKind::runtime, \
                           ::meshtrain::detail::concat(__VA_ARGS__), __FILE__, __LINE__)

// MESHTRAIN_REQUIRE(cond, "message parts"...) throws Error{runtime} when cond is false:
// for invariants of the library itself, not for user input.
#define MESHTRAIN_REQUIRE(cond, ...)          \
  do {                                        \
    if (!(cond)) MESHTRAIN_FAIL(__VA_ARGS__); \
  } while (0)
