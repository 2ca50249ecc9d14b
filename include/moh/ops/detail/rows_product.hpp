// The decode products: C[n, count] (+)= A[n, K] W[count, K]^T as dot products, straight from
// W's storage (T or bfloat16) without packing. rows_product() is the entry point and
// rows_product_route() its dispatch; the kernels below it split W into parts read side by side,
// chunks that stay in L2, or tiles of rows. Each element sums in packets and then reduces, so its
// bits differ from those of gemm() (ops/detail/packed_gemm.hpp, whose packet loads these share),
// but depend on no other row of A or W.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "moh/ops/detail/packed_gemm.hpp"
#include "moh/runtime/tuning.hpp"
#include "moh/runtime/workspace.hpp"
#include "moh/tensor.hpp"

#include "moh/ops/detail/unroll_begin.hpp"

namespace moh {
namespace detail {

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"
#endif

/// Rows of W up to this length are short (one head's slice of W_o): rows_product() gives each
/// of them one chain, reading up to kShortStreams parts of the rows side by side (fewer by
/// KernelTuning::weight_streams); longer rows (a projection's, a router's) get row_chains()
/// chains each.
constexpr Index kShortRow = 256;

/// Partial sums per long row of W in rows_product() (but see row_chains()), and the rows of W
/// that two rows of A take at a time (3 x 2 x 4 accumulators in AVX-512's 32 registers; 1 x 2 x
/// 4 in 16).
///
/// One row of A (a decode step of one sequence) reads KernelTuning::weight_streams rows of W side
/// by side, the fastest pattern depending on the core (runtime/tuning.hpp); two rows of A or more
/// read chunks of kLongRowTile parts (rows_product_long_chunks()).
constexpr int kRowChains = 4;
static_assert((kRowChains & (kRowChains - 1)) == 0, "the chains are added pairwise");
#if defined(EIGEN_VECTORIZE_AVX512)
constexpr int kLongRowTile = 3;
constexpr int kMaxStreams = KernelTuning::kMaxWeightStreams;  // 24 accumulators
#else
constexpr int kLongRowTile = 1;
constexpr int kMaxStreams = 3;  // 12 accumulators of 16 registers
#endif

/// Calls fn(r, std::integral_constant<int, RA>{}) for rows r of A, RA = 2 at a time, then RA = 1
/// for the last row of an odd n: the rows of rows_product()'s kernels that share each load of W.
template <class Fn>
EIGEN_ALWAYS_INLINE void for_row_pairs(Index n, Fn&& fn) {
  Index r = 0;
  for (; r + 2 <= n; r += 2) fn(r, std::integral_constant<int, 2>{});
  if (r < n) fn(r, std::integral_constant<int, 1>{});
}

/// Reads `count` items (rows of W, keys) in G parts side by side: part g is items [g part,
/// (g + 1) part) for part = count / (G kStep) kStep, and step(i, part) is called for i = 0,
/// kStep, 2 kStep, ... below part, to take items i .. i + kStep - 1 of every part, so that each
/// part is read from its first item to its last (one stream in memory per part; G neighbouring
/// items per step instead would start G new streams every step). Returns the items taken, G
/// part; the rest, fewer than G kStep, are the caller's. Kernels mark their steps
/// MOH_DETAIL_INLINE_LAMBDA, so that each step is compiled into the loop.
template <int G, Index kStep = 1, class Step>
EIGEN_ALWAYS_INLINE Index for_parts(Index count, Step&& step) {
  static_assert(G >= 1 && kStep >= 1, "at least one part of whole steps");
  const Index part = count / (G * kStep) * kStep;
  for (Index i = 0; i < part; i += kStep) step(i, part);
  return G * part;
}

/// Calls fn(std::integral_constant<int, G>{}) for G = streams if 2 <= streams <= kMost (each G
/// compiled, from kMost down); nothing otherwise.
template <int kMost, class Fn>
EIGEN_ALWAYS_INLINE void with_streams([[maybe_unused]] int streams, [[maybe_unused]] Fn&& fn) {
  if constexpr (kMost >= 2) {
    if (streams == kMost)
      fn(std::integral_constant<int, kMost>{});
    else
      with_streams<kMost - 1>(streams, fn);
  }
}

/// Whether rows_product_long() widens bfloat16 rows of W two packets per load (float; AVX-512,
/// or AVX2): one full-width load of 2 L bfloat16 holds, in each 32-bit lane i, the elements 2i
/// (low half) and 2i + 1 (high half), so one shift gives the even elements as floats and one
/// mask the odd, against a widening shuffle and a shift per packet. Multiplied by the rows of A
/// laid out the same way (even_odd_rows()), lane i of the even accumulator of chains (c, c + 1)
/// holds what lane 2i of chain c (i < L / 2) or lane 2i - L of chain c + 1 holds in the plain
/// loop, product for product in the same order; even_odd_chains() puts the lanes back before
/// anything is added, so every element keeps its bits. It is faster where widening bounds the
/// plain loop (AVX2) or the rows come from L2, and no slower where memory bounds the step.
/// Compiled where Eigen vectorizes with AVX2 or AVX-512 (EIGEN_VECTORIZE_AVX2, which AVX-512
/// builds define too): the helpers take Eigen's packets, which are plain floats when it does not.
template <class T, class Src>
constexpr bool even_odd_widening() {
  if constexpr (!std::is_same<T, float>::value || !std::is_same<Src, std::uint16_t>::value ||
                kRowChains % 2 != 0) {
    return false;
  } else {
#if defined(__AVX512F__)
    if constexpr (std::is_same<GemmPacket<T>, __m512>::value) return true;
#endif
#if defined(__AVX2__)
    if constexpr (std::is_same<GemmPacket<T>, __m256>::value) return true;
#endif
    return false;
  }
}

/// Partial sums per long row of W from Src into T: kRowChains, but 2 for bfloat16 rows into
/// float where AVX-512 is off, so that AVX2's 16 registers hold the accumulators of 6 rows read
/// side by side instead of 3 (even_odd_chains(): one even and one odd accumulator per row).
/// More rows in flight read memory faster.
/// Every product of such rows (one row of A or more, with or without the even/odd layout) has
/// the same chains, so a row's bits still depend on no other row.
template <class T, class Src>
constexpr int row_chains() {
#if defined(EIGEN_VECTORIZE_AVX512)
  return kRowChains;
#else
  return even_odd_widening<T, Src>() ? 2 : kRowChains;
#endif
}
/// Rows of W that one row of A reads side by side, at most: as many as kMaxStreams rows of
/// kRowChains accumulators take.
template <class T, class Src>
constexpr int max_streams() {
  return kMaxStreams * kRowChains / row_chains<T, Src>();
}
/// Parts of W per chunk of rows_product_long_chunks() when more rows of A take them two at a
/// time (kLongRowTile, likewise; 1: one row of W at a time, no chunks).
template <class T, class Src>
constexpr int long_row_tile() {
  return kLongRowTile * kRowChains / row_chains<T, Src>();
}

#if defined(EIGEN_VECTORIZE_AVX2)
#if defined(__AVX512F__)
/// The 32 bfloat16 at p as floats: e holds the even elements (lane i: element 2i), o the odd.
EIGEN_ALWAYS_INLINE void widen_even_odd(const std::uint16_t* p, __m512& e, __m512& o) {
  const __m512i w = _mm512_loadu_si512(p);
  e = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  o = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
/// The even and the odd elements of the 32 floats in a0, a1 (elements 0-15, 16-31).
EIGEN_ALWAYS_INLINE void split_even_odd(__m512 a0, __m512 a1, __m512& e, __m512& o) {
  e = _mm512_permutex2var_ps(
      a0, _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0), a1);
  o = _mm512_permutex2var_ps(
      a0, _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1), a1);
}
/// split_even_odd() undone: elements 0-15 into a0, 16-31 into a1.
EIGEN_ALWAYS_INLINE void merge_even_odd(__m512 e, __m512 o, __m512& a0, __m512& a1) {
  a0 = _mm512_permutex2var_ps(
      e, _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0), o);
  a1 = _mm512_permutex2var_ps(
      e, _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8), o);
}
#endif
#if defined(__AVX2__)
/// The 16 bfloat16 at p as floats: e holds the even elements (lane i: element 2i), o the odd.
EIGEN_ALWAYS_INLINE void widen_even_odd(const std::uint16_t* p, __m256& e, __m256& o) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  e = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  o = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
/// The even and the odd elements of the 16 floats in a0, a1 (elements 0-7, 8-15): a shuffle
/// within each 128-bit half takes (0, 2 of a0, 0, 2 of a1 | 4, 6 of a0, 4, 6 of a1), and a swap
/// of the two middle 64-bit quarters puts them in order (the odd ones likewise from 1, 3).
EIGEN_ALWAYS_INLINE void split_even_odd(__m256 a0, __m256 a1, __m256& e, __m256& o) {
  const auto in_order = [](__m256 x) {
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(x), _MM_SHUFFLE(3, 1, 2, 0)));
  };
  e = in_order(_mm256_shuffle_ps(a0, a1, _MM_SHUFFLE(2, 0, 2, 0)));
  o = in_order(_mm256_shuffle_ps(a0, a1, _MM_SHUFFLE(3, 1, 3, 1)));
}
/// split_even_odd() undone: elements 0-7 into a0, 8-15 into a1. The interleaves within each
/// 128-bit half give (e0 o0 e1 o1 | e4 o4 e5 o5) and (e2 o2 e3 o3 | e6 o6 e7 o7); their low
/// halves are elements 0-7, their high halves 8-15.
EIGEN_ALWAYS_INLINE void merge_even_odd(__m256 e, __m256 o, __m256& a0, __m256& a1) {
  const __m256 lo = _mm256_unpacklo_ps(e, o), hi = _mm256_unpackhi_ps(e, o);
  a0 = _mm256_permute2f128_ps(lo, hi, 0x20);
  a1 = _mm256_permute2f128_ps(lo, hi, 0x31);
}
#endif

