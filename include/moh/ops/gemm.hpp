// The products of the projections: C[M, N] (+)= A[M, K] B, where B is read from a weight matrix
// stored in T or in bfloat16, either as [K, N] or as the transpose of a [N, K] matrix
// (torch.nn.Linear's layout, so Y = X W^T needs no copy of W).
//
// multiply() runs each product on one of the kernels of ops/detail/packed_gemm.hpp (gemm(),
// small_product(), few_rows_product()) or on rows_product() (ops/detail/rows_product.hpp), by the
// route multiply_route() gives for the shape.
//
// In gemm() and small_product(), every element of C is one chain of multiply-adds (fused where
// the target has FMA) over k = 0 .. K-1 in order, starting from C (accumulate) or zero, whatever
// the blocking, the edge handling or the thread that runs it: a row of C does not depend on which
// other rows or columns are computed in the same call, and the two give the same bits.
// rows_product() (up to kDotRows rows against W^T, or every row of a decode call: multiply()'s
// dot_rows; any rows for the few outputs of a router, project_dots() in linear.hpp) sums in
// packets and then reduces, so its bits differ; multiply() picks it by shape and by that flag
// alone, so results still never depend on the thread count.
#pragma once

#include "moh/ops/detail/packed_gemm.hpp"
#include "moh/ops/detail/rows_product.hpp"
#include "moh/tensor.hpp"

namespace moh {
namespace detail {

/// Rows of A that multiply() gives to rows_product() against a transposed operand by count (a
/// decode call gives it all its rows: dot_rows): a decode step of up to 8 sequences reads the
/// weights in place rather than packing them every step.
constexpr Index kDotRows = 8;

/// Whether multiply() takes M rows against a transposed operand as dot products (rows_product()).
inline bool dot_route(Index M, bool dot_rows) { return M <= kDotRows || dot_rows; }

/// Rows of A below which multiply() runs a [K, N] operand unpacked: packing B would cost about
/// as much as the product (a few tokens routed to one head or expert).
constexpr Index kUnpackedRows = 32;

/// The kernel that multiply() runs a product on.
enum class ProductRoute {
  Rows,     // rows_product(): dot products against a transposed B, read once, unpacked
  FewRows,  // few_rows_product(): a [K, N] B streamed row after row, for at most kFewRows rows
  Small,    // small_product(): a [K, N] B unpacked in register tiles, for fewer than kUnpackedRows
  Packed,   // gemm(): B packed into panels (or read in the panels it is stored in)
};

/// The route multiply() takes for C[M, N] (+)= A[M, K] B in T, B `transposed` or [K, N],
/// `dot_rows` as there: multiply() itself asks it, so this is the route that runs. K and the
/// storage type of B do not enter it.
template <class T>
inline ProductRoute multiply_route(Index M, Index N, bool transposed, bool dot_rows) {
  constexpr Index L = GemmShape<T>::L;
  if (transposed && dot_route(M, dot_rows)) return ProductRoute::Rows;
  const bool whole_packets = !transposed && L > 1 && N % L == 0;
  if (whole_packets && M <= kFewRows) return ProductRoute::FewRows;
  if (whole_packets && M < kUnpackedRows) return ProductRoute::Small;
  return ProductRoute::Packed;
}

/// C[M, N] (+)= A[M, K] B on this thread, by the cheapest route for the shape:
///   - at most kDotRows rows against a transposed B, or any rows with `dot_rows`: rows_product()
///     (a decode step streams the weights once, unpacked);
///   - at most kFewRows rows against a [K, N] B of whole packets: few_rows_product();
///   - fewer than kUnpackedRows rows against a [K, N] B of whole packets: small_product();
///   - else gemm().
/// The last three compute the same chain per element, so their results are bitwise equal.
/// rows_product() rounds differently, so a row's bits would depend on how many rows share the
/// call; `dot_rows` (Exec::dot_rows: a decode step's, a cross-attention query's or a short
/// memory's products, at most kDotRows tokens per sequence) keeps every transposed product on
/// rows_product(), whose rows do not depend on each other, so that a batch of sequences gives
/// each sequence's bits alone whatever the batch size.
template <class T>
void multiply(const T* A, Index lda, const GemmB<T>& B, T* C, Index ldc, Index M, Index N,
              Index K, bool accumulate, Arena& arena, bool dot_rows = false) {
  using S = GemmShape<T>;
  switch (multiply_route<T>(M, N, B.transposed, dot_rows)) {
    case ProductRoute::Rows:
      // One run of the storage (a head's panel) at a time; once when K = 0 (C = 0 or kept).
      B.for_each_run(K, [&](Index k, Index n, const GemmB<T>& s) {
        if (s.values)
          rows_product<T>(A + k, lda, M, s.values, s.ld, N, n, C, ldc, accumulate || k > 0);
        else
          rows_product<T>(A + k, lda, M, s.bf16, s.ld, N, n, C, ldc, accumulate || k > 0,
                          &arena);
      });
      return;
    case ProductRoute::FewRows:
      if (B.values)
        few_rows_product<T>(A, lda, B.values, B.ld, M, N, K, C, ldc, accumulate);
      else
        few_rows_product<T>(A, lda, B.bf16, B.ld, M, N, K, C, ldc, accumulate);
      return;
    case ProductRoute::Small:
      if (B.values)
        small_product<T, S::MR, S::NP, true>(A, lda, B.values, B.ld, M, N, K, C, ldc,
                                             accumulate, B.reach);
      else
        small_product<T, S::MR, S::NP, true>(A, lda, B.bf16, B.ld, M, N, K, C, ldc, accumulate,
                                             B.reach);
      return;
    case ProductRoute::Packed:
      break;
  }
  gemm<T>(A, lda, B, C, ldc, M, N, K, accumulate, arena);
}

}  // namespace detail
}  // namespace moh
