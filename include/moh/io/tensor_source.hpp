// moh::TensorSource: named tensors read from safetensors files, one or many (a sharded
// checkpoint), behind one interface.
//
// Every accessor is here, once: names, shapes (info), raw bytes, and the values converted to a
// C++ type (floating targets round; integer and bool targets need exactly representable values),
// as a vector, a matrix, a rank-3 tensor or a mask, each after checking the shape, and the
// string metadata. SafeTensors (one file) and ShardedSafeTensors (a Hugging Face index and its
// shards) only fill it; error messages name the file a tensor lives in.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "moh/error.hpp"
#include "moh/io/dtype.hpp"
#include "moh/io/mapped_file.hpp"
#include "moh/tensor.hpp"

namespace moh {

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

/// Named tensors of one or more safetensors files. Copies are cheap and share the bytes.
class TensorSource {
 public:
  /// The path (or the name given to from_bytes) used in error messages: the file, or the index
  /// of a sharded checkpoint.
  const std::string& source() const { return source_; }
  /// String metadata: a file's "__metadata__", or an index's "metadata" (empty if none).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool has_metadata(const std::string& key) const { return metadata_.count(key) != 0; }
  const std::string& metadata_value(const std::string& key) const {
    const auto it = metadata_.find(key);
    if (it == metadata_.end()) detail::fail("metadata key '", key, "' missing in ", source_);
    return it->second;
  }

