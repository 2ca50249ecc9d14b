// The few-query kernels of attend() (ops/attention_kernel.hpp): a decode step's few queries of
// one head, at most 4 at a time, against the keys and values where they lie (T or bfloat16
// widened in registers), with no layout: few_query_scores() and few_query_values(), and the two
// heads' values in one pass (few_query_values_pair()) that detail/attend.hpp pairs heads for.
// packet_size() and tiled_head() here are the tiled path's too.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "moh/ops/detail/packed_gemm.hpp"
#include "moh/ops/detail/rows_product.hpp"
#include "moh/runtime/tuning.hpp"
#include "moh/tensor.hpp"

#include "moh/ops/detail/unroll_begin.hpp"

namespace moh {

// Packet types are SIMD vector types with alignment attributes; naming them as template
// arguments makes GCC warn that those attributes are ignored, which is harmless here (the same
// pattern Eigen silences in its own headers).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"
#endif

namespace detail {

template <class T>
constexpr Index packet_size() {
  return Eigen::internal::unpacket_traits<GemmPacket<T>>::size;
}
/// Whether the register-tiled products apply to head size d (a whole number of packets).
template <class T>
constexpr bool tiled_head(Index d) {
  return packet_size<T>() > 1 && d % packet_size<T>() == 0;
}

// A decode step's few queries (a group of query heads over one key/value head): scores and
// weighted values straight from the keys and values where they lie (the cache's rows), one pass
// over each, nothing laid out. Below kPackedQueries queries a block of keys is not worth
// copying: each key is used by so few queries that the copy costs more than the products.
constexpr Index kPackedQueries = 8;

// The few-query kernels of 3 or more queries ask for the rows about this many bytes ahead of
// the one they read: their multiply-adds (32 per key for 4 queries of 128) slow the issue of
// loads enough that the hardware prefetcher alone leaves memory idle between them. A bfloat16
// cache is always prefetched; a float cache where KernelTuning::prefetch_float_cache says, as
// that helps on some cores and slows others. One query or two are not prefetched this way; one
// query over a float cache's rows back to back asks for one line of each row itself
// (one_query_sixteen_keys(), where have_sums_of_sixteen()).
constexpr Index kPrefetchAhead = 4096;

/// Whether the few-query kernels of NQ queries prefetch a cache of Src for compute type T.
template <class T, int NQ, class Src>
bool prefetch_few_query() {
  return NQ >= 3 && (!std::is_same<Src, T>::value || prefetch_float_cache());
}

/// Rows ahead to prefetch for rows of `row_bytes`.
inline Index prefetch_rows(Index row_bytes) {
  return std::max<Index>(1, kPrefetchAhead / std::max<Index>(1, row_bytes));
}

/// out[j] = the sum of the lanes of a[j] for j < 4. With AVX-512 floats the four sums share
/// their shuffles (14 instructions for four, against about 10 each one by one), in the order of
/// Eigen's predux with AVX512DQ (halves of 8, then of 4, then pairs), so that a score's bits do
/// not depend on which of the two reduced it; without DQ predux adds in another order, so this
/// falls back to it.
template <class T>
inline void sums_of_four(const GemmPacket<T>* a, T* out) {
#if defined(EIGEN_VECTORIZE_AVX512) && defined(EIGEN_VECTORIZE_AVX512DQ)
  if constexpr (std::is_same_v<T, float> && packet_size<T>() == 16) {
    // 128-bit lanes of u01: [a0 l0 + l2, a0 l1 + l3, a1 l0 + l2, a1 l1 + l3]; u23 alike.
    const __m512 u01 = _mm512_add_ps(_mm512_shuffle_f32x4(a[0], a[1], 0x44),
                                     _mm512_shuffle_f32x4(a[0], a[1], 0xEE));
    const __m512 u23 = _mm512_add_ps(_mm512_shuffle_f32x4(a[2], a[3], 0x44),
                                     _mm512_shuffle_f32x4(a[2], a[3], 0xEE));
    // Lane j: four partial sums of a[j]; then each lane's four added within it.
    const __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(u01, u23, 0x88),
                                   _mm512_shuffle_f32x4(u01, u23, 0xDD));
    const __m512 x = _mm512_add_ps(w, _mm512_permute_ps(w, 0x4E));  // elements (2, 3, 0, 1)
    const __m512 y = _mm512_add_ps(x, _mm512_permute_ps(x, 0xB1));  // elements (1, 0, 3, 2)
    const __m512i first = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
    _mm_storeu_ps(out, _mm512_castps512_ps128(_mm512_permutexvar_ps(first, y)));
    return;
  }
#endif
  for (int j = 0; j < 4; ++j) out[j] = Eigen::internal::predux(a[j]);
}

/// Whether scaled_sums_of_sixteen() reduces packets of T here (AVX-512 floats with DQ, where
/// sums_of_four() follows predux's order).
template <class T>
constexpr bool have_sums_of_sixteen() {
#if defined(EIGEN_VECTORIZE_AVX512) && defined(EIGEN_VECTORIZE_AVX512DQ)
  return std::is_same_v<T, float> && packet_size<T>() == 16;
#else
  return false;
#endif
}

/// out[j] = scale * (the sum of the lanes of a[j]) for j < 16, stored as one packet: each level
/// of predux's tree (elements i and i + 8, then i + 4, i + 2, i + 1) done for all sixteen at
/// once, two packets into one per shuffle pair, so each sum has the bits of predux(a[j]) (46
/// shuffles and adds for sixteen, against 14 per four with sums_of_four() and a scalar multiply
/// and store per sum). Only where have_sums_of_sixteen<T>().
template <class T>
inline void scaled_sums_of_sixteen([[maybe_unused]] const GemmPacket<T>* a,
                                   [[maybe_unused]] T scale, [[maybe_unused]] T* out) {
#if defined(EIGEN_VECTORIZE_AVX512) && defined(EIGEN_VECTORIZE_AVX512DQ)
  if constexpr (have_sums_of_sixteen<T>()) {
    // Halves of 8: 128-bit lanes of t[m] are [a0 l0 + l2, a0 l1 + l3, a1 l0 + l2, a1 l1 + l3]
    // for a0 = a[2m], a1 = a[2m + 1].
    __m512 t[8];
    for (int m = 0; m < 8; ++m)
      t[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0x44),
                           _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0xEE));
    // Halves of 4: lane k of u[n] holds the four partial sums of a[4n + k].
    __m512 u[4];
    for (int n = 0; n < 4; ++n)
      u[n] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * n], t[2 * n + 1], 0x88),
                           _mm512_shuffle_f32x4(t[2 * n], t[2 * n + 1], 0xDD));
    // Elements e and e + 2 within a lane: lane k of v0 is [a[k]: e0 + e2, e1 + e3, a[4 + k]:
    // the same], of v1 the same for a[8 + k] and a[12 + k].
    const __m512 v0 = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x44),
                                    _mm512_shuffle_ps(u[0], u[1], 0xEE));
    const __m512 v1 = _mm512_add_ps(_mm512_shuffle_ps(u[2], u[3], 0x44),
                                    _mm512_shuffle_ps(u[2], u[3], 0xEE));
    // Pairs: lane k of w is the sums of a[k], a[4 + k], a[8 + k], a[12 + k]; then transposed.
    const __m512 w =
        _mm512_add_ps(_mm512_shuffle_ps(v0, v1, 0x88), _mm512_shuffle_ps(v0, v1, 0xDD));
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_set1_ps(scale), _mm512_permutexvar_ps(order, w)));
  }
