// moh::SafeTensors: a strict, header-only reader for the safetensors format.
//
// Layout: an 8-byte little-endian header length N, N bytes of UTF-8 JSON, then the tensor data.
// The JSON is an object mapping tensor names to {"dtype", "shape", "data_offsets": [begin, end]}
// (offsets relative to the first data byte), plus an optional "__metadata__" map of strings.
//
// This is the library's widest door for outside input, so everything is checked before use and
// every problem is reported as a moh::Error naming what was expected and what was found:
//   - the file holds the 8-byte prefix; the header length fits in the file and is <= 100 MB;
//   - the header is valid UTF-8, nests at most 64 levels (checked before parsing, because the JSON
//     parser recurses), is valid JSON, is an object and repeats no key;
//   - each entry has exactly the fields dtype (a known name), shape (non-negative integers whose
//     product, and byte size, fit in 63 bits) and data_offsets (begin <= end <= data size, and
//     end - begin == numel * dtype size); no two tensors' bytes overlap;
//   - "__metadata__" is an object whose values are strings;
//   - BOOL bytes are 0 or 1;
//   - conversions to an integer or bool type are exact (no silent wrap, no undefined casts).
// Data need not be aligned: every element is assembled from its little-endian bytes.
//
// SafeTensors::open maps the file read-only (POSIX mmap, MAP_PRIVATE) instead of copying it, so a
// multi-GB checkpoint costs page cache, not heap; copies of a SafeTensors share the mapping, which
// is released with the last copy. As with any mapped file, the file must not be truncated while
// it is open. Platforms without mmap read the file into memory instead.
#pragma once

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <type_traits>
#include <system_error>
#include <utility>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#define MOH_SAFETENSORS_HAS_MMAP 1
#else
#define MOH_SAFETENSORS_HAS_MMAP 0
#endif

#include "moh/error.hpp"
#include "moh/float16.hpp"
#include "moh/tensor.hpp"

namespace moh {

/// Element types of a safetensors file that moh can read.
enum class DType { F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL };

/// Bytes per element of `dtype`.
inline std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::F64:
    case DType::I64:
      return 8;
    case DType::F32:
    case DType::I32:
      return 4;
    case DType::F16:
    case DType::BF16:
    case DType::I16:
      return 2;
    case DType::I8:
    case DType::U8:
    case DType::BOOL:
      return 1;
  }
  return 0;  // unreachable for valid enumerators
}

/// The safetensors spelling of `dtype`, e.g. "F32".
inline const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F64: return "F64";
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::I64: return "I64";
    case DType::I32: return "I32";
    case DType::I16: return "I16";
    case DType::I8: return "I8";
    case DType::U8: return "U8";
    case DType::BOOL: return "BOOL";
  }
  return "?";
}

namespace detail {

/// Reads an unsigned integer stored little-endian at `p` (any alignment, any host byte order).
template <class U>
U load_le(const std::uint8_t* p) {
  static_assert(std::is_unsigned<U>::value, "load_le reads unsigned integers");
  U value = 0;
  for (std::size_t i = 0; i < sizeof(U); ++i) value = static_cast<U>(value | (U(p[i]) << (8 * i)));
  return value;
}

}  // namespace detail

/// One tensor's entry in a safetensors header. `begin`/`end` are byte offsets into the data
/// section (after the header), already validated against the file.
struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<std::int64_t> shape;
  std::size_t begin = 0, end = 0;

  /// Number of elements (1 for a scalar of shape []).
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (std::int64_t d : shape) n *= d;  // validated not to overflow when the file was read
    return n;
  }
  /// Number of data bytes, end - begin.
  std::size_t nbytes() const { return end - begin; }
};

