// What the layer tests share (tests/layers, tests/detail): the scalar types of the typed suites,
// the compute modes, calls that return their output, padding masks and the matching options of
// the layer and of the naive reference, the naive reference's weights of each layer, and checks
// of refused calls, of the rows of queries that see no key, and of thread-count independence.
// The helpers of every test (errors, random inputs, tolerances, configs) are test_helpers.hpp's.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "moh/moh.hpp"
#include "reference/naive.hpp"
#include "test_helpers.hpp"

namespace moh_test {

// The types every layer test names, so that `using namespace moh_test;` brings them with the
// helpers (test_helpers.hpp brings moh::Index).
using moh::ComputeMode;
using moh::ForwardOptions;
using moh::Mask;
using moh::Tensor3;
using moh_ref::Mat;
using moh_ref::to_ref;

// ---- typed suites -------------------------------------------------------------------------------

/// The scalar types every typed layer suite runs over.
using Scalars = ::testing::Types<float, double>;

/// The fixture of a typed suite that needs nothing of its own:
///   template <class T> using FooTest = moh_test::ScalarTest<T>;
///   TYPED_TEST_SUITE(FooTest, moh_test::Scalars);
template <class T>
class ScalarTest : public ::testing::Test {};

// ---- compute modes ------------------------------------------------------------------------------

/// The two compute modes of the routed layers (MoH, MoA).
inline constexpr moh::ComputeMode kModes[] = {moh::ComputeMode::Sparse, moh::ComputeMode::Dense};

inline const char* mode_name(moh::ComputeMode m) {
  return m == moh::ComputeMode::Sparse ? "sparse" : "dense";
}

/// The options of a call in `mode`, all else default (causal: Auto).
inline moh::ForwardOptions in_mode(moh::ComputeMode mode) {
  moh::ForwardOptions o;
  o.mode = mode;
  return o;
}

/// `o` with `pool` (null: the calling thread only).
inline moh::ForwardOptions with_pool(moh::ForwardOptions o, moh::ThreadPool* pool) {
  o.pool = pool;
  return o;
}

// ---- calls that return their output -------------------------------------------------------------

/// layer.forward(x, y, o, routing) into a new y [B, T, embed_dim] (forward itself, not operator()).
template <class Layer>
moh::Tensor3<typename Layer::Scalar> run(const Layer& layer,
                                         const moh::Tensor3<typename Layer::Scalar>& x,
                                         const moh::ForwardOptions& o = {},
                                         typename Layer::RoutingRecord* routing = nullptr) {
  moh::Tensor3<typename Layer::Scalar> y(x.dimension(0), x.dimension(1), layer.embed_dim());
  layer.forward(x, y, o, routing);
  return y;
}

/// layer.forward_cross(x, memory, y, o, routing) into a new y [B, T, embed_dim].
template <class Layer>
moh::Tensor3<typename Layer::Scalar> run_cross(const Layer& layer,
                                               const moh::Tensor3<typename Layer::Scalar>& x,
                                               const moh::Tensor3<typename Layer::Scalar>& memory,
                                               const moh::ForwardOptions& o = {},
                                               typename Layer::RoutingRecord* routing = nullptr) {
  moh::Tensor3<typename Layer::Scalar> y(x.dimension(0), x.dimension(1), layer.embed_dim());
  layer.forward_cross(x, memory, y, o, routing);
  return y;
}

// ---- padding masks and options ------------------------------------------------------------------

/// A [B, S] padding mask with the (sequence, key) pairs listed padded.
inline moh::Mask padding(Index B, Index S, std::initializer_list<std::pair<Index, Index>> padded) {
  moh::Mask m = no_padding(B, S);
  for (const auto& [b, s] : padded) m(b, s) = true;
  return m;
}

/// A [3, S] padding mask: sequence 0 padded at `keys`, sequence 1 not at all, sequence 2 at every
/// key (its queries see nothing).
inline moh::Mask three_sequence_padding(Index S, std::initializer_list<Index> keys) {
  moh::Mask m = no_padding(3, S);
  for (Index s : keys) m(0, s) = true;
  for (Index s = 0; s < S; ++s) m(2, s) = true;
  return m;
}

/// The masking of a call, as the layer's options and as the naive reference's: causal (On or Off,
/// never Auto), `pad` over the keys (no mask when null; it must outlive the options), and the RoPE
/// position of the first query.
struct Masking {
  bool causal = false;
  const moh::Mask* pad = nullptr;
  Index position_offset = 0;

