// MoHAttention: Mixture-of-Head attention (Jin et al. 2024, arXiv 2410.11842).
//
//   [q | k | v] = x W_in^T + b_in,   o_h = attention(q_h, k_g, v_g),  g = h / (H / H_kv)
//   y = concat_h(g_h o_h) W_out^T + b_out
// with gates g_h from a router (moh_router.hpp): shared heads always on, each token's top-K routed
// heads on, every other head's gate exactly 0. The sparse path (default) computes queries,
// scores, softmax, weighted values and output projection only for the (token, head) pairs that
// are on; keys and values are computed for every token. ComputeMode::Dense computes every head
// and multiplies by the gate: the reference the sparse path is tested against.
// Router::QueryNorm with RoPE, grouped-query heads, no bias and a KvCache is MoH-LLaMA3.
#pragma once

#include <cstdint>
#include <random>

#include "moh/detail/attend.hpp"
#include "moh/detail/projections.hpp"
#include "moh/kv_cache.hpp"
#include "moh/moh_router.hpp"
#include "moh/options.hpp"
#include "moh/tensor.hpp"

namespace moh {

enum class MoHRouter {
  Learned,    // two-stage router with weights (ViT / DiT / LLM trained from scratch)
  QueryNorm,  // parameter-free, from the norms of the routed heads' queries (MoH-LLaMA3)
};

/// Sizes and settings of a MoHAttention layer.
struct MoHConfig {
  Index embed_dim = 0;            // D
  Index num_heads = 0;            // H, shared + routed
  Index head_dim = 0;             // d; 0 = embed_dim / num_heads
  Index num_kv_heads = 0;         // H_kv; 0 = num_heads
  Index shared_heads = 0;         // S_h: heads 0..S_h-1, always on
  Index active_routed_heads = 0;  // K: routed heads each token keeps
  MoHRouter router = MoHRouter::Learned;
  bool bias = true;
  bool rope = false;
  double rope_base = 10000.0;
  WeightStorage weight_storage = WeightStorage::Native;  // projections (not the router) in T or bfloat16

  Index head_size() const { return head_dim ? head_dim : (num_heads ? embed_dim / num_heads : 0); }
  Index routed_heads() const { return num_heads - shared_heads; }
  /// Fraction of heads each token uses: (S_h + K) / H.
  double active_fraction() const {
    return num_heads ? static_cast<double>(shared_heads + active_routed_heads) / num_heads : 0.0;
  }
  /// Throws moh::Error on impossible settings.
  void validate() const {
    detail::make_geometry(*this, "MoHAttention");
    detail::require(shared_heads >= 0 && shared_heads <= num_heads,
                    "MoHAttention: shared_heads must be in [0, num_heads]: expected 0..",
                    num_heads, ", got ", shared_heads);
    detail::require(active_routed_heads >= 0 && active_routed_heads <= routed_heads(),
                    "MoHAttention: active_routed_heads must be in [0, routed heads = num_heads - "
                    "shared_heads]: expected 0..",
                    routed_heads(), ", got ", active_routed_heads);
    detail::require(shared_heads + active_routed_heads > 0,
                    "MoHAttention: no head is ever active: expected shared_heads + "
                    "active_routed_heads >= 1, got ",
                    shared_heads, " + ", active_routed_heads);
  }
};

template <class T>
class MoHAttention {
 public:
  using Scalar = T;

  /// Zero weights (router weights zero too: every gate of a learned router is then uniform).
  explicit MoHAttention(const MoHConfig& config)
      : config_(validated(config)),
        proj_(detail::make_geometry(config, kName), kName),
        router_(config.embed_dim, config.num_heads, config.shared_heads,
                config.active_routed_heads) {}
  /// Seeded random weights, uniform in +-1/sqrt(fan_in) like torch.nn.Linear.
  MoHAttention(const MoHConfig& config, std::uint64_t seed) : MoHAttention(config) {
    std::mt19937_64 rng(seed);
    proj_.randomize(rng);
    if (config_.router == MoHRouter::Learned) {
      std::uniform_real_distribution<double> dist(-1.0, 1.0);
      const double bound = 1.0 / std::sqrt(static_cast<double>(config_.embed_dim));
      for (Matrix<T>* w : {&router_.routed_weight(), &router_.shared_weight(), &router_.mix_weight()})
        for (Index i = 0; i < w->size(); ++i) w->data()[i] = static_cast<T>(bound * dist(rng));
    }
  }