namespace detail {

/// Largest accepted header, as in the reference implementation.
constexpr std::uint64_t kMaxSafetensorsHeader = 100000000;
/// Deepest accepted JSON nesting; the header itself needs 3.
constexpr int kMaxJsonDepth = 64;

inline bool parse_dtype(const std::string& name, DType& out) {
  static const std::pair<const char*, DType> kNames[] = {
      {"F64", DType::F64}, {"F32", DType::F32}, {"F16", DType::F16}, {"BF16", DType::BF16},
      {"I64", DType::I64}, {"I32", DType::I32}, {"I16", DType::I16}, {"I8", DType::I8},
      {"U8", DType::U8},   {"BOOL", DType::BOOL}};
  for (const auto& entry : kNames) {
    if (name == entry.first) {
      out = entry.second;
      return true;
    }
  }
  return false;
}

/// a * b into `out`; false if the product exceeds `limit`.
inline bool checked_mul(std::uint64_t a, std::uint64_t b, std::uint64_t limit, std::uint64_t& out) {
  if (a != 0 && b > limit / a) return false;
  out = a * b;
  return true;
}

/// Offset of the first byte that breaks strict UTF-8 (no overlongs, no surrogates, nothing above
/// U+10FFFF, no truncated sequences), or `size` if the text is valid.
inline std::size_t utf8_error_offset(const std::uint8_t* s, std::size_t size) {
  std::size_t i = 0;
  while (i < size) {
    const std::uint8_t c = s[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    std::size_t length;
    std::uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the first continuation byte
    if (c >= 0xC2 && c <= 0xDF) {
      length = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      length = 3;
      if (c == 0xE0) lo = 0xA0;  // overlong
      if (c == 0xED) hi = 0x9F;  // UTF-16 surrogates
    } else if (c >= 0xF0 && c <= 0xF4) {
      length = 4;
      if (c == 0xF0) lo = 0x90;  // overlong
      if (c == 0xF4) hi = 0x8F;  // above U+10FFFF
    } else {
      return i;  // stray continuation byte, overlong lead C0/C1, or F5..FF
    }
    if (size - i < length) return i;
    if (s[i + 1] < lo || s[i + 1] > hi) return i;
    for (std::size_t k = 2; k < length; ++k) {
      if ((s[i + k] & 0xC0) != 0x80) return i;
    }
    i += length;
  }
  return size;
}

/// True if the JSON text opens more than `max_depth` arrays/objects at once. Brackets inside
/// strings (including after escaped quotes) do not count. Runs in one pass without recursion,
/// so it is safe on any input.
inline bool json_nesting_exceeds(const std::uint8_t* s, std::size_t size, int max_depth) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (std::size_t i = 0; i < size; ++i) {
    const std::uint8_t c = s[i];
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) return true;
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;  // a mismatch is left for the JSON parser to report
    }
  }
  return false;
}

/// Short description of a JSON value for messages, e.g. "number -3" or "array [1,2]".
inline std::string describe_json(const nlohmann::json& value) {
  std::string text = value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (text.size() > 60) text = text.substr(0, 57) + "...";
  return concat(value.type_name(), ' ', text);
}

/// Reads a JSON number that must be a non-negative integer <= `limit`.
inline bool json_to_count(const nlohmann::json& value, std::uint64_t limit, std::uint64_t& out) {
  if (value.is_number_unsigned()) {
    out = value.get<std::uint64_t>();
  } else if (value.is_number_integer()) {
    const std::int64_t v = value.get<std::int64_t>();
    if (v < 0) return false;
    out = static_cast<std::uint64_t>(v);
  } else {
    return false;  // floats (2.0, 1e30), strings, booleans, ...
  }
  return out <= limit;
}

/// Name of a requested element type, for conversion messages.
template <class T>
const char* type_name() {
  if (std::is_same<T, bool>::value) return "bool (0 or 1)";
  if (std::is_same<T, float>::value) return "float";
  if (std::is_same<T, double>::value) return "double";
  if (std::is_same<T, long double>::value) return "long double";
  if (std::is_integral<T>::value) {
    static const std::string name =
        concat(std::is_signed<T>::value ? "int" : "uint", 8 * sizeof(T));
    return name.c_str();
  }
  return "the requested type";
}

