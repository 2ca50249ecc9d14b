// Internal: the query/key/value and output projections that MHA and MoH share, in PyTorch
// layout, with grouped-query heads.
//
// in_w [(H + 2 H_kv) d, D]: rows [0, H d) project queries (head h at rows h d ..), then H_kv key
// heads, then H_kv value heads. out_w [D, H d]. Biases are empty when the layer has none.
#pragma once

#include <random>
#include <string>
#include <vector>

#include "moh/detail/layer.hpp"
#include "moh/ops/linear.hpp"
#include "moh/ops/weight_matrix.hpp"
#include "moh/runtime/workspace.hpp"

namespace moh {
namespace detail {

/// The PyTorch names of the four projection tensors of a layer.
struct ProjectionNames {
  const char* in_weight;   // e.g. "in_proj_weight" or "qkv.weight"
  const char* in_bias;
  const char* out_weight;  // e.g. "out_proj.weight" or "proj.weight"
  const char* out_bias;
};

template <class T>
class Projections {
 public:
  Projections() = default;
  /// `per_head_output`: out_w is stored in column panels of one head each (a layer that runs only
  /// some heads reads each active head's slice as one contiguous run); the products read it the
  /// same way either way.
  Projections(const HeadShape& s, bool in_bias, bool out_bias, WeightStorage storage,
              bool per_head_output = false)
      : s_(s), in_w_(in_rows(), s.D, storage),
        out_w_(s.D, q_width(), storage, per_head_output ? s.d : 0) {
    if (in_bias) in_b_.setZero(in_rows());
    if (out_bias) out_b_.setZero(s.D);
  }

  /// The tensors under `names`, each also accepted in the LLaMA-style layout (q_proj, k_proj,
  /// v_proj rows for the fused input projection, o_proj for the output).
  static std::vector<WeightInfo> infos(const HeadShape& s, bool in_bias, bool out_bias,
                                       const ProjectionNames& names) {
    const std::int64_t q = s.H * s.d, kv = s.Hkv * s.d, D = s.D;
    std::vector<WeightInfo> out;
    out.push_back({names.in_weight, {q + 2 * kv, D},
                   {{"q_proj.weight", {q, D}, {}, {}}, {"k_proj.weight", {kv, D}, {}, {}},
                    {"v_proj.weight", {kv, D}, {}, {}}},
                   {}});
    if (in_bias)
      out.push_back({names.in_bias, {q + 2 * kv},
                     {{"q_proj.bias", {q}, {}, {}}, {"k_proj.bias", {kv}, {}, {}},
                      {"v_proj.bias", {kv}, {}, {}}},
                     {}});
    out.push_back({names.out_weight, {D, q}, {}, {"o_proj.weight"}});
    if (out_bias) out.push_back({names.out_bias, {D}, {}, {"o_proj.bias"}});
    return out;
  }

  /// The bias tensors (all their published names) of a layer configured without them.
  static void foreign(bool in_bias, bool out_bias, const ProjectionNames& names,
                      const char* in_flag, const char* out_flag, std::vector<ForeignWeight>& out) {
    const std::string in = std::string("a bias of the input projection, which this layer is "
                                       "configured without (") + in_flag + " = false)";
    const std::string o = std::string("a bias of the output projection, which this layer is "
                                      "configured without (") + out_flag + " = false)";
    if (!in_bias)
      for (const char* name : {names.in_bias, "q_proj.bias", "k_proj.bias", "v_proj.bias"})
        out.push_back({name, in});
    if (!out_bias)
      for (const char* name : {names.out_bias, "o_proj.bias"}) out.push_back({name, o});
  }

  /// Stores or loads the tensor `name` if it is one of `names`' four; false otherwise.
  bool store(const ProjectionNames& names, const std::string& name, const T* v) {
    if (name == names.in_weight) in_w_.set(ConstMatrixMap<T>(v, in_rows(), s_.D));
    else if (name == names.in_bias) in_b_ = Eigen::Map<const Vector<T>>(v, in_rows());
    else if (name == names.out_weight) out_w_.set(ConstMatrixMap<T>(v, s_.D, q_width()));
    else if (name == names.out_bias) out_b_ = Eigen::Map<const Vector<T>>(v, s_.D);
    else return false;
    return true;
  }
  bool load(const ProjectionNames& names, const std::string& name, T* v) const {
    if (name == names.in_weight) MatrixMap<T>(v, in_rows(), s_.D) = in_w_.values();
    else if (name == names.in_bias) Eigen::Map<Vector<T>>(v, in_rows()) = in_b_;
    else if (name == names.out_weight) MatrixMap<T>(v, s_.D, q_width()) = out_w_.values();
    else if (name == names.out_bias) Eigen::Map<Vector<T>>(v, s_.D) = out_b_;
    else return false;
    return true;
  }

  std::size_t weight_bytes() const {
    return in_w_.bytes() + out_w_.bytes() + (in_b_.size() + out_b_.size()) * sizeof(T);
  }

