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
// The options of the authors' ViT/DiT modules (docs/semantics.md §7): qkv_bias apart from
// proj_bias, and qk_norm (one LayerNorm(d) on every query and key head). MoHScores::Cosine is
// MoH-ViT (docs/semantics.md §8): TransNeXt's last-stage cosine attention with a per-head
// temperature, a query embedding, the ln(N_0) scale and a continuous position bias that the layer
// computes from its cpb_fc1/cpb_fc2 MLP for each token grid (once per grid, then kept).
// Self-, cross- and cached attention come from the shared skeleton (detail/layer.hpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "moh/detail/attend.hpp"
#include "moh/detail/layer.hpp"
#include "moh/detail/projections.hpp"
#include "moh/attention_config.hpp"
#include "moh/layers/moh_router.hpp"
#include "moh/options.hpp"
#include "moh/ops/normalize.hpp"
#include "moh/tensor.hpp"

namespace moh {

/// How a MoH layer scores a query against a key.
enum class MoHScores {
  Dot,     // q k^T / sqrt(d) (docs/semantics.md §1): MoH-DiT, MoH-LLaMA3, plain-attention ViTs
  Cosine,  // MoH-ViT's cosine attention with a continuous position bias (docs/semantics.md §8)
};

template <>
struct EnumNames<MoHScores> {
  static constexpr const char* names[] = {"dot", "cosine"};
};

/// Sizes and settings of a MoHAttention layer.
struct MoHConfig : HeadsConfig {
  static constexpr const char* kLayer = "MoHAttention";  // the layer this config builds
  Index shared_heads = 0;         // S_h: heads 0..S_h-1, always on
  Index active_routed_heads = 0;  // K: routed heads each token keeps
  MoHRouterKind router = MoHRouterKind::Learned;
  bool qkv_bias = true;   // a bias on the query/key/value projection (the authors' qkv_bias)
  bool proj_bias = true;  // a bias on the output projection (always there in the ViT/DiT code)
  bool qk_norm = false;   // LayerNorm(d) on every query and key head (docs/semantics.md §7)
  MoHScores scores = MoHScores::Dot;
  // MoHScores::Cosine only (docs/semantics.md §8): the grid the model was pretrained on (position
  // bias coordinates are scaled by it; each side >= 2), N_0 of the ln(N_0) scale (the tokens of the
  // grid the layer was built for), and the hidden width of the position-bias MLP.
  Index pretrain_h = 0, pretrain_w = 0, train_tokens = 0;
  Index cpb_hidden = 512;

  /// MoH-ViT's last-stage attention (TransNeXt) for a grid_h x grid_w token grid, which is also
  /// the pretraining grid and N_0 = grid_h grid_w.
  static MoHConfig vit(Index embed_dim, Index num_heads, Index shared_heads,
                       Index active_routed_heads, Index grid_h, Index grid_w) {
    MoHConfig c;
    c.embed_dim = embed_dim;
    c.num_heads = num_heads;
    c.shared_heads = shared_heads;
    c.active_routed_heads = active_routed_heads;
    c.scores = MoHScores::Cosine;
    c.pretrain_h = grid_h;
    c.pretrain_w = grid_w;
    c.train_tokens = grid_h * grid_w;
    return c;
  }

  /// MoH-LLaMA3's attention with H query heads over `num_kv_heads` key/value heads: the
  /// query-norm router, RoPE with base `rope_theta`, no bias, and the split of the released
  /// model (SkyworkAI/MoH, MoH-LLaMA3/Inference_code/modeling_llama.py: shared_head =
  /// int(H * 0.5), routed_head = int(H * 0.25)): heads 0..H/2-1 always on, each token's top
  /// H/4 of the other H/2 heads on, 0/1 gates. head_dim = embed_dim / num_heads.
  static MoHConfig moh_llama3(Index embed_dim, Index num_heads, Index num_kv_heads,
                              double rope_theta = 500000.0) {
    MoHConfig c;
    c.embed_dim = embed_dim;
    c.num_heads = num_heads;
    c.num_kv_heads = num_kv_heads;
    c.shared_heads = num_heads / 2;
    c.active_routed_heads = num_heads / 4;
    c.router = MoHRouterKind::QueryNorm;
    c.qkv_bias = c.proj_bias = false;
    c.rope = true;
    c.rope_theta = rope_theta;
    return c;
  }

