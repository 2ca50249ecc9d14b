// moh::SafeTensorsWriter: builds a safetensors file from tensors held in memory.
//
// Output layout (the standard format, readable by moh::SafeTensors and by Python's safetensors):
// an 8-byte little-endian header length N, N bytes of compact UTF-8 JSON padded with spaces to a
// multiple of 8 (so the data starts 8-byte aligned), then every tensor's bytes back to back in
// name order, little-endian whatever the host. The header lists "__metadata__" first (when set),
// then the tensors in name order; the same tensors and metadata always give the same bytes.
//
// Values are converted to the target dtype when a tensor is added, so errors surface at add():
// floating targets round to nearest even (F16/BF16 from double round once, not twice), integer
// and BOOL targets need exactly representable values (BOOL: 0 or 1) and throw moh::Error
// otherwise. The writer owns the encoded bytes; the caller's buffers may go right after add().
#pragma once

#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "moh/error.hpp"
#include "moh/io/dtype.hpp"
#include "moh/io/json.hpp"
#include "moh/io/mapped_file.hpp"
#include "moh/tensor.hpp"

namespace moh {

/// Collects named tensors and metadata and writes them as one safetensors file.
class SafeTensorsWriter {
 public:
  /// Adds tensor `name` of `shape` from numel(shape) row-major values at `data`, stored as `dtype`.
  /// T is float, double, bool or an integer type; the values are converted and copied now.
  template <class T>
  void add(const std::string& name, const T* data, const std::vector<std::int64_t>& shape,
           DType dtype) {
    const std::size_t n = checked_numel(name, shape);
    detail::require(data != nullptr || n == 0, "SafeTensorsWriter: tensor '", name,
                    "': expected data for ", n, " elements, got a null pointer");
    add_elements<T>(name, shape, dtype, n, [data](std::size_t i) { return data[i]; });
  }

  /// Adds tensor `name` from `values` (row-major, values.size() == numel(shape)) as `dtype`.
  template <class T>
  void add(const std::string& name, const std::vector<T>& values,
           const std::vector<std::int64_t>& shape, DType dtype = dtype_for<T>()) {
    const std::size_t n = checked_numel(name, shape);
    if (values.size() != n) {
      detail::fail("SafeTensorsWriter: tensor '", name, "': data size does not match shape ",
                   detail::shape_string(shape), ": expected ", n, " values, got ", values.size());
    }
    add_elements<T>(name, shape, dtype, n, [&values](std::size_t i) { return T(values[i]); });
  }

  /// Adds a row-major [rows, cols] matrix as `dtype`.
  template <class T>
  void add(const std::string& name, const Matrix<T>& m, DType dtype = dtype_for<T>()) {
    add(name, m.data(), {static_cast<std::int64_t>(m.rows()), static_cast<std::int64_t>(m.cols())},
        dtype);
  }

  /// Adds a [size] vector as `dtype`.
  template <class T>
  void add(const std::string& name, const Vector<T>& v, DType dtype = dtype_for<T>()) {
    add(name, v.data(), {static_cast<std::int64_t>(v.size())}, dtype);
  }

  /// Adds a row-major [d0, d1, d2] tensor, e.g. activations [batch, tokens, features], as `dtype`.
  template <class T>
  void add(const std::string& name, const Tensor3<T>& t, DType dtype = dtype_for<T>()) {
    add(name, t.data(),
        {static_cast<std::int64_t>(t.dimension(0)), static_cast<std::int64_t>(t.dimension(1)),
         static_cast<std::int64_t>(t.dimension(2))},
        dtype);
  }

  /// Adds a [batch, keys] mask as `dtype` (BOOL by default; true -> 1).
  void add(const std::string& name, const Mask& mask, DType dtype = DType::BOOL) {
    add(name, mask.data(),
        {static_cast<std::int64_t>(mask.dimension(0)), static_cast<std::int64_t>(mask.dimension(1))},
        dtype);
  }

  /// Sets "__metadata__"[key] = value, replacing an earlier value of the key.
  void set_metadata(const std::string& key, const std::string& value) {
    require_utf8("metadata key", key, key);
    require_utf8("metadata value", key, value);
    metadata_[key] = value;
  }

  /// True if a tensor called `name` was added.
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }

  /// The whole file: length prefix, padded header, data.
  std::vector<std::uint8_t> to_bytes() const {
    const std::string header = header_text();
    std::vector<std::uint8_t> out(8 + header.size() + data_size_);
    detail::store_le<std::uint64_t>(out.data(), header.size());
    std::uint8_t* p = out.data() + 8;
    for (char c : header) *p++ = static_cast<std::uint8_t>(c);
    for (const auto& entry : tensors_) {
      std::copy(entry.second.bytes.begin(), entry.second.bytes.end(), p);
      p += entry.second.bytes.size();
    }
    return out;
  }

