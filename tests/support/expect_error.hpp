#pragma once
// Expecting an error: meshtrain::Error of a kind, with a message that names what is wrong.

#include <gtest/gtest.h>

#include <functional>
#include <initializer_list>
#include <string>

#include "base/error.hpp"

namespace meshtrain::testing {

// Runs fn, expects it to throw meshtrain::Error of the given kind, and expects the
// message to contain every one of the fragments (so each error names what is wrong).
inline void expect_error(const std::function<void()>& fn, ErrorKind kind,
                         std::initializer_list<std::string> fragments) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(static_cast<int>(e.kind()), static_cast<int>(kind)) << "message: " << e.what();
    for (const auto& fragment : fragments) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos)
          << "expected the message to mention '" << fragment << "', got: " << e.what();
    }
    return;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected meshtrain::Error, got std::exception: " << e.what();
    return;
  }
  ADD_FAILURE() << "expected meshtrain::Error, nothing was thrown";
}

inline void expect_bad_input(const std::function<void()>& fn,
                             std::initializer_list<std::string> fragments) {
  expect_error(fn, ErrorKind::bad_input, fragments);
}

}  // namespace meshtrain::testing