  /// MoH-LLaMA3-8B's attention as released (Chat-UniVi/MoH-LLaMA3-8B): D = 4096, 32 query heads
  /// of 128 over 8 key/value heads, RoPE base 500000, no bias, the query-norm router; heads 0..15
  /// always on and the top 8 of the 16 routed heads 16..31 per token (75 % of the heads).
  static MoHConfig moh_llama3_8b() {
    MoHConfig c = moh_llama3(4096, 32, 8, 500000.0);
    c.head_dim = 128;
    return c;
  }

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
    const bool query_norm = router == MoHRouterKind::QueryNorm;
    detail::require(!(qk_norm && query_norm), "MoHAttention: qk_norm: the query-norm router ",
                    "reads the queries' norms before any normalisation: expected qk_norm = false ",
                    "with router = query_norm, got true");
    if (scores == MoHScores::Cosine) {
      detail::require(!query_norm, "MoHAttention: router: cosine attention normalises every ",
                      "query, so the query-norm router would see norms of 1: expected learned, ",
                      "got query_norm");
      detail::require(!rope, "MoHAttention: rope: cosine attention has a continuous position ",
                      "bias instead: expected false with scores = cosine, got true");
      detail::require(pretrain_h >= 2 && pretrain_w >= 2, "MoHAttention: pretrain_h, pretrain_w: ",
                      "expected each >= 2 with scores = cosine, got ", pretrain_h, " x ",
                      pretrain_w);
      detail::require(train_tokens >= 1, "MoHAttention: train_tokens (N_0 of the ln(N_0) ",
                      "scale): expected >= 1 with scores = cosine, got ", train_tokens);
      detail::require(cpb_hidden >= 1, "MoHAttention: cpb_hidden: expected >= 1, got ",
                      cpb_hidden);
    } else {
      detail::require(pretrain_h == 0 && pretrain_w == 0 && train_tokens == 0, "MoHAttention: ",
                      "pretrain_h, pretrain_w, train_tokens are settings of cosine attention: ",
                      "expected 0 with scores = dot, got ", pretrain_h, ", ", pretrain_w, ", ",
                      train_tokens);
    }
  }

  template <class Self, class Visitor>
  static void fields(Self& c, Visitor&& v) {
    HeadsConfig::fields(c, v);
    v("shared_heads", c.shared_heads);
    v("active_routed_heads", c.active_routed_heads);
    v("router", c.router);
    v("qkv_bias", c.qkv_bias);
    v("proj_bias", c.proj_bias);
    v("qk_norm", c.qk_norm);
    v("scores", c.scores);
    v("pretrain_h", c.pretrain_h);
    v("pretrain_w", c.pretrain_w);
    v("train_tokens", c.train_tokens);
    v("cpb_hidden", c.cpb_hidden);
  }
};

namespace detail {

/// The continuous position bias of MoH-ViT (docs/semantics.md §8) for one token grid, kept by a
/// layer per grid: [H, T, T] row-major, T = grid_h grid_w.
template <class T>
struct GridBias {
  Index grid_h = 0, grid_w = 0;
  std::vector<T> values;
};

/// A layer's per-grid position biases: computed on first use of a grid, then shared by every
/// later call (also concurrent ones). Copying a layer starts an empty cache; setting the MLP's
/// weights clears it.
template <class T>
class GridBiasCache {
 public:
  GridBiasCache() = default;
  GridBiasCache(const GridBiasCache&) {}
  GridBiasCache& operator=(const GridBiasCache&) {
    clear();
    return *this;
  }

  template <class Compute>
  std::shared_ptr<const GridBias<T>> get(Index grid_h, Index grid_w, Compute compute) const {
    const std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& e : entries_)
      if (e->grid_h == grid_h && e->grid_w == grid_w) return e;
    auto e = std::make_shared<GridBias<T>>();
    e->grid_h = grid_h;
    e->grid_w = grid_w;
    compute(e->values);
    if (entries_.size() == kMaxGrids) entries_.erase(entries_.begin());
    entries_.push_back(e);
    return e;
  }
  void clear() {
    const std::lock_guard<std::mutex> lock(mutex_);
    entries_.clear();
  }

 private:
  static constexpr std::size_t kMaxGrids = 4;
  mutable std::mutex mutex_;
  mutable std::vector<std::shared_ptr<const GridBias<T>>> entries_;
};

