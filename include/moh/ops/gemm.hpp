// A packed, register-tiled GEMM for the projections: C[M, N] (+)= A[M, K] B, where B is read
// from a weight matrix stored in T or in bfloat16, either as [K, N] or as the transpose of a
// [N, K] matrix (torch.nn.Linear's layout, so Y = X W^T needs no copy of W).
//
// Blocking: B is packed per (KC x NC) block into panels of NR columns (bfloat16 is widened to T
// while packing, so it costs nothing extra), unless the weights are stored packed already
// (WeightStorage::NativePacked), whose panels are read in place; A is read in place, MR rows at a
// time (2 MR for panels of at most NP / 2 packets, the last M % MR rows in a tile of their own
// height); a micro-kernel keeps an MR x NR tile of C in vector registers over KC. The packs come
// from the arena the caller passes (its thread's, in a Workspace), so nothing is allocated once
// warm.
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

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "moh/float16.hpp"
#include "moh/runtime/tuning.hpp"
#include "moh/runtime/workspace.hpp"
#include "moh/tensor.hpp"

#include "moh/ops/detail/unroll_begin.hpp"

namespace moh {
namespace detail {

/// The B operand of gemm(): element (k, n) of B is
///   src[n * ld + k] when `transposed` (B = W^T for a row-major W[N, K]), else src[k * ld + n],
/// where src is `values` (T) or, when that is null, `bf16` (bfloat16 bits, widened exactly).
/// `reach` (untransposed B only) is how many rows of the storage, from B's first row on, the
/// unpacked kernels may prefetch: a routed expert's weights are followed by the next expert's,
/// which the same call reads next. 0: just the product's depth.
/// A transposed B may also be stored in panels of depth: k runs of `panel_depth` (a weight matrix
/// kept in column panels, one per head), the run that holds k at `panel_stride` elements from the
/// previous one; src then points at element (k = 0, n = 0), `panel_k` deep into its run.
/// A transposed B may also come with its matrix already in gemm()'s panel layout (`packed`, see
/// packed_panel()); gemm() then reads those panels instead of packing them.
template <class T>
struct GemmB {
  const T* values = nullptr;
  const std::uint16_t* bf16 = nullptr;
  Index ld = 0;
  bool transposed = false;
  Index reach = 0;
  Index panel_depth = 0;  // transposed only: 0 = one run over all of k
  Index panel_stride = 0;
  Index panel_k = 0;
  // The whole W[rows, cols] in panels of nr rows: element (i, j) at
  // packed[(i / nr) * cols * nr + j * nr + i % nr], rows past the last zero, and nr more
  // elements after the last panel (a kernel reads whole packets from a panel's offset, into
  // lanes it discards); B(k, n) is W(packed_row + n, packed_col + k). Null: not stored so.
  const T* packed = nullptr;
  Index packed_nr = 0, packed_cols = 0, packed_row = 0, packed_col = 0;