#endif
}

/// Steps of sixteen keys ahead that one_query_sixteen_keys() asks for over rows back to back.
constexpr Index kSixteenKeysAhead = 2;

/// S[c] = scale * q . k_c for one query over the first nk / 16 * 16 keys (rows at k_stride) of a
/// cache in T, sixteen keys at a time: each query packet loaded once for the sixteen rows (read
/// side by side: packet x of each in turn), the sums reduced together (scaled_sums_of_sixteen(),
/// so only where have_sums_of_sixteen<T>()). Returns the keys taken. DS > 0: rows of exactly DS
/// packets, back to back (k_stride = head_dim = DS packets, a KvCache's rows), so that every load
/// is at a fixed offset from one pointer (with the stride known only at run time GCC keeps
/// sixteen row pointers, some in vector registers, and reads the keys slower). Rows back to back
/// also ask for the first line of each of the sixteen rows kSixteenKeysAhead steps ahead, the
/// rest of each row left to the hardware prefetcher, which keeps memory busier.
template <class T, int DS>
Index one_query_sixteen_keys(const T* q, const T* k, Index k_stride, Index nk, Index head_dim,
                             T scale, T* S) {
  using P = GemmPacket<T>;
  constexpr Index L = packet_size<T>();
  const Index d = DS > 0 ? DS * L : head_dim;
  const Index stride = DS > 0 ? DS * L : k_stride;
  eigen_assert(d == head_dim && stride == k_stride &&
               "one_query_sixteen_keys: rows of DS packets, back to back");
  Index c = 0;
  for (; c + 16 <= nk; c += 16) {
    P acc[16];
    for (int j = 0; j < 16; ++j) acc[j] = Eigen::internal::pset1<P>(T(0));
    const T* kc = k + c * stride;
    if constexpr (DS > 0) {
      if (c + (kSixteenKeysAhead + 1) * 16 <= nk)
        for (int j = 0; j < 16; ++j) prefetch_bytes(kc + (kSixteenKeysAhead * 16 + j) * stride, 1);
    }
    for (Index x = 0; x < d; x += L) {
      const P qv = Eigen::internal::ploadu<P>(q + x);
      for (int j = 0; j < 16; ++j)
        acc[j] = Eigen::internal::pmadd(qv, Eigen::internal::ploadu<P>(kc + j * stride + x),
                                        acc[j]);
    }
    scaled_sums_of_sixteen<T>(acc, scale, S + c);
  }
  return c;
}

/// Calls fn(std::integral_constant<int, P>{}) for P = packets where that is a common head size,
/// 2, 4, 8 or 16 packets (32, 64, 128 or 256 floats with AVX-512), which the decode kernels
/// compile with the head's packets known; returns whether it did. The one list of those sizes.
template <class Fn>
constexpr bool with_head_packets(Index packets, Fn&& fn) {
  const auto one = [&](auto p) {
    if (packets != decltype(p)::value) return false;
    fn(p);
    return true;
  };
  return one(std::integral_constant<int, 2>{}) || one(std::integral_constant<int, 4>{}) ||
         one(std::integral_constant<int, 8>{}) || one(std::integral_constant<int, 16>{});
}

