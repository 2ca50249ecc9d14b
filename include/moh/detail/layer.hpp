// Internal: the skeleton every attention layer shares.
//
// AttentionLayer<Derived, T, Routing> implements, once for all layers, what does not depend on
// how a layer turns queries into outputs:
//   - self-attention (forward), cross-attention (forward_cross) and cached decoding
//     (forward_cached): checking the inputs and the options, projecting the keys and values of
//     x, of the memory or of the new tokens (RoPE'd from the right position), appending them to
//     the cache, and resolving the causal mask;
//   - cache creation and the size accessors;
//   - weights by name (weight_infos, set_weight, weight) and the check that every weight was set
//     before a forward call.
// The derived layer supplies its key/value projection and the attention proper:
//   void project_keys_values(const ConstRowsRef<T>& src, RowsRef<T> KV, const Exec&) const;
//       KV [N, 2 H_kv d]: key heads, then value heads, before RoPE
//   void attend(const Pass<T, Routing>&) const;
//   void store_weight(const std::string& name, const T* values);   // numel values, row-major
//   void load_weight(const std::string& name, T* values) const;
//   Index bias_heads() const;     // the head dimension an attn_bias may have (besides 1)
//   Index weight_heads() const;   // the head dimension of the attention probabilities
//   static constexpr const char* kName;
//   static constexpr bool kHasModes, kHasQueryPadding;
// and may hide the defaults of reads_grid() (whether options.grid_h/grid_w mean something) and
// self_attention_only() (null, or why forward_cross/forward_cached are refused).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "moh/detail/attend.hpp"
#include "moh/attention_config.hpp"
#include "moh/options.hpp"
#include "moh/ops/linear.hpp"
#include "moh/ops/rope.hpp"
#include "moh/runtime/kv_cache.hpp"
#include "moh/runtime/workspace.hpp"
#include "moh/tensor.hpp"

namespace moh {
namespace detail {

/// Head sizes of a layer, validated once by its config.
struct HeadShape {
  Index D = 0;     // embed_dim
  Index H = 0;     // query heads (MoA: experts)
  Index d = 0;     // head_dim
  Index Hkv = 0;   // key/value heads
  Index D_kv = 0;  // width of the rows keys and values are projected from (the memory's)
  bool rope = false;
  double rope_theta = 10000.0;
  Index group() const { return H / Hkv; }
  Index kv_width() const { return 2 * Hkv * d; }
};

/// Validates the fields of AttentionConfig that every layer reads the same way.
inline void validate_common(const AttentionConfig& c, const char* layer) {
  require(c.embed_dim > 0, layer, ": embed_dim must be positive: expected > 0, got ", c.embed_dim);
  require(c.head_dim >= 0, layer, ": head_dim must be >= 0: expected >= 0, got ", c.head_dim);
  if (c.rope) require(c.rope_theta > 0, layer, ": rope_theta must be positive: expected > 0, got ",
                      c.rope_theta);
}

/// Throws unless a layer's `weights` values (computed in double, so that the check itself
/// cannot overflow) fit comfortably in an Index: sizes that large are a bad config, not a model.
inline void require_weight_count_fits(double weights, const char* layer) {
  constexpr double kMax = 9007199254740992.0;  // 2^53
  require(weights <= kMax, layer, ": the sizes describe ", weights, " weight values: expected at ",
          "most 2^53");
}

/// One attention call as the derived layer sees it.
template <class T, class Routing>
struct Pass {
  ConstMatrixMap<T> X;        // [B*T, D] rows of x
  Index batch = 0, tokens = 0;
  const KeyValues<T>& kv;     // keys/values to attend to
  const RopeTable<T>& rope;   // cos/sin of x's positions (empty without RoPE)
  bool causal = false;
  ComputeMode mode = ComputeMode::Auto;
  mutable MatrixMap<T> Y;     // [B*T, D] rows of y (written through a const Pass)
  Routing* routing = nullptr;  // the caller's record, or null
  Exec exec;
  ScoreExtras<T> extras;      // the call's attention bias and probabilities (checked), or none
  PaddingMask query_padding;  // [B, T] (layers with kHasQueryPadding), or none
  const ForwardOptions& options;
};

/// Uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)) like torch.nn.Linear's default init.
template <class T>
void fill_uniform(T* data, Index n, Index fan_in, std::mt19937_64& rng) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
  std::uniform_real_distribution<double> dist(-bound, bound);
  for (Index i = 0; i < n; ++i) data[i] = static_cast<T>(dist(rng));
}

template <class Derived, class T, class Routing>
class AttentionLayer {
 public:
  using Scalar = T;
  using RoutingRecord = Routing;

