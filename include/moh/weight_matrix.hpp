// moh::WeightMatrix: a layer's weight matrix, stored in the compute type T or in bfloat16.
//
// bfloat16 storage keeps the upper 16 bits of each float (weights rounded to nearest, ties to
// even), halving the bytes a projection reads: when decoding one token at a time, the
// projections stream every weight once per step and that traffic is the cost. Compute stays in
// T: a block of bfloat16 weights is widened into a per-thread tile (64 K elements at most, so it
// stays in the core's cache) just before the GEMM that uses it. Tiles depend on the shape only,
// so results do not depend on the thread count.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "moh/float16.hpp"
#include "moh/linear.hpp"
#include "moh/scratch.hpp"
#include "moh/tensor.hpp"

namespace moh {

/// How a layer stores its projection weights. Compute is always in the layer's scalar type.
enum class WeightStorage {
  Native,    // in T, exactly as set
  BFloat16,  // rounded to bfloat16 (8-bit mantissa): half the memory of float
};

/// "native" or "bfloat16".
inline const char* weight_storage_name(WeightStorage s) {
  return s == WeightStorage::BFloat16 ? "bfloat16" : "native";
}

template <class T>
class WeightMatrix {
 public:
  /// Widened bfloat16 tiles hold at most this many elements (256 KiB of float).
  static constexpr Index kTileElements = Index(1) << 16;

  WeightMatrix() = default;
  /// A zero [rows, cols] matrix.
  WeightMatrix(Index rows, Index cols, WeightStorage storage)
      : rows_(rows), cols_(cols), storage_(storage) {
    if (storage_ == WeightStorage::Native)
      native_.setZero(rows, cols);
    else
      bf16_.assign(static_cast<std::size_t>(rows * cols), 0);
  }

  Index rows() const { return rows_; }
  Index cols() const { return cols_; }
  /// The bfloat16 bits, row-major [rows, cols] (BFloat16 storage only).
  const std::uint16_t* bf16_data() const { return bf16_.data(); }
  WeightStorage storage() const { return storage_; }
  /// Bytes the weights occupy.
  std::size_t bytes() const {
    return storage_ == WeightStorage::Native ? native_.size() * sizeof(T) : bf16_.size() * 2;
  }

  /// The whole matrix in T (a copy; exact for bfloat16 storage).
  Matrix<T> values() const {
    if (storage_ == WeightStorage::Native) return native_;
    Matrix<T> out(rows_, cols_);
    widen(bf16_.data(), cols_, rows_, cols_, out.data(), cols_);
    return out;
  }

  /// Overwrites rows [first, first + w.rows()) with `w` (rounded for bfloat16 storage). The
  /// caller checks shapes.
  void set_rows(Index first, const ConstRowsRef<T>& w) {
    eigen_assert(w.cols() == cols_ && first >= 0 && first + w.rows() <= rows_);
    if (storage_ == WeightStorage::Native) {
      native_.middleRows(first, w.rows()) = w;
      return;
    }
    for (Index i = 0; i < w.rows(); ++i)
      for (Index j = 0; j < cols_; ++j)
        bf16_[static_cast<std::size_t>((first + i) * cols_ + j)] =
            float_to_bfloat16(static_cast<float>(w(i, j)));
  }
  void set(const ConstRowsRef<T>& w) { set_rows(0, w); }

  /// Block [r0, r0 + n) x [c0, c0 + m) in T: a view of native storage, or the bfloat16 values
  /// widened into the calling thread's weight tile (valid until the next block() call on this
  /// thread). n * m must not exceed kTileElements for bfloat16 storage.
  ConstStridedMap<T> block(Index r0, Index n, Index c0, Index m) const {
    eigen_assert(r0 >= 0 && c0 >= 0 && r0 + n <= rows_ && c0 + m <= cols_);
    if (storage_ == WeightStorage::Native)
      return ConstStridedMap<T>(native_.data() + r0 * cols_ + c0, n, m,
                                Eigen::OuterStride<>(cols_));
    eigen_assert(n * m <= kTileElements);
    T* tile = detail::scratch_matrix<T>(detail::ScratchSlot::WeightTile, n, m).data();
    widen(bf16_.data() + r0 * cols_ + c0, cols_, n, m, tile, m);
    return ConstStridedMap<T>(tile, n, m, Eigen::OuterStride<>(m));
  }

