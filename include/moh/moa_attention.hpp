// MoAAttention: Mixture of Attention heads (Zhang et al. 2022, arXiv 2210.05144).
//
//   K = x_kv W_k^T,  V = x_kv W_v^T              W_k, W_v [d, D]: one key/value head, shared
//   for each of the k experts e a router picks for token x (moa_router.hpp), with gate w_e:
//     q_e = x W_q^e,  o_e = attention(q_e, K, V)  W_q^e [D, d]
//   y = sum_e w_e (o_e W_o^e)                     W_o^e [d, D]; no other projection, no bias
// The sparse path (default) projects queries and outputs per expert over just the tokens routed
// to it (grouped GEMMs), so the cost per token follows k, not E. ComputeMode::Dense computes
// every expert for every token and multiplies by the gate: the reference.
#pragma once

#include <cstdint>
#include <random>

#include "moh/detail/attend.hpp"
#include "moh/detail/projections.hpp"
#include "moh/kv_cache.hpp"
#include "moh/linear.hpp"
#include "moh/moa_router.hpp"
#include "moh/options.hpp"
#include "moh/tensor.hpp"
#include "moh/weight_matrix.hpp"

namespace moh {

/// Sizes and settings of a MoAAttention layer.
struct MoAConfig {
  Index embed_dim = 0;    // D
  Index head_dim = 0;     // d, size of every expert's query and of the shared key/value head
  Index num_experts = 0;  // E
  Index top_k = 0;        // k experts per token
  MoAGating gating = MoAGating::Softmax;
  WeightStorage weight_storage = WeightStorage::Native;  // expert and key/value projections (not the gate)

  /// Throws moh::Error on impossible settings.
  void validate() const {
    detail::require(embed_dim > 0, "MoAAttention: embed_dim must be positive: expected > 0, got ",
                    embed_dim);
    detail::require(head_dim > 0, "MoAAttention: head_dim must be positive: expected > 0, got ",
                    head_dim);
    detail::require(num_experts > 0,
                    "MoAAttention: num_experts must be positive: expected > 0, got ", num_experts);
    detail::require(top_k >= 1 && top_k <= num_experts,
                    "MoAAttention: top_k must be in [1, num_experts]: expected 1..", num_experts,
                    ", got ", top_k);
  }
};

template <class T>
class MoAAttention {
 public:
  using Scalar = T;

  explicit MoAAttention(const MoAConfig& config) : config_(validated(config)) {
    const Index D = config.embed_dim, d = config.head_dim, E = config.num_experts;
    q_experts_ = WeightMatrix<T>(E * D, d, config.weight_storage);
    // In column panels of the routed output stage's width: each (panel, expert) slice is
    // contiguous, so the stage streams the weights it reads.
    out_experts_ = WeightMatrix<T>(E * d, D, config.weight_storage, detail::kRoutedColumnTile);
    gate_.setZero(D, E);
    kv_ = WeightMatrix<T>(2 * d, D, config.weight_storage);
  }
  /// Seeded random weights (uniform in +-1/sqrt(fan_in)).
  MoAAttention(const MoAConfig& config, std::uint64_t seed) : MoAAttention(config) {
    const Index D = config.embed_dim, d = config.head_dim, E = config.num_experts;
    std::mt19937_64 rng(seed);
    Matrix<T> q(E * D, d), out(E * d, D), kv(2 * d, D);
    fill(q, D, rng);
    fill(out, d, rng);
    fill(gate_, D, rng);
    fill(kv, D, rng);
    q_experts_.set(q);
    out_experts_.set(out);
    kv_.set(kv);
  }

  const MoAConfig& config() const { return config_; }

  // Weights (MoA fairseq names). Setters check shapes and throw moh::Error.
  /// q_proj.experts.w [E, D, d], stored as [E*D, d] (expert e = rows e*D ..).
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
  void set_query_experts(const Matrix<T>& w) { assign(q_experts_, w, "q_proj.experts.w [E*D, d]"); }
  void set_output_experts(const Matrix<T>& w) { assign(out_experts_, w, "q_proj.output_experts.w [E*d, D]"); }
  void set_gate_weight(const Matrix<T>& w) { assign(gate_, w, "q_proj.w_gate"); }
  void set_key_weight(const Matrix<T>& w) { assign_rows(0, w, "k_proj.weight"); }
  void set_value_weight(const Matrix<T>& w) { assign_rows(config_.head_dim, w, "v_proj.weight"); }

