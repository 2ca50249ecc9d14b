// Numerically stable softmax and log-sum-exp over a contiguous row.
//
// softmax(x)_i = exp(x_i - max x) / sum_j exp(x_j - max x). Entries equal to -inf get
// probability 0; a row that is entirely -inf (nothing visible) becomes all zeros, never NaN.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>

#include "moh/tensor.hpp"

namespace moh {

/// Softmax in place over x[0, n); returns log(sum_i exp(x_i)) of the input (-inf for an empty or
/// all -inf row, which becomes all zeros). Router rows (n <= 256) take one vectorised pass of exp
/// in an aligned copy, so a row's bits do not depend on where it lies in memory; longer rows, and
/// rows with entries far below the max (where a vectorised exp would not reach 0 the way std::exp
/// does), use std::exp.
template <class T>
T softmax_lse(T* x, Index n) {
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  constexpr Index kVectorRow = 256;
  if (n <= 0) return kNegInf;
  T max = kNegInf, min = std::numeric_limits<T>::infinity();
  for (Index i = 0; i < n; ++i) {
    max = std::max(max, x[i]);
    min = std::min(min, x[i]);
  }
  if (max == kNegInf) {
    std::fill(x, x + n, T(0));
    return kNegInf;
  }
  T sum = 0;
  if (n <= kVectorRow && min - max > T(-80)) {
    alignas(64) T row[kVectorRow];
    Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>, Eigen::Aligned64> a(row, n);
    a = Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>(x, n) - max;
    a = a.exp();
    sum = a.sum();
    std::copy(row, row + n, x);
  } else {
    for (Index i = 0; i < n; ++i) {
      x[i] = (x[i] == kNegInf) ? T(0) : std::exp(x[i] - max);
      sum += x[i];
    }
  }
  for (Index i = 0; i < n; ++i) x[i] /= sum;
  return max + std::log(sum);
}

/// In place over x[0, n).
template <class T>
void softmax(T* x, Index n) {
  softmax_lse(x, n);
}

}  // namespace moh
