// Tests for moh/io/mapped_file.hpp: file bytes mapped read-only (or read into memory where there
// is no mmap) that live as long as a copy of them does, and errors that name the file, its role
// and the system's reason: missing files, directories, devices and FIFOs (rejected without
// blocking).
#include "moh/io/mapped_file.hpp"

#include <gtest/gtest.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <sys/stat.h>
#include <sys/types.h>
#endif

#include "io/io_test_support.hpp"
#include "test_helpers.hpp"

namespace {

using moh_test::error_of;
using moh_test::Mentions;
using namespace moh_io_test;  // Bytes, temp_path, write_file, read_file

/// Bytes 0, 1, ..., 255, 0, 1, ... (n of them).
Bytes pattern(std::size_t n) {
  Bytes b(n);
  for (std::size_t i = 0; i < n; ++i) b[i] = static_cast<std::uint8_t>(i * 7 + 3);
  return b;
}

TEST(MappedFile, ErrnoText) {
  const std::string text = moh::detail::errno_text(ENOENT);
  EXPECT_TRUE(Mentions(text, {"No such file or directory", "(errno " + std::to_string(ENOENT) + ")"}));
}

TEST(MappedFile, SharedBytesOwnTheirBytesWithoutCopying) {
  const moh::detail::SharedBytes none;
  EXPECT_EQ(none.data(), nullptr);
  EXPECT_EQ(none.size(), 0u);
  EXPECT_FALSE(none.mapped());

  Bytes v = pattern(1000);
  const std::uint8_t* where = v.data();
  moh::detail::SharedBytes copy;
  {
    const moh::detail::SharedBytes bytes = moh::detail::SharedBytes::from_vector(std::move(v));
    EXPECT_EQ(bytes.data(), where);  // taken over, not copied
    EXPECT_EQ(bytes.size(), 1000u);
    EXPECT_FALSE(bytes.mapped());
    copy = bytes;
  }
  // The last copy keeps the bytes alive.
  EXPECT_EQ(copy.data(), where);
  EXPECT_EQ(0, std::memcmp(copy.data(), pattern(1000).data(), 1000));
}

#if MOH_HAS_MMAP
TEST(MappedFile, MapFileMapsTheWholeFileReadOnly) {
  const std::string path = temp_path("map");
  const Bytes bytes = pattern(70000);  // more than a page
  write_file(path, bytes);
  const moh::detail::SharedBytes view = moh::detail::map_file(path, "safetensors file");
  EXPECT_TRUE(view.mapped());
  ASSERT_EQ(view.size(), bytes.size());
  EXPECT_EQ(0, std::memcmp(view.data(), bytes.data(), bytes.size()));
  // load_file maps as well where there is mmap.
  const moh::detail::SharedBytes loaded = moh::detail::load_file(path, "safetensors file");
  EXPECT_TRUE(loaded.mapped());
  ASSERT_EQ(loaded.size(), bytes.size());
  EXPECT_EQ(0, std::memcmp(loaded.data(), bytes.data(), bytes.size()));
  std::remove(path.c_str());
}

TEST(MappedFile, MappingOutlivesTheFileAndTheFirstCopy) {
  const std::string path = temp_path("outlive");
  const Bytes bytes = pattern(5000);
  write_file(path, bytes);
  std::vector<moh::detail::SharedBytes> kept;
  {
    const moh::detail::SharedBytes view = moh::detail::map_file(path, "safetensors file");
    kept.push_back(view);
  }
  std::remove(path.c_str());  // the mapping keeps the bytes
  const moh::detail::SharedBytes last = kept.front();
  kept.clear();
  ASSERT_EQ(last.size(), bytes.size());
  EXPECT_EQ(0, std::memcmp(last.data(), bytes.data(), bytes.size()));
}
#endif

TEST(MappedFile, EmptyFileGivesNoBytes) {
  const std::string path = temp_path("empty");
  write_file(path, {});
  const moh::detail::SharedBytes loaded = moh::detail::load_file(path, "safetensors file");
  EXPECT_EQ(loaded.size(), 0u);
  const moh::detail::SharedBytes copy = moh::detail::read_file_into_memory(path, "safetensors file");
  EXPECT_EQ(copy.size(), 0u);
  EXPECT_FALSE(copy.mapped());
#if MOH_HAS_MMAP
  EXPECT_TRUE(moh::detail::map_file(path, "safetensors file").mapped());
  EXPECT_EQ(moh::detail::map_file(path, "safetensors file").size(), 0u);
#endif
  std::remove(path.c_str());
}

// Moved from safetensors_test.cpp (SafeTensorsOpen.ReadIntoMemoryFallbackMatches).
TEST(MappedFile, ReadIntoMemoryFallbackMatches) {
  const std::string path = temp_path("fallback");
  const Bytes bytes = pattern(3 * (1 << 20) + 17);  // more than one 1 MiB read
  write_file(path, bytes);
  const moh::detail::SharedBytes copy = moh::detail::read_file_into_memory(path, "safetensors file");
  EXPECT_FALSE(copy.mapped());
  ASSERT_EQ(copy.size(), bytes.size());
  EXPECT_EQ(0, std::memcmp(copy.data(), bytes.data(), bytes.size()));
  EXPECT_TRUE(Mentions(error_of([] { moh::detail::read_file_into_memory(::testing::TempDir(), "safetensors file"); }),
                       {"expected a regular file", "got a directory"}));
  EXPECT_TRUE(Mentions(error_of([] { moh::detail::read_file_into_memory("/nonexistent/x.safetensors", "safetensors file"); }),
                       {"cannot open", "/nonexistent/x.safetensors"}));
  std::remove(path.c_str());
}

// Moved from safetensors_test.cpp (SafeTensorsMalformed.NonexistentPath), for every way in.
TEST(MappedFile, NonexistentPath) {
  const std::string path = "/nonexistent/dir/missing.safetensors";
  EXPECT_TRUE(Mentions(error_of([&] { moh::detail::load_file(path, "safetensors file"); }),
                       {"cannot open safetensors file '" + path + "'", "expected a readable file",
                        "No such file or directory"}));
  EXPECT_TRUE(Mentions(error_of([&] { moh::detail::read_file_into_memory(path, "safetensors index"); }),
                       {"cannot open safetensors index '" + path + "'", "expected a readable file",
                        "No such file or directory"}));
  EXPECT_TRUE(Mentions(error_of([&] { moh::detail::require_regular_file(path, "shard"); }),
                       {"cannot open shard '" + path + "'", "No such file or directory"}));
#if MOH_HAS_MMAP
  EXPECT_TRUE(Mentions(error_of([&] { moh::detail::map_file(path, "safetensors file"); }),
                       {"cannot open safetensors file '" + path + "'", "errno"}));
#endif
}

// Moved from safetensors_test.cpp (SafeTensorsOpen.DirectoryIsRejected).
TEST(MappedFile, DirectoryIsRejected) {
  const std::string dir = ::testing::TempDir();
  EXPECT_TRUE(Mentions(error_of([&] { moh::detail::load_file(dir, "safetensors file"); }),
                       {"safetensors file '" + dir + "'", "expected a regular file", "got a directory"}));
  EXPECT_TRUE(Mentions(error_of([&] { moh::detail::require_regular_file(dir, "safetensors index"); }),
                       {"safetensors index '" + dir + "'", "expected a regular file", "got a directory"}));
}

TEST(MappedFile, RegularFilesAndLinksToThemAreAccepted) {
  const std::string path = temp_path("regular");
  write_file(path, pattern(10));
  EXPECT_NO_THROW(moh::detail::require_regular_file(path, "safetensors file"));
#if defined(__unix__) || defined(__APPLE__)
  const std::string link = temp_path("link");
  std::filesystem::create_symlink(path, link);
  EXPECT_NO_THROW(moh::detail::require_regular_file(link, "safetensors file"));
  const moh::detail::SharedBytes via_link = moh::detail::load_file(link, "safetensors file");
  ASSERT_EQ(via_link.size(), 10u);
  EXPECT_EQ(0, std::memcmp(via_link.data(), pattern(10).data(), 10));
  std::remove(link.c_str());
#endif
  std::remove(path.c_str());
}

#if defined(__unix__) || defined(__APPLE__)
// Moved from safetensors_test.cpp (SafeTensorsOpen.DevicesAndFifosAreRejectedWithoutBlocking).
TEST(MappedFile, DevicesAndFifosAreRejectedWithoutBlocking) {
  if (std::filesystem::exists("/dev/null")) {
    EXPECT_TRUE(Mentions(error_of([] { moh::detail::load_file("/dev/null", "safetensors file"); }),
                         {"'/dev/null'", "expected a regular file", "got a character device"}));
    EXPECT_TRUE(Mentions(error_of([] { moh::detail::read_file_into_memory("/dev/null", "safetensors file"); }),
                         {"'/dev/null'", "expected a regular file", "got a character device"}));
  }
  // Opening a FIFO for reading would wait for a writer; every way in must reject it at once.
  const std::string fifo = temp_path("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << fifo;
  EXPECT_TRUE(Mentions(error_of([&] { moh::detail::load_file(fifo, "safetensors file"); }), {"got a FIFO", fifo}));
  EXPECT_TRUE(Mentions(error_of([&] { moh::detail::read_file_into_memory(fifo, "safetensors file"); }),
                       {"got a FIFO", fifo}));
  std::remove(fifo.c_str());
}
#endif

}  // namespace
