// MoHAttention: Mixture-of-Head attention (Jin et al. 2024, arXiv 2410.11842).
//
//   [q | k | v] = x W_in^T + b_in,   o_h = attention(q_h, k_g, v_g),  g = h / (H / H_kv)
//   y = concat_h(g_h o_h) W_out^T + b_out
// with gates g_h from a router (moh_router.hpp): shared heads always on, each token's top-K routed
// heads on, every other head's gate exactly 0. The sparse path (default) computes queries,
// scores, softmax, weighted values and output projection only for the (token, head) pairs that
// are on; keys and values are computed for every token. ComputeMode::Dense computes every head
// and multiplies by the gate: the reference the sparse path is tested against.
// MoHRouterKind::QueryNorm with RoPE, grouped-query heads, no bias and a KvCache is MoH-LLaMA3.
// Self-, cross- and cached attention come from the shared skeleton (detail/layer.hpp).
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "moh/detail/attend.hpp"
#include "moh/detail/layer.hpp"
#include "moh/detail/projections.hpp"
#include "moh/layers/attention_config.hpp"
#include "moh/layers/moh_router.hpp"
#include "moh/layers/options.hpp"
#include "moh/tensor.hpp"

namespace moh {

/// Sizes and settings of a MoHAttention layer.
struct MoHConfig : HeadsConfig {
  static constexpr const char* kLayer = "MoHAttention";  // the layer this config builds
  Index shared_heads = 0;         // S_h: heads 0..S_h-1, always on
  Index active_routed_heads = 0;  // K: routed heads each token keeps
  MoHRouterKind router = MoHRouterKind::Learned;
  bool bias = true;               // biases on the input and output projections

  Index routed_heads() const { return num_heads - shared_heads; }
  /// Fraction of heads each token uses: (S_h + K) / H.
  double active_fraction() const {
    return num_heads ? static_cast<double>(shared_heads + active_routed_heads) / num_heads : 0.0;
  }
  /// Throws moh::Error on impossible settings.
  void validate() const {
    detail::heads_shape(*this, kLayer);
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

  template <class Self, class Visitor>
  static void fields(Self& c, Visitor&& v) {
    HeadsConfig::fields(c, v);
    v("shared_heads", c.shared_heads);
    v("active_routed_heads", c.active_routed_heads);
    v("router", c.router);
    v("bias", c.bias);
  }
};

template <class T>
class MoHAttention : public detail::AttentionLayer<MoHAttention<T>, T, MoHRouting<T>> {
  using Base = detail::AttentionLayer<MoHAttention<T>, T, MoHRouting<T>>;
  friend Base;

 public:
  using Config = MoHConfig;
  static constexpr const char* kName = MoHConfig::kLayer;
  static constexpr bool kHasModes = true;

  /// No weights yet: set them (setters, load_weights) before forward, which refuses to run
  /// until every tensor is set.
  explicit MoHAttention(const MoHConfig& config)
      : Base(validated(config), weight_infos(config)),
        config_(config),
        proj_(this->shape(), config.bias, config.bias, config.weight_storage),
        router_(config.embed_dim, config.num_heads, config.shared_heads,
                config.active_routed_heads) {}
  /// All weights zero (a learned router's gates are then uniform).
  MoHAttention(const MoHConfig& config, ZeroWeights) : MoHAttention(config) {
    this->mark_weights_set();
  }
  /// Seeded random weights, uniform in +-1/sqrt(fan_in) like torch.nn.Linear.
  MoHAttention(const MoHConfig& config, std::uint64_t seed) : MoHAttention(config) {
    std::mt19937_64 rng(seed);
    proj_.randomize(rng);
    if (config_.router == MoHRouterKind::Learned)
      for (Matrix<T>* w : {&router_.routed_weight(), &router_.shared_weight(), &router_.mix_weight()})
        detail::fill_uniform(w->data(), w->size(), config_.embed_dim, rng);
    this->mark_weights_set();
  }

  const MoHConfig& config() const { return config_; }
  using Base::weight_infos;
  /// The tensors of a layer with this config, under the MoH ViT/DiT names (qkv, proj, and the
  /// learned router's wg, wg_0, wg_1); the projections are also accepted LLaMA-style.
  static std::vector<WeightInfo> weight_infos(const MoHConfig& c) {
    std::vector<WeightInfo> w =
        detail::Projections<T>::infos(detail::heads_shape(c, kName), c.bias, c.bias, kNames);
    const std::int64_t S = c.shared_heads, K = c.active_routed_heads, D = c.embed_dim;
    if (c.router == MoHRouterKind::Learned) {
      if (K > 0) w.push_back({"wg.weight", {c.num_heads - S, D}, {}, {}});
      if (S > 0 && K > 0) w.push_back({"wg_0.weight", {2, D}, {}, {}});
      if (S > 1) w.push_back({"wg_1.weight", {S, D}, {}, {}});
    }
    return w;
  }

