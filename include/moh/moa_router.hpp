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

#include "moh/softmax.hpp"
#include "moh/tensor.hpp"
#include "moh/top_k.hpp"

namespace moh {

enum class MoAGating {
  Softmax,      // softmax over all experts, keep top k, gates not renormalised (MoA paper)
  TopKSoftmax,  // keep the top k logits, softmax over those k (JetMoE)
};

/// Which experts each token of a MoA call used, with the auxiliary losses.
template <class T>
struct MoARouting {
  Index batch = 0, tokens = 0, num_experts = 0, top_k = 0;
  Matrix<T> logits;  // [B*T, E]
  Matrix<T> probs;   // [B*T, E]: softmax over all experts
  Matrix<T> gates;   // [B*T, E]: w_e for the kept experts, exactly 0 elsewhere
  Eigen::Matrix<Index, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> selected;  // [B*T, k]
  std::vector<Index> expert_counts;  // [E]: (token, slot) pairs routed to each expert
  T switch_loss = 0, z_loss = 0, cv_loss = 0;

  /// Fraction of expert slots used: k / E.
  double active_fraction() const {
    return num_experts ? static_cast<double>(top_k) / static_cast<double>(num_experts) : 0.0;
  }
};

/// Routes from logits [B*T, E] (already x W_g) into `out`.
template <class T>
void route_moa(const Matrix<T>& logits, Index batch, Index tokens, Index k, MoAGating gating,
               MoARouting<T>& out) {
  const Index N = logits.rows(), E = logits.cols();
  out.batch = batch;
  out.tokens = tokens;
  out.num_experts = E;
  out.top_k = k;
  out.logits = logits;
  out.probs = logits;
  out.gates.setZero(N, E);
  out.selected.resize(N, k);
  out.expert_counts.assign(static_cast<std::size_t>(E), 0);
  std::vector<T> kept(static_cast<std::size_t>(k));
  T z = 0;
  for (Index i = 0; i < N; ++i) {
    const T lse = softmax_lse(out.probs.row(i).data(), E);
    z += lse * lse;
    Index* sel = out.selected.row(i).data();
    // Top-k by p and top-k by logit pick the same experts (softmax is monotonic) except for
    // ties created by rounding; pick on the quantity each convention ranks by.
    moh::top_k(gating == MoAGating::Softmax ? out.probs.row(i).data() : logits.row(i).data(), E,
          k, sel);
    for (Index s = 0; s < k; ++s) {
      kept[s] = gating == MoAGating::Softmax ? out.probs(i, sel[s]) : logits(i, sel[s]);
      ++out.expert_counts[sel[s]];
    }
    if (gating == MoAGating::TopKSoftmax) softmax(kept.data(), k);
    for (Index s = 0; s < k; ++s) out.gates(i, sel[s]) = kept[s];
  }

  out.switch_loss = out.z_loss = out.cv_loss = T(0);
  if (N == 0) return;
  out.z_loss = z / static_cast<T>(N);
  const T total_p = out.probs.sum(), total_c = static_cast<T>(N * k);
  T sw = 0;
  for (Index e = 0; e < E; ++e)
    sw += (out.probs.col(e).sum() / total_p) * (static_cast<T>(out.expert_counts[e]) / total_c);
  out.switch_loss = static_cast<T>(E) * sw;
  if (E > 1) {
    Vector<T> G = out.gates.colwise().sum().transpose();
    const T sum = G.sum();
    if (sum > T(0)) G /= sum;
    const T mean = G.mean();
    const T var = (G.array() - mean).square().sum() / static_cast<T>(E - 1);
    out.cv_loss = var / (mean * mean + T(1e-10));
  }
}

}  // namespace moh
