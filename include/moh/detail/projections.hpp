// Internal: the query/key/value and output projections that MHA and MoH share, in PyTorch
// layout, with grouped-query heads, RoPE and the KV cache.
//
// in_w [(H + 2 H_kv) d, D]: rows [0, H d) project queries (head h at rows h d ..), then H_kv key
// heads, then H_kv value heads. out_w [D, H d]. Biases are empty when the layer has none.
#pragma once

#include <random>
#include <string>

#include "moh/detail/attend.hpp"
#include "moh/kv_cache.hpp"
#include "moh/linear.hpp"
#include "moh/options.hpp"
#include "moh/rope.hpp"
#include "moh/scratch.hpp"
#include "moh/weight_matrix.hpp"

namespace moh {
namespace detail {

/// Sizes shared by MHA and MoH, validated once.
struct Geometry {
  Index D = 0, H = 0, d = 0, Hkv = 0;
  bool bias = true, rope = false;
  double rope_base = 10000.0;
  WeightStorage weights = WeightStorage::Native;
  Index q_width() const { return H * d; }
  Index kv_width() const { return 2 * Hkv * d; }
  Index in_rows() const { return q_width() + kv_width(); }
  Index group() const { return H / Hkv; }
};

/// Validates the attention sizes of a config (MhaConfig, MoHConfig) and derives the geometry.
template <class Config>
Geometry make_geometry(const Config& c, const char* layer) {
  require(c.embed_dim > 0, layer, ": embed_dim must be positive: expected > 0, got ", c.embed_dim);
  require(c.num_heads > 0, layer, ": num_heads must be positive: expected > 0, got ", c.num_heads);
  require(c.head_dim >= 0, layer, ": head_dim must be >= 0 (0 = embed_dim / num_heads), got ",
          c.head_dim);
  if (c.head_dim == 0)
    require(c.embed_dim % c.num_heads == 0, layer,
            ": embed_dim must be divisible by num_heads when head_dim is 0: expected a multiple "
            "of ", c.num_heads, ", got ", c.embed_dim);
  require(c.num_kv_heads >= 0, layer, ": num_kv_heads must be >= 0 (0 = num_heads), got ",
          c.num_kv_heads);
  Geometry g;
  g.D = c.embed_dim;
  g.H = c.num_heads;
  g.d = c.head_dim ? c.head_dim : c.embed_dim / c.num_heads;
  g.Hkv = c.num_kv_heads ? c.num_kv_heads : c.num_heads;
  require(g.Hkv <= g.H && g.H % g.Hkv == 0, layer,
          ": num_kv_heads must divide num_heads: expected a divisor of ", g.H, ", got ", g.Hkv);
  g.bias = c.bias;
  g.rope = c.rope;
  g.rope_base = c.rope_base;
  g.weights = c.weight_storage;
  if (g.rope) {
    require(g.d % 2 == 0, layer, ": RoPE needs an even head_dim: expected even, got ", g.d);
    require(c.rope_base > 0, layer, ": rope_base must be positive: expected > 0, got ",
            c.rope_base);
  }
  return g;
}

/// Keys/values of a call without cache. KV: [B*S, 2 H_kv d] rows, key heads then value heads
/// (keys RoPE'd already); padding [B, S] or none.
template <class T>
KeyValues<T> key_values(const ConstRowsRef<T>& KV, Index kv_heads, Index d, Index batch, Index keys,
                        const PaddingMask& padding, const char* layer) {
  check_padding(padding, batch, keys, layer);
  KeyValues<T> kv;
  const Index w = 2 * kv_heads * d;
  kv.k = HeadsView<T>{KV.data(), w, keys * w, d};
  kv.v = HeadsView<T>{KV.data() + kv_heads * d, w, keys * w, d};
  kv.keys = keys;
  kv.kv_heads = kv_heads;
  if (padding) {
    kv.padding = padding->data();
    kv.padding_stride = keys;
  }
  return kv;
}

/// The whole cache as keys/values to attend to.
template <class T>
KeyValues<T> cache_view(const KvCache<T>& cache) {
  KeyValues<T> kv;
  const Index cap = cache.capacity(), d = cache.head_dim();
  kv.k = HeadsView<T>{cache.keys(0, 0), d, cache.kv_heads() * cap * d, cap * d};
  kv.v = HeadsView<T>{cache.values(0, 0), d, cache.kv_heads() * cap * d, cap * d};
  kv.keys = cache.length();
  kv.kv_heads = cache.kv_heads();
  if (cache.any_padding()) {
    kv.padding = cache.padding(0);
    kv.padding_stride = cap;
  }
  return kv;
}

/// Appends the new tokens' keys/values (KV as in key_values(), [B*T, 2 H_kv d]) and their
/// padding flags ([B, T] or none) to `cache`, and returns the whole cache to attend to.
template <class T>
KeyValues<T> append_to_cache(const ConstRowsRef<T>& KV, Index kv_heads, Index d, Index batch,
                             Index tokens, const PaddingMask& padding,
                             KvCache<T>& cache, const char* layer) {
  cache.check(batch, kv_heads, d, tokens, layer);
  check_padding(padding, batch, tokens, layer);
  const Index start = cache.length();
  for (Index b = 0; b < batch; ++b) {
    for (Index t = 0; t < tokens; ++t) {
      const T* row = KV.row(b * tokens + t).data();
      for (Index h = 0; h < kv_heads; ++h) {
        std::copy(row + h * d, row + (h + 1) * d, cache.keys(b, h) + (start + t) * d);
        std::copy(row + (kv_heads + h) * d, row + (kv_heads + h + 1) * d,
                  cache.values(b, h) + (start + t) * d);
      }
      cache.set_padding(b, start + t, padding ? (*padding)(b, t) : false);
    }
  }
  cache.commit(tokens);
  return cache_view(cache);
}

template <class T>
class Projections {
 public:
  Projections() = default;
  Projections(const Geometry& g, const char* layer) : g_(g), layer_(layer) {
    in_w_ = WeightMatrix<T>(g.in_rows(), g.D, g.weights);
    out_w_ = WeightMatrix<T>(g.D, g.q_width(), g.weights);
    if (g.bias) {
      in_b_.setZero(g.in_rows());
      out_b_.setZero(g.D);
    }
  }