  /// The same matrix without its first `k` rows and `n` columns.
  GemmB offset(Index k, Index n) const {
    GemmB b = *this;
    if (!transposed && reach > 0) b.reach = std::max<Index>(0, reach - k);
    if (packed != nullptr) {
      b.packed_row += n;
      b.packed_col += k;
    }
    Index at = transposed ? n * ld + k : k * ld + n;
    if (transposed && panel_depth > 0) {
      const Index deep = panel_k + k;  // from the start of the current run
      b.panel_k = deep % panel_depth;
      at = n * ld + (deep / panel_depth) * panel_stride + b.panel_k - panel_k;
    }
    if (values != nullptr)
      b.values += at;
    else
      b.bf16 += at;
    return b;
  }
  /// B[k, n .. n + w) for k >= 0 as rows of a panel at stride packed_nr, read in place: null
  /// unless B is stored packed and those w columns lie in one of its panels.
  const T* packed_panel(Index n, Index w) const {
    if (packed == nullptr) return nullptr;
    const Index row = packed_row + n, at = row % packed_nr;
    if (at + w > packed_nr) return nullptr;
    return packed + (row / packed_nr) * packed_cols * packed_nr + packed_col * packed_nr + at;
  }
  /// How many k from the first on lie in one run of storage (all of them without panels).
  Index run(Index depth) const {
    return transposed && panel_depth > 0 ? std::min(depth, panel_depth - panel_k) : depth;
  }
  /// Calls fn(k0, n, B from row k0 on) for the runs of storage that cover k in [0, depth), in
  /// order; once with n = 0 when depth is 0.
  template <class Fn>
  void for_each_run(Index depth, Fn&& fn) const {
    Index k = 0;
    do {
      const GemmB s = offset(k, 0);
      const Index n = s.run(depth - k);
      fn(k, n, s);
      k += n;
    } while (k < depth);
  }
};

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"
#endif

template <class T>
using GemmPacket = typename Eigen::internal::packet_traits<T>::type;

/// Blocking of gemm() for T on this target: the micro-kernel holds MR rows x NP packets of C.
template <class T>
struct GemmShape {
  static constexpr Index L = Eigen::internal::unpacket_traits<GemmPacket<T>>::size;
#if defined(EIGEN_VECTORIZE_AVX512)
  // 32 vector registers: 24 accumulators, 4 packets of B, a broadcast of A; 6 x 4 is among the
  // fastest tiles at the projection shapes, and its 64 columns fit head-sized blocks exactly.
  static constexpr int MR = 6, NP = 4;
#else
  // 16 vector registers (AVX, SSE) or a scalar fallback: 12 accumulators.
  static constexpr int MR = 6, NP = 2;
#endif
  static constexpr Index NR = NP * L;
  static constexpr Index KC = 256;      // depth of a packed block
  static constexpr Index MC = 16 * MR;  // rows of A per pass over a block of B (stay in L2)
  static constexpr Index NC = 8 * NR;   // columns of B packed at a time (stays in L2)
};

/// One packet of T from L consecutive elements at p (T or bfloat16, widened).
template <class T>
inline GemmPacket<T> load_packet(const T* p) {
  return Eigen::internal::ploadu<GemmPacket<T>>(p);
}
template <class T>
inline GemmPacket<T> load_packet(const std::uint16_t* p) {
  using P = GemmPacket<T>;
  constexpr Index L = Eigen::internal::unpacket_traits<P>::size;
#if defined(__AVX512F__)
  if constexpr (std::is_same<P, __m512>::value) {  // a float's bits are the bfloat16's, shifted
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
#endif
#if defined(__AVX2__)
  if constexpr (std::is_same<P, __m256>::value) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
#endif
  alignas(64) T wide[L];
  for (Index i = 0; i < L; ++i) wide[i] = static_cast<T>(bfloat16_to_float(p[i]));
  return Eigen::internal::pload<P>(wide);
}
/// Asks for the `bytes` at p, a line (64 bytes) at a time (a hint: it changes no result).
EIGEN_ALWAYS_INLINE void prefetch_bytes([[maybe_unused]] const void* p,
                                        [[maybe_unused]] Index bytes) {
#if defined(__GNUC__)
  const char* c = static_cast<const char*>(p);
  for (Index o = 0; o < bytes; o += 64) __builtin_prefetch(c + o);
#endif
}
/// Asks for the lines (64 bytes each) at the address `at` + 64 i for each i of Lines, `at`
/// given as an integer, so that no line's address is a pointer past an array: one instruction
/// each, so no loop is left in the caller's loop at any optimisation level.
template <Index... Lines>
EIGEN_ALWAYS_INLINE void prefetch_lines_at([[maybe_unused]] std::uintptr_t at,
                                           std::integer_sequence<Index, Lines...>) {
#if defined(__GNUC__)
  (__builtin_prefetch(reinterpret_cast<const void*>(at + static_cast<std::uintptr_t>(Lines * 64))),
   ...);
#endif
}
/// prefetch_lines_at() from the pointer p.
template <Index... Lines>
EIGEN_ALWAYS_INLINE void prefetch_lines(const void* p, std::integer_sequence<Index, Lines...> l) {
  prefetch_lines_at(reinterpret_cast<std::uintptr_t>(p), l);
}
/// For one step of kStep elements at element k of G rows of Src (at ldw): asks for the lines
/// kAhead elements further on in each row, so that every line of a row from its element kAhead
/// on is asked for once over the steps (a step of 64 bytes or more: kStep sizeof(Src) / 64 lines
/// per row; a shorter one: one line per row every 64 bytes' worth of steps, k counted from a
/// row's start). A hint: the lines past the last row are asked for too (their addresses are
/// formed as integers, never as pointers past the rows, and a prefetch does not fault).
template <class Src, int G, Index kStep, Index kAhead>
EIGEN_ALWAYS_INLINE void ask_rows_ahead(const Src* W, Index ldw, Index k) {
  constexpr Index kBytes = kStep * Index(sizeof(Src));
  static_assert(kAhead > 0, "something ahead to ask for");
  static_assert(kBytes % 64 == 0 || 64 % kBytes == 0, "whole lines or whole parts of one");
  if constexpr (kBytes < 64) {
    if ((k * Index(sizeof(Src))) % 64 != 0) return;
  }
  for (int g = 0; g < G; ++g)
    prefetch_lines_at(reinterpret_cast<std::uintptr_t>(W + g * ldw + k) +
                          static_cast<std::uintptr_t>(kAhead) * sizeof(Src),
                      std::make_integer_sequence<Index, std::max<Index>(1, kBytes / 64)>{});
}

template <class T>
inline T load_scalar(const T* p) {
  return *p;
}
template <class T>
inline T load_scalar(const std::uint16_t* p) {
  return static_cast<T>(bfloat16_to_float(*p));
}

/// The register tile of every product here: C[MR, NP packets] (+)= A[MR, depth] B[depth, NP
/// packets], with A(r, k) = A[r * a_row + k * a_k] broadcast, B row k at B + k * b_k (T, or
/// bfloat16 widened in registers) and C rows at ldc. Each element is one chain of multiply-adds
/// over k in order, from C (accumulate) or zero. kPrefetch: while row k is used, ask for row k
/// of `pf` (rows at B's stride, NP packets wide) for k < min(depth, pf_rows): the caller points
/// it at the weights it reads next (unpacked weights of a routed expert come from L3 or memory,
/// which the hardware prefetcher does not follow across an expert's scattered rows).
/// Always inlined, with product_tile and product_rest: GCC's own choice varies with small
/// changes to the callers, and an out-of-line copy of the prefetching kernel is slower.
template <class T, int MR, int NP, class Src, bool kPrefetch = false>
EIGEN_ALWAYS_INLINE void tile_kernel(const T* A, Index a_row, Index a_k, const Src* B, Index b_k,
                                     Index depth, T* C, Index ldc, bool accumulate,
                                     [[maybe_unused]] const Src* pf = nullptr,
                                     [[maybe_unused]] Index pf_rows = 0) {
  using P = GemmPacket<T>;
  constexpr Index L = Eigen::internal::unpacket_traits<P>::size;
  P acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int p = 0; p < NP; ++p)
      acc[r][p] = accumulate ? Eigen::internal::ploadu<P>(C + r * ldc + p * L)
                             : Eigen::internal::pset1<P>(T(0));
  auto step = [&](Index k) {
    P b[NP];
    for (int p = 0; p < NP; ++p) b[p] = load_packet<T>(B + k * b_k + p * L);
    for (int r = 0; r < MR; ++r) {
      const P a = Eigen::internal::pset1<P>(A[r * a_row + k * a_k]);
      for (int p = 0; p < NP; ++p) acc[r][p] = Eigen::internal::pmadd(a, b[p], acc[r][p]);
    }
  };
  Index k = 0;
#if defined(__GNUC__)
  if constexpr (kPrefetch) {  // two loops, so that the hot one has no branch
    for (const Index ahead = std::min(depth, pf_rows); k < ahead; ++k) {
      prefetch_bytes(pf + k * b_k, NP * L * Index(sizeof(Src)));
      step(k);
    }
  }
#endif
  for (; k < depth; ++k) step(k);
  for (int r = 0; r < MR; ++r)
    for (int p = 0; p < NP; ++p) Eigen::internal::pstoreu(C + r * ldc + p * L, acc[r][p]);
}

/// Where one row tile of small_product() prefetches: `rows` rows of B from `at` (none if 0).
template <class Src>
struct TilePrefetch {
  const Src* at = nullptr;
  Index rows = 0;
};

/// Unpacked operands: A rows at stride lda, B rows at ldb.
template <class T, int MR, int NP, bool kPrefetch, class Src>
EIGEN_ALWAYS_INLINE void product_tile(const T* A, Index lda, const Src* B, Index ldb,
                                      Index depth, T* C, Index ldc, bool accumulate,
                                      TilePrefetch<Src> pf) {
  tile_kernel<T, MR, NP, Src, kPrefetch>(A, lda, 1, B, ldb, depth, C, ldc, accumulate, pf.at,
                                         pf.rows);
}

/// product_tile for the last `rows` (< N) rows, in one pass over B.
template <class T, int N, int NP, bool kPrefetch, class Src>
EIGEN_ALWAYS_INLINE void product_rest(Index rows, const T* A, Index lda, const Src* B,
                                      Index ldb, Index depth, T* C, Index ldc, bool accumulate,
                                      TilePrefetch<Src> pf) {
  if constexpr (N > 1) {
    if (rows == N - 1)
      product_tile<T, N - 1, NP, kPrefetch>(A, lda, B, ldb, depth, C, ldc, accumulate, pf);
    else
      product_rest<T, N - 1, NP, kPrefetch>(rows, A, lda, B, ldb, depth, C, ldc, accumulate, pf);
  }
}

/// Rows of B ahead of the row being multiplied that the first row tile of a block prefetches.
constexpr Index kPrefetchRows = 16;

/// C[rows, cols] (+)= A[rows, depth] B[depth, cols] in MR x NP-packet register tiles, without
/// packing (for few rows, or operands already laid out); cols a multiple of the packet size.
/// The depth is split into blocks whose slice of B fits L1, so that each row tile rereads B from
/// L1 rather than from L2 or L3; C carries the chain between blocks, so the bits do not change.
/// kPrefetch: B comes from outside the caches (a routed expert's weights; see tile_kernel). The
/// first row tile of each block prefetches kPrefetchRows ahead within the block (16 rows past it
/// when it is the only tile); the other row tiles share out the block read next among the
/// NP-packet strips (the next depth block, else the next strip's first, else the rows past
/// `depth`: the next expert's, as far as row `reach` (>= depth) of B), so that memory is busy
/// while the block in L1 is multiplied, not only while it is first read.
template <class T, int MR, int NP, bool kPrefetch, class Src>
void small_product(const T* A, Index lda, const Src* B, Index ldb, Index rows, Index cols,
                   Index depth, T* C, Index ldc, bool accumulate, Index reach = 0) {
  eigen_assert(reach == 0 || reach >= depth);
  reach = std::max(reach, depth);
  constexpr Index L = Eigen::internal::unpacket_traits<GemmPacket<T>>::size;
  constexpr Index kL1Bytes = 32 * 1024;
  auto strip = [&](auto packets, Index c) {
    constexpr int np = decltype(packets)::value;
    const Index block = std::max<Index>(8, kL1Bytes / (np * L * static_cast<Index>(sizeof(Src))));
    const Index blocks = (depth + block - 1) / block, strips = cols / (NP * L);
    const Index tiles = (rows + MR - 1) / MR;
    Index k0 = 0;
    do {  // at least once, so that depth 0 still writes C
      const Index kb = std::min(block, depth - k0);
      const bool acc = accumulate || k0 > 0;
      const T* a = A + k0;
      const Src* b = B + k0 * ldb + c;
      // The block read after this one, in the order NP-packet strips outer, depth blocks inner,
      // continued past `depth` by the next expert of the same shape (narrow strips left out).
      TilePrefetch<Src> next;
      if constexpr (kPrefetch) {
        if (np == NP && tiles > 1 && depth > 0) {
          const Index at = (c / (NP * L)) * blocks + k0 / block + 1;
          const Index strip_of = (at / blocks) % strips;
          const Index k_of = (at / blocks / strips) * depth + (at % blocks) * block;
          next.rows = std::min({block, depth - (at % blocks) * block, reach - k_of});
          if (next.rows > 0) next.at = B + k_of * ldb + strip_of * NP * L;
        }
      }
      auto prefetch_of = [&](Index tile) {
        TilePrefetch<Src> pf;
        if constexpr (kPrefetch) {
          if (tile == 0) {  // its own block; alone, also the start of the next
            const Index end = tiles > 1 ? std::min(kb, reach - k0)
                                        : std::min(kb + kPrefetchRows, reach - k0);
            if (end > kPrefetchRows) pf = {b + kPrefetchRows * ldb, end - kPrefetchRows};
          } else if (tile < tiles && next.rows > 0) {  // tile == tiles: no rows left
            const Index lo = next.rows * (tile - 1) / (tiles - 1);
            const Index hi = next.rows * tile / (tiles - 1);
            pf = {next.at + lo * ldb, hi - lo};
          }
          eigen_assert(pf.rows <= 0 || (pf.at - B) / ldb + pf.rows <= reach);
        }
        return pf;
      };
      Index r = 0, tile = 0;
      for (; r + MR <= rows; r += MR, ++tile)
        product_tile<T, MR, np, kPrefetch>(a + r * lda, lda, b, ldb, kb, C + r * ldc + c, ldc, acc,
                                           prefetch_of(tile));
      product_rest<T, MR, np, kPrefetch>(rows - r, a + r * lda, lda, b, ldb, kb, C + r * ldc + c,
                                         ldc, acc, prefetch_of(tile));
      k0 += kb;
    } while (k0 < depth);
  };
  Index c = 0;
  for (; c + NP * L <= cols; c += NP * L) strip(std::integral_constant<int, NP>(), c);
  for (; c < cols; c += L) strip(std::integral_constant<int, 1>(), c);
}

/// dst[k * ldd + j] = src[j * lds + k] for j < rows, k < cols: a transposing copy in square
/// blocks of one packet, transposed in registers. Src is T or bfloat16. Out of line: inlined into
/// gemm(), GCC 12 warns about the uninitialised temporaries of its own AVX-512 headers
/// (avx512fintrin.h's `__m512 __Y = __Y;` in Eigen's ptranspose) in consumers' -Wall builds.
template <class T, class Src>
EIGEN_DONT_INLINE void pack_transposed(const Src* src, Index lds, Index rows, Index cols, T* dst,
                                       Index ldd) {
  using P = GemmPacket<T>;
  constexpr Index L = Eigen::internal::unpacket_traits<P>::size;
  Index j = 0;
  if constexpr (L > 1) {
    for (; j + L <= rows; j += L) {
      Index k = 0;
      for (; k + L <= cols; k += L) {
        Eigen::internal::PacketBlock<P, L> block;
        for (Index i = 0; i < L; ++i) block.packet[i] = load_packet<T>(src + (j + i) * lds + k);
        Eigen::internal::ptranspose(block);
        for (Index i = 0; i < L; ++i) Eigen::internal::pstoreu(dst + (k + i) * ldd + j, block.packet[i]);
      }
      // Fewer than L columns are left. The explicit bound keeps GCC -O3 from warning that an
      // unbounded k would overflow (-Waggressive-loop-optimizations) in consumers' builds.
      for (Index t = 1; t < L && k < cols; ++t, ++k) {
        T* d = dst + k * ldd + j;
        const Src* s = src + j * lds + k;
        for (Index i = 0; i < L; ++i) d[i] = load_scalar<T>(s + i * lds);
      }
    }
  }
  for (; j < rows; ++j)
    for (Index k = 0; k < cols; ++k) dst[k * ldd + j] = load_scalar<T>(src + j * lds + k);
}

/// dst[k * ldd + j] = src[k * lds + j] for k < rows, j < cols. Src is T or bfloat16.
template <class T, class Src>
void pack_rows(const Src* src, Index lds, Index rows, Index cols, T* dst, Index ldd) {
  constexpr Index L = Eigen::internal::unpacket_traits<GemmPacket<T>>::size;
  for (Index k = 0; k < rows; ++k) {
    const Src* s = src + k * lds;
    T* o = dst + k * ldd;
    Index j = 0;
    for (; j + L <= cols; j += L) Eigen::internal::pstoreu(o + j, load_packet<T>(s + j));
    for (; j < cols; ++j) o[j] = load_scalar<T>(s + j);
  }
}

/// Packs B[0 : kc, 0 : w] into a panel [kc, NR] (columns w .. NR zero).
template <class T>
void pack_b_panel(const GemmB<T>& b, Index kc, Index w, Index NR, T* panel) {
  if (b.transposed) {
    b.for_each_run(kc, [&](Index k, Index n, const GemmB<T>& s) {
      if (s.values)
        pack_transposed<T>(s.values, s.ld, w, n, panel + k * NR, NR);
      else
        pack_transposed<T>(s.bf16, s.ld, w, n, panel + k * NR, NR);
    });
  } else if (b.values) {
    pack_rows<T>(b.values, b.ld, kc, w, panel, NR);
  } else {
    pack_rows<T>(b.bf16, b.ld, kc, w, panel, NR);
  }
  if (w < NR)
    for (Index k = 0; k < kc; ++k) std::fill(panel + k * NR + w, panel + (k + 1) * NR, T(0));
}

/// tile_kernel for an edge tile: only the first `np` (<= NP) packets of columns, so a narrow
/// edge (a head's d columns, the last few of a product) does not pay for a whole panel. Out of
/// line, as rows_kernel: inlining the dozens of kernels makes gemm() itself slower.
template <class T, int MR, int NP, bool kPrefetch = false>
EIGEN_DONT_INLINE void edge_kernel(Index np, const T* A, Index a_row, Index a_k, const T* Bp,
                                   Index NR, Index kc, T* C, Index ldc, bool accumulate,
                                   const T* pf = nullptr, Index pf_rows = 0) {
  if constexpr (NP > 1) {
    if (np < NP) {
      edge_kernel<T, MR, NP - 1, kPrefetch>(np, A, a_row, a_k, Bp, NR, kc, C, ldc, accumulate,
                                            pf, pf_rows);
      return;
    }
  }
  tile_kernel<T, MR, NP, T, kPrefetch>(A, a_row, a_k, Bp, NR, kc, C, ldc, accumulate, pf, pf_rows);
}

/// edge_kernel for the first `rows` (1 .. MR) rows of A, read in place at stride lda: a tile of
/// exactly those rows, not MR rows of which some are padding.
template <class T, int MR, int NP>
EIGEN_DONT_INLINE void rows_kernel(Index rows, Index np, const T* A, Index lda, const T* Bp,
                                   Index NR, Index kc, T* C, Index ldc, bool accumulate) {
  if constexpr (MR > 1) {
    if (rows < MR) {
      rows_kernel<T, MR - 1, NP>(rows, np, A, lda, Bp, NR, kc, C, ldc, accumulate);
      return;
    }
  }
  edge_kernel<T, MR, NP>(np, A, lda, 1, Bp, NR, kc, C, ldc, accumulate);
}

/// C[M, N] (+)= A[M, K] B on this thread; A and C row-major at strides lda, ldc. Packs B (or
/// reads the panels of a B stored packed with this target's NR) and tiles; see multiply() for
/// few rows.
template <class T>
void gemm(const T* A, Index lda, const GemmB<T>& B, T* C, Index ldc, Index M, Index N, Index K,
          bool accumulate, Arena& arena) {
  using S = GemmShape<T>;
  constexpr Index MR = S::MR, NR = S::NR, KC = S::KC, MC = S::MC, NC = S::NC;
  static_assert(S::NP % 2 == 0 && MC % (2 * MR) == 0, "narrow panels run tiles of 2 MR rows");
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    if (!accumulate)
      for (Index i = 0; i < M; ++i) std::fill(C + i * ldc, C + i * ldc + N, T(0));
    return;
  }
  const Index nc_max = std::min(NC, (N + NR - 1) / NR * NR);
  const Index kc_max = std::min(KC, K);
  // The packs start on a page of their own, so that the panel's rows do not meet the rows of A
  // and C in the same cache sets (which is slower).
  Arena::Scope scope(arena);
  const bool prepacked = B.transposed && B.packed != nullptr && B.packed_nr == NR;
  T* bp = arena.allocate<T>(kc_max * nc_max, Arena::kPageBytes);
  // An edge tile's C: up to 2 MR rows at stride NR. Not cleared here (a call with few rows
  // would spend more on that than on its product): each use writes the lanes its kernel reads.
  alignas(64) T edge[2 * MR * NR];
  const T* panels[NC / NR];  // the block's panels: packed here or read in place
  // edge[r, j] = C[r, j] (or 0) for j < w, 0 for the rest of the np packets a kernel reads.
  auto start_edge = [&](T* e, const T* c, Index h, Index w, Index np, bool acc) {
    for (Index r = 0; r < h; ++r) {
      for (Index j = 0; j < w; ++j) e[r * NR + j] = acc ? c[r * ldc + j] : T(0);
      std::fill(e + r * NR + w, e + r * NR + np * S::L, T(0));
    }
  };
  // C[r, j] = edge[r, j] for the h x w elements of an edge tile.
  auto end_edge = [&](const T* e, T* c, Index h, Index w) {
    for (Index r = 0; r < h; ++r)
      for (Index j = 0; j < w; ++j) c[r * ldc + j] = e[r * NR + j];
  };