  const MoHConfig& config() const { return config_; }

  // Weights in PyTorch layout (MoH code: qkv.weight, qkv.bias, proj.weight, proj.bias, wg.weight,
  // wg_0.weight, wg_1.weight). Setters check shapes and throw moh::Error.
  Matrix<T> qkv_weight() const { return proj_.in_weight(); }   // [(H+2H_kv) d, D]
  const Vector<T>& qkv_bias() const { return proj_.in_bias(); }       // [(H+2H_kv) d] or empty
  Matrix<T> proj_weight() const { return proj_.out_weight(); }  // [D, H d]
  const Vector<T>& proj_bias() const { return proj_.out_bias(); }      // [D] or empty
  void set_qkv_weight(const Matrix<T>& w) { proj_.set_in_weight(w); }
  void set_qkv_bias(const Vector<T>& b) { proj_.set_in_bias(b); }
  void set_proj_weight(const Matrix<T>& w) { proj_.set_out_weight(w); }
  void set_proj_bias(const Vector<T>& b) { proj_.set_out_bias(b); }
  const MoHLearnedRouter<T>& router() const { return router_; }
  /// Bytes of projection weights and biases (router weights, always in T, not counted).
  std::size_t weight_bytes() const { return proj_.weight_bytes(); }
  void set_router_routed_weight(const Matrix<T>& w) { set_router(router_.routed_weight(), w, "wg.weight"); }
  void set_router_mix_weight(const Matrix<T>& w) { set_router(router_.mix_weight(), w, "wg_0.weight"); }
  void set_router_shared_weight(const Matrix<T>& w) { set_router(router_.shared_weight(), w, "wg_1.weight"); }

  /// Self-attention. x, y: [B, T, D]. Fills `routing` when given.
  void forward(const ConstTensorMap3<T>& x, TensorMap3<T> y, const ForwardOptions& opts = {},
               MoHRouting<T>* routing = nullptr) const {
    const Index B = x.dimension(0), Tq = x.dimension(1);
    check_io(x, y);
    const MatrixMap<T> KV = proj_.keys_values_of(x, opts.position_offset, opts.pool);
    run(x, proj_.key_values(KV, B, Tq, opts.key_padding_mask), opts.position_offset, opts, y,
        routing);
  }

  /// Incremental self-attention through `cache` (see MultiHeadAttention::forward_cached).
  void forward_cached(const ConstTensorMap3<T>& x, TensorMap3<T> y, KvCache<T>& cache,
                      const ForwardOptions& opts = {}, MoHRouting<T>* routing = nullptr) const {
    const Index B = x.dimension(0), Tq = x.dimension(1), start = cache.length();
    check_io(x, y);
    cache.check(B, geo().Hkv, geo().d, Tq, kName);
    const MatrixMap<T> KV = proj_.keys_values_of(x, start, opts.pool);
    run(x, proj_.append(KV, B, Tq, opts.key_padding_mask, cache), start, opts, y, routing);
  }

  /// Convenience: returns y.
  Tensor3<T> operator()(const Tensor3<T>& x, const ForwardOptions& opts = {},
                        MoHRouting<T>* routing = nullptr) const {
    Tensor3<T> y(x.dimension(0), x.dimension(1), geo().D);
    forward(x, y, opts, routing);
    return y;
  }

  KvCache<T> make_cache(Index batch, Index capacity) const {
    return KvCache<T>(batch, geo().Hkv, geo().d, capacity);
  }

 private:
  static constexpr const char* kName = "MoHAttention";
  static const MoHConfig& validated(const MoHConfig& c) {
    c.validate();
    return c;
  }
  const detail::Geometry& geo() const { return proj_.geometry(); }

