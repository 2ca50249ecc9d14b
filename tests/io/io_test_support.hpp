// What the io tests share: byte buffers, unique temporary paths, and writing and reading whole
// files. One home for them, so that no io test keeps its own copy.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

namespace moh_io_test {

using Bytes = std::vector<std::uint8_t>;

/// A fresh path under the test temp folder, unique per call (and per process: test runs in other
/// build folders may share the temp folder).
inline std::string temp_path(const std::string& stem) {
  static const std::string run = std::to_string(std::random_device{}());
  static int counter = 0;
  return ::testing::TempDir() + "moh_io_" + stem + "_" + run + "_" + std::to_string(++counter);
}

/// Writes `bytes` to `path`, replacing the file (a test failure if the write fails).
inline void write_file(const std::string& path, const Bytes& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

/// The bytes of the file at `path` (none when it cannot be read).
inline Bytes read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

}  // namespace moh_io_test