/// Elements of a row of A that the even/odd loop reads: its whole steps of row_chains() packets.
inline Index even_odd_length(Index K) {
  constexpr Index kStep = row_chains<float, std::uint16_t>() *
                          Eigen::internal::unpacket_traits<GemmPacket<float>>::size;
  return K / kStep * kStep;
}

/// Ap[r, :] = A[r, :] laid out for the even/odd loop: each block of 2 L of the row's first
/// even_odd_length(K) elements as its L even elements, then its L odd (rows at that length).
inline void even_odd_rows(const float* A, Index lda, Index n, Index K, float* Ap) {
  using P = GemmPacket<float>;
  constexpr Index L = Eigen::internal::unpacket_traits<P>::size;
  const Index whole = even_odd_length(K);
  for (Index r = 0; r < n; ++r)
    for (Index k = 0; k < whole; k += 2 * L) {
      P e, o;
      split_even_odd(Eigen::internal::ploadu<P>(A + r * lda + k),
                     Eigen::internal::ploadu<P>(A + r * lda + k + L), e, o);
      Eigen::internal::pstoreu(Ap + r * whole + k, e);
      Eigen::internal::pstoreu(Ap + r * whole + k + L, o);
    }
}

/// The even/odd products of W's rows j < G against A's rows r < RA (laid out by even_odd_rows(),
/// rows at lda) over k < `whole` (a multiple of L C), put back into the plain loop's C chains
/// acc[g][r][c] (which start at zero): lane t of chain 2q is the even accumulator's lane t / 2
/// (t even) or the odd one's (t odd), chain 2q + 1 the same from their lanes L / 2 and up.
template <int G, int RA, int C, Index kAhead = 0>
EIGEN_ALWAYS_INLINE void even_odd_chains(const float* Ap, Index lda, const std::uint16_t* W,
                                         Index ldw, Index whole,
                                         GemmPacket<float> (&acc)[G][RA][C]) {
  using P = GemmPacket<float>;
  constexpr Index L = Eigen::internal::unpacket_traits<P>::size;
  constexpr int kPairs = C / 2;
  P ev[G][RA][kPairs], od[G][RA][kPairs];
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < RA; ++r)
      for (int q = 0; q < kPairs; ++q) ev[g][r][q] = od[g][r][q] = Eigen::internal::pset1<P>(0.f);
  for (Index k = 0; k < whole; k += L * C) {
    if constexpr (kAhead > 0) ask_rows_ahead<std::uint16_t, G, L * C, kAhead>(W, ldw, k);
    for (int q = 0; q < kPairs; ++q) {
      P ae[RA], ao[RA];
      for (int r = 0; r < RA; ++r) {
        ae[r] = Eigen::internal::ploadu<P>(Ap + r * lda + k + 2 * L * q);
        ao[r] = Eigen::internal::ploadu<P>(Ap + r * lda + k + 2 * L * q + L);
        if constexpr (G > 1 && RA > 1) {  // held for their G multiply-adds each
          MOH_DETAIL_IN_REGISTER(ae[r]);
          MOH_DETAIL_IN_REGISTER(ao[r]);
        }
      }
      for (int g = 0; g < G; ++g) {
        P we, wo;
        widen_even_odd(W + g * ldw + k + 2 * L * q, we, wo);
        for (int r = 0; r < RA; ++r) {
          ev[g][r][q] = Eigen::internal::pmadd(ae[r], we, ev[g][r][q]);
          od[g][r][q] = Eigen::internal::pmadd(ao[r], wo, od[g][r][q]);
        }
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < RA; ++r)
      for (int q = 0; q < kPairs; ++q)
        merge_even_odd(ev[g][r][q], od[g][r][q], acc[g][r][2 * q], acc[g][r][2 * q + 1]);
}
#endif

/// out (+)= the reduced packet-wise sums `acc` of a . w plus the products of elements whole to
/// K - 1 added one by one: the end of every dot product of rows_product().
template <class T, class Src>
EIGEN_ALWAYS_INLINE void finish_dot(const GemmPacket<T>& acc, const T* a, const Src* w,
                                    Index whole, Index K, T& out, bool accumulate) {
  T sum = Eigen::internal::predux(acc);
  for (Index i = whole; i < K; ++i) sum += a[i] * load_scalar<T>(w + i);
  out = accumulate ? out + sum : sum;
}

/// finish_dot() of the C chains of a dot product (a[0 .. C), overwritten): added pairwise
/// (a[i] + a[i + C / 2] for i < C / 2; then the same over the first half; so on), then reduced.
template <class T, class Src, int C>
EIGEN_ALWAYS_INLINE void finish_chains(GemmPacket<T> (&a)[C], const T* A, const Src* w,
                                       Index whole, Index K, T& out, bool accumulate) {
  static_assert((C & (C - 1)) == 0, "the chains are added pairwise");
  for (int half = C / 2; half > 0; half /= 2)
    for (int c = 0; c < half; ++c) a[c] = Eigen::internal::padd(a[c], a[c + half]);
  finish_dot<T>(a[0], A, w, whole, K, out, accumulate);
}

/// C[r, jj] (+)= A[r, :] . W[jj, :] for r < RA and jj < G, W's rows long (T or bfloat16,
/// widened in registers): packet p of a row goes to chain p % row_chains<T, Src>(),
/// the chains are added pairwise (0 + 2, 1 + 3; then 0 + 1; so on for more chains), reduced,
/// and the last K % L products are added one by one. The G rows of W share each load of A and
/// the RA rows of A each load of W; the bits of an element depend on neither G nor RA.
/// kEvenOdd (even_odd_widening() only): the whole steps of the chains' packets come from
/// even_odd_chains() over `Ap`, A's rows laid out by even_odd_rows() (rows at ldap): the same
/// bits. C[r, jj] is at C[r * ldc + jj * c_step] (c_step: see rows_product_long_parts()).
/// kAhead > 0: the steps also ask for W's rows kAhead elements ahead (ask_rows_ahead(); a hint).
/// With G and RA both above 1, each packet of A and W that the plain loop loads is held in a
/// register (MOH_DETAIL_IN_REGISTER) for its G or RA multiply-adds: GCC otherwise takes W's
/// packet from memory again in each (and, with W's held alone, A's), five loads for six
/// multiply-adds becoming eight or nine. even_odd_chains() holds A's packets likewise.
template <class T, int G, int RA, class Src, bool kEvenOdd = false, Index kAhead = 0>
EIGEN_ALWAYS_INLINE void rows_product_long(const T* A, Index lda, const Src* W, Index ldw, Index K,
                                           T* C, Index ldc, bool accumulate,
                                           [[maybe_unused]] const T* Ap,
                                           [[maybe_unused]] Index ldap, Index c_step = 1) {
  using P = GemmPacket<T>;
  constexpr Index L = Eigen::internal::unpacket_traits<P>::size;
  constexpr int kChains = row_chains<T, Src>();
  constexpr Index kStep = kChains * L;
  const Index whole = K / L * L;
  P acc[G][RA][kChains];
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < RA; ++r)
      for (int c = 0; c < kChains; ++c) acc[g][r][c] = Eigen::internal::pset1<P>(T(0));
  const auto chain = [&](Index k, int c) {
    P av[RA];
    for (int r = 0; r < RA; ++r) {
      av[r] = Eigen::internal::ploadu<P>(A + r * lda + k);
      if constexpr (RA > 1 && G > 1) MOH_DETAIL_IN_REGISTER(av[r]);
    }
    for (int g = 0; g < G; ++g) {
      P wv = load_packet<T>(W + g * ldw + k);
      if constexpr (RA > 1 && G > 1) MOH_DETAIL_IN_REGISTER(wv);
      for (int r = 0; r < RA; ++r) acc[g][r][c] = Eigen::internal::pmadd(av[r], wv, acc[g][r][c]);
    }
  };
  Index k = 0;
#if defined(EIGEN_VECTORIZE_AVX2)
  if constexpr (kEvenOdd) {
    k = whole / kStep * kStep;
    even_odd_chains<G, RA, kChains, kAhead>(Ap, ldap, W, ldw, k, acc);
  }
#endif
  for (; k + kStep <= whole; k += kStep) {
    if constexpr (kAhead > 0) ask_rows_ahead<Src, G, kStep, kAhead>(W, ldw, k);
    for (int c = 0; c < kChains; ++c) chain(k + c * L, c);
  }
  // The last whole packets, fewer than kChains; c stays a constant of the unrolled loop (an
  // index known only at run time would keep the accumulators in memory).
  for (int c = 0; c < kChains; ++c)
    if (k + c * L < whole) chain(k + c * L, c);
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < RA; ++r)
      finish_chains<T>(acc[g][r], A + r * lda, W + g * ldw, whole, K, C[r * ldc + g * c_step],
                       accumulate);
}