  Index embed_dim() const { return shape_.D; }
  /// Query heads (MoAAttention counts its experts' heads, E H_kv).
  Index num_heads() const { return shape_.H; }
  Index num_kv_heads() const { return shape_.Hkv; }
  Index head_dim() const { return shape_.d; }
  /// Width of the memory forward_cross() takes keys and values from.
  Index memory_dim() const { return shape_.D_kv; }

  /// Self-attention. x, y: [B, T, D] (y written, may not alias x). Fills `routing` when given.
  void forward(const ConstTensorMap3<T>& x, TensorMap3<T> y, const ForwardOptions& opts = {},
               Routing* routing = nullptr) const {
    check_call(x, y, opts, Kind::Self);
    const WorkspaceLease lease(opts.workspace, opts.pool, Derived::kName);
    const Exec exec = lease.exec();
    const Arena::Scope scope(exec.call());
    // Keys and queries are the same tokens: one table of their positions serves both.
    const RopeTable<T> rope = rope_table(opts.position_offset, x.dimension(1), exec.call());
    const KeyValues<T> kv = keys_values_of(x, rope, opts.key_padding_mask, exec);
    run(x, kv, rope, opts, Kind::Self, y, routing, exec);
  }

  /// Cross-attention: queries (and routing) from x [B, T, D], keys/values from memory
  /// [B, S, memory_dim()]; key_padding_mask [B, S].
  void forward_cross(const ConstTensorMap3<T>& x, const ConstTensorMap3<T>& memory,
                     TensorMap3<T> y, const ForwardOptions& opts = {},
                     Routing* routing = nullptr) const {
    check_call(x, y, opts, Kind::Cross);
    require_shape3(Derived::kName, "memory", memory, x.dimension(0), -1, shape_.D_kv);
    const WorkspaceLease lease(opts.workspace, opts.pool, Derived::kName);
    // The memory projected as make_memory_cache() projects it, the queries as on a memory cache,
    // so that the two forms give the same bits.
    const Exec memory_exec = decode_exec(lease, memory.dimension(1));
    const Exec exec = decode_exec(lease, x.dimension(1));
    const Arena::Scope scope(exec.call());
    // The memory's keys sit at positions 0.., the queries at position_offset..
    const RopeTable<T> key_rope = rope_table(0, memory.dimension(1), exec.call());
    const RopeTable<T> rope = rope_table(opts.position_offset, x.dimension(1), exec.call());
    const KeyValues<T> kv = keys_values_of(memory, key_rope, opts.key_padding_mask, memory_exec);
    run(x, kv, rope, opts, Kind::Cross, y, routing, exec);
  }

