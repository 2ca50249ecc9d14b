// MultiHeadAttention: dense multi-head attention (Vaswani et al. 2017), as torch.nn.MultiheadAttention.
//
//   [q | k | v] = x W_in^T + b_in              W_in [(H + 2 H_kv) d, D]
//   o_h = softmax(q_h k_g^T / sqrt(d) + mask) v_g,   g = h / (H / H_kv)
//   y = concat_h(o_h) W_out^T + b_out          W_out [D, H d]
//
// Self- and cross-attention, grouped-query heads (H_kv < H; H_kv = 1 is multi-query), optional
// RoPE on queries and keys, and incremental decoding through a KvCache.
#pragma once

#include <cstdint>
#include <random>

#include "moh/detail/attend.hpp"
#include "moh/detail/projections.hpp"
#include "moh/kv_cache.hpp"
#include "moh/options.hpp"
#include "moh/tensor.hpp"

namespace moh {

/// Sizes and settings of a MultiHeadAttention layer.
struct MhaConfig {
  Index embed_dim = 0;      // D
  Index num_heads = 0;      // H
  Index head_dim = 0;       // d; 0 = embed_dim / num_heads
  Index num_kv_heads = 0;   // H_kv; 0 = num_heads
  bool bias = true;         // biases on the input and output projections
  bool rope = false;        // rotary position embedding on queries and keys
  double rope_base = 10000.0;
  WeightStorage weight_storage = WeightStorage::Native;  // projections in T or bfloat16

  Index head_size() const { return head_dim ? head_dim : (num_heads ? embed_dim / num_heads : 0); }
  Index kv_heads() const { return num_kv_heads ? num_kv_heads : num_heads; }
  /// Throws moh::Error on impossible settings.
  void validate() const { detail::make_geometry(*this, "MultiHeadAttention"); }
};

template <class T>
class MultiHeadAttention {
 public:
  using Scalar = T;

  /// Zero weights; set them with the setters or load_weights().
  explicit MultiHeadAttention(const MhaConfig& config)
      : config_(config), proj_(detail::make_geometry(config, kName), kName) {}
  /// Seeded random weights, uniform in +-1/sqrt(fan_in) like torch.nn.Linear.
  MultiHeadAttention(const MhaConfig& config, std::uint64_t seed) : MultiHeadAttention(config) {
    std::mt19937_64 rng(seed);
    proj_.randomize(rng);
  }

  const MhaConfig& config() const { return config_; }
  Index embed_dim() const { return geo().D; }
  Index num_heads() const { return geo().H; }
  Index head_dim() const { return geo().d; }
  Index num_kv_heads() const { return geo().Hkv; }

  // Weights in PyTorch layout. Setters check shapes and throw moh::Error.
  Matrix<T> in_proj_weight() const { return proj_.in_weight(); }    // [(H+2H_kv) d, D]
  const Vector<T>& in_proj_bias() const { return proj_.in_bias(); }        // [(H+2H_kv) d] or empty
  Matrix<T> out_proj_weight() const { return proj_.out_weight(); }  // [D, H d]
  const Vector<T>& out_proj_bias() const { return proj_.out_bias(); }      // [D] or empty
  void set_in_proj_weight(const Matrix<T>& w) { proj_.set_in_weight(w); }
  void set_in_proj_bias(const Vector<T>& b) { proj_.set_in_bias(b); }
  void set_out_proj_weight(const Matrix<T>& w) { proj_.set_out_weight(w); }
  void set_out_proj_bias(const Vector<T>& b) { proj_.set_out_bias(b); }
  /// Bytes of weights and biases the layer holds (halved for the weights with bfloat16 storage).
  std::size_t weight_bytes() const { return proj_.weight_bytes(); }

