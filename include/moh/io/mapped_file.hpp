// Read-only file bytes that stay alive as long as something uses them: a POSIX memory mapping
// where there is one (a multi-GB checkpoint costs page cache, not heap), else the file read into
// memory. Every failure is a moh::Error naming the file and the system's reason.
#pragma once

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#define MOH_HAS_MMAP 1
#else
#define MOH_HAS_MMAP 0
#endif

#include "moh/error.hpp"

namespace moh {
namespace detail {

/// Text of an errno value, e.g. "No such file or directory (errno 2)".
inline std::string errno_text(int error) {
  return concat(std::generic_category().message(error), " (errno ", error, ")");
}

/// Read-only bytes and whatever keeps them alive (a file mapping, a vector). Copies share the
/// owner, which releases the bytes when the last copy goes.
class SharedBytes {
 public:
  SharedBytes() = default;
  /// `size` bytes at `data`, valid while `owner` lives.
  SharedBytes(const std::uint8_t* data, std::size_t size, std::shared_ptr<const void> owner,
              bool mapped)
      : data_(data), size_(size), owner_(std::move(owner)), mapped_(mapped) {}

  /// Takes ownership of `bytes` (no copy).
  static SharedBytes from_vector(std::vector<std::uint8_t> bytes) {
    auto owner = std::make_shared<const std::vector<std::uint8_t>>(std::move(bytes));
    return SharedBytes(owner->data(), owner->size(), owner, false);
  }

  const std::uint8_t* data() const { return data_; }
  std::size_t size() const { return size_; }
  /// True if the bytes are a memory mapping of a file (rather than a copy in memory).
  bool mapped() const { return mapped_; }

 private:
  const std::uint8_t* data_ = nullptr;
  std::size_t size_ = 0;
  std::shared_ptr<const void> owner_;
  bool mapped_ = false;
};

/// What a file that is not a regular one is, for messages.
inline const char* file_kind(bool directory, bool character, bool block, bool fifo, bool socket) {
  return directory ? "a directory"
         : character ? "a character device"
         : block     ? "a block device"
         : fifo      ? "a FIFO"
         : socket    ? "a socket"
                     : "not a regular file";
}

/// Throws unless `path` names a regular file (after following links); `what` names the file's
/// role in the message, e.g. "safetensors file".
inline void require_regular_file(const std::string& path, const char* what) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (ec) {
    fail("cannot open ", what, " '", path, "': expected a readable file, got error: ",
         ec.message());
  }
  if (fs::is_regular_file(status)) return;
  fail(what, " '", path, "': expected a regular file, got ",
       file_kind(fs::is_directory(status), fs::is_character_file(status),
                 fs::is_block_file(status), fs::is_fifo(status), fs::is_socket(status)));
}

/// Reads the whole file at `path` into memory (the fallback where mmap is unavailable).
inline SharedBytes read_file_into_memory(const std::string& path, const char* what) {
  require_regular_file(path, what);
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot open ", what, " '", path, "': expected a readable file");
  std::vector<std::uint8_t> bytes;
  std::vector<char> chunk(1 << 20);
  while (in.read(chunk.data(), static_cast<std::streamsize>(chunk.size())) || in.gcount() > 0) {
    bytes.insert(bytes.end(), chunk.data(), chunk.data() + in.gcount());
  }
  if (in.bad()) fail("cannot read ", what, " '", path, "': read failed after ", bytes.size(), " bytes");
  return SharedBytes::from_vector(std::move(bytes));
}

#if MOH_HAS_MMAP
/// Maps the regular file at `path` read-only (MAP_PRIVATE); the descriptor is closed at once, the
/// mapping lives until the last copy of the result goes. An empty file yields empty bytes (mmap
/// of 0 bytes is not allowed).
inline SharedBytes map_file(const std::string& path, const char* what) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer; it is rejected just below.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    fail("cannot open ", what, " '", path, "': expected a readable file, got error: ",
         errno_text(errno));
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    fail("cannot stat ", what, " '", path, "': expected a readable file, got error: ",
         errno_text(errno));
  }
  if (!S_ISREG(st.st_mode)) {
    fail(what, " '", path, "': expected a regular file, got ",
         file_kind(S_ISDIR(st.st_mode), S_ISCHR(st.st_mode), S_ISBLK(st.st_mode),
                   S_ISFIFO(st.st_mode), S_ISSOCK(st.st_mode)));
  }
  const std::uint64_t file_size = static_cast<std::uint64_t>(st.st_size);
  if constexpr (sizeof(std::size_t) < sizeof(std::uint64_t)) {
    if (file_size > std::numeric_limits<std::size_t>::max()) {
      fail(what, " '", path, "' is too large to map: expected <= ",
           std::numeric_limits<std::size_t>::max(), " bytes, got ", file_size);
    }
  }
  const std::size_t size = static_cast<std::size_t>(file_size);
  if (size == 0) return SharedBytes(nullptr, 0, nullptr, true);
  void* address = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  if (address == MAP_FAILED) {
    fail("cannot map ", what, " '", path, "': mmap of ", size, " bytes failed with error: ",
         errno_text(errno));
  }
  std::shared_ptr<const void> owner(address, [size](const void* p) {
    ::munmap(const_cast<void*>(p), size);
  });
  return SharedBytes(static_cast<const std::uint8_t*>(address), size, std::move(owner), true);
}
#endif

/// The bytes of the file at `path`: mapped where mmap exists, read into memory elsewhere.
inline SharedBytes load_file(const std::string& path, const char* what) {
#if MOH_HAS_MMAP
  return map_file(path, what);
#else
  return read_file_into_memory(path, what);
#endif
}

}  // namespace detail
}  // namespace moh