  /// Tensor names in sorted order.
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    out.reserve(tensors_.size());
    for (const auto& entry : tensors_) out.push_back(entry.first);
    return out;
  }
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }

  const TensorInfo& info(const std::string& name) const { return entry(name).info; }

  /// The file that holds tensor `name` (source() for a single file; its shard when sharded).
  const std::string& file_of(const std::string& name) const { return files_[entry(name).file]; }

  /// The tensor's bytes (little-endian, row-major, possibly unaligned); valid while this object
  /// or a copy of it lives.
  const std::uint8_t* raw(const std::string& name) const { return entry(name).data; }


  /// All elements converted to T, row-major. Floating targets round; integer and bool targets
  /// require exactly representable values (bool: 0 or 1).
  template <class T>
  std::vector<T> values(const std::string& name) const {
    return values_of<T>(entry(name));
  }

  /// As values(name), after checking that the shape is exactly `shape`.
  template <class T>
  std::vector<T> values(const std::string& name, const std::vector<std::int64_t>& shape) const {
    return values_of<T>(expect_shape(name, shape));
  }

  /// A [rows, cols] tensor as a row-major matrix.
  template <class T>
  Matrix<T> matrix(const std::string& name, Index rows, Index cols) const {
    return filled(expect_shape(name, {static_cast<std::int64_t>(rows), static_cast<std::int64_t>(cols)}),
                  Matrix<T>(rows, cols));
  }

  /// A [size] tensor as a column vector.
  template <class T>
  Vector<T> vector(const std::string& name, Index size) const {
    return filled(expect_shape(name, {static_cast<std::int64_t>(size)}), Vector<T>(size));
  }

  /// Any rank-3 tensor, e.g. activations [batch, tokens, features].
  template <class T>
  Tensor3<T> tensor3(const std::string& name) const {
    const Entry& t = expect_rank(name, 3);
    return filled(t, Tensor3<T>(to_index(t, 0), to_index(t, 1), to_index(t, 2)));
  }

  /// Any rank-4 tensor, e.g. an attention bias [batch, heads, queries, keys].
  template <class T>
  Tensor4<T> tensor4(const std::string& name) const {
    const Entry& t = expect_rank(name, 4);
    return filled(t, Tensor4<T>(to_index(t, 0), to_index(t, 1), to_index(t, 2), to_index(t, 3)));
  }

  /// A rank-2 tensor of 0/1 values (BOOL, or any integer/float dtype) as a moh::Mask.
  Mask mask(const std::string& name) const {
    const Entry& t = expect_rank(name, 2);
    return filled(t, Mask(to_index(t, 0), to_index(t, 1)));
  }

 protected:
  /// Where a tensor's bytes are: its header entry, its first byte, and the file it is in.
  struct Entry {
    TensorInfo info;
    const std::uint8_t* data = nullptr;
    std::size_t file = 0;  // index into files_
  };

  std::string source_;
  std::map<std::string, std::string> metadata_;
  std::map<std::string, Entry> tensors_;
  std::vector<std::string> files_;            // names of the files, for messages
  std::vector<detail::SharedBytes> storage_;  // keeps every file's bytes alive

  /// The entry of tensor `name` in another source (a shard).
  static const Entry& entry_in(const TensorSource& source, const std::string& name) {
    return source.entry(name);
  }
  /// The bytes another single-file source (a shard) keeps alive.
  static const detail::SharedBytes& storage_of(const TensorSource& source) {
    return source.storage_.front();
  }

  // A source is copied as what it is (SafeTensors, ShardedSafeTensors), never sliced to a bare
  // TensorSource; take one by reference.
  TensorSource() = default;
  TensorSource(const TensorSource&) = default;
  TensorSource& operator=(const TensorSource&) = default;
  TensorSource(TensorSource&&) noexcept = default;
  TensorSource& operator=(TensorSource&&) noexcept = default;
  ~TensorSource() = default;

 private:
  const Entry& entry(const std::string& name) const {
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

  const Entry& expect_shape(const std::string& name, const std::vector<std::int64_t>& shape) const {
    const Entry& t = entry(name);
    if (t.info.shape != shape) {
      detail::fail("tensor '", name, "' in ", files_[t.file], ": expected shape ",
                   detail::shape_string(shape), ", got ", detail::shape_string(t.info.shape));
    }
    return t;
  }

  const Entry& expect_rank(const std::string& name, std::size_t rank) const {
    const Entry& t = entry(name);
    if (t.info.shape.size() != rank) {
      detail::fail("tensor '", name, "' in ", files_[t.file], ": expected a rank-", rank,
                   " shape, got ", detail::shape_string(t.info.shape));
    }
    return t;
  }

  Index to_index(const Entry& t, std::size_t axis) const {
    const std::int64_t d = t.info.shape[axis];
    if (static_cast<std::uint64_t>(d) > static_cast<std::uint64_t>(std::numeric_limits<Index>::max())) {
      detail::fail("tensor '", t.info.name, "' in ", files_[t.file], ": dimension ", axis,
                   " expected <= ", std::numeric_limits<Index>::max(), ", got ", d);
    }
    return static_cast<Index>(d);
  }

  template <class T>
  std::vector<T> values_of(const Entry& t) const {  // std::vector<bool> has no data()
    std::vector<T> out(static_cast<std::size_t>(t.info.numel()));
    convert_into<T>(t, [&](std::size_t i, T v) { out[i] = v; });
    return out;
  }

  /// `out` (an Eigen matrix, vector or tensor sized for the tensor) with its elements.
  template <class Out>
  Out filled(const Entry& t, Out out) const {
    using T = std::remove_cv_t<std::remove_reference_t<decltype(*out.data())>>;
    T* data = out.data();
    convert_into<T>(t, [data](std::size_t i, T v) { data[i] = v; });
    return out;
  }

  /// Decodes every element of `e`, converts it to T and hands it to store(index, value).
  template <class T, class Store>
  void convert_into(const Entry& e, Store&& store) const {
    static_assert(std::is_arithmetic<T>::value, "moh::TensorSource converts to arithmetic types");
    const TensorInfo& t = e.info;
    const std::uint8_t* p = e.data;
    const std::size_t n = static_cast<std::size_t>(t.numel());
    const std::size_t width = dtype_size(t.dtype);
    auto run = [&](auto decode) {
      for (std::size_t i = 0; i < n; ++i) {
        const auto v = decode(p + i * width);
        T out{};
        if (!detail::convert_value(v, out)) {
          detail::fail("tensor '", t.name, "' in ", files_[e.file], ": element ", i, " (",
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
};

}  // namespace moh
