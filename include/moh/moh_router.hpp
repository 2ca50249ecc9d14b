// Routers of Mixture-of-Head attention (MoH, Jin et al. 2024, arXiv 2410.11842).
//
// Heads 0..S_h-1 are shared (always on); heads S_h..H-1 are routed, and each token keeps its top
// K of them. Two routers:
//  - Learned two-stage router (MoH ViT/DiT/LLM from scratch), weights W_r [E, D], W_s [S_h, D]
//    (S_h > 1), W_m [2, D] (S_h > 0 and K > 0):
//      p = softmax(x W_r^T), keep top K (ties: lower index), g_r = K p_kept / max(sum p_kept, eps)
//      g_s = S_h softmax(x W_s^T)   (g_s = 1 with one shared head)
//      [a_s, a_r] = 2 softmax(x W_m^T);  g_s *= a_s;  g_r *= a_r
//  - Query-norm router (MoH-LLaMA3 continue-tuning), no weights: l_i = ||q_i|| of each routed
//    head (before RoPE), z = l / std(l), p = softmax(z), keep top K; gates are 0/1.
// Load-balance loss over the E = H - S_h routed heads and N tokens: L_b = E sum_i f_i P_i, with
// f_i the fraction of tokens that kept head i and P_i the mean of p_i.
#pragma once

#include <cmath>
#include <limits>
#include <vector>

#include "moh/linear.hpp"
#include "moh/softmax.hpp"
#include "moh/tensor.hpp"
#include "moh/top_k.hpp"

namespace moh {

/// Which heads each token of a MoH call used, and with what weight.
template <class T>
struct MoHRouting {
  Index batch = 0, tokens = 0, num_heads = 0, shared_heads = 0, active_routed_heads = 0;
  Matrix<T> gates;  // [B*T, H]: weight of each head's output, exactly 0 for unused heads
  Eigen::Matrix<bool, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> active;  // [B*T, H]
  Matrix<T> routed_probs;          // [B*T, E]: router probabilities p before top-K
  std::vector<Index> head_counts;  // [H]: tokens that used each head
  T load_balance_loss = 0;

  Index routed_heads() const { return num_heads - shared_heads; }
  /// Gates as a [B, T, H] tensor (a copy).
  Tensor3<T> gates_tensor() const {
    Tensor3<T> g(batch, tokens, num_heads);
    std::copy(gates.data(), gates.data() + gates.size(), g.data());
    return g;
  }
  /// Fraction of (token, head) pairs computed: (S_h + K) / H for every router.
  double active_fraction() const {
    Index used = 0;
    for (Index c : head_counts) used += c;
    const Index all = batch * tokens * num_heads;
    return all ? static_cast<double>(used) / static_cast<double>(all) : 0.0;
  }
  /// Heads used by token t of sequence b, ascending.
  std::vector<Index> heads_of(Index b, Index t) const {
    std::vector<Index> out;
    for (Index h = 0; h < num_heads; ++h)
      if (active(b * tokens + t, h)) out.push_back(h);
    return out;
  }
};

namespace detail {

/// Shapes the record and fills the shared heads; callers then fill routed heads per row.
template <class T>
void start_routing(MoHRouting<T>& r, Index batch, Index tokens, Index heads, Index shared,
                   Index k) {
  r.batch = batch;
  r.tokens = tokens;
  r.num_heads = heads;
  r.shared_heads = shared;
  r.active_routed_heads = k;
  r.gates.setZero(batch * tokens, heads);
  r.active.setConstant(batch * tokens, heads, false);
  r.routed_probs.setZero(batch * tokens, heads - shared);
  r.active.leftCols(shared).setConstant(true);
}

/// Keeps the top K of row p (E routed probabilities) of token row `row`, marks them active and
/// returns their indices in `kept` (largest first).
template <class T>
void keep_top_k(MoHRouting<T>& r, Index row, Index* kept) {
  const Index E = r.routed_heads(), K = r.active_routed_heads;
  top_k(r.routed_probs.row(row).data(), E, K, kept);
  for (Index i = 0; i < K; ++i) r.active(row, r.shared_heads + kept[i]) = true;
}

/// Head counts and load-balance loss from the filled record.
template <class T>
void finish_routing(MoHRouting<T>& r) {
  const Index N = r.batch * r.tokens, E = r.routed_heads(), S = r.shared_heads;
  r.head_counts.assign(static_cast<std::size_t>(r.num_heads), 0);
  for (Index i = 0; i < N; ++i)
    for (Index h = 0; h < r.num_heads; ++h) r.head_counts[h] += r.active(i, h) ? 1 : 0;
  r.load_balance_loss = T(0);
  if (N == 0 || E == 0) return;
  T loss = 0;
  for (Index e = 0; e < E; ++e) {
    const T f = static_cast<T>(r.head_counts[S + e]) / static_cast<T>(N);
    const T P = r.routed_probs.col(e).sum() / static_cast<T>(N);
    loss += f * P;
  }
  r.load_balance_loss = static_cast<T>(E) * loss;
}

}  // namespace detail

/// The learned two-stage router. Weights are [out, in] like torch.nn.Linear, no bias.
template <class T>
class MoHLearnedRouter {
 public:
  MoHLearnedRouter() = default;
  MoHLearnedRouter(Index embed_dim, Index num_heads, Index shared_heads, Index active_routed)
      : D_(embed_dim), H_(num_heads), S_(shared_heads), K_(active_routed) {
    if (K_ > 0) routed_.setZero(H_ - S_, D_);
    if (S_ > 1) shared_.setZero(S_, D_);
    if (S_ > 0 && K_ > 0) mix_.setZero(2, D_);
  }

