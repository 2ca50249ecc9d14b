// MoAAttention: Mixture of Attention heads (Zhang et al. 2022, arXiv 2210.05144), and its
// multi-head-expert form in JetMoE (docs/semantics.md §5 and §9).
//
//   [K | V] = x_kv W_kv^T                          H_kv key/value heads of size d, shared by all
//                                                   experts; x_kv = x, or a memory of width kdim
//   for each of the k experts e a router picks for token x (moa_router.hpp), with gate w_e:
//     q_e = x W_q^e                                W_q^e [D, H_kv d]: H_kv query heads
//     o_e = concat_j attention(q_e head j, K_j, V_j)   (RoPE on queries and keys when set)
//   y = sum_e w_e (o_e W_o^e) + b                  W_o^e [H_kv d, D]; b [D] when `out_bias`
// fairseq's MoA is H_kv = 1, softmax-then-top-k gates, no bias, no RoPE (tensor names
// MoANames::Fairseq); JetMoE-8B's attention is H_kv = 16, top-k-then-softmax gates, a shared
// bias and RoPE (MoANames::JetMoE: the tensor names of Hugging Face transformers and of the
// official repository). Query tokens marked in ForwardOptions::query_padding_mask are routed to
// no expert and output zeros (fairseq's skip mask).
// The sparse path (default) projects queries and outputs per expert over just the tokens routed
// to it (grouped GEMMs), so the cost per token follows k, not E. ComputeMode::Dense computes
// every expert for every token and multiplies by the gate: the reference. Self-, cross- and
// cached attention, and a memory's keys and values computed once (make_memory_cache), come from
// the shared skeleton (detail/layer.hpp).
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "moh/detail/attend.hpp"
#include "moh/detail/layer.hpp"
#include "moh/attention_config.hpp"
#include "moh/layers/moa_router.hpp"
#include "moh/options.hpp"
#include "moh/ops/linear.hpp"
#include "moh/ops/weight_matrix.hpp"
#include "moh/tensor.hpp"

namespace moh {

/// Whose tensor names (and layouts) a MoAAttention layer's weights use.
enum class MoANames {
  Fairseq,  // q_proj.experts.w [E, D, H_kv d], q_proj.output_experts.w [E, H_kv d, D],
            // q_proj.w_gate [D, E], k_proj.weight, v_proj.weight [H_kv d, kdim]
  JetMoE,   // experts.input_linear.weight [E, H_kv d, D], experts.output_linear.weight
            // [E, D, H_kv d], experts.router.layer.weight [E, D], experts.bias [D],
            // kv_proj.weight [2 H_kv d, kdim] (keys first)
};

template <>
struct EnumNames<MoANames> {
  static constexpr const char* names[] = {"fairseq", "jetmoe"};
};

/// Sizes and settings of a MoAAttention layer. head_dim (d) is the size of every query and
/// key/value head; each expert has num_kv_heads (H_kv) query heads, head j attending
/// with key/value head j.
struct MoAConfig : AttentionConfig {
  static constexpr const char* kLayer = "MoAAttention";  // the layer this config builds
  Index num_kv_heads = 1;  // H_kv >= 1: key/value heads, and each expert's query heads
  Index num_experts = 0;   // E
  Index top_k = 0;        // k experts per token
  MoAGating gating = MoAGating::Softmax;
  Index kdim = 0;         // width of the memory keys and values come from; 0 = embed_dim
  bool out_bias = false;  // one output bias [D] shared by all experts (JetMoE)
  MoANames names = MoANames::Fairseq;

  /// JetMoE's attention (Hugging Face transformers' JetMoeAttention / the official MoA layer):
  /// top-k-then-softmax gates, a shared output bias, RoPE, JetMoE's tensor names.
  static MoAConfig jetmoe(Index embed_dim, Index num_kv_heads, Index num_experts, Index top_k,
                          Index head_dim, double rope_theta = 10000.0) {
    MoAConfig c;
    c.embed_dim = embed_dim;
    c.num_kv_heads = num_kv_heads;
    c.num_experts = num_experts;
    c.top_k = top_k;
    c.head_dim = head_dim;
    c.gating = MoAGating::TopKSoftmax;
    c.out_bias = true;
    c.rope = true;
    c.rope_theta = rope_theta;
    c.names = MoANames::JetMoE;
    return c;
  }

