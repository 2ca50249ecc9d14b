// KvCache: keys and values of past tokens for incremental (LLM-style) decoding.
//
// Preallocated once: [batch, kv_heads, capacity, head_dim] for keys and for values, plus a
// [batch, capacity] padding flag per slot. A layer's forward_cached() appends the new tokens'
// keys/values (after RoPE) and attends to everything cached, with bottom-right causal alignment,
// so a chunk of new tokens sees the cache plus itself. One cache belongs to one layer; the layer
// makes it (make_cache) and is the only one that writes it.
//
// Each sequence has its own length (a server's batch of conversations of different lengths): a
// forward_cached() call appends its new tokens to every sequence after that sequence's own last
// token, at that sequence's RoPE positions, and sequence b's queries see its own length(b)
// tokens. One sequence can be reset or cut back (reset(b), truncate(b, n)) without touching the
// others.
//
// CacheStorage::BFloat16 stores keys and values rounded to bfloat16 (half the bytes a decode step
// streams); attention widens them to T as it reads them and computes in T.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "moh/float16.hpp"

#include "moh/runtime/large_buffer.hpp"
#include "moh/tensor.hpp"

namespace moh {
namespace detail {
struct KvCacheAccess;
}

/// How a KvCache stores keys and values. Attention always computes in the layer's type.
enum class CacheStorage {
  Native,    // in T
  BFloat16,  // rounded to bfloat16 (to nearest, ties to even): half the bytes of float
};

template <class T>
class KvCache {
 public:
  KvCache() = default;
  /// Allocates room for `capacity` tokens of `batch` sequences, stored as `storage` says.
  KvCache(Index batch, Index kv_heads, Index head_dim, Index capacity,
          CacheStorage storage = CacheStorage::Native)
      : batch_(batch), kv_heads_(kv_heads), head_dim_(head_dim), capacity_(capacity),
        storage_(storage) {
    detail::require(batch > 0 && kv_heads > 0 && head_dim > 0 && capacity > 0,
                    "KvCache: sizes must be positive: expected batch, kv_heads, head_dim, "
                    "capacity > 0, got ",
                    batch, ", ", kv_heads, ", ", head_dim, ", ", capacity);
    // Zeroed, in huge pages where the system allows (a decode step streams all of it).
    const auto n = static_cast<std::size_t>(batch * kv_heads * capacity * head_dim);
    if (storage == CacheStorage::Native) {
      keys_ = LargeBuffer<T>(n);
      values_ = LargeBuffer<T>(n);
    } else {
      keys16_ = LargeBuffer<std::uint16_t>(n);
      values16_ = LargeBuffer<std::uint16_t>(n);
    }
    padding_.setConstant(batch * capacity, false);
    lengths_.assign(static_cast<std::size_t>(batch), 0);
  }

  Index batch() const { return batch_; }
  Index kv_heads() const { return kv_heads_; }
  Index head_dim() const { return head_dim_; }
  Index capacity() const { return capacity_; }
  CacheStorage storage() const { return storage_; }
  /// Bytes the keys and values occupy.
  std::size_t bytes() const {
    return (keys_.size() + values_.size()) * sizeof(T) + (keys16_.size() + values16_.size()) * 2;
  }
  /// Number of tokens cached so far: the longest sequence's (every sequence's unless they were
  /// reset or cut back one by one).
  Index length() const { return length_; }
  /// Number of tokens cached for sequence b.
  Index length(Index b) const {
    check_sequence(b, "length");
    return lengths_[static_cast<std::size_t>(b)];
  }
  /// Whether the sequences have different lengths.
  bool ragged() const {
    return std::any_of(lengths_.begin(), lengths_.end(), [&](Index n) { return n != length_; });
  }
  /// Forgets every cached token; keeps the allocation.
  void reset() { truncate(0); }
  /// Forgets sequence b's tokens (a finished conversation whose row takes a new one); the other
  /// sequences keep theirs.
  void reset(Index b) {
    check_sequence(b, "reset");
    truncate(b, 0);
  }
  /// Keeps at most the first `length` tokens of every sequence (e.g. rejected speculative
  /// tokens): the next forward_cached() continues each from there. Requires
  /// 0 <= length <= length().
  void truncate(Index length) {
    detail::require(length >= 0 && length <= length_, "KvCache::truncate: expected a length in "
                    "[0, ", length_, "] (the tokens cached), got ", length);
    for (Index& n : lengths_) n = std::min(n, length);
    update_length();
  }
  /// Keeps the first `length` tokens of sequence b; the others are untouched. Requires
  /// 0 <= length <= length(b).
  void truncate(Index b, Index length) {
    check_sequence(b, "truncate");
    Index& n = lengths_[static_cast<std::size_t>(b)];
    detail::require(length >= 0 && length <= n, "KvCache::truncate: sequence ", b, ": expected a ",
                    "length in [0, ", n, "] (its tokens cached), got ", length);
    n = length;
    update_length();
  }
  /// An independent copy (the copy constructor is deleted so a cache is never copied by accident).
  KvCache clone() const { return KvCache(*this, 0); }

