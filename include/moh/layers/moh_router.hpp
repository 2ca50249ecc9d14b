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

#include "moh/ops/linear.hpp"
#include "moh/ops/softmax.hpp"
#include "moh/ops/top_k.hpp"
#include "moh/runtime/workspace.hpp"
#include "moh/tensor.hpp"

namespace moh {

/// Which router a MoH layer uses.
enum class MoHRouterKind {
  Learned,    // the two-stage router with weights (ViT / DiT / LLMs trained from scratch)
  QueryNorm,  // parameter-free, from the norms of the routed heads' queries (MoH-LLaMA3)
};

template <>
struct EnumNames<MoHRouterKind> {
  static constexpr const char* names[] = {"learned", "query_norm"};
};

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

/// What a router writes: the storage of a MoHRouting record, or arena memory when the caller
/// asked for none. Row-major [rows, heads] gates and activity, [rows, heads - shared] routed
/// probabilities, [heads] counts.
template <class T>
struct MoHGates {
  Index batch = 0, tokens = 0, heads = 0, shared = 0, k = 0;
  T* gates = nullptr;
  bool* active = nullptr;
  T* probs = nullptr;
  Index* counts = nullptr;
  T* loss = nullptr;

  Index rows() const { return batch * tokens; }
  Index routed() const { return heads - shared; }
  T& gate(Index r, Index h) const { return gates[r * heads + h]; }
  bool& on(Index r, Index h) const { return active[r * heads + h]; }
  T* probs_row(Index r) const { return probs + r * routed(); }

  /// The record's storage, resized (no allocation when it already has this shape).
  static MoHGates of(MoHRouting<T>& r, Index B, Index Tn, Index H, Index S, Index K) {
    r.batch = B;
    r.tokens = Tn;
    r.num_heads = H;
    r.shared_heads = S;
    r.active_routed_heads = K;
    r.gates.resize(B * Tn, H);
    r.active.resize(B * Tn, H);
    r.routed_probs.resize(B * Tn, H - S);
    r.head_counts.resize(static_cast<std::size_t>(H));
    return MoHGates{B, Tn, H, S, K, r.gates.data(), r.active.data(), r.routed_probs.data(),
                    r.head_counts.data(), &r.load_balance_loss};
  }
  /// Storage in `arena` for a call that keeps no record.
  static MoHGates in(Arena& a, Index B, Index Tn, Index H, Index S, Index K) {
    return MoHGates{B, Tn, H, S, K, a.allocate<T>(B * Tn * H), a.allocate<bool>(B * Tn * H),
                    a.allocate<T>(B * Tn * (H - S)), a.allocate<Index>(H), a.allocate<T>(1)};
  }

  /// Zero gates and probabilities, shared heads on, routed heads off: callers then fill the
  /// routed heads per row.
  void start() const {
    std::fill(gates, gates + rows() * heads, T(0));
    std::fill(probs, probs + rows() * routed(), T(0));
    for (Index r = 0; r < rows(); ++r)
      for (Index h = 0; h < heads; ++h) on(r, h) = h < shared;
  }
  /// Keeps the top k of row r's routed probabilities, marks them active and returns their
  /// indices in `kept` (largest first).
  void keep_top_k(Index r, Index* kept) const {
    top_k(probs_row(r), routed(), k, kept);
    for (Index i = 0; i < k; ++i) on(r, shared + kept[i]) = true;
  }
  /// Head counts and the load-balance loss from the filled rows.
  void finish() const {
    const Index N = rows(), E = routed();
    std::fill(counts, counts + heads, Index(0));
    for (Index r = 0; r < N; ++r)
      for (Index h = 0; h < heads; ++h) counts[h] += on(r, h) ? 1 : 0;
    *loss = T(0);
    if (N == 0 || E == 0) return;
    T sum = 0;
    for (Index e = 0; e < E; ++e) {
      const T f = static_cast<T>(counts[shared + e]) / static_cast<T>(N);
      T P = 0;
      for (Index r = 0; r < N; ++r) P += probs_row(r)[e];
      sum += f * (P / static_cast<T>(N));
    }
    *loss = static_cast<T>(E) * sum;
  }
};

}  // namespace detail

/// The learned two-stage router. Weights are [out, in] like torch.nn.Linear, no bias.
template <class T>
class MoHTwoStageRouter {
 public:
  MoHTwoStageRouter() = default;
  MoHTwoStageRouter(Index embed_dim, Index num_heads, Index shared_heads, Index active_routed)
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

  /// Routes X [B*T, D] (rows of `batch` sequences of `tokens`) into `out` (allocates scratch;
  /// the layers route through their workspace).
  void route(const ConstRowsRef<T>& X, Index batch, Index tokens, MoHRouting<T>& out,
             ThreadPool* pool = nullptr) const {
    detail::require(X.rows() == batch * tokens && X.cols() == D_, "MoHTwoStageRouter: X: ",
                    "expected shape [", batch * tokens, ", ", D_, "], got [", X.rows(), ", ",
                    X.cols(), "]");
    const detail::WorkspaceLease lease(nullptr, pool, "MoHTwoStageRouter");
    route(X, detail::MoHGates<T>::of(out, batch, tokens, H_, S_, K_), lease.exec());
  }