  /// Self-attention. x, y: [B, T, D] (y written, may not alias x).
  void forward(const ConstTensorMap3<T>& x, TensorMap3<T> y, const ForwardOptions& opts = {}) const {
    const Index B = x.dimension(0), Tq = x.dimension(1);
    check_io(x, y);
    const MatrixMap<T> KV = proj_.keys_values_of(x, opts.position_offset, opts.pool);
    run(x, proj_.key_values(KV, B, Tq, opts.key_padding_mask), opts.position_offset, opts, y);
  }

  /// Cross-attention: queries from x [B, T, D], keys/values from memory [B, S, D]; padding [B, S].
  void forward_cross(const ConstTensorMap3<T>& x, const ConstTensorMap3<T>& memory,
                     TensorMap3<T> y, const ForwardOptions& opts = {}) const {
    const Index B = x.dimension(0), S = memory.dimension(1);
    check_io(x, y);
    require_shape3("MultiHeadAttention: memory", memory, B, -1, geo().D);
    const MatrixMap<T> KV = proj_.keys_values_of(memory, 0, opts.pool);
    run(x, proj_.key_values(KV, B, S, opts.key_padding_mask), opts.position_offset, opts, y);
  }

  /// Incremental self-attention: x [B, T_new, D] are the next tokens after those in `cache`;
  /// their keys/values are appended and they attend to the whole cache (causal when
  /// opts.causal). RoPE positions continue from cache.length(). Padding: [B, T_new].
  void forward_cached(const ConstTensorMap3<T>& x, TensorMap3<T> y, KvCache<T>& cache,
                      const ForwardOptions& opts = {}) const {
    const Index B = x.dimension(0), Tq = x.dimension(1), start = cache.length();
    check_io(x, y);
    cache.check(B, geo().Hkv, geo().d, Tq, kName);
    const MatrixMap<T> KV = proj_.keys_values_of(x, start, opts.pool);
    run(x, proj_.append(KV, B, Tq, opts.key_padding_mask, cache), start, opts, y);
  }

  /// Convenience: returns y for self-attention.
  Tensor3<T> operator()(const Tensor3<T>& x, const ForwardOptions& opts = {}) const {
    Tensor3<T> y(x.dimension(0), x.dimension(1), geo().D);
    forward(x, y, opts);
    return y;
  }

  /// A cache sized for this layer.
  KvCache<T> make_cache(Index batch, Index capacity) const {
    return KvCache<T>(batch, geo().Hkv, geo().d, capacity);
  }

 private:
  static constexpr const char* kName = "MultiHeadAttention";
  const detail::Geometry& geo() const { return proj_.geometry(); }

  void check_io(const ConstTensorMap3<T>& x, const TensorMap3<T>& y) const {
    require_shape3("MultiHeadAttention: x", x, -1, -1, geo().D);
    require_shape3("MultiHeadAttention: y", y, x.dimension(0), x.dimension(1), geo().D);
  }

  // Queries, attention over `kv`, output projection.
  void run(const ConstTensorMap3<T>& x, const detail::KeyValues<T>& kv, Index first_position,
           const ForwardOptions& opts, TensorMap3<T>& y) const {
    const Index B = x.dimension(0), Tq = x.dimension(1), w = geo().q_width();
    MatrixMap<T> Q = detail::scratch_matrix<T>(detail::ScratchSlot::Queries, B * Tq, w);
    MatrixMap<T> C = detail::scratch_matrix<T>(detail::ScratchSlot::Context, B * Tq, w);
    proj_.project_q(as_rows(x), Q, opts.pool);
    proj_.rope_rows(Q, 0, geo().H, B, Tq, first_position);
    detail::attend_heads<T>(detail::HeadsView<T>{Q.data(), w, Tq * w, geo().d}, kv, B, Tq,
                            geo().H, geo().d, opts.causal, C.data(), opts.pool);
    proj_.project_out(C, as_rows(y), opts.pool);
  }

  MhaConfig config_;
  detail::Projections<T> proj_;
};

}  // namespace moh