  Index kv_heads() const { return num_kv_heads; }
  Index memory_dim() const { return kdim ? kdim : embed_dim; }

  /// Throws moh::Error on impossible settings.
  void validate() const {
    detail::validate_common(*this, kLayer);
    detail::require(head_dim > 0, "MoAAttention: head_dim must be positive: expected > 0, got ",
                    head_dim);
    detail::require(num_kv_heads >= 1, "MoAAttention: num_kv_heads: expected >= 1 (fairseq's MoA: ",
                    "1), got ", num_kv_heads);
    detail::require(kdim >= 0, "MoAAttention: kdim: expected >= 0 (0 = embed_dim), got ", kdim);
    if (rope)
      detail::require(head_dim % 2 == 0, "MoAAttention: RoPE needs an even head_dim: expected ",
                      "even, got ", head_dim);
    detail::require(num_experts > 0,
                    "MoAAttention: num_experts must be positive: expected > 0, got ", num_experts);
    detail::require(top_k >= 1 && top_k <= num_experts,
                    "MoAAttention: top_k must be in [1, num_experts]: expected 1..", num_experts,
                    ", got ", top_k);
    detail::require(!(out_bias && names == MoANames::Fairseq), "MoAAttention: out_bias: ",
                    "fairseq's MoA has no output bias (no tensor name for one): expected out_bias = false with ",
                    "names = fairseq, got true");
    const double E = static_cast<double>(num_experts), D = static_cast<double>(embed_dim);
    const double w = static_cast<double>(kv_heads()) * static_cast<double>(head_dim);
    detail::require_weight_count_fits(2.0 * E * D * w + 2.0 * w * static_cast<double>(memory_dim()) +
                                          D * E + D,
                                      kLayer);
  }

  template <class Self, class Visitor>
  static void fields(Self& c, Visitor&& v) {
    AttentionConfig::fields(c, v);
    v("num_kv_heads", c.num_kv_heads);
    v("num_experts", c.num_experts);
    v("top_k", c.top_k);
    v("gating", c.gating);
    v("kdim", c.kdim);
    v("out_bias", c.out_bias);
    v("names", c.names);
  }
};

template <class T>
class MoAAttention : public detail::AttentionLayer<MoAAttention<T>, T, MoARouting<T>> {
  using Base = detail::AttentionLayer<MoAAttention<T>, T, MoARouting<T>>;
  friend Base;

 public:
  using Config = MoAConfig;
  static constexpr const char* kName = MoAConfig::kLayer;
  static constexpr bool kHasModes = true, kHasQueryPadding = true;

  /// No weights yet: set them (setters, load_weights) before forward, which refuses to run
  /// until every tensor is set.
  explicit MoAAttention(const MoAConfig& config)
      : Base(shape_of(config), weight_infos(config)), config_(config) {
    const Index D = config.embed_dim, w = width(), E = config.num_experts;
    // The experts are read untransposed ([in, out]), which a packed copy does not serve.
    const WeightStorage experts = without_packed_copy(config.weight_storage);
    q_experts_ = WeightMatrix<T>(E * D, w, experts);
    // In column panels of the routed output stage's width: each (panel, expert) slice is
    // contiguous, so the stage streams the weights it reads.
    out_experts_ = WeightMatrix<T>(E * w, D, experts, detail::kRoutedColumnTile);
    gate_.setZero(D, E);
    kv_ = WeightMatrix<T>(2 * w, config.memory_dim(), config.weight_storage);
    if (config.out_bias) bias_.setZero(D);
  }
  /// All weights zero.
  MoAAttention(const MoAConfig& config, ZeroWeights) : MoAAttention(config) {
    this->mark_weights_set();
  }
  /// Seeded random weights (uniform in +-1/sqrt(fan_in)).
  MoAAttention(const MoAConfig& config, std::uint64_t seed) : MoAAttention(config) {
    const Index D = config.embed_dim, w = width(), E = config.num_experts;
    const Index Dkv = config.memory_dim();
    std::mt19937_64 rng(seed);
    Matrix<T> q(E * D, w), out(E * w, D), kv(2 * w, Dkv);
    detail::fill_uniform(q.data(), q.size(), D, rng);
    detail::fill_uniform(out.data(), out.size(), w, rng);
    detail::fill_uniform(gate_.data(), gate_.size(), D, rng);
    detail::fill_uniform(kv.data(), kv.size(), Dkv, rng);
    detail::fill_uniform(bias_.data(), bias_.size(), w, rng);
    q_experts_.set(q);
    out_experts_.set(out);
    kv_.set(kv);
    this->mark_weights_set();
  }

