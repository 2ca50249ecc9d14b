// Router of Mixture of Attention heads (MoA, Zhang et al. 2022, arXiv 2210.05144).
//
//   l = x W_g (W_g [D, E]),  p = softmax(l),  keep the top k experts by p (ties: lower index),
//   gate w_e = p_e, not renormalised                               (MoAGating::Softmax, default)
// or the JetMoE convention: top k logits, then softmax over those k   (MoAGating::TopKSoftmax).
// Auxiliary losses over the N tokens of a call (p is always the softmax over all E):
//   switch = E sum_e (sum_t p_te / sum_te p_te) (c_e / sum c),  c_e = (token, slot) pairs to e
//   z      = mean_t (logsumexp_e l_te)^2
//   cv     = var(G) / (mean(G)^2 + 1e-10), G_e = sum_t kept gate of e, normalised to sum 1
//            (unbiased variance; 0 when E = 1)
#pragma once

#include <vector>

#include "moh/ops/softmax.hpp"
#include "moh/ops/top_k.hpp"
#include "moh/runtime/workspace.hpp"
#include "moh/tensor.hpp"

namespace moh {

enum class MoAGating {
  Softmax,      // softmax over all experts, keep top k, gates not renormalised (MoA paper)
  TopKSoftmax,  // keep the top k logits, softmax over those k (JetMoE)
};

template <>
struct EnumNames<MoAGating> {
  static constexpr const char* names[] = {"softmax", "top_k_softmax"};
};

/// Which experts each token of a MoA call used, with the auxiliary losses.
template <class T>
struct MoARouting {
  Index batch = 0, tokens = 0, num_experts = 0, top_k = 0;
  Matrix<T> logits;  // [B*T, E]
  Matrix<T> probs;   // [B*T, E]: softmax over all experts
  Matrix<T> gates;   // [B*T, E]: w_e for the kept experts, exactly 0 elsewhere
  // [B*T, k]: the experts of each token's slots; -1 for a query padding token (no expert)
  Eigen::Matrix<Index, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> selected;
  std::vector<Index> expert_counts;  // [E]: (token, slot) pairs routed to each expert
  // The losses of docs/semantics.md §5 over the call's tokens (query padding excluded but from z).
  T switch_loss = 0, z_loss = 0, cv_loss = 0;

  /// Fraction of expert slots used: k / E.
  double active_fraction() const {
    return num_experts ? static_cast<double>(top_k) / static_cast<double>(num_experts) : 0.0;
  }
};

namespace detail {

/// What route_moa() writes: a MoARouting record's storage, or arena memory when the caller asked
/// for none. Row-major [rows, E] logits, probabilities and gates, [rows, k] selected experts.
template <class T>
struct MoAGates {
  Index batch = 0, tokens = 0, experts = 0, k = 0;
  T* logits = nullptr;
  T* probs = nullptr;
  T* gates = nullptr;
  Index* selected = nullptr;
  Index* counts = nullptr;
  T* switch_loss = nullptr;
  T* z_loss = nullptr;
  T* cv_loss = nullptr;

  Index rows() const { return batch * tokens; }
  T gate(Index r, Index e) const { return gates[r * experts + e]; }
  Index pick(Index r, Index s) const { return selected[r * k + s]; }