/// softplus(t) = ln(1 + e^t), as torch.nn.functional.softplus (beta 1, threshold 20).
inline double softplus(double t) { return t > 20.0 ? t : std::log1p(std::exp(t)); }

}  // namespace detail

template <class T>
class MoHAttention : public detail::AttentionLayer<MoHAttention<T>, T, MoHRouting<T>> {
  using Base = detail::AttentionLayer<MoHAttention<T>, T, MoHRouting<T>>;
  friend Base;

 public:
  using Config = MoHConfig;
  static constexpr const char* kName = MoHConfig::kLayer;
  static constexpr bool kHasModes = true, kHasQueryPadding = false;

  /// No weights yet: set them (setters, load_weights) before forward, which refuses to run
  /// until every tensor is set.
  explicit MoHAttention(const MoHConfig& config)
      : Base(validated(config), weight_infos(config)),
        config_(config),
        proj_(this->shape(), config.qkv_bias, config.proj_bias, config.weight_storage,
              /*per_head_output=*/true),
        router_(config.embed_dim, config.num_heads, config.shared_heads,
                config.active_routed_heads) {
    const Index H = this->shape().H, d = this->shape().d, hid = config.cpb_hidden;
    if (config.qk_norm)
      for (Vector<T>* v : {&q_norm_w_, &q_norm_b_, &k_norm_w_, &k_norm_b_}) v->setZero(d);
    if (cosine()) {
      temperature_.setZero(H);
      query_embedding_.setZero(H * d);
      cpb1_w_.setZero(hid * 2);
      cpb1_b_.setZero(hid);
      cpb2_w_.setZero(H * hid);
      cpb2_b_.setZero(H);
    }
  }
  /// All weights zero (a learned router's gates are then uniform; LayerNorms then output their
  /// zero bias).
  MoHAttention(const MoHConfig& config, ZeroWeights) : MoHAttention(config) {
    this->mark_weights_set();
  }
  /// Seeded random weights: projections and routers uniform in +-1/sqrt(fan_in) like
  /// torch.nn.Linear; the authors' initial values for the rest (LayerNorm weight 1 and bias 0,
  /// temperature ln(e^(1/0.24) - 1), a query embedding of small values).
  MoHAttention(const MoHConfig& config, std::uint64_t seed) : MoHAttention(config) {
    std::mt19937_64 rng(seed);
    proj_.randomize(rng);
    if (config_.router == MoHRouterKind::Learned)
      for (Matrix<T>* w : {&router_.routed_weight(), &router_.shared_weight(), &router_.mix_weight()})
        detail::fill_uniform(w->data(), w->size(), config_.embed_dim, rng);
    if (config_.qk_norm) {
      q_norm_w_.setOnes();
      k_norm_w_.setOnes();
    }
    if (cosine()) {
      temperature_.setConstant(static_cast<T>(std::log(std::expm1(1.0 / 0.24))));
      std::uniform_real_distribution<double> small(-0.02, 0.02);
      for (Index i = 0; i < query_embedding_.size(); ++i)
        query_embedding_[i] = static_cast<T>(small(rng));
      detail::fill_uniform(cpb1_w_.data(), cpb1_w_.size(), 2, rng);
      detail::fill_uniform(cpb1_b_.data(), cpb1_b_.size(), 2, rng);
      detail::fill_uniform(cpb2_w_.data(), cpb2_w_.size(), config_.cpb_hidden, rng);
      detail::fill_uniform(cpb2_b_.data(), cpb2_b_.size(), config_.cpb_hidden, rng);
    }
    this->mark_weights_set();
  }