  /// The keys and values of a memory [B, S, memory_dim()], computed once for many
  /// forward_cross() calls (an encoder's output attended at every decoding step): a cache of S
  /// tokens, full, keys RoPE'd at positions 0.. Padding: opts.key_padding_mask [B, S].
  KvCache<T> make_memory_cache(const ConstTensorMap3<T>& memory, const ForwardOptions& opts = {}) const {
    const char* name = Derived::kName;
    require_shape3(name, "memory", memory, -1, -1, shape_.D_kv);
    require(memory.dimension(0) > 0 && memory.dimension(1) > 0, name, ": memory: expected at ",
            "least one sequence of one token, got [", memory.dimension(0), ", ",
            memory.dimension(1), ", ", memory.dimension(2), "]");
    require_weights_set();
    if (const char* why = derived().self_attention_only())
      fail(name, ": make_memory_cache: ", why, ": expected forward (self-attention), got a memory");
    // Only key_padding_mask, pool and workspace mean something here; the rest belong to the
    // forward_cross calls that read the cache.
    const ForwardOptions plain;
    const char* unused = opts.attn_bias                ? "attn_bias"
                         : opts.attention_weights      ? "attention_weights"
                         : opts.query_padding_mask     ? "query_padding_mask"
                         : opts.new_token_padding_mask ? "new_token_padding_mask"
                         : opts.causal != plain.causal ? "causal"
                         : opts.mode != plain.mode     ? "mode"
                         : opts.position_offset != 0   ? "position_offset"
                         : (opts.grid_h || opts.grid_w) ? "grid_h, grid_w"
                                                        : nullptr;
    if (unused)
      fail(name, ": make_memory_cache: ", unused, " is an option of the forward_cross calls that "
           "read the cache: expected only key_padding_mask, pool and workspace here, got ",
           unused);
    const Index B = memory.dimension(0), S = memory.dimension(1);
    check_padding(opts.key_padding_mask, B, S, "key_padding_mask");
    KvCache<T> cache(B, shape_.Hkv, shape_.d, S);
    const WorkspaceLease lease(opts.workspace, opts.pool, Derived::kName);
    const Exec exec = decode_exec(lease, S);  // forward_cross with the tensor projects it alike
    const Arena::Scope scope(exec.call());
    const RopeTable<T> rope = rope_table(0, S, exec.call());
    write_slots(projected(memory, rope, exec), B, S, opts.key_padding_mask, cache);
    KvCacheAccess::commit(cache, S);
    KvCacheAccess::mark_memory(cache);
    return cache;
  }

  /// Cross-attention to a memory whose keys and values make_memory_cache() computed: queries
  /// (and routing) from x [B, T, D]; the cache is read, never changed. The memory's padding is
  /// the cache's (opts.key_padding_mask must be empty).
  void forward_cross(const ConstTensorMap3<T>& x, const KvCache<T>& memory, TensorMap3<T> y,
                     const ForwardOptions& opts = {}, Routing* routing = nullptr) const {
    check_call(x, y, opts, Kind::Cross);
    if (!memory.is_memory())
      fail(Derived::kName, ": forward_cross: expected a memory cache (make_memory_cache), got a "
           "cache of the layer's own tokens (make_cache), which forward_cached reads");
    KvCacheAccess::check(memory, x.dimension(0), shape_.Hkv, shape_.d, 0, Derived::kName);
    if (opts.key_padding_mask)
      fail(Derived::kName, ": key_padding_mask: a memory cache keeps the memory's padding from "
           "make_memory_cache: expected none here, got a [", opts.key_padding_mask->dimension(0),
           ", ", opts.key_padding_mask->dimension(1), "] mask");
    const WorkspaceLease lease(opts.workspace, opts.pool, Derived::kName);
    const Exec exec = decode_exec(lease, x.dimension(1));
    const Arena::Scope scope(exec.call());
    const RopeTable<T> rope = rope_table(opts.position_offset, x.dimension(1), exec.call());
    run(x, cache_view(memory, 0, exec.call()), rope, opts, Kind::Cross, y, routing, exec);
  }

