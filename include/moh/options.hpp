// Per-call options shared by every layer's forward(), forward_cross() and forward_cached().
#pragma once

#include <optional>
#include <type_traits>
#include <utility>

#include "moh/runtime/thread_pool.hpp"
#include "moh/runtime/workspace.hpp"
#include "moh/tensor.hpp"

namespace moh {

/// The causal mask of a call (bottom-right aligned, docs/semantics.md §1).
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

/// A non-owning view of a row-major [d0, d1, d2, d3] tensor of float or double, or none: an
/// attention bias the call reads (Writable = false) or where it writes attention probabilities
/// (Writable = true). Assigning a view rebinds it. Its scalar type must be the layer's.
template <bool Writable>
class Tensor4Ref {
  template <class T>
  using Pointer = std::conditional_t<Writable, T*, const T*>;

 public:
  Tensor4Ref() = default;
  Tensor4Ref(std::nullopt_t) {}
  Tensor4Ref(Pointer<float> data, Index d0, Index d1, Index d2, Index d3)
      : data_(data), is_double_(false), set_(true), dims_{d0, d1, d2, d3} {}
  Tensor4Ref(Pointer<double> data, Index d0, Index d1, Index d2, Index d3)
      : data_(data), is_double_(true), set_(true), dims_{d0, d1, d2, d3} {}
  /// From an Eigen tensor or tensor map of float or double (row-major, 4-D).
  template <class Tn, class = decltype(std::declval<Tn&>().data()),
            class = std::enable_if_t<std::decay_t<Tn>::NumDimensions == 4>>
  Tensor4Ref(Tn& t)  // NOLINT: implicit, like the masks
      : Tensor4Ref(t.data(), t.dimension(0), t.dimension(1), t.dimension(2), t.dimension(3)) {
    static_assert(static_cast<int>(std::decay_t<Tn>::Layout) == static_cast<int>(Eigen::RowMajor),
                  "moh: attention bias and probabilities are row-major tensors");
  }

  explicit operator bool() const { return set_; }
  Index dimension(int axis) const { return dims_[axis]; }
  /// The data as T; a view of the other scalar type is a moh::Error naming `what`.
  template <class T>
  Pointer<T> data(const char* layer, const char* what) const {
    detail::require(is_double_ == std::is_same<T, double>::value, layer, ": ", what,
                    ": expected ", std::is_same<T, double>::value ? "double" : "float",
                    " values (the layer's scalar type), got ",
                    is_double_ ? "double" : "float");
    return static_cast<Pointer<T>>(data_);
  }

 private:
  Pointer<void> data_ = nullptr;
  bool is_double_ = false, set_ = false;
  Index dims_[4] = {0, 0, 0, 0};
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
  /// MoAAttention only: [batch, tokens], true = that query token is padding (fairseq's skip
  /// mask): no expert is routed or computed for it, its output row is 0, and it is left out of
  /// the expert counts and the switch and cv losses (docs/semantics.md §9).
  PaddingMask query_padding_mask;
  /// An additive bias on the scores, [B or 1, H or 1, T, S] of the layer's scalar type, added
  /// after the scaling and before the softmax (docs/semantics.md §6): fairseq's attn_mask, ALiBi,
  /// relative position biases, sliding windows (-inf hides a key). H is the layer's query heads;
  /// for MoAAttention it must be 1. A dimension given as 1 is broadcast, never copied.
  Tensor4Ref<false> attn_bias;
  /// When set, the call writes its attention probabilities here, of the layer's scalar type:
  /// [B, H, T, S] for MultiHeadAttention and MoHAttention (rows of heads a token did not use
  /// are zero), [B, top_k * num_kv_heads, T, S] for MoAAttention (slot s's heads at s H_kv ..).
  /// Off by default, and nothing is spent on it then.
  Tensor4Ref<true> attention_weights;
  /// MoH-ViT's cosine attention only: the token grid [h, w] of x (T = h w, row-major), from which
  /// the continuous position bias is computed (and kept per grid). Left 0 x 0, the layer takes
  /// its pretraining grid when T has that many tokens (else it is an error): pass the grid for
  /// any other shape, also one of the same number of tokens (5 x 4 for a 4 x 5 model).
  Index grid_h = 0, grid_w = 0;
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
