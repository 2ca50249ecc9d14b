// Linear projection Y = X W^T + b, with W stored [out, in] as torch.nn.Linear stores it.
//
// Every projection in moh is one GEMM over all rows (batch x tokens) at once (ops/gemm.hpp), or
// dot products against W's rows for a decode step's few rows, for every row of a decode call
// (Exec::dot_rows) and for a router's few outputs (project_dots). The parallel form splits Y into
// tiles; no element's arithmetic depends on the tiles (a GEMM's grid follows the shape only; a
// decode call's dot products split finer on a pool of several threads), so the result is
// bitwise identical for any number of threads.
#pragma once

#include <algorithm>

#include "moh/ops/detail/packed_gemm.hpp"
#include "moh/ops/detail/rows_product.hpp"
#include "moh/ops/gemm.hpp"
#include "moh/runtime/thread_pool.hpp"
#include "moh/runtime/workspace.hpp"
#include "moh/tensor.hpp"

namespace moh {

template <class T>
using RowsRef = Eigen::Ref<Matrix<T>, 0, Eigen::OuterStride<>>;
template <class T>
using ConstRowsRef = Eigen::Ref<const Matrix<T>, 0, Eigen::OuterStride<>>;

namespace detail {

// Tiles of the parallel projection: at most 4 x 4 per GEMM so that each tile runs near full GEMM
// speed, at least 128 rows x 256 columns, and never fewer than one tile per core on a ViT-sized
// input. The grid depends on the shape only (dot_tile() below: and on whether there are threads).
inline Index linear_tile(Index n, Index minimum, Index align, Index parts = 4) {
  const Index part = (n + parts - 1) / parts;
  return std::max(minimum, (part + align - 1) / align * align);
}

// Column tiles of a decode call's products (its few rows, or Exec::dot_rows) on a pool of more
// than one thread: 16 per product, of at least 64 columns. No tile width enters an element's
// arithmetic on any route multiply() takes for such rows, so here the grid may follow the pool
// without changing a bit. Sixteen let two threads that stream at different speeds (two cores
// sharing the memory) finish a product within a sixteenth of each other, where with four one
// thread waits for the other. On one thread the four wide tiles stay (sixteen are slower there).
inline Index dot_tile(Index n) { return linear_tile(n, 64, 64, 16); }

/// Calls fn(row0, rows, col0, cols, thread) for each tile of an [rows, cols] output, on `pool`.
/// A last row tile of at most kDotRows rows is merged into the one before: multiply() would take
/// it as dot products, which round differently from the GEMM of the other tiles, and a row's bits
/// would depend on where the tiling puts it (a sequence's prompt or memory of more than kDotRows
/// tokens, alone and at the end of a batch).
/// With `dots` (a decode call's rows, multiply()'s dot_route(), on several threads), dot_tile()'s
/// column tiles.
template <class Fn>
void for_each_linear_tile(Index rows, Index cols, ThreadPool* pool, Fn&& fn, bool dots = false) {
  const Index row_tile = linear_tile(rows, 128, 16);
  const Index col_tile = dots ? dot_tile(cols) : linear_tile(cols, 256, 64);
  Index row_tiles = (rows + row_tile - 1) / row_tile;
  if (row_tiles > 1 && rows - (row_tiles - 1) * row_tile <= kDotRows) --row_tiles;
  const Index col_tiles = (cols + col_tile - 1) / col_tile;
  parallel_for(pool, row_tiles * col_tiles, [&](std::int64_t task, int thread) {
    const Index tile = task / col_tiles, r0 = tile * row_tile, c0 = (task % col_tiles) * col_tile;
    const Index nr = tile + 1 == row_tiles ? rows - r0 : row_tile;
    fn(r0, nr, c0, std::min(col_tile, cols - c0), thread);
  });
}

/// Y[N, out] = X[N, in] B (+ bias[out] when not null) on this thread, where B is a GEMM operand
/// (a weight matrix read transposed: B = W^T) with `out` columns; `dot_rows` as multiply()'s.
template <class T>
void project_rows(const ConstRowsRef<T>& X, const GemmB<T>& B, const T* bias, RowsRef<T> Y,
                  Arena& arena, bool dot_rows = false) {
  multiply<T>(X.data(), X.outerStride(), B, Y.data(), Y.outerStride(), X.rows(), Y.cols(),
              X.cols(), false, arena, dot_rows);
  if (bias != nullptr)
    Y.rowwise() += Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>>(bias, Y.cols());
}

/// The same over linear()'s tiles of Y on exec's threads; operand(c0) is B from output
/// column c0 on.
template <class T, class Operand>
void project_tiles(const ConstRowsRef<T>& X, Operand operand, const T* bias, RowsRef<T> Y,
                   const Exec& exec) {
  for_each_linear_tile(X.rows(), Y.cols(), exec.pool,
                       [&](Index r0, Index nr, Index c0, Index nc, int thread) {
                         project_rows<T>(X.middleRows(r0, nr), operand(c0),
                                         bias ? bias + c0 : nullptr, Y.block(r0, c0, nr, nc),
                                         exec.thread(thread), exec.dot_rows);
                       },
                       dot_route(X.rows(), exec.dot_rows) && exec.threaded());
}

/// Y[N, out] = X[N, in] W[out, in]^T as dot products (rows_product(): each element sums in
/// packets, then reduces), in blocks of rows on exec's threads. For weights of a few rows, such
/// as a router's, which a GEMM tile would fill with padding. An element depends on its row
/// alone, so the split never changes it, and a decode step's few rows, which multiply() also
/// gives to rows_product(), get the same bits.
template <class T>
void project_dots(const ConstRowsRef<T>& X, const ConstRowsRef<T>& W, RowsRef<T> Y,
                  const Exec& exec) {
  eigen_assert(X.cols() == W.cols() && Y.rows() == X.rows() && Y.cols() == W.rows());
  constexpr Index kRows = 64;
  parallel_for(exec.pool, (X.rows() + kRows - 1) / kRows, [&](std::int64_t t, int) {
    const Index r0 = t * kRows, n = std::min(kRows, X.rows() - r0);
    rows_product<T>(X.data() + r0 * X.outerStride(), X.outerStride(), n, W.data(),
                    W.outerStride(), W.rows(), W.cols(), Y.data() + r0 * Y.outerStride(),
                    Y.outerStride(), false);
  });
}

/// Throws unless X [N, in], W [out, in], bias [out] (bias < 0: none) and Y [N, out] agree.
inline void check_linear(Index x_rows, Index x_cols, Index w_rows, Index w_cols, Index bias,
                         Index y_rows, Index y_cols) {
  if (x_cols != w_cols)
    fail("linear: X [N, in] and W [out, in] disagree on in: expected X with ", w_cols,
         " columns, got ", x_cols);
  if (y_rows != x_rows || y_cols != w_rows)
    fail("linear: Y: expected shape [", x_rows, ", ", w_rows, "], got [", y_rows, ", ", y_cols,
         "]");
  if (bias >= 0 && bias != w_rows) fail("linear: bias: expected shape [", w_rows, "], got [", bias, "]");
}

/// Y[N, out] = X[N, in] W[out, in]^T (+ bias) over linear()'s tiles on exec (shapes unchecked).
template <class T>
void project_matrix(const ConstRowsRef<T>& X, const ConstRowsRef<T>& W, const T* bias,
                    RowsRef<T> Y, const Exec& exec) {
  project_tiles<T>(
      X,
      [&](Index c0) {
        return GemmB<T>{W.data() + c0 * W.outerStride(), nullptr, W.outerStride(), true};
      },
      bias, Y, exec);
}

template <class T>
void linear_on(const ConstRowsRef<T>& X, const ConstRowsRef<T>& W, const T* bias, RowsRef<T> Y,
               ThreadPool* pool, Workspace* workspace) {
  const WorkspaceLease lease(workspace, pool, "linear");
  project_matrix<T>(X, W, bias, Y, lease.exec());
}

}  // namespace detail

/// Y[N, out] = X[N, in] W[out, in]^T: all rows at once, split over tiles of Y run on
/// `pool` (null: this thread), with scratch from `workspace` (null: a temporary one). Y may not
/// alias X or W. Shapes are checked (moh::Error).
template <class T>
void linear(const ConstRowsRef<T>& X, const ConstRowsRef<T>& W, RowsRef<T> Y,
            ThreadPool* pool = nullptr, Workspace* workspace = nullptr) {
  detail::check_linear(X.rows(), X.cols(), W.rows(), W.cols(), -1, Y.rows(), Y.cols());
  detail::linear_on<T>(X, W, nullptr, Y, pool, workspace);
}

/// Y[N, out] = X[N, in] W[out, in]^T + bias[out] (see the overload without a bias).
template <class T>
void linear(const ConstRowsRef<T>& X, const ConstRowsRef<T>& W, const Vector<T>& bias,
            RowsRef<T> Y, ThreadPool* pool = nullptr, Workspace* workspace = nullptr) {
  detail::check_linear(X.rows(), X.cols(), W.rows(), W.cols(), bias.size(), Y.rows(), Y.cols());
  detail::linear_on<T>(X, W, bias.data(), Y, pool, workspace);
}

}  // namespace moh
