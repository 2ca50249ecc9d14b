// Per-call options shared by every layer's forward(), forward_cross() and forward_cached().
#pragma once

#include <optional>

#include "moh/runtime/thread_pool.hpp"
#include "moh/runtime/workspace.hpp"
#include "moh/tensor.hpp"

namespace moh {

/// The causal mask of a call (bottom-right aligned, SEMANTICS 1).
enum class Causal {
  Auto,  // forward and forward_cross: off; forward_cached: on, so that a prompt fed in one call
         // equals the same prompt fed token by token
  On,
  Off,
};

/// How a routed layer (MoH, MoA) computes its heads. MultiHeadAttention has no modes: anything
/// but Auto is an error there.
enum class ComputeMode {
  Auto,    // Sparse for the routed layers
  Sparse,  // only the (token, head) pairs a router selected: cost follows the heads used
  Dense,   // every head for every token, then multiplied by its gate: the reference path
};

/// A non-owning view of a [batch, tokens] padding mask (true = padding), or no mask. It reads
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

/// Options of one call. Pointers are not owned.
struct ForwardOptions {
  Causal causal = Causal::Auto;
  /// forward / forward_cross: [batch, keys] (S = T for self-attention), true = that key is
  /// padding and never attended to. Not for forward_cached (see new_token_padding_mask).
  PaddingMask key_padding_mask;
  /// forward_cached only: [batch, new tokens], true = that new token is padding. The flags are
  /// stored in the cache with the token, so no later query attends to it either.
  PaddingMask new_token_padding_mask;
  ThreadPool* pool = nullptr;     // threads to use; null = the calling thread only
  Workspace* workspace = nullptr;  // scratch; null = a temporary one (the call then allocates)
  ComputeMode mode = ComputeMode::Auto;
  /// RoPE position of x's first token for forward / forward_cross (layers with RoPE only); a
  /// cached call continues from the cache's length instead, so this must stay 0 there.
  Index position_offset = 0;
};

/// The routing record of a layer that routes nothing (MultiHeadAttention's last argument).
struct NoRouting {};

/// Maps a moh::Mask for ForwardOptions' padding masks.
inline MaskMap map_mask(const Mask& mask) {
  return MaskMap(mask.data(), mask.dimension(0), mask.dimension(1));
}

}  // namespace moh