/// The packets of the rows that one_query_sixteen_keys() reads at fixed offsets for one query
/// over keys in Src of head_dim at k_stride: heads of 2, 4, 8 or 16 packets (32, 64, 128 or 256
/// floats with AVX-512) of a cache in T, in rows back to back, where have_sums_of_sixteen<T>()
/// (AVX-512 with DQ); 0 when the rows take the run-time stride.
template <class T, class Src>
constexpr Index fixed_key_rows(Index head_dim, Index k_stride) {
  if (!std::is_same_v<Src, T> || !have_sums_of_sixteen<T>() || k_stride != head_dim ||
      head_dim % packet_size<T>() != 0)
    return 0;
  const Index packets = head_dim / packet_size<T>();
  return with_head_packets(packets, [](auto) {}) ? packets : 0;
}

/// Parts of a block's keys that the scores read side by side where AVX-512 is off: key i of
/// each part in step, each part one stream in memory order, which reads a cache faster than one
/// key at a time (3 parts: 12 accumulators, 3 key packets and a query packet fill AVX2's 16
/// registers). AVX-512: see score_parts().
constexpr int kScoreParts = 3;

/// Parts of a block's keys that the scores of NQ queries read side by side (kScoreParts where
/// AVX-512 is off). With AVX-512, one part (one query over a cache in T: four neighbouring keys at
/// a time, sixteen with DQ; three or four queries: one key at a time) except for one or two
/// queries over a bfloat16 cache, 4 parts, and two over a cache in T, 2, where parts stream
/// faster. NQ is a chunk of for_query_chunks(), so a group of 5-7 queries ends with a chunk of
/// one to three.
template <class T, int NQ, class Src>
constexpr int score_parts() {
#if defined(EIGEN_VECTORIZE_AVX512)
  if constexpr (NQ > 2) return 1;
  if constexpr (!std::is_same_v<Src, T>) return 4;
  return NQ == 2 ? 2 : 1;
#else
  return kScoreParts;
#endif
}

/// Whether few_query_scores_of() reads its NQ > 1 float queries of DP packets (DP > 0) from a
/// copy at fixed offsets, rather than at their stride: with AVX-512, where they fit its 32
/// registers beside the NQ x KS x KB sums and KS x KB key packets of a step. At the stride
/// (known only at run time) GCC 12 keeps a pointer per query packet, most in vector registers,
/// and moves one to a general register before each multiply-add; from the copy it keeps the
/// query packets in registers, which is faster. Four float queries of 128 (32 packets, every
/// register) and builds without AVX-512 keep the stride.
template <class T, int NQ, int DP, int KS, int KB>
constexpr bool local_queries() {
#if defined(EIGEN_VECTORIZE_AVX512)
  return std::is_same_v<T, float> && NQ > 1 && DP > 0 && NQ * DP + NQ * KS * KB + KS * KB <= 32;
#else
  return false;
#endif
}