  const MoAConfig& config() const { return config_; }
  using Base::weight_infos;
  /// The tensors of a layer with this config, under fairseq's or JetMoE's names (config.names).
  static std::vector<WeightInfo> weight_infos(const MoAConfig& c) {
    const std::int64_t E = c.num_experts, D = c.embed_dim, w = c.kv_heads() * c.head_dim;
    const std::int64_t Dkv = c.memory_dim();
    if (c.names == MoANames::JetMoE) {
      std::vector<WeightInfo> out{{"experts.input_linear.weight", {E, w, D}, {}, {}},
                                  {"experts.output_linear.weight", {E, D, w}, {}, {}},
                                  {"experts.router.layer.weight", {E, D}, {}, {}},
                                  {"kv_proj.weight", {2 * w, Dkv}, {}, {}}};
      if (c.out_bias) out.push_back({"experts.bias", {D}, {}, {}});
      return out;
    }
    return {{"q_proj.experts.w", {E, D, w}, {}, {}},
            {"q_proj.output_experts.w", {E, w, D}, {}, {}},
            {"q_proj.w_gate", {D, E}, {}, {}},
            {"k_proj.weight", {w, Dkv}, {}, {}},
            {"v_proj.weight", {w, Dkv}, {}, {}}};
  }

  /// Tensors a source for this config must not have (load_weights refuses them): the other
  /// convention's names, and a bias the config leaves out.
  static std::vector<ForeignWeight> foreign_weights(const MoAConfig& c) {
    std::vector<ForeignWeight> out;
    MoAConfig other = c;
    other.names = c.names == MoANames::JetMoE ? MoANames::Fairseq : MoANames::JetMoE;
    other.out_bias = false;
    const std::string why = c.names == MoANames::JetMoE
                                ? "fairseq MoA's name, but this layer reads JetMoE's: expected "
                                  "names = fairseq"
                                : "JetMoE's name, but this layer reads fairseq's: expected names "
                                  "= jetmoe (MoAConfig::jetmoe)";
    for (const WeightInfo& w : weight_infos(other)) out.push_back({w.name, why});
    if (!c.out_bias)
      out.push_back({"experts.bias", "JetMoE's output bias, but this layer has out_bias = false"});
    return out;
  }

  // Weights in fairseq's layout whatever the names, copies.
  /// Query projections [E*D, H_kv d] (expert e = rows e*D ..; fairseq's q_proj.experts.w).
  Matrix<T> query_experts() const { return q_experts_.values(); }
  /// Output projections [E*H_kv d, D] (fairseq's q_proj.output_experts.w).
  Matrix<T> output_experts() const { return out_experts_.values(); }
  /// Router [D, E] (fairseq's q_proj.w_gate; JetMoE's router weight transposed).
  const Matrix<T>& gate_weight() const { return gate_; }
  /// Keys and values [H_kv d, kdim] each (fairseq's k_proj.weight and v_proj.weight).
  Matrix<T> key_weight() const { return kv_.values().topRows(width()); }
  Matrix<T> value_weight() const { return kv_.values().bottomRows(width()); }
  /// Query heads: E experts of H_kv heads each (a token uses top_k H_kv of them).
  Index num_heads() const { return config_.num_experts * config_.kv_heads(); }
  /// Experts (E).
  Index num_experts() const { return config_.num_experts; }
  /// The shared output bias [D], or empty.
  const Vector<T>& output_bias() const { return bias_; }
  /// Bytes of expert, key/value, gate and bias weights (halved, but for the gate and bias,
  /// with bfloat16).
  std::size_t weight_bytes() const {
    return q_experts_.bytes() + out_experts_.bytes() + kv_.bytes() +
           (gate_.size() + bias_.size()) * sizeof(T);
  }
  // Setters in fairseq's layout (any names).
  void set_query_experts(const Matrix<T>& w) { set_fairseq(0, w); }
  void set_output_experts(const Matrix<T>& w) { set_fairseq(1, w); }
  void set_gate_weight(const Matrix<T>& w) { set_fairseq(2, w); }
  void set_key_weight(const Matrix<T>& w) { set_fairseq(3, w); }
  void set_value_weight(const Matrix<T>& w) { set_fairseq(4, w); }
  /// Keys then values [2 H_kv d, kdim] (JetMoE's kv_proj.weight; fairseq's k_proj and v_proj
  /// stacked).
  void set_key_value_weight(const Matrix<T>& kv) {
    if (jetmoe()) {
      this->set_weight("kv_proj.weight", kv);
      return;
    }
    const Index w = width();
    detail::require(kv.rows() == 2 * w && kv.cols() == config_.memory_dim(), kName,
                    ": key and value weights: expected shape [", 2 * w, ", ",
                    config_.memory_dim(), "], got [", kv.rows(), ", ", kv.cols(), "]");
    this->set_weight("k_proj.weight", Matrix<T>(kv.topRows(w)));
    this->set_weight("v_proj.weight", Matrix<T>(kv.bottomRows(w)));
  }
  /// The output bias [D] (JetMoE's experts.bias; a layer with out_bias = true).
  void set_output_bias(const Vector<T>& b) { this->set_weight("experts.bias", b); }

