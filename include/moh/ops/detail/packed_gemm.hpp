// A packed, register-tiled GEMM and its unpacked variants for few rows: C[M, N] (+)= A[M, K] B,
// B a GemmB (a weight matrix in T or bfloat16, [K, N] or the transpose of [N, K]). multiply()
// (ops/gemm.hpp) picks among gemm(), small_product() and few_rows_product() by shape.
//
// Blocking: B is packed per (KC x NC) block into panels of NR columns (bfloat16 is widened to T
// while packing, so it costs nothing extra), unless the weights are stored packed already
// (WeightStorage::NativePacked), whose panels are read in place; A is read in place, MR rows at a
// time (2 MR for panels of at most NP / 2 packets, the last M % MR rows in a tile of their own
// height); a micro-kernel keeps an MR x NR tile of C in vector registers over KC. The packs come
// from the arena the caller passes (its thread's, in a Workspace), so nothing is allocated once
// warm.
//
// gemm(), small_product() and few_rows_product() keep the contract of ops/gemm.hpp: each element
// of C is one in-order chain of multiply-adds over k, so the three give the same bits. The packet
// loads, load_scalar() and the prefetch hints here are shared with the decode products
// (ops/detail/rows_product.hpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "moh/float16.hpp"
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

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

}  // namespace detail
}  // namespace moh

#include "moh/ops/detail/unroll_end.hpp"