/// S[r, c] = scale * q_r . k_c for NQ queries (rows at q_stride) and nk keys (rows at
/// k_stride) of d = whole packets; S rows at ld. Each score is a packet-wise sum over d (one
/// chain over the packets in order), then reduced. With score_parts() > 1, that many parts of
/// the keys side by side, one key of each at a time, each key's row read once for all the
/// queries (whose packets come from L1); the keys left over one by one. With one part (AVX-512),
/// one query over a cache in T: four keys at a time, each key's row read in order (sixteen keys
/// with DQ, their rows read side by side); three or more queries: one key at a time (neighbouring
/// keys in step defeat the hardware prefetcher there). The sums and their order are the same
/// either way.
/// DP: the head's packets when known at compile time (the loops over d unrolled, which is
/// faster), 0 when not. The loops over the accumulators of a step of one key per part, or of 3
/// or more queries, are unrolled by hint (MOH_DETAIL_UNROLL_REGISTERS), so that GCC keeps the
/// accumulators in registers rather than on the stack.
template <class T, int NQ, int DP, class Src>
void few_query_scores_of(const T* q, Index q_stride, const Src* k, Index k_stride, Index nk,
                         Index head_dim, T scale, T* S, Index ld) {
  using P = GemmPacket<T>;
  constexpr Index L = packet_size<T>();
  const Index d = DP > 0 ? DP * L : head_dim;
  constexpr int KS = score_parts<T, NQ, Src>();
  constexpr int KB = NQ >= 3 || KS > 1 ? 1 : 4;
  constexpr int kSums = NQ * KS * KB;
  const Index row_bytes = d * static_cast<Index>(sizeof(Src));
  const Index ahead = prefetch_rows(row_bytes);
  const bool prefetch = prefetch_few_query<T, NQ, Src>();
  eigen_assert((DP == 0 || head_dim == DP * L) && "few_query_scores_of: heads of DP packets");
  constexpr bool kLocal = local_queries<T, NQ, DP, KS, KB>();
  alignas(kLocal ? 64 : alignof(T)) T q_local[kLocal ? NQ * DP * L : 1];
  if constexpr (kLocal)
    for (int r = 0; r < NQ; ++r)
      std::copy(q + r * q_stride, q + r * q_stride + DP * L, q_local + r * DP * L);
  // Query r's packet at column x.
  const auto query = [&](int r, Index x) MOH_DETAIL_INLINE_LAMBDA {
    if constexpr (kLocal)
      return Eigen::internal::ploadu<P>(q_local + r * (DP * L) + x);
    else
      return Eigen::internal::ploadu<P>(q + r * q_stride + x);
  };
  Index c = 0;
  if constexpr (NQ == 1 && std::is_same_v<Src, T> && have_sums_of_sixteen<T>())
    c = one_query_sixteen_keys<T, 0>(q, k, k_stride, nk, d, scale, S);
  // Keys c + s part + i + j (part s < KS, step i, key j < KB of the step) in whole steps
  // (for_parts()); the keys left over one by one below. A part asks for its own keys ahead (the
  // last part also for those left over), never for the next part's, which were read already,
  // and for none past them.
  const Index taken = for_parts<KS, KB>(nk - c, [&](Index i, Index part) MOH_DETAIL_INLINE_LAMBDA {
    const Src* kc = k + (c + i) * k_stride;  // part s's keys at kc + s * part * k_stride
    if (prefetch)
      for (int s = 0; s < KS; ++s) {
        const Index last = s + 1 < KS ? c + (s + 1) * part - 1 : nk - 1;
        for (int j = 0; j < KB; ++j) {
          const Index key = c + s * part + i + j + ahead;
          if (key <= last) prefetch_bytes(k + key * k_stride, row_bytes);
        }
      }
    P acc[NQ][KS * KB];
    MOH_DETAIL_UNROLL_REGISTERS
    for (int r = 0; r < NQ; ++r) {
      MOH_DETAIL_UNROLL_REGISTERS
      for (int j = 0; j < KS * KB; ++j) acc[r][j] = Eigen::internal::pset1<P>(T(0));
    }
    if constexpr (KB == 1) {
      MOH_DETAIL_UNROLL_REGISTERS
      for (Index x = 0; x < d; x += L) {
        P kv[KS];
        MOH_DETAIL_UNROLL_REGISTERS
        for (int s = 0; s < KS; ++s) kv[s] = load_packet<T>(kc + s * part * k_stride + x);
        MOH_DETAIL_UNROLL_REGISTERS
        for (int r = 0; r < NQ; ++r) {
          const P qv = query(r, x);
          MOH_DETAIL_UNROLL_REGISTERS
          for (int s = 0; s < KS; ++s) acc[r][s] = Eigen::internal::pmadd(qv, kv[s], acc[r][s]);
        }
      }
    } else {
      for (int j = 0; j < KB; ++j)
        for (Index x = 0; x < d; x += L) {
          const P kv = load_packet<T>(kc + j * k_stride + x);
          for (int r = 0; r < NQ; ++r)
            acc[r][j] = Eigen::internal::pmadd(query(r, x), kv, acc[r][j]);
        }
    }
    T sums[kSums];  // in (r, s, j) order
    int n = 0;
    for (; n + 4 <= kSums; n += 4) sums_of_four<T>(&acc[0][0] + n, sums + n);
    for (; n < kSums; ++n) sums[n] = Eigen::internal::predux((&acc[0][0])[n]);
    for (int r = 0; r < NQ; ++r)
      for (int s = 0; s < KS; ++s)
        for (int j = 0; j < KB; ++j)
          S[r * ld + c + s * part + i + j] = scale * sums[(r * KS + s) * KB + j];
  });
  for (c += taken; c < nk; ++c)
    for (int r = 0; r < NQ; ++r) {
      P acc = Eigen::internal::pset1<P>(T(0));
      for (Index x = 0; x < d; x += L)
        acc = Eigen::internal::pmadd(query(r, x), load_packet<T>(k + c * k_stride + x), acc);
      S[r * ld + c] = scale * Eigen::internal::predux(acc);
    }
}

template <class T, int NQ, class Src>
void few_query_scores(const T* q, Index q_stride, const Src* k, Index k_stride, Index nk, Index d,
                      T scale, T* S, Index ld) {
  // One query over rows back to back: sixteen keys at a time at fixed offsets, the keys left
  // over below.
  if constexpr (NQ == 1 && std::is_same_v<Src, T> && have_sums_of_sixteen<T>()) {
    Index c = 0;
    with_head_packets(fixed_key_rows<T, Src>(d, k_stride), [&](auto ds) {
      c = one_query_sixteen_keys<T, decltype(ds)::value>(q, k, k_stride, nk, d, scale, S);
    });
    if (c > 0) {
      few_query_scores_of<T, 1, 0>(q, q_stride, k + c * k_stride, k_stride, nk - c, d, scale,
                                   S + c, ld);
      return;
    }
  }
  // One query keeps the loop over d (DP = 0): with AVX-512's four neighbouring keys unrolled,
  // GCC interleaves the loads of their rows, which reads the cache slower; its parts (without
  // AVX-512, or over a bfloat16 cache: score_parts()) unroll it by hint.
  if constexpr (NQ > 1) {
    if (with_head_packets(d / packet_size<T>(), [&](auto dp) {
          few_query_scores_of<T, NQ, decltype(dp)::value>(q, q_stride, k, k_stride, nk, d, scale,
                                                           S, ld);
        }))
      return;
  }
  few_query_scores_of<T, NQ, 0>(q, q_stride, k, k_stride, nk, d, scale, S, ld);
}