 private:
  static detail::HeadShape shape_of(const MoAConfig& c) {
    c.validate();
    detail::HeadShape s;
    s.D = c.embed_dim;
    s.D_kv = c.memory_dim();
    s.H = c.num_experts;
    s.d = c.head_dim;
    s.Hkv = c.kv_heads();
    s.rope = c.rope;
    s.rope_theta = c.rope_theta;
    return s;
  }
  Index width() const { return config_.kv_heads() * config_.head_dim; }  // w = H_kv d
  bool jetmoe() const { return config_.names == MoANames::JetMoE; }

  /// Sets one of the five tensors from its fairseq layout: under its own name for fairseq
  /// names, converted to the JetMoE tensor it is for JetMoE's (keys and values are one tensor
  /// there: set_key_value_weight).
  void set_fairseq(int which, const Matrix<T>& m) {
    static const char* const kFairseq[] = {"q_proj.experts.w", "q_proj.output_experts.w",
                                           "q_proj.w_gate", "k_proj.weight", "v_proj.weight"};
    if (!jetmoe()) {
      this->set_weight(kFairseq[which], m);
      return;
    }
    detail::require(which < 3, kName, ": ", kFairseq[which], ": JetMoE's names keep keys and ",
                    "values in one tensor (kv_proj.weight): expected set_key_value_weight, got ",
                    which == 3 ? "set_key_weight" : "set_value_weight");
    const Index D = config_.embed_dim, w = width(), E = config_.num_experts;
    const Index rows[] = {E * D, E * w, D}, cols[] = {w, D, E};
    detail::require(m.rows() == rows[which] && m.cols() == cols[which], kName, ": ",
                    kFairseq[which], ": expected shape [", rows[which], ", ", cols[which],
                    "], got [", m.rows(), ", ", m.cols(), "]");
    if (which == 0)
      this->set_weight("experts.input_linear.weight", per_expert_transposed(m.data(), D, w));
    if (which == 1)
      this->set_weight("experts.output_linear.weight", per_expert_transposed(m.data(), w, D));
    if (which == 2) this->set_weight("experts.router.layer.weight", Matrix<T>(m.transpose()));
  }

  // Skeleton hooks (detail/layer.hpp).
  Index bias_heads() const { return 1; }
  Index weight_heads() const { return config_.top_k * config_.kv_heads(); }