/// double -> float with IEEE round-to-nearest semantics, without the undefined behaviour of
/// static_cast for values beyond float's range (they become +-max or +-infinity).
inline float narrow_to_float(double v) {
  constexpr double kMax = static_cast<double>(std::numeric_limits<float>::max());
  // Halfway between FLT_MAX (2^128 - 2^104) and 2^128; ties round to even, i.e. to infinity.
  const double overflow = std::ldexp(1.0, 128) - std::ldexp(1.0, 103);
  if (std::isnan(v)) return std::numeric_limits<float>::quiet_NaN();
  if (v >= overflow) return std::numeric_limits<float>::infinity();
  if (v <= -overflow) return -std::numeric_limits<float>::infinity();
  if (v > kMax) return std::numeric_limits<float>::max();
  if (v < -kMax) return -std::numeric_limits<float>::max();
  return static_cast<float>(v);
}

/// Converts one element to T. Floating targets round; integer targets need the exact value to be
/// representable; bool needs exactly 0 or 1. Returns false (leaving `out`) when impossible.
template <class T, class S>
bool convert_value(S v, T& out) {
  static_assert(std::is_arithmetic<T>::value, "moh::SafeTensors converts to arithmetic types");
  if constexpr (std::is_same<T, bool>::value) {
    if (v == S(0) || v == S(1)) {
      out = (v == S(1));
      return true;
    }
    return false;
  } else if constexpr (std::is_floating_point<T>::value) {
    if constexpr (std::is_same<T, float>::value && std::is_same<S, double>::value) {
      out = narrow_to_float(v);
    } else {
      out = static_cast<T>(v);  // widening, or integer -> floating (always defined)
    }
    return true;
  } else if constexpr (std::is_floating_point<S>::value) {
    // Floating -> integer: finite, integral and inside [min, 2^digits).
    if (!std::isfinite(v) || std::trunc(v) != v) return false;
    const long double x = v;
    const long double lowest = static_cast<long double>(std::numeric_limits<T>::min());
    const long double above = std::ldexp(1.0L, std::numeric_limits<T>::digits);
    if (x < lowest || x >= above) return false;
    out = static_cast<T>(v);
    return true;
  } else {
    // Integer -> integer: range-checked, so nothing wraps.
    if constexpr (std::is_signed<S>::value) {
      if (v < 0) {
        if constexpr (!std::is_signed<T>::value) {
          return false;
        } else {
          if (static_cast<std::intmax_t>(v) <
              static_cast<std::intmax_t>(std::numeric_limits<T>::min())) {
            return false;
          }
          out = static_cast<T>(v);
          return true;
        }
      }
    }
    if (static_cast<std::uintmax_t>(v) >
        static_cast<std::uintmax_t>(std::numeric_limits<T>::max())) {
      return false;
    }
    out = static_cast<T>(v);
    return true;
  }
}

/// Promotes small integer types so that streams print numbers, not characters.
template <class S>
auto printable(S v) {
  return +v;
}

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
  const char* kind = fs::is_directory(status)   ? "a directory"
                     : fs::is_character_file(status) ? "a character device"
                     : fs::is_block_file(status) ? "a block device"
                     : fs::is_fifo(status)       ? "a FIFO"
                     : fs::is_socket(status)     ? "a socket"
                                                 : "not a regular file";
  fail(what, " '", path, "': expected a regular file, got ", kind);
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

#if MOH_SAFETENSORS_HAS_MMAP
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
    const char* kind = S_ISDIR(st.st_mode)    ? "a directory"
                       : S_ISCHR(st.st_mode)  ? "a character device"
                       : S_ISBLK(st.st_mode)  ? "a block device"
                       : S_ISFIFO(st.st_mode) ? "a FIFO"
                       : S_ISSOCK(st.st_mode) ? "a socket"
                                              : "not a regular file";
    fail(what, " '", path, "': expected a regular file, got ", kind);
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
#if MOH_SAFETENSORS_HAS_MMAP
  return map_file(path, what);
