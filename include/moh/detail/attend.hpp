// Internal drivers that run the attention kernel over many heads, shared by the layers.
//
// attend_heads(): every query head of every token (dense MHA, and the reference path of the
// routed layers). attend_routed(): only the (token, head) pairs a router picked, grouped per head
// so that each head's queries, scores and output projection are computed for its tokens only.
#pragma once

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "moh/ops/attention_kernel.hpp"
#include "moh/ops/detail/few_query.hpp"
#include "moh/ops/linear.hpp"
#include "moh/runtime/thread_pool.hpp"
#include "moh/runtime/workspace.hpp"
#include "moh/tensor.hpp"

namespace moh {
namespace detail {

/// Where head h of token s of sequence b lives: data + b*batch_stride + s*row_stride + h*head_stride,
/// or the same offset of `bf16` when the heads are stored as bfloat16 (a bfloat16 KV cache).
template <class T>
struct HeadsView {
  const T* data = nullptr;
  Index row_stride = 0;
  Index batch_stride = 0;
  Index head_stride = 0;
  const std::uint16_t* bf16 = nullptr;
  Index offset(Index b, Index s, Index h) const {
    return b * batch_stride + s * row_stride + h * head_stride;
  }
  const T* at(Index b, Index s, Index h) const { return data + offset(b, s, h); }
  const std::uint16_t* at16(Index b, Index s, Index h) const { return bf16 + offset(b, s, h); }
};

/// Key/value source of an attention call: K and V views with S keys per sequence and a
/// per-sequence padding row (or none).
template <class T>
struct KeyValues {
  HeadsView<T> k, v;
  Index keys = 0;      // S: every sequence's keys, or the most any has (with `lengths`)
  Index kv_heads = 1;  // H_kv
  const bool* padding = nullptr;  // [batch, padding_stride], true = padding
  Index padding_stride = 0;
  const Index* lengths = nullptr;  // [batch] keys of each sequence (a ragged cache), or null
  const bool* padding_row(Index b) const { return padding ? padding + b * padding_stride : nullptr; }
  Index keys_of(Index b) const { return lengths ? lengths[b] : keys; }
};

inline Index blocks_of(Index n, Index block) { return (n + block - 1) / block; }

// Query rows per attention task. A task lays out its kv head's keys once (PackedKeys) when it
// has at least kPackRows rows, so that cost is spread over many query blocks.
constexpr Index kTaskRows = 8 * kQueryBlock;
constexpr Index kPackRows = 32;

/// Keys/values of sequence b, kv head g, packed in `arena` for `rows` queries when worth it.
template <class T>
std::optional<PackedKeys<T>> maybe_pack(const KeyValues<T>& kv, Index b, Index g, Index d,
                                        Index rows, T scale, Arena& arena) {
  if (!tiled_head<T>(d) || rows < kPackRows) return std::nullopt;
  if (kv.k.bf16)
    return PackedKeys<T>::pack(arena, kv.k.at16(b, 0, g), kv.k.row_stride, kv.v.at16(b, 0, g),
                               kv.v.row_stride, kv.keys_of(b), d, scale);
  return PackedKeys<T>::pack(arena, kv.k.at(b, 0, g), kv.k.row_stride, kv.v.at(b, 0, g),
                             kv.v.row_stride, kv.keys_of(b), d, scale);
}

/// One head's keys and values of sequence b as the kernel takes them.
template <class T>
AttentionKeysValues<T> head_keys(const KeyValues<T>& kv, Index b, Index g) {
  if (kv.k.bf16)
    return AttentionKeysValues<T>{nullptr, kv.k.row_stride, nullptr, kv.v.row_stride,
                                  kv.keys_of(b), kv.k.at16(b, 0, g), kv.v.at16(b, 0, g)};
  return AttentionKeysValues<T>{kv.k.at(b, 0, g), kv.k.row_stride, kv.v.at(b, 0, g),
                                kv.v.row_stride, kv.keys_of(b)};
}

/// What a call adds to the scores and asks back from them, layer-wide: an additive bias whose row
/// for (sequence b, query head h, query t) is at bias + b bias_b + h bias_h + t bias_t (a stride
/// of 0 broadcasts), and where the probabilities go: row (b, head h, t) of S values at
/// weights + ((b weights_heads + h) tokens + t) keys. Null pointers: none.
template <class T>
struct ScoreExtras {
  const T* bias = nullptr;
  Index bias_b = 0, bias_h = 0, bias_t = 0;
  T* weights = nullptr;
  Index weights_heads = 0, tokens = 0, keys = 0;
  Index bias_offset(Index b, Index h, Index t) const { return b * bias_b + h * bias_h + t * bias_t; }
  Index weights_row(Index b, Index h, Index t) const {
    return (b * weights_heads + h) * tokens + t;
  }
};

/// Whether attend_heads() attends in pairs of heads (attend_head_pairs()): kPairedValues, one
/// token per sequence, one query head per kv head, heads of one value panel or half of one
/// (paired_values_head()), a cache in T holding at most kDeferredKeys keys a sequence, no bias
/// and no probabilities asked, and at least as many pairs as the pool has threads (else one head
/// a task keeps more of them busy). Either way each head gets the same bits.
template <class T>
bool pairs_decode_heads(const KeyValues<T>& kv, Index batch, Index tokens, Index heads, Index d,
                        const ScoreExtras<T>& extras, const Exec& exec) {
  return kPairedValues && tokens == 1 && heads == kv.kv_heads && paired_values_head<T>(d) &&
         kv.k.bf16 == nullptr && kv.keys <= kDeferredKeys && extras.bias == nullptr &&
         extras.weights == nullptr && batch * ((heads + 1) / 2) >= exec.threads();
}

/// attend_heads() for one token per sequence and one query head per kv head, in heads of one
/// value panel or half of one over a cache in T (pairs_decode_heads()): heads 2p and 2p + 1 of a
/// sequence attend in one task, their weighted values in one pass (few_query_values_pair(), two
/// streams in memory instead of one, which is faster), each head with the bits it has alone
/// (attend()'s own, as finish_values() promises).
template <class T>
void attend_head_pairs(const HeadsView<T>& q, const KeyValues<T>& kv, Index batch, Index heads,
                       Index d, T scale, bool causal, T* out, const Exec& exec) {
  const Index pairs = (heads + 1) / 2;
  parallel_for(exec.pool, batch * pairs, [&](std::int64_t task, int thread) {
    const Index b = task / pairs, g0 = task % pairs * 2;
    const int n = static_cast<int>(std::min<Index>(2, heads - g0));
    const Index keys = kv.keys_of(b);  // at most kDeferredKeys (pairs_decode_heads())
    const AttentionMasking mask{causal, keys - 1, kv.padding_row(b)};
    Arena& arena = exec.thread(thread);
    const Arena::Scope scope(arena);
    T* room = arena.allocate<T>(2 * keys + 2 * d);
    DeferredValues<T> deferred[2];
    for (int i = 0; i < n; ++i) {
      const Index g = g0 + i;
      deferred[i].w = room + i * keys;
      deferred[i].capacity = keys;
      attend<T>(AttentionQueries<T>{q.at(b, 0, g), q.row_stride, 1, d, scale, {nullptr, 0}},
                head_keys(kv, b, g), mask,
                AttentionOutput<T>{out + b * heads * d + g * d, heads * d}, arena, nullptr, {},
                {}, &deferred[i]);
    }
    finish_values(deferred, n, d, room + 2 * keys);
  });
}

/// O[b*T + t, h*d : (h+1)*d] = attention of query head h of token t over kv head
/// g = h / (H / H_kv), scores scaled by `scale`. q: [B, T, H heads]; out: row-major [B*T, H*d].
/// Query heads that share a kv head are attended together (their queries gathered into one
/// block), so each key/value block is read once per group rather than once per query head.
/// `extras` adds its bias and takes the probabilities of head h as its head h.
template <class T>
void attend_heads(const HeadsView<T>& q, const KeyValues<T>& kv, Index batch, Index tokens,
                  Index heads, Index d, T scale, bool causal, const ScoreExtras<T>& extras,
                  T* out, const Exec& exec) {
  const Index group = heads / kv.kv_heads;
  if (pairs_decode_heads(kv, batch, tokens, heads, d, extras, exec)) {
    attend_head_pairs(q, kv, batch, heads, d, scale, causal, out, exec);
    return;
  }
  const Index per_block = std::max<Index>(1, kQueryBlock / group);  // tokens per query block
  const Index per_task = per_block * (kTaskRows / kQueryBlock);      // tokens per task
  const Index chunks = blocks_of(tokens, per_task);
  parallel_for(exec.pool, batch * kv.kv_heads * chunks, [&](std::int64_t task, int thread) {
    const Index chunk = task % chunks, g = (task / chunks) % kv.kv_heads;
    const Index b = task / (chunks * kv.kv_heads);
    const Index first = chunk * per_task, last = std::min(tokens, first + per_task);
    const AttentionMasking mask{causal, kv.keys_of(b) - tokens, kv.padding_row(b)};
    Arena& arena = exec.thread(thread);
    const Arena::Scope scope(arena);
    const std::optional<PackedKeys<T>> packed =
        maybe_pack(kv, b, g, d, (last - first) * group, scale, arena);
    const AttentionKeysValues<T> keys = head_keys(kv, b, g);
    // Gathered queries of one block of tokens of the group's heads, their outputs, and where
    // their bias and probability rows are.
    const Index gathered = group == 1 ? 0 : per_block * group;
    MatrixMap<T> gq = arena.matrix<T>(gathered, d);
    MatrixMap<T> go = arena.matrix<T>(gathered, d);
    Index* positions = arena.allocate<Index>(gathered);
    Index* bias_offsets = arena.allocate<Index>(extras.bias ? gathered : 0);
    Index* weight_rows = arena.allocate<Index>(extras.weights ? gathered : 0);
    for (Index t0 = first; t0 < last; t0 += per_block) {
      const Index nt = std::min(per_block, last - t0);
      if (group == 1) {  // one head per kv head: attend in place, no gathering
        const AttentionBias<T> bias{extras.bias ? extras.bias + extras.bias_offset(b, g, 0) : nullptr,
                                    extras.bias_t, nullptr};
        const AttentionWeights<T> weights{
            extras.weights ? extras.weights + extras.weights_row(b, g, t0) * extras.keys : nullptr,
            extras.keys, nullptr};
        attend<T>(AttentionQueries<T>{q.at(b, t0, g), q.row_stride, nt, d, scale, {nullptr, t0}},
                  keys, mask,
                  AttentionOutput<T>{out + (b * tokens + t0) * heads * d + g * d, heads * d},
                  arena, packed ? &*packed : nullptr, bias, weights);
        continue;
      }
      const Index n = nt * group;
      for (Index t = 0; t < nt; ++t)
        for (Index j = 0; j < group; ++j) {
          const Index row = t * group + j, h = g * group + j;
          gq.row(row) = Eigen::Map<const Vector<T>>(q.at(b, t0 + t, h), d).transpose();
          positions[row] = t0 + t;
          if (extras.bias) bias_offsets[row] = extras.bias_offset(b, h, t0 + t);
          if (extras.weights) weight_rows[row] = extras.weights_row(b, h, t0 + t);
        }
      attend<T>(AttentionQueries<T>{gq.data(), d, n, d, scale, {positions, 0}}, keys, mask,
                AttentionOutput<T>{go.data(), d}, arena, packed ? &*packed : nullptr,
                AttentionBias<T>{extras.bias, 0, bias_offsets},
                AttentionWeights<T>{extras.weights, extras.keys, weight_rows});
      for (Index t = 0; t < nt; ++t)
        for (Index j = 0; j < group; ++j)
          Eigen::Map<Vector<T>>(out + (b * tokens + t0 + t) * heads * d + (g * group + j) * d,
                                d) = go.row(t * group + j).transpose();
    }
  });
}

/// The (token, head) pairs a router picked, grouped by head: rows[offsets[h] .. offsets[h+1])
/// are the token rows (b*T + t, ascending) that use head h, gates[] their gate. The arrays live
/// in the arena the plan was built in.
template <class T>
struct HeadPlan {
  Index heads = 0, batch = 0, tokens = 0, pairs = 0;
  Index* offsets = nullptr;    // [heads + 1]
  Index* rows = nullptr;       // [pairs]
  Index* positions = nullptr;  // [pairs], t of each row
  T* gates = nullptr;          // [pairs]
  Index* slots = nullptr;      // [pairs], which of the row's picks (build_picked only)