  for (Index j0 = 0; j0 < N; j0 += NC) {
    const Index nc = std::min(NC, N - j0);
    for (Index k0 = 0; k0 < K; k0 += KC) {
      const Index kc = std::min(KC, K - k0);
      const bool acc = accumulate || k0 > 0;
      for (Index jp = 0; jp < nc; jp += NR) {
        const GemmB<T> block = B.offset(k0, j0 + jp);
        const Index w = std::min(NR, nc - jp);
        panels[jp / NR] = prepacked ? block.packed_panel(0, w) : nullptr;
        if (panels[jp / NR] == nullptr) {
          pack_b_panel<T>(block, kc, w, NR, bp + jp * kc);
          panels[jp / NR] = bp + jp * kc;
        }
      }
      // A is read in place (faster than packing it here); the last M % MR rows are a tile of
      // their own height.
      const Index tail = M % MR;
      for (Index i0 = 0; i0 < M; i0 += MC) {
        const Index mc = std::min(MC, M - i0);
        for (Index jp = 0; jp < nc; jp += NR) {
          const Index w = std::min(NR, nc - jp);
          const T* b = panels[jp / NR];
          const Index np = (w + S::L - 1) / S::L;
          // A panel read in place comes from L3 or memory, not from the pack just written: the
          // first row tile over it prefetches kPrefetchRows rows ahead of the one it multiplies
          // (into the panel's next block: its rows follow in storage).
          const bool fetch = i0 == 0 && b != bp + jp * kc && K - k0 > kPrefetchRows;
          const T* pf = fetch ? b + kPrefetchRows * NR : nullptr;
          const Index pf_rows = fetch ? std::min(kc, K - k0 - kPrefetchRows) : 0;
          const Index full = std::min(mc, M - tail - i0);  // rows in whole tiles of MR
          for (Index ip = 0; ip < mc; ip += MR) {
            const Index h = std::min(MR, mc - ip);
            const T* a = A + (i0 + ip) * lda + k0;
            T* c = C + (i0 + ip) * ldc + j0 + jp;
            if (2 * np <= S::NP && ip + 2 * MR <= full) {
              // A narrow panel (a head's d columns, the last few): tiles of twice the rows in
              // the same registers, so that each load of B feeds twice the multiply-adds and
              // enough independent chains hide the multiply-add latency. Columns that are not
              // whole packets go through `edge`, started from C's values.
              const bool whole = w % S::L == 0;
              if (!whole) start_edge(edge, c, 2 * MR, w, np, acc);
              T* out = whole ? c : edge;
              const Index ld_out = whole ? ldc : NR;
              const bool from = whole ? acc : true;
              if (ip == 0 && pf_rows > 0)
                edge_kernel<T, 2 * S::MR, S::NP / 2, true>(np, a, lda, 1, b, NR, kc, out, ld_out,
                                                           from, pf, pf_rows);
              else
                edge_kernel<T, 2 * S::MR, S::NP / 2>(np, a, lda, 1, b, NR, kc, out, ld_out, from);
              if (!whole) end_edge(edge, c, 2 * MR, w);
              ip += MR;
              continue;
            }
            if (h == MR && w == NR) {
              if (ip == 0 && pf_rows > 0)
                tile_kernel<T, S::MR, S::NP, T, true>(a, lda, 1, b, NR, kc, c, ldc, acc, pf,
                                                      pf_rows);
              else
                tile_kernel<T, S::MR, S::NP>(a, lda, 1, b, NR, kc, c, ldc, acc);
              continue;
            }
            if (h == MR && w % S::L == 0 && ip == 0 && pf_rows > 0) {
              edge_kernel<T, S::MR, S::NP, true>(np, a, lda, 1, b, NR, kc, c, ldc, acc, pf,
                                                 pf_rows);
              continue;
            }
            // Edge tile (fewer rows than MR, or fewer columns than a panel): a tile of its
            // rows and packets, in place when its columns are whole packets (a head's d), else
            // through `edge`, started from C's values; each element is the same chain as in a
            // whole tile.
            if (w % S::L == 0) {
              rows_kernel<T, S::MR, S::NP>(h, np, a, lda, b, NR, kc, c, ldc, acc);
              continue;
            }
            start_edge(edge, c, h, w, np, acc);
            rows_kernel<T, S::MR, S::NP>(h, np, a, lda, b, NR, kc, edge, NR, true);
            end_edge(edge, c, h, w);
          }
        }
      }
    }
  }
}

/// Rows of A that few_rows_product() handles (decode steps); more go to the tiled products.
constexpr Index kFewRows = 4;
/// Rows of A that multiply() gives to rows_product() against a transposed operand by count (a
/// decode call gives it all its rows: dot_rows): a decode step of up to 8 sequences reads the
/// weights in place rather than packing them every step.
constexpr Index kDotRows = 8;

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
  if (K > kShortRow) {
#if defined(EIGEN_VECTORIZE_AVX2)
    if constexpr (even_odd_widening<T, Src>()) {
      const Index ldap = even_odd_length(K);
      if (arena != nullptr && ldap > 0) {
        Arena::Scope scope(*arena);
        T* Ap = arena->allocate<T>(n * ldap);
        even_odd_rows(A, lda, n, K, Ap);
        rows_product_long_rows<T, Src, true>(A, lda, n, W, ldw, count, K, C, ldc, accumulate, Ap,
                                             ldap);
        return;
      }
    }
#endif
    rows_product_long_rows<T>(A, lda, n, W, ldw, count, K, C, ldc, accumulate);
    return;
  }
  rows_product_short_rows<T>(A, lda, n, W, ldw, count, K, C, ldc, accumulate);
}