/// Whether the passes of the weighted values over a run ask for the next run (NextRunLines):
/// without AVX-512, where several passes go over each run; AVX-512's two passes do not ask.
#ifdef EIGEN_VECTORIZE_AVX512
constexpr bool kValueNextRun = false;
#else
constexpr bool kValueNextRun = true;
#endif

/// The lines of the run of keys that the weighted values read next, asked for one at a time,
/// `every` steps of one key apart, while the passes of the current run find it in the caches:
/// otherwise memory is busy only while the first passes read their columns of a run. Rows of
/// row_bytes at `stride` bytes, each asked for from its first byte, a line (64 bytes) at a time,
/// in order (a row that starts inside a line leaves the last line it reaches into unasked; the
/// cache's rows of 128 floats or bfloat16 start on lines). The row pointer never moves past the
/// last row. A hint: it changes no result.
struct NextRunLines {
  const char* row = nullptr;  // the row being asked for
  Index rows_left = 0;        // from `row` on
  Index stride = 0;
  Index row_bytes = 0;
  Index offset = 0;  // of the next line in `row`
  Index every = 1;
  Index countdown = 1;

  /// The lines of `rows` rows of `row_bytes` from `first`, at `stride` bytes, spread over
  /// `steps` steps: one every steps / lines (at least 1), so that all are asked for within the
  /// steps when there are as many steps as lines or more.
  static NextRunLines over(const void* first, Index rows, Index stride, Index row_bytes,
                           Index steps) {
    NextRunLines n;
    if (rows <= 0 || row_bytes <= 0) return n;
    n.row = static_cast<const char*>(first);
    n.rows_left = rows;
    n.stride = stride;
    n.row_bytes = row_bytes;
    const Index lines = rows * ((row_bytes + 63) / 64);
    n.every = n.countdown = std::max<Index>(1, steps / lines);
    return n;
  }

  /// One step of one key: every `every` steps, asks for the next line (none past the last row)
  /// and returns it; else null.
  EIGEN_ALWAYS_INLINE const char* step() {
    if (--countdown > 0 || rows_left == 0) return nullptr;
    countdown = every;
    const char* line = row + offset;
    prefetch_lines(line, std::make_integer_sequence<Index, 1>{});
    offset += 64;
    if (offset >= row_bytes) {
      offset = 0;
      if (--rows_left > 0) row += stride;
    }
    return line;
  }
};

/// A[r, x0 : x0 + NP L] += sum_c W[r, c] v_c[x0 : ...] for NQ rows: the accumulators stay in
/// registers over all nk keys (each element one chain over c in order).
/// `next` (optional) takes one step per key (a copy in registers while the keys go by).
/// With kPrefetch, also asks for the panel's columns of row c + ahead (at most row pf_last)
/// while reading row c, for rows of row_bytes. A compile-time choice, and a fixed number of
/// lines: with a loop over a row's lines in the loop over keys (even one run 0 times) GCC keeps
/// the 16 accumulators of 2 queries x 8 packets on the stack.
template <class T, int NQ, int NP, class Src, bool kPrefetch = false>
void few_query_values_panel(const T* W, Index ldw, const Src* v, Index v_stride, Index nk,
                            Index x0, T* A, Index lda, [[maybe_unused]] Index row_bytes = 0,
                            [[maybe_unused]] Index pf_last = 0, NextRunLines* next = nullptr) {
  using P = GemmPacket<T>;
  constexpr Index L = packet_size<T>();
  constexpr Index kLines = (NP * L * Index(sizeof(Src)) + 63) / 64;  // of the panel's columns
  [[maybe_unused]] const Index ahead = kPrefetch ? prefetch_rows(row_bytes) : 0;
  // The caller's next-run steps, in registers while the keys go by, handed back at the end.
  [[maybe_unused]] NextRunLines lines;
  [[maybe_unused]] const auto hand_back = [&] {
    if constexpr (kValueNextRun)
      if (next != nullptr) *next = lines;
  };
  if constexpr (kValueNextRun)
    if (next != nullptr) lines = *next;
#if defined(EIGEN_VECTORIZE_AVX2)
  // A bfloat16 cache, pairs of packets: each full-width load (64 bytes with AVX-512, 32 with
  // AVX2) widened into its even and its odd columns (widen_even_odd(): a shift and a mask,
  // against a widening shuffle and a shift per packet), the accumulators held in the same order
  // between split_even_odd() and merge_even_odd(). Each column's chain is the same, so are its
  // bits.
  if constexpr (even_odd_widening<T, Src>() && NP % 2 == 0) {
    constexpr int kPairs = NP / 2;
    P ev[NQ][kPairs], od[NQ][kPairs];
    MOH_DETAIL_UNROLL_REGISTERS
    for (int r = 0; r < NQ; ++r) {
      MOH_DETAIL_UNROLL_REGISTERS
      for (int q = 0; q < kPairs; ++q)
        split_even_odd(Eigen::internal::ploadu<P>(A + r * lda + x0 + 2 * q * L),
                       Eigen::internal::ploadu<P>(A + r * lda + x0 + (2 * q + 1) * L), ev[r][q],
                       od[r][q]);
    }
    for (Index c = 0; c < nk; ++c) {
      if constexpr (kPrefetch)
        prefetch_lines(v + std::min(c + ahead, pf_last) * v_stride + x0,
                       std::make_integer_sequence<Index, kLines>{});
      if constexpr (kValueNextRun) lines.step();
      P ve[kPairs], vo[kPairs];
      MOH_DETAIL_UNROLL_REGISTERS
      for (int q = 0; q < kPairs; ++q)
        widen_even_odd(v + c * v_stride + x0 + 2 * q * L, ve[q], vo[q]);
      MOH_DETAIL_UNROLL_REGISTERS
      for (int r = 0; r < NQ; ++r) {
        const P w = Eigen::internal::pset1<P>(W[r * ldw + c]);
        MOH_DETAIL_UNROLL_REGISTERS
        for (int q = 0; q < kPairs; ++q) {
          ev[r][q] = Eigen::internal::pmadd(w, ve[q], ev[r][q]);
          od[r][q] = Eigen::internal::pmadd(w, vo[q], od[r][q]);
        }
      }
    }
    MOH_DETAIL_UNROLL_REGISTERS
    for (int r = 0; r < NQ; ++r) {
      MOH_DETAIL_UNROLL_REGISTERS
      for (int q = 0; q < kPairs; ++q) {
        P a0, a1;
        merge_even_odd(ev[r][q], od[r][q], a0, a1);
        Eigen::internal::pstoreu(A + r * lda + x0 + 2 * q * L, a0);
        Eigen::internal::pstoreu(A + r * lda + x0 + (2 * q + 1) * L, a1);
      }
    }
    hand_back();
    return;
  }
#endif
  P acc[NQ][NP];
  MOH_DETAIL_UNROLL_REGISTERS
  for (int r = 0; r < NQ; ++r) {
    MOH_DETAIL_UNROLL_REGISTERS
    for (int j = 0; j < NP; ++j) acc[r][j] = Eigen::internal::ploadu<P>(A + r * lda + x0 + j * L);
  }
  for (Index c = 0; c < nk; ++c) {
    if constexpr (kPrefetch)
      prefetch_lines(v + std::min(c + ahead, pf_last) * v_stride + x0,
                     std::make_integer_sequence<Index, kLines>{});
    if constexpr (kValueNextRun) lines.step();
    P vv[NP];
    MOH_DETAIL_UNROLL_REGISTERS
    for (int j = 0; j < NP; ++j) vv[j] = load_packet<T>(v + c * v_stride + x0 + j * L);
    MOH_DETAIL_UNROLL_REGISTERS
    for (int r = 0; r < NQ; ++r) {
      const P w = Eigen::internal::pset1<P>(W[r * ldw + c]);
      MOH_DETAIL_UNROLL_REGISTERS
      for (int j = 0; j < NP; ++j) acc[r][j] = Eigen::internal::pmadd(w, vv[j], acc[r][j]);
    }
  }
  MOH_DETAIL_UNROLL_REGISTERS
  for (int r = 0; r < NQ; ++r) {
    MOH_DETAIL_UNROLL_REGISTERS
    for (int j = 0; j < NP; ++j) Eigen::internal::pstoreu(A + r * lda + x0 + j * L, acc[r][j]);
  }
  hand_back();
}

