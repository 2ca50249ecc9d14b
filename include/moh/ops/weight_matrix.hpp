// moh::WeightMatrix: a layer's weight matrix, stored in the compute type T or in bfloat16.
//
// bfloat16 storage keeps the upper 16 bits of each float (weights rounded to nearest, ties to
// even), halving the bytes a projection reads: when decoding one token at a time, the
// projections stream every weight once per step and that traffic is the cost. Compute stays in
// T: the GEMM widens bfloat16 weights while it packs them, and the unpacked products (a decode
// step, a few tokens routed to one expert) widen them in registers as they read them
// (ops/gemm.hpp). None of this depends on the thread count.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "moh/float16.hpp"
#include "moh/ops/detail/packed_gemm.hpp"
#include "moh/ops/linear.hpp"
#include "moh/ops/weight_storage.hpp"
#include "moh/runtime/large_buffer.hpp"
#include "moh/tensor.hpp"

namespace moh {

/// A weight matrix W[rows, cols]. By default it is stored row-major. With a `panel` width it is
/// stored in column panels: columns [j0, j0 + w) (w = panel, less for the last) are one
/// row-major [rows, w] block, and the blocks follow one another. A routed layer that multiplies
/// one column panel of many experts' rows at a time then reads each expert's slice as one
/// contiguous run, which the hardware prefetcher streams, rather than rows a page apart.
/// WeightStorage::NativePacked adds a copy of W in gemm()'s panels of B = W^T (see GemmB), used
/// by transposed operands.
template <class T>
class WeightMatrix {
 public:
  WeightMatrix() = default;
  /// A zero [rows, cols] matrix, row-major, or in column panels of `panel` columns when > 0.
  WeightMatrix(Index rows, Index cols, WeightStorage storage, Index panel = 0)
      : rows_(rows), cols_(cols), panel_(panel > 0 ? std::min(panel, cols) : cols),
        storage_(storage) {
    detail::require(rows >= 0 && cols >= 0 && panel >= 0, "WeightMatrix: sizes must be >= 0: ",
                    "expected rows, cols, panel >= 0, got ", rows, ", ", cols, ", ", panel);
    // Zeroed, in huge pages where the system allows (a decode step streams all of it).
    if (storage_ != WeightStorage::BFloat16)
      native_ = LargeBuffer<T>(static_cast<std::size_t>(rows * cols));
    else
      bf16_ = LargeBuffer<std::uint16_t>(static_cast<std::size_t>(rows * cols));
    if (storage_ == WeightStorage::NativePacked)  // zeroed, with the tail GemmB::packed needs
      packed_ = LargeBuffer<T>(static_cast<std::size_t>(packed_rows() * cols + nr_));
  }

  Index rows() const { return rows_; }
  Index cols() const { return cols_; }
  /// Columns per panel of the storage (cols when row-major).
  Index panel() const { return panel_; }
  WeightStorage storage() const { return storage_; }
  /// Bytes the weights occupy.
  std::size_t bytes() const {
    return (native_.size() + packed_.size()) * sizeof(T) + bf16_.size() * 2;
  }

  /// The whole matrix in T, row-major (a copy; exact for bfloat16 storage).
  Matrix<T> values() const {
    Matrix<T> out(rows_, cols_);
    for (Index j0 = 0; j0 < cols_; j0 += panel_) {
      const Index w = width(j0);
      if (storage_ != WeightStorage::BFloat16)
        out.middleCols(j0, w) = Eigen::Map<const Matrix<T>>(native_.data() + rows_ * j0, rows_, w);
      else
        widen(bf16_.data() + rows_ * j0, w, rows_, w, out.data() + j0, cols_);
    }
    return out;
  }

  /// Overwrites rows [first, first + w.rows()) with `w` (rounded for bfloat16 storage).
  void set_rows(Index first, const ConstRowsRef<T>& w) {
    if (w.cols() != cols_ || first < 0 || first + w.rows() > rows_)
      detail::fail("WeightMatrix::set_rows: expected at most ", rows_ - std::max<Index>(first, 0),
                   " rows of ", cols_, " columns from row ", first, " of a [", rows_, ", ", cols_,
                   "] matrix, got [", w.rows(), ", ", w.cols(), "]");
    if (packed_.size() != 0) {
      const Index nr = nr_;
      for (Index i = 0; i < w.rows(); ++i) {
        const Index r = first + i;
        T* p = packed_.data() + (r / nr) * cols_ * nr + r % nr;
        for (Index j = 0; j < cols_; ++j) p[j * nr] = w(i, j);
      }
    }
    for (Index j0 = 0; j0 < cols_; j0 += panel_) {
      const Index pw = width(j0), at = rows_ * j0 + first * pw;
      if (storage_ != WeightStorage::BFloat16) {
        Eigen::Map<Matrix<T>>(native_.data() + at, w.rows(), pw) = w.middleCols(j0, pw);
        continue;
      }
      for (Index i = 0; i < w.rows(); ++i)
        for (Index j = 0; j < pw; ++j)
          bf16_[static_cast<std::size_t>(at + i * pw + j)] =
              float_to_bfloat16(static_cast<float>(w(i, j0 + j)));
    }
  }
  /// Overwrites the whole matrix with `w` [rows, cols].
  void set(const ConstRowsRef<T>& w) {
    if (w.rows() != rows_ || w.cols() != cols_)
      detail::fail("WeightMatrix::set: expected shape [", rows_, ", ", cols_, "], got [",
                   w.rows(), ", ", w.cols(), "]");
    set_rows(0, w);
  }