  // Weights in PyTorch layout (MoH code: qkv.weight, qkv.bias, proj.weight, proj.bias,
  // wg.weight, wg_0.weight, wg_1.weight); copies, bfloat16 widened exactly.
  Matrix<T> qkv_weight() const {  // [(H + 2 H_kv) d, D]
    return this->weight_matrix("qkv.weight", q_width() + this->shape().kv_width(), this->shape().D);
  }
  Vector<T> qkv_bias() const { return vector("qkv.bias"); }  // [(H + 2 H_kv) d] or empty
  Matrix<T> proj_weight() const {  // [D, H d]
    return this->weight_matrix("proj.weight", this->shape().D, q_width());
  }
  Vector<T> proj_bias() const { return vector("proj.bias"); }  // [D] or empty
  void set_qkv_weight(const Matrix<T>& w) { this->set_weight("qkv.weight", w); }
  void set_qkv_bias(const Vector<T>& b) { this->set_weight("qkv.bias", b); }
  void set_proj_weight(const Matrix<T>& w) { this->set_weight("proj.weight", w); }
  void set_proj_bias(const Vector<T>& b) { this->set_weight("proj.bias", b); }
  const MoHTwoStageRouter<T>& router() const { return router_; }
  void set_router_routed_weight(const Matrix<T>& w) { this->set_weight("wg.weight", w); }
  void set_router_mix_weight(const Matrix<T>& w) { this->set_weight("wg_0.weight", w); }
  void set_router_shared_weight(const Matrix<T>& w) { this->set_weight("wg_1.weight", w); }
  /// Bytes of projection weights and biases (router weights, always in T, not counted).
  std::size_t weight_bytes() const { return proj_.weight_bytes(); }

 private:
  static constexpr detail::ProjectionNames kNames{"qkv.weight", "qkv.bias", "proj.weight",
                                                  "proj.bias"};

  static detail::HeadShape validated(const MoHConfig& c) {
    c.validate();
    return detail::heads_shape(c, kName);
  }
  Index q_width() const { return this->shape().H * this->shape().d; }
  Vector<T> vector(const char* name) const {
    if (!config_.bias) return Vector<T>();
    const std::vector<T> v = this->weight(name);
    return Eigen::Map<const Vector<T>>(v.data(), static_cast<Index>(v.size()));
  }
  Matrix<T>* router_weight(const std::string& name) {
    if (name == "wg.weight") return &router_.routed_weight();
    if (name == "wg_0.weight") return &router_.mix_weight();
    if (name == "wg_1.weight") return &router_.shared_weight();
    return nullptr;
  }

  void store_weight(const std::string& name, const T* values) {
    if (proj_.store(kNames, name, values)) return;
    Matrix<T>& w = *router_weight(name);
    w = ConstMatrixMap<T>(values, w.rows(), w.cols());
  }
  void load_weight(const std::string& name, T* values) const {
    if (proj_.load(kNames, name, values)) return;
    const Matrix<T>& w = *const_cast<MoHAttention*>(this)->router_weight(name);
    MatrixMap<T>(values, w.rows(), w.cols()) = w;
  }

  void project_keys_values(const ConstRowsRef<T>& src, RowsRef<T> KV, const detail::Exec& exec) const {
    proj_.project_kv(src, KV, exec);
  }

  void attend(const detail::Pass<T, MoHRouting<T>>& p) const {
    const detail::HeadShape& s = this->shape();
    const Index B = p.batch, Tq = p.tokens, H = s.H, d = s.d;
    const Index S = config_.shared_heads, K = config_.active_routed_heads;
    detail::Arena& call = p.exec.call();
    const detail::Arena::Scope scope(call);
    const detail::MoHGates<T> g = p.routing ? detail::MoHGates<T>::of(*p.routing, B, Tq, H, S, K)
                                            : detail::MoHGates<T>::in(call, B, Tq, H, S, K);

    const bool query_norm = config_.router == MoHRouterKind::QueryNorm;
    const bool dense = p.mode == ComputeMode::Dense || S + K == H;
    // [B*T, H d]: every query, only when the router or the dense path needs them all.
    const Index q_rows = (query_norm || dense) ? B * Tq : 0;
    MatrixMap<T> Q = call.matrix<T>(q_rows, q_width());
    if (q_rows) proj_.project_q(p.X, Q, p.exec);
    if (query_norm)
      detail::route_by_query_norm<T>(Q, d, g, call);
    else
      router_.route(p.X, g, p.exec);

    if (dense) {
      // Reference: every head, then each head's output scaled by its gate.
      this->rope_rows(Q, 0, H, B, Tq, p.rope);
      MatrixMap<T> C = call.matrix<T>(B * Tq, q_width());
      detail::attend_heads<T>(detail::HeadsView<T>{Q.data(), Q.cols(), Tq * Q.cols(), d}, p.kv,
                              B, Tq, H, d, p.causal, C.data(), p.exec);
      for (Index i = 0; i < C.rows(); ++i)
        for (Index h = 0; h < H; ++h) C.row(i).segment(h * d, d) *= g.gate(i, h);
      proj_.project_out(C, p.Y, p.exec);
      return;
    }

    detail::HeadPlan<T> plan;
    plan.build(call, H, B, Tq, [&](Index row, Index h) { return g.on(row, h); },
               [&](Index row, Index h) { return g.gate(row, h); });
    const RopeTable<T>& rope = p.rope;
    auto project_q = [&](Index h, const Index* rows, const ConstRowsRef<T>& Xg, RowsRef<T> Qh,
                         detail::Arena& arena) {
      if (query_norm) {
        for (Index i = 0; i < Qh.rows(); ++i) Qh.row(i) = Q.row(rows[i]).segment(h * d, d);
      } else {
        proj_.project_q_head(h, Xg, Qh, arena);
      }
      if (rope)
        for (Index i = 0; i < Qh.rows(); ++i) rope.rotate(Qh.row(i).data(), rows[i] % Tq);
    };
    auto project_out = [&](Index h, const ConstRowsRef<T>& O, RowsRef<T> P, Index c0,
                           bool accumulate, detail::Arena& arena) {
      proj_.out_head(h, O, P, c0, accumulate, arena);
    };
    const Index group = s.group();
    proj_.init_output(p.Y);
    detail::attend_routed<T>(plan, p.X, p.kv, d, p.causal, !query_norm, project_q, project_out,
                             [group](Index h) { return h / group; }, p.Y, p.exec);
  }

  MoHConfig config_;
  detail::Projections<T> proj_;
  MoHTwoStageRouter<T> router_;
};

}  // namespace moh