  const Matrix<T>& routed_weight() const { return routed_; }  // W_r [E, D] ("wg"), empty if K = 0
  const Matrix<T>& shared_weight() const { return shared_; }  // W_s [S_h, D] ("wg_1"), if S_h > 1
  const Matrix<T>& mix_weight() const { return mix_; }        // W_m [2, D] ("wg_0"), if both groups
  Matrix<T>& routed_weight() { return routed_; }
  Matrix<T>& shared_weight() { return shared_; }
  Matrix<T>& mix_weight() { return mix_; }

  /// Routes X [B*T, D] (rows of `batch` sequences of `tokens`) into `out`.
  void route(const ConstRowsRef<T>& X, Index batch, Index tokens, MoHRouting<T>& out,
             ThreadPool* pool = nullptr) const {
    const Index N = X.rows(), E = H_ - S_;
    detail::start_routing(out, batch, tokens, H_, S_, K_);
    Matrix<T> lr(N, routed_.rows()), ls(N, shared_.rows()), lm(N, mix_.rows());
    if (routed_.size()) linear<T>(X, routed_, nullptr, lr, pool);
    if (shared_.size()) linear<T>(X, shared_, nullptr, ls, pool);
    if (mix_.size()) linear<T>(X, mix_, nullptr, lm, pool);
    std::vector<Index> kept(static_cast<std::size_t>(K_));
    for (Index i = 0; i < N; ++i) {
      T a_s = 1, a_r = 1;
      if (mix_.size()) {
        softmax(lm.row(i).data(), 2);
        a_s = 2 * lm(i, 0);
        a_r = 2 * lm(i, 1);
      }
      if (S_ == 1) out.gates(i, 0) = a_s;
      if (S_ > 1) {
        softmax(ls.row(i).data(), S_);
        for (Index h = 0; h < S_; ++h) out.gates(i, h) = static_cast<T>(S_) * ls(i, h) * a_s;
      }
      if (K_ > 0) {
        out.routed_probs.row(i) = lr.row(i);
        softmax(out.routed_probs.row(i).data(), E);
        detail::keep_top_k(out, i, kept.data());
        T sum = 0;
        for (Index k : kept) sum += out.routed_probs(i, k);
        const T denom = std::max(sum, std::numeric_limits<T>::min());
        for (Index k : kept)
          out.gates(i, S_ + k) = static_cast<T>(K_) * out.routed_probs(i, k) / denom * a_r;
      }
    }
    detail::finish_routing(out);
  }

 private:
  Index D_ = 0, H_ = 0, S_ = 0, K_ = 0;
  Matrix<T> routed_, shared_, mix_;
};

/// The parameter-free query-norm router: Q [B*T, H d] are the queries before RoPE.
/// With a single routed head, or all norms equal, z is 0 and ties go to the lower index.
template <class T>
void route_by_query_norm(const ConstRowsRef<T>& Q, Index batch, Index tokens, Index num_heads,
                         Index head_dim, Index shared_heads, Index active_routed,
                         MoHRouting<T>& out) {
  const Index N = Q.rows(), E = num_heads - shared_heads;
  detail::start_routing(out, batch, tokens, num_heads, shared_heads, active_routed);
  out.gates.leftCols(shared_heads).setOnes();
  std::vector<Index> kept(static_cast<std::size_t>(active_routed));
  for (Index i = 0; i < N; ++i) {
    auto p = out.routed_probs.row(i);
    for (Index e = 0; e < E; ++e)
      p[e] = Q.row(i).segment((shared_heads + e) * head_dim, head_dim).norm();
    T stddev = 0;
    if (E > 1) {
      const T mean = p.sum() / static_cast<T>(E);
      stddev = std::sqrt((p.array() - mean).square().sum() / static_cast<T>(E - 1));
    }
    if (stddev > T(0) && std::isfinite(stddev))
      p /= stddev;
    else
      p.setZero();
    softmax(p.data(), E);
    if (active_routed == 0) continue;
    detail::keep_top_k(out, i, kept.data());
    for (Index k : kept) out.gates(i, shared_heads + k) = T(1);
  }
  detail::finish_routing(out);
}

}  // namespace moh