  /// Writes the file to `path + ".tmp"`, flushes it, then renames it to `path`, so `path` is
  /// either absent/old or complete. Errors name the path and the system's reason.
  void write(const std::string& path) const {
    const std::string tmp = path + ".tmp";
    std::FILE* file = std::fopen(tmp.c_str(), "wb");
    if (file == nullptr) {
      detail::fail("SafeTensorsWriter: cannot create '", tmp, "': expected a writable path, got "
                   "error: ", detail::errno_text(errno));
    }
    const std::string header = header_text();
    std::uint8_t prefix[8];
    detail::store_le<std::uint64_t>(prefix, header.size());
    bool ok = std::fwrite(prefix, 1, 8, file) == 8 &&
              std::fwrite(header.data(), 1, header.size(), file) == header.size();
    for (auto it = tensors_.begin(); ok && it != tensors_.end(); ++it) {
      const std::vector<std::uint8_t>& bytes = it->second.bytes;
      ok = std::fwrite(bytes.data(), 1, bytes.size(), file) == bytes.size();
    }
    ok = ok && std::fflush(file) == 0;
#if MOH_HAS_MMAP
    ok = ok && ::fsync(::fileno(file)) == 0;  // the data is on disk before the rename
#endif
    const int write_error = errno;
    const bool closed = std::fclose(file) == 0;
    if (!ok || !closed) {
      const int error = ok ? errno : write_error;
      std::remove(tmp.c_str());
      detail::fail("SafeTensorsWriter: cannot write '", tmp, "': expected ",
                   8 + header.size() + data_size_, " bytes written, got error: ",
                   detail::errno_text(error));
    }
    if (std::rename(tmp.c_str(), path.c_str()) != 0) {
      const int error = errno;
      std::remove(tmp.c_str());
      detail::fail("SafeTensorsWriter: cannot rename '", tmp, "' to '", path,
                   "': expected a writable path, got error: ", detail::errno_text(error));
    }
  }

 private:
  struct Pending {
    DType dtype = DType::F32;
    std::vector<std::int64_t> shape;
    std::vector<std::uint8_t> bytes;  // encoded, little-endian
  };

  void require_utf8(const char* what, const std::string& name, const std::string& text) const {
    const auto* s = reinterpret_cast<const std::uint8_t*>(text.data());
    const std::size_t bad = detail::utf8_error_offset(s, text.size());
    if (bad != text.size()) {
      detail::fail("SafeTensorsWriter: ", what, " '", name, "': expected UTF-8 text, got an "
                   "invalid byte at offset ", bad);
    }
  }

  /// Checks the name and the shape; returns the element count.
  std::size_t checked_numel(const std::string& name, const std::vector<std::int64_t>& shape) const {
    if (name.empty()) detail::fail("SafeTensorsWriter: tensor name: expected a non-empty name, got \"\"");
    if (name == "__metadata__") {
      detail::fail("SafeTensorsWriter: tensor name: expected any name but the reserved "
                   "\"__metadata__\", got \"__metadata__\"");
    }
    require_utf8("tensor", name, name);
    if (tensors_.count(name) != 0) {
      detail::fail("SafeTensorsWriter: tensor '", name, "': expected a new name, got one already "
                   "added");
    }
    // Like the reader: the product of the non-zero dims and the byte size fit in int64.
    constexpr std::uint64_t kLimit = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
    std::uint64_t numel = 1, nonzero = 8;  // 8 = the widest dtype
    for (std::size_t i = 0; i < shape.size(); ++i) {
      if (shape[i] < 0) {
        detail::fail("SafeTensorsWriter: tensor '", name, "': shape[", i,
                     "]: expected a non-negative dimension, got ", shape[i], " in ",
                     detail::shape_string(shape));
      }
      const std::uint64_t dim = static_cast<std::uint64_t>(shape[i]);
      numel *= dim;
      if (dim != 0 && !detail::checked_mul(nonzero, dim, kLimit, nonzero)) {
        detail::fail("SafeTensorsWriter: tensor '", name, "': shape ", detail::shape_string(shape),
                     " is too large: expected a byte size <= ", kLimit, ", got an overflow");
      }
    }
    if constexpr (sizeof(std::size_t) < sizeof(std::uint64_t)) {
      if (numel > std::numeric_limits<std::size_t>::max() / 8) {
        detail::fail("SafeTensorsWriter: tensor '", name, "': shape ", detail::shape_string(shape),
                     " is too large for this machine: expected <= ",
                     std::numeric_limits<std::size_t>::max() / 8, " elements, got ", numel);
      }
    }
    return static_cast<std::size_t>(numel);
  }