  const MoHConfig& config() const { return config_; }
  using Base::weight_infos;
  /// The tensors of a layer with this config, under the MoH ViT/DiT names (qkv, proj, the
  /// learned router's wg, wg_0, wg_1, qk_norm's q_norm and k_norm, and cosine attention's
  /// temperature, query_embedding, cpb_fc1 and cpb_fc2); the projections are also accepted
  /// LLaMA-style.
  static std::vector<WeightInfo> weight_infos(const MoHConfig& c) {
    const detail::HeadShape s = detail::heads_shape(c, kName);
    std::vector<WeightInfo> w = detail::Projections<T>::infos(s, c.qkv_bias, c.proj_bias, kNames);
    const std::int64_t S = c.shared_heads, K = c.active_routed_heads, D = c.embed_dim;
    const std::int64_t H = s.H, d = s.d, hid = c.cpb_hidden;
    if (c.router == MoHRouterKind::Learned) {
      if (K > 0) w.push_back({"wg.weight", {c.num_heads - S, D}, {}, {}});
      if (S > 0 && K > 0) w.push_back({"wg_0.weight", {2, D}, {}, {}});
      if (S > 1) w.push_back({"wg_1.weight", {S, D}, {}, {}});
    }
    if (c.qk_norm)
      for (const char* name : {"q_norm.weight", "q_norm.bias", "k_norm.weight", "k_norm.bias"})
        w.push_back({name, {d}, {}, {}});
    if (c.scores == MoHScores::Cosine) {
      w.push_back({"temperature", {H, 1, 1}, {}, {}});
      w.push_back({"query_embedding", {H, 1, d}, {}, {}});
      w.push_back({"cpb_fc1.weight", {hid, 2}, {}, {}});
      w.push_back({"cpb_fc1.bias", {hid}, {}, {}});
      w.push_back({"cpb_fc2.weight", {H, hid}, {}, {}});
      w.push_back({"cpb_fc2.bias", {H}, {}, {}});
    }
    return w;
  }

  /// Tensors a source for this config must not have (load_weights refuses them): TransNeXt's
  /// aggregated attention, cosine attention's tensors on a dot-product layer, qk_norm's on a
  /// layer without it, biases the config leaves out.
  static std::vector<ForeignWeight> foreign_weights(const MoHConfig& c) {
    std::vector<ForeignWeight> out;
    const std::string aggregated =
        "a tensor of TransNeXt's AggregatedAttention (the first three stages of MoH-ViT: pooled "
        "and local keys), which moh does not implement; only the last stage's attention is a "
        "MoH layer (scores = cosine, docs/semantics.md §8)";
    for (const char* name : {"sr.weight", "learnable_tokens", "learnable_bias",
                             "relative_pos_bias_local", "q.weight", "kv.weight"})
      out.push_back({name, aggregated});
    if (c.scores != MoHScores::Cosine)
      for (const char* name : {"temperature", "query_embedding", "cpb_fc1.weight", "cpb_fc2.weight"})
        out.push_back({name, "a tensor of MoH-ViT's cosine attention, but this layer scores with "
                             "dot products: expected scores = cosine (MoHConfig::vit)"});
    if (!c.qk_norm)
      for (const char* name : {"q_norm.weight", "k_norm.weight"})
        out.push_back({name, "a LayerNorm of qk_norm, but this layer has qk_norm = false"});
    detail::Projections<T>::foreign(c.qkv_bias, c.proj_bias, kNames, "qkv_bias", "proj_bias", out);
    return out;
  }

  // Weights in PyTorch layout (MoH code: qkv.weight, qkv.bias, proj.weight, proj.bias,
  // wg.weight, wg_0.weight, wg_1.weight); copies, bfloat16 widened exactly. The other tensors
  // (q_norm, k_norm, temperature, query_embedding, cpb_fc1, cpb_fc2) by name: weight().
  Matrix<T> qkv_weight() const {  // [(H + 2 H_kv) d, D]
    return this->weight_matrix("qkv.weight", q_width() + this->shape().kv_width(), this->shape().D);
  }
  Vector<T> qkv_bias() const { return vector(config_.qkv_bias, "qkv.bias"); }  // or empty
  Matrix<T> proj_weight() const {  // [D, H d]
    return this->weight_matrix("proj.weight", this->shape().D, q_width());
  }
  Vector<T> proj_bias() const { return vector(config_.proj_bias, "proj.bias"); }  // or empty
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

  /// Cosine attention: the position bias [H, T, T] (row-major, T = grid_h grid_w) that the layer
  /// adds to the scores of a grid_h x grid_w grid, from its cpb_fc1/cpb_fc2 MLP
  /// (docs/semantics.md §8).
  std::vector<T> position_bias(Index grid_h, Index grid_w) const {
    require_cosine("position_bias");
    check_grid(grid_h, grid_w, grid_h * grid_w);
    return grid_bias(grid_h, grid_w)->values;
  }

 private:
  static constexpr detail::ProjectionNames kNames{"qkv.weight", "qkv.bias", "proj.weight",
                                                  "proj.bias"};