  /// Incremental self-attention: x [B, T_new, D] are the next tokens of each sequence after
  /// those in `cache`; their keys/values are appended and they attend to their sequence's whole
  /// cache, causally unless opts.causal is Off. Each sequence continues from its own length
  /// (cache.length(b): RoPE positions, causal mask), so a batch of sequences of different lengths
  /// advances in one call. Padding of the new tokens: opts.new_token_padding_mask [B, T_new].
  void forward_cached(const ConstTensorMap3<T>& x, TensorMap3<T> y, KvCache<T>& cache,
                      const ForwardOptions& opts = {}, Routing* routing = nullptr) const {
    check_call(x, y, opts, Kind::Cached);
    if (cache.is_memory())
      fail(Derived::kName, ": forward_cached: this KvCache holds a memory (make_memory_cache), "
           "which forward_cross reads: expected a cache from make_cache, got a memory cache");
    const Index B = x.dimension(0), Tq = x.dimension(1);
    KvCacheAccess::check(cache, B, shape_.Hkv, shape_.d, Tq, Derived::kName);
    const WorkspaceLease lease(opts.workspace, opts.pool, Derived::kName);
    const Exec exec = decode_exec(lease, Tq);
    const Arena::Scope scope(exec.call());
    const RopeTable<T> rope = cache_rope(cache, Tq, exec.call());  // new keys and queries alike
    const MatrixMap<T> KV = projected(x, rope, exec);
    write_slots(KV, B, Tq, opts.new_token_padding_mask, cache);
    run(x, cache_view(cache, Tq, exec.call()), rope, opts, Kind::Cached, y, routing, exec);
    KvCacheAccess::commit(cache, Tq);  // only once the call has succeeded
  }

  /// Convenience: returns y for self-attention (allocates it).
  Tensor3<T> operator()(const Tensor3<T>& x, const ForwardOptions& opts = {},
                        Routing* routing = nullptr) const {
    Tensor3<T> y(x.dimension(0), x.dimension(1), shape_.D);
    forward(x, y, opts, routing);
    return y;
  }

  /// A cache for `batch` sequences of up to `capacity` tokens, sized for this layer; keys and
  /// values stored in T or in bfloat16 (`storage`).
  KvCache<T> make_cache(Index batch, Index capacity,
                        CacheStorage storage = CacheStorage::Native) const {
    return KvCache<T>(batch, shape_.Hkv, shape_.d, capacity, storage);
  }

  // ---- weights by name ---------------------------------------------------------------------

  /// The layer's tensors under the authors' PyTorch names, with their shapes.
  const std::vector<WeightInfo>& weight_infos() const { return infos_; }

  /// Sets tensor `name` from `count` = numel values, row-major in its PyTorch shape (bfloat16
  /// storage rounds them). Unknown names and wrong counts throw moh::Error.
  void set_weight(const std::string& name, const T* values, Index count) {
    const std::size_t i = index_of(name);
    require(count == infos_[i].numel(), Derived::kName, ": ", name, ": expected ",
            infos_[i].numel(), " values (shape ", shape_string(infos_[i].shape), "), got ", count);
    derived().store_weight(name, values);
    set_[i] = 1;
  }
  /// Sets a tensor from a matrix [numel / last dim, last dim]; a 1-D tensor [n] from a vector
  /// (a matrix [n, 1] or [1, n]).
  void set_weight(const std::string& name, const Matrix<T>& values) {
    const WeightInfo& w = infos_[index_of(name)];
    if (w.shape.size() == 1) {
      const bool vector = values.cols() == 1 || values.rows() == 1;
      if (!vector || values.size() != w.shape[0])
        fail(Derived::kName, ": ", name, ": expected shape [", w.shape[0], "], got ",
             vector ? shape_string(std::vector<Index>{values.size()})
                    : shape_string(std::vector<Index>{values.rows(), values.cols()}));
    } else {
      const Index cols = w.shape.back(), rows = w.numel() / std::max<Index>(cols, 1);
      if (values.rows() != rows || values.cols() != cols)
        fail(Derived::kName, ": ", name, ": expected shape [", rows, ", ", cols, "], got [",
             values.rows(), ", ", values.cols(), "]");
    }
    set_weight(name, values.data(), values.size());
  }
  /// The values of tensor `name`, row-major in its PyTorch shape (exact for bfloat16 storage).
  std::vector<T> weight(const std::string& name) const {
    std::vector<T> out(static_cast<std::size_t>(infos_[index_of(name)].numel()));
    derived().load_weight(name, out.data());
    return out;
  }
  /// Whether every tensor has been set (by a seed, zero_weights, the setters or load_weights).
  bool weights_set() const {
    return std::all_of(set_.begin(), set_.end(), [](char s) { return s != 0; });
  }

