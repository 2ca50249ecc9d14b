// MoAAttention: Mixture of Attention heads (Zhang et al. 2022, arXiv 2210.05144).
//
//   K = x_kv W_k^T,  V = x_kv W_v^T              W_k, W_v [d, D]: one key/value head, shared
//   for each of the k experts e a router picks for token x (moa_router.hpp), with gate w_e:
//     q_e = x W_q^e,  o_e = attention(q_e, K, V)  W_q^e [D, d]
//   y = sum_e w_e (o_e W_o^e)                     W_o^e [d, D]; no other projection, no bias
// The sparse path (default) projects queries and outputs per expert over just the tokens routed
// to it (grouped GEMMs), so the cost per token follows k, not E. ComputeMode::Dense computes
// every expert for every token and multiplies by the gate: the reference. Self-, cross- and
// cached attention come from the shared skeleton (detail/layer.hpp).
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "moh/detail/attend.hpp"
#include "moh/detail/layer.hpp"
#include "moh/layers/attention_config.hpp"
#include "moh/layers/moa_router.hpp"
#include "moh/layers/options.hpp"
#include "moh/ops/linear.hpp"
#include "moh/ops/weight_matrix.hpp"
#include "moh/tensor.hpp"

namespace moh {

/// Sizes and settings of a MoAAttention layer. head_dim (d) is the size of every expert's query
/// and of the shared key/value head; num_kv_heads is 1 (0 means 1) and rope is off.
struct MoAConfig : AttentionConfig {
  static constexpr const char* kLayer = "MoAAttention";  // the layer this config builds
  Index num_experts = 0;  // E
  Index top_k = 0;        // k experts per token
  MoAGating gating = MoAGating::Softmax;

  /// Throws moh::Error on impossible settings.
  void validate() const {
    detail::validate_common(*this, "MoAAttention");
    detail::require(head_dim > 0, "MoAAttention: head_dim must be positive: expected > 0, got ",
                    head_dim);
    detail::require(num_kv_heads <= 1, "MoAAttention: num_kv_heads: experts over several "
                    "key/value heads are not supported: expected 0 or 1, got ", num_kv_heads);
    detail::require(!rope, "MoAAttention: rope: RoPE is not supported by this layer: expected "
                    "false, got true");
    detail::require(num_experts > 0,
                    "MoAAttention: num_experts must be positive: expected > 0, got ", num_experts);
    detail::require(top_k >= 1 && top_k <= num_experts,
                    "MoAAttention: top_k must be in [1, num_experts]: expected 1..", num_experts,
                    ", got ", top_k);
    detail::require_weight_count_fits((2.0 * static_cast<double>(num_experts) + 2.0) *
                                              static_cast<double>(embed_dim) *
                                              static_cast<double>(head_dim) +
                                          static_cast<double>(embed_dim) *
                                              static_cast<double>(num_experts),
                                      kLayer);
  }

  template <class Self, class Visitor>
  static void fields(Self& c, Visitor&& v) {
    AttentionConfig::fields(c, v);
    v("num_experts", c.num_experts);
    v("top_k", c.top_k);
    v("gating", c.gating);
  }
};

template <class T>
class MoAAttention : public detail::AttentionLayer<MoAAttention<T>, T, MoARouting<T>> {
  using Base = detail::AttentionLayer<MoAAttention<T>, T, MoARouting<T>>;
  friend Base;

 public:
  using Config = MoAConfig;
  static constexpr const char* kName = MoAConfig::kLayer;
  static constexpr bool kHasModes = true;

  /// No weights yet: set them (setters, load_weights) before forward, which refuses to run
  /// until every tensor is set.
  explicit MoAAttention(const MoAConfig& config)
      : Base(shape_of(config), weight_infos(config)), config_(config) {
    const Index D = config.embed_dim, d = config.head_dim, E = config.num_experts;
    q_experts_ = WeightMatrix<T>(E * D, d, config.weight_storage);
    // In column panels of the routed output stage's width: each (panel, expert) slice is
    // contiguous, so the stage streams the weights it reads.
    out_experts_ = WeightMatrix<T>(E * d, D, config.weight_storage, detail::kRoutedColumnTile);
    gate_.setZero(D, E);
    kv_ = WeightMatrix<T>(2 * d, D, config.weight_storage);
  }
  /// All weights zero.
  MoAAttention(const MoAConfig& config, ZeroWeights) : MoAAttention(config) {
    this->mark_weights_set();
  }
  /// Seeded random weights (uniform in +-1/sqrt(fan_in)).
  MoAAttention(const MoAConfig& config, std::uint64_t seed) : MoAAttention(config) {
    const Index D = config.embed_dim, d = config.head_dim, E = config.num_experts;
    std::mt19937_64 rng(seed);
    Matrix<T> q(E * D, d), out(E * d, D), kv(2 * d, D);
    detail::fill_uniform(q.data(), q.size(), D, rng);
    detail::fill_uniform(out.data(), out.size(), d, rng);
    detail::fill_uniform(gate_.data(), gate_.size(), D, rng);
    detail::fill_uniform(kv.data(), kv.size(), D, rng);
    q_experts_.set(q);
    out_experts_.set(out);
    kv_.set(kv);
    this->mark_weights_set();
  }

