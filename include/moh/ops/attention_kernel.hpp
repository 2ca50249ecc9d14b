// Scaled dot-product attention for one head: O = softmax(Q K^T * scale + bias + mask) V.
//
// Tiled over query and key blocks with an online softmax (running row max and row sum), so the
// scores of a whole head are never held: the extra memory is one [query block x key block] tile
// plus a [query block x d] accumulator, taken from the caller's workspace. Each query block is
// computed the same way whatever else runs, so results do not depend on how blocks are spread
// over threads.
//
// Masks: key j is hidden from a query at position p when it is padding or, if causal, when
// j > p + causal_shift (bottom-right alignment: causal_shift = S - T, the keys that precede the
// first query, e.g. a KV cache), or when an additive bias gives it -inf. A query that sees no key
// at all outputs zeros. The probabilities, when asked, are a second pass over the scores with the
// rows' final max and sum: nothing is spent on them otherwise.
//
// attention() checks its arguments and runs detail::attend(), whose route attend_route() picks:
// the tiled kernel below, the few-query kernels of ops/detail/few_query.hpp, or Eigen's products.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "moh/ops/detail/few_query.hpp"
#include "moh/ops/detail/packed_gemm.hpp"
#include "moh/runtime/workspace.hpp"
#include "moh/tensor.hpp"

#include "moh/ops/detail/unroll_begin.hpp"