/// C[M, N] (+)= A[M, K] B[K, N] for M <= kFewRows and N a multiple of the packet size, reading
/// B row after row in storage order, each row once (a decode step against weights stored
/// [in, out], such as MoA's experts): memory streams whole rows instead of the strips of
/// small_product(). Each C element is the same chain as small_product()'s and gemm()'s (0, or C
/// when `accumulate`, then one multiply-add per k in order), so the bits are theirs. C rows are
/// updated in chunks that stay in L1.
template <class T, class Src>
void few_rows_product(const T* A, Index lda, const Src* B, Index ldb, Index M, Index N, Index K,
                      T* C, Index ldc, bool accumulate) {
  using P = GemmPacket<T>;
  constexpr Index L = Eigen::internal::unpacket_traits<P>::size;
  constexpr Index kChunk = 2048;  // columns per pass: kFewRows x 2048 floats = 32 KiB of C
  eigen_assert(M <= kFewRows && N % L == 0);
  for (Index c0 = 0; c0 < N; c0 += kChunk) {
    const Index nc = std::min(kChunk, N - c0);
    for (Index r = 0; r < M; ++r)
      if (!accumulate) std::fill(C + r * ldc + c0, C + r * ldc + c0 + nc, T(0));
    for (Index k = 0; k < K; ++k) {
      const Src* b = B + k * ldb + c0;
      for (Index r = 0; r < M; ++r) {
        const P a = Eigen::internal::pset1<P>(A[r * lda + k]);
        T* c = C + r * ldc + c0;
        for (Index j = 0; j < nc; j += L)
          Eigen::internal::pstoreu(
              c + j, Eigen::internal::pmadd(a, load_packet<T>(b + j), Eigen::internal::ploadu<P>(c + j)));
      }
    }
  }
}