#else
  return read_file_into_memory(path, what);
#endif
}

/// Parses `size` bytes of untrusted JSON text as strictly as a safetensors header: valid UTF-8,
/// nesting <= kMaxJsonDepth (checked before the recursive parser runs), valid JSON, no repeated
/// key in any object, an object at the top. Errors read "<prefix><what> ...", e.g.
/// "safetensors file a.st: header is not valid UTF-8: ...".
inline nlohmann::json parse_json_strictly(const std::uint8_t* text, std::size_t size,
                                          const std::string& prefix, const std::string& what) {
  const std::size_t bad_byte = utf8_error_offset(text, size);
  if (bad_byte != size) {
    static const char kHex[] = "0123456789abcdef";
    const std::uint8_t b = text[bad_byte];
    const char byte_text[] = {'0', 'x', kHex[b >> 4], kHex[b & 15], '\0'};
    fail(prefix, what, " is not valid UTF-8: expected UTF-8 text, got byte ", byte_text, " at ",
         what, " offset ", bad_byte);
  }
  if (json_nesting_exceeds(text, size, kMaxJsonDepth)) {
    fail(prefix, what, " JSON nests too deeply: expected depth <= ", kMaxJsonDepth, ", got more");
  }
  nlohmann::json root;
  try {
    // Reject repeated keys in any object (the parser would silently keep the last one).
    std::vector<std::set<std::string>> open_objects;
    auto reject_duplicates = [&](int, nlohmann::json::parse_event_t event,
                                 nlohmann::json& parsed) {
      using Event = nlohmann::json::parse_event_t;
      if (event == Event::object_start) {
        open_objects.emplace_back();
      } else if (event == Event::object_end && !open_objects.empty()) {
        open_objects.pop_back();
      } else if (event == Event::key && !open_objects.empty()) {
        const std::string& key = parsed.get_ref<const std::string&>();
        if (!open_objects.back().insert(key).second) {
          fail(prefix, what, " repeats the key '", key, "': expected unique keys");
        }
      }
      return true;
    };
    const char* first = reinterpret_cast<const char*>(text);
    root = nlohmann::json::parse(first, first + size, reject_duplicates);
  } catch (const nlohmann::json::exception& e) {
    fail(prefix, what, " is not valid JSON: expected a JSON object, got error: ", e.what());
  }
  if (!root.is_object()) {
    fail(prefix, what, ": expected a JSON object, got ", describe_json(root));
  }
  return root;
}

/// What SafeTensors and ShardedSafeTensors share: the name used in error messages and the
/// string metadata map, with its accessors.
class CheckpointSource {
 public:
  /// The path (or the name given to from_bytes) used in error messages.
  const std::string& source() const { return source_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool has_metadata(const std::string& key) const { return metadata_.count(key) != 0; }
  const std::string& metadata_value(const std::string& key) const {
    const auto it = metadata_.find(key);
    if (it == metadata_.end()) fail("metadata key '", key, "' missing in ", source_);
    return it->second;
  }

 protected:
  std::string source_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace detail

/// A parsed, validated safetensors file. Copies are cheap and share the underlying bytes.
/// source() and the "__metadata__" map (metadata(), has_metadata(), metadata_value(): empty if
/// the file has none) come from detail::CheckpointSource.
class SafeTensors : public detail::CheckpointSource {
 public:
  /// Maps (POSIX mmap, read-only) and validates the file at `path`; errors name the path. The
  /// result and its copies share the mapping; nothing is copied into memory.
  static SafeTensors open(const std::string& path) {
    return from_shared_bytes(detail::load_file(path, "safetensors file"), path);
  }

  /// Validates `bytes` as a safetensors file, taking ownership of them; `source` names it in
  /// error messages.
  static SafeTensors from_bytes(std::vector<std::uint8_t> bytes,
                                std::string source = "<memory>") {
    return from_shared_bytes(detail::SharedBytes::from_vector(std::move(bytes)), std::move(source));
  }

  /// Tensor names in sorted order.
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    out.reserve(tensors_.size());
    for (const auto& entry : tensors_) out.push_back(entry.first);
    return out;
  }
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }

  const TensorInfo& info(const std::string& name) const {
    const auto it = tensors_.find(name);
    if (it != tensors_.end()) return it->second;
    std::string available;
    std::size_t listed = 0;
    for (const auto& entry : tensors_) {
      if (listed == 12) {
        available += ", ...";
        break;
      }
      available += (listed++ ? ", " : "") + entry.first;
    }
    detail::fail("tensor '", name, "' missing in ", source_, ": expected one of [", available,
                 "]");
  }

  /// The tensor's bytes (little-endian, row-major, possibly unaligned); valid while this object
  /// or a copy of it lives.
  const std::uint8_t* raw(const std::string& name) const { return bytes_of(info(name)); }

  /// All elements converted to T, row-major. Floating targets round; integer and bool targets
  /// require exactly representable values (bool: 0 or 1).
  template <class T>
  std::vector<T> values(const std::string& name) const {
    return values_of<T>(info(name));
  }

  /// As values(name), after checking that the shape is exactly `shape`.
  template <class T>
  std::vector<T> values(const std::string& name, const std::vector<std::int64_t>& shape) const {
    return values_of<T>(expect_shape(name, shape));
  }

  /// A [rows, cols] tensor as a row-major matrix.
  template <class T>
  Matrix<T> matrix(const std::string& name, Index rows, Index cols) const {
    const TensorInfo& t = expect_shape(name, {static_cast<std::int64_t>(rows),
                                              static_cast<std::int64_t>(cols)});
    Matrix<T> out(rows, cols);
    convert_into<T>(t, [&](std::size_t i, T v) { out.data()[i] = v; });
    return out;
  }

  /// A [size] tensor as a column vector.
  template <class T>
  Vector<T> vector(const std::string& name, Index size) const {
    const TensorInfo& t = expect_shape(name, {static_cast<std::int64_t>(size)});
    Vector<T> out(size);
    convert_into<T>(t, [&](std::size_t i, T v) { out.data()[i] = v; });
    return out;
  }

  /// Any rank-3 tensor, e.g. activations [batch, tokens, features].
  template <class T>
  Tensor3<T> tensor3(const std::string& name) const {
    const TensorInfo& t = expect_rank(name, 3);
    Tensor3<T> out(to_index(t, 0), to_index(t, 1), to_index(t, 2));
    convert_into<T>(t, [&](std::size_t i, T v) { out.data()[i] = v; });
    return out;
  }

  /// A rank-2 tensor of 0/1 values (BOOL, or any integer/float dtype) as a moh::Mask.
  Mask mask(const std::string& name) const {
    const TensorInfo& t = expect_rank(name, 2);
    Mask out(to_index(t, 0), to_index(t, 1));
    convert_into<bool>(t, [&](std::size_t i, bool v) { out.data()[i] = v; });
    return out;
  }

 private:
  SafeTensors() = default;

  /// Validates bytes whose lifetime `bytes` manages (a mapping or a vector); no copy.
  static SafeTensors from_shared_bytes(detail::SharedBytes bytes, std::string source) {
    SafeTensors st;
    st.source_ = std::move(source);
    st.storage_ = std::move(bytes);
    st.parse();
    return st;
  }

  const std::uint8_t* bytes_of(const TensorInfo& t) const {
    return storage_.data() + data_start_ + t.begin;
  }

