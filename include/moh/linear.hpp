// Linear projection Y = X W^T + b, with W stored [out, in] as torch.nn.Linear stores it.
//
// Every projection in moh is one GEMM over all rows (batch x tokens) at once. The parallel form
// splits Y into fixed tiles whose size never depends on the thread count, so the result is
// bitwise identical for any number of threads.
#pragma once

#include <algorithm>

#include "moh/tensor.hpp"
#include "moh/thread_pool.hpp"

namespace moh {

template <class T>
using RowsRef = Eigen::Ref<Matrix<T>, 0, Eigen::OuterStride<>>;
template <class T>
using ConstRowsRef = Eigen::Ref<const Matrix<T>, 0, Eigen::OuterStride<>>;

/// Y[N, out] = X[N, in] W[out, in]^T (+ bias[out] when `bias` is not null). One GEMM.
template <class T>
void linear(const ConstRowsRef<T>& X, const ConstRowsRef<T>& W, const T* bias, RowsRef<T> Y) {
  eigen_assert(X.cols() == W.cols() && Y.rows() == X.rows() && Y.cols() == W.rows());
  Y.noalias() = X * W.transpose();
  if (bias != nullptr) {
    Y.rowwise() += Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>>(bias, W.rows());
  }
}

namespace detail {
// Tile of the parallel projection: large enough that each GEMM runs near full speed, small
// enough that a 2-core machine gets work for both cores on a ViT-sized input.
constexpr Index kLinearRowTile = 128;
constexpr Index kLinearColTile = 256;
}  // namespace detail

/// Same as linear(), split over fixed tiles of Y and run on `pool` (null: this thread).
template <class T>
void linear(const ConstRowsRef<T>& X, const ConstRowsRef<T>& W, const T* bias, RowsRef<T> Y,
            ThreadPool* pool) {
  using detail::kLinearColTile;
  using detail::kLinearRowTile;
  const Index rows = X.rows(), cols = W.rows();
  const Index row_tiles = (rows + kLinearRowTile - 1) / kLinearRowTile;
  const Index col_tiles = (cols + kLinearColTile - 1) / kLinearColTile;
  parallel_for(pool, row_tiles * col_tiles, [&](std::int64_t task, int) {
    const Index r0 = (task / col_tiles) * kLinearRowTile, c0 = (task % col_tiles) * kLinearColTile;
    const Index nr = std::min(kLinearRowTile, rows - r0), nc = std::min(kLinearColTile, cols - c0);
    linear<T>(X.middleRows(r0, nr), W.middleRows(c0, nc), bias ? bias + c0 : nullptr,
              Y.block(r0, c0, nr, nc));
  });
}

}  // namespace moh