  moh::ForwardOptions options(moh::ComputeMode mode = moh::ComputeMode::Auto) const {
    moh::ForwardOptions o;
    o.mode = mode;
    o.causal = causal ? moh::Causal::On : moh::Causal::Off;
    if (pad) o.key_padding_mask = moh::map_mask(*pad);
    o.position_offset = position_offset;
    return o;
  }
  moh_ref::AttnOptions reference() const {
    moh_ref::AttnOptions o;
    o.causal = causal;
    if (pad) o.pad = moh_ref::to_ref(*pad);
    o.position_offset = static_cast<int>(position_offset);
    return o;
  }
};

// ---- reference weights --------------------------------------------------------------------------

/// The naive reference's weights of an MHA-like layer (MultiHeadAttention, MoHAttention) whose
/// projections are W_in, b_in (queries, keys, values) and W_out, b_out.
template <class Layer, class M, class V>
moh_ref::MhaWeights mha_weights_of(const Layer& layer, const M& W_in, const V& b_in,
                                   const M& W_out, const V& b_out) {
  moh_ref::MhaWeights w;
  w.D = static_cast<int>(layer.embed_dim());
  w.H = static_cast<int>(layer.num_heads());
  w.d = static_cast<int>(layer.head_dim());
  w.Hkv = static_cast<int>(layer.num_kv_heads());
  w.W_in = to_ref(W_in);
  w.b_in = to_ref(b_in);
  w.W_out = to_ref(W_out);
  w.b_out = to_ref(b_out);
  w.rope = layer.config().rope;
  w.rope_theta = layer.config().rope_theta;
  return w;
}
/// The naive reference's weights of each layer.
template <class T>
moh_ref::MhaWeights weights_of(const moh::MultiHeadAttention<T>& m) {
  return mha_weights_of(m, m.in_proj_weight(), m.in_proj_bias(), m.out_proj_weight(),
                        m.out_proj_bias());
}
template <class T>
moh_ref::MhaWeights weights_of(const moh::MoHAttention<T>& m) {
  return mha_weights_of(m, m.qkv_weight(), m.qkv_bias(), m.proj_weight(), m.proj_bias());
}

template <class T>
moh_ref::MoAWeights weights_of(const moh::MoAAttention<T>& m) {
  const moh::MoAConfig& c = m.config();
  moh_ref::MoAWeights w;
  w.D = static_cast<int>(c.embed_dim);
  w.d = static_cast<int>(c.head_dim);
  w.E = static_cast<int>(c.num_experts);
  w.k = static_cast<int>(c.top_k);
  w.Wq = to_ref(m.query_experts());
  w.Wo = to_ref(m.output_experts());
  w.Wg = to_ref(m.gate_weight());
  w.Wk = to_ref(m.key_weight());
  w.Wv = to_ref(m.value_weight());
  w.topk_softmax = c.gating == moh::MoAGating::TopKSoftmax;
  return w;
}

// ---- layers without weights --------------------------------------------------------------------

/// A layer built from its config alone (no weights yet), the seeded layer to copy them from, and
/// the arguments of a call: x [2, 3, D] (seeded with seed + 1), y and a cache for 3 tokens.
template <class Layer>
struct UnsetLayer {
  using T = typename Layer::Scalar;

  UnsetLayer(const typename Layer::Config& c, std::uint64_t seed)
      : seeded(c, seed),
        m(c),
        x(random_tensor<T>(2, 3, c.embed_dim, seed + 1)),
        y(2, 3, c.embed_dim),
        cache(m.make_cache(2, 3)) {}