  void store_weight(const std::string& name, const T* v) {
    const Index D = config_.embed_dim, w = width(), E = config_.num_experts;
    const Index Dkv = config_.memory_dim();
    if (name == "q_proj.experts.w") q_experts_.set(ConstMatrixMap<T>(v, E * D, w));
    else if (name == "q_proj.output_experts.w") out_experts_.set(ConstMatrixMap<T>(v, E * w, D));
    else if (name == "q_proj.w_gate") gate_ = ConstMatrixMap<T>(v, D, E);
    else if (name == "k_proj.weight") kv_.set_rows(0, ConstMatrixMap<T>(v, w, Dkv));
    else if (name == "v_proj.weight") kv_.set_rows(w, ConstMatrixMap<T>(v, w, Dkv));
    else if (name == "experts.input_linear.weight") q_experts_.set(per_expert_transposed(v, w, D));
    else if (name == "experts.output_linear.weight") out_experts_.set(per_expert_transposed(v, D, w));
    else if (name == "experts.router.layer.weight") gate_ = ConstMatrixMap<T>(v, E, D).transpose();
    else if (name == "kv_proj.weight") kv_.set(ConstMatrixMap<T>(v, 2 * w, Dkv));
    else bias_ = Eigen::Map<const Vector<T>>(v, D);  // experts.bias
  }
  void load_weight(const std::string& name, T* v) const {
    const Index D = config_.embed_dim, w = width(), E = config_.num_experts;
    const Index Dkv = config_.memory_dim();
    if (name == "q_proj.experts.w") MatrixMap<T>(v, E * D, w) = q_experts_.values();
    else if (name == "q_proj.output_experts.w") MatrixMap<T>(v, E * w, D) = out_experts_.values();
    else if (name == "q_proj.w_gate") MatrixMap<T>(v, D, E) = gate_;
    else if (name == "k_proj.weight") MatrixMap<T>(v, w, Dkv) = key_weight();
    else if (name == "v_proj.weight") MatrixMap<T>(v, w, Dkv) = value_weight();
    else if (name == "experts.input_linear.weight")
      MatrixMap<T>(v, E * w, D) = per_expert_transposed(q_experts_.values().data(), D, w);
    else if (name == "experts.output_linear.weight")
      MatrixMap<T>(v, E * D, w) = per_expert_transposed(out_experts_.values().data(), w, D);
    else if (name == "experts.router.layer.weight") MatrixMap<T>(v, E, D) = gate_.transpose();
    else if (name == "kv_proj.weight") MatrixMap<T>(v, 2 * w, Dkv) = kv_.values();
    else Eigen::Map<Vector<T>>(v, D) = bias_;  // experts.bias
  }
  /// E blocks [rows, cols] (row-major, one after another) each transposed: [E * cols, rows].
  Matrix<T> per_expert_transposed(const T* v, Index rows, Index cols) const {
    const Index E = config_.num_experts;
    Matrix<T> out(E * cols, rows);
    for (Index e = 0; e < E; ++e)
      out.middleRows(e * cols, cols) = ConstMatrixMap<T>(v + e * rows * cols, rows, cols).transpose();
    return out;
  }

  // [B*S, 2 H_kv d]: key heads, then value heads.
  void project_keys_values(const ConstRowsRef<T>& src, RowsRef<T> KV, const detail::Exec& exec) const {
    detail::project<T>(src, kv_, 0, nullptr, KV, exec);
  }