  static detail::HeadShape validated(const MoHConfig& c) {
    c.validate();
    return detail::heads_shape(c, kName);
  }
  bool cosine() const { return config_.scores == MoHScores::Cosine; }
  Index q_width() const { return this->shape().H * this->shape().d; }
  Vector<T> vector(bool present, const char* name) const {
    if (!present) return Vector<T>();
    const std::vector<T> v = this->weight(name);
    return Eigen::Map<const Vector<T>>(v.data(), static_cast<Index>(v.size()));
  }

  // Skeleton hooks (detail/layer.hpp).
  Index bias_heads() const { return this->shape().H; }
  Index weight_heads() const { return this->shape().H; }
  bool reads_grid() const { return cosine(); }
  const char* self_attention_only() const {
    return cosine() ? "cosine attention's position bias relates the tokens of one grid" : nullptr;
  }

  Matrix<T>* router_weight(const std::string& name) {
    if (name == "wg.weight") return &router_.routed_weight();
    if (name == "wg_0.weight") return &router_.mix_weight();
    if (name == "wg_1.weight") return &router_.shared_weight();
    return nullptr;
  }
  Vector<T>* extra_weight(const std::string& name) {
    if (name == "q_norm.weight") return &q_norm_w_;
    if (name == "q_norm.bias") return &q_norm_b_;
    if (name == "k_norm.weight") return &k_norm_w_;
    if (name == "k_norm.bias") return &k_norm_b_;
    if (name == "temperature") return &temperature_;
    if (name == "query_embedding") return &query_embedding_;
    if (name == "cpb_fc1.weight") return &cpb1_w_;
    if (name == "cpb_fc1.bias") return &cpb1_b_;
    if (name == "cpb_fc2.weight") return &cpb2_w_;
    if (name == "cpb_fc2.bias") return &cpb2_b_;
    return nullptr;
  }

  void store_weight(const std::string& name, const T* values) {
    if (proj_.store(kNames, name, values)) return;
    if (Vector<T>* v = extra_weight(name)) {
      *v = Eigen::Map<const Vector<T>>(values, v->size());
      if (name.compare(0, 4, "cpb_") == 0) grid_biases_.clear();
      return;
    }
    Matrix<T>& w = *router_weight(name);
    w = ConstMatrixMap<T>(values, w.rows(), w.cols());
  }
  void load_weight(const std::string& name, T* values) const {
    if (proj_.load(kNames, name, values)) return;
    auto& self = const_cast<MoHAttention&>(*this);
    if (const Vector<T>* v = self.extra_weight(name)) {
      std::copy(v->data(), v->data() + v->size(), values);
      return;
    }
    const Matrix<T>& w = *self.router_weight(name);
    MatrixMap<T>(values, w.rows(), w.cols()) = w;
  }

  /// Keys and values, then each key head normalised: LayerNorm (qk_norm), then to unit length
  /// (cosine attention).
  void project_keys_values(const ConstRowsRef<T>& src, RowsRef<T> KV, const detail::Exec& exec) const {
    proj_.project_kv(src, KV, exec);
    if (!config_.qk_norm && !cosine()) return;
    const Index d = this->shape().d, Hkv = this->shape().Hkv;
    for (Index r = 0; r < KV.rows(); ++r)
      for (Index g = 0; g < Hkv; ++g) {
        T* k = KV.row(r).data() + g * d;
        if (config_.qk_norm) layer_norm_row(k, d, k_norm_w_.data(), k_norm_b_.data(), kLayerNormEps);
        if (cosine()) l2_normalize_row(k, d, kL2Eps);
      }
  }

  /// Query head h (d values at q) as its scores read it: LayerNorm (qk_norm), then cosine
  /// attention's (q / ||q|| + e_h) softplus(tau_h) ln(N_0); unchanged without either.
  void transform_query(T* q, Index h) const {
    const Index d = this->shape().d;
    if (config_.qk_norm) layer_norm_row(q, d, q_norm_w_.data(), q_norm_b_.data(), kLayerNormEps);
    if (cosine()) {
      l2_normalize_row(q, d, kL2Eps);
      const T f = static_cast<T>(detail::softplus(static_cast<double>(temperature_[h])) *
                                 std::log(static_cast<double>(config_.train_tokens)));
      const T* e = query_embedding_.data() + h * d;
      for (Index i = 0; i < d; ++i) q[i] = (q[i] + e[i]) * f;
    }
  }