  /// Self-attention. x, y: [B, T, D].
  void forward(const ConstTensorMap3<T>& x, TensorMap3<T> y, const ForwardOptions& opts = {},
               MoARouting<T>* routing = nullptr) const {
    check_io(x, y);
    const MatrixMap<T> KV = project_kv(x, opts.pool);
    run(x, detail::key_values<T>(KV, 1, config_.head_dim, x.dimension(0), x.dimension(1),
                                 opts.key_padding_mask, kName),
        opts, y, routing);
  }

  /// Cross-attention: queries from x [B, T, D], keys/values from memory [B, S, D].
  void forward_cross(const ConstTensorMap3<T>& x, const ConstTensorMap3<T>& memory,
                     TensorMap3<T> y, const ForwardOptions& opts = {},
                     MoARouting<T>* routing = nullptr) const {
    check_io(x, y);
    require_shape3("MoAAttention: memory", memory, x.dimension(0), -1, config_.embed_dim);
    const MatrixMap<T> KV = project_kv(memory, opts.pool);
    run(x, detail::key_values<T>(KV, 1, config_.head_dim, memory.dimension(0),
                                 memory.dimension(1), opts.key_padding_mask, kName),
        opts, y, routing);
  }

  /// Incremental self-attention through `cache` (one key/value head of size d).
  void forward_cached(const ConstTensorMap3<T>& x, TensorMap3<T> y, KvCache<T>& cache,
                      const ForwardOptions& opts = {}, MoARouting<T>* routing = nullptr) const {
    check_io(x, y);
    cache.check(x.dimension(0), 1, config_.head_dim, x.dimension(1), kName);
    const MatrixMap<T> KV = project_kv(x, opts.pool);
    run(x, detail::append_to_cache<T>(KV, 1, config_.head_dim, x.dimension(0), x.dimension(1),
                                      opts.key_padding_mask, cache, kName),
        opts, y, routing);
  }

  Tensor3<T> operator()(const Tensor3<T>& x, const ForwardOptions& opts = {},
                        MoARouting<T>* routing = nullptr) const {
    Tensor3<T> y(x.dimension(0), x.dimension(1), config_.embed_dim);
    forward(x, y, opts, routing);
    return y;
  }

  KvCache<T> make_cache(Index batch, Index capacity) const {
    return KvCache<T>(batch, 1, config_.head_dim, capacity);
  }

 private:
  static constexpr const char* kName = "MoAAttention";
  static const MoAConfig& validated(const MoAConfig& c) {
    c.validate();
    return c;
  }

  void check_io(const ConstTensorMap3<T>& x, const TensorMap3<T>& y) const {
    require_shape3("MoAAttention: x", x, -1, -1, config_.embed_dim);
    require_shape3("MoAAttention: y", y, x.dimension(0), x.dimension(1), config_.embed_dim);
  }
  // [B*S, 2d]: key head, then value head.
  MatrixMap<T> project_kv(const ConstTensorMap3<T>& src, ThreadPool* pool) const {
    MatrixMap<T> KV = detail::scratch_matrix<T>(detail::ScratchSlot::KeysValues,
                                                src.dimension(0) * src.dimension(1),
                                                2 * config_.head_dim);
    linear<T>(as_rows(src), kv_, nullptr, KV, pool);
    return KV;
  }

