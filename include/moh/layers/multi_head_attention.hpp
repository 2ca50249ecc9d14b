// MultiHeadAttention: dense multi-head attention (Vaswani et al. 2017), as torch.nn.MultiheadAttention.
//
//   [q | k | v] = x W_in^T + b_in              W_in [(H + 2 H_kv) d, D]
//   o_h = softmax(q_h k_g^T / sqrt(d) + mask) v_g,   g = h / (H / H_kv)
//   y = concat_h(o_h) W_out^T + b_out          W_out [D, H d]
//
// Self- and cross-attention, grouped-query heads (H_kv < H; H_kv = 1 is multi-query), optional
// RoPE on queries and keys, and incremental decoding through a KvCache (detail/layer.hpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "moh/detail/attend.hpp"
#include "moh/detail/layer.hpp"
#include "moh/detail/projections.hpp"
#include "moh/attention_config.hpp"
#include "moh/options.hpp"
#include "moh/tensor.hpp"

namespace moh {

/// Sizes and settings of a MultiHeadAttention layer.
struct MHAConfig : HeadsConfig {
  static constexpr const char* kLayer = "MultiHeadAttention";  // the layer this config builds
  bool bias = true;  // biases on the input and output projections

  /// Throws moh::Error on impossible settings.
  void validate() const { detail::heads_shape(*this, kLayer); }

  template <class Self, class Visitor>
  static void fields(Self& c, Visitor&& v) {
    HeadsConfig::fields(c, v);
    v("bias", c.bias);
  }
};

template <class T>
class MultiHeadAttention
    : public detail::AttentionLayer<MultiHeadAttention<T>, T, NoRouting> {
  using Base = detail::AttentionLayer<MultiHeadAttention<T>, T, NoRouting>;
  friend Base;

 public:
  using Config = MHAConfig;
  static constexpr const char* kName = MHAConfig::kLayer;
  static constexpr bool kHasModes = false, kHasQueryPadding = false;

  /// No weights yet: set them (setters, load_weights) before forward, which refuses to run
  /// until every tensor is set.
  explicit MultiHeadAttention(const MHAConfig& config)
      : Base(detail::heads_shape(config, kName), weight_infos(config)),
        config_(config),
        proj_(this->shape(), config.bias, config.bias, config.weight_storage) {}
  /// All weights zero.
  MultiHeadAttention(const MHAConfig& config, ZeroWeights) : MultiHeadAttention(config) {
    this->mark_weights_set();
  }
  /// Seeded random weights, uniform in +-1/sqrt(fan_in) like torch.nn.Linear.
  MultiHeadAttention(const MHAConfig& config, std::uint64_t seed) : MultiHeadAttention(config) {
    std::mt19937_64 rng(seed);
    proj_.randomize(rng);
    this->mark_weights_set();
  }

  const MHAConfig& config() const { return config_; }
  using Base::weight_infos;
  /// The tensors of a layer with this config: torch nn.MultiheadAttention's names, each also
  /// accepted as LLaMA-style q_proj / k_proj / v_proj / o_proj.
  static std::vector<WeightInfo> weight_infos(const MHAConfig& c) {
    return detail::Projections<T>::infos(detail::heads_shape(c, kName), c.bias, c.bias, kNames);
  }

  /// Tensors a source for this config must not have (load_weights refuses them).
  static std::vector<ForeignWeight> foreign_weights(const MHAConfig& c) {
    std::vector<ForeignWeight> out;
    detail::Projections<T>::foreign(c.bias, c.bias, kNames, "bias", "bias", out);
    // torch.nn.MultiheadAttention(add_bias_kv=True) appends a learned key and value to every
    // sequence, which this layer does not compute.
    for (const char* name : {"bias_k", "bias_v"})
      out.push_back({name, "torch.nn.MultiheadAttention's add_bias_kv (a learned key and value "
                           "appended to every sequence), which MultiHeadAttention does not have: "
                           "expected add_bias_kv=False"});
    return out;
  }

  // Weights in PyTorch layout (copies; bfloat16 storage is widened exactly).
  Matrix<T> in_proj_weight() const {  // [(H + 2 H_kv) d, D]
    return this->weight_matrix("in_proj_weight", q_width() + this->shape().kv_width(), this->shape().D);
  }
  Vector<T> in_proj_bias() const { return vector("in_proj_bias"); }  // [(H + 2 H_kv) d] or empty
  Matrix<T> out_proj_weight() const {  // [D, H d]
    return this->weight_matrix("out_proj.weight", this->shape().D, q_width());
  }
  Vector<T> out_proj_bias() const { return vector("out_proj.bias"); }  // [D] or empty
  void set_in_proj_weight(const Matrix<T>& w) { this->set_weight("in_proj_weight", w); }
  void set_in_proj_bias(const Vector<T>& b) { this->set_weight("in_proj_bias", b); }
  void set_out_proj_weight(const Matrix<T>& w) { this->set_weight("out_proj.weight", w); }
  void set_out_proj_bias(const Vector<T>& b) { this->set_weight("out_proj.bias", b); }
  /// Bytes of weights and biases the layer holds (halved for the weights with bfloat16 storage).
  std::size_t weight_bytes() const { return proj_.weight_bytes(); }

 private:
  static constexpr detail::ProjectionNames kNames{"in_proj_weight", "in_proj_bias",
                                                  "out_proj.weight", "out_proj.bias"};

  Index q_width() const { return this->shape().H * this->shape().d; }
  Vector<T> vector(const char* name) const {
    if (!config_.bias) return Vector<T>();
    const std::vector<T> v = this->weight(name);
    return Eigen::Map<const Vector<T>>(v.data(), static_cast<Index>(v.size()));
  }

  Index bias_heads() const { return this->shape().H; }
  Index weight_heads() const { return this->shape().H; }
  void store_weight(const std::string& name, const T* values) { proj_.store(kNames, name, values); }
  void load_weight(const std::string& name, T* values) const { proj_.load(kNames, name, values); }

  void project_keys_values(const ConstRowsRef<T>& src, RowsRef<T> KV, const detail::Exec& exec) const {
    proj_.project_kv(src, KV, exec);
  }

  // Queries, attention over the pass's keys/values, output projection.
  void attend(const detail::Pass<T, NoRouting>& p) const {
    const detail::HeadShape& s = this->shape();
    const Index w = s.H * s.d;
    detail::Arena& call = p.exec.call();
    const detail::Arena::Scope scope(call);
    MatrixMap<T> Q = call.matrix<T>(p.batch * p.tokens, w);
    MatrixMap<T> C = call.matrix<T>(p.batch * p.tokens, w);
    proj_.project_q(p.X, Q, p.exec);
    this->rope_rows(Q, 0, s.H, p.batch, p.tokens, p.rope);
    detail::attend_heads<T>(detail::HeadsView<T>{Q.data(), w, p.tokens * w, s.d}, p.kv, p.batch,
                            p.tokens, s.H, s.d, T(1) / std::sqrt(static_cast<T>(s.d)), p.causal,
                            p.extras, C.data(), p.exec);
    proj_.project_out(C, p.Y, p.exec);
  }

  MHAConfig config_;
  detail::Projections<T> proj_;
};

}  // namespace moh
