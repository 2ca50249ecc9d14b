// Top-k selection for routers: the k largest entries of a short row, ties to the lower index.
#pragma once

#include "moh/tensor.hpp"

namespace moh {

/// Writes to out[0, k) the indices of the k largest values of x[0, n), largest first; among
/// equal values the lower index comes first (and wins the last slot). Requires 0 <= k <= n.
/// O(n k), meant for router rows (n = heads or experts).
template <class T>
void top_k(const T* x, Index n, Index k, Index* out) {
  detail::require(k >= 0 && k <= n, "top_k: k must be in [0, n]: expected 0 <= k <= ", n,
                  ", got ", k);
  Index filled = 0;
  for (Index i = 0; i < n && k > 0; ++i) {
    // Strictly greater moves past an equal value, so the earlier index stays in front.
    if (filled == k && !(x[i] > x[out[k - 1]])) continue;
    Index pos = (filled < k) ? filled++ : k - 1;
    while (pos > 0 && x[i] > x[out[pos - 1]]) {
      out[pos] = out[pos - 1];
      --pos;
    }
    out[pos] = i;
  }
}

}  // namespace moh