 protected:
  AttentionLayer(const HeadShape& shape, std::vector<WeightInfo> infos)
      : shape_(shape), infos_(std::move(infos)), set_(infos_.size(), 0) {}

  const HeadShape& shape() const { return shape_; }
  // Default hooks; a layer that reads a token grid, or attends only to its own tokens, hides
  // them.
  bool reads_grid() const { return false; }
  const char* self_attention_only() const { return nullptr; }  // or why
  /// After a seeded or zero initialisation.
  void mark_weights_set() { std::fill(set_.begin(), set_.end(), 1); }

  /// Matrix [rows, cols] view of tensor `name`'s values for a typed accessor.
  Matrix<T> weight_matrix(const std::string& name, Index rows, Index cols) const {
    const std::vector<T> v = weight(name);
    return ConstMatrixMap<T>(v.data(), rows, cols);
  }

  /// The Exec of a decode-style call with `tokens` tokens per sequence (new tokens against a
  /// cache, queries or a memory of cross-attention): at most kDotRows tokens take every product
  /// against transposed weights as dot products (Exec::dot_rows), so that a sequence's rows do
  /// not depend on how many sequences share the call.
  static Exec decode_exec(const WorkspaceLease& lease, Index tokens) {
    Exec exec = lease.exec();
    exec.dot_rows = tokens <= kDotRows;
    return exec;
  }

  /// RoPE on `heads` heads of size d at column `col` of each row of M ([B*T, *]), row t of each
  /// sequence at the table's position t. No-op without a table (a layer without RoPE).
  void rope_rows(RowsRef<T> M, Index col, Index heads, Index batch, Index tokens,
                 const RopeTable<T>& table) const {
    if (!table) return;
    for (Index b = 0; b < batch; ++b)
      for (Index t = 0; t < tokens; ++t)
        for (Index h = 0; h < heads; ++h)
          table.rotate(M.row(b * tokens + t).data() + col + h * shape_.d, b, t);
  }
  /// The cos/sin table of positions [first, first + tokens) in `arena`; empty without RoPE.
  RopeTable<T> rope_table(Index first, Index tokens, Arena& arena) const {
    if (!shape_.rope) return RopeTable<T>();
    return RopeTable<T>(first, tokens, shape_.d, shape_.rope_theta,
                        arena.allocate<T>(RopeTable<T>::storage_size(tokens, shape_.d)));
  }
  /// The table of `tokens` new tokens after each sequence's cached ones. A ragged cache gets
  /// B x tokens rows, sequence b's at positions length(b) + t (only the rows used: one row per
  /// token however far apart the lengths are).
  RopeTable<T> cache_rope(const KvCache<T>& cache, Index tokens, Arena& arena) const {
    if (!cache.ragged() || !shape_.rope) return rope_table(cache.length(), tokens, arena);
    const Index B = cache.batch();
    Index* positions = arena.allocate<Index>(B * tokens);
    Index* starts = arena.allocate<Index>(B);
    for (Index b = 0; b < B; ++b) {
      starts[b] = b * tokens;
      for (Index t = 0; t < tokens; ++t) positions[b * tokens + t] = cache.length(b) + t;
    }
    RopeTable<T> table = RopeTable<T>::at_positions(
        positions, B * tokens, shape_.d, shape_.rope_theta,
        arena.allocate<T>(RopeTable<T>::storage_size(B * tokens, shape_.d)));
    table.set_sequence_starts(starts);
    return table;
  }

