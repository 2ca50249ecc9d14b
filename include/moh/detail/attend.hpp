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
#include "moh/scratch.hpp"
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

/// Per-thread scratch of the attention drivers: the kernel's tiles plus a gathered query block.
/// Kept per thread between calls (see scratch.hpp), so the loops below never allocate once warm.
template <class T>
struct GatherScratch {
  AttentionScratch<T> kernel;
  Matrix<T> q, o;                // [rows, d]
  std::vector<Index> positions;  // [rows]
  void reserve(Index rows, Index d) {
    if (q.rows() < rows || q.cols() != d) {
      q.resize(std::max(rows, kQueryBlock), d);
      o.resize(q.rows(), d);
      positions.resize(static_cast<std::size_t>(q.rows()));
    }
  }
};

template <class T>
GatherScratch<T>& thread_gather_scratch() {
  thread_local GatherScratch<T> scratch;
  return scratch;
}

template <class T>
PackedKeys<T>& thread_packed_keys() {
  thread_local PackedKeys<T> packed;
  return packed;
}

// Query rows per attention task. A task lays out its kv head's keys once (PackedKeys) when it
// has at least kPackRows rows, so that cost is spread over many query blocks.
constexpr Index kTaskRows = 8 * kQueryBlock;
constexpr Index kPackRows = 32;

/// Keys/values of sequence b, kv head g, packed for `rows` queries when worth it (else null).
template <class T>
const PackedKeys<T>* maybe_pack(const KeyValues<T>& kv, Index b, Index g, Index d, Index rows,
                                T scale) {
  if (!tiled_head<T>(d) || rows < kPackRows) return nullptr;
  PackedKeys<T>& p = thread_packed_keys<T>();
  p.pack(kv.k.at(b, 0, g), kv.k.row_stride, kv.v.at(b, 0, g), kv.v.row_stride, kv.keys, d, scale);
  return &p;
}