  /// Encodes element(i) for i < n as `dtype` and records the tensor.
  template <class T, class Element>
  void add_elements(const std::string& name, const std::vector<std::int64_t>& shape, DType dtype,
                    std::size_t n, Element&& element) {
    static_assert(std::is_same<T, float>::value || std::is_same<T, double>::value ||
                      std::is_integral<T>::value,
                  "moh::SafeTensorsWriter writes float, double, bool and integer values");
    Pending t;
    t.dtype = dtype;
    t.shape = shape;
    const std::size_t width = dtype_size(dtype);
    t.bytes.resize(n * width);
    std::uint8_t* out = t.bytes.data();
    auto encode = [&](auto convert) {
      for (std::size_t i = 0; i < n; ++i) convert(element(i), out + i * width, i);
    };
    switch (dtype) {
      case DType::F64:
        encode([&](T v, std::uint8_t* p, std::size_t i) { store<double>(name, v, p, i, dtype); });
        break;
      case DType::F32:
        encode([&](T v, std::uint8_t* p, std::size_t i) { store<float>(name, v, p, i, dtype); });
        break;
      case DType::F16:
        encode([](T v, std::uint8_t* p, std::size_t) {
          detail::store_le<std::uint16_t>(p, float_to_half(detail::to_float_for_narrowing(v)));
        });
        break;
      case DType::BF16:
        encode([](T v, std::uint8_t* p, std::size_t) {
          detail::store_le<std::uint16_t>(p, float_to_bfloat16(detail::to_float_for_narrowing(v)));
        });
        break;
      case DType::I64:
        encode([&](T v, std::uint8_t* p, std::size_t i) { store<std::int64_t>(name, v, p, i, dtype); });
        break;
      case DType::I32:
        encode([&](T v, std::uint8_t* p, std::size_t i) { store<std::int32_t>(name, v, p, i, dtype); });
        break;
      case DType::I16:
        encode([&](T v, std::uint8_t* p, std::size_t i) { store<std::int16_t>(name, v, p, i, dtype); });
        break;
      case DType::I8:
        encode([&](T v, std::uint8_t* p, std::size_t i) { store<std::int8_t>(name, v, p, i, dtype); });
        break;
      case DType::U8:
        encode([&](T v, std::uint8_t* p, std::size_t i) { store<std::uint8_t>(name, v, p, i, dtype); });
        break;
      case DType::BOOL:
        encode([&](T v, std::uint8_t* p, std::size_t i) { store<bool>(name, v, p, i, dtype); });
        break;
    }
    data_size_ += t.bytes.size();
    tensors_.emplace(name, std::move(t));
  }

  /// Converts one value to the element type E of `dtype` (exactly for integers and bool, with
  /// IEEE rounding for floats) and stores its little-endian bytes at `p`.
  template <class E, class T>
  static void store(const std::string& name, T v, std::uint8_t* p, std::size_t i, DType dtype) {
    E e{};
    if (!detail::convert_value(v, e)) {
      detail::fail("SafeTensorsWriter: tensor '", name, "': element ", i, ": expected a value "
                   "representable as ", dtype_name(dtype), " (", detail::type_name<E>(), "), got ",
                   detail::printable(v));
    }
    if constexpr (std::is_same<E, bool>::value) {
      p[0] = e ? 1 : 0;
    } else {
      using U = std::conditional_t<sizeof(E) == 8, std::uint64_t,
                std::conditional_t<sizeof(E) == 4, std::uint32_t,
                std::conditional_t<sizeof(E) == 2, std::uint16_t, std::uint8_t>>>;
      detail::store_le<U>(p, detail::bit_cast_value<U>(e));
    }
  }

  /// The JSON header, padded with spaces to a multiple of 8 bytes.
  std::string header_text() const {
    const auto dump = [](const nlohmann::json& j) {
      return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::strict);
    };
    std::string header = "{";
    if (!metadata_.empty()) header += dump("__metadata__") + ":" + dump(metadata_);
    std::size_t offset = 0;
    for (const auto& entry : tensors_) {
      const Pending& t = entry.second;
      const nlohmann::json fields = {{"dtype", dtype_name(t.dtype)},
                                     {"shape", t.shape},
                                     {"data_offsets", {offset, offset + t.bytes.size()}}};
      offset += t.bytes.size();
      if (header.size() > 1) header += ',';
      header += dump(entry.first) + ":" + dump(fields);
    }
    header += '}';
    header.append((8 - header.size() % 8) % 8, ' ');
    if (header.size() > detail::kMaxSafetensorsHeader) {
      detail::fail("SafeTensorsWriter: header too large: expected <= ",
                   detail::kMaxSafetensorsHeader, " bytes (what readers accept), got ",
                   header.size());
    }
    return header;
  }

  std::map<std::string, Pending> tensors_;  // sorted by name: the order in the file
  std::map<std::string, std::string> metadata_;
  std::size_t data_size_ = 0;  // sum of the tensors' byte sizes
};

}  // namespace moh
