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
// SafeTensors::open maps the file read-only (POSIX mmap, MAP_PRIVATE; io/mapped_file.hpp)
// instead of copying it, so a multi-GB checkpoint costs page cache, not heap; copies of a SafeTensors share the mapping, which
// is released with the last copy. As with any mapped file, the file must not be truncated while
// it is open. Platforms without mmap read the file into memory instead.
//
// The accessors (names, info, values, matrix, vector, tensor3, mask, metadata) are
// TensorSource's (io/tensor_source.hpp).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "moh/error.hpp"
#include "moh/io/dtype.hpp"
#include "moh/io/json.hpp"
#include "moh/io/mapped_file.hpp"
#include "moh/io/tensor_source.hpp"

namespace moh {

/// A parsed, validated safetensors file. Copies are cheap and share the underlying bytes.
class SafeTensors : public TensorSource {
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

 private:
  SafeTensors() = default;

  /// Validates bytes whose lifetime `bytes` manages (a mapping or a vector); no copy.
  static SafeTensors from_shared_bytes(detail::SharedBytes bytes, std::string source) {
    SafeTensors st;
    st.source_ = std::move(source);
    st.files_.push_back(st.source_);
    st.storage_.push_back(std::move(bytes));
    st.parse();
    return st;
  }

  // ---- parsing and validation -------------------------------------------------------------

  template <class... Parts>
  [[noreturn]] void bad_file(const Parts&... parts) const {
    detail::fail("safetensors file ", source_, ": ", parts...);
  }

  void parse() {
    const std::uint8_t* bytes = storage_[0].data();
    const std::uint64_t file_size = storage_[0].size();
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
    const std::size_t data_start = 8 + header_len;
    const std::uint64_t data_size = file_size - data_start;

    const nlohmann::json root = detail::parse_json_strictly(
        bytes + 8, header_len, detail::concat("safetensors file ", source_, ": "), "header");

    for (auto it = root.begin(); it != root.end(); ++it) {
      if (it.key() == "__metadata__") {
        parse_metadata(it.value());
      } else {
        TensorInfo t = parse_entry(it.key(), it.value(), data_size);
        const std::uint8_t* data = bytes + data_start + t.begin;
        std::string name = t.name;
        tensors_.emplace(std::move(name), Entry{std::move(t), data, 0});
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
      if (entry.second.info.nbytes() != 0) order.push_back(&entry.second.info);
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
      const TensorInfo& t = entry.second.info;
      if (t.dtype != DType::BOOL) continue;
      const std::uint8_t* p = entry.second.data;
      for (std::size_t i = 0; i < t.nbytes(); ++i) {
        if (p[i] > 1) {
          bad_file("tensor '", t.name, "': BOOL element ", i, ": expected 0 or 1, got ",
                   static_cast<unsigned>(p[i]));
        }
      }
    }
  }
};

}  // namespace moh
