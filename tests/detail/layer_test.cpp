// The layer skeleton every attention layer shares (moh/detail/layer.hpp), through the three
// layers. Incremental decoding through KvCache (docs/semantics.md §1 and §4): feeding a sequence
// to forward_cached() as a prompt and then token by token (or in chunks) must give what one
// causal forward() over the whole sequence gives, for MultiHeadAttention (GQA + RoPE),
// MoHAttention with the learned router and with the query-norm router (MoH-LLaMA3: RoPE, GQA, no
// bias) and MoAAttention; a default forward_cached() is causal. Also: batches of different
// lengths through padding, GQA = MHA with repeated key/value heads, the cache's errors, reset(),
// clone(), sparse = dense, thread-count independence, the options each entry point refuses, the
// size accessors, weights by name (and forward refusing to run until every one is set), and the
// caller's Workspace (the same bits as none, reused across calls and thread counts).
#include "moh/detail/layer.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "moh/layers/moa_attention.hpp"
#include "moh/layers/moh_attention.hpp"
#include "moh/layers/multi_head_attention.hpp"
#include "moh/runtime/kv_cache.hpp"
#include "moh/runtime/thread_pool.hpp"
#include "moh/runtime/workspace.hpp"
#include "test_helpers.hpp"

namespace {

using moh::Causal;
using moh::ComputeMode;
using moh::ForwardOptions;
using moh::Index;
using moh::Mask;
using moh::Matrix;
using moh::Tensor3;
using moh_test::BitEqual;
using moh_test::error_of;
using moh_test::Mentions;
using moh_test::random_tensor;
using moh_test::Tol;

// ---- layer configurations -------------------------------------------------------------------

// GQA (6 query heads on 2 key/value heads), RoPE, head_dim 6 != embed_dim / num_heads = 4.
moh::MHAConfig gqa_rope_mha() { return moh_test::mha_config(24, 6, 2, 6, true, true); }

// Learned two-stage router: 2 shared + top 3 of 6 routed heads, GQA 8 -> 4, RoPE, biases.
moh::MoHConfig learned_moh() {
  return moh_test::moh_config(20, 8, 2, 3, moh::MoHRouterKind::Learned, 4, 6, true, true);
}

// MoH-LLaMA3: query-norm router, RoPE, GQA 8 -> 2, no bias.
moh::MoHConfig llama_moh() {
  moh::MoHConfig c =
      moh_test::moh_config(24, 8, 2, 3, moh::MoHRouterKind::QueryNorm, 2, 8, false, true);
  c.rope_theta = 500000.0;
  return c;
}

moh::MoAConfig small_moa() { return moh_test::moa_config(16, 6, 5, 2); }

// ---- uniform calls over the three layers ------------------------------------------------------

/// The gates of a routing record ([B*T, heads or experts]), empty for MultiHeadAttention's.
template <class T>
Matrix<T> gates_of(const moh::NoRouting&) {
  return Matrix<T>();
}
template <class T>
Matrix<T> gates_of(const moh::MoHRouting<T>& r) {
  return r.gates;
}
template <class T>
Matrix<T> gates_of(const moh::MoARouting<T>& r) {
  return r.gates;
}

template <class T, class Layer>
void call_forward(const Layer& l, const Tensor3<T>& x, Tensor3<T>& y, const ForwardOptions& o,
                  Matrix<T>* gates) {
  typename Layer::RoutingRecord r;
  l.forward(x, y, o, &r);
  if (gates) *gates = gates_of<T>(r);
}
template <class T, class Layer>
void call_cached(const Layer& l, const Tensor3<T>& x, Tensor3<T>& y, moh::KvCache<T>& cache,
                 const ForwardOptions& o, Matrix<T>* gates) {
  typename Layer::RoutingRecord r;
  l.forward_cached(x, y, cache, o, &r);
  if (gates) *gates = gates_of<T>(r);
}

// ---- sequences, schedules and comparisons -----------------------------------------------------

template <class T>
Tensor3<T> tokens(const Tensor3<T>& x, Index first, Index count) {
  const Eigen::array<Index, 3> off{0, first, 0}, ext{x.dimension(0), count, x.dimension(2)};
  return x.slice(off, ext);
}
template <class T>
Tensor3<T> batch_item(const Tensor3<T>& x, Index b, Index count) {
  const Eigen::array<Index, 3> off{b, 0, 0}, ext{1, count, x.dimension(2)};
  return x.slice(off, ext);
}
Mask mask_tokens(const Mask& m, Index first, Index count) {
  const Eigen::array<Index, 2> off{0, first}, ext{m.dimension(0), count};
  return m.slice(off, ext);
}

/// Chunk sizes: a prompt of `prompt` tokens (a call even when 0), then one token per call.
std::vector<Index> prompt_then_tokens(Index prompt, Index total) {
  std::vector<Index> s = {prompt};
  for (Index t = prompt; t < total; ++t) s.push_back(1);
  return s;
}
std::vector<Index> chunks_of(Index chunk, Index total) {
  std::vector<Index> s;
  for (Index t = 0; t < total; t += chunk) s.push_back(std::min(chunk, total - t));
  return s;
}

template <class T>
struct Outcome {
  Tensor3<T> y;
  Matrix<T> gates;  // [B*T, heads or experts] in the full call's row order (empty for MHA)
};

/// One causal forward over the whole x.
template <class T, class Layer>
Outcome<T> full_forward(const Layer& layer, const Tensor3<T>& x, const Mask* padding = nullptr,
                    ForwardOptions o = {}) {
  o.causal = Causal::On;
  if (padding) o.key_padding_mask = moh::map_mask(*padding);
  Outcome<T> r;
  r.y = Tensor3<T>(x.dimension(0), x.dimension(1), x.dimension(2));
  call_forward(layer, x, r.y, o, &r.gates);
  return r;
}

/// x fed through forward_cached in calls of `schedule` tokens each, outputs stitched: causal by
/// default (Causal::Auto), with the padding of each call's new tokens.
template <class T, class Layer>
Outcome<T> decode(const Layer& layer, const Tensor3<T>& x, const std::vector<Index>& schedule,
              const Mask* padding = nullptr, ForwardOptions o = {},
              moh::KvCache<T>* use_cache = nullptr) {
  const Index B = x.dimension(0), Tn = x.dimension(1), D = x.dimension(2);
  moh::KvCache<T> own = layer.make_cache(B, std::max<Index>(Tn, 1));
  moh::KvCache<T>& cache = use_cache ? *use_cache : own;
  const Index start = cache.length();
  Outcome<T> r;
  r.y = Tensor3<T>(B, Tn, D);
  Index t0 = 0;
  for (Index n : schedule) {
    const Tensor3<T> xs = tokens(x, t0, n);
    Tensor3<T> ys(B, n, D);
    Mask ps;
    ForwardOptions oc = o;
    if (padding) {
      ps = mask_tokens(*padding, t0, n);
      oc.new_token_padding_mask = moh::map_mask(ps);
    }
    Matrix<T> g;
    call_cached(layer, xs, ys, cache, oc, &g);
    EXPECT_EQ(cache.length(), start + t0 + n);
    if (g.size() && r.gates.size() == 0) r.gates = Matrix<T>::Constant(B * Tn, g.cols(), T(-1));
    for (Index b = 0; b < B; ++b)
      for (Index t = 0; t < n; ++t) {
        for (Index j = 0; j < D; ++j) r.y(b, t0 + t, j) = ys(b, t, j);
        if (g.size()) r.gates.row(b * Tn + t0 + t) = g.row(b * n + t);
      }
    t0 += n;
  }
  EXPECT_EQ(t0, Tn) << "schedule does not cover the sequence";
  return r;
}

/// max |a - b| / max(1, max |b|) over two [B, T, D] tensors of the same shape.
template <class T>
double rel_error(const Tensor3<T>& a, const Tensor3<T>& b) {
  EXPECT_EQ(a.dimension(0), b.dimension(0));
  EXPECT_EQ(a.dimension(1), b.dimension(1));
  EXPECT_EQ(a.dimension(2), b.dimension(2));
  if (a.size() != b.size()) return INFINITY;
  const Eigen::MatrixXd rb = moh_test::rows_of(b);
  return moh_test::max_abs_diff(moh_test::rows_of(a), rb) / moh_test::scale_of(rb);
}

/// Same heads/experts on (gate != 0) in every row, and gates equal to `tol` (relative).
template <class T>
void expect_same_routing(const Matrix<T>& got, const Matrix<T>& want, double tol,
                         const std::string& what) {
  ASSERT_EQ(got.rows(), want.rows()) << what;
  ASSERT_EQ(got.cols(), want.cols()) << what;
  for (Index i = 0; i < want.rows(); ++i)
    for (Index h = 0; h < want.cols(); ++h) {
      ASSERT_EQ(got(i, h) != T(0), want(i, h) != T(0)) << what << ": row " << i << " head " << h;
      ASSERT_NEAR(static_cast<double>(got(i, h)), static_cast<double>(want(i, h)),
                  tol * std::max(1.0, std::abs(static_cast<double>(want(i, h)))))
          << what << ": row " << i << " head " << h;
    }
}

/// The central check: prompt + token-by-token decoding equals the full causal forward.
template <class Layer>
void check_decode_equals_full(const Layer& layer, Index B, Index Tn, std::uint64_t seed,
                              const std::vector<Index>& prompts) {
  using T = typename Layer::Scalar;
  const Tensor3<T> x = random_tensor<T>(B, Tn, layer.embed_dim(), seed);
  const Outcome<T> full = full_forward<T>(layer, x);
  for (Index P : prompts) {
    const Outcome<T> dec = decode<T>(layer, x, prompt_then_tokens(P, Tn));
    EXPECT_LE(rel_error(dec.y, full.y), Tol<T>::exact) << "prompt " << P << " of " << Tn;
    if (full.gates.size())
      expect_same_routing(dec.gates, full.gates, Tol<T>::exact * 10,
                          "prompt " + std::to_string(P));
  }
  for (Index chunk : {Index(3), Index(2), Index(5)}) {
    const Outcome<T> dec = decode<T>(layer, x, chunks_of(chunk, Tn));
    EXPECT_LE(rel_error(dec.y, full.y), Tol<T>::exact) << "chunks of " << chunk;
    if (full.gates.size())
      expect_same_routing(dec.gates, full.gates, Tol<T>::exact * 10,
                          "chunks of " + std::to_string(chunk));
  }
}

// ---- decoding equals the full forward --------------------------------------------------------

TEST(Decode, MhaGqaRopeFloat) {
  check_decode_equals_full(moh::MultiHeadAttention<float>(gqa_rope_mha(), 1), 2, 9, 10,
                           {0, 1, 4, 8, 9});
}

TEST(Decode, MhaGqaRopeDouble) {
  check_decode_equals_full(moh::MultiHeadAttention<double>(gqa_rope_mha(), 1), 2, 9, 10,
                           {0, 1, 4, 9});
}

TEST(Decode, MhaLongSequenceCrossesKernelBlocks) {
  // 300 tokens: the prompt spans two 256-key blocks and several 64-query blocks, then 40 tokens
  // are decoded one by one against a cache longer than one key block.
  const moh::MultiHeadAttention<float> layer(gqa_rope_mha(), 2);
  const Tensor3<float> x = random_tensor<float>(1, 300, 24, 20);
  const Outcome<float> full = full_forward<float>(layer, x);
  const Outcome<float> dec = decode<float>(layer, x, prompt_then_tokens(260, 300));
  EXPECT_LE(rel_error(dec.y, full.y), 1e-5);
  const Outcome<float> chunked = decode<float>(layer, x, chunks_of(70, 300));
  EXPECT_LE(rel_error(chunked.y, full.y), 1e-5);
}

TEST(Decode, MoHLearnedRouterFloat) {
  check_decode_equals_full(moh::MoHAttention<float>(learned_moh(), 3), 2, 10, 30, {0, 1, 3, 10});
}

TEST(Decode, MoHLearnedRouterDouble) {
  check_decode_equals_full(moh::MoHAttention<double>(learned_moh(), 3), 3, 7, 31, {0, 1, 5});
}

TEST(Decode, MoHQueryNormRouterFloat) {
  check_decode_equals_full(moh::MoHAttention<float>(llama_moh(), 4), 2, 10, 40, {0, 1, 6, 10});
}

TEST(Decode, MoHQueryNormRouterDouble) {
  check_decode_equals_full(moh::MoHAttention<double>(llama_moh(), 4), 2, 8, 41, {0, 1, 2, 8});
}

TEST(Decode, MoAFloat) {
  check_decode_equals_full(moh::MoAAttention<float>(small_moa(), 5), 2, 9, 50, {0, 1, 4, 9});
}

TEST(Decode, MoADouble) {
  check_decode_equals_full(moh::MoAAttention<double>(small_moa(), 5), 2, 9, 51, {0, 1, 7});
}

TEST(Decode, ZeroTokenCallIsANoOp) {
  // A call with no new tokens appends nothing and writes nothing.
  const moh::MultiHeadAttention<float> layer(gqa_rope_mha(), 6);
  moh::KvCache<float> cache = layer.make_cache(2, 4);
  const Tensor3<float> x = random_tensor<float>(2, 3, 24, 60);
  Tensor3<float> y(2, 3, 24), empty_y(2, 0, 24);
  const Tensor3<float> empty_x(2, 0, 24);
  ForwardOptions o;
  o.causal = Causal::On;
  layer.forward_cached(empty_x, empty_y, cache, o);
  EXPECT_EQ(cache.length(), 0);
  layer.forward_cached(x, y, cache, o);
  layer.forward_cached(empty_x, empty_y, cache, o);
  EXPECT_EQ(cache.length(), 3);
  const moh::MoHAttention<float> moh_layer(llama_moh(), 6);
  moh::KvCache<float> moh_cache = moh_layer.make_cache(2, 4);
  moh_layer.forward_cached(empty_x, empty_y, moh_cache, o);
  EXPECT_EQ(moh_cache.length(), 0);
}

// ---- batches of different lengths -------------------------------------------------------------

/// Right padding: sequence b is lengths[b] tokens long, followed by padding up to T.
Mask right_padding(const std::vector<Index>& lengths, Index Tn) {
  Mask m(static_cast<Index>(lengths.size()), Tn);
  for (Index b = 0; b < m.dimension(0); ++b)
    for (Index t = 0; t < Tn; ++t) m(b, t) = t >= lengths[b];
  return m;
}

template <class Layer>
void check_padded_batch(const Layer& layer, std::uint64_t seed) {
  using T = typename Layer::Scalar;
  const std::vector<Index> lengths = {7, 4, 1, 6};
  const Index B = 4, Tn = 7, D = layer.embed_dim();
  const Tensor3<T> x = random_tensor<T>(B, Tn, D, seed);
  const Mask pad = right_padding(lengths, Tn);
  const Outcome<T> batched = full_forward<T>(layer, x, &pad);
  // Every real token of sequence b equals running sequence b alone at batch 1.
  for (Index b = 0; b < B; ++b) {
    const Tensor3<T> xb = batch_item(x, b, lengths[b]);
    const Outcome<T> alone = full_forward<T>(layer, xb);
    const Tensor3<T> yb = batch_item(batched.y, b, lengths[b]);
    EXPECT_LE(rel_error(yb, alone.y), Tol<T>::exact) << "sequence " << b;
    if (alone.gates.size()) {
      const Matrix<T> rows = batched.gates.middleRows(b * Tn, lengths[b]);
      expect_same_routing(rows, alone.gates, Tol<T>::exact * 10, "sequence " + std::to_string(b));
    }
  }
  // Decoding the padded batch (prompt 3, then tokens; or chunks of 3) equals the padded full
  // forward on every row, padded ones included (they see the same keys either way).
  for (const std::vector<Index>& schedule : {prompt_then_tokens(3, Tn), chunks_of(3, Tn)}) {
    const Outcome<T> dec = decode<T>(layer, x, schedule, &pad);
    EXPECT_LE(rel_error(dec.y, batched.y), Tol<T>::exact);
  }
}

/// check_padded_batch on Layer<float>(float_config) with x seeded `seed` and on
/// Layer<double>(double_config) with seed + 1, both layers seeded `layer_seed`.
template <template <class> class Layer>
void check_padded_batch_float_and_double(const typename Layer<float>::Config& float_config,
                                         const typename Layer<double>::Config& double_config,
                                         std::uint64_t layer_seed, std::uint64_t seed) {
  check_padded_batch(Layer<float>(float_config, layer_seed), seed);
  check_padded_batch(Layer<double>(double_config, layer_seed), seed + 1);
}

TEST(Decode, PaddedBatchMatchesSequencesAloneMha) {
  check_padded_batch_float_and_double<moh::MultiHeadAttention>(gqa_rope_mha(), gqa_rope_mha(), 7,
                                                               70);
}

TEST(Decode, PaddedBatchMatchesSequencesAloneMoH) {
  check_padded_batch_float_and_double<moh::MoHAttention>(llama_moh(), learned_moh(), 8, 80);
}

TEST(Decode, PaddedBatchMatchesSequencesAloneMoA) {
  check_padded_batch_float_and_double<moh::MoAAttention>(small_moa(), small_moa(), 9, 90);
}

TEST(Decode, LeftPaddingWithRopeMatchesAloneAndHiddenRowsAreBias) {
  // Left padding shifts the real tokens' RoPE positions by the pad count; RoPE scores depend on
  // relative positions only, so the real tokens still match the sequence alone. A padded query
  // before the first real token sees no key at all: its attention output is zeros, so y is
  // exactly the output bias.
  const moh::MultiHeadAttention<double> layer(gqa_rope_mha(), 10);
  const Index Tn = 6, pads = 2, D = 24;
  const Tensor3<double> x = random_tensor<double>(1, Tn, D, 100);
  Mask pad(1, Tn);
  for (Index t = 0; t < Tn; ++t) pad(0, t) = t < pads;
  const Outcome<double> padded = full_forward<double>(layer, x, &pad);
  const Tensor3<double> real = tokens(x, pads, Tn - pads);
  const Outcome<double> alone = full_forward<double>(layer, real);
  EXPECT_LE(rel_error(tokens(padded.y, pads, Tn - pads), alone.y), 1e-12);
  for (Index t = 0; t < pads; ++t)
    for (Index j = 0; j < D; ++j) EXPECT_EQ(padded.y(0, t, j), layer.out_proj_bias()[j]) << t;
  const Outcome<double> dec = decode<double>(layer, x, prompt_then_tokens(1, Tn), &pad);
  EXPECT_LE(rel_error(dec.y, padded.y), 1e-12);
}

// ---- GQA = MHA with repeated key/value heads ----------------------------------------------------

/// Rows of a [(H + 2 Hkv) d, *] projection expanded to H key/value heads: query head h uses
/// kv head h / (H / Hkv).
template <class M>
M expand_kv_rows(const M& w, Index H, Index Hkv, Index d) {
  const Index group = H / Hkv;
  M out(3 * H * d, w.cols());
  out.topRows(H * d) = w.topRows(H * d);
  for (Index h = 0; h < H; ++h) {
    const Index g = h / group;
    out.middleRows(H * d + h * d, d) = w.middleRows(H * d + g * d, d);            // keys
    out.middleRows(2 * H * d + h * d, d) = w.middleRows(H * d + Hkv * d + g * d, d);  // values
  }
  return out;
}

/// The MultiHeadAttention that repeats each key/value head of `gqa` for the query heads that share
/// it (num_kv_heads = num_heads): the same function with plain multi-head attention.
moh::MultiHeadAttention<double> with_repeated_kv_heads(const moh::MultiHeadAttention<double>& gqa) {
  moh::MHAConfig c = gqa.config();
  c.num_kv_heads = c.num_heads;
  moh::MultiHeadAttention<double> mha(c);
  const Index H = gqa.num_heads(), Hkv = gqa.num_kv_heads(), d = gqa.head_dim();
  mha.set_in_proj_weight(expand_kv_rows(gqa.in_proj_weight(), H, Hkv, d));
  mha.set_in_proj_bias(expand_kv_rows(Matrix<double>(gqa.in_proj_bias()), H, Hkv, d));
  mha.set_out_proj_weight(gqa.out_proj_weight());
  mha.set_out_proj_bias(gqa.out_proj_bias());
  return mha;
}

TEST(Decode, GqaEqualsMhaWithRepeatedKvHeads) {
  const moh::MHAConfig c = gqa_rope_mha();  // H = 6, Hkv = 2, d = 6
  const moh::MultiHeadAttention<double> gqa(c, 11);
  const moh::MultiHeadAttention<double> mha = with_repeated_kv_heads(gqa);
  const Tensor3<double> x = random_tensor<double>(2, 8, 24, 110);
  const Outcome<double> a = full_forward<double>(gqa, x), b = full_forward<double>(mha, x);
  EXPECT_LE(rel_error(a.y, b.y), 1e-12);
  const Outcome<double> da = decode<double>(gqa, x, prompt_then_tokens(3, 8));
  const Outcome<double> db = decode<double>(mha, x, prompt_then_tokens(3, 8));
  EXPECT_LE(rel_error(da.y, b.y), 1e-12);
  EXPECT_LE(rel_error(db.y, b.y), 1e-12);
  // Multi-query attention (Hkv = 1) too, without cache.
  moh::MHAConfig mqa_c = c;
  mqa_c.num_kv_heads = 1;
  const moh::MultiHeadAttention<double> mqa(mqa_c, 12);
  EXPECT_LE(rel_error(full_forward<double>(mqa, x).y,
                      full_forward<double>(with_repeated_kv_heads(mqa), x).y),
            1e-12);
}

TEST(Decode, MoHQueryNormGqaEqualsRepeatedKvHeads) {
  const moh::MoHConfig c = llama_moh();  // H = 8, Hkv = 2, d = 8
  const moh::MoHAttention<float> gqa(c, 13);
  moh::MoHConfig full_c = c;
  full_c.num_kv_heads = c.num_heads;
  moh::MoHAttention<float> moh_full(full_c);
  moh_full.set_qkv_weight(expand_kv_rows(gqa.qkv_weight(), 8, 2, 8));
  moh_full.set_proj_weight(gqa.proj_weight());
  const Tensor3<float> x = random_tensor<float>(2, 9, 24, 130);
  const Outcome<float> want = full_forward<float>(moh_full, x);
  const Outcome<float> got = full_forward<float>(gqa, x);
  EXPECT_LE(rel_error(got.y, want.y), 1e-5);
  expect_same_routing(got.gates, want.gates, 0.0, "full");
  const Outcome<float> dec = decode<float>(gqa, x, prompt_then_tokens(4, 9));
  EXPECT_LE(rel_error(dec.y, want.y), 1e-5);
}

// ---- the cache itself -------------------------------------------------------------------------

/// Three tokens (x seeded with `seed`) into a cache of capacity 2: refused, naming the capacity.
/// Returns the cache's length after the call.
template <class Layer>
Index overfill_cache(const Layer& layer, std::uint64_t seed, const ForwardOptions& o) {
  using T = typename Layer::Scalar;
  moh::KvCache<T> cache = layer.make_cache(1, 2);
  const Tensor3<T> x = random_tensor<T>(1, 3, layer.embed_dim(), seed);
  Tensor3<T> y(1, 3, layer.embed_dim());
  const std::string msg = error_of([&] { layer.forward_cached(x, y, cache, o); });
  EXPECT_NE(msg.find("capacity 2"), std::string::npos) << msg;
  return cache.length();
}

TEST(Decode, FullCacheThrowsNamingCapacityAndKeepsState) {
  const moh::MultiHeadAttention<float> layer(gqa_rope_mha(), 14);
  const Tensor3<float> x = random_tensor<float>(1, 6, 24, 140);
  moh::KvCache<float> cache = layer.make_cache(1, 5);
  EXPECT_EQ(cache.capacity(), 5);
  ForwardOptions o;
  o.causal = Causal::On;
  Tensor3<float> y4(1, 4, 24), y2(1, 2, 24), y1(1, 1, 24);
  layer.forward_cached(tokens(x, 0, 4), y4, cache, o);
  const std::string msg = error_of([&] { layer.forward_cached(tokens(x, 4, 2), y2, cache, o); });
  ASSERT_FALSE(msg.empty()) << "expected moh::Error for 2 tokens into 1 free slot";
  EXPECT_NE(msg.find("capacity 5"), std::string::npos) << msg;
  EXPECT_NE(msg.find("got 2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("MultiHeadAttention"), std::string::npos) << msg;
  // The failed call changed nothing: the last free slot still takes token 4 correctly.
  EXPECT_EQ(cache.length(), 4);
  layer.forward_cached(tokens(x, 4, 1), y1, cache, o);
  const Outcome<float> full = full_forward<float>(layer, tokens(x, 0, 5));
  EXPECT_LE(rel_error(y1, tokens(full.y, 4, 1)), 1e-5);
  EXPECT_THROW(layer.forward_cached(tokens(x, 5, 1), y1, cache, o), moh::Error);
  // MoH and MoA refuse too.
  overfill_cache(moh::MoAAttention<float>(small_moa(), 14), 141, o);
  EXPECT_EQ(overfill_cache(moh::MoHAttention<float>(llama_moh(), 14), 142, o), 0);
}

TEST(Decode, MismatchedCacheThrows) {
  const moh::MultiHeadAttention<float> layer(gqa_rope_mha(), 15);  // Hkv = 2, d = 6
  const Tensor3<float> x = random_tensor<float>(2, 1, 24, 150);
  Tensor3<float> y(2, 1, 24);
  ForwardOptions o;
  o.causal = Causal::On;
  moh::KvCache<float> wrong_batch(3, 2, 6, 8);
  std::string msg = error_of([&] { layer.forward_cached(x, y, wrong_batch, o); });
  EXPECT_NE(msg.find("batch"), std::string::npos) << msg;
  EXPECT_NE(msg.find('3'), std::string::npos) << msg;
  EXPECT_NE(msg.find('2'), std::string::npos) << msg;
  moh::KvCache<float> wrong_dim(2, 2, 8, 8);
  msg = error_of([&] { layer.forward_cached(x, y, wrong_dim, o); });
  EXPECT_NE(msg.find("head_dim"), std::string::npos) << msg;
  EXPECT_NE(msg.find('8'), std::string::npos) << msg;
  moh::KvCache<float> wrong_heads(2, 6, 6, 8);  // an MHA-sized cache for a GQA layer
  msg = error_of([&] { layer.forward_cached(x, y, wrong_heads, o); });
  EXPECT_NE(msg.find("kv_heads"), std::string::npos) << msg;
  moh::KvCache<float> empty;
  EXPECT_THROW(layer.forward_cached(x, y, empty, o), moh::Error);
  for (moh::KvCache<float>* c : {&wrong_batch, &wrong_dim, &wrong_heads}) EXPECT_EQ(c->length(), 0);
  // Padding of the wrong shape ([B, T_new] expected).
  moh::KvCache<float> cache = layer.make_cache(2, 8);
  Mask bad(2, 3);
  bad.setConstant(false);
  o.new_token_padding_mask = moh::map_mask(bad);
  msg = error_of([&] { layer.forward_cached(x, y, cache, o); });
  EXPECT_TRUE(Mentions(msg, {"new_token_padding_mask", "[2, 1]", "[2, 3]"})) << msg;
  EXPECT_EQ(cache.length(), 0);
  // MoA caches have one kv head of size head_dim; a wider one is refused.
  const moh::MoAAttention<float> moa(small_moa(), 15);
  moh::KvCache<float> moa_wrong(2, 1, 7, 8);
  const Tensor3<float> xm = random_tensor<float>(2, 1, 16, 151);
  Tensor3<float> ym(2, 1, 16);
  ForwardOptions om;
  EXPECT_THROW(moa.forward_cached(xm, ym, moa_wrong, om), moh::Error);
  // Sizes must be positive.
  EXPECT_THROW(moh::KvCache<float>(0, 1, 4, 4), moh::Error);
  EXPECT_THROW(moh::KvCache<float>(1, 1, 4, 0), moh::Error);
}

TEST(Decode, ResetThenReuseGivesTheSameResult) {
  const moh::MoHAttention<float> layer(llama_moh(), 16);
  const Tensor3<float> x = random_tensor<float>(2, 7, 24, 160);
  moh::KvCache<float> cache = layer.make_cache(2, 7);
  const Outcome<float> first =
      decode<float>(layer, x, prompt_then_tokens(2, 7), nullptr, {}, &cache);
  EXPECT_EQ(cache.length(), 7);
  cache.reset();
  EXPECT_EQ(cache.length(), 0);
  EXPECT_EQ(cache.capacity(), 7);
  const Outcome<float> second =
      decode<float>(layer, x, prompt_then_tokens(2, 7), nullptr, {}, &cache);
  EXPECT_TRUE(BitEqual(first.y, second.y));
  EXPECT_EQ(first.gates, second.gates);
  // A cache reset after a padded batch forgets the padding.
  const Mask pad = right_padding({3, 7}, 7);
  cache.reset();
  decode<float>(layer, x, chunks_of(3, 7), &pad, {}, &cache);
  for (Index t = 0; t < 7; ++t) {
    EXPECT_EQ(cache.is_padding(0, t), t >= 3) << t;
    EXPECT_FALSE(cache.is_padding(1, t)) << t;
  }
  cache.reset();
  EXPECT_EQ(cache.length(), 0);
  const Outcome<float> third =
      decode<float>(layer, x, prompt_then_tokens(2, 7), nullptr, {}, &cache);
  EXPECT_TRUE(BitEqual(first.y, third.y));
  for (Index t = 0; t < 7; ++t) EXPECT_FALSE(cache.is_padding(0, t)) << t;
}

/// Speculative decoding: tokens appended and then rejected with truncate() leave no trace; the
/// next call continues from the truncated length (RoPE positions included) as if the rejected
/// tokens had never been fed.
template <class Layer>
void check_truncate_forgets_rejected_tokens(const Layer& layer, std::uint64_t seed) {
  using T = typename Layer::Scalar;
  const Index B = 2, D = layer.embed_dim(), Tn = 9, keep = 4;
  const Tensor3<T> x = random_tensor<T>(B, Tn, D, seed);
  Tensor3<T> spliced = random_tensor<T>(B, Tn, D, seed + 1);  // x's first `keep`, then others
  for (Index b = 0; b < B; ++b)
    for (Index t = 0; t < keep; ++t)
      for (Index j = 0; j < D; ++j) spliced(b, t, j) = x(b, t, j);
  moh::KvCache<T> cache = layer.make_cache(B, Tn);
  decode<T>(layer, tokens(x, 0, 7), {3, 1, 3}, nullptr, {}, &cache);  // 3 rejected after `keep`
  cache.truncate(keep);
  EXPECT_EQ(cache.length(), keep);
  const Outcome<T> rest =
      decode<T>(layer, tokens(spliced, keep, Tn - keep), {2, 1, 2}, nullptr, {}, &cache);
  EXPECT_EQ(cache.length(), Tn);
  const Outcome<T> full = full_forward<T>(layer, spliced);
  EXPECT_LE(rel_error(rest.y, tokens(full.y, keep, Tn - keep)), Tol<T>::exact) << Layer::kName;
  if (full.gates.size()) {
    Matrix<T> want(B * (Tn - keep), full.gates.cols());
    for (Index b = 0; b < B; ++b)
      want.middleRows(b * (Tn - keep), Tn - keep) = full.gates.middleRows(b * Tn + keep, Tn - keep);
    expect_same_routing(rest.gates, want, Tol<T>::exact * 10, Layer::kName);
  }
}

TEST(Decode, TruncateForgetsRejectedTokens) {
  check_truncate_forgets_rejected_tokens(moh::MultiHeadAttention<double>(gqa_rope_mha(), 25), 250);
  check_truncate_forgets_rejected_tokens(moh::MoHAttention<float>(llama_moh(), 26), 260);
  check_truncate_forgets_rejected_tokens(moh::MoHAttention<double>(learned_moh(), 27), 270);
  check_truncate_forgets_rejected_tokens(moh::MoAAttention<float>(small_moa(), 28), 280);
}

TEST(Decode, CloneIsIndependent) {
  const moh::MultiHeadAttention<double> layer(gqa_rope_mha(), 17);
  const Index Tn = 8, split = 5;
  const Tensor3<double> x = random_tensor<double>(1, Tn, 24, 170);
  // x2 shares the first `split` tokens with x and continues differently.
  Tensor3<double> x2 = random_tensor<double>(1, Tn, 24, 171);
  for (Index t = 0; t < split; ++t)
    for (Index j = 0; j < 24; ++j) x2(0, t, j) = x(0, t, j);
  moh::KvCache<double> a = layer.make_cache(1, Tn);
  decode<double>(layer, tokens(x, 0, split), prompt_then_tokens(2, split), nullptr, {}, &a);
  moh::KvCache<double> b = a.clone();
  EXPECT_EQ(b.length(), split);
  const Outcome<double> ya = decode<double>(layer, tokens(x, split, Tn - split),
                                            chunks_of(1, Tn - split), nullptr, {}, &a);
  EXPECT_EQ(b.length(), split);  // a's appends did not reach b
  const Outcome<double> yb = decode<double>(layer, tokens(x2, split, Tn - split),
                                            chunks_of(2, Tn - split), nullptr, {}, &b);
  EXPECT_EQ(a.length(), Tn);
  EXPECT_LE(rel_error(ya.y, tokens(full_forward<double>(layer, x).y, split, Tn - split)), 1e-12);
  EXPECT_LE(rel_error(yb.y, tokens(full_forward<double>(layer, x2).y, split, Tn - split)), 1e-12);
  // The two caches now hold different keys for the slots after the split.
  EXPECT_NE(a.keys(0, 0)[split * 6], b.keys(0, 0)[split * 6]);
  EXPECT_EQ(a.keys(0, 1)[0], b.keys(0, 1)[0]);
}

// ---- sparse = dense, threads ------------------------------------------------------------------

template <class T, class Layer>
void check_sparse_equals_dense(const Layer& layer, std::uint64_t seed) {
  const Index D = layer.embed_dim();
  const Tensor3<T> x = random_tensor<T>(2, 9, D, seed);
  const Mask pad = right_padding({9, 6}, 9);
  ForwardOptions sparse, dense;
  sparse.mode = moh::ComputeMode::Sparse;
  dense.mode = moh::ComputeMode::Dense;
  for (const std::vector<Index>& schedule : {prompt_then_tokens(4, 9), chunks_of(3, 9)}) {
    const Outcome<T> s = decode<T>(layer, x, schedule, &pad, sparse);
    const Outcome<T> d = decode<T>(layer, x, schedule, &pad, dense);
    EXPECT_LE(rel_error(s.y, d.y), Tol<T>::exact);
    EXPECT_EQ(s.gates, d.gates);  // the same router call either way
  }
}

TEST(Decode, SparseEqualsDenseInCachedDecodingMoH) {
  check_sparse_equals_dense<float>(moh::MoHAttention<float>(learned_moh(), 18), 180);
  check_sparse_equals_dense<float>(moh::MoHAttention<float>(llama_moh(), 18), 181);
  check_sparse_equals_dense<double>(moh::MoHAttention<double>(llama_moh(), 18), 182);
}

TEST(Decode, SparseEqualsDenseInCachedDecodingMoA) {
  check_sparse_equals_dense<float>(moh::MoAAttention<float>(small_moa(), 19), 190);
  check_sparse_equals_dense<double>(moh::MoAAttention<double>(small_moa(), 19), 191);
}

TEST(Decode, ThreadCountDoesNotChangeCachedResults) {
  moh::ThreadPool p2(2), p3(3);
  auto check = [&](const auto& layer, Index D, std::uint64_t seed, const char* name) {
    const Tensor3<float> x = random_tensor<float>(3, 70, D, seed);
    ForwardOptions o;
    const Outcome<float> serial = decode<float>(layer, x, chunks_of(66, 70), nullptr, o);
    for (moh::ThreadPool* pool : {&p2, &p3}) {
      o.pool = pool;
      const Outcome<float> par = decode<float>(layer, x, chunks_of(66, 70), nullptr, o);
      EXPECT_TRUE(BitEqual(serial.y, par.y)) << name << " threads " << pool->size();
      EXPECT_EQ(serial.gates, par.gates) << name;
    }
  };
  check(moh::MultiHeadAttention<float>(gqa_rope_mha(), 20), 24, 200, "mha");
  check(moh::MoHAttention<float>(learned_moh(), 20), 20, 201, "moh learned");
  check(moh::MoHAttention<float>(llama_moh(), 20), 24, 202, "moh llama");
  check(moh::MoAAttention<float>(small_moa(), 20), 16, 203, "moa");
}

// ---- a default forward_cached() is causal ------------------------------------------------------

/// With default options, a prompt fed to forward_cached() in one call equals the same prompt fed
/// token by token and a causal forward(), while a default forward() is not causal.
template <class Layer>
void check_default_cached_call_is_causal(const Layer& layer, std::uint64_t seed) {
  using T = typename Layer::Scalar;
  const Index B = 2, D = layer.embed_dim();
  for (Index Tn : {Index(1), Index(3), Index(17)}) {
    const std::string where = std::string(Layer::kName) + " T=" + std::to_string(Tn);
    const Tensor3<T> x = random_tensor<T>(B, Tn, D, seed + Tn);
    moh::KvCache<T> cache = layer.make_cache(B, Tn);
    Tensor3<T> one_call(B, Tn, D);
    layer.forward_cached(x, one_call, cache);
    EXPECT_EQ(cache.length(), Tn) << where;
    const Outcome<T> by_token = decode<T>(layer, x, chunks_of(1, Tn));  // default options
    EXPECT_LE(rel_error(by_token.y, one_call), Tol<T>::exact) << where;
    EXPECT_LE(rel_error(one_call, full_forward<T>(layer, x).y), Tol<T>::exact) << where;
    if (Tn > 1) {
      EXPECT_GT(rel_error(layer(x), one_call), 1e-3) << where << ": forward() must not be causal";
    }
  }
}

template <class T>
void check_default_cached_call_is_causal_for_all_layers() {
  // Default configs with sizes only: head sizes 5, 3 and 5.
  moh::MHAConfig mc;
  mc.embed_dim = 15;
  mc.num_heads = 3;
  moh::MoHConfig hc;
  hc.embed_dim = 15;
  hc.num_heads = 5;
  hc.shared_heads = 1;
  hc.active_routed_heads = 2;
  moh::MoAConfig ac;
  ac.embed_dim = 9;
  ac.head_dim = 5;
  ac.num_experts = 4;
  ac.top_k = 2;
  check_default_cached_call_is_causal(moh::MultiHeadAttention<T>(mc, 21), 210);
  check_default_cached_call_is_causal(moh::MoHAttention<T>(hc, 22), 220);
  check_default_cached_call_is_causal(moh::MoAAttention<T>(ac, 23), 230);
}

TEST(LayerCausal, DefaultCachedCallIsCausalFloat) {
  check_default_cached_call_is_causal_for_all_layers<float>();
}
TEST(LayerCausal, DefaultCachedCallIsCausalDouble) {
  check_default_cached_call_is_causal_for_all_layers<double>();
}

// Causal::Off in forward_cached: every new token sees every cached and new key.
TEST(LayerCausal, CachedCallWithCausalOffSeesEveryKey) {
  const moh::MultiHeadAttention<double> layer(moh_test::mha_config(15, 3), 24);
  const Tensor3<double> x = random_tensor<double>(2, 17, 15, 240);
  moh::KvCache<double> cache = layer.make_cache(2, 17);
  ForwardOptions off;
  off.causal = Causal::Off;
  Tensor3<double> y(2, 17, 15);
  layer.forward_cached(x, y, cache, off);
  EXPECT_LE(rel_error(y, layer(x)), Tol<double>::exact);
}

// ---- options each entry point refuses ----------------------------------------------------------

/// Each entry point refuses the options that are not its own, naming the field (and the one to
/// use instead); a refused cached call appends nothing.
template <class Layer>
void check_refused_options(const Layer& layer, std::uint64_t seed) {
  using T = typename Layer::Scalar;
  const std::string name = Layer::kName;
  const bool rope = layer.config().rope;
  const std::string where = name + (rope ? " with RoPE" : "");
  const Index B = 2, Tn = 3, D = layer.embed_dim();
  const Tensor3<T> x = random_tensor<T>(B, Tn, D, seed);
  const Tensor3<T> mem = random_tensor<T>(B, 5, layer.memory_dim(), seed + 1);
  Tensor3<T> y(B, Tn, D);
  moh::KvCache<T> cache = layer.make_cache(B, 8);
  const Mask keys = moh_test::no_padding(B, Tn), new_tokens = moh_test::no_padding(B, Tn);
  const Mask memory_keys = moh_test::no_padding(B, 5);
  std::string msg;

  // key_padding_mask is for forward / forward_cross; forward_cached takes new_token_padding_mask.
  ForwardOptions k;
  k.key_padding_mask = moh::map_mask(keys);
  msg = error_of([&] { layer.forward_cached(x, y, cache, k); });
  EXPECT_TRUE(Mentions(msg, {name, "key_padding_mask", "new_token_padding_mask", "forward_cached"}))
      << where;
  EXPECT_NO_THROW(layer.forward(x, y, k)) << where;
  ForwardOptions km;
  km.key_padding_mask = moh::map_mask(memory_keys);
  EXPECT_NO_THROW(layer.forward_cross(x, mem, y, km)) << where;

  // new_token_padding_mask is for forward_cached only.
  ForwardOptions n;
  n.new_token_padding_mask = moh::map_mask(new_tokens);
  msg = error_of([&] { layer.forward(x, y, n); });
  EXPECT_TRUE(Mentions(msg, {name, "new_token_padding_mask", "forward_cached", "key_padding_mask"}))
      << where;
  msg = error_of([&] { layer.forward_cross(x, mem, y, n); });
  EXPECT_TRUE(Mentions(msg, {name, "new_token_padding_mask", "forward_cached", "key_padding_mask"}))
      << where;

  // position_offset: never with a cache (it continues from the cache's length), and only with RoPE.
  ForwardOptions p;
  p.position_offset = 3;
  msg = error_of([&] { layer.forward_cached(x, y, cache, p); });
  EXPECT_TRUE(Mentions(msg, {name, "position_offset", "cache", "expected 0, got 3"})) << where;
  if (rope) {
    EXPECT_NO_THROW(layer.forward(x, y, p)) << where;
    EXPECT_NO_THROW(layer.forward_cross(x, mem, y, p)) << where;
    ForwardOptions negative;
    negative.position_offset = -1;
    msg = error_of([&] { layer.forward(x, y, negative); });
    EXPECT_TRUE(Mentions(msg, {name, "position_offset", ">= 0", "got -1"})) << where;
  } else {
    for (const std::string& m : {error_of([&] { layer.forward(x, y, p); }),
                                 error_of([&] { layer.forward_cross(x, mem, y, p); })})
      EXPECT_TRUE(Mentions(m, {name, "position_offset", "RoPE", "expected 0, got 3"})) << where;
  }

  // Compute modes: MultiHeadAttention has none, the routed layers take both.
  for (ComputeMode mode : {ComputeMode::Sparse, ComputeMode::Dense}) {
    const std::string mode_name = mode == ComputeMode::Sparse ? "Sparse" : "Dense";
    ForwardOptions m;
    m.mode = mode;
    if (Layer::kHasModes) {
      EXPECT_NO_THROW(layer.forward(x, y, m)) << where << " " << mode_name;
      EXPECT_NO_THROW(layer.forward_cross(x, mem, y, m)) << where << " " << mode_name;
      continue;
    }
    for (const std::string& e : {error_of([&] { layer.forward(x, y, m); }),
                                 error_of([&] { layer.forward_cross(x, mem, y, m); }),
                                 error_of([&] { layer.forward_cached(x, y, cache, m); })})
      EXPECT_TRUE(Mentions(e, {name, "mode", "ComputeMode::Auto", "got " + mode_name})) << where;
  }

  // Nothing refused reached the cache; a call with the right options does.
  EXPECT_EQ(cache.length(), 0) << where;
  ForwardOptions good;
  good.new_token_padding_mask = moh::map_mask(new_tokens);
  layer.forward_cached(x, y, cache, good);
  EXPECT_EQ(cache.length(), Tn) << where;
}

TEST(LayerOptions, EachEntryPointRefusesOptionsNotItsOwn) {
  check_refused_options(moh::MultiHeadAttention<float>(moh_test::mha_config(15, 3), 30), 300);
  check_refused_options(moh::MultiHeadAttention<double>(gqa_rope_mha(), 31), 310);
  check_refused_options(moh::MoHAttention<float>(moh_test::moh_config(15, 5, 1, 2), 32), 320);
  check_refused_options(moh::MoHAttention<float>(learned_moh(), 33), 330);
  check_refused_options(moh::MoHAttention<double>(llama_moh(), 34), 340);
  check_refused_options(moh::MoAAttention<float>(small_moa(), 35), 350);
  check_refused_options(moh::MoAAttention<double>(moh_test::moa_config(9, 5, 4, 3), 36), 360);
}

// ---- the size accessors -------------------------------------------------------------------------

template <class Layer>
void expect_sizes(const Layer& l, Index D, Index H, Index Hkv, Index d, const std::string& what) {
  EXPECT_EQ(l.embed_dim(), D) << what;
  EXPECT_EQ(l.num_heads(), H) << what;
  EXPECT_EQ(l.num_kv_heads(), Hkv) << what;
  EXPECT_EQ(l.head_dim(), d) << what;
  EXPECT_EQ(l.memory_dim(), D) << what;
  const auto cache = l.make_cache(3, 5);
  EXPECT_EQ(cache.batch(), 3) << what;
  EXPECT_EQ(cache.kv_heads(), Hkv) << what;
  EXPECT_EQ(cache.head_dim(), d) << what;
  EXPECT_EQ(cache.capacity(), 5) << what;
  EXPECT_EQ(cache.length(), 0) << what;
}

TEST(LayerSizes, TheSameAccessorsOnEveryLayer) {
  using moh::MoHRouterKind;
  // Defaults: head_dim = embed_dim / num_heads, num_kv_heads = num_heads (MHA, MoH) or 1 (MoA).
  expect_sizes(moh::MultiHeadAttention<float>(moh_test::mha_config(12, 4)), 12, 4, 4, 3, "mha");
  expect_sizes(moh::MultiHeadAttention<double>(moh_test::mha_config(10, 5, 1, 7), 1), 10, 5, 1, 7,
               "mqa");
  expect_sizes(moh::MultiHeadAttention<float>(gqa_rope_mha(), moh::zero_weights), 24, 6, 2, 6,
               "gqa");
  expect_sizes(moh::MoHAttention<float>(moh_test::moh_config(12, 4, 1, 2)), 12, 4, 4, 3, "moh");
  expect_sizes(moh::MoHAttention<double>(learned_moh(), 2), 20, 8, 4, 6, "moh gqa");
  expect_sizes(moh::MoHAttention<float>(llama_moh(), moh::zero_weights), 24, 8, 2, 8, "llama");
  // MoA: E experts of one query head each over one key/value head of head_dim.
  expect_sizes(moh::MoAAttention<float>(small_moa()), 16, 5, 1, 6, "moa");
  moh::MoAConfig one_kv = moh_test::moa_config(9, 5, 3, 1);
  one_kv.num_kv_heads = 1;
  expect_sizes(moh::MoAAttention<double>(one_kv, 3), 9, 3, 1, 5, "moa kv 1");
  // JetMoE: E experts of H_kv query heads each, so E H_kv query heads over H_kv key/value heads.
  const moh::MoAAttention<float> jetmoe(moh::MoAConfig::jetmoe(16, 4, 3, 2, 8), moh::zero_weights);
  EXPECT_EQ(jetmoe.num_experts(), 3);
  expect_sizes(jetmoe, 16, 12, 4, 8, "jetmoe");
}

// ---- weights by name ---------------------------------------------------------------------------

/// set_weight / weight by name: every listed tensor round-trips (pointer and matrix forms), a
/// layer whose every tensor was copied by name computes what the original does, and unknown
/// names, wrong counts and wrong shapes are refused without changing the layer.
template <class Layer>
void check_weights_by_name(const typename Layer::Config& c, std::uint64_t seed) {
  using T = typename Layer::Scalar;
  const std::string name = Layer::kName;
  const Layer seeded(c, seed);
  Layer by_pointer(c), by_matrix(c), trip(c);
  const std::vector<moh::WeightInfo>& infos = seeded.weight_infos();
  ASSERT_FALSE(infos.empty()) << name;
  ASSERT_EQ(Layer::weight_infos(c).size(), infos.size()) << name;
  for (std::size_t i = 0; i < infos.size(); ++i) {
    const moh::WeightInfo& w = infos[i];
    EXPECT_EQ(Layer::weight_infos(c)[i].name, w.name);
    const Index numel = static_cast<Index>(w.numel());
    const std::vector<T> v = seeded.weight(w.name);
    ASSERT_EQ(static_cast<Index>(v.size()), numel) << name << " " << w.name;
    // Wrong counts.
    for (Index count : {numel - 1, numel + 1}) {
      std::vector<T> longer(v);
      longer.push_back(T(7));
      const std::string msg =
          error_of([&] { by_pointer.set_weight(w.name, longer.data(), count); });
      EXPECT_TRUE(Mentions(msg, {name, w.name, "expected " + std::to_string(numel) + " values",
                                 "got " + std::to_string(count)}));
    }
    by_pointer.set_weight(w.name, v.data(), numel);
    EXPECT_TRUE(BitEqual(by_pointer.weight(w.name), v)) << name << " " << w.name;
    // The matrix form: [numel / last dim, last dim], a 1-D tensor as [n, 1].
    const Index cols = w.shape.size() == 1 ? 1 : static_cast<Index>(w.shape.back());
    const Matrix<T> m = moh::ConstMatrixMap<T>(v.data(), numel / cols, cols);
    const Matrix<T> wrong = Matrix<T>::Zero(m.rows() + 1, m.cols());
    const std::string msg = error_of([&] { by_matrix.set_weight(w.name, wrong); });
    // Both shapes named: in full for a matrix, by their length for a 1-D tensor.
    const std::string tail = w.shape.size() == 1 ? "" : ", " + std::to_string(cols) + "]";
    EXPECT_TRUE(Mentions(msg, {name, w.name, "[" + std::to_string(m.rows()) + tail,
                               "[" + std::to_string(m.rows() + 1) + tail}));
    by_matrix.set_weight(w.name, m);
    EXPECT_TRUE(BitEqual(by_matrix.weight(w.name), v)) << name << " " << w.name;
    // Any values round-trip (native storage).
    const Matrix<T> r = moh_test::random_matrix<T>(1, numel, seed + 100 + i, 3.0);
    trip.set_weight(w.name, r.data(), numel);
    EXPECT_TRUE(BitEqual(trip.weight(w.name), std::vector<T>(r.data(), r.data() + numel)))
        << name << " " << w.name;
    if (i + 1 < infos.size()) {
      EXPECT_FALSE(by_pointer.weights_set()) << name << " after " << w.name;
    }
  }
  EXPECT_TRUE(by_pointer.weights_set()) << name;
  EXPECT_TRUE(by_matrix.weights_set()) << name;
  const Tensor3<T> x = random_tensor<T>(2, 17, seeded.embed_dim(), seed + 1);
  const Tensor3<T> want = seeded(x);
  EXPECT_TRUE(BitEqual(by_pointer(x), want)) << name;
  EXPECT_TRUE(BitEqual(by_matrix(x), want)) << name;
  // Unknown names, for setting and for getting; the message lists the layer's names.
  const std::vector<T> one(1, T(1));
  for (const std::string& msg :
       {error_of([&] { by_pointer.set_weight("no_such.weight", one.data(), 1); }),
        error_of([&] { by_pointer.set_weight("no_such.weight", Matrix<T>::Zero(1, 1)); }),
        error_of([&] { (void)by_pointer.weight("no_such.weight"); })})
    EXPECT_TRUE(Mentions(msg, {name, "no weight named 'no_such.weight'", infos.front().name,
                               infos.back().name}));
  // None of the refused calls changed the layer.
  EXPECT_TRUE(BitEqual(by_pointer(x), want)) << name;
}

TEST(LayerWeights, SetAndGetByNameRoundTrip) {
  check_weights_by_name<moh::MultiHeadAttention<float>>(gqa_rope_mha(), 40);
  check_weights_by_name<moh::MultiHeadAttention<double>>(moh_test::mha_config(9, 3, 1, 0, false),
                                                         41);
  check_weights_by_name<moh::MoHAttention<float>>(learned_moh(), 42);
  check_weights_by_name<moh::MoHAttention<double>>(moh_test::moh_config(15, 5, 2, 0), 43);
  check_weights_by_name<moh::MoHAttention<float>>(llama_moh(), 44);
  check_weights_by_name<moh::MoAAttention<float>>(small_moa(), 45);
  check_weights_by_name<moh::MoAAttention<double>>(moh_test::moa_config(9, 5, 4, 3), 46);
}

// bfloat16 storage rounds what set_weight is given; weight() returns the stored values exactly,
// so setting them again changes nothing.
TEST(LayerWeights, BFloat16StorageRoundsOnceAndReadsBackExactly) {
  moh::MHAConfig c = moh_test::mha_config(12, 3);
  c.weight_storage = moh::WeightStorage::BFloat16;
  moh::MultiHeadAttention<float> m(c, moh::zero_weights);
  const moh::WeightInfo& w = m.weight_infos().front();  // in_proj_weight
  const Matrix<float> v = moh_test::random_matrix<float>(1, w.numel(), 47);
  m.set_weight(w.name, v.data(), w.numel());
  const std::vector<float> stored = m.weight(w.name);
  bool rounded = false;
  for (std::size_t i = 0; i < stored.size(); ++i) {
    EXPECT_NEAR(stored[i], v(0, i), std::abs(v(0, i)) / 256) << i;
    rounded = rounded || stored[i] != v(0, i);
  }
  EXPECT_TRUE(rounded) << "bfloat16 storage kept every float exactly";
  m.set_weight(w.name, stored.data(), static_cast<Index>(stored.size()));
  EXPECT_TRUE(BitEqual(m.weight(w.name), stored));
}

/// A layer built from its config alone: forward, forward_cross and forward_cached refuse to run,
/// naming exactly the tensors not set yet, while they are set by name one by one (last listed
/// first); once all are, it computes what the seeded layer it was copied from computes.
template <class Layer>
void check_unset_until_all_set_by_name(const typename Layer::Config& c, std::uint64_t seed) {
  using T = typename Layer::Scalar;
  const std::string name = Layer::kName;
  const Layer seeded(c, seed);
  Layer m(c);
  const Index D = m.embed_dim();
  const Tensor3<T> x = random_tensor<T>(2, 3, D, seed + 1);
  Tensor3<T> y(2, 3, D);
  moh::KvCache<T> cache = m.make_cache(2, 3);
  const std::vector<moh::WeightInfo>& infos = m.weight_infos();
  for (std::size_t left = infos.size(); left > 0; --left) {
    std::string unset;
    for (std::size_t i = 0; i < left; ++i) unset += (i ? ", " : "") + infos[i].name;
    const std::vector<std::string> parts = {name, "weights not set: [" + unset + "]"};
    EXPECT_FALSE(m.weights_set()) << name;
    EXPECT_TRUE(Mentions(error_of([&] { m.forward(x, y); }), parts));
    EXPECT_TRUE(Mentions(error_of([&] { m.forward_cross(x, x, y); }), parts));
    EXPECT_TRUE(Mentions(error_of([&] { m.forward_cached(x, y, cache); }), parts));
    const std::vector<T> v = seeded.weight(infos[left - 1].name);
    m.set_weight(infos[left - 1].name, v.data(), static_cast<Index>(v.size()));
  }
  EXPECT_EQ(cache.length(), 0) << name;
  EXPECT_TRUE(m.weights_set()) << name;
  m.forward(x, y);
  EXPECT_TRUE(BitEqual(y, seeded(x))) << name;
  Tensor3<T> want(2, 3, D);
  moh::KvCache<T> seeded_cache = seeded.make_cache(2, 3);
  seeded.forward_cached(x, want, seeded_cache);
  m.forward_cached(x, y, cache);
  EXPECT_TRUE(BitEqual(y, want)) << name;
}

TEST(LayerWeights, ForwardRefusesToRunUntilEveryTensorIsSetByName) {
  check_unset_until_all_set_by_name<moh::MultiHeadAttention<float>>(gqa_rope_mha(), 50);
  check_unset_until_all_set_by_name<moh::MultiHeadAttention<double>>(
      moh_test::mha_config(9, 3, 0, 0, false), 51);
  check_unset_until_all_set_by_name<moh::MoHAttention<float>>(learned_moh(), 52);
  check_unset_until_all_set_by_name<moh::MoHAttention<double>>(llama_moh(), 53);
  check_unset_until_all_set_by_name<moh::MoAAttention<float>>(small_moa(), 54);
}

// ---- the caller's workspace --------------------------------------------------------------------

/// Self-, cross- and cached attention of one layer (the cached ones in three calls), with the
/// given workspace and pool.
template <class Layer>
std::vector<Tensor3<typename Layer::Scalar>> all_calls(const Layer& layer, ComputeMode mode,
                                                        std::uint64_t seed, moh::Workspace* ws,
                                                        moh::ThreadPool* pool, Index Tn = 70) {
  using T = typename Layer::Scalar;
  const Index B = 3, S = 45, D = layer.embed_dim();
  const Tensor3<T> x = random_tensor<T>(B, Tn, D, seed);
  const Tensor3<T> mem = random_tensor<T>(B, S, layer.memory_dim(), seed + 1);
  Mask pad = moh_test::no_padding(B, Tn), mpad = moh_test::no_padding(B, S);
  pad(1, Tn / 2) = mpad(2, S - 1) = true;
  ForwardOptions o;
  o.mode = mode;
  o.workspace = ws;
  o.pool = pool;
  ForwardOptions self = o, cross = o;
  self.causal = Causal::On;
  self.key_padding_mask = moh::map_mask(pad);
  cross.key_padding_mask = moh::map_mask(mpad);
  std::vector<Tensor3<T>> out;
  Tensor3<T> y(B, Tn, D);
  layer.forward(x, y, self);
  out.push_back(y);
  layer.forward_cross(x, mem, y, cross);
  out.push_back(y);
  out.push_back(decode<T>(layer, x, {Tn / 2, 1, Tn - Tn / 2 - 1}, &pad, o).y);
  return out;
}

/// A workspace reused across calls and pools gives the bits of calls without one, for 1, 2 and 3
/// threads, and again after release().
template <class Layer>
void check_workspace_keeps_bits(const Layer& layer, ComputeMode mode, std::uint64_t seed) {
  const std::string what = std::string(Layer::kName) +
                           (mode == ComputeMode::Dense ? " dense" : " sparse/auto");
  const char* kinds[] = {"self", "cross", "cached"};
  const auto want = all_calls(layer, mode, seed, nullptr, nullptr);
  moh::Workspace ws;
  auto expect_same = [&](const std::string& how, moh::ThreadPool* pool) {
    const auto got = all_calls(layer, mode, seed, &ws, pool);
    for (std::size_t k = 0; k < want.size(); ++k)
      EXPECT_TRUE(BitEqual(got[k], want[k])) << what << " " << kinds[k] << " " << how;
  };
  expect_same("calling thread", nullptr);
  for (int threads : {1, 2, 3}) {
    moh::ThreadPool pool(threads);
    for (int round = 0; round < 2; ++round)
      expect_same(std::to_string(threads) + " threads, round " + std::to_string(round), &pool);
  }
  expect_same("calling thread after the pools", nullptr);
  EXPECT_GT(ws.bytes(), 0u) << what;
  ws.release();
  EXPECT_EQ(ws.bytes(), 0u) << what;
  expect_same("after release", nullptr);
}

TEST(LayerWorkspace, ReusedWorkspaceGivesTheSameBitsForAnyThreadCount) {
  check_workspace_keeps_bits(moh::MultiHeadAttention<float>(gqa_rope_mha(), 60), ComputeMode::Auto,
                             600);
  check_workspace_keeps_bits(moh::MultiHeadAttention<double>(moh_test::mha_config(15, 3), 61),
                             ComputeMode::Auto, 610);
  for (ComputeMode mode : {ComputeMode::Sparse, ComputeMode::Dense}) {
    check_workspace_keeps_bits(moh::MoHAttention<float>(learned_moh(), 62), mode, 620);
    check_workspace_keeps_bits(moh::MoHAttention<double>(llama_moh(), 63), mode, 630);
    check_workspace_keeps_bits(moh::MoAAttention<float>(small_moa(), 64), mode, 640);
  }
}

/// Once warm, calls of the shapes seen (or smaller) take no more scratch: bytes() stops growing.
template <class Layer>
void check_warm_workspace_stops_growing(const Layer& layer, std::uint64_t seed) {
  moh::Workspace ws;
  all_calls(layer, ComputeMode::Auto, seed, &ws, nullptr);
  const std::size_t warm = ws.bytes();
  EXPECT_GT(warm, 0u) << Layer::kName;
  for (int round = 0; round < 2; ++round) {
    all_calls(layer, ComputeMode::Auto, seed, &ws, nullptr);
    EXPECT_EQ(ws.bytes(), warm) << Layer::kName << " round " << round;
  }
  all_calls(layer, ComputeMode::Auto, seed, &ws, nullptr, 17);  // smaller calls
  EXPECT_EQ(ws.bytes(), warm) << Layer::kName << " smaller";
}

TEST(LayerWorkspace, WarmWorkspaceStopsGrowing) {
  check_warm_workspace_stops_growing(moh::MultiHeadAttention<float>(gqa_rope_mha(), 65), 650);
  check_warm_workspace_stops_growing(moh::MoHAttention<float>(learned_moh(), 66), 660);
  check_warm_workspace_stops_growing(moh::MoHAttention<float>(llama_moh(), 67), 670);
  check_warm_workspace_stops_growing(moh::MoAAttention<float>(small_moa(), 68), 680);
}

}  // namespace