 private:
  enum class Kind { Self, Cross, Cached };

  const Derived& derived() const { return static_cast<const Derived&>(*this); }
  Derived& derived() { return static_cast<Derived&>(*this); }

  std::size_t index_of(const std::string& name) const {
    for (std::size_t i = 0; i < infos_.size(); ++i)
      if (infos_[i].name == name) return i;
    std::string names;
    for (const WeightInfo& w : infos_) names += (names.empty() ? "" : ", ") + w.name;
    fail(Derived::kName, ": no weight named '", name, "': expected one of [", names, "]");
  }

  void require_weights_set() const {
    if (weights_set()) return;
    std::string unset;
    for (std::size_t i = 0; i < infos_.size(); ++i)
      if (!set_[i]) unset += (unset.empty() ? "" : ", ") + infos_[i].name;
    fail(Derived::kName, ": weights not set: [", unset, "]: expected every weight set (the "
         "setters or load_weights), or a layer built with a seed or moh::zero_weights");
  }

  void check_call(const ConstTensorMap3<T>& x, const TensorMap3<T>& y, const ForwardOptions& o,
                  Kind kind) const {
    const char* name = Derived::kName;
    require_shape3(name, "x", x, -1, -1, shape_.D);
    require_shape3(name, "y", y, x.dimension(0), x.dimension(1), shape_.D);
    require_weights_set();
    if (kind != Kind::Cross && shape_.D_kv != shape_.D)
      fail(name, ": ", kind == Kind::Self ? "forward" : "forward_cached", ": keys and values of "
           "this layer come from a memory of width kdim = ", shape_.D_kv, ", not from x (width ",
           shape_.D, "): expected forward_cross with a memory, got self-attention");
    if (!Derived::kHasModes && o.mode != ComputeMode::Auto)
      fail(name, ": mode: this layer has no compute modes: expected ComputeMode::Auto, got ",
           o.mode == ComputeMode::Dense ? "Dense" : "Sparse");
    if (kind == Kind::Cached) {
      check_padding(o.new_token_padding_mask, x.dimension(0), x.dimension(1),
                    "new_token_padding_mask");
      if (o.position_offset != 0)
        fail(name, ": position_offset: a cached call continues from the cache's length: "
             "expected 0, got ", o.position_offset);
      if (o.key_padding_mask)
        fail(name, ": key_padding_mask is for forward and forward_cross ([batch, keys]): "
             "expected none in forward_cached, which takes new_token_padding_mask [batch, new "
             "tokens], got a [", o.key_padding_mask->dimension(0), ", ",
             o.key_padding_mask->dimension(1), "] mask");
    } else {
      if (o.new_token_padding_mask)
        fail(name, ": new_token_padding_mask is for forward_cached: expected none here, where "
             "padding is key_padding_mask [batch, keys], got a [",
             o.new_token_padding_mask->dimension(0), ", ",
             o.new_token_padding_mask->dimension(1), "] mask");
      if (o.position_offset != 0 && !shape_.rope)
        fail(name, ": position_offset: the layer has no RoPE (rope = false): expected 0, got ",
             o.position_offset);
    }
    require(o.position_offset >= 0, name, ": position_offset: expected >= 0, got ",
            o.position_offset);
    if (o.query_padding_mask) {
      if (!Derived::kHasQueryPadding)
        fail(name, ": query_padding_mask is MoAAttention's (fairseq's skip mask): expected none "
             "here, got a [", o.query_padding_mask->dimension(0), ", ",
             o.query_padding_mask->dimension(1), "] mask");
      check_padding(o.query_padding_mask, x.dimension(0), x.dimension(1), "query_padding_mask");
    }
    if (!derived().reads_grid() && (o.grid_h != 0 || o.grid_w != 0))
      fail(name, ": grid_h, grid_w: only a cosine-attention layer (MoHConfig::scores = cosine) "
           "reads a token grid: expected 0 x 0, got ", o.grid_h, " x ", o.grid_w);
    if (kind != Kind::Self)
      if (const char* why = derived().self_attention_only())
        fail(name, ": ", kind == Kind::Cross ? "forward_cross" : "forward_cached", ": ", why,
             ": expected forward (self-attention), got ",
             kind == Kind::Cross ? "cross-attention" : "cached decoding");
  }