/// Rows of W in a tile of rows_product_chain_by_chain() (against rows of A in pairs,
/// for_row_pairs()), and the fewest rows of A that take that route (where chain_by_chain():
/// AVX-512 off, rows of A and W in float, the only type it is used for). Its G x RA accumulators
/// hold one chain at a time, so more rows share each load than 4 chains allow in AVX2's 16
/// registers (1 row of W x 2 of A); with fewer than 4 rows of A it is not faster.
constexpr int kChainTileW = 4;
constexpr Index kChainByChainRows = 4;
template <class T, class Src>
constexpr bool chain_by_chain() {
#if defined(EIGEN_VECTORIZE_AVX512)
  return false;
#else
  return std::is_same<T, float>::value && std::is_same<Src, float>::value &&
         row_chains<T, Src>() == kRowChains;
#endif
}

/// C[r, jj] = A[r, :] . W[jj, :] (or += when accumulate) for r < RA and jj < G, W's rows long
/// and in T: the same chains as rows_product_long() (packet p to chain p % kRowChains, added
/// pairwise, reduced, the last K % L products one by one), but computed one chain at a time,
/// over packets c, c + kRowChains, ... for G x RA elements at once: the chain of each element is
/// the same sequence of multiply-adds, so are its bits.
template <class T, int G, int RA>
EIGEN_ALWAYS_INLINE void rows_product_chain_by_chain(const T* A, Index lda, const T* W,
                                                     Index ldw, Index K, T* C, Index ldc,
                                                     bool accumulate) {
  using P = GemmPacket<T>;
  constexpr Index L = Eigen::internal::unpacket_traits<P>::size;
  constexpr int kChains = kRowChains;
  const Index whole = K / L * L;
  P chains[G][RA][kChains];
  MOH_DETAIL_UNROLL_REGISTERS
  for (int c = 0; c < kChains; ++c) {
    P acc[G][RA];
    MOH_DETAIL_UNROLL_REGISTERS
    for (int g = 0; g < G; ++g)
      MOH_DETAIL_UNROLL_REGISTERS
      for (int r = 0; r < RA; ++r) acc[g][r] = Eigen::internal::pset1<P>(T(0));
    for (Index k = c * L; k < whole; k += kChains * L) {
      P wv[G];
      MOH_DETAIL_UNROLL_REGISTERS
      for (int g = 0; g < G; ++g) wv[g] = Eigen::internal::ploadu<P>(W + g * ldw + k);
      MOH_DETAIL_UNROLL_REGISTERS
      for (int r = 0; r < RA; ++r) {
        const P av = Eigen::internal::ploadu<P>(A + r * lda + k);
        MOH_DETAIL_UNROLL_REGISTERS
        for (int g = 0; g < G; ++g) acc[g][r] = Eigen::internal::pmadd(av, wv[g], acc[g][r]);
      }
    }
    MOH_DETAIL_UNROLL_REGISTERS
    for (int g = 0; g < G; ++g)
      MOH_DETAIL_UNROLL_REGISTERS
      for (int r = 0; r < RA; ++r) chains[g][r][c] = acc[g][r];
  }
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < RA; ++r)
      finish_chains<T>(chains[g][r], A + r * lda, W + g * ldw, whole, K, C[r * ldc + g],
                       accumulate);
}