  /// Calls fn(i, j, block) for blocks that cover [r0, r0 + n) x [c0, c0 + m) in row-major
  /// order, block starting at (r0 + i, c0 + j): one view of everything for native storage,
  /// widened tiles of at most kTileElements for bfloat16. The tiling depends on the shape only.
  template <class Fn>
  void for_each_block(Index r0, Index n, Index c0, Index m, Fn&& fn) const {
    if (storage_ == WeightStorage::Native || n * m <= kTileElements) {
      fn(Index(0), Index(0), block(r0, n, c0, m));
      return;
    }
    const Index width = std::min(m, kTileElements);
    const Index height = std::max<Index>(1, kTileElements / width);
    for (Index i = 0; i < n; i += height)
      for (Index j = 0; j < m; j += width) {
        const Index bn = std::min(height, n - i), bm = std::min(width, m - j);
        fn(i, j, block(r0 + i, bn, c0 + j, bm));
      }
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

  Index rows_ = 0, cols_ = 0;
  WeightStorage storage_ = WeightStorage::Native;
  Matrix<T> native_;                // [rows, cols] when Native
  std::vector<std::uint16_t> bf16_;  // [rows, cols] row-major when BFloat16
};

namespace detail {
/// Rows of X (at most kFewRows of them) times bfloat16 rows straight from storage: each weight
/// is widened in registers as it is read, so decoding streams 2 bytes per weight and nothing
/// else. Y[r, j] = sum_k X[r, k] W[j, k] (+ bias[j]), summed in kLanes interleaved partial sums.
constexpr Index kBf16FewRows = 4;
#if defined(__AVX512F__) || defined(__AVX2__)
/// The float case of bf16_rows_product with SIMD: widen 16 (AVX-512) or 8 (AVX2) weights per
/// step with a zero-extend and a shift, then one fused multiply-add per row of X.
inline void bf16_rows_product_simd(const ConstRowsRef<float>& X, const std::uint16_t* W,
                                   Index w_stride, Index count, const float* bias,
                                   RowsRef<float> Y) {
  const Index n = X.rows(), in = X.cols();
#if defined(__AVX512F__)
  constexpr Index kStep = 16;
  using Vec = __m512;
  auto widen = [](const std::uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  };
  auto load = [](const float* p) { return _mm512_loadu_ps(p); };
  auto fma = [](Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); };
  auto zero = [] { return _mm512_setzero_ps(); };
  auto reduce = [](Vec v) { return _mm512_reduce_add_ps(v); };
#else
  constexpr Index kStep = 8;
  using Vec = __m256;
  auto widen = [](const std::uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  };
  auto load = [](const float* p) { return _mm256_loadu_ps(p); };
  auto fma = [](Vec a, Vec b, Vec c) { return _mm256_add_ps(_mm256_mul_ps(a, b), c); };
  auto zero = [] { return _mm256_setzero_ps(); };
  auto reduce = [](Vec v) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, v);
    float s = 0;
    for (float l : lanes) s += l;
    return s;
  };
#endif
  // kGroup weight rows at a time, one accumulator each: independent FMA chains hide latency.
  constexpr Index kGroup = 8;
  const Index whole = in / kStep * kStep;
  for (Index r = 0; r < n; ++r) {
    const float* x = X.row(r).data();
    for (Index j0 = 0; j0 < count; j0 += kGroup) {
      const Index g = std::min(kGroup, count - j0);
      Vec acc[kGroup];
      for (Index jj = 0; jj < kGroup; ++jj) acc[jj] = zero();
      if (g == kGroup) {
        for (Index k = 0; k < whole; k += kStep) {
          const Vec xv = load(x + k);
          for (Index jj = 0; jj < kGroup; ++jj)
            acc[jj] = fma(xv, widen(W + (j0 + jj) * w_stride + k), acc[jj]);
        }
      } else {
        for (Index jj = 0; jj < g; ++jj)
          for (Index k = 0; k < whole; k += kStep)
            acc[jj] = fma(load(x + k), widen(W + (j0 + jj) * w_stride + k), acc[jj]);
      }
      for (Index jj = 0; jj < g; ++jj) {
        const std::uint16_t* w = W + (j0 + jj) * w_stride;
        float sum = reduce(acc[jj]) + (bias ? bias[j0 + jj] : 0.0f);
        for (Index k = whole; k < in; ++k) sum += x[k] * bfloat16_to_float(w[k]);
        Y(r, j0 + jj) = sum;
      }
    }
  }
}
#endif