  void run(const ConstTensorMap3<T>& x, const detail::KeyValues<T>& kv,
           const ForwardOptions& opts, TensorMap3<T>& y, MoARouting<T>* routing) const {
    const Index B = x.dimension(0), Tq = x.dimension(1), N = B * Tq;
    const Index D = config_.embed_dim, d = config_.head_dim, E = config_.num_experts;
    const ConstMatrixMap<T> X = as_rows(x);
    MatrixMap<T> Y = as_rows(y);
    MoARouting<T> local;
    MoARouting<T>& r = routing ? *routing : local;
    Matrix<T> logits(N, E);
    detail::multiply<T>(X.data(), X.outerStride(), detail::GemmB<T>{gate_.data(), nullptr, E, false},
                        logits.data(), E, N, E, D, false);
    route_moa<T>(logits, B, Tq, config_.top_k, config_.gating, r);

    if (opts.mode == ComputeMode::Dense) {
      // Reference: every expert for every token, each output scaled by its gate.
      MatrixMap<T> Q = detail::scratch_matrix<T>(detail::ScratchSlot::Queries, N, E * d);
      MatrixMap<T> C = detail::scratch_matrix<T>(detail::ScratchSlot::Context, N, E * d);
      for (Index e = 0; e < E; ++e)
        project_q(e, X, Q.middleCols(e * d, d));
      detail::attend_heads<T>(detail::HeadsView<T>{Q.data(), E * d, Tq * E * d, d}, kv, B, Tq, E,
                              d, opts.causal, C.data(), opts.pool);
      for (Index i = 0; i < N; ++i)
        for (Index e = 0; e < E; ++e) C.row(i).segment(e * d, d) *= r.gates(i, e);
      project_out(0, C, Y, 0, E * d, false);
      return;
    }

    detail::HeadPlan<T> plan;
    plan.build_picked(E, B, Tq, r.top_k, [&](Index row, Index s) { return r.selected(row, s); },
                      [&](Index row, Index e) { return r.gates(row, e); });
    auto project_routed_q = [&](Index e, const Index*, const ConstRowsRef<T>& Xg, RowsRef<T> Qe) {
      project_q(e, Xg, Qe);
    };
    auto project_routed_out = [&](Index e, const ConstRowsRef<T>& O, RowsRef<T> P, Index c0,
                                  bool accumulate) { project_out(e * d, O, P, c0, d, accumulate); };
    Y.setZero();
    detail::attend_routed<T>(plan, X, kv, d, opts.causal, true, project_routed_q,
                             project_routed_out, [](Index) { return Index(0); }, Y, opts.pool);
  }

  /// Q[n, d] = X[n, D] Wq_e (expert e's query projection, stored [D, d]).
  void project_q(Index e, const ConstRowsRef<T>& X, RowsRef<T> Q) const {
    const Index D = config_.embed_dim, d = config_.head_dim;
    detail::multiply<T>(X.data(), X.outerStride(), q_experts_.operand(e * D, 0, false), Q.data(),
                        Q.outerStride(), X.rows(), d, D, false);
  }

  /// P[n, m] (+)= O[n, depth] W_o[r0 : r0 + depth, c0 : c0 + m] (expert outputs stacked in
  /// rows), one column panel of the weights at a time.
  void project_out(Index r0, const ConstRowsRef<T>& O, RowsRef<T> P, Index c0, Index depth,
                   bool accumulate) const {
    const Index panel = out_experts_.panel();
    for (Index c = 0, w = 0; c < P.cols(); c += w) {
      w = std::min(P.cols() - c, panel - (c0 + c) % panel);  // to the end of the panel
      detail::multiply<T>(O.data(), O.outerStride(), out_experts_.operand(r0, c0 + c, false),
                          P.data() + c, P.outerStride(), O.rows(), w, depth, accumulate);
    }
  }

  template <class Dst>
  static void check_shape(const Dst& dst, const Matrix<T>& w, const char* name) {
    if (w.rows() != dst.rows() || w.cols() != dst.cols())
      detail::fail("MoAAttention: ", name, ": expected shape [", dst.rows(), ", ", dst.cols(),
                   "], got [", w.rows(), ", ", w.cols(), "]");
  }
  static void assign(Matrix<T>& dst, const Matrix<T>& w, const char* name) {
    check_shape(dst, w, name);
    dst = w;
  }
  static void assign(WeightMatrix<T>& dst, const Matrix<T>& w, const char* name) {
    check_shape(dst, w, name);
    dst.set(w);
  }
  void assign_rows(Index first, const Matrix<T>& w, const char* name) {
    const Index d = config_.head_dim, D = config_.embed_dim;
    if (w.rows() != d || w.cols() != D)
      detail::fail("MoAAttention: ", name, ": expected shape [", d, ", ", D, "], got [", w.rows(),
                   ", ", w.cols(), "]");
    kv_.set_rows(first, w);
  }
  static void fill(Matrix<T>& m, Index fan_in, std::mt19937_64& rng) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
    std::uniform_real_distribution<double> dist(-bound, bound);
    for (Index i = 0; i < m.size(); ++i) m.data()[i] = static_cast<T>(dist(rng));
  }

  MoAConfig config_;
  WeightMatrix<T> q_experts_;    // [E*D, d]
  WeightMatrix<T> out_experts_;  // [E*d, D] in column panels of detail::kRoutedColumnTile
  Matrix<T> gate_;               // [D, E], always in T (the router)
  WeightMatrix<T> kv_;           // [2d, D]: k_proj rows, then v_proj rows
};

}  // namespace moh