  const TensorInfo& expect_shape(const std::string& name,
                                 const std::vector<std::int64_t>& shape) const {
    const TensorInfo& t = info(name);
    if (t.shape != shape) {
      detail::fail("tensor '", name, "' in ", source_, ": expected shape ",
                   detail::shape_string(shape), ", got ", detail::shape_string(t.shape));
    }
    return t;
  }

  const TensorInfo& expect_rank(const std::string& name, std::size_t rank) const {
    const TensorInfo& t = info(name);
    if (t.shape.size() != rank) {
      detail::fail("tensor '", name, "' in ", source_, ": expected a rank-", rank,
                   " shape, got ", detail::shape_string(t.shape));
    }
    return t;
  }

  Index to_index(const TensorInfo& t, std::size_t axis) const {
    const std::int64_t d = t.shape[axis];
    if (static_cast<std::uint64_t>(d) > static_cast<std::uint64_t>(std::numeric_limits<Index>::max())) {
      detail::fail("tensor '", t.name, "' in ", source_, ": dimension ", axis,
                   " expected <= ", std::numeric_limits<Index>::max(), ", got ", d);
    }
    return static_cast<Index>(d);
  }

  template <class T>
  std::vector<T> values_of(const TensorInfo& t) const {
    std::vector<T> out(static_cast<std::size_t>(t.numel()));
    convert_into<T>(t, [&](std::size_t i, T v) { out[i] = v; });
    return out;
  }

  /// Decodes every element of `t`, converts it to T and hands it to store(index, value).
  template <class T, class Store>
  void convert_into(const TensorInfo& t, Store&& store) const {
    static_assert(std::is_arithmetic<T>::value, "moh::SafeTensors converts to arithmetic types");
    const std::uint8_t* p = bytes_of(t);
    const std::size_t n = static_cast<std::size_t>(t.numel());
    const std::size_t width = dtype_size(t.dtype);
    auto run = [&](auto decode) {
      for (std::size_t i = 0; i < n; ++i) {
        const auto v = decode(p + i * width);
        T out{};
        if (!detail::convert_value(v, out)) {
          detail::fail("tensor '", t.name, "' in ", source_, ": element ", i, " (",
                       dtype_name(t.dtype), "): expected a value representable as ",
                       detail::type_name<T>(), ", got ", detail::printable(v));
        }
        store(i, out);
      }
    };
    using detail::bit_cast_value;
    using detail::load_le;
    switch (t.dtype) {
      case DType::F64:
        run([](const std::uint8_t* q) { return bit_cast_value<double>(load_le<std::uint64_t>(q)); });
        break;
      case DType::F32:
        run([](const std::uint8_t* q) { return bit_cast_value<float>(load_le<std::uint32_t>(q)); });
        break;
      case DType::F16:
        run([](const std::uint8_t* q) { return half_to_float(load_le<std::uint16_t>(q)); });
        break;
      case DType::BF16:
        run([](const std::uint8_t* q) { return bfloat16_to_float(load_le<std::uint16_t>(q)); });
        break;
      case DType::I64:
        run([](const std::uint8_t* q) {
          return bit_cast_value<std::int64_t>(load_le<std::uint64_t>(q));
        });
        break;
      case DType::I32:
        run([](const std::uint8_t* q) {
          return bit_cast_value<std::int32_t>(load_le<std::uint32_t>(q));
        });
        break;
      case DType::I16:
        run([](const std::uint8_t* q) {
          return bit_cast_value<std::int16_t>(load_le<std::uint16_t>(q));
        });
        break;
      case DType::I8:
        run([](const std::uint8_t* q) { return bit_cast_value<std::int8_t>(q[0]); });
        break;
      case DType::U8:
      case DType::BOOL:  // validated to be 0 or 1 when the file was read
        run([](const std::uint8_t* q) { return q[0]; });
        break;
    }
  }

  // ---- parsing and validation -------------------------------------------------------------