/// Elements of a long row of Src that rows_product_long_parts() asks for ahead of its reads
/// (ask_rows_ahead()): 192 of bfloat16 (384 bytes), none of float (where asking ahead gains
/// nothing).
template <class Src>
constexpr Index long_row_ahead() {
  return std::is_same<Src, std::uint16_t>::value ? 192 : 0;
}

/// C[g part + t] (+)= A . W[g part + t, :] for g < G and t < part = count / G: one row of A against
/// long rows of W in G parts side by side (for_parts()), part g's t-th row in step t with the other
/// parts' (rows_product_long() with W's row stride times the part, and C's elements as far apart),
/// as the short rows' parts (short_rows_step()) and the scores' parts of a block's keys. Returns
/// the rows done; the rows left over, fewer than G, are the caller's. Each element has the bits it
/// has in any tile. Parts stream memory faster than G neighbouring rows at a time.
/// Parts of bfloat16 rows also ask for their rows ahead of what they read (long_row_ahead()).
template <class T, int G, class Src, bool kEvenOdd>
Index rows_product_long_parts(const T* A, Index lda, const Src* W, Index ldw, Index count, Index K,
                              T* C, bool accumulate, const T* Ap, Index ldap) {
  return for_parts<G>(count, [&](Index t, Index part) MOH_DETAIL_INLINE_LAMBDA {
    rows_product_long<T, G, 1, Src, kEvenOdd, long_row_ahead<Src>()>(
        A, lda, W + t * ldw, part * ldw, K, C + t, 0, accumulate, Ap, ldap, part);
  });
}

