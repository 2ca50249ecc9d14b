// Naive loop references for the building blocks (linear, scaled dot-product attention). Everything
// accumulates in double with plain loops, written straight from docs/semantics.md §1, so it
// shares no code with the library. The shared test helpers (random inputs, max_abs_diff,
// scale_of, ...) come from test_helpers.hpp, included here for the tests that compare against
// these references.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "moh/tensor.hpp"
#include "test_helpers.hpp"

namespace moh_test {

using moh::Index;

/// Y[n, out] = X[n, in] W[out, in]^T + b[out] (b may be empty), in double loops.
template <class MX, class MW>
moh::Matrix<double> naive_linear(const MX& X, const MW& W, const std::vector<double>& b = {}) {
  moh::Matrix<double> Y(X.rows(), W.rows());
  for (Index r = 0; r < X.rows(); ++r)
    for (Index o = 0; o < W.rows(); ++o) {
      double acc = b.empty() ? 0.0 : b[static_cast<std::size_t>(o)];
      for (Index i = 0; i < X.cols(); ++i)
        acc += static_cast<double>(X(r, i)) * static_cast<double>(W(o, i));
      Y(r, o) = acc;
    }
  return Y;
}

/// Masking of naive_attention(): query i at position pos[i] sees key j unless padding[j] or,
/// when causal, j > pos[i] + shift.
struct NaiveMask {
  bool causal = false;
  Index shift = 0;
  std::vector<bool> padding;  // [S] or empty
};

/// O[n_q, d] = softmax(Q K^T * scale + mask) V for one head; a query that sees no key gets a zero
/// row. Q: [n_q, d], K, V: [S, d] (any matrix-like with operator()(r, c)); pos: [n_q].
template <class MQ, class MK, class MV>
moh::Matrix<double> naive_attention(const MQ& Q, const MK& K, const MV& V,
                                    const std::vector<Index>& pos, double scale,
                                    const NaiveMask& mask) {
  const Index n_q = Q.rows(), S = K.rows(), d = Q.cols();
  moh::Matrix<double> O = moh::Matrix<double>::Zero(n_q, V.cols());
  std::vector<double> s(static_cast<std::size_t>(S));
  std::vector<bool> visible(static_cast<std::size_t>(S));
  for (Index i = 0; i < n_q; ++i) {
    double max = -std::numeric_limits<double>::infinity();
    bool any = false;
    for (Index j = 0; j < S; ++j) {
      bool vis = true;
      if (!mask.padding.empty() && mask.padding[static_cast<std::size_t>(j)]) vis = false;
      if (mask.causal && j > pos[static_cast<std::size_t>(i)] + mask.shift) vis = false;
      visible[static_cast<std::size_t>(j)] = vis;
      if (!vis) continue;
      double dot = 0;
      for (Index c = 0; c < d; ++c) dot += static_cast<double>(Q(i, c)) * static_cast<double>(K(j, c));
      s[static_cast<std::size_t>(j)] = dot * scale;
      max = std::max(max, dot * scale);
      any = true;
    }
    if (!any) continue;  // nothing visible: zeros
    double sum = 0;
    for (Index j = 0; j < S; ++j) {
      if (!visible[static_cast<std::size_t>(j)]) continue;
      s[static_cast<std::size_t>(j)] = std::exp(s[static_cast<std::size_t>(j)] - max);
      sum += s[static_cast<std::size_t>(j)];
    }
    for (Index j = 0; j < S; ++j) {
      if (!visible[static_cast<std::size_t>(j)]) continue;
      const double a = s[static_cast<std::size_t>(j)] / sum;
      for (Index c = 0; c < V.cols(); ++c) O(i, c) += a * static_cast<double>(V(j, c));
    }
  }
  return O;
}

}  // namespace moh_test