  void require_cosine(const char* what) const {
    detail::require(cosine(), kName, ": ", what, ": only a cosine-attention layer has a position ",
                    "bias: expected scores = cosine, got dot");
  }
  void check_grid(Index grid_h, Index grid_w, Index tokens) const {
    detail::require(grid_h > 0 && grid_w > 0 && grid_h * grid_w == tokens, kName, ": grid_h, ",
                    "grid_w: the tokens must form the grid (T = grid_h grid_w, row-major): ",
                    "expected a grid of ", tokens, " tokens, got ", grid_h, " x ", grid_w);
  }

  /// The position bias of a grid, from the cache or computed now (docs/semantics.md §8).
  std::shared_ptr<const detail::GridBias<T>> grid_bias(Index gh, Index gw) const {
    return grid_biases_.get(gh, gw, [&](std::vector<T>& out) {
      const Index H = this->shape().H, hid = config_.cpb_hidden, Tn = gh * gw;
      const Index rows = 2 * gh - 1, cols = 2 * gw - 1;
      // The MLP on every relative offset (dy, dx), in double: table [rows * cols, H].
      std::vector<double> table(static_cast<std::size_t>(rows * cols * H)), hidden(hid);
      const double log8 = std::log2(8.0);
      auto coord = [&](Index delta, Index pretrain) {
        const double r = static_cast<double>(delta) * 8.0 / static_cast<double>(pretrain - 1);
        const double c = std::log2(std::abs(r) + 1.0) / log8;
        return r < 0 ? -c : c;
      };
      for (Index dy = -(gh - 1); dy < gh; ++dy)
        for (Index dx = -(gw - 1); dx < gw; ++dx) {
          const double cy = coord(dy, config_.pretrain_h), cx = coord(dx, config_.pretrain_w);
          for (Index u = 0; u < hid; ++u) {
            const double a = static_cast<double>(cpb1_w_[2 * u]) * cy +
                             static_cast<double>(cpb1_w_[2 * u + 1]) * cx +
                             static_cast<double>(cpb1_b_[u]);
            hidden[u] = a > 0 ? a : 0.0;
          }
          double* row = table.data() + ((dy + gh - 1) * cols + (dx + gw - 1)) * H;
          for (Index h = 0; h < H; ++h) {
            double acc = static_cast<double>(cpb2_b_[h]);
            for (Index u = 0; u < hid; ++u) acc += static_cast<double>(cpb2_w_[h * hid + u]) * hidden[u];
            row[h] = acc;
          }
        }
      out.resize(static_cast<std::size_t>(H * Tn * Tn));
      for (Index i = 0; i < Tn; ++i)
        for (Index j = 0; j < Tn; ++j) {
          const Index dy = i / gw - j / gw, dx = i % gw - j % gw;
          const double* row = table.data() + ((dy + gh - 1) * cols + (dx + gw - 1)) * H;
          for (Index h = 0; h < H; ++h) out[(h * Tn + i) * Tn + j] = static_cast<T>(row[h]);
        }
    });
  }

  /// Cosine attention: the call's extras with the grid's position bias, plus the caller's bias
  /// (summed into the call arena then).
  detail::ScoreExtras<T> with_position_bias(const detail::Pass<T, MoHRouting<T>>& p,
                                            std::shared_ptr<const detail::GridBias<T>>& keep) const {
    const Index Tn = p.tokens, H = this->shape().H;
    Index gh = p.options.grid_h, gw = p.options.grid_w;
    if (gh == 0 && gw == 0 && config_.pretrain_h * config_.pretrain_w == Tn) {
      gh = config_.pretrain_h;
      gw = config_.pretrain_w;
    }
    check_grid(gh, gw, Tn);
    keep = grid_bias(gh, gw);
    detail::ScoreExtras<T> e = p.extras;
    const T* pos = keep->values.data();
    if (e.bias == nullptr) {
      e.bias = pos;
      e.bias_b = 0;
      e.bias_h = Tn * Tn;
      e.bias_t = Tn;
      return e;
    }
    const Index Bb = e.bias_b ? p.batch : 1;
    T* sum = p.exec.call().template allocate<T>(Bb * H * Tn * Tn);
    for (Index b = 0; b < Bb; ++b)
      for (Index h = 0; h < H; ++h)
        for (Index t = 0; t < Tn; ++t) {
          const T* user = e.bias + e.bias_offset(b, h, t);
          const T* P = pos + (h * Tn + t) * Tn;
          T* out = sum + ((b * H + h) * Tn + t) * Tn;
          for (Index j = 0; j < Tn; ++j) out[j] = user[j] + P[j];
        }
    e.bias = sum;
    e.bias_b = Bb == 1 ? 0 : H * Tn * Tn;
    e.bias_h = Tn * Tn;
    e.bias_t = Tn;
    return e;
  }