/// Bytes of W, at most, in a chunk of rows_product_long_chunks(): the chunk stays in L2 while
/// every pair of rows of A reads it.
constexpr Index kLongRowChunkBytes = 256 * 1024;

/// C[r, j] (+)= A[r, :] . W[j, :] for r < n and the first rows j of W, two rows of A or more:
/// W in chunks of G parts side by side, each chunk read by every pair of rows of A
/// (for_row_pairs()) in turn, part g's t-th row in step t with the other parts'
/// (rows_product_long() with W's row stride and C's element step times the rows per part). The
/// first pair streams the chunk's G parts from memory, as one row of A streams
/// rows_product_long_parts() (without asking ahead); the other pairs find them in L2 (at most
/// kLongRowChunkBytes a chunk), which is faster than each pair re-reading a tile of neighbouring
/// rows. Returns the rows done, G times the rows per part of each chunk; the rows left over,
/// fewer than G, are the caller's. Each element has the bits it has in any tile.
template <class T, int G, class Src, bool kEvenOdd>
Index rows_product_long_chunks(const T* A, Index lda, Index n, const Src* W, Index ldw,
                               Index count, Index K, T* C, Index ldc, bool accumulate,
                               const T* Ap, Index ldap) {
  const Index most = std::max<Index>(1, kLongRowChunkBytes / (G * K * Index(sizeof(Src))));
  Index j = 0;
  while (count - j >= G) {
    const Index part = std::min(most, (count - j) / G);
    for_row_pairs(n, [&](Index r, auto ra) {
      for (Index t = 0; t < part; ++t)
        rows_product_long<T, G, decltype(ra)::value, Src, kEvenOdd>(
            A + r * lda, lda, W + (j + t) * ldw, part * ldw, K, C + r * ldc + j + t, ldc,
            accumulate, kEvenOdd ? Ap + r * ldap : nullptr, ldap, part);
    });
    j += G * part;
  }
  return j;
}