/// Whether multiply() takes M rows against a transposed operand as dot products (rows_product()).
inline bool dot_route(Index M, bool dot_rows) { return M <= kDotRows || dot_rows; }

/// Rows of A below which multiply() runs a [K, N] operand unpacked: packing B would cost about
/// as much as the product (a few tokens routed to one head or expert).
constexpr Index kUnpackedRows = 32;

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
  if (B.transposed && dot_route(M, dot_rows)) {
    // One run of the storage (a head's panel) at a time; once when K = 0 (C = 0 or kept).
    B.for_each_run(K, [&](Index k, Index n, const GemmB<T>& s) {
      if (s.values)
        rows_product<T>(A + k, lda, M, s.values, s.ld, N, n, C, ldc, accumulate || k > 0);
      else
        rows_product<T>(A + k, lda, M, s.bf16, s.ld, N, n, C, ldc, accumulate || k > 0, &arena);
    });
    return;
  }
  if (!B.transposed && M <= kFewRows && S::L > 1 && N % S::L == 0) {
    if (B.values)
      few_rows_product<T>(A, lda, B.values, B.ld, M, N, K, C, ldc, accumulate);
    else
      few_rows_product<T>(A, lda, B.bf16, B.ld, M, N, K, C, ldc, accumulate);
    return;
  }
  if (!B.transposed && M < kUnpackedRows && S::L > 1 && N % S::L == 0) {
    if (B.values)
      small_product<T, S::MR, S::NP, true>(A, lda, B.values, B.ld, M, N, K, C, ldc, accumulate,
                                           B.reach);
    else
      small_product<T, S::MR, S::NP, true>(A, lda, B.bf16, B.ld, M, N, K, C, ldc, accumulate,
                                           B.reach);
    return;
  }
  gemm<T>(A, lda, B, C, ldc, M, N, K, accumulate, arena);
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

}  // namespace detail
}  // namespace moh

#include "moh/ops/detail/unroll_end.hpp"