  /// This matrix from element (r0, c0) on as the B operand of detail::gemm(): B = W^T
  /// (B(k, n) = W(r0 + n, c0 + k)) when `transposed`, else B(k, n) = W(r0 + k, c0 + n). An
  /// untransposed operand reaches to W's last row, so that a product over one expert's rows
  /// prefetches the next expert's. With column panels, an untransposed operand's columns must
  /// stay in c0's panel; a transposed one runs across the panels (which must then all be whole).
  detail::GemmB<T> operand(Index r0, Index c0, bool transposed) const {
    eigen_assert(r0 >= 0 && c0 >= 0 && r0 <= rows_ && c0 <= cols_);
    detail::require(panel_ == cols_ || !transposed || cols_ % panel_ == 0,
                    "WeightMatrix: a transposed operand needs whole column panels: expected a "
                    "panel width that divides ", cols_, ", got ", panel_);
    const Index j0 = panel_ > 0 ? std::min(c0, cols_ - 1) / panel_ * panel_ : 0;
    const Index w = width(j0), at = rows_ * j0 + r0 * w + (c0 - j0);
    detail::GemmB<T> b;
    b.ld = w;
    b.transposed = transposed;
    b.reach = transposed ? 0 : rows_ - r0;
    if (transposed && panel_ < cols_) {
      b.panel_depth = panel_;
      b.panel_stride = rows_ * panel_;
      b.panel_k = c0 - j0;
    }
    if (storage_ != WeightStorage::BFloat16)
      b.values = native_.data() + at;
    else
      b.bf16 = bf16_.data() + at;
    if (transposed && packed_.size() != 0) {
      b.packed = packed_.data();
      b.packed_nr = nr_;
      b.packed_cols = cols_;
      b.packed_row = r0;
      b.packed_col = c0;
    }
    return b;
  }

 private:
  static void widen(const std::uint16_t* src, Index src_stride, Index n, Index m, T* dst,
                    Index dst_stride) {
    for (Index i = 0; i < n; ++i) {
      const std::uint16_t* s = src + i * src_stride;
      T* o = dst + i * dst_stride;
#if defined(__GNUC__)
      if constexpr (std::is_same<T, float>::value) {
        // A float's bits are the bfloat16's bits shifted up: one integer shift per element, which
        // the compiler vectorises (a may_alias type makes writing float storage as integers legal).
        typedef std::uint32_t bits32 __attribute__((may_alias));
        bits32* w = reinterpret_cast<bits32*>(o);
        for (Index j = 0; j < m; ++j) w[j] = static_cast<std::uint32_t>(s[j]) << 16;
        continue;
      }
#endif
      for (Index j = 0; j < m; ++j) o[j] = static_cast<T>(bfloat16_to_float(s[j]));
    }
  }

  // Columns of the panel that starts at column j0.
  Index width(Index j0) const { return std::min(panel_, cols_ - j0); }
  // Rows of the packed copy: whole panels of nr_.
  Index packed_rows() const { return (rows_ + nr_ - 1) / nr_ * nr_; }

  Index rows_ = 0, cols_ = 0, panel_ = 0;
  // Rows per panel of the packed copy: gemm()'s NR where the matrix was built. gemm() reads the
  // copy only if that is its own NR (a program whose files target different vector widths packs
  // B on each call instead).
  Index nr_ = detail::GemmShape<T>::NR;
  WeightStorage storage_ = WeightStorage::Native;
  LargeBuffer<T> native_;              // rows * cols unless BFloat16, in the layout above
  LargeBuffer<T> packed_;              // packed_rows() * cols + nr_ when NativePacked
  LargeBuffer<std::uint16_t> bf16_;    // rows * cols when BFloat16, in the layout above
};

namespace detail {

/// Y[N, count] = X[N, in] W[first : first + count, :]^T (+ bias[count]) over linear()'s
/// tiles of Y on exec's threads, read straight from W's storage (bfloat16 is widened as it is
/// packed or loaded). Shapes are the caller's to check.
template <class T>
void project(const ConstRowsRef<T>& X, const WeightMatrix<T>& W, Index first, const T* bias,
             RowsRef<T> Y, const Exec& exec) {
  eigen_assert(X.cols() == W.cols() && Y.rows() == X.rows() && first + Y.cols() <= W.rows());
  project_tiles<T>(X, [&](Index c0) { return W.operand(first + c0, 0, true); }, bias, Y, exec);
}

}  // namespace detail

/// Y[N, out] = X[N, in] W^T for weights stored in T or bfloat16 (see linear() for Matrix W).
template <class T>
void linear(const ConstRowsRef<T>& X, const WeightMatrix<T>& W, RowsRef<T> Y,
            ThreadPool* pool = nullptr, Workspace* workspace = nullptr) {
  detail::check_linear(X.rows(), X.cols(), W.rows(), W.cols(), -1, Y.rows(), Y.cols());
  const detail::WorkspaceLease lease(workspace, pool, "linear");
  detail::project<T>(X, W, 0, nullptr, Y, lease.exec());
}

/// Y[N, out] = X[N, in] W^T + bias[out] for weights stored in T or bfloat16.
template <class T>
void linear(const ConstRowsRef<T>& X, const WeightMatrix<T>& W, const Vector<T>& bias,
            RowsRef<T> Y, ThreadPool* pool = nullptr, Workspace* workspace = nullptr) {
  detail::check_linear(X.rows(), X.cols(), W.rows(), W.cols(), bias.size(), Y.rows(), Y.cols());
  const detail::WorkspaceLease lease(workspace, pool, "linear");
  detail::project<T>(X, W, 0, bias.data(), Y, lease.exec());
}

}  // namespace moh