  void check_io(const ConstTensorMap3<T>& x, const TensorMap3<T>& y) const {
    require_shape3("MoHAttention: x", x, -1, -1, geo().D);
    require_shape3("MoHAttention: y", y, x.dimension(0), x.dimension(1), geo().D);
  }
  void set_router(Matrix<T>& dst, const Matrix<T>& w, const char* name) {
    if (w.rows() != dst.rows() || w.cols() != dst.cols())
      detail::fail("MoHAttention: ", name, ": expected shape [", dst.rows(), ", ", dst.cols(),
                   "], got [", w.rows(), ", ", w.cols(), "]");
    dst = w;
  }

  void run(const ConstTensorMap3<T>& x, const detail::KeyValues<T>& kv, Index first,
           const ForwardOptions& opts, TensorMap3<T>& y, MoHRouting<T>* routing) const {
    const Index B = x.dimension(0), Tq = x.dimension(1), H = geo().H, d = geo().d;
    const ConstMatrixMap<T> X = as_rows(x);
    MatrixMap<T> Y = as_rows(y);
    MoHRouting<T> local;
    MoHRouting<T>& r = routing ? *routing : local;

    const bool query_norm = config_.router == MoHRouter::QueryNorm;
    const bool dense = opts.mode == ComputeMode::Dense ||
                       config_.shared_heads + config_.active_routed_heads == H;
    // [B*T, H d]: every query, only when the router or the dense path needs them all.
    const Index q_rows = (query_norm || dense) ? B * Tq : 0;
    MatrixMap<T> Q = detail::scratch_matrix<T>(detail::ScratchSlot::Queries, q_rows, geo().q_width());
    if (q_rows) proj_.project_q(X, Q, opts.pool);
    if (query_norm)
      route_by_query_norm<T>(Q, B, Tq, H, d, config_.shared_heads,
                             config_.active_routed_heads, r);
    else
      router_.route(X, B, Tq, r, opts.pool);

    if (dense) {
      // Reference: every head, then each head's output scaled by its gate.
      proj_.rope_rows(Q, 0, H, B, Tq, first);
      MatrixMap<T> C = detail::scratch_matrix<T>(detail::ScratchSlot::Context, B * Tq, geo().q_width());
      detail::attend_heads<T>(detail::HeadsView<T>{Q.data(), Q.cols(), Tq * Q.cols(), d}, kv, B,
                              Tq, H, d, opts.causal, C.data(), opts.pool);
      for (Index i = 0; i < C.rows(); ++i)
        for (Index h = 0; h < H; ++h) C.row(i).segment(h * d, d) *= r.gates(i, h);
      proj_.project_out(C, Y, opts.pool);
      return;
    }

    detail::HeadPlan<T> plan;
    plan.build(H, B, Tq, [&](Index row, Index h) { return r.active(row, h); },
               [&](Index row, Index h) { return r.gates(row, h); });
    const RopeTable<T> rope = proj_.rope_table(first, Tq);
    auto project_q = [&](Index h, const Index* rows, const ConstRowsRef<T>& Xg, RowsRef<T> Qh) {
      if (query_norm) {
        for (Index i = 0; i < Qh.rows(); ++i) Qh.row(i) = Q.row(rows[i]).segment(h * d, d);
      } else {
        proj_.project_q_head(h, Xg, Qh);
      }
      if (geo().rope)
        for (Index i = 0; i < Qh.rows(); ++i) rope.rotate(Qh.row(i).data(), rows[i] % Tq);
    };
    auto project_out = [&](Index h, const ConstRowsRef<T>& O, RowsRef<T> P, Index c0,
                           bool accumulate) {
      proj_.out_head(h, O, P, c0, accumulate);
    };
    const Index group = geo().group();
    proj_.init_output(Y);
    detail::attend_routed<T>(plan, X, kv, d, opts.causal, !query_norm, project_q, project_out,
                             [group](Index h) { return h / group; }, Y, opts.pool);
  }

  MoHConfig config_;
  detail::Projections<T> proj_;
  MoHLearnedRouter<T> router_;
};

}  // namespace moh