namespace moh {

/// Which keys each query may see.
struct AttentionMasking {
  bool causal = false;
  Index causal_shift = 0;              // S - T for bottom-right causal alignment
  const bool* key_padding = nullptr;   // [S], true = padding; null = none
};

/// Positions of the queries handed to attention(): list[i] when given (any order), else first + i.
struct QueryPositions {
  const Index* list = nullptr;
  Index first = 0;
  Index operator[](Index i) const { return list ? list[i] : first + i; }
};

/// The queries of one head: [count, head_dim] at row stride `stride`; scores are
/// scale * q . k (1 / sqrt(head_dim) for scaled dot-product attention). Not owned.
template <class T>
struct AttentionQueries {
  const T* data = nullptr;
  Index stride = 0;
  Index count = 0;
  Index head_dim = 0;
  T scale = T(1);
  QueryPositions positions;  // for the causal mask
};

/// The keys and values of one head: [count, head_dim] each, at their row strides, in T or (when
/// keys_bf16 and values_bf16 are given instead) as bfloat16 bits, widened as they are read. Not
/// owned.
template <class T>
struct AttentionKeysValues {
  const T* keys = nullptr;
  Index key_stride = 0;
  const T* values = nullptr;
  Index value_stride = 0;
  Index count = 0;  // S
  const std::uint16_t* keys_bf16 = nullptr;
  const std::uint16_t* values_bf16 = nullptr;
};

/// An additive bias on the scores (docs/semantics.md §6): query i and key j get row(i)[j] added
/// after the scaling, where row(i) = data + offsets[i] when the queries come from several heads or
/// sequences (offsets given), else data + position(i) * row_stride; -inf hides the key. A block
/// of keys that the bias hides from every query of a block is skipped. Not owned; data null =
/// no bias.
template <class T>
struct AttentionBias {
  const T* data = nullptr;
  Index row_stride = 0;
  const Index* offsets = nullptr;
  const T* row(Index i, const QueryPositions& positions) const {
    return data + (offsets ? offsets[i] : positions[i] * row_stride);
  }
};

/// Where attention() writes the probabilities, when asked (data not null): query i's softmax row
/// of S values at data + (rows ? rows[i] : i) * row_stride. Not owned.
template <class T>
struct AttentionWeights {
  T* data = nullptr;
  Index row_stride = 0;
  const Index* rows = nullptr;
  T* row(Index i) const { return data + (rows ? rows[i] : i) * row_stride; }
};

/// Where attention() writes: [queries, head_dim] at row stride `stride` (may not alias the queries).
template <class T>
struct AttentionOutput {
  T* data = nullptr;
  Index stride = 0;
};

/// Block sizes of the tiled kernel.
constexpr Index kQueryBlock = 64;
constexpr Index kKeyBlock = 256;

namespace detail {

template <class T>
struct PackedKeys;
template <class T>
struct DeferredValues;

/// The kernel that attend() runs a head's queries on.
enum class AttendRoute {
  Tiled,     // keys laid out once, register-tiled products: many queries pay for the layout
  FewQuery,  // few_query_scores() and few_query_values() on the keys where they lie (decode)
  Strided,   // Eigen products on strided maps: head sizes that are not whole packets
};

/// The route attend() takes for `queries` queries of head size `head_dim` in T, the keys laid out
/// by the caller (`packed`) or not: register-tiled products for whole-packet head sizes and
/// enough queries to pay for laying out the keys; a decode step's few queries read the keys and
/// values in place; odd head sizes go through Eigen's products. attend() itself asks it.
template <class T>
constexpr AttendRoute attend_route(Index queries, Index head_dim, bool packed) {
  if (!tiled_head<T>(head_dim)) return AttendRoute::Strided;
  return packed || queries >= kPackedQueries ? AttendRoute::Tiled : AttendRoute::FewQuery;
}

/// attention() with its tiles from `arena`, and optionally the keys and values laid out once
/// for many query blocks (`packed`, from PackedKeys::pack with the same scale), an additive bias
/// and the probabilities to write. With `defer`, one query of a head of one value panel or half
/// of one (paired_values_head()) over keys in T that fit one block, without bias or probabilities,
/// stops before its weighted values and leaves them in *defer (pending); anything else is
/// attended whole (not pending).
template <class T>
void attend(const AttentionQueries<T>& queries, const AttentionKeysValues<T>& kv,
            const AttentionMasking& mask, const AttentionOutput<T>& output, Arena& arena,
            const PackedKeys<T>* packed = nullptr, const AttentionBias<T>& bias = {},
            const AttentionWeights<T>& weights = {}, DeferredValues<T>* defer = nullptr);

}  // namespace detail

/// Attends the queries to the keys/values of one head: out = softmax(scale q k^T + bias + mask) v,
/// and writes the softmax rows to `weights` when given. Tiles come from `workspace` (null: a
/// temporary one). Sizes are checked (moh::Error).
template <class T>
void attention(const AttentionQueries<T>& queries, const AttentionKeysValues<T>& kv,
               const AttentionMasking& mask, const AttentionOutput<T>& output,
               Workspace* workspace = nullptr, const AttentionBias<T>& bias = {},
               const AttentionWeights<T>& weights = {}) {
  detail::require(queries.count >= 0 && queries.head_dim > 0 && kv.count >= 0,
                  "attention: sizes: expected queries >= 0, head_dim > 0, keys >= 0, got ",
                  queries.count, ", ", queries.head_dim, ", ", kv.count);
  detail::require(queries.count == 0 || (queries.data && output.data), "attention: expected ",
                  "query and output data for ", queries.count, " queries, got a null pointer");
  detail::require(kv.count == 0 || (kv.keys && kv.values) || (kv.keys_bf16 && kv.values_bf16),
                  "attention: expected key and value data for ", kv.count, " keys (in T or both ",
                  "in bfloat16), got a null pointer");
  detail::require(queries.stride >= queries.head_dim && output.stride >= queries.head_dim &&
                      (kv.count == 0 || (kv.key_stride >= queries.head_dim &&
                                         kv.value_stride >= queries.head_dim)),
                  "attention: row strides must hold a head: expected >= ", queries.head_dim,
                  ", got queries ", queries.stride, ", keys ", kv.key_stride, ", values ",
                  kv.value_stride, ", output ", output.stride);
  const detail::WorkspaceLease lease(workspace, nullptr, "attention");
  // Rows at a stride must not overlap; rows at given offsets (or row indices) are the caller's.
  detail::require(bias.data == nullptr || bias.offsets != nullptr || bias.row_stride >= kv.count,
                  "attention: bias rows must hold every key: expected a row stride >= ",
                  kv.count, " (or row offsets), got ", bias.row_stride);
  detail::require(weights.data == nullptr || weights.row_stride >= kv.count, "attention: ",
                  "probability rows must hold every key: expected a row stride >= ", kv.count,
                  ", got ", weights.row_stride);
  detail::attend<T>(queries, kv, mask, output, lease.exec().call(), nullptr, bias, weights);
}

namespace detail {

/// The kernel's tiles for one head of size d, carved from an arena once per call and reused by
/// every block (no allocation in the loop).
template <class T>
struct AttentionTiles {
  MatrixMap<T> scores;   // [kQueryBlock, kKeyBlock]
  MatrixMap<T> acc;      // [kQueryBlock, d]
  // Fast path: contiguous copies, so that strided rows (heads interleaved in a projection) do
  // not alias in the caches: scale * K^T of the key block, its values, and the query block.
  MatrixMap<T> keys_t;   // [d, kKeyBlock + 16] (padded so its rows do not alias in the caches)
  MatrixMap<T> values;   // [kKeyBlock, d]
  MatrixMap<T> queries;  // [kQueryBlock, d]
  Eigen::Map<Vector<T>> row_max, row_sum;