  void attend(const detail::Pass<T, MoARouting<T>>& p) const {
    const Index B = p.batch, Tq = p.tokens, N = B * Tq;
    const Index D = config_.embed_dim, d = config_.head_dim, E = config_.num_experts;
    const Index k = config_.top_k, Hkv = config_.kv_heads(), w = width();
    const T scale = T(1) / std::sqrt(static_cast<T>(d));
    detail::Arena& call = p.exec.call();
    const detail::Arena::Scope scope(call);
    const detail::MoAGates<T> g = p.routing ? detail::MoAGates<T>::of(*p.routing, B, Tq, E, k)
                                            : detail::MoAGates<T>::in(call, B, Tq, E, k);
    detail::multiply<T>(p.X.data(), p.X.outerStride(),
                        detail::GemmB<T>{gate_.data(), nullptr, E, false}, g.logits, E, N, E, D,
                        false, call);
    detail::route_moa<T>(config_.gating, g, call,
                         p.query_padding ? p.query_padding->data() : nullptr);
    auto init_output = [&] {
      if (bias_.size())
        p.Y.rowwise() = bias_.transpose();
      else
        p.Y.setZero();
    };
    // A padded query's output is 0, bias included (docs/semantics.md §9).
    auto zero_padded_rows = [&] {
      if (!p.query_padding) return;
      for (Index i = 0; i < N; ++i)
        if (p.query_padding->data()[i]) p.Y.row(i).setZero();
    };

    if (p.mode == ComputeMode::Dense) {
      // Reference: every expert for every token, each output scaled by its gate. Query head j
      // of expert e is head j E + e, so that the E heads reading kv head j are adjacent.
      const Index heads = E * Hkv;
      MatrixMap<T> Qe = call.matrix<T>(N, w);
      MatrixMap<T> Q = call.matrix<T>(N, heads * d);
      MatrixMap<T> C = call.matrix<T>(N, heads * d);
      for (Index e = 0; e < E; ++e) {
        project_q(e, p.X, Qe, call);
        for (Index j = 0; j < Hkv; ++j) Q.middleCols((j * E + e) * d, d) = Qe.middleCols(j * d, d);
      }
      this->rope_rows(Q, 0, heads, B, Tq, p.rope);
      // All heads' probabilities when asked, then each slot's heads picked from them.
      detail::ScoreExtras<T> extras = p.extras;
      const Index S = extras.keys;
      T* all = extras.weights ? call.allocate<T>(B * heads * Tq * S) : nullptr;
      if (all) {
        extras.weights = all;
        extras.weights_heads = heads;
      }
      detail::attend_heads<T>(detail::HeadsView<T>{Q.data(), heads * d, Tq * heads * d, d}, p.kv,
                              B, Tq, heads, d, scale, p.causal, extras, C.data(), p.exec);
      MatrixMap<T> O = call.matrix<T>(N, E * w);  // expert-major again, gated
      for (Index i = 0; i < N; ++i)
        for (Index e = 0; e < E; ++e)
          for (Index j = 0; j < Hkv; ++j)
            O.row(i).segment(e * w + j * d, d) = C.row(i).segment((j * E + e) * d, d) * g.gate(i, e);
      if (all)
        for (Index i = 0; i < N; ++i)
          for (Index s = 0; s < k && g.pick(i, s) >= 0; ++s)
            for (Index j = 0; j < Hkv; ++j) {
              const Index b = i / Tq, t = i % Tq;
              const T* from = all + ((b * heads + j * E + g.pick(i, s)) * Tq + t) * S;
              std::copy(from, from + S, p.extras.weights + p.extras.weights_row(b, s * Hkv + j, t) * S);
            }
      init_output();
      project_out(0, O, p.Y, 0, E * w, true, call);
      zero_padded_rows();
      return;
    }

    detail::HeadPlan<T> plan;
    plan.build_picked(call, E, B, Tq, k, [&](Index row, Index s) { return g.pick(row, s); },
                      [&](Index row, Index e) { return g.gate(row, e); });
    const RopeTable<T>& rope = p.rope;
    auto project_routed_q = [&](Index e, const Index* rows, const ConstRowsRef<T>& Xg,
                                RowsRef<T> Qe, detail::Arena& arena) {
      project_q(e, Xg, Qe, arena);
      if (rope)
        for (Index i = 0; i < Qe.rows(); ++i)
          for (Index j = 0; j < Hkv; ++j)
            rope.rotate(Qe.row(i).data() + j * d, rows[i] / Tq, rows[i] % Tq);
    };
    auto project_routed_out = [&](Index e, const ConstRowsRef<T>& O, RowsRef<T> P, Index c0,
                                  bool accumulate, detail::Arena& arena) {
      project_out(e * w, O, P, c0, w, accumulate, arena);
    };
    init_output();
    detail::attend_routed<T>(
        plan, Hkv, p.X, p.kv, d, scale, p.causal, true, project_routed_q, project_routed_out,
        [](Index, Index j) { return j; }, p.extras, [](Index, Index) { return Index(0); },
        [&](Index i, Index, Index j) { return plan.slots[i] * Hkv + j; }, p.Y, p.exec);
    zero_padded_rows();
  }

  /// Q[n, H_kv d] = X[n, D] Wq_e (expert e's query projection, stored [D, H_kv d]).
  void project_q(Index e, const ConstRowsRef<T>& X, RowsRef<T> Q, detail::Arena& arena) const {
    const Index D = config_.embed_dim;
    detail::multiply<T>(X.data(), X.outerStride(), q_experts_.operand(e * D, 0, false), Q.data(),
                        Q.outerStride(), X.rows(), width(), D, false, arena);
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
  WeightMatrix<T> q_experts_;    // [E*D, H_kv d]
  WeightMatrix<T> out_experts_;  // [E*H_kv d, D] in column panels of detail::kRoutedColumnTile
  Matrix<T> gate_;               // [D, E], always in T (the router)
  WeightMatrix<T> kv_;           // [2 H_kv d, kdim]: key rows, then value rows
  Vector<T> bias_;               // [D] or empty, always in T
};

}  // namespace moh
