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

#include "moh/attention_kernel.hpp"
#include "moh/linear.hpp"
#include "moh/tensor.hpp"
#include "moh/thread_pool.hpp"

namespace moh {
namespace detail {

/// Where head h of token s of sequence b lives: data + b*batch_stride + s*row_stride + h*head_stride.
template <class T>
struct HeadsView {
  const T* data = nullptr;
  Index row_stride = 0;
  Index batch_stride = 0;
  Index head_stride = 0;
  const T* at(Index b, Index s, Index h) const {
    return data + b * batch_stride + s * row_stride + h * head_stride;
  }
};

/// Key/value source of an attention call: K and V views with S keys per sequence and a
/// per-sequence padding row (or none).
template <class T>
struct KeyValues {
  HeadsView<T> k, v;
  Index keys = 0;      // S
  Index kv_heads = 1;  // H_kv
  const bool* padding = nullptr;  // [batch, padding_stride], true = padding
  Index padding_stride = 0;
  const bool* padding_row(Index b) const { return padding ? padding + b * padding_stride : nullptr; }
};

inline Index blocks_of(Index n, Index block) { return (n + block - 1) / block; }

/// O[b*T + t, h*d : (h+1)*d] = attention of query head h of token t over kv head
/// h / (H / H_kv). q: [B, T, H heads]; out: row-major [B*T, H*d].
template <class T>
void attend_heads(const HeadsView<T>& q, const KeyValues<T>& kv, Index batch, Index tokens,
                  Index heads, Index d, bool causal, T* out, ThreadPool* pool) {
  const Index blocks = blocks_of(tokens, kQueryBlock);
  const Index group = heads / kv.kv_heads;
  const T scale = T(1) / std::sqrt(static_cast<T>(d));
  std::vector<AttentionScratch<T>> scratch(static_cast<std::size_t>(thread_slots(pool)));
  parallel_for(pool, batch * heads * blocks, [&](std::int64_t task, int thread) {
    const Index blk = task % blocks, h = (task / blocks) % heads, b = task / (blocks * heads);
    const Index i0 = blk * kQueryBlock, nq = std::min(kQueryBlock, tokens - i0), g = h / group;
    AttentionMasking mask{causal, kv.keys - tokens, kv.padding_row(b)};
    attention<T>(q.at(b, i0, h), q.row_stride, nq, QueryPositions{nullptr, i0}, kv.k.at(b, 0, g),
                 kv.k.row_stride, kv.v.at(b, 0, g), kv.v.row_stride, kv.keys, d, mask, scale,
                 out + (b * tokens + i0) * heads * d + h * d, heads * d,
                 scratch[static_cast<std::size_t>(thread)]);
  });
}

/// The (token, head) pairs a router picked, grouped by head: rows[offsets[h] .. offsets[h+1])
/// are the token rows (b*T + t, ascending) that use head h, gates[] their gate.
template <class T>
struct HeadPlan {
  Index heads = 0, batch = 0, tokens = 0;
  std::vector<Index> offsets;    // [heads + 1]
  std::vector<Index> rows;       // [pairs]
  std::vector<Index> positions;  // [pairs], t of each row
  std::vector<T> gates;          // [pairs]
  Index pairs() const { return static_cast<Index>(rows.size()); }