  /// The bias and probability views of a call with `tokens` queries over `keys` keys, checked
  /// against the shapes docs/semantics.md §6 allows; the probabilities are zeroed (rows that no
  /// head computes stay zero).
  ScoreExtras<T> score_extras(const ForwardOptions& o, Index batch, Index tokens,
                              Index keys) const {
    const char* name = Derived::kName;
    ScoreExtras<T> e;
    if (o.attn_bias) {
      const Tensor4Ref<false>& m = o.attn_bias;
      const Index Hb = derived().bias_heads(), b0 = m.dimension(0), h0 = m.dimension(1);
      if (!((b0 == batch || b0 == 1) && (h0 == Hb || h0 == 1) && m.dimension(2) == tokens &&
            m.dimension(3) == keys))
        fail(name, ": attn_bias: expected shape [",
             batch == 1 ? std::string("1") : std::to_string(batch) + " or 1", ", ",
             Hb == 1 ? std::string("1") : std::to_string(Hb) + " or 1", ", ", tokens, ", ", keys,
             "] (batch, heads, queries, keys), got [", b0, ", ", h0, ", ", m.dimension(2), ", ",
             m.dimension(3), "]");
      e.bias = m.template data<T>(name, "attn_bias");
      e.bias_t = keys;
      e.bias_h = h0 == 1 ? 0 : tokens * keys;
      e.bias_b = b0 == 1 ? 0 : h0 * tokens * keys;
    }
    if (o.attention_weights) {
      const Tensor4Ref<true>& w = o.attention_weights;
      const Index Hw = derived().weight_heads();
      if (w.dimension(0) != batch || w.dimension(1) != Hw || w.dimension(2) != tokens ||
          w.dimension(3) != keys)
        fail(name, ": attention_weights: expected shape [", batch, ", ", Hw, ", ", tokens, ", ",
             keys, "] (batch, heads, queries, keys), got [", w.dimension(0), ", ",
             w.dimension(1), ", ", w.dimension(2), ", ", w.dimension(3), "]");
      e.weights = w.template data<T>(name, "attention_weights");
      e.weights_heads = Hw;
      e.tokens = tokens;
      e.keys = keys;
      std::fill(e.weights, e.weights + batch * Hw * tokens * keys, T(0));
    }
    return e;
  }

  // Keys/values of src's rows [B*S, 2 H_kv d] in the call's arena, keys RoPE'd with `rope`.
  MatrixMap<T> projected(const ConstTensorMap3<T>& src, const RopeTable<T>& rope,
                         const Exec& exec) const {
    const Index B = src.dimension(0), S = src.dimension(1);
    MatrixMap<T> KV = exec.call().template matrix<T>(B * S, shape_.kv_width());
    derived().project_keys_values(as_rows(src), KV, exec);
    rope_rows(KV, 0, shape_.Hkv, B, S, rope);
    return KV;
  }

  KeyValues<T> keys_values_of(const ConstTensorMap3<T>& src, const RopeTable<T>& rope,
                              const PaddingMask& padding, const Exec& exec) const {
    const Index B = src.dimension(0), S = src.dimension(1);
    check_padding(padding, B, S, "key_padding_mask");
    const MatrixMap<T> KV = projected(src, rope, exec);
    KeyValues<T> kv;
    const Index w = shape_.kv_width(), d = shape_.d;
    kv.k = HeadsView<T>{KV.data(), w, S * w, d};
    kv.v = HeadsView<T>{KV.data() + shape_.Hkv * d, w, S * w, d};
    kv.keys = S;
    kv.kv_heads = shape_.Hkv;
    if (padding) {
      kv.padding = padding->data();
      kv.padding_stride = S;
    }
    return kv;
  }