  /// Builds the plan from a [B*T, heads] activity mask and gates.
  template <class ActiveFn, class GateFn>
  void build(Arena& arena, Index num_heads, Index b_, Index t_, ActiveFn active, GateFn gate) {
    build_from(arena, num_heads, b_, t_, gate, [&](Index r, auto&& add) {
      for (Index h = 0; h < num_heads; ++h)
        if (active(r, h)) add(h, Index(0));
    });
  }
  /// Builds the plan from the k distinct heads pick(r, 0 .. k-1) of each row r, in
  /// O(B*T*k) rather than O(B*T*heads): a MoA router's top-k experts.
  template <class PickFn, class GateFn>
  void build_picked(Arena& arena, Index num_heads, Index b_, Index t_, Index k, PickFn pick,
                    GateFn gate) {
    build_from(arena, num_heads, b_, t_, gate, [&](Index r, auto&& add) {
      for (Index s = 0; s < k; ++s)
        if (pick(r, s) >= 0) add(pick(r, s), s);  // -1: no head in this slot (padding)
    });
  }
  Index count(Index h) const { return offsets[h + 1] - offsets[h]; }
  /// Range of head h's pairs whose rows lie in [r0, r1).
  std::pair<Index, Index> range(Index h, Index r0, Index r1) const {
    const Index* first = rows + offsets[h];
    const Index* last = rows + offsets[h + 1];
    return {std::lower_bound(first, last, r0) - rows, std::lower_bound(first, last, r1) - rows};
  }