  const Geometry& geometry() const { return g_; }
  Matrix<T> in_weight() const { return in_w_.values(); }
  const Vector<T>& in_bias() const { return in_b_; }
  Matrix<T> out_weight() const { return out_w_.values(); }
  std::size_t weight_bytes() const {
    return in_w_.bytes() + out_w_.bytes() + (in_b_.size() + out_b_.size()) * sizeof(T);
  }
  const Vector<T>& out_bias() const { return out_b_; }

  void set_in_weight(const Matrix<T>& w) { in_w_.set(checked(w, g_.in_rows(), g_.D, "in_proj_weight")); }
  void set_out_weight(const Matrix<T>& w) { out_w_.set(checked(w, g_.D, g_.q_width(), "out_proj_weight")); }
  void set_in_bias(const Vector<T>& b) { in_b_ = checked_bias(b, g_.in_rows(), "in_proj_bias"); }
  void set_out_bias(const Vector<T>& b) { out_b_ = checked_bias(b, g_.D, "out_proj_bias"); }

  /// Uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)) like torch.nn.Linear, from `rng`.
  void randomize(std::mt19937_64& rng) {
    Matrix<T> in(g_.in_rows(), g_.D), out(g_.D, g_.q_width());
    fill(in, g_.D, rng);
    fill(out, g_.q_width(), rng);
    in_w_.set(in);
    out_w_.set(out);
    if (g_.bias) {
      fill(in_b_, g_.D, rng);
      fill(out_b_, g_.q_width(), rng);
    }
  }

  /// Q[N, H d] = X[N, D] Wq^T + bq.
  void project_q(const ConstRowsRef<T>& X, RowsRef<T> Q, ThreadPool* pool) const {
    linear<T>(X, in_w_, 0, g_.q_width(), bias(0), Q, pool);
  }
  /// Keys/values of the rows of `src` ([B, S, D]) in thread scratch, RoPE'd from `first`.
  MatrixMap<T> keys_values_of(const ConstTensorMap3<T>& src, Index first, ThreadPool* pool) const {
    const Index B = src.dimension(0), S = src.dimension(1);
    MatrixMap<T> KV = scratch_matrix<T>(ScratchSlot::KeysValues, B * S, g_.kv_width());
    project_kv(as_rows(src), KV, pool);
    rope_rows(KV, 0, g_.Hkv, B, S, first);
    return KV;
  }