  const MoAConfig& config() const { return config_; }
  using Base::weight_infos;
  /// The tensors of a layer with this config, under the MoA fairseq names.
  static std::vector<WeightInfo> weight_infos(const MoAConfig& c) {
    const std::int64_t E = c.num_experts, D = c.embed_dim, d = c.head_dim;
    return {{"q_proj.experts.w", {E, D, d}, {}, {}},
            {"q_proj.output_experts.w", {E, d, D}, {}, {}},
            {"q_proj.w_gate", {D, E}, {}, {}},
            {"k_proj.weight", {d, D}, {}, {}},
            {"v_proj.weight", {d, D}, {}, {}}};
  }

  // Weights (MoA fairseq names), copies.
  /// q_proj.experts.w [E, D, d], as [E*D, d] (expert e = rows e*D ..).
  Matrix<T> query_experts() const { return q_experts_.values(); }
  /// q_proj.output_experts.w [E, d, D], as [E*d, D] (stored in column panels, see out_experts_).
  Matrix<T> output_experts() const { return out_experts_.values(); }
  /// q_proj.w_gate [D, E].
  const Matrix<T>& gate_weight() const { return gate_; }
  /// k_proj.weight [d, D] and v_proj.weight [d, D].
  Matrix<T> key_weight() const { return kv_.values().topRows(config_.head_dim); }
  Matrix<T> value_weight() const { return kv_.values().bottomRows(config_.head_dim); }
  /// Bytes of expert, key/value and gate weights (halved, but for the gate, with bfloat16).
  std::size_t weight_bytes() const {
    return q_experts_.bytes() + out_experts_.bytes() + kv_.bytes() + gate_.size() * sizeof(T);
  }
  void set_query_experts(const Matrix<T>& w) { this->set_weight("q_proj.experts.w", w); }
  void set_output_experts(const Matrix<T>& w) { this->set_weight("q_proj.output_experts.w", w); }
  void set_gate_weight(const Matrix<T>& w) { this->set_weight("q_proj.w_gate", w); }
  void set_key_weight(const Matrix<T>& w) { this->set_weight("k_proj.weight", w); }
  void set_value_weight(const Matrix<T>& w) { this->set_weight("v_proj.weight", w); }

 private:
  static detail::HeadShape shape_of(const MoAConfig& c) {
    c.validate();
    detail::HeadShape s;
    s.D = s.D_kv = c.embed_dim;
    s.H = c.num_experts;
    s.d = c.head_dim;
    s.Hkv = 1;
    return s;
  }

  void store_weight(const std::string& name, const T* v) {
    const Index D = config_.embed_dim, d = config_.head_dim, E = config_.num_experts;
    if (name == "q_proj.experts.w") q_experts_.set(ConstMatrixMap<T>(v, E * D, d));
    else if (name == "q_proj.output_experts.w") out_experts_.set(ConstMatrixMap<T>(v, E * d, D));
    else if (name == "q_proj.w_gate") gate_ = ConstMatrixMap<T>(v, D, E);
    else if (name == "k_proj.weight") kv_.set_rows(0, ConstMatrixMap<T>(v, d, D));
    else kv_.set_rows(d, ConstMatrixMap<T>(v, d, D));  // v_proj.weight
  }
  void load_weight(const std::string& name, T* v) const {
    const Index D = config_.embed_dim, d = config_.head_dim, E = config_.num_experts;
    if (name == "q_proj.experts.w") MatrixMap<T>(v, E * D, d) = q_experts_.values();
    else if (name == "q_proj.output_experts.w") MatrixMap<T>(v, E * d, D) = out_experts_.values();
    else if (name == "q_proj.w_gate") MatrixMap<T>(v, D, E) = gate_;
    else if (name == "k_proj.weight") MatrixMap<T>(v, d, D) = key_weight();
    else MatrixMap<T>(v, d, D) = value_weight();  // v_proj.weight
  }