template <class T>
void bf16_rows_product(const ConstRowsRef<T>& X, const std::uint16_t* W, Index w_stride,
                       Index count, const T* bias, RowsRef<T> Y) {
  constexpr Index kLanes = 16;
  const Index n = X.rows(), in = X.cols(), whole = in / kLanes * kLanes;
  eigen_assert(n <= kBf16FewRows);
#if defined(__AVX512F__) || defined(__AVX2__)
  if constexpr (std::is_same<T, float>::value) {
    bf16_rows_product_simd(X, W, w_stride, count, bias, Y);
    return;
  }
#endif
  for (Index j = 0; j < count; ++j) {
    const std::uint16_t* w = W + j * w_stride;
    T acc[kBf16FewRows][kLanes] = {};
    for (Index k = 0; k < whole; k += kLanes) {
      T wf[kLanes];
      for (Index l = 0; l < kLanes; ++l) wf[l] = static_cast<T>(bfloat16_to_float(w[k + l]));
      for (Index r = 0; r < n; ++r) {
        const T* x = X.row(r).data() + k;
        for (Index l = 0; l < kLanes; ++l) acc[r][l] += x[l] * wf[l];
      }
    }
    for (Index r = 0; r < n; ++r) {
      T sum = bias ? bias[j] : T(0);
      for (Index l = 0; l < kLanes; ++l) sum += acc[r][l];
      for (Index k = whole; k < in; ++k) sum += X(r, k) * static_cast<T>(bfloat16_to_float(w[k]));
      Y(r, j) = sum;
    }
  }
}
}  // namespace detail

/// Y[N, count] = X[N, in] W[first : first + count, :]^T (+ bias[count]) on this thread.
template <class T>
void linear(const ConstRowsRef<T>& X, const WeightMatrix<T>& W, Index first, Index count,
            const T* bias, RowsRef<T> Y) {
  eigen_assert(X.cols() == W.cols() && Y.rows() == X.rows() && Y.cols() == count);
  if (W.storage() == WeightStorage::BFloat16 && X.rows() <= detail::kBf16FewRows) {
    detail::bf16_rows_product<T>(X, W.bf16_data() + first * W.cols(), W.cols(), count, bias, Y);
    return;
  }
  W.for_each_block(first, count, 0, W.cols(), [&](Index i, Index j, const ConstStridedMap<T>& w) {
    auto y = Y.middleCols(i, w.rows());
    if (j == 0) {
      linear<T>(X.middleCols(j, w.cols()), w, bias ? bias + i : nullptr, y);
    } else {
      y.noalias() += X.middleCols(j, w.cols()) * w.transpose();
    }
  });
}

/// The same split over linear()'s fixed tiles of Y and run on `pool`.
template <class T>
void linear(const ConstRowsRef<T>& X, const WeightMatrix<T>& W, Index first, Index count,
            const T* bias, RowsRef<T> Y, ThreadPool* pool) {
  detail::for_each_linear_tile(X.rows(), count, pool, [&](Index r0, Index nr, Index c0, Index nc) {
    linear<T>(X.middleRows(r0, nr), W, first + c0, nc, bias ? bias + c0 : nullptr,
              Y.block(r0, c0, nr, nc));
  });
}

namespace detail {
/// C[N, m] (+)= A[N, n] W[r0 : r0 + n, c0 : c0 + m] on this thread (`accumulate`: add to C).
template <class T, class Product>
void multiply_block(const ConstRowsRef<T>& A, const WeightMatrix<T>& W, Index r0, Index n, Index c0,
                    Index m, RowsRef<T> C, bool accumulate, Product&& product) {
  W.for_each_block(r0, n, c0, m, [&](Index i, Index j, const ConstStridedMap<T>& w) {
    product(A.middleCols(i, w.rows()), w, C.middleCols(j, w.cols()), accumulate || i > 0);
  });
}
}  // namespace detail

/// Y[N, out] = X[N, in] W^T (+ bias) on `pool`.
template <class T>
void linear(const ConstRowsRef<T>& X, const WeightMatrix<T>& W, const T* bias, RowsRef<T> Y,
            ThreadPool* pool) {
  linear<T>(X, W, 0, W.rows(), bias, Y, pool);
}

}  // namespace moh