/// O[b*T + t, h*d : (h+1)*d] = attention of query head h of token t over kv head
/// g = h / (H / H_kv). q: [B, T, H heads]; out: row-major [B*T, H*d].
/// Query heads that share a kv head are attended together (their queries gathered into one
/// block), so each key/value block is read once per group rather than once per query head.
template <class T>
void attend_heads(const HeadsView<T>& q, const KeyValues<T>& kv, Index batch, Index tokens,
                  Index heads, Index d, bool causal, T* out, ThreadPool* pool) {
  const Index group = heads / kv.kv_heads;
  const Index per_block = std::max<Index>(1, kQueryBlock / group);  // tokens per query block
  const Index per_task = per_block * (kTaskRows / kQueryBlock);      // tokens per task
  const Index chunks = blocks_of(tokens, per_task);
  const T scale = T(1) / std::sqrt(static_cast<T>(d));
  parallel_for(pool, batch * kv.kv_heads * chunks, [&](std::int64_t task, int) {
    const Index chunk = task % chunks, g = (task / chunks) % kv.kv_heads;
    const Index b = task / (chunks * kv.kv_heads);
    const Index first = chunk * per_task, last = std::min(tokens, first + per_task);
    const AttentionMasking mask{causal, kv.keys - tokens, kv.padding_row(b)};
    const PackedKeys<T>* packed = maybe_pack(kv, b, g, d, (last - first) * group, scale);
    GatherScratch<T>& s = thread_gather_scratch<T>();
    for (Index t0 = first; t0 < last; t0 += per_block) {
      const Index nt = std::min(per_block, last - t0);
      if (group == 1) {  // one head per kv head: attend in place, no gathering
        attention<T>(q.at(b, t0, g), q.row_stride, nt, QueryPositions{nullptr, t0},
                     kv.k.at(b, 0, g), kv.k.row_stride, kv.v.at(b, 0, g), kv.v.row_stride,
                     kv.keys, d, mask, scale, out + (b * tokens + t0) * heads * d + g * d,
                     heads * d, s.kernel, packed);
        continue;
      }
      const Index n = nt * group;
      s.reserve(n, d);
      for (Index t = 0; t < nt; ++t)
        for (Index j = 0; j < group; ++j) {
          const Index row = t * group + j;
          s.q.row(row) =
              Eigen::Map<const Vector<T>>(q.at(b, t0 + t, g * group + j), d).transpose();
          s.positions[row] = t0 + t;
        }
      attention<T>(s.q.data(), d, n, QueryPositions{s.positions.data(), 0}, kv.k.at(b, 0, g),
                   kv.k.row_stride, kv.v.at(b, 0, g), kv.v.row_stride, kv.keys, d, mask, scale,
                   s.o.data(), d, s.kernel, packed);
      for (Index t = 0; t < nt; ++t)
        for (Index j = 0; j < group; ++j)
          Eigen::Map<Vector<T>>(out + (b * tokens + t0 + t) * heads * d + (g * group + j) * d,
                                d) = s.o.row(t * group + j).transpose();
    }
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
    build_from(num_heads, b_, t_, gate, [&](Index r, auto&& add) {
      for (Index h = 0; h < num_heads; ++h)
        if (active(r, h)) add(h);
    });
  }
  /// Builds the plan from the k distinct heads pick(r, 0 .. k-1) of each row r, in
  /// O(B*T*k) rather than O(B*T*heads): a MoA router's top-k experts.
  template <class PickFn, class GateFn>
  void build_picked(Index num_heads, Index b_, Index t_, Index k, PickFn pick, GateFn gate) {
    build_from(num_heads, b_, t_, gate, [&](Index r, auto&& add) {
      for (Index s = 0; s < k; ++s) add(pick(r, s));
    });
  }
  /// Range of head h's pairs whose rows lie in [r0, r1).
  std::pair<Index, Index> range(Index h, Index r0, Index r1) const {
    const auto first = rows.begin() + offsets[h], last = rows.begin() + offsets[h + 1];
    return {std::lower_bound(first, last, r0) - rows.begin(),
            std::lower_bound(first, last, r1) - rows.begin()};
  }

 private:
  // each_head(r, add) calls add(h) once for every head h that row r uses (distinct heads).
  template <class GateFn, class EachHead>
  void build_from(Index num_heads, Index b_, Index t_, GateFn gate, EachHead each_head) {
    heads = num_heads;
    batch = b_;
    tokens = t_;
    const Index n = batch * tokens;
    offsets.assign(static_cast<std::size_t>(heads + 1), 0);
    for (Index r = 0; r < n; ++r)
      each_head(r, [&](Index h) {
        eigen_assert(h >= 0 && h < heads);
        ++offsets[h + 1];
      });
    for (Index h = 0; h < heads; ++h) offsets[h + 1] += offsets[h];
    rows.resize(static_cast<std::size_t>(offsets[heads]));
    positions.resize(rows.size());
    gates.resize(rows.size());
    std::vector<Index> fill(offsets.begin(), offsets.end() - 1);  // next free slot of each head
    for (Index r = 0; r < n; ++r)  // rows in order, so each head's rows ascend
      each_head(r, [&](Index h) {
        const Index i = fill[h]++;
        eigen_assert(i == offsets[h] || rows[i - 1] < r);  // a head picked twice for one row
        rows[i] = r;
        positions[i] = r % tokens;
        gates[i] = gate(r, h);
      });
  }
};

constexpr Index kRoutedRowTile = 128;    // rows per projection task of the routed path
// Output columns per task when heads have few rows. MoAAttention also stores its output experts
// in column panels of this width (see its constructor), so that each task reads contiguous runs.
constexpr Index kRoutedColumnTile = 128;
// Heads with fewer rows than this on average project their outputs in column tiles. Measured
// (1 thread, interleaved): at (8, 256, 512) MoA E = 32 (128 rows per expert) column tiles took
// 0.91x the time of row tiles; MoH at ViT 50-100 % (98-197 rows per head) was 0.97-1.01x.
constexpr Index kRoutedColumnRows = 256;

/// Runs the routed heads of `plan`:
///   Q[i]  = project_q(h, X rows of head h)                 (only the picked pairs)
///   O[i]  = gate[i] * attention(Q[i], keys/values of head h)
///   Y[r] += O rows of head h projected by project_out      (summed over heads in order)
/// project_q(h, row indices [n], gathered X rows [n, D] (empty unless gather_x), Q out [n, d]) and
/// project_out(h, O [n, d], P [n, m], c0, accumulate) (output columns [c0, c0 + m) of O's
/// projection, added to P or written) are the layer's per-head GEMMs. kv_head(h) picks the
/// key/value head. Y must already hold the bias (or zeros). X: [B*T, D] rows.
template <class T, class ProjectQ, class ProjectOut, class KvHead>
void attend_routed(const HeadPlan<T>& plan, const ConstRowsRef<T>& X, const KeyValues<T>& kv,
                   Index d, bool causal, bool gather_x, ProjectQ project_q, ProjectOut project_out,
                   KvHead kv_head, RowsRef<T> Y, ThreadPool* pool) {
  const Index pairs = plan.pairs(), D_in = X.cols(), D_out = Y.cols();
  const Index n_rows = plan.batch * plan.tokens;
  MatrixMap<T> Q = scratch_matrix<T>(ScratchSlot::RoutedQueries, pairs, d);
  MatrixMap<T> O = scratch_matrix<T>(ScratchSlot::RoutedOutputs, pairs, d);

  // 1. Queries of the picked pairs, per head, in fixed tiles of that head's rows.
  std::vector<Index> tile_head, tile_start;
  for (Index h = 0; h < plan.heads; ++h)
    for (Index i = plan.offsets[h]; i < plan.offsets[h + 1]; i += kRoutedRowTile) {
      tile_head.push_back(h);
      tile_start.push_back(i);
    }
  parallel_for(pool, static_cast<Index>(tile_head.size()), [&](std::int64_t task, int) {
    const Index h = tile_head[task], i0 = tile_start[task];
    const Index n = std::min(kRoutedRowTile, plan.offsets[h + 1] - i0);
    if (gather_x && plan.offsets[h + 1] - plan.offsets[h] == n_rows) {
      // Every token uses this head (a shared head): its rows are X's rows, no gathering.
      project_q(h, plan.rows.data() + i0, X.middleRows(i0 - plan.offsets[h], n),
                Q.middleRows(i0, n));
      return;
    }
    MatrixMap<T> g = scratch_matrix<T>(ScratchSlot::GatherRows, n, gather_x ? D_in : 0);
    if (gather_x)
      for (Index i = 0; i < n; ++i) g.row(i) = X.row(plan.rows[i0 + i]);
    project_q(h, plan.rows.data() + i0, g, Q.middleRows(i0, n));
  });

  // 2. Attention, per kv head, sequence and block of queries: the picked pairs of every query
  //    head that reads kv head g are gathered into one block, so each key/value block is read
  //    once per block of queries, and a kv head that no picked pair reads is never touched.
  //    Within a head the rows of one sequence are one contiguous run (rows are sorted).
  std::vector<Index> order;                    // pair indices, grouped by (kv head, sequence)
  std::vector<Index> att_first, att_count;     // tasks: ranges of `order`
  std::vector<Index> att_batch, att_kv;
  order.reserve(static_cast<std::size_t>(pairs));
  std::vector<Index> kv_of_head(static_cast<std::size_t>(plan.heads));
  Index kv_heads_used = 0;
  for (Index h = 0; h < plan.heads; ++h) {
    kv_of_head[h] = kv_head(h);
    kv_heads_used = std::max(kv_heads_used, kv_of_head[h] + 1);
  }
  for (Index g = 0; g < kv_heads_used; ++g)
    for (Index b = 0; b < plan.batch; ++b) {
      const Index first = static_cast<Index>(order.size());
      for (Index h = 0; h < plan.heads; ++h) {
        if (kv_of_head[h] != g) continue;
        const auto [lo, hi] = plan.range(h, b * plan.tokens, (b + 1) * plan.tokens);
        for (Index i = lo; i < hi; ++i) order.push_back(i);
      }
      const Index last = static_cast<Index>(order.size());
      for (Index i = first; i < last; i += kTaskRows) {
        att_first.push_back(i);
        att_count.push_back(std::min(kTaskRows, last - i));
        att_batch.push_back(b);
        att_kv.push_back(g);
      }
    }
  const T scale = T(1) / std::sqrt(static_cast<T>(d));
  parallel_for(pool, static_cast<Index>(att_first.size()), [&](std::int64_t task, int) {
    const Index first = att_first[task], n = att_count[task];
    const Index b = att_batch[task], g = att_kv[task];
    const AttentionMasking mask{causal, kv.keys - plan.tokens, kv.padding_row(b)};
    const PackedKeys<T>* packed = maybe_pack(kv, b, g, d, n, scale);
    GatherScratch<T>& s = thread_gather_scratch<T>();
    for (Index r0 = 0; r0 < n; r0 += kQueryBlock) {
      const Index m = std::min(kQueryBlock, n - r0);
      s.reserve(m, d);
      for (Index r = 0; r < m; ++r) {
        const Index i = order[first + r0 + r];
        s.q.row(r) = Q.row(i);
        s.positions[r] = plan.positions[i];
      }
      attention<T>(s.q.data(), d, m, QueryPositions{s.positions.data(), 0}, kv.k.at(b, 0, g),
                   kv.k.row_stride, kv.v.at(b, 0, g), kv.v.row_stride, kv.keys, d, mask, scale,
                   s.o.data(), d, s.kernel, packed);
      for (Index r = 0; r < m; ++r) {
        const Index i = order[first + r0 + r];
        O.row(i) = s.o.row(r) * plan.gates[i];
      }
    }
  });

  // 3. Output projection. Each Y element adds the heads' contributions in index order, so the
  //    sum is the same whatever thread runs a tile. With many rows per head: tiles of token
  //    rows. With fewer than kRoutedColumnRows on average (MoA's many experts: about 12 tokens
  //    each at E = 32 on 197 tokens): tiles of output columns, so that each head's weights are
  //    read once per call, not once per row tile, and its rows are multiplied together.
  auto add_head = [&](Index h, Index lo, Index hi, Index c0, MatrixMap<T>& p) {
    const Index n = hi - lo, m = p.cols();
    if (plan.rows[hi - 1] - plan.rows[lo] == n - 1) {  // consecutive rows: add in place
      project_out(h, O.middleRows(lo, n), Y.block(plan.rows[lo], c0, n, m), c0, true);
      return;
    }
    project_out(h, O.middleRows(lo, n), p.topRows(n), c0, false);
    for (Index i = lo; i < hi; ++i) Y.row(plan.rows[i]).segment(c0, m) += p.row(i - lo);
  };
  if (pairs < plan.heads * kRoutedColumnRows) {
    Index most = 0;
    for (Index h = 0; h < plan.heads; ++h) most = std::max(most, plan.offsets[h + 1] - plan.offsets[h]);
    parallel_for(pool, blocks_of(D_out, kRoutedColumnTile), [&](std::int64_t task, int) {
      const Index c0 = task * kRoutedColumnTile, m = std::min(kRoutedColumnTile, D_out - c0);
      MatrixMap<T> p = scratch_matrix<T>(ScratchSlot::PartialOutput, most, m);
      for (Index h = 0; h < plan.heads; ++h)
        if (plan.offsets[h + 1] > plan.offsets[h]) add_head(h, plan.offsets[h], plan.offsets[h + 1], c0, p);
    });
    return;
  }
  parallel_for(pool, blocks_of(n_rows, kRoutedRowTile), [&](std::int64_t task, int) {
    const Index r0 = task * kRoutedRowTile, r1 = std::min(n_rows, r0 + kRoutedRowTile);
    MatrixMap<T> p = scratch_matrix<T>(ScratchSlot::PartialOutput, r1 - r0, D_out);
    for (Index h = 0; h < plan.heads; ++h) {
      const auto [lo, hi] = plan.range(h, r0, r1);
      if (hi > lo) add_head(h, lo, hi, 0, p);
    }
  });
}

}  // namespace detail
}  // namespace moh