/// rows_product() over long rows of W: one row of A reads W in weight_streams() parts side by
/// side (at most max_streams(): rows_product_long_parts(); 1: one row at a time; the rows left
/// over one by one); more rows of A read W in chunks of long_row_tile() parts against pairs of
/// A rows (rows_product_long_chunks()), or one row of W at a time where long_row_tile() is 1,
/// so that the rows of A, re-read from L1/L2 for every step of W, are read that many times
/// less often; kChainByChainRows rows of A or more take W kChainTileW rows at a time chain by
/// chain where chain_by_chain(). No rows of A: nothing is read or written. No element's bits
/// depend on any of these.
/// kEvenOdd: see rows_product_long() (Ap, ldap as there).
template <class T, class Src, bool kEvenOdd = false>
void rows_product_long_rows(const T* A, Index lda, Index n, const Src* W, Index ldw, Index count,
                            Index K, T* C, Index ldc, bool accumulate, const T* Ap = nullptr,
                            Index ldap = 0) {
  Index j = 0;
  constexpr int kMost = max_streams<T, Src>();
  static_assert(kMost <= KernelTuning::kMaxWeightStreams, "parts for every streams setting");
  if (n > 1) {
    if constexpr (chain_by_chain<T, Src>()) {
      if (n >= kChainByChainRows)
        for (; j + kChainTileW <= count; j += kChainTileW)
          for_row_pairs(n, [&](Index r, auto ra) {
            rows_product_chain_by_chain<T, kChainTileW, decltype(ra)::value>(
                A + r * lda, lda, W + j * ldw, ldw, K, C + r * ldc + j, ldc, accumulate);
          });
    }
    if constexpr (long_row_tile<T, Src>() > 1)
      j += rows_product_long_chunks<T, long_row_tile<T, Src>(), Src, kEvenOdd>(
          A, lda, n, W + j * ldw, ldw, count - j, K, C + j, ldc, accumulate, Ap, ldap);
  } else if (n == 1) {
    // weight_streams() parts, compiled only up to kMost (more would not fit the registers).
    with_streams<kMost>(std::min(weight_streams(), kMost), [&](auto g_tile) {
      j += rows_product_long_parts<T, decltype(g_tile)::value, Src, kEvenOdd>(
          A, lda, W + j * ldw, ldw, count - j, K, C + j, accumulate, Ap, ldap);
    });
  }
  // The rows of W left (every row where long_row_tile() is 1, unless chain by chain took them),
  // one at a time against every row of A, two at a time.
  for (; j < count; ++j)
    for_row_pairs(n, [&](Index r, auto ra) {
      rows_product_long<T, 1, decltype(ra)::value, Src, kEvenOdd>(
          A + r * lda, lda, W + j * ldw, ldw, K, C + r * ldc + j, ldc, accumulate,
          kEvenOdd ? Ap + r * ldap : nullptr, ldap);
    });
}