  /// KV[N, 2 H_kv d] = X[N, D] [Wk; Wv]^T + [bk; bv]: key heads, then value heads.
  void project_kv(const ConstRowsRef<T>& X, RowsRef<T> KV, ThreadPool* pool) const {
    linear<T>(X, in_w_, g_.q_width(), g_.kv_width(), bias(g_.q_width()), KV, pool);
  }
  /// Query head h of the given rows: Q[n, d] = X[n, D] Wq_h^T + bq_h.
  void project_q_head(Index h, const ConstRowsRef<T>& X, RowsRef<T> Q) const {
    linear<T>(X, in_w_, h * g_.d, g_.d, bias(h * g_.d), Q);
  }
  /// Y[N, D] = C[N, H d] Wo^T + bo.
  void project_out(const ConstRowsRef<T>& C, RowsRef<T> Y, ThreadPool* pool) const {
    linear<T>(C, out_w_, out_b_.size() ? out_b_.data() : nullptr, Y, pool);
  }
  /// P[n, m] (+)= O_h[n, d] Wo[c0 : c0 + m, h d : (h+1) d]^T (no bias): output columns
  /// [c0, c0 + m) of head h, added to P when `accumulate`.
  void out_head(Index h, const ConstRowsRef<T>& O, RowsRef<T> P, Index c0, bool accumulate) const {
    multiply<T>(O.data(), O.outerStride(), out_w_.operand(c0, h * g_.d, true), P.data(),
                P.outerStride(), O.rows(), P.cols(), g_.d, accumulate);
  }
  /// Y rows = output bias (or zero), before routed heads are added.
  void init_output(RowsRef<T> Y) const {
    if (out_b_.size())
      Y.rowwise() = out_b_.transpose();
    else
      Y.setZero();
  }

  /// RoPE on `heads` heads of size d at column `col` of each row of M ([B*T, *]), positions
  /// first + t. No-op when the layer has no RoPE.
  void rope_rows(RowsRef<T> M, Index col, Index heads, Index batch, Index tokens,
                 Index first) const {
    if (!g_.rope) return;
    const RopeTable<T> table = rope_table(first, tokens);
    for (Index b = 0; b < batch; ++b)
      for (Index t = 0; t < tokens; ++t)
        for (Index h = 0; h < heads; ++h)
          table.rotate(M.row(b * tokens + t).data() + col + h * g_.d, t);
  }
  RopeTable<T> rope_table(Index first, Index tokens) const {
    return g_.rope ? RopeTable<T>(first, tokens, g_.d, g_.rope_base) : RopeTable<T>();
  }

  KeyValues<T> key_values(const ConstRowsRef<T>& KV, Index batch, Index keys,
                          const PaddingMask& padding) const {
    return detail::key_values<T>(KV, g_.Hkv, g_.d, batch, keys, padding, layer_);
  }
  KeyValues<T> append(const ConstRowsRef<T>& KV, Index batch, Index tokens,
                      const PaddingMask& padding, KvCache<T>& cache) const {
    return detail::append_to_cache<T>(KV, g_.Hkv, g_.d, batch, tokens, padding, cache, layer_);
  }

 private:
  const T* bias(Index offset) const { return in_b_.size() ? in_b_.data() + offset : nullptr; }

  Matrix<T> checked(const Matrix<T>& w, Index rows, Index cols, const char* name) const {
    if (w.rows() != rows || w.cols() != cols)
      fail(layer_, ": ", name, ": expected shape [", rows, ", ", cols, "], got [", w.rows(), ", ",
           w.cols(), "]");
    return w;
  }
  Vector<T> checked_bias(const Vector<T>& b, Index size, const char* name) const {
    require(g_.bias, layer_, ": ", name, ": the layer has no bias (bias = false): expected none, "
            "got a vector of ", b.size());
    if (b.size() != size) fail(layer_, ": ", name, ": expected shape [", size, "], got [", b.size(), "]");
    return b;
  }
  template <class M>
  static void fill(M& m, Index fan_in, std::mt19937_64& rng) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
    std::uniform_real_distribution<double> dist(-bound, bound);
    for (Index i = 0; i < m.size(); ++i) m.data()[i] = static_cast<T>(dist(rng));
  }

  Geometry g_;
  const char* layer_ = "";
  WeightMatrix<T> in_w_;   // [(H + 2 H_kv) d, D]
  Vector<T> in_b_;   // [(H + 2 H_kv) d] or empty
  WeightMatrix<T> out_w_;  // [D, H d]
  Vector<T> out_b_;  // [D] or empty
};

}  // namespace detail
}  // namespace moh