/// few_query_values_panel over the last `packets` (<= NP) packets of columns from x0.
template <class T, int NQ, int NP, class Src, bool kPrefetch = false>
void few_query_values_rest(Index packets, const T* W, Index ldw, const Src* v, Index v_stride,
                           Index nk, Index x0, T* A, Index lda, Index row_bytes = 0,
                           Index pf_last = 0, NextRunLines* next = nullptr) {
  if constexpr (NP > 1) {
    if (packets < NP) {
      few_query_values_rest<T, NQ, NP - 1, Src, kPrefetch>(packets, W, ldw, v, v_stride, nk, x0,
                                                           A, lda, row_bytes, pf_last, next);
      return;
    }
  }
  few_query_values_panel<T, NQ, NP, Src, kPrefetch>(W, ldw, v, v_stride, nk, x0, A, lda,
                                                    row_bytes, pf_last, next);
}

// Accumulators the weighted-value panels keep in registers: half of AVX-512's 32 vector
// registers or of AVX2's 16 (other targets get 8 too), the rest for the value packets loaded and
// the broadcast weight (a wider panel leaves GCC short, and it keeps its accumulators on the
// stack).
#ifdef EIGEN_VECTORIZE_AVX512
constexpr int kValueAccumulators = 16;
#else
constexpr int kValueAccumulators = 8;
#endif

// Keys per run of the weighted values' passes (few_query_values()), and the most bytes of
// values a run holds where that is less: runs of 64 float rows of 128 (32 KiB) keep the later
// passes of AVX2's pairs in L1, where 128 would send them to L2. AVX-512's 2 passes of 2
// queries keep 128 keys of any size.
constexpr Index kValueRun = 128;
#ifdef EIGEN_VECTORIZE_AVX512
constexpr Index kValueRunBytes = std::numeric_limits<Index>::max();
#else
constexpr Index kValueRunBytes = 32 * 1024;
#endif

/// Keys per run of the weighted values for rows of `row_bytes`.
inline Index value_run(Index row_bytes) {
  return std::max<Index>(16, std::min(kValueRun, kValueRunBytes / std::max<Index>(1, row_bytes)));
}