 private:
  // each_head(r, add) calls add(h, slot) once for every head h that row r uses (distinct heads).
  template <class GateFn, class EachHead>
  void build_from(Arena& arena, Index num_heads, Index b_, Index t_, GateFn gate,
                  EachHead each_head) {
    heads = num_heads;
    batch = b_;
    tokens = t_;
    const Index n = batch * tokens;
    offsets = arena.allocate<Index>(heads + 1);
    std::fill(offsets, offsets + heads + 1, Index(0));
    for (Index r = 0; r < n; ++r)
      each_head(r, [&](Index h, Index) {
        eigen_assert(h >= 0 && h < heads);
        ++offsets[h + 1];
      });
    for (Index h = 0; h < heads; ++h) offsets[h + 1] += offsets[h];
    pairs = offsets[heads];
    rows = arena.allocate<Index>(pairs);
    positions = arena.allocate<Index>(pairs);
    gates = arena.allocate<T>(pairs);
    slots = arena.allocate<Index>(pairs);
    Index* fill = arena.allocate<Index>(heads);  // next free slot of each head
    std::copy(offsets, offsets + heads, fill);
    for (Index r = 0; r < n; ++r)  // rows in order, so each head's rows ascend
      each_head(r, [&](Index h, Index slot) {
        const Index i = fill[h]++;
        eigen_assert(i == offsets[h] || rows[i - 1] < r);  // a head picked twice for one row
        rows[i] = r;
        positions[i] = r % tokens;
        gates[i] = gate(r, h);
        slots[i] = slot;
      });
  }
};

constexpr Index kRoutedRowTile = 128;    // rows per projection task of the routed path
// Output columns per task when heads have few rows. MoAAttention also stores its output experts
// in column panels of this width (see its constructor), so that each task reads contiguous runs.
constexpr Index kRoutedColumnTile = 128;
// Heads with fewer rows than this on average project their outputs in column tiles, which is
// faster there (MoA's many experts of few rows each).
constexpr Index kRoutedColumnRows = 256;
// Heads whose output weights are larger than this (bytes) also project in column tiles: a row
// tile would stream all of them again for its few rows of each head (JetMoE-8B's 16 MiB
// experts).
constexpr std::size_t kRoutedRowTileWeightBytes = std::size_t(4) << 20;
// Heads whose output weights are at least this large (bytes; MoH-LLaMA3's 128 x 4096 floats,
// 2 MiB) project in row tiles of kRoutedLargeRowTile: each row tile packs every head's weights
// again, which at 128 rows costs much of what routing saves.
constexpr std::size_t kRoutedLargeHeadBytes = std::size_t(1) << 20;
constexpr Index kRoutedLargeRowTile = 512;
// A one-thread decode step projects every output column in one tile while a head's products
// (its rows x D_out) take at most this many bytes (16 rows at D = 4096, about half an L2);
// past it, 4 tiles.
constexpr std::size_t kRoutedDecodeRowBytes = std::size_t(256) << 10;

/// Runs the routed heads of `plan`, each a block of `sub_heads` query heads of size d (MoH and
/// fairseq MoA: 1; a multi-head MoA expert: H_kv):
///   Q[i]  = project_q(h, X rows of head h)                 (only the picked pairs) [sub_heads d]
///   O[i]  = gate[i] * attention(sub-head j of Q[i], kv head kv_head(h, j)), for each j
///   Y[r] += O rows of head h projected by project_out      (summed over heads in order)
/// project_q(h, row indices [n], gathered X rows [n, D] (empty unless gather_x), Q out
/// [n, sub_heads d], arena) and project_out(h, O [n, sub_heads d], P [n, m], c0, accumulate,
/// arena) (output columns [c0, c0 + m) of O's projection, added to P or written) are the
/// layer's per-head GEMMs, with the running thread's arena. `extras` adds its bias (head index
/// bias_head(h, j)) and takes the probabilities (head index weights_head(i, h, j), pair i).
/// Scores are scaled by `scale`. Y must already hold the bias (or zeros). X: [B*T, D] rows.
template <class T, class ProjectQ, class ProjectOut, class KvHead, class BiasHead,
          class WeightsHead>
void attend_routed(const HeadPlan<T>& plan, Index sub_heads, const ConstRowsRef<T>& X,
                   const KeyValues<T>& kv, Index d, T scale, bool causal, bool gather_x,
                   ProjectQ project_q, ProjectOut project_out, KvHead kv_head,
                   const ScoreExtras<T>& extras, BiasHead bias_head, WeightsHead weights_head,
                   RowsRef<T> Y, const Exec& exec) {
  const Index pairs = plan.pairs, D_in = X.cols(), D_out = Y.cols(), w = sub_heads * d;
  const Index n_rows = plan.batch * plan.tokens;
  Arena& call = exec.call();
  const Arena::Scope call_scope(call);
  MatrixMap<T> Q = call.matrix<T>(pairs, w);
  MatrixMap<T> O = call.matrix<T>(pairs, w);

  // 1. Queries of the picked pairs, per head, in fixed tiles of that head's rows.
  Index tiles = 0;
  for (Index h = 0; h < plan.heads; ++h) tiles += blocks_of(plan.count(h), kRoutedRowTile);
  Index* tile_head = call.allocate<Index>(tiles);
  Index* tile_start = call.allocate<Index>(tiles);
  for (Index h = 0, t = 0; h < plan.heads; ++h)
    for (Index i = plan.offsets[h]; i < plan.offsets[h + 1]; i += kRoutedRowTile, ++t) {
      tile_head[t] = h;
      tile_start[t] = i;
    }
  parallel_for(exec.pool, tiles, [&](std::int64_t task, int thread) {
    const Index h = tile_head[task], i0 = tile_start[task];
    const Index n = std::min(kRoutedRowTile, plan.offsets[h + 1] - i0);
    Arena& arena = exec.thread(thread);
    const Arena::Scope scope(arena);
    if (gather_x && plan.count(h) == n_rows) {
      // Every token uses this head (a shared head): its rows are X's rows, no gathering.
      project_q(h, plan.rows + i0, X.middleRows(i0 - plan.offsets[h], n), Q.middleRows(i0, n),
                arena);
      return;
    }
    MatrixMap<T> g = arena.matrix<T>(n, gather_x ? D_in : 0);
    if (gather_x)
      for (Index i = 0; i < n; ++i) g.row(i) = X.row(plan.rows[i0 + i]);
    project_q(h, plan.rows + i0, g, Q.middleRows(i0, n), arena);
  });

  // 2. Attention, per kv head, sequence and block of queries: the picked (pair, sub-head) queries
  //    that read kv head g are gathered into one block, so each key/value block is read once per
  //    block of queries, and a kv head that no picked pair reads is never touched. Within a head
  //    the rows of one sequence are one contiguous run (rows are sorted).
  Index* kv_of = call.allocate<Index>(plan.heads * sub_heads);  // [head, sub-head]
  Index kv_heads_used = 0;
  for (Index h = 0; h < plan.heads; ++h)
    for (Index j = 0; j < sub_heads; ++j) {
      kv_of[h * sub_heads + j] = kv_head(h, j);
      kv_heads_used = std::max(kv_heads_used, kv_of[h * sub_heads + j] + 1);
    }
  // Queries as pair * sub_heads + sub-head, grouped by (kv head, sequence), and tasks as ranges
  // of that order: at most one task per kTaskRows queries plus one per (kv head, sequence).
  const Index queries = pairs * sub_heads;
  Index* order = call.allocate<Index>(queries);
  const Index max_tasks = blocks_of(queries, kTaskRows) + kv_heads_used * plan.batch;
  Index* att_first = call.allocate<Index>(max_tasks);
  Index* att_count = call.allocate<Index>(max_tasks);
  Index* att_batch = call.allocate<Index>(max_tasks);
  Index* att_kv = call.allocate<Index>(max_tasks);
  Index ordered = 0, tasks = 0;
  for (Index g = 0; g < kv_heads_used; ++g)
    for (Index b = 0; b < plan.batch; ++b) {
      const Index first = ordered;
      for (Index h = 0; h < plan.heads; ++h)
        for (Index j = 0; j < sub_heads; ++j) {
          if (kv_of[h * sub_heads + j] != g) continue;
          const auto [lo, hi] = plan.range(h, b * plan.tokens, (b + 1) * plan.tokens);
          for (Index i = lo; i < hi; ++i) order[ordered++] = i * sub_heads + j;
        }
      // Causal: by position, so that a block of queries spans few positions and the keys past
      // its last one are skipped (head by head, a block of a head with 1 in 8 of the tokens
      // would span 8 times as many). A query's result does not depend on its block.
      if (causal)
        std::sort(order + first, order + ordered, [&](Index a, Index c) {
          const Index pa = plan.positions[a / sub_heads], pc = plan.positions[c / sub_heads];
          return pa != pc ? pa < pc : a < c;
        });
      for (Index i = first; i < ordered; i += kTaskRows, ++tasks) {
        eigen_assert(tasks < max_tasks);
        att_first[tasks] = i;
        att_count[tasks] = std::min(kTaskRows, ordered - i);
        att_batch[tasks] = b;
        att_kv[tasks] = g;
      }
    }
  // The plan head of each pair, for the bias and probability rows.
  Index* head_of = call.allocate<Index>((extras.bias || extras.weights) ? pairs : 0);
  if (extras.bias || extras.weights)
    for (Index h = 0; h < plan.heads; ++h)
      for (Index i = plan.offsets[h]; i < plan.offsets[h + 1]; ++i) head_of[i] = h;
  parallel_for(exec.pool, tasks, [&](std::int64_t task, int thread) {
    const Index first = att_first[task], n = att_count[task];
    const Index b = att_batch[task], g = att_kv[task];
    const AttentionMasking mask{causal, kv.keys_of(b) - plan.tokens, kv.padding_row(b)};
    Arena& arena = exec.thread(thread);
    const Arena::Scope scope(arena);
    const std::optional<PackedKeys<T>> packed = maybe_pack(kv, b, g, d, n, scale, arena);
    const AttentionKeysValues<T> keys = head_keys(kv, b, g);
    const Index block = std::min(kQueryBlock, n);
    MatrixMap<T> gq = arena.matrix<T>(block, d);
    MatrixMap<T> go = arena.matrix<T>(block, d);
    Index* positions = arena.allocate<Index>(block);
    Index* bias_offsets = arena.allocate<Index>(extras.bias ? block : 0);
    Index* weight_rows = arena.allocate<Index>(extras.weights ? block : 0);
    for (Index r0 = 0; r0 < n; r0 += kQueryBlock) {
      const Index m = std::min(kQueryBlock, n - r0);
      for (Index r = 0; r < m; ++r) {
        const Index q = order[first + r0 + r], i = q / sub_heads, j = q % sub_heads;
        gq.row(r) = Q.row(i).segment(j * d, d);
        positions[r] = plan.positions[i];
        if (extras.bias)
          bias_offsets[r] = extras.bias_offset(b, bias_head(head_of[i], j), plan.positions[i]);
        if (extras.weights)
          weight_rows[r] = extras.weights_row(b, weights_head(i, head_of[i], j), plan.positions[i]);
      }
      attend<T>(AttentionQueries<T>{gq.data(), d, m, d, scale, {positions, 0}}, keys, mask,
                AttentionOutput<T>{go.data(), d}, arena, packed ? &*packed : nullptr,
                AttentionBias<T>{extras.bias, 0, bias_offsets},
                AttentionWeights<T>{extras.weights, extras.keys, weight_rows});
      for (Index r = 0; r < m; ++r) {
        const Index q = order[first + r0 + r], i = q / sub_heads, j = q % sub_heads;
        O.row(i).segment(j * d, d) = go.row(r) * plan.gates[i];
      }
    }
  });

  // 3. Output projection. Each Y element adds the heads' contributions in index order, so the
  //    sum is the same whatever thread runs a tile. With many rows per head: tiles of token
  //    rows. With fewer than kRoutedColumnRows on average (MoA's many experts: about 12 tokens
  //    each at E = 32 on 197 tokens), or heads of large output weights (JetMoE's experts): tiles
  //    of output columns, so that each head's weights are read once per call, not once per row
  //    tile, and its rows are multiplied together.
  // A decode step's rows (few rows, or a decode call's: Exec::dot_rows) always go through P, so
  // that a row's bits do not depend on which other sequences of the batch use the same head (a
  // batch equals its sequences decoded alone): added in place, a GEMM's chain would start at Y.
  const bool decode = dot_route(n_rows, exec.dot_rows);  // multiply()'s rule
  auto add_head = [&](Index h, Index lo, Index hi, Index c0, MatrixMap<T>& p, Arena& arena) {
    const Index n = hi - lo, m = p.cols();
    if (!decode && plan.rows[hi - 1] - plan.rows[lo] == n - 1) {  // add in place
      project_out(h, O.middleRows(lo, n), Y.block(plan.rows[lo], c0, n, m), c0, true, arena);
      return;
    }
    project_out(h, O.middleRows(lo, n), p.topRows(n), c0, false, arena);
    for (Index i = lo; i < hi; ++i) Y.row(plan.rows[i]).segment(c0, m) += p.row(i - lo);
  };
  const std::size_t head_weight_bytes =
      static_cast<std::size_t>(w) * static_cast<std::size_t>(D_out) * sizeof(T);
  if (pairs < plan.heads * kRoutedColumnRows || head_weight_bytes > kRoutedRowTileWeightBytes) {
    Index most = 0;
    for (Index h = 0; h < plan.heads; ++h) most = std::max(most, plan.count(h));
    // A decode step's rows: wide tiles, so that each head's weights (one contiguous panel
    // per head, MoHAttention) stream in long runs rather than 128-column pieces; on one thread
    // one tile of every column, each head's panel one run, while a head's products (most x
    // D_out) fit kRoutedDecodeRowBytes. No tile width enters an element's arithmetic.
    const std::size_t head_bytes = static_cast<std::size_t>(most * D_out) * sizeof(T);
    const bool one_tile = !exec.threaded() && head_bytes <= kRoutedDecodeRowBytes;
    const Index tile = !decode  ? kRoutedColumnTile
                       : one_tile ? std::max<Index>(D_out, 1)
                                  : linear_tile(D_out, 256, 64);
    parallel_for(exec.pool, blocks_of(D_out, tile), [&](std::int64_t task, int thread) {
      const Index c0 = task * tile, m = std::min(tile, D_out - c0);
      Arena& arena = exec.thread(thread);
      const Arena::Scope scope(arena);
      MatrixMap<T> p = arena.matrix<T>(most, m);
      for (Index h = 0; h < plan.heads; ++h)
        if (plan.count(h) > 0) add_head(h, plan.offsets[h], plan.offsets[h + 1], c0, p, arena);
    });
    return;
  }
  const Index row_tile =
      head_weight_bytes >= kRoutedLargeHeadBytes ? kRoutedLargeRowTile : kRoutedRowTile;
  parallel_for(exec.pool, blocks_of(n_rows, row_tile), [&](std::int64_t task, int thread) {
    const Index r0 = task * row_tile, r1 = std::min(n_rows, r0 + row_tile);
    Arena& arena = exec.thread(thread);
    const Arena::Scope scope(arena);
    MatrixMap<T> p = arena.matrix<T>(r1 - r0, D_out);
    for (Index h = 0; h < plan.heads; ++h) {
      const auto [lo, hi] = plan.range(h, r0, r1);
      if (hi > lo) add_head(h, lo, hi, 0, p, arena);
    }
  });
}

}  // namespace detail
}  // namespace moh