  AttentionTiles(Arena& a, Index d)
      : scores(a.matrix<T>(kQueryBlock, kKeyBlock)),
        acc(a.matrix<T>(kQueryBlock, d)),
        keys_t(a.matrix<T>(d, kKeyBlock + 16)),
        values(a.matrix<T>(kKeyBlock, d)),
        queries(a.matrix<T>(kQueryBlock, d)),
        row_max(a.allocate<T>(kQueryBlock), kQueryBlock),
        row_sum(a.allocate<T>(kQueryBlock), kQueryBlock) {}
};

}  // namespace detail

// Packet types are SIMD vector types with alignment attributes; naming them as template
// arguments makes GCC warn that those attributes are ignored, which is harmless here (the same
// pattern Eigen silences in its own headers).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"
#endif

namespace detail {

// Register tile of the attention products: kTileRows rows x 2 packets of columns, i.e. 16
// accumulators with 32 vector registers (AVX-512), 8 with 16; 8 x 2 is the fastest tile for a
// block's 64 x 256 x 64 products with AVX-512.
constexpr int kTilePackets = 2;
#ifdef EIGEN_VECTORIZE_AVX512
constexpr int kTileRows = 8;
#else
constexpr int kTileRows = 4;
#endif

/// C[rows, cols] (+)= A[rows, depth] B[depth, cols] with the attention tile (small_product in
/// ops/detail/packed_gemm.hpp); cols a multiple of the packet size.
template <class T>
void attention_product(const T* A, Index lda, const T* B, Index ldb, Index rows, Index cols,
                       Index depth, T* C, Index ldc, bool accumulate) {
  small_product<T, kTileRows, kTilePackets, false>(A, lda, B, ldb, rows, cols, depth, C, ldc,
                                                   accumulate);
}

}  // namespace detail

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

namespace detail {

/// dst[n, d] (contiguous) = the n rows at `stride` of src (T, or bfloat16 widened).
template <class T, class Src>
void copy_rows(const Src* src, Index stride, Index n, Index d, T* dst) {
  pack_rows<T>(src, stride, n, d, dst, d);
}

/// One head's keys and values laid out for the register-tiled path, prepared once and shared by
/// every query block that attends to them: scale * K^T [d, S rounded up to whole packets, zero
/// padded] and V [S, d], both contiguous, in arena memory.
template <class T>
struct PackedKeys {
  const T* keys_t = nullptr;  // [d, stride]
  Index keys_t_stride = 0;    // padded S + 16, so that rows do not alias in the caches
  const T* values = nullptr;  // [S, d]
  Index keys = 0;

