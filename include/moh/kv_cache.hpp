// KvCache: keys and values of past tokens for incremental (LLM-style) decoding.
//
// Preallocated once: [batch, kv_heads, capacity, head_dim] for keys and for values, plus a
// [batch, capacity] padding flag per slot. A layer's cached forward appends the new tokens'
// keys/values (after RoPE) and attends to everything cached, with bottom-right causal alignment,
// so a chunk of new tokens sees the cache plus itself. One cache belongs to one layer.
#pragma once

#include <vector>

#include "moh/tensor.hpp"

namespace moh {

template <class T>
class KvCache {
 public:
  KvCache() = default;
  /// Allocates room for `capacity` tokens of `batch` sequences.
  KvCache(Index batch, Index kv_heads, Index head_dim, Index capacity)
      : batch_(batch), kv_heads_(kv_heads), head_dim_(head_dim), capacity_(capacity) {
    detail::require(batch > 0 && kv_heads > 0 && head_dim > 0 && capacity > 0,
                    "KvCache: sizes must be positive: expected batch, kv_heads, head_dim, "
                    "capacity > 0, got ",
                    batch, ", ", kv_heads, ", ", head_dim, ", ", capacity);
    keys_.assign(static_cast<std::size_t>(batch * kv_heads * capacity * head_dim), T(0));
    values_.assign(keys_.size(), T(0));
    padding_.setConstant(batch, capacity, false);
  }

  Index batch() const { return batch_; }
  Index kv_heads() const { return kv_heads_; }
  Index head_dim() const { return head_dim_; }
  Index capacity() const { return capacity_; }
  /// Number of tokens cached so far (the same for every sequence of the batch).
  Index length() const { return length_; }
  /// Forgets every cached token; keeps the allocation.
  void reset() {
    length_ = 0;
    any_padding_ = false;
  }
  /// An independent copy (the copy constructor is deleted so a cache is never copied by accident).
  KvCache clone() const { return KvCache(*this, 0); }

  KvCache(KvCache&&) noexcept = default;
  KvCache& operator=(KvCache&&) noexcept = default;
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  /// Keys of sequence b, kv head g: [capacity, head_dim], rows [0, length()) valid.
  T* keys(Index b, Index g) { return keys_.data() + offset(b, g); }
  const T* keys(Index b, Index g) const { return keys_.data() + offset(b, g); }
  T* values(Index b, Index g) { return values_.data() + offset(b, g); }
  const T* values(Index b, Index g) const { return values_.data() + offset(b, g); }
  /// Padding flags of sequence b: [capacity], true = padding.
  const bool* padding(Index b) const { return padding_.data() + b * capacity_; }
  bool any_padding() const { return any_padding_; }

  /// Throws unless this cache fits a layer with these sizes and has room for `new_tokens` more.
  void check(Index batch, Index kv_heads, Index head_dim, Index new_tokens,
             const char* layer) const {
    detail::require(capacity_ > 0, layer, ": KvCache is empty (default-constructed): expected a "
                    "cache made with KvCache(batch, kv_heads, head_dim, capacity)");
    detail::require_equal(std::string(layer) + ": KvCache batch", batch_, batch);
    detail::require_equal(std::string(layer) + ": KvCache kv_heads", kv_heads_, kv_heads);
    detail::require_equal(std::string(layer) + ": KvCache head_dim", head_dim_, head_dim);
    detail::require(length_ + new_tokens <= capacity_, layer, ": KvCache is full: expected at most ",
                    capacity_ - length_, " new tokens (capacity ", capacity_, ", length ",
                    length_, "), got ", new_tokens);
  }

  /// Marks one slot of sequence b as padding or not (layers call this while appending).
  void set_padding(Index b, Index slot, bool pad) {
    padding_(b, slot) = pad;
    any_padding_ = any_padding_ || pad;
  }
  /// Advances the length after a layer wrote n new slots.
  void commit(Index n) { length_ += n; }

 private:
  KvCache(const KvCache& other, int)
      : batch_(other.batch_), kv_heads_(other.kv_heads_), head_dim_(other.head_dim_),
        capacity_(other.capacity_), length_(other.length_), any_padding_(other.any_padding_),
        keys_(other.keys_), values_(other.values_), padding_(other.padding_) {}
  Index offset(Index b, Index g) const { return ((b * kv_heads_) + g) * capacity_ * head_dim_; }

  Index batch_ = 0, kv_heads_ = 0, head_dim_ = 0, capacity_ = 0, length_ = 0;
  bool any_padding_ = false;
  std::vector<T> keys_, values_;       // [batch, kv_heads, capacity, head_dim]
  Eigen::Matrix<bool, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> padding_;  // [batch, capacity]
};

}  // namespace moh