  /// Uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)) like torch.nn.Linear, from `rng`.
  void randomize(std::mt19937_64& rng) {
    Matrix<T> in(in_rows(), s_.D), out(s_.D, q_width());
    fill_uniform(in.data(), in.size(), s_.D, rng);
    fill_uniform(out.data(), out.size(), q_width(), rng);
    in_w_.set(in);
    out_w_.set(out);
    fill_uniform(in_b_.data(), in_b_.size(), s_.D, rng);
    fill_uniform(out_b_.data(), out_b_.size(), q_width(), rng);
  }

  /// Q[N, H d] = X[N, D] Wq^T + bq.
  void project_q(const ConstRowsRef<T>& X, RowsRef<T> Q, const Exec& exec) const {
    project<T>(X, in_w_, 0, bias(0), Q, exec);
  }
  /// KV[N, 2 H_kv d] = X[N, D] [Wk; Wv]^T + [bk; bv]: key heads, then value heads.
  void project_kv(const ConstRowsRef<T>& X, RowsRef<T> KV, const Exec& exec) const {
    project<T>(X, in_w_, q_width(), bias(q_width()), KV, exec);
  }
  /// Query head h of the given rows on this thread: Q[n, d] = X[n, D] Wq_h^T + bq_h.
  void project_q_head(Index h, const ConstRowsRef<T>& X, RowsRef<T> Q, Arena& arena,
                      bool dot_rows) const {
    project_rows<T>(X, in_w_.operand(h * s_.d, 0, true), bias(h * s_.d), Q, arena, dot_rows);
  }
  /// Y[N, D] = C[N, H d] Wo^T + bo.
  void project_out(const ConstRowsRef<T>& C, RowsRef<T> Y, const Exec& exec) const {
    project<T>(C, out_w_, 0, out_b_.size() ? out_b_.data() : nullptr, Y, exec);
  }
  /// P[n, m] (+)= O_h[n, d] Wo[c0 : c0 + m, h d : (h+1) d]^T (no bias): output columns
  /// [c0, c0 + m) of head h, added to P when `accumulate`.
  void out_head(Index h, const ConstRowsRef<T>& O, RowsRef<T> P, Index c0, bool accumulate,
                Arena& arena, bool dot_rows) const {
    multiply<T>(O.data(), O.outerStride(), out_w_.operand(c0, h * s_.d, true), P.data(),
                P.outerStride(), O.rows(), P.cols(), s_.d, accumulate, arena, dot_rows);
  }
  /// Y rows = output bias (or zero), before routed heads are added.
  void init_output(RowsRef<T> Y) const {
    if (out_b_.size())
      Y.rowwise() = out_b_.transpose();
    else
      Y.setZero();
  }

 private:
  Index q_width() const { return s_.H * s_.d; }
  Index in_rows() const { return q_width() + s_.kv_width(); }
  const T* bias(Index offset) const { return in_b_.size() ? in_b_.data() + offset : nullptr; }

  HeadShape s_;
  WeightMatrix<T> in_w_;   // [(H + 2 H_kv) d, D]
  Vector<T> in_b_;         // [(H + 2 H_kv) d] or empty
  WeightMatrix<T> out_w_;  // [D, H d], row-major or in panels of one head's d columns
  Vector<T> out_b_;        // [D] or empty
};

/// Validates the head sizes of an MHA or MoH config and derives its shape.
template <class Config>
HeadShape heads_shape(const Config& c, const char* layer) {
  validate_common(c, layer);
  require(c.num_heads > 0, layer, ": num_heads must be positive: expected > 0, got ", c.num_heads);
  require(c.num_kv_heads >= 0, layer, ": num_kv_heads must be >= 0 (0 = num_heads): expected ",
          ">= 0, got ", c.num_kv_heads);
  if (c.head_dim == 0)
    require(c.embed_dim % c.num_heads == 0, layer,
            ": embed_dim must be divisible by num_heads when head_dim is 0: expected a multiple "
            "of ", c.num_heads, ", got ", c.embed_dim);
  HeadShape s;
  s.D = s.D_kv = c.embed_dim;
  s.H = c.num_heads;
  s.d = c.head_dim ? c.head_dim : c.embed_dim / c.num_heads;
  s.Hkv = c.num_kv_heads ? c.num_kv_heads : c.num_heads;
  require(s.Hkv <= s.H && s.H % s.Hkv == 0, layer,
          ": num_kv_heads must divide num_heads: expected a divisor of ", s.H, ", got ", s.Hkv);
  require_weight_count_fits(
      (static_cast<double>(s.H) + 2.0 * static_cast<double>(s.Hkv)) * static_cast<double>(s.d) *
              static_cast<double>(s.D) +
          static_cast<double>(s.D) * static_cast<double>(s.H) * static_cast<double>(s.d),
      layer);
  s.rope = c.rope;
  s.rope_theta = c.rope_theta;
  if (s.rope) require(s.d % 2 == 0, layer, ": RoPE needs an even head_dim: expected even, got ", s.d);
  return s;
}

}  // namespace detail
}  // namespace moh
