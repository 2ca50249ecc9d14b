// Linear projection Y = X W^T + b, with W stored [out, in] as torch.nn.Linear stores it.
//
// Every projection in moh is one GEMM over all rows (batch x tokens) at once. The parallel form
// splits Y into fixed tiles whose size never depends on the thread count, so the result is
// bitwise identical for any number of threads.
#pragma once

#include <algorithm>

#include "moh/detail/gemm.hpp"
#include "moh/tensor.hpp"
#include "moh/thread_pool.hpp"

namespace moh {

template <class T>
using RowsRef = Eigen::Ref<Matrix<T>, 0, Eigen::OuterStride<>>;
template <class T>
using ConstRowsRef = Eigen::Ref<const Matrix<T>, 0, Eigen::OuterStride<>>;

/// Y[N, out] = X[N, in] W[out, in]^T (+ bias[out] when `bias` is not null) on this thread:
/// one GEMM (detail/gemm.hpp), or dot products against W's rows for a few rows of X.
template <class T>
void linear(const ConstRowsRef<T>& X, const ConstRowsRef<T>& W, const T* bias, RowsRef<T> Y) {
  eigen_assert(X.cols() == W.cols() && Y.rows() == X.rows() && Y.cols() == W.rows());
  detail::multiply<T>(X.data(), X.outerStride(),
                      detail::GemmB<T>{W.data(), nullptr, W.outerStride(), true}, Y.data(),
                      Y.outerStride(), X.rows(), W.rows(), X.cols(), false);
  if (bias != nullptr) {
    Y.rowwise() += Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>>(bias, W.rows());
  }
}

namespace detail {
// Tiles of the parallel projection: at most 4 x 4 per GEMM so that each tile runs near full GEMM
// speed, at least 128 rows x 256 columns, and never fewer than one tile per core on a ViT-sized
// input. The grid depends on the shape only, never on the thread count.
inline Index linear_tile(Index n, Index minimum, Index align) {
  const Index quarter = (n + 3) / 4;
  return std::max(minimum, (quarter + align - 1) / align * align);
}
}  // namespace detail

namespace detail {
/// Calls fn(row0, rows, col0, cols) for each tile of an [rows, cols] output, on `pool`.
template <class Fn>
void for_each_linear_tile(Index rows, Index cols, ThreadPool* pool, Fn&& fn) {
  const Index row_tile = linear_tile(rows, 128, 16);
  const Index col_tile = linear_tile(cols, 256, 64);
  const Index row_tiles = (rows + row_tile - 1) / row_tile;
  const Index col_tiles = (cols + col_tile - 1) / col_tile;
  parallel_for(pool, row_tiles * col_tiles, [&](std::int64_t task, int) {
    const Index r0 = (task / col_tiles) * row_tile, c0 = (task % col_tiles) * col_tile;
    fn(r0, std::min(row_tile, rows - r0), c0, std::min(col_tile, cols - c0));
  });
}
}  // namespace detail

/// Same as linear(), split over fixed tiles of Y and run on `pool` (null: this thread).
template <class T>
void linear(const ConstRowsRef<T>& X, const ConstRowsRef<T>& W, const T* bias, RowsRef<T> Y,
            ThreadPool* pool) {
  detail::for_each_linear_tile(X.rows(), W.rows(), pool, [&](Index r0, Index nr, Index c0, Index nc) {
    linear<T>(X.middleRows(r0, nr), W.middleRows(c0, nc), bias ? bias + c0 : nullptr,
              Y.block(r0, c0, nr, nc));
  });
}

}  // namespace moh