  /// Routes into `g` with scratch from exec's call arena.
  void route(const ConstRowsRef<T>& X, const detail::MoHGates<T>& g, const detail::Exec& exec) const {
    const Index N = X.rows();
    detail::Arena& arena = exec.call();
    const detail::Arena::Scope scope(arena);
    g.start();
    MatrixMap<T> lr = arena.matrix<T>(N, routed_.rows()), ls = arena.matrix<T>(N, shared_.rows()),
                 lm = arena.matrix<T>(N, mix_.rows());
    // A few outputs per token: dot products, not GEMM tiles of mostly padding.
    if (routed_.size()) detail::project_dots<T>(X, routed_, lr, exec);
    if (shared_.size()) detail::project_dots<T>(X, shared_, ls, exec);
    if (mix_.size()) detail::project_dots<T>(X, mix_, lm, exec);
    Index* kept = arena.allocate<Index>(K_);
    for (Index i = 0; i < N; ++i) {
      T a_s = 1, a_r = 1;
      if (mix_.size()) {
        softmax(lm.row(i).data(), 2);
        a_s = 2 * lm(i, 0);
        a_r = 2 * lm(i, 1);
      }
      if (S_ == 1) g.gate(i, 0) = a_s;
      if (S_ > 1) {
        softmax(ls.row(i).data(), S_);
        for (Index h = 0; h < S_; ++h) g.gate(i, h) = static_cast<T>(S_) * ls(i, h) * a_s;
      }
      if (K_ > 0) {
        T* p = g.probs_row(i);
        std::copy(lr.row(i).data(), lr.row(i).data() + g.routed(), p);
        softmax(p, g.routed());
        g.keep_top_k(i, kept);
        T sum = 0;
        for (Index j = 0; j < K_; ++j) sum += p[kept[j]];
        const T denom = std::max(sum, std::numeric_limits<T>::min());
        for (Index j = 0; j < K_; ++j)
          g.gate(i, S_ + kept[j]) = static_cast<T>(K_) * p[kept[j]] / denom * a_r;
      }
    }
    g.finish();
  }

 private:
  Index D_ = 0, H_ = 0, S_ = 0, K_ = 0;
  Matrix<T> routed_, shared_, mix_;
};

namespace detail {

/// The query-norm router into `g`: Q [B*T, H d] are the queries before RoPE (any row stride).
template <class T>
void route_by_query_norm(const ConstRowsRef<T>& Q, Index head_dim, const MoHGates<T>& g,
                         Arena& arena) {
  const Arena::Scope scope(arena);
  const Index N = Q.rows(), E = g.routed(), S = g.shared;
  g.start();
  for (Index r = 0; r < N; ++r)
    for (Index h = 0; h < S; ++h) g.gate(r, h) = T(1);
  Index* kept = arena.allocate<Index>(g.k);
  for (Index i = 0; i < N; ++i) {
    Eigen::Map<Vector<T>> p(g.probs_row(i), E);
    for (Index e = 0; e < E; ++e) p[e] = Q.row(i).segment((S + e) * head_dim, head_dim).norm();
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
    if (g.k == 0) continue;
    g.keep_top_k(i, kept);
    for (Index j = 0; j < g.k; ++j) g.gate(i, S + kept[j]) = T(1);
  }
  g.finish();
}

}  // namespace detail

/// The parameter-free query-norm router: Q [B*T, H d] are the queries before RoPE.
/// With a single routed head, or all norms equal, z is 0 and ties go to the lower index.
template <class T>
void route_by_query_norm(const ConstRowsRef<T>& Q, Index batch, Index tokens, Index num_heads,
                         Index head_dim, Index shared_heads, Index active_routed,
                         MoHRouting<T>& out) {
  detail::require(Q.rows() == batch * tokens && Q.cols() == num_heads * head_dim,
                  "route_by_query_norm: Q: expected shape [", batch * tokens, ", ",
                  num_heads * head_dim, "], got [", Q.rows(), ", ", Q.cols(), "]");
  detail::require(shared_heads >= 0 && active_routed >= 0 &&
                      shared_heads + active_routed <= num_heads,
                  "route_by_query_norm: expected 0 <= shared_heads + active_routed <= ",
                  num_heads, ", got ", shared_heads, " + ", active_routed);
  detail::Arena arena;
  detail::route_by_query_norm<T>(
      Q, head_dim,
      detail::MoHGates<T>::of(out, batch, tokens, num_heads, shared_heads, active_routed), arena);
}

}  // namespace moh
