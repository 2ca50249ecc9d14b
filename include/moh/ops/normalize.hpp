// Row normalisations that the authors' attention modules apply to queries and keys.
//
//   layer_norm:   y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias   (biased variance, as
//                 torch.nn.LayerNorm over the last dimension; MoH-DiT's qk_norm, eps 1e-5)
//   l2_normalize: y = x / max(||x||_2, eps)                                (torch F.normalize,
//                 eps 1e-12; MoH-ViT's cosine attention)
// Plain loops over one row: a row's result does not depend on where it lies in memory or which
// thread computes it.
#pragma once

#include <algorithm>
#include <cmath>

#include "moh/error.hpp"
#include "moh/ops/linear.hpp"  // RowsRef, ConstRowsRef
#include "moh/tensor.hpp"

namespace moh {

/// LayerNorm of x[0, n) in place; weight and bias [n] (null: 1 and 0).
template <class T>
void layer_norm_row(T* x, Index n, const T* weight, const T* bias, T eps) {
  if (n <= 0) return;
  T mean = 0;
  for (Index i = 0; i < n; ++i) mean += x[i];
  mean /= static_cast<T>(n);
  T var = 0;
  for (Index i = 0; i < n; ++i) var += (x[i] - mean) * (x[i] - mean);
  var /= static_cast<T>(n);
  const T inv = T(1) / std::sqrt(var + eps);
  for (Index i = 0; i < n; ++i) {
    const T y = (x[i] - mean) * inv;
    x[i] = (weight ? y * weight[i] : y) + (bias ? bias[i] : T(0));
  }
}

/// x[0, n) / max(||x||_2, eps), in place.
template <class T>
void l2_normalize_row(T* x, Index n, T eps) {
  T sq = 0;
  for (Index i = 0; i < n; ++i) sq += x[i] * x[i];
  const T norm = std::max(std::sqrt(sq), eps);
  for (Index i = 0; i < n; ++i) x[i] /= norm;
}

/// Y = LayerNorm of each row of X [N, n] (Y [N, n] may be X itself); weight and bias [n], or
/// empty for 1 and 0.
template <class T>
void layer_norm(const ConstRowsRef<T>& X, const Vector<T>& weight, const Vector<T>& bias,
                RowsRef<T> Y, T eps = T(1e-5)) {
  const Index n = X.cols();
  detail::require(Y.rows() == X.rows() && Y.cols() == n, "layer_norm: Y: expected shape [",
                  X.rows(), ", ", n, "], got [", Y.rows(), ", ", Y.cols(), "]");
  detail::require(weight.size() == 0 || weight.size() == n, "layer_norm: weight: expected ", n,
                  " values (or none), got ", weight.size());
  detail::require(bias.size() == 0 || bias.size() == n, "layer_norm: bias: expected ", n,
                  " values (or none), got ", bias.size());
  detail::require(eps > T(0), "layer_norm: eps: expected > 0, got ", eps);
  for (Index r = 0; r < X.rows(); ++r) {
    if (Y.row(r).data() != X.row(r).data()) Y.row(r) = X.row(r);
    layer_norm_row(Y.row(r).data(), n, weight.size() ? weight.data() : nullptr,
                   bias.size() ? bias.data() : nullptr, eps);
  }
}

}  // namespace moh