  /// Lays out S keys and values (rows at their strides, T or bfloat16) of size d, scaled by
  /// `scale`.
  template <class Src>
  static PackedKeys pack(Arena& arena, const Src* k, Index k_stride, const Src* v,
                         Index v_stride, Index S, Index d, T scale) {
    const Index L = packet_size<T>();
    const Index padded = (S + L - 1) / L * L;
    MatrixMap<T> kt = arena.matrix<T>(d, padded + 16);
    MatrixMap<T> vc = arena.matrix<T>(S, d);
    copy_rows(k, k_stride, S, d, vc.data());  // contiguous, then transposed
    kt.leftCols(S) = vc.transpose() * scale;
    kt.middleCols(S, padded - S).setZero();
    copy_rows(v, v_stride, S, d, vc.data());
    return PackedKeys{kt.data(), kt.outerStride(), vc.data(), S};
  }
};

/// The most keys a deferred query can have (DeferredValues): what attend()'s one block of keys
/// holds for one query (the few-query kernels' key_block at one query).
constexpr Index kDeferredKeys = kQueryBlock * kKeyBlock;

/// One query's attend() stopped before its weighted values, for a caller that pairs two such
/// queries' values in one pass (few_query_values_pair()): the softmax weights of its one block
/// of keys copied to `w` (the caller's room for `capacity`), the values they weigh, the
/// softmax sum, and the output row. finish_values() writes what attend() would have.
template <class T>
struct DeferredValues {
  T* w = nullptr;
  Index capacity = 0;
  const T* v = nullptr;
  Index v_stride = 0;
  Index nk = 0;
  T sum = 0;
  T* out = nullptr;
  bool pending = false;  // set by attend(): the values are the caller's to compute
};

/// attend(), declared with its contract above attention().
template <class T>
void attend(const AttentionQueries<T>& queries, const AttentionKeysValues<T>& kv,
            const AttentionMasking& mask, const AttentionOutput<T>& output, Arena& arena,
            const PackedKeys<T>* packed, const AttentionBias<T>& bias,
            const AttentionWeights<T>& weights, DeferredValues<T>* defer) {
  const T* q = queries.data;
  const Index q_stride = queries.stride, n_q = queries.count, d = queries.head_dim;
  const T scale = queries.scale;
  const QueryPositions& positions = queries.positions;
  const T* k = kv.keys;
  const T* v = kv.values;
  const Index k_stride = kv.key_stride, v_stride = kv.value_stride, S = kv.count;
  T* out = output.data;
  const Index out_stride = output.stride;
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  constexpr Index L = detail::packet_size<T>();
  const AttendRoute route = attend_route<T>(n_q, d, packed != nullptr);
  const bool fast = route == AttendRoute::Tiled;
  const bool few = route == AttendRoute::FewQuery;  // few_query_scores / few_query_values
  eigen_assert(packed == nullptr || packed->keys == S);
  const std::uint16_t* k16 = kv.keys_bf16;
  const std::uint16_t* v16 = kv.values_bf16;
  const bool narrow = k16 != nullptr;  // bfloat16 keys and values
  Arena::Scope scope(arena);
  AttentionTiles<T> scratch(arena, d);
  // bfloat16 blocks widened for the paths that read T (the few-query kernels widen in registers).
  const bool widen = narrow && !few && packed == nullptr;
  MatrixMap<T> wide_k = arena.matrix<T>(widen ? kKeyBlock : 0, d);
  MatrixMap<T> wide_v = arena.matrix<T>(widen ? kKeyBlock : 0, d);
  // Keys and values of block [j0, j0 + nk): in T at k, v (rows at ks, vs), or bfloat16 at k16,
  // v16 for the few-query kernels.
  struct Block {
    const T* k;
    Index ks;
    const T* v;
    Index vs;
    const std::uint16_t* k16;
    const std::uint16_t* v16;
  };
  auto block_of = [&](Index j0, Index nk) {
    if (!narrow) return Block{k + j0 * k_stride, k_stride, v + j0 * v_stride, v_stride, nullptr,
                              nullptr};
    if (!widen) return Block{nullptr, 0, nullptr, 0, k16 + j0 * k_stride, v16 + j0 * v_stride};
    copy_rows(k16 + j0 * k_stride, k_stride, nk, d, wide_k.data());
    copy_rows(v16 + j0 * v_stride, v_stride, nk, d, wide_v.data());
    return Block{wide_k.data(), d, wide_v.data(), d, nullptr, nullptr};
  };
  // Keys per block: the few-query kernels take as many as the score tile holds for their
  // queries (4096 for a group of 4, 16384 for one), so that the keys and the values of a head are
  // each read in one long run (short blocks, alternating between the two streams, read the cache
  // well below a plain sum's rate).
  const Index key_block =
      few ? std::max(kKeyBlock, kQueryBlock * kKeyBlock / std::max<Index>(1, n_q) / kKeyBlock *
                                    kKeyBlock)
          : kKeyBlock;
  StridedMap<T> scores_tile(scratch.scores.data(), kQueryBlock * kKeyBlock / key_block, key_block,
                            Eigen::OuterStride<>(key_block));
  eigen_assert((!few || n_q != 1 || key_block == kDeferredKeys) &&
               "attend: kDeferredKeys is one query's block of keys");
  if (defer != nullptr) defer->pending = false;
  const bool deferring = defer != nullptr && few && !narrow && n_q == 1 && bias.data == nullptr &&
                         weights.data == nullptr && paired_values_head<T>(d) && S <= key_block &&
                         S <= defer->capacity;
  // Of one row of a masked block: which keys are hidden.
  bool* hidden = arena.allocate<bool>(key_block);
  for (Index i0 = 0; i0 < n_q; i0 += kQueryBlock) {
    const Index nq = std::min(kQueryBlock, n_q - i0);
    ConstStridedMap<T> Q(q + i0 * q_stride, nq, d, Eigen::OuterStride<>(q_stride));
    if (fast) scratch.queries.topRows(nq) = Q;
    StridedMap<T> O(out + i0 * out_stride, nq, d, Eigen::OuterStride<>(out_stride));

    // Causal limits for this block: keys past `key_end` are hidden from every query in it;
    // keys up to `all_see` are visible (causally) to all of them.
    Index key_end = S, all_see = S - 1;
    if (mask.causal) {
      Index pmin = positions[i0], pmax = positions[i0];
      for (Index r = 1; r < nq; ++r) {
        pmin = std::min(pmin, positions[i0 + r]);
        pmax = std::max(pmax, positions[i0 + r]);
      }
      key_end = std::clamp<Index>(pmax + mask.causal_shift + 1, 0, S);
      all_see = pmin + mask.causal_shift;
    }

    // Whether the bias hides keys [j0, j0 + nk) from every query of the block.
    auto hidden_by_bias = [&](Index j0, Index nk) {
      if (bias.data == nullptr) return false;
      for (Index r = 0; r < nq; ++r) {
        const T* b = bias.row(i0 + r, positions) + j0;
        for (Index c = 0; c < nk; ++c)
          if (b[c] != kNegInf) return false;
      }
      return true;
    };

    // The block's scores into scratch.scores: scale q k^T + bias, -inf where a mask hides a key.
    // Returns whether any entry may be -inf. Leaves the block's contiguous values for the fast
    // path's product in *v_block.
    auto scores_of = [&](Index j0, Index nk, const Block& blk, const T** v_block) {
      ConstStridedMap<T> K(blk.k, blk.k ? nk : 0, d, Eigen::OuterStride<>(std::max<Index>(1, blk.ks)));
      auto s = scores_tile.topLeftCorner(nq, nk);
      *v_block = scratch.values.data();
      if (fast) {
        // scale * K^T of this block, zero-padded to whole packets of keys.
        const Index padded = (nk + L - 1) / L * L;
        const T* kt = nullptr;
        Index kt_stride = 0;
        if (packed != nullptr) {  // prepared once for all query blocks (already scaled)
          kt = packed->keys_t + j0;
          kt_stride = packed->keys_t_stride;
          *v_block = packed->values + j0 * d;
        } else {
          auto block = scratch.keys_t.leftCols(padded);
          scratch.values.topRows(nk) = K;  // contiguous first, then transposed
          block.leftCols(nk) = scratch.values.topRows(nk).transpose() * scale;
          block.rightCols(padded - nk).setZero();
          scratch.values.topRows(nk) =
              ConstStridedMap<T>(blk.v, nk, d, Eigen::OuterStride<>(blk.vs));
          kt = block.data();
          kt_stride = block.outerStride();
        }
        attention_product<T>(scratch.queries.data(), d, kt, kt_stride, nq, padded, d,
                             scratch.scores.data(), scratch.scores.outerStride(), false);
      } else if (few) {
        const T* qb = q + i0 * q_stride;
        T* sb = scores_tile.data();
        const Index ld = scores_tile.outerStride();
        for_query_chunks(nq, [&](auto n, Index r0) {
          constexpr int kN = decltype(n)::value;
          if (blk.k16)
            few_query_scores<T, kN>(qb + r0 * q_stride, q_stride, blk.k16, k_stride, nk, d, scale,
                                    sb + r0 * ld, ld);
          else
            few_query_scores<T, kN>(qb + r0 * q_stride, q_stride, blk.k, blk.ks, nk, d, scale,
                                    sb + r0 * ld, ld);
        });
      } else {
        s.noalias() = (Q * K.transpose()) * scale;
      }
      bool bias_hides = false;  // whether the bias has a -inf in this block
      if (bias.data != nullptr)
        for (Index r = 0; r < nq; ++r) {
          const Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>> b(
              bias.row(i0 + r, positions) + j0, nk);
          s.row(r) += b;
          bias_hides = bias_hides || b.minCoeff() == kNegInf;
        }
      const bool masked = bias_hides || mask.key_padding != nullptr ||
                          (mask.causal && j0 + nk - 1 > all_see);
      if (mask.key_padding != nullptr || (mask.causal && j0 + nk - 1 > all_see)) {
        for (Index r = 0; r < nq; ++r) {
          const Index limit = mask.causal ? positions[i0 + r] + mask.causal_shift : S;
          for (Index c = 0; c < nk; ++c) {
            const Index j = j0 + c;
            if (j > limit || (mask.key_padding && mask.key_padding[j])) s(r, c) = kNegInf;
          }
        }
      }
      return masked;
    };

    auto acc = scratch.acc.topRows(nq);
    auto m = scratch.row_max.head(nq);
    auto l = scratch.row_sum.head(nq);
    acc.setZero();
    m.setConstant(kNegInf);
    l.setZero();

    for (Index j0 = 0; j0 < key_end; j0 += key_block) {
      const Index nk = std::min(key_block, key_end - j0);
      if (hidden_by_bias(j0, nk)) continue;  // contributes nothing to any query of the block
      const T* v_block = nullptr;
      const Block blk = packed ? Block{} : block_of(j0, nk);
      const bool masked = scores_of(j0, nk, blk, &v_block);
      auto s = scores_tile.topLeftCorner(nq, nk);

      // Online softmax, one contiguous row at a time: rescale what was accumulated to the new
      // row max, then add this block's weights and weighted values.
      for (Index r = 0; r < nq; ++r) {
        auto row = s.row(r);
        const T m_new = std::max(m[r], row.maxCoeff());
        if (m_new == kNegInf) {  // nothing visible yet in this row
          row.setZero();
          continue;
        }
        const T alpha = (m[r] == kNegInf) ? T(0) : std::exp(m[r] - m_new);
        if (masked) {
          // Eigen's vectorised exp does not return exactly 0 for -inf, and its select() is not
          // vectorised (every exp would go through libm): note the hidden keys, exponentiate
          // the whole row in packets, then zero them.
          T* p = row.data();
          for (Index c = 0; c < nk; ++c) hidden[c] = p[c] == kNegInf;
          row = (row.array() - m_new).exp().matrix();
          for (Index c = 0; c < nk; ++c)
            if (hidden[c]) p[c] = T(0);
        } else {
          row = (row.array() - m_new).exp().matrix();
        }
        l[r] = l[r] * alpha + row.sum();
        if (alpha != T(1)) acc.row(r) *= alpha;
        m[r] = m_new;
      }
      if (fast) {
        attention_product<T>(s.data(), s.outerStride(), v_block, d, nq, d, nk, acc.data(),
                             acc.outerStride(), true);
      } else if (deferring) {  // one block (S <= key_block): its weights wait for the caller
        std::copy(s.data(), s.data() + nk, defer->w);
        defer->v = blk.v;
        defer->v_stride = blk.vs;
        defer->nk = nk;
      } else if (few) {
        for_query_chunks(nq, [&](auto n, Index r0) {
          constexpr int kN = decltype(n)::value;
          const T* w = s.data() + r0 * s.outerStride();
          T* a = acc.data() + r0 * acc.outerStride();
          if (blk.v16)
            few_query_values<T, kN>(w, s.outerStride(), blk.v16, v_stride, nk, d, a,
                                    acc.outerStride());
          else
            few_query_values<T, kN>(w, s.outerStride(), blk.v, blk.vs, nk, d, a,
                                    acc.outerStride());
        });
      } else {
        acc.noalias() += s * ConstStridedMap<T>(blk.v, nk, d, Eigen::OuterStride<>(blk.vs));
      }
    }

    if (deferring && l[0] > T(0)) {
      defer->sum = l[0];
      defer->out = O.row(0).data();
      defer->pending = true;
      continue;  // no probabilities (weights.data is null)
    }
    for (Index r = 0; r < nq; ++r) {
      if (l[r] > T(0)) {
        O.row(r) = acc.row(r) / l[r];
      } else {
        O.row(r).setZero();
      }
    }

    // The probabilities, when asked: the scores again, normalised by the row's final max and sum.
    if (weights.data == nullptr) continue;
    for (Index r = 0; r < nq; ++r) std::fill(weights.row(i0 + r), weights.row(i0 + r) + S, T(0));
    for (Index j0 = 0; j0 < key_end; j0 += key_block) {
      const Index nk = std::min(key_block, key_end - j0);
      if (hidden_by_bias(j0, nk)) continue;
      const T* v_block = nullptr;
      scores_of(j0, nk, packed ? Block{} : block_of(j0, nk), &v_block);
      for (Index r = 0; r < nq; ++r) {
        if (!(l[r] > T(0))) continue;  // a row that sees nothing stays zero
        T* p = weights.row(i0 + r) + j0;
        const T* s = scores_tile.row(r).data();
        for (Index c = 0; c < nk; ++c) p[c] = s[c] == kNegInf ? T(0) : std::exp(s[c] - m[r]) / l[r];
      }
    }
  }
}

/// Writes the outputs of attend()'s pending queries among `deferred[0 .. count)` (count at most
/// two; the others are skipped): their weighted values from zero, two in one pass
/// (few_query_values_pair()), each divided by its softmax sum, the bits attend() would have
/// written. `acc`: room for 2 head_dim.
template <class T>
void finish_values(DeferredValues<T>* deferred, int count, Index head_dim, T* acc) {
  eigen_assert(count <= 2 && "finish_values: at most two queries");
  DeferredValues<T>* pending[2] = {nullptr, nullptr};
  int n = 0;
  for (int i = 0; i < count; ++i)
    if (deferred[i].pending) pending[n++] = &deferred[i];
  if (n == 0) return;
  std::fill(acc, acc + 2 * head_dim, T(0));
  const auto pair = [&](auto packets) {
    few_query_values_pair<T, decltype(packets)::value>(
        pending[0]->w, pending[0]->v, pending[0]->v_stride, pending[0]->nk, acc, pending[1]->w,
        pending[1]->v, pending[1]->v_stride, pending[1]->nk, acc + head_dim);
  };
  const int packets = paired_values_packets<T>(head_dim);
  if (n == 2 && packets == kPairedPanel)
    pair(std::integral_constant<int, kPairedPanel>{});
  else if (n == 2 && packets == kPairedHalfPanel)
    pair(std::integral_constant<int, kPairedHalfPanel>{});
  else  // one pending query (or, never deferred so, heads that do not pair): each alone
    for (int i = 0; i < n; ++i)
      few_query_values<T, 1>(pending[i]->w, 0, pending[i]->v, pending[i]->v_stride,
                             pending[i]->nk, head_dim, acc + i * head_dim, 0);
  for (int i = 0; i < n; ++i) {
    using Row = Eigen::Map<Eigen::Matrix<T, 1, Eigen::Dynamic>>;
    Row(pending[i]->out, head_dim) = Row(acc + i * head_dim, head_dim) / pending[i]->sum;
    pending[i]->pending = false;
  }
}

}  // namespace detail

}  // namespace moh

#include "moh/ops/detail/unroll_end.hpp"