  template <class... Parts>
  [[noreturn]] void bad_file(const Parts&... parts) const {
    detail::fail("safetensors file ", source_, ": ", parts...);
  }

  void parse() {
    const std::uint8_t* bytes = storage_.data();
    const std::uint64_t file_size = storage_.size();
    if (file_size < 8) {
      bad_file("too short for the header length prefix: expected at least 8 bytes, got ",
               file_size);
    }
    const std::uint64_t header_size = detail::load_le<std::uint64_t>(bytes);
    if (header_size > detail::kMaxSafetensorsHeader) {
      bad_file("header length too large: expected <= ", detail::kMaxSafetensorsHeader,
               " bytes, got ", header_size);
    }
    if (header_size > file_size - 8) {
      bad_file("header length exceeds the file: expected <= ", file_size - 8,
               " bytes (file size ", file_size, " minus 8), got ", header_size);
    }
    const std::size_t header_len = static_cast<std::size_t>(header_size);
    data_start_ = 8 + header_len;
    const std::uint64_t data_size = file_size - data_start_;

    const nlohmann::json root = detail::parse_json_strictly(
        bytes + 8, header_len, detail::concat("safetensors file ", source_, ": "), "header");

    for (auto it = root.begin(); it != root.end(); ++it) {
      if (it.key() == "__metadata__") {
        parse_metadata(it.value());
      } else {
        TensorInfo t = parse_entry(it.key(), it.value(), data_size);
        tensors_.emplace(t.name, std::move(t));
      }
    }
    check_no_overlap();
    check_bools();
  }

  void parse_metadata(const nlohmann::json& meta) {
    if (!meta.is_object()) {
      bad_file("__metadata__: expected an object of strings, got ", detail::describe_json(meta));
    }
    for (auto it = meta.begin(); it != meta.end(); ++it) {
      if (!it.value().is_string()) {
        bad_file("__metadata__['", it.key(), "']: expected a string, got ",
                 detail::describe_json(it.value()));
      }
      metadata_.emplace(it.key(), it.value().get<std::string>());
    }
  }