/// Packets of columns per query that decide the groups of few_query_values(): all the queries
/// in one group if they fit kValueAccumulators at this many each (or the head's fewer), else
/// pairs. Half the accumulators, so that a pair always fits: with AVX2's 8, 3 or 4 queries go
/// in pairs over 4 packets, and 2 queries in one group over 4, rather than one by one over 8,
/// which widens or loads each value packet once for two queries (4 queries of 128: the same 8
/// passes over a run); one query keeps 8 packets. AVX-512 keeps its groups (2 queries over 8
/// packets).
constexpr int value_group_packets() { return std::min(8, kValueAccumulators / 2); }

/// Packets of columns a weighted-value panel of `queries` queries spans.
constexpr int value_panel_packets(int queries) {
  return std::min(8, std::max(1, kValueAccumulators / queries));
}

/// Column panels (passes over the keys) of a group of `queries` queries over d columns (whole
/// packets): value_panel_packets(queries) packets each, the packets left, fewer, in one more.
template <class T>
constexpr Index value_panels(int queries, Index d) {
  const Index cols = value_panel_packets(queries) * packet_size<T>();
  return (d + cols - 1) / cols;
}

/// A[QP, d] += W[QP, nk] V[nk, d] for one group of QP queries, in value_panels<T>(QP, d) column
/// panels. With kPrefetch every panel asks for its own columns of the rows ahead (rows of
/// row_bytes, at most row pf_last). `next` (optional): see few_query_values_panel().
template <class T, int QP, class Src, bool kPrefetch>
void few_query_values_group(const T* W, Index ldw, const Src* v, Index v_stride, Index nk,
                            Index d, T* A, Index lda, Index row_bytes, Index pf_last,
                            NextRunLines* next) {
  constexpr Index L = packet_size<T>();
  constexpr int NP = value_panel_packets(QP);
  constexpr int kRest = NP > 1 ? NP - 1 : 1;
  Index x0 = 0;
  [[maybe_unused]] Index panels = 0;
  for (; x0 + NP * L <= d; x0 += NP * L, ++panels)
    few_query_values_panel<T, QP, NP, Src, kPrefetch>(W, ldw, v, v_stride, nk, x0, A, lda,
                                                      row_bytes, pf_last, next);
  // A head of 4 packets with one query is one panel of 4 chains, not 4 passes with one each.
  if (x0 < d) {
    few_query_values_rest<T, QP, kRest, Src, kPrefetch>((d - x0) / L, W, ldw, v, v_stride, nk, x0,
                                                        A, lda, row_bytes, pf_last, next);
    ++panels;
  }
  eigen_assert(panels == value_panels<T>(QP, d) && "the passes few_query_values() counted");
}

/// A[NQ, d] += W[NQ, nk] V[nk, d] (V rows at v_stride, d whole packets). The queries go in
/// groups, all NQ in one if their accumulators over value_group_packets() packets (or the
/// head's fewer) fit kValueAccumulators, else in pairs (and the last one alone for an odd NQ),
/// each group in column panels.
template <class T, int NQ, class Src>
void few_query_values(const T* W, Index ldw, const Src* v, Index v_stride, Index nk, Index d, T* A,
                      Index lda) {
  constexpr Index L = packet_size<T>();
  static_assert(2 * value_group_packets() <= kValueAccumulators, "pairs always fit");
  const Index wide = std::min<Index>(value_group_packets(), d / L);
  const bool together = NQ <= 2 || NQ * wide <= kValueAccumulators;
  // fn(std::integral_constant<int, QP>{}, r0) for each group of QP queries from r0, in order.
  const auto for_groups = [&](auto&& fn) {
    if (together) {
      fn(std::integral_constant<int, NQ>{}, Index(0));
    } else if constexpr (NQ > 2) {
      Index r0 = 0;
      for (; r0 + 2 <= NQ; r0 += 2) fn(std::integral_constant<int, 2>{}, r0);
      if (r0 < NQ) fn(std::integral_constant<int, 1>{}, r0);
    }
  };
  // The passes of all the groups over a run: each group's column panels (the last narrower).
  Index passes = 0;
  for_groups([&](auto queries, Index) { passes += value_panels<T>(decltype(queries)::value, d); });
  // More than one pass (groups or panels) goes over the values in runs of value_run() keys,
  // every pass per run, so that the later passes find the run in L1/L2 (each element's chain
  // over the keys stays in order: its accumulator is stored and reloaded between runs, exactly).
  // Meanwhile the passes ask for the next run's lines, spread evenly over their steps.
  const Index row_bytes = d * static_cast<Index>(sizeof(Src));
  const bool one_pass = passes <= 1;
  const Index run = one_pass ? nk : value_run(row_bytes);
  // For 3 or more queries (as the scores), the first group's panels ask for their columns of
  // the rows ahead, up to the block's last (the later groups find them in the caches).
  const bool prefetch = prefetch_few_query<T, NQ, Src>();
  for (Index c0 = 0; c0 < nk; c0 += run) {
    const Index n = std::min(run, nk - c0);
    const Src* vr = v + c0 * v_stride;
    const Index next_rows = std::min(run, nk - c0 - n);
    NextRunLines next;
    if (kValueNextRun && next_rows > 0)
      next = NextRunLines::over(vr + n * v_stride, next_rows,
                                v_stride * static_cast<Index>(sizeof(Src)), row_bytes, passes * n);
    NextRunLines* ask = kValueNextRun && next_rows > 0 ? &next : nullptr;
    for_groups([&](auto queries, Index r0) {
      constexpr int QP = decltype(queries)::value;
      const T* w = W + r0 * ldw + c0;
      if (prefetch && r0 == 0)
        few_query_values_group<T, QP, Src, true>(w, ldw, vr, v_stride, n, d, A + r0 * lda, lda,
                                                 row_bytes, nk - c0 - 1, ask);
      else
        few_query_values_group<T, QP, Src, false>(w, ldw, vr, v_stride, n, d, A + r0 * lda, lda,
                                                  row_bytes, nk - c0 - 1, ask);
    });
  }
}