  static MoAGates of(MoARouting<T>& r, Index B, Index Tn, Index E, Index k) {
    r.batch = B;
    r.tokens = Tn;
    r.num_experts = E;
    r.top_k = k;
    r.logits.resize(B * Tn, E);
    r.probs.resize(B * Tn, E);
    r.gates.resize(B * Tn, E);
    r.selected.resize(B * Tn, k);
    r.expert_counts.resize(static_cast<std::size_t>(E));
    return MoAGates{B, Tn, E, k, r.logits.data(), r.probs.data(), r.gates.data(),
                    r.selected.data(), r.expert_counts.data(), &r.switch_loss,   &r.z_loss,
                    &r.cv_loss};
  }
  static MoAGates in(Arena& a, Index B, Index Tn, Index E, Index k) {
    const Index N = B * Tn;
    return MoAGates{B, Tn, E, k, a.allocate<T>(N * E), a.allocate<T>(N * E),
                    a.allocate<T>(N * E), a.allocate<Index>(N * k), a.allocate<Index>(E),
                    a.allocate<T>(1),     a.allocate<T>(1),         a.allocate<T>(1)};
  }
};

/// Routes from g.logits (already x W_g) into the rest of `g`. Rows that `padding` ([rows], or
/// null) marks get p = 0, no expert (selected -1) and no gate, and are left out of the counts
/// and the switch and cv losses; the z-loss still averages over every row (docs/semantics.md §9).
template <class T>
void route_moa(MoAGating gating, const MoAGates<T>& g, Arena& arena,
               const bool* padding = nullptr) {
  const Arena::Scope scope(arena);
  const Index N = g.rows(), E = g.experts, k = g.k;
  std::copy(g.logits, g.logits + N * E, g.probs);
  std::fill(g.gates, g.gates + N * E, T(0));
  std::fill(g.counts, g.counts + E, Index(0));
  T* kept = arena.allocate<T>(k);
  T z = 0;
  Index routed = 0;  // rows that are not padding
  for (Index i = 0; i < N; ++i) {
    T* p = g.probs + i * E;
    const T* l = g.logits + i * E;
    const T lse = softmax_lse(p, E);
    z += lse * lse;
    Index* sel = g.selected + i * k;
    if (padding && padding[i]) {
      std::fill(p, p + E, T(0));
      std::fill(sel, sel + k, Index(-1));
      continue;
    }
    ++routed;
    // Top-k by p and top-k by logit pick the same experts (softmax is monotonic) except for
    // ties created by rounding; pick on the quantity each convention ranks by.
    moh::top_k(gating == MoAGating::Softmax ? p : l, E, k, sel);
    for (Index s = 0; s < k; ++s) {
      kept[s] = gating == MoAGating::Softmax ? p[sel[s]] : l[sel[s]];
      ++g.counts[sel[s]];
    }
    if (gating == MoAGating::TopKSoftmax) softmax(kept, k);
    for (Index s = 0; s < k; ++s) g.gates[i * E + sel[s]] = kept[s];
  }

  T& switch_loss = *g.switch_loss;
  T& z_loss = *g.z_loss;
  T& cv_loss = *g.cv_loss;
  switch_loss = z_loss = cv_loss = T(0);
  if (N == 0) return;
  z_loss = z / static_cast<T>(N);
  T* column = arena.allocate<T>(E);  // per expert: sum over tokens of p, then of kept gates
  T total_p = 0;
  for (Index e = 0; e < E; ++e) {
    column[e] = 0;
    for (Index i = 0; i < N; ++i) column[e] += g.probs[i * E + e];
    total_p += column[e];
  }
  if (routed == 0) return;  // every token is padding: nothing was routed
  const T total_c = static_cast<T>(routed * k);
  T sw = 0;
  for (Index e = 0; e < E; ++e)
    sw += (column[e] / total_p) * (static_cast<T>(g.counts[e]) / total_c);
  switch_loss = static_cast<T>(E) * sw;
  if (E > 1) {
    T sum = 0;
    for (Index e = 0; e < E; ++e) {
      column[e] = 0;
      for (Index i = 0; i < N; ++i) column[e] += g.gates[i * E + e];
      sum += column[e];
    }
    T mean = 0;
    for (Index e = 0; e < E; ++e) {
      if (sum > T(0)) column[e] /= sum;
      mean += column[e];
    }
    mean /= static_cast<T>(E);
    T var = 0;
    for (Index e = 0; e < E; ++e) var += (column[e] - mean) * (column[e] - mean);
    var /= static_cast<T>(E - 1);
    cv_loss = var / (mean * mean + T(1e-10));
  }
}

}  // namespace detail

/// Routes from logits [B*T, E] (already x W_g) into `out`.
template <class T>
void route_moa(const Matrix<T>& logits, Index batch, Index tokens, Index k, MoAGating gating,
               MoARouting<T>& out) {
  detail::require(logits.rows() == batch * tokens, "route_moa: logits: expected ",
                  batch * tokens, " rows (batch * tokens), got ", logits.rows());
  detail::require(k >= 1 && k <= logits.cols(), "route_moa: k must be in [1, experts]: expected ",
                  "1..", logits.cols(), ", got ", k);
  const detail::MoAGates<T> g = detail::MoAGates<T>::of(out, batch, tokens, logits.cols(), k);
  out.logits = logits;
  detail::Arena arena;
  detail::route_moa<T>(gating, g, arena);
}

}  // namespace moh