/// Rows of W that rows_product() reads side by side when they are short (K <= kShortRow), at
/// most: the rows split into that many parts, row i of every part in step, each part one stream
/// in memory order (faster than one row after another, or neighbouring rows in one stream).
/// 6 parts of one chain against two rows of A are 12 accumulators, which AVX2's 16 registers
/// hold; AVX-512 keeps 4. Fewer where KernelTuning::weight_streams says so
/// (set_kernel_tuning()).
#if defined(EIGEN_VECTORIZE_AVX512)
constexpr int kShortStreams = 4;
#else
constexpr int kShortStreams = 6;
#endif

/// C[r, j + s part] (+)= A[r, :] . W[j + s part, :] for r < RA <= 2 and s < S, W's rows short
/// (K <= kShortRow): one chain per row over its packets in order, reduced, then its last K % L
/// products added one by one; the S rows (one per part) read side by side, sharing each load of
/// A, the RA rows of A sharing each load of W. A row's bits depend on neither S nor RA.
template <class T, int S, int RA, class Src>
EIGEN_ALWAYS_INLINE void short_rows_step(const T* A, Index lda, const Src* W, Index ldw, Index j,
                                         Index part, Index K, T* C, Index ldc, bool accumulate) {
  using P = GemmPacket<T>;
  constexpr Index L = Eigen::internal::unpacket_traits<P>::size;
  const Index whole = K / L * L;
  P acc[S][RA];
  MOH_DETAIL_UNROLL_REGISTERS
  for (int s = 0; s < S; ++s)
    MOH_DETAIL_UNROLL_REGISTERS
    for (int r = 0; r < RA; ++r) acc[s][r] = Eigen::internal::pset1<P>(T(0));
  for (Index k = 0; k < whole; k += L) {
    P av[RA];
    MOH_DETAIL_UNROLL_REGISTERS
    for (int r = 0; r < RA; ++r) av[r] = Eigen::internal::ploadu<P>(A + r * lda + k);
    MOH_DETAIL_UNROLL_REGISTERS
    for (int s = 0; s < S; ++s) {
      const P wv = load_packet<T>(W + (j + s * part) * ldw + k);
      MOH_DETAIL_UNROLL_REGISTERS
      for (int r = 0; r < RA; ++r) acc[s][r] = Eigen::internal::pmadd(av[r], wv, acc[s][r]);
    }
  }
  MOH_DETAIL_UNROLL_REGISTERS
  for (int s = 0; s < S; ++s)
    MOH_DETAIL_UNROLL_REGISTERS
    for (int r = 0; r < RA; ++r)
      finish_dot<T>(acc[s][r], A + r * lda, W + (j + s * part) * ldw, whole, K,
                    C[r * ldc + j + s * part], accumulate);
}