  TensorInfo parse_entry(const std::string& name, const nlohmann::json& entry,
                         std::uint64_t data_size) const {
    static const char* const kFields = "dtype, shape, data_offsets";
    if (!entry.is_object()) {
      bad_file("tensor '", name, "': expected an object with fields ", kFields, ", got ",
               detail::describe_json(entry));
    }
    for (auto it = entry.begin(); it != entry.end(); ++it) {
      if (it.key() != "dtype" && it.key() != "shape" && it.key() != "data_offsets") {
        bad_file("tensor '", name, "': unexpected field '", it.key(), "': expected only ",
                 kFields);
      }
    }
    for (const char* field : {"dtype", "shape", "data_offsets"}) {
      if (!entry.contains(field)) {
        bad_file("tensor '", name, "': expected fields ", kFields, ", got no '", field, "'");
      }
    }

    TensorInfo t;
    t.name = name;

    const nlohmann::json& dtype = entry["dtype"];
    if (!dtype.is_string()) {
      bad_file("tensor '", name, "': dtype: expected a string, got ", detail::describe_json(dtype));
    }
    if (!detail::parse_dtype(dtype.get<std::string>(), t.dtype)) {
      bad_file("tensor '", name, "': unknown dtype: expected one of F64, F32, F16, BF16, I64, "
               "I32, I16, I8, U8, BOOL, got '", dtype.get<std::string>(), "'");
    }

    // Shape: every dim is a non-negative integer; the product of the non-zero dims (which code
    // downstream may use for strides) and the byte size must both fit in int64.
    constexpr std::uint64_t kLimit = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
    const nlohmann::json& shape = entry["shape"];
    if (!shape.is_array()) {
      bad_file("tensor '", name, "': shape: expected an array of non-negative integers, got ",
               detail::describe_json(shape));
    }
    std::uint64_t numel = 1, nonzero_bytes = dtype_size(t.dtype);
    for (std::size_t i = 0; i < shape.size(); ++i) {
      std::uint64_t dim = 0;
      if (!detail::json_to_count(shape[i], kLimit, dim)) {
        bad_file("tensor '", name, "': shape[", i, "]: expected a non-negative integer, got ",
                 detail::describe_json(shape[i]));
      }
      t.shape.push_back(static_cast<std::int64_t>(dim));
      numel *= dim;  // 0, or nonzero_bytes / dtype size: never overflows once checked below
      if (dim != 0 && !detail::checked_mul(nonzero_bytes, dim, kLimit, nonzero_bytes)) {
        bad_file("tensor '", name, "': shape ", detail::shape_string(t.shape),
                 "... is too large: expected a byte size <= ", kLimit, ", got an overflow");
      }
    }
    const std::uint64_t nbytes = numel * dtype_size(t.dtype);  // <= nonzero_bytes <= kLimit

    const nlohmann::json& offsets = entry["data_offsets"];
    std::uint64_t begin = 0, end = 0;
    if (!offsets.is_array() || offsets.size() != 2 ||
        !detail::json_to_count(offsets[0], kLimit, begin) ||
        !detail::json_to_count(offsets[1], kLimit, end)) {
      bad_file("tensor '", name, "': data_offsets: expected [begin, end] with non-negative "
               "integers, got ", detail::describe_json(offsets));
    }
    if (begin > end) {
      bad_file("tensor '", name, "': data_offsets: expected begin <= end, got [", begin, ", ",
               end, "]");
    }
    if (end > data_size) {
      bad_file("tensor '", name, "': data_offsets end beyond the data: expected <= ", data_size,
               " (data bytes after the header), got ", end);
    }
    if (end - begin != nbytes) {
      bad_file("tensor '", name, "': byte size disagrees with dtype and shape: expected ", nbytes,
               " bytes (", dtype_name(t.dtype), " ", detail::shape_string(t.shape), "), got ",
               end - begin, " (data_offsets [", begin, ", ", end, "])");
    }
    t.begin = static_cast<std::size_t>(begin);
    t.end = static_cast<std::size_t>(end);
    return t;
  }

  /// No two non-empty tensors may share bytes.
  void check_no_overlap() const {
    std::vector<const TensorInfo*> order;
    for (const auto& entry : tensors_) {
      if (entry.second.nbytes() != 0) order.push_back(&entry.second);
    }
    std::sort(order.begin(), order.end(),
              [](const TensorInfo* a, const TensorInfo* b) { return a->begin < b->begin; });
    for (std::size_t i = 1; i < order.size(); ++i) {
      const TensorInfo& a = *order[i - 1];
      const TensorInfo& b = *order[i];
      if (b.begin < a.end) {
        bad_file("tensors '", a.name, "' (bytes [", a.begin, ", ", a.end, ")) and '", b.name,
                 "' (bytes [", b.begin, ", ", b.end, ")) overlap: expected disjoint data_offsets");
      }
    }
  }

  /// BOOL tensors store one byte per element, which must be 0 or 1.
  void check_bools() const {
    for (const auto& entry : tensors_) {
      const TensorInfo& t = entry.second;
      if (t.dtype != DType::BOOL) continue;
      const std::uint8_t* p = bytes_of(t);
      for (std::size_t i = 0; i < t.nbytes(); ++i) {
        if (p[i] > 1) {
          bad_file("tensor '", t.name, "': BOOL element ", i, ": expected 0 or 1, got ",
                   static_cast<unsigned>(p[i]));
        }
      }
    }
  }

  detail::SharedBytes storage_;  // the whole file, mapped or in memory
  std::size_t data_start_ = 0;   // first byte after the header
  std::map<std::string, TensorInfo> tensors_;
};

}  // namespace moh