/// Whether attend_heads() pairs the heads of a decode step (attend_head_pairs()), as it streams
/// memory faster on AVX2 and AVX-512 builds; SSE-only and vectorized non-x86 builds pair too.
/// The switch that turns the pairs off.
constexpr bool kPairedValues = true;

/// Packets per head of the heads whose weighted values pair (few_query_values_pair()): one
/// query's whole panel (value_panel_packets(1): 64 floats with AVX2, 128 with AVX-512, 32 with
/// SSE alone), or half of it (32, 64, 16).
constexpr int kPairedPanel = value_panel_packets(1);
constexpr int kPairedHalfPanel = value_panel_packets(1) / 2;
static_assert(kPairedHalfPanel * 2 == kPairedPanel, "a panel of two halves");

/// The packets of a head of d columns whose weighted values pair (few_query_values_pair()):
/// kPairedPanel for one query's whole panel, kPairedHalfPanel for half of it, else 0.
template <class T>
constexpr int paired_values_packets(Index d) {
  if (!tiled_head<T>(d)) return 0;
  if (d == kPairedPanel * packet_size<T>()) return kPairedPanel;
  if (d == kPairedHalfPanel * packet_size<T>()) return kPairedHalfPanel;
  return 0;
}

/// Whether one query's weighted values over a head of d columns are one panel or half of one
/// (paired_values_packets()), so that two such queries over their own values can share a pass.
template <class T>
constexpr bool paired_values_head(Index d) {
  return paired_values_packets<T>(d) != 0;
}

/// a0[0 : d) += sum_c w0[c] v0_c over n0 values (rows at vs0), and a1 the same over its own
/// n1 values, for heads of NP packets (paired_values_packets(d)): both read in one pass while
/// both have keys left, then the longer alone: two streams in memory where one query's values
/// are one, which is faster. Each element is one chain over its keys in order from a0 or a1,
/// few_query_values()'s, so are its bits. Whole panels with AVX2: the two heads' 16
/// accumulators and two weights leave 3 accumulators on the stack. Half panels take 8
/// accumulators, and AVX-512's whole panels 16 of its 32 registers.
template <class T, int NP>
void few_query_values_pair(const T* w0, const T* v0, Index vs0, Index n0, T* a0, const T* w1,
                           const T* v1, Index vs1, Index n1, T* a1) {
  using P = GemmPacket<T>;
  static_assert(NP == kPairedPanel || NP == kPairedHalfPanel, "heads that pair");
  constexpr Index L = packet_size<T>();
  P acc0[NP], acc1[NP];
  MOH_DETAIL_UNROLL_REGISTERS
  for (int j = 0; j < NP; ++j) {
    acc0[j] = Eigen::internal::ploadu<P>(a0 + j * L);
    acc1[j] = Eigen::internal::ploadu<P>(a1 + j * L);
  }
  const Index both = std::min(n0, n1);
  for (Index c = 0; c < both; ++c) {
    const P x0 = Eigen::internal::pset1<P>(w0[c]);
    const P x1 = Eigen::internal::pset1<P>(w1[c]);
    MOH_DETAIL_UNROLL_REGISTERS
    for (int j = 0; j < NP; ++j) {
      acc0[j] = Eigen::internal::pmadd(x0, Eigen::internal::ploadu<P>(v0 + c * vs0 + j * L),
                                       acc0[j]);
      acc1[j] = Eigen::internal::pmadd(x1, Eigen::internal::ploadu<P>(v1 + c * vs1 + j * L),
                                       acc1[j]);
    }
  }
  MOH_DETAIL_UNROLL_REGISTERS
  for (int j = 0; j < NP; ++j) {
    Eigen::internal::pstoreu(a0 + j * L, acc0[j]);
    Eigen::internal::pstoreu(a1 + j * L, acc1[j]);
  }
  // The longer one's last keys, on from where its chain stopped.
  if (n0 > both)
    few_query_values_panel<T, 1, NP, T>(w0 + both, 0, v0 + both * vs0, vs0, n0 - both, 0, a0, 0);
  if (n1 > both)
    few_query_values_panel<T, 1, NP, T>(w1 + both, 0, v1 + both * vs1, vs1, n1 - both, 0, a1, 0);
}

/// Calls fn(std::integral_constant<int, n>{}, r0) for chunks of at most 4 of `rows` rows.
template <class Fn>
void for_query_chunks(Index rows, Fn&& fn) {
  for (Index r0 = 0; r0 < rows; r0 += 4) {
    switch (std::min<Index>(4, rows - r0)) {
      case 4: fn(std::integral_constant<int, 4>{}, r0); break;
      case 3: fn(std::integral_constant<int, 3>{}, r0); break;
      case 2: fn(std::integral_constant<int, 2>{}, r0); break;
      default: fn(std::integral_constant<int, 1>{}, r0); break;
    }
  }
}

}  // namespace detail

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

}  // namespace moh

#include "moh/ops/detail/unroll_end.hpp"