/// rows_product() over short rows of W: S parts of count / S rows read side by side (S =
/// kShortStreams, or fewer by KernelTuning::weight_streams), the rows left over one at a time;
/// the rows of A two at a time against each step's rows of W (which stay in L1 for them).
template <class T, class Src>
void rows_product_short_rows(const T* A, Index lda, Index n, const Src* W, Index ldw,
                             Index count, Index K, T* C, Index ldc, bool accumulate) {
  Index done = 0;  // rows read in parts
  // Rows from `done` on as S parts side by side (for_parts()): row first + j + s part.
  const auto in_parts = [&](auto parts) {
    constexpr int S = decltype(parts)::value;
    const Index first = done;
    done += for_parts<S>(count - first, [&](Index j, Index part) MOH_DETAIL_INLINE_LAMBDA {
      for_row_pairs(n, [&](Index r, auto ra) {
        short_rows_step<T, S, decltype(ra)::value>(A + r * lda, lda, W, ldw, first + j, part, K,
                                                   C + r * ldc, ldc, accumulate);
      });
    });
  };
  static_assert(kShortStreams <= KernelTuning::kMaxWeightStreams, "parts for every setting");
  with_streams<kShortStreams>(std::min(weight_streams(), kShortStreams), in_parts);
  in_parts(std::integral_constant<int, 1>{});
}

/// The kernel that rows_product() runs its rows on.
enum class RowsRoute {
  ShortRows,        // rows_product_short_rows(): K <= kShortRow (a head's slice of W_o)
  LongRows,         // rows_product_long_rows() on A where it lies
  LongRowsEvenOdd,  // rows_product_long_rows() on A laid out by even_odd_rows(), bfloat16 W
};

/// The route rows_product() takes for rows of length K of W in Src, into T, with or without an
/// arena: rows_product() itself asks it, so this is the route that runs. The even/odd loop needs
/// an arena for A's layout, and exists where even_odd_widening() (float from bfloat16, AVX2 or
/// AVX-512). The rows of A and W do not enter it (they choose inside rows_product_long_rows()).
template <class T, class Src>
inline RowsRoute rows_product_route(Index K, [[maybe_unused]] bool have_arena) {
  if (K <= kShortRow) return RowsRoute::ShortRows;
#if defined(EIGEN_VECTORIZE_AVX2)
  if constexpr (even_odd_widening<T, Src>()) {
    if (have_arena && even_odd_length(K) > 0) return RowsRoute::LongRowsEvenOdd;
  }
#endif
  return RowsRoute::LongRows;
}

/// C[n, count] (+)= A[n, K] W[count, K]^T (a decode step's rows, a tile of a decode call's; any n
/// for a router's few outputs, project_dots()), straight from W's storage (T or bfloat16) without
/// packing: each weight is read once from memory (a long row, a chunk of long rows, or a step's
/// short rows stays in L1 or L2 while the rows of A pass over it, two at a time, sharing its
/// loads). Each C element sums packet-wise partial sums, then reduces them (and adds the sum
/// to C when `accumulate`); a row of C does not depend on the other rows, nor on how many rows
/// come with it, and an element does not depend on the rows of W beside it.
/// With an `arena` (optional) and long bfloat16 rows (even_odd_widening()), A's rows are laid
/// out there for the even/odd loop first (n x K floats, taken back on return).
template <class T, class Src>
void rows_product(const T* A, Index lda, Index n, const Src* W, Index ldw, Index count, Index K,
                  T* C, Index ldc, bool accumulate, [[maybe_unused]] Arena* arena = nullptr) {
  switch (rows_product_route<T, Src>(K, arena != nullptr)) {
    case RowsRoute::ShortRows:
      rows_product_short_rows<T>(A, lda, n, W, ldw, count, K, C, ldc, accumulate);
      return;
    case RowsRoute::LongRowsEvenOdd:
#if defined(EIGEN_VECTORIZE_AVX2)
      if constexpr (even_odd_widening<T, Src>()) {
        const Index ldap = even_odd_length(K);
        Arena::Scope scope(*arena);
        T* Ap = arena->allocate<T>(n * ldap);
        even_odd_rows(A, lda, n, K, Ap);
        rows_product_long_rows<T, Src, true>(A, lda, n, W, ldw, count, K, C, ldc, accumulate, Ap,
                                             ldap);
        return;
      }
#endif
      break;  // not given where the even/odd loop is not compiled
    case RowsRoute::LongRows:
      break;
  }
  rows_product_long_rows<T>(A, lda, n, W, ldw, count, K, C, ldc, accumulate);
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

}  // namespace detail
}  // namespace moh

#include "moh/ops/detail/unroll_end.hpp"