  void check_padding(const PaddingMask& mask, Index batch, Index tokens, const char* what) const {
    if (!mask) return;
    if (mask->dimension(0) != batch || mask->dimension(1) != tokens)
      fail(Derived::kName, ": ", what, ": expected shape [", batch, ", ", tokens, "], got [",
           mask->dimension(0), ", ", mask->dimension(1), "]");
  }

  /// Writes the new tokens' keys/values (KV [B*T, 2 H_kv d]) and padding flags into the slots
  /// after each sequence's length (which the caller advances once the call has succeeded).
  void write_slots(const ConstRowsRef<T>& KV, Index batch, Index tokens,
                   const PaddingMask& padding, KvCache<T>& cache) const {
    const Index d = shape_.d, Hkv = shape_.Hkv;
    for (Index b = 0; b < batch; ++b)
      for (Index t = 0, start = cache.length(b); t < tokens; ++t) {
        const T* row = KV.row(b * tokens + t).data();
        for (Index g = 0; g < Hkv; ++g)
          KvCacheAccess::store(cache, b, g, start + t, row + g * d, row + (Hkv + g) * d);
        KvCacheAccess::set_padding(cache, b, start + t, padding ? (*padding)(b, t) : false);
      }
  }

  /// The cache's tokens and `extra` slots after each sequence's (the new tokens just written)
  /// as keys/values to attend to; per-sequence counts in `arena` when the cache is ragged.
  static KeyValues<T> cache_view(const KvCache<T>& cache, Index extra, Arena& arena) {
    KeyValues<T> kv;
    const Index cap = cache.capacity(), d = cache.head_dim();
    kv.k = HeadsView<T>{KvCacheAccess::keys(cache), d, cache.kv_heads() * cap * d, cap * d};
    kv.v = HeadsView<T>{KvCacheAccess::values(cache), d, cache.kv_heads() * cap * d, cap * d};
    if (cache.storage() == CacheStorage::BFloat16) {
      kv.k.bf16 = KvCacheAccess::keys16(cache);
      kv.v.bf16 = KvCacheAccess::values16(cache);
    }
    kv.keys = cache.length() + extra;
    kv.kv_heads = cache.kv_heads();
    kv.padding = KvCacheAccess::padding(cache, 0);
    kv.padding_stride = cap;
    if (cache.ragged()) {
      Index* counts = arena.allocate<Index>(cache.batch());
      for (Index b = 0; b < cache.batch(); ++b) counts[b] = cache.length(b) + extra;
      kv.lengths = counts;
    }
    return kv;
  }

  void run(const ConstTensorMap3<T>& x, const KeyValues<T>& kv, const RopeTable<T>& rope,
           const ForwardOptions& o, Kind kind, TensorMap3<T>& y, Routing* routing,
           const Exec& exec) const {
    const bool causal = o.causal == Causal::On || (o.causal == Causal::Auto && kind == Kind::Cached);
    const Index B = x.dimension(0), Tq = x.dimension(1);
    const Pass<T, Routing> pass{as_rows(x), B,       Tq,      kv,
                                rope,       causal,  o.mode,  as_rows(y),
                                routing,    exec,    score_extras(o, B, Tq, kv.keys),
                                o.query_padding_mask, o};
    derived().attend(pass);
  }

  HeadShape shape_;
  std::vector<WeightInfo> infos_;
  std::vector<char> set_;  // [infos_.size()]: whether each tensor was set
};

}  // namespace detail
}  // namespace moh