  // [B*S, 2d]: key head, then value head.
  void project_keys_values(const ConstRowsRef<T>& src, RowsRef<T> KV, const detail::Exec& exec) const {
    detail::project<T>(src, kv_, 0, nullptr, KV, exec);
  }

  void attend(const detail::Pass<T, MoARouting<T>>& p) const {
    const Index B = p.batch, Tq = p.tokens, N = B * Tq;
    const Index D = config_.embed_dim, d = config_.head_dim, E = config_.num_experts;
    const Index k = config_.top_k;
    detail::Arena& call = p.exec.call();
    const detail::Arena::Scope scope(call);
    const detail::MoAGates<T> g = p.routing ? detail::MoAGates<T>::of(*p.routing, B, Tq, E, k)
                                            : detail::MoAGates<T>::in(call, B, Tq, E, k);
    detail::multiply<T>(p.X.data(), p.X.outerStride(),
                        detail::GemmB<T>{gate_.data(), nullptr, E, false}, g.logits, E, N, E, D,
                        false, call);
    detail::route_moa<T>(config_.gating, g, call);

    if (p.mode == ComputeMode::Dense) {
      // Reference: every expert for every token, each output scaled by its gate.
      MatrixMap<T> Q = call.matrix<T>(N, E * d);
      MatrixMap<T> C = call.matrix<T>(N, E * d);
      for (Index e = 0; e < E; ++e) project_q(e, p.X, Q.middleCols(e * d, d), call);
      detail::attend_heads<T>(detail::HeadsView<T>{Q.data(), E * d, Tq * E * d, d}, p.kv, B, Tq,
                              E, d, p.causal, C.data(), p.exec);
      for (Index i = 0; i < N; ++i)
        for (Index e = 0; e < E; ++e) C.row(i).segment(e * d, d) *= g.gate(i, e);
      project_out(0, C, p.Y, 0, E * d, false, call);
      return;
    }

    detail::HeadPlan<T> plan;
    plan.build_picked(call, E, B, Tq, k, [&](Index row, Index s) { return g.pick(row, s); },
                      [&](Index row, Index e) { return g.gate(row, e); });
    auto project_routed_q = [&](Index e, const Index*, const ConstRowsRef<T>& Xg, RowsRef<T> Qe,
                                detail::Arena& arena) { project_q(e, Xg, Qe, arena); };
    auto project_routed_out = [&](Index e, const ConstRowsRef<T>& O, RowsRef<T> P, Index c0,
                                  bool accumulate, detail::Arena& arena) {
      project_out(e * d, O, P, c0, d, accumulate, arena);
    };
    p.Y.setZero();
    detail::attend_routed<T>(plan, p.X, p.kv, d, p.causal, true, project_routed_q,
                             project_routed_out, [](Index) { return Index(0); }, p.Y, p.exec);
  }

  /// Q[n, d] = X[n, D] Wq_e (expert e's query projection, stored [D, d]).
  void project_q(Index e, const ConstRowsRef<T>& X, RowsRef<T> Q, detail::Arena& arena) const {
    const Index D = config_.embed_dim, d = config_.head_dim;
    detail::multiply<T>(X.data(), X.outerStride(), q_experts_.operand(e * D, 0, false), Q.data(),
                        Q.outerStride(), X.rows(), d, D, false, arena);
  }

  /// P[n, m] (+)= O[n, depth] W_o[r0 : r0 + depth, c0 : c0 + m] (expert outputs stacked in
  /// rows), one column panel of the weights at a time.
  void project_out(Index r0, const ConstRowsRef<T>& O, RowsRef<T> P, Index c0, Index depth,
                   bool accumulate, detail::Arena& arena) const {
    const Index panel = out_experts_.panel();
    for (Index c = 0, w = 0; c < P.cols(); c += w) {
      w = std::min(P.cols() - c, panel - (c0 + c) % panel);  // to the end of the panel
      detail::multiply<T>(O.data(), O.outerStride(), out_experts_.operand(r0, c0 + c, false),
                          P.data() + c, P.outerStride(), O.rows(), w, depth, accumulate, arena);
    }
  }

  MoAConfig config_;
  WeightMatrix<T> q_experts_;    // [E*D, d]
  WeightMatrix<T> out_experts_;  // [E*d, D] in column panels of detail::kRoutedColumnTile
  Matrix<T> gate_;               // [D, E], always in T (the router)
  WeightMatrix<T> kv_;           // [2d, D]: k_proj rows, then v_proj rows
};

}  // namespace moh