  KvCache(KvCache&&) noexcept = default;
  KvCache& operator=(KvCache&&) noexcept = default;
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  /// Keys of sequence b, kv head g: [capacity, head_dim], rows [0, length(b)) valid (a cache
  /// stored in T; a bfloat16 cache has keys_bf16()).
  const T* keys(Index b, Index g) const { return native(keys_, b, g, "keys"); }
  const T* values(Index b, Index g) const { return native(values_, b, g, "values"); }
  /// The same for a bfloat16 cache: bfloat16 bits (moh::bfloat16_to_float widens one).
  const std::uint16_t* keys_bf16(Index b, Index g) const { return bf16(keys16_, b, g, "keys"); }
  const std::uint16_t* values_bf16(Index b, Index g) const {
    return bf16(values16_, b, g, "values");
  }
  /// Whether slot `slot` (< length()) of sequence b holds a padding token.
  bool is_padding(Index b, Index slot) const { return padding_[b * capacity_ + slot]; }
  /// Whether the cache holds a memory's keys and values (make_memory_cache): read by
  /// forward_cross, never extended by forward_cached.
  bool is_memory() const { return memory_; }

 private:
  friend struct detail::KvCacheAccess;
  KvCache(const KvCache& other, int)
      : batch_(other.batch_), kv_heads_(other.kv_heads_), head_dim_(other.head_dim_),
        capacity_(other.capacity_), length_(other.length_), any_padding_(other.any_padding_),
        memory_(other.memory_), storage_(other.storage_), keys_(other.keys_),
        values_(other.values_), keys16_(other.keys16_), values16_(other.values16_),
        padding_(other.padding_), lengths_(other.lengths_) {}
  Index offset(Index b, Index g) const { return ((b * kv_heads_) + g) * capacity_ * head_dim_; }
  const T* native(const LargeBuffer<T>& v, Index b, Index g, const char* what) const {
    detail::require(storage_ == CacheStorage::Native, "KvCache::", what, ": this cache stores ",
                    "bfloat16: expected ", what, "_bf16(b, g), got ", what, "(b, g)");
    return v.data() + offset(b, g);
  }
  const std::uint16_t* bf16(const LargeBuffer<std::uint16_t>& v, Index b, Index g,
                            const char* what) const {
    detail::require(storage_ == CacheStorage::BFloat16, "KvCache::", what, "_bf16: this cache ",
                    "stores keys and values in T: expected ", what, "(b, g), got ", what,
                    "_bf16(b, g)");
    return v.data() + offset(b, g);
  }
  void check_sequence(Index b, const char* what) const {
    detail::require(b >= 0 && b < batch_, "KvCache::", what, ": expected a sequence in [0, ",
                    batch_, "), got ", b);
  }
  void update_length() {
    length_ = lengths_.empty() ? 0 : *std::max_element(lengths_.begin(), lengths_.end());
    if (length_ == 0) any_padding_ = false;
  }