  const Layer seeded;
  Layer m;
  const moh::Tensor3<T> x;
  moh::Tensor3<T> y;
  moh::KvCache<T> cache;
};

// ---- checks -------------------------------------------------------------------------------------

/// Success when `f` throws a moh::Error whose message mentions every one of `parts`.
inline ::testing::AssertionResult ErrorMentions(const std::function<void()>& f,
                                                const std::vector<std::string>& parts) {
  return Mentions(error_of(f), parts);
}

/// Success when forward, forward_cross (x as its own memory) and forward_cached of `layer` all
/// refuse to run on x with `o`, each with a message that mentions every one of `parts`.
template <class Layer, class T = typename Layer::Scalar>
::testing::AssertionResult EveryEntryPointRefuses(const Layer& layer, const moh::Tensor3<T>& x,
                                                  moh::Tensor3<T>& y, moh::KvCache<T>& cache,
                                                  const std::vector<std::string>& parts,
                                                  const moh::ForwardOptions& o = {}) {
  const std::pair<const char*, std::function<void()>> calls[] = {
      {"forward", [&] { layer.forward(x, y, o); }},
      {"forward_cross", [&] { layer.forward_cross(x, x, y, o); }},
      {"forward_cached", [&] { layer.forward_cached(x, y, cache, o); }}};
  for (const auto& [entry, call] : calls) {
    ::testing::AssertionResult r = ErrorMentions(call, parts);
    if (!r) return r << " (" << entry << ")";
  }
  return ::testing::AssertionSuccess();
}

/// "[2, 3, 8]": a shape as the messages write it.
inline std::string shape_string(std::initializer_list<Index> dims) {
  std::string s = "[";
  for (Index d : dims) s += (s.size() > 1 ? ", " : "") + std::to_string(d);
  return s + "]";
}

/// On x [2, 3, D], forward refuses a y of [y_batch, y_tokens, D] and, in each of `modes`, a key
/// padding mask of [pad_batch, pad_keys], each time naming the shape expected and the one given.
template <class Layer>
void expect_mismatched_shapes_named(const Layer& layer, Index y_batch, Index y_tokens,
                                    Index pad_batch, Index pad_keys,
                                    std::initializer_list<moh::ComputeMode> modes) {
  using T = typename Layer::Scalar;
  const Index D = layer.embed_dim();
  const moh::Tensor3<T> x = random_tensor<T>(2, 3, D, 2);
  moh::Tensor3<T> y(y_batch, y_tokens, D), good(2, 3, D);
  EXPECT_TRUE(ErrorMentions([&] { layer.forward(x, y); },
                            {shape_string({2, 3, D}), shape_string({y_batch, y_tokens, D})}));
  const moh::Mask pad = no_padding(pad_batch, pad_keys);
  for (moh::ComputeMode mode : modes) {
    moh::ForwardOptions o = in_mode(mode);
    o.key_padding_mask = moh::map_mask(pad);
    EXPECT_TRUE(ErrorMentions([&] { layer.forward(x, good, o); },
                              {shape_string({2, 3}), shape_string({pad_batch, pad_keys})}))
        << mode_name(mode);
  }
}

/// In each compute mode, layer.forward on x gives the bits `seeded` gives.
template <class Layer>
void expect_same_bits_as_in_every_mode(const Layer& layer, const Layer& seeded,
                                       const moh::Tensor3<typename Layer::Scalar>& x) {
  for (moh::ComputeMode mode : kModes) {
    const moh::ForwardOptions o = in_mode(mode);
    const moh::Tensor3<typename Layer::Scalar> want = run(seeded, x, o);
    moh::Tensor3<typename Layer::Scalar> y(want.dimension(0), want.dimension(1),
                                           want.dimension(2));
    EXPECT_NO_THROW(layer.forward(x, y, o));
    EXPECT_TRUE(BitEqual(y, want)) << mode_name(mode);
  }
}

/// Every row (b, i) of y [B, T, D] for which sees_nothing(b, i) holds equals `bias` exactly (zero
/// when `bias` is empty): a query that sees no key outputs the output projection's bias.
template <class T, class SeesNothing>
void expect_rows_are_bias(const moh::Tensor3<T>& y, const moh::Vector<T>& bias,
                          SeesNothing sees_nothing, const std::string& where) {
  const Index B = y.dimension(0), Tn = y.dimension(1), D = y.dimension(2);
  for (Index b = 0; b < B; ++b)
    for (Index i = 0; i < Tn; ++i) {
      if (!sees_nothing(b, i)) continue;
      bool equal = true;
      for (Index c = 0; c < D; ++c)
        equal = equal && y.data()[(b * Tn + i) * D + c] == (bias.size() ? bias(c) : T(0));
      EXPECT_TRUE(equal) << where << ": sequence " << b << ", query " << i << " is not the bias";
    }
}

/// Self-attention of `layer` on x [3, T, D] with the keys padded by `pad`, a
/// three_sequence_padding() that pads key 0 of sequence 0: causal or not, and in each of `modes`,
/// y matches want(masking), the reference's [B*T, D], and the queries that see no key (all of
/// sequence 2; causal, query 0 of sequence 0 too) output `bias`.
template <class Layer, class Want>
void check_three_sequence_masks(const Layer& layer, const moh::Tensor3<typename Layer::Scalar>& x,
                                const moh::Mask& pad, Want want,
                                const moh::Vector<typename Layer::Scalar>& bias,
                                std::initializer_list<moh::ComputeMode> modes,
                                const std::string& what) {
  for (bool causal : {false, true}) {
    const Masking mk{causal, &pad};
    const Mat reference = want(mk);
    for (moh::ComputeMode mode : modes) {
      const moh::Tensor3<typename Layer::Scalar> y = run(layer, x, mk.options(mode));
      std::string where = what + " causal=" + std::to_string(causal);
      if (mode != moh::ComputeMode::Auto) where += std::string(" ") + mode_name(mode);
      EXPECT_LE(relative_error(y, reference), Tol<typename Layer::Scalar>::rel) << where;
      expect_rows_are_bias(
          y, bias, [&](Index b, Index i) { return b == 2 || (causal && b == 0 && i == 0); },
          where);
    }
  }
}

/// Decodes x [B, T, D] through a fresh cache of `storage`: the first `prompt` tokens in one
/// forward_cached call, then one token per call, with `opts` and a workspace of its own; returns
/// the outputs [B, T, D].
template <class Layer>
moh::Tensor3<float> decode_prompt_then_steps(const Layer& layer, const moh::Tensor3<float>& x,
                                             Index prompt, moh::ForwardOptions opts,
                                             moh::CacheStorage storage = moh::CacheStorage::Native) {
  const Index B = x.dimension(0), T = x.dimension(1), D = x.dimension(2);
  moh::Tensor3<float> y(B, T, D);
  moh::KvCache<float> cache = layer.make_cache(B, T, storage);
  moh::Workspace ws;
  opts.workspace = &ws;
  for (Index t = 0; t < T;) {
    const Index n = t == 0 ? prompt : 1;
    moh::Tensor3<float> xs =
        x.slice(Eigen::array<Index, 3>{0, t, 0}, Eigen::array<Index, 3>{B, n, D});
    moh::Tensor3<float> ys(B, n, D);
    layer.forward_cached(xs, ys, cache, opts);
    y.slice(Eigen::array<Index, 3>{0, t, 0}, Eigen::array<Index, 3>{B, n, D}) = ys;
    t += n;
  }
  return y;
}

/// f(pool) returns a tensor; with pools of 1, 2 and 3 threads it must give the bits it gives on
/// the calling thread alone (pool null), which are returned.
template <class F>
auto expect_same_bits_for_any_thread_count(F f, const std::string& what) {
  const auto base = f(nullptr);
  for (int threads : {1, 2, 3}) {
    moh::ThreadPool pool(threads);
    EXPECT_TRUE(BitEqual(f(&pool), base)) << what << ", " << threads << " threads";
  }
  return base;
}

}  // namespace moh_test
