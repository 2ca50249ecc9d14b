// Per-call options shared by every layer's forward().
#pragma once

#include <optional>

#include "moh/tensor.hpp"
#include "moh/thread_pool.hpp"

namespace moh {

/// How a routed layer (MoH, MoA) computes its heads.
enum class ComputeMode {
  Sparse,  // only the (token, head) pairs a router selected: cost follows the heads used
  Dense,   // every head for every token, then multiplied by its gate: the reference path
};

/// A non-owning view of a [batch, keys] key padding mask (true = padding), or no mask. It reads
/// like std::optional<MaskMap>, but assigning a new mask rebinds the view: Eigen's TensorMap
/// assignment would copy elements into the mask viewed before.
class PaddingMask {
 public:
  PaddingMask() = default;
  PaddingMask(std::nullopt_t) {}
  PaddingMask(const MaskMap& mask)  // NOLINT: implicit, like the optional it replaces
      : data_(mask.data()), batch_(mask.dimension(0)), keys_(mask.dimension(1)), set_(true) {}

  bool has_value() const { return set_; }
  explicit operator bool() const { return set_; }
  void reset() { *this = PaddingMask(); }
  const PaddingMask& operator*() const { return *this; }
  const PaddingMask* operator->() const { return this; }

  Index dimension(int axis) const { return axis == 0 ? batch_ : keys_; }
  const bool* data() const { return data_; }
  bool operator()(Index b, Index k) const { return data_[b * keys_ + k]; }

 private:
  const bool* data_ = nullptr;
  Index batch_ = 0, keys_ = 0;
  bool set_ = false;
};

/// Options of one forward call. Pointers are not owned.
struct ForwardOptions {
  bool causal = false;                      // bottom-right causal mask (SEMANTICS 1)
  PaddingMask key_padding_mask;             // [batch, keys], true = padding; with a KV cache:
                                            // [batch, new tokens], stored in the cache
  ThreadPool* pool = nullptr;               // threads to use; null = the calling thread only
  ComputeMode mode = ComputeMode::Sparse;   // routed layers only
  Index position_offset = 0;                // RoPE position of the first token (no cache)
};

/// Maps a moh::Mask for ForwardOptions::key_padding_mask.
inline MaskMap map_mask(const Mask& mask) {
  return MaskMap(mask.data(), mask.dimension(0), mask.dimension(1));
}

namespace detail {

/// Checks a key padding mask against [batch, keys].
inline void check_padding(const PaddingMask& mask, Index batch, Index keys,
                          const char* layer) {
  if (!mask) return;
  if (mask->dimension(0) != batch || mask->dimension(1) != keys) {
    fail(layer, ": key_padding_mask: expected shape [", batch, ", ", keys, "], got [",
         mask->dimension(0), ", ", mask->dimension(1), "]");
  }
}

}  // namespace detail
}  // namespace moh