  Index batch_ = 0, kv_heads_ = 0, head_dim_ = 0, capacity_ = 0, length_ = 0;
  bool any_padding_ = false;      // a slot was marked padding since the cache was last empty
  bool memory_ = false;           // made by make_memory_cache
  CacheStorage storage_ = CacheStorage::Native;
  LargeBuffer<T> keys_, values_;  // [batch, kv_heads, capacity, head_dim] (Native)
  LargeBuffer<std::uint16_t> keys16_, values16_;  // the same in bfloat16 (BFloat16)
  Eigen::Matrix<bool, Eigen::Dynamic, 1> padding_;  // [batch, capacity], true = padding
  std::vector<Index> lengths_;    // [batch]: tokens of each sequence; length_ is their maximum
};

namespace detail {

/// What only the layers do with a cache: check it fits, write new slots, advance its length.
struct KvCacheAccess {
  /// Throws unless `cache` fits a layer with these sizes and has room for `new_tokens` more.
  template <class T>
  static void check(const KvCache<T>& c, Index batch, Index kv_heads, Index head_dim,
                    Index new_tokens, const char* layer) {
    require(c.capacity_ > 0, layer, ": KvCache is empty (default-constructed): expected a cache "
            "made with make_cache(batch, capacity)");
    require(c.batch_ == batch, layer, ": KvCache batch: expected ", batch, ", got ", c.batch_);
    require(c.kv_heads_ == kv_heads, layer, ": KvCache kv_heads: expected ", kv_heads, ", got ",
            c.kv_heads_);
    require(c.head_dim_ == head_dim, layer, ": KvCache head_dim: expected ", head_dim, ", got ",
            c.head_dim_);
    require(c.length_ + new_tokens <= c.capacity_, layer, ": KvCache is full: expected at most ",
            c.capacity_ - c.length_, " new tokens (capacity ", c.capacity_, ", length ",
            c.length_, "), got ", new_tokens);
  }
  /// Stores one token's key and value heads (d values each) of sequence b, kv head g at `slot`.
  template <class T>
  static void store(KvCache<T>& c, Index b, Index g, Index slot, const T* key, const T* value) {
    const Index d = c.head_dim_, at = c.offset(b, g) + slot * d;
    if (c.storage_ == CacheStorage::Native) {
      std::copy(key, key + d, c.keys_.data() + at);
      std::copy(value, value + d, c.values_.data() + at);
      return;
    }
    for (Index i = 0; i < d; ++i) {
      c.keys16_[static_cast<std::size_t>(at + i)] = float_to_bfloat16(static_cast<float>(key[i]));
      c.values16_[static_cast<std::size_t>(at + i)] =
          float_to_bfloat16(static_cast<float>(value[i]));
    }
  }
  /// Writable keys and values of sequence b, kv head g of a cache stored in T.
  template <class T>
  static T* keys(KvCache<T>& c, Index b, Index g) {
    eigen_assert(c.storage_ == CacheStorage::Native);
    return c.keys_.data() + c.offset(b, g);
  }
  template <class T>
  static T* values(KvCache<T>& c, Index b, Index g) {
    eigen_assert(c.storage_ == CacheStorage::Native);
    return c.values_.data() + c.offset(b, g);
  }
  /// Keys and values of sequence 0, kv head 0 (the rest at offset(b, g)) in either storage.
  template <class T>
  static const T* keys(const KvCache<T>& c) { return c.keys_.data(); }
  template <class T>
  static const T* values(const KvCache<T>& c) { return c.values_.data(); }
  template <class T>
  static const std::uint16_t* keys16(const KvCache<T>& c) { return c.keys16_.data(); }
  template <class T>
  static const std::uint16_t* values16(const KvCache<T>& c) { return c.values16_.data(); }
  template <class T>
  static void set_padding(KvCache<T>& c, Index b, Index slot, bool pad) {
    c.padding_[b * c.capacity_ + slot] = pad;
    c.any_padding_ = c.any_padding_ || pad;
  }
  /// Padding flags of sequence b ([capacity]), or null when no cached slot is padding.
  template <class T>
  static const bool* padding(const KvCache<T>& c, Index b) {
    return c.any_padding_ ? c.padding_.data() + b * c.capacity_ : nullptr;
  }
  /// Advances every sequence's length after a layer wrote n new slots after each.
  template <class T>
  static void commit(KvCache<T>& c, Index n) {
    for (Index& l : c.lengths_) l += n;
    c.length_ += n;
  }
  /// The sequences' lengths ([batch]).
  template <class T>
  static const Index* lengths(const KvCache<T>& c) { return c.lengths_.data(); }
  template <class T>
  static void mark_memory(KvCache<T>& c) { c.memory_ = true; }
};

}  // namespace detail
}  // namespace moh