  /// Builds the plan from a [B*T, heads] activity mask and gates.
  template <class ActiveFn, class GateFn>
  void build(Index num_heads, Index b_, Index t_, ActiveFn active, GateFn gate) {
    heads = num_heads;
    batch = b_;
    tokens = t_;
    const Index n = batch * tokens;
    offsets.assign(static_cast<std::size_t>(heads + 1), 0);
    for (Index r = 0; r < n; ++r)
      for (Index h = 0; h < heads; ++h)
        if (active(r, h)) ++offsets[static_cast<std::size_t>(h + 1)];
    for (Index h = 0; h < heads; ++h) offsets[h + 1] += offsets[h];
    rows.resize(static_cast<std::size_t>(offsets[heads]));
    positions.resize(rows.size());
    gates.resize(rows.size());
    std::vector<Index> fill(offsets.begin(), offsets.end() - 1);
    for (Index r = 0; r < n; ++r)
      for (Index h = 0; h < heads; ++h)
        if (active(r, h)) {
          const Index i = fill[h]++;
          rows[i] = r;
          positions[i] = r % tokens;
          gates[i] = gate(r, h);
        }
  }
  /// Range of head h's pairs whose rows lie in [r0, r1).
  std::pair<Index, Index> range(Index h, Index r0, Index r1) const {
    const auto first = rows.begin() + offsets[h], last = rows.begin() + offsets[h + 1];
    return {std::lower_bound(first, last, r0) - rows.begin(),
            std::lower_bound(first, last, r1) - rows.begin()};
  }
};

constexpr Index kRoutedRowTile = 128;  // rows per projection task of the routed path

/// Runs the routed heads of `plan`:
///   Q[i]  = project_q(h, X rows of head h)                 (only the picked pairs)
///   O[i]  = gate[i] * attention(Q[i], keys/values of head h)
///   Y[r] += project_out(h, O rows of head h)               (summed over heads in order)
/// project_q(h, row indices [n], gathered X rows [n, D] (empty unless gather_x), Q out [n, d]) and
/// project_out(h, O [n, d], P out [n, D]) are the layer's per-head GEMMs. kv_head(h) picks the
/// key/value head. Y must already hold the bias (or zeros). X: [B*T, D] rows.
template <class T, class ProjectQ, class ProjectOut, class KvHead>
void attend_routed(const HeadPlan<T>& plan, const ConstRowsRef<T>& X, const KeyValues<T>& kv,
                   Index d, bool causal, bool gather_x, ProjectQ project_q, ProjectOut project_out,
                   KvHead kv_head, RowsRef<T> Y, ThreadPool* pool) {
  const Index pairs = plan.pairs(), D_in = X.cols(), D_out = Y.cols();
  const int slots = thread_slots(pool);
  Matrix<T> Q(pairs, d), O(pairs, d);

  // 1. Queries of the picked pairs, per head, in fixed tiles of that head's rows.
  std::vector<Index> tile_head, tile_start;
  for (Index h = 0; h < plan.heads; ++h)
    for (Index i = plan.offsets[h]; i < plan.offsets[h + 1]; i += kRoutedRowTile) {
      tile_head.push_back(h);
      tile_start.push_back(i);
    }
  std::vector<Matrix<T>> gathered(static_cast<std::size_t>(slots));
  parallel_for(pool, static_cast<Index>(tile_head.size()), [&](std::int64_t task, int thread) {
    const Index h = tile_head[task], i0 = tile_start[task];
    const Index n = std::min(kRoutedRowTile, plan.offsets[h + 1] - i0);
    Matrix<T>& g = gathered[static_cast<std::size_t>(thread)];
    const Index width = gather_x ? D_in : 0;
    if (g.rows() != kRoutedRowTile || g.cols() != width) g.resize(kRoutedRowTile, width);
    if (gather_x)
      for (Index i = 0; i < n; ++i) g.row(i) = X.row(plan.rows[i0 + i]);
    project_q(h, plan.rows.data() + i0, g.topRows(n), Q.middleRows(i0, n));
  });

  // 2. Attention of each head's queries, per sequence and query block. A head's rows are sorted,
  //    so the rows of one sequence are one contiguous run.
  std::vector<Index> att_head, att_start, att_count;
  for (Index h = 0; h < plan.heads; ++h)
    for (Index b = 0; b < plan.batch; ++b) {
      const auto [lo, hi] = plan.range(h, b * plan.tokens, (b + 1) * plan.tokens);
      for (Index i = lo; i < hi; i += kQueryBlock) {
        att_head.push_back(h);
        att_start.push_back(i);
        att_count.push_back(std::min(kQueryBlock, hi - i));
      }
    }
  const T scale = T(1) / std::sqrt(static_cast<T>(d));
  std::vector<AttentionScratch<T>> scratch(static_cast<std::size_t>(slots));
  parallel_for(pool, static_cast<Index>(att_head.size()), [&](std::int64_t task, int thread) {
    const Index h = att_head[task], i0 = att_start[task], n = att_count[task];
    const Index b = plan.rows[i0] / plan.tokens, g = kv_head(h);
    AttentionMasking mask{causal, kv.keys - plan.tokens, kv.padding_row(b)};
    attention<T>(Q.row(i0).data(), d, n, QueryPositions{plan.positions.data() + i0, 0},
                 kv.k.at(b, 0, g), kv.k.row_stride, kv.v.at(b, 0, g), kv.v.row_stride, kv.keys,
                 d, mask, scale, O.row(i0).data(), d, scratch[static_cast<std::size_t>(thread)]);
    for (Index i = i0; i < i0 + n; ++i) O.row(i) *= plan.gates[i];
  });

  // 3. Output projection per tile of token rows; heads are added in index order, so the sum
  //    is the same whatever thread runs the tile.
  const Index n_rows = plan.batch * plan.tokens;
  std::vector<Matrix<T>> partial(static_cast<std::size_t>(slots));
  parallel_for(pool, blocks_of(n_rows, kRoutedRowTile), [&](std::int64_t task, int thread) {
    const Index r0 = task * kRoutedRowTile, r1 = std::min(n_rows, r0 + kRoutedRowTile);
    Matrix<T>& p = partial[static_cast<std::size_t>(thread)];
    if (p.rows() != kRoutedRowTile || p.cols() != D_out) p.resize(kRoutedRowTile, D_out);
    for (Index h = 0; h < plan.heads; ++h) {
      const auto [lo, hi] = plan.range(h, r0, r1);
      if (hi == lo) continue;
      project_out(h, O.middleRows(lo, hi - lo), p.topRows(hi - lo));
      for (Index i = lo; i < hi; ++i) Y.row(plan.rows[i]) += p.row(i - lo);
    }
  });
}

}  // namespace detail
}  // namespace moh
