// Naive loop references for the building blocks (linear, softmax, scaled dot-product attention)
// and small helpers shared by the block tests. Everything accumulates in double with plain loops,
// written straight from SEMANTICS.md section 1, so it shares no code with the library.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "moh/tensor.hpp"

namespace moh_test {

using moh::Index;

/// Row-major [rows, cols] matrix of uniform values in [-scale, scale] from `seed`.
template <class T>
moh::Matrix<T> random_matrix(Index rows, Index cols, std::uint64_t seed, double scale = 1.0) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> dist(-scale, scale);
  moh::Matrix<T> m(rows, cols);
  for (Index i = 0; i < m.size(); ++i) m.data()[i] = static_cast<T>(dist(rng));
  return m;
}

/// [B, T, D] tensor of uniform values in [-scale, scale] from `seed`.
template <class T>
moh::Tensor3<T> random_tensor(Index B, Index T_, Index D, std::uint64_t seed, double scale = 1.0) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> dist(-scale, scale);
  moh::Tensor3<T> t(B, T_, D);
  for (Index i = 0; i < t.size(); ++i) t.data()[i] = static_cast<T>(dist(rng));
  return t;
}

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

/// max |a - b| over two equally sized matrix-likes.
template <class MA, class MB>
double max_abs_diff(const MA& a, const MB& b) {
  double m = 0;
  for (Index r = 0; r < a.rows(); ++r)
    for (Index c = 0; c < a.cols(); ++c) {
      const double d = std::abs(static_cast<double>(a(r, c)) - static_cast<double>(b(r, c)));
      m = std::isnan(d) ? std::numeric_limits<double>::infinity() : std::max(m, d);
    }
  return m;
}

/// max(1, max |a|).
template <class MA>
double scale_of(const MA& a) {
  double m = 1.0;
  for (Index r = 0; r < a.rows(); ++r)
    for (Index c = 0; c < a.cols(); ++c) m = std::max(m, std::abs(static_cast<double>(a(r, c))));
  return m;
}

}  // namespace moh_test