  void attend(const detail::Pass<T, MoHRouting<T>>& p) const {
    const detail::HeadShape& s = this->shape();
    const Index B = p.batch, Tq = p.tokens, H = s.H, d = s.d;
    const Index S = config_.shared_heads, K = config_.active_routed_heads;
    detail::Arena& call = p.exec.call();
    const detail::Arena::Scope scope(call);
    const detail::MoHGates<T> g = p.routing ? detail::MoHGates<T>::of(*p.routing, B, Tq, H, S, K)
                                            : detail::MoHGates<T>::in(call, B, Tq, H, S, K);
    std::shared_ptr<const detail::GridBias<T>> position;  // held for the call
    const detail::ScoreExtras<T> extras = cosine() ? with_position_bias(p, position) : p.extras;
    const T scale = cosine() ? T(1) : T(1) / std::sqrt(static_cast<T>(d));
    const bool transformed = config_.qk_norm || cosine();

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
      if (transformed)
        for (Index i = 0; i < Q.rows(); ++i)
          for (Index h = 0; h < H; ++h) transform_query(Q.row(i).data() + h * d, h);
      this->rope_rows(Q, 0, H, B, Tq, p.rope);
      MatrixMap<T> C = call.matrix<T>(B * Tq, q_width());
      detail::attend_heads<T>(detail::HeadsView<T>{Q.data(), Q.cols(), Tq * Q.cols(), d}, p.kv,
                              B, Tq, H, d, scale, p.causal, extras, C.data(), p.exec);
      for (Index i = 0; i < C.rows(); ++i)
        for (Index h = 0; h < H; ++h) C.row(i).segment(h * d, d) *= g.gate(i, h);
      if (extras.weights)  // a head that is off has no probabilities
        for (Index i = 0; i < C.rows(); ++i)
          for (Index h = 0; h < H; ++h)
            if (!g.on(i, h)) {
              T* row = extras.weights + extras.weights_row(i / Tq, h, i % Tq) * extras.keys;
              std::fill(row, row + extras.keys, T(0));
            }
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
        proj_.project_q_head(h, Xg, Qh, arena, p.exec.dot_rows);
      }
      if (transformed)
        for (Index i = 0; i < Qh.rows(); ++i) transform_query(Qh.row(i).data(), h);
      if (rope)
        for (Index i = 0; i < Qh.rows(); ++i)
          rope.rotate(Qh.row(i).data(), rows[i] / Tq, rows[i] % Tq);
    };
    auto project_out = [&](Index h, const ConstRowsRef<T>& O, RowsRef<T> P, Index c0,
                           bool accumulate, detail::Arena& arena) {
      proj_.out_head(h, O, P, c0, accumulate, arena, p.exec.dot_rows);
    };
    const Index group = s.group();
    proj_.init_output(p.Y);
    detail::attend_routed<T>(
        plan, 1, p.X, p.kv, d, scale, p.causal, !query_norm, project_q, project_out,
        [group](Index h, Index) { return h / group; }, extras, [](Index h, Index) { return h; },
        [](Index, Index h, Index) { return h; }, p.Y, p.exec);
  }

  static constexpr T kLayerNormEps = T(1e-5);  // torch.nn.LayerNorm's default
  static constexpr T kL2Eps = T(1e-12);        // torch.nn.functional.normalize's default

  MoHConfig config_;
  detail::Projections<T> proj_;
  MoHTwoStageRouter<T> router_;
  Vector<T> q_norm_w_, q_norm_b_, k_norm_w_, k_norm_b_;  // [d] each (qk_norm)
  Vector<T> temperature_;                                // [H] (cosine)
  Vector<T> query_embedding_;                            // [H d] (cosine)
  Vector<T> cpb1_w_, cpb1_b_, cpb2_w_, cpb2_b_;          // [hid, 2], [hid], [H, hid], [H]
  detail::GridBiasCache<T> grid_biases_;
};

}  // namespace moh
