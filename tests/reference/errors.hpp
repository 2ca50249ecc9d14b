// Helpers for tests of moh::Error messages: run a call that must throw, and check what its
// message names.
#pragma once

#include <gtest/gtest.h>

#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "moh/error.hpp"

namespace moh_test {

/// Runs `f`, which must throw moh::Error; returns its message ("" and a failure otherwise).
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const moh::Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected moh::Error, got another exception: " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected moh::Error, got no exception";
  return "";
}

/// Success when `message` contains every one of `parts`.
inline ::testing::AssertionResult Mentions(const std::string& message,
                                           const std::vector<std::string>& parts) {
  for (const std::string& part : parts) {
    if (message.find(part) == std::string::npos) {
      return ::testing::AssertionFailure() << "message \"" << message << "\" lacks \"" << part
                                           << "\"";
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace moh_test
