// Incremental decoding through KvCache (SEMANTICS sections 1 and 4): feeding a sequence to
// forward_cached() as a prompt and then token by token (or in chunks) must give what one causal
// forward() over the whole sequence gives, for MultiHeadAttention (GQA + RoPE), MoHAttention with
// the learned router and with the query-norm router (MoH-LLaMA3: RoPE, GQA, no bias) and
// MoAAttention. Also: batches of different lengths through key padding, GQA = MHA with repeated
// key/value heads, the cache's errors, reset(), clone(), sparse = dense, and thread-count
// independence.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "moh/kv_cache.hpp"
#include "moh/moa_attention.hpp"
#include "moh/moh_attention.hpp"
#include "moh/multi_head_attention.hpp"
#include "reference/naive_blocks.hpp"

namespace {

using moh::ForwardOptions;
using moh::Index;
using moh::Mask;
using moh::Matrix;
using moh::Tensor3;

// ---- layer configurations -------------------------------------------------------------------

// GQA (6 query heads on 2 key/value heads), RoPE, head_dim 6 != embed_dim / num_heads = 4.
moh::MhaConfig mha_config() {
  moh::MhaConfig c;
  c.embed_dim = 24;
  c.num_heads = 6;
  c.head_dim = 6;
  c.num_kv_heads = 2;
  c.rope = true;
  return c;
}

// Learned two-stage router: 2 shared + top 3 of 6 routed heads, GQA 8 -> 4, RoPE, biases.
moh::MoHConfig moh_learned_config() {
  moh::MoHConfig c;
  c.embed_dim = 20;
  c.num_heads = 8;
  c.head_dim = 6;
  c.num_kv_heads = 4;
  c.shared_heads = 2;
  c.active_routed_heads = 3;
  c.rope = true;
  return c;
}

// MoH-LLaMA3: query-norm router, RoPE, GQA 8 -> 2, no bias.
moh::MoHConfig moh_llama_config() {
  moh::MoHConfig c;
  c.embed_dim = 24;
  c.num_heads = 8;
  c.head_dim = 8;
  c.num_kv_heads = 2;
  c.shared_heads = 2;
  c.active_routed_heads = 3;
  c.router = moh::MoHRouter::QueryNorm;
  c.bias = false;
  c.rope = true;
  c.rope_base = 500000.0;
  return c;
}

moh::MoAConfig moa_config() {
  moh::MoAConfig c;
  c.embed_dim = 16;
  c.head_dim = 6;
  c.num_experts = 5;
  c.top_k = 2;
  return c;
}

// ---- uniform calls over the three layers ------------------------------------------------------

template <class T>
void call_forward(const moh::MultiHeadAttention<T>& l, const Tensor3<T>& x, Tensor3<T>& y,
                  const ForwardOptions& o, Matrix<T>* gates) {
  l.forward(x, y, o);
  if (gates) gates->resize(0, 0);
}
template <class T>
void call_forward(const moh::MoHAttention<T>& l, const Tensor3<T>& x, Tensor3<T>& y,
                  const ForwardOptions& o, Matrix<T>* gates) {
  moh::MoHRouting<T> r;
  l.forward(x, y, o, &r);
  if (gates) *gates = r.gates;
}
template <class T>
void call_forward(const moh::MoAAttention<T>& l, const Tensor3<T>& x, Tensor3<T>& y,
                  const ForwardOptions& o, Matrix<T>* gates) {
  moh::MoARouting<T> r;
  l.forward(x, y, o, &r);
  if (gates) *gates = r.gates;
}
template <class T>
void call_cached(const moh::MultiHeadAttention<T>& l, const Tensor3<T>& x, Tensor3<T>& y,
                 moh::KvCache<T>& cache, const ForwardOptions& o, Matrix<T>* gates) {
  l.forward_cached(x, y, cache, o);
  if (gates) gates->resize(0, 0);
}
template <class T>
void call_cached(const moh::MoHAttention<T>& l, const Tensor3<T>& x, Tensor3<T>& y,
                 moh::KvCache<T>& cache, const ForwardOptions& o, Matrix<T>* gates) {
  moh::MoHRouting<T> r;
  l.forward_cached(x, y, cache, o, &r);
  if (gates) *gates = r.gates;
}
template <class T>
void call_cached(const moh::MoAAttention<T>& l, const Tensor3<T>& x, Tensor3<T>& y,
                 moh::KvCache<T>& cache, const ForwardOptions& o, Matrix<T>* gates) {
  moh::MoARouting<T> r;
  l.forward_cached(x, y, cache, o, &r);
  if (gates) *gates = r.gates;
}

Index embed_dim_of(const moh::MhaConfig& c) { return c.embed_dim; }
Index embed_dim_of(const moh::MoHConfig& c) { return c.embed_dim; }
Index embed_dim_of(const moh::MoAConfig& c) { return c.embed_dim; }

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
  o.causal = true;
  if (padding) o.key_padding_mask = moh::map_mask(*padding);
  Outcome<T> r;
  r.y = Tensor3<T>(x.dimension(0), x.dimension(1), x.dimension(2));
  call_forward(layer, x, r.y, o, &r.gates);
  return r;
}

/// x fed through forward_cached in calls of `schedule` tokens each (causal), outputs stitched.
template <class T, class Layer>
Outcome<T> decode(const Layer& layer, const Tensor3<T>& x, const std::vector<Index>& schedule,
              const Mask* padding = nullptr, ForwardOptions o = {},
              moh::KvCache<T>* use_cache = nullptr) {
  const Index B = x.dimension(0), Tn = x.dimension(1), D = x.dimension(2);
  moh::KvCache<T> own = layer.make_cache(B, std::max<Index>(Tn, 1));
  moh::KvCache<T>& cache = use_cache ? *use_cache : own;
  const Index start = cache.length();
  o.causal = true;
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
      oc.key_padding_mask = moh::map_mask(ps);
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

template <class T>
double tolerance() {
  return sizeof(T) == sizeof(float) ? 1e-5 : 1e-12;
}

/// max |a - b| / max(1, max |b|) over two [B, T, D] tensors, only rows where keep(b, t).
template <class T, class Keep>
double rel_error(const Tensor3<T>& a, const Tensor3<T>& b, Keep keep) {
  double err = 0, scale = 1;
  for (Index i = 0; i < b.dimension(0); ++i)
    for (Index t = 0; t < b.dimension(1); ++t) {
      if (!keep(i, t)) continue;
      for (Index j = 0; j < b.dimension(2); ++j) {
        const double d = std::abs(static_cast<double>(a(i, t, j)) - static_cast<double>(b(i, t, j)));
        err = std::isnan(d) ? INFINITY : std::max(err, d);
        scale = std::max(scale, std::abs(static_cast<double>(b(i, t, j))));
      }
    }
  return err / scale;
}
template <class T>
double rel_error(const Tensor3<T>& a, const Tensor3<T>& b) {
  EXPECT_EQ(a.dimension(0), b.dimension(0));
  EXPECT_EQ(a.dimension(1), b.dimension(1));
  EXPECT_EQ(a.dimension(2), b.dimension(2));
  return rel_error(a, b, [](Index, Index) { return true; });
}

template <class T>
bool bitwise_equal(const Tensor3<T>& a, const Tensor3<T>& b) {
  return a.size() == b.size() && std::equal(a.data(), a.data() + a.size(), b.data());
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
template <class T, class Layer>
void check_decode_equals_full(const Layer& layer, Index B, Index Tn, std::uint64_t seed,
                              const std::vector<Index>& prompts) {
  const Tensor3<T> x = moh_test::random_tensor<T>(B, Tn, embed_dim_of(layer.config()), seed);
  const Outcome<T> full = full_forward<T>(layer, x);
  for (Index P : prompts) {
    const Outcome<T> dec = decode<T>(layer, x, prompt_then_tokens(P, Tn));
    EXPECT_LE(rel_error(dec.y, full.y), tolerance<T>()) << "prompt " << P << " of " << Tn;
    if (full.gates.size())
      expect_same_routing(dec.gates, full.gates, tolerance<T>() * 10,
                          "prompt " + std::to_string(P));
  }
  for (Index chunk : {Index(3), Index(2), Index(5)}) {
    const Outcome<T> dec = decode<T>(layer, x, chunks_of(chunk, Tn));
    EXPECT_LE(rel_error(dec.y, full.y), tolerance<T>()) << "chunks of " << chunk;
    if (full.gates.size())
      expect_same_routing(dec.gates, full.gates, tolerance<T>() * 10,
                          "chunks of " + std::to_string(chunk));
  }
}

// ---- decoding equals the full forward --------------------------------------------------------

TEST(Decode, MhaGqaRopeFloat) {
  const moh::MultiHeadAttention<float> layer(mha_config(), 1);
  check_decode_equals_full<float>(layer, 2, 9, 10, {0, 1, 4, 8, 9});
}

TEST(Decode, MhaGqaRopeDouble) {
  const moh::MultiHeadAttention<double> layer(mha_config(), 1);
  check_decode_equals_full<double>(layer, 2, 9, 10, {0, 1, 4, 9});
}

TEST(Decode, MhaLongSequenceCrossesKernelBlocks) {
  // 300 tokens: the prompt spans two 256-key blocks and several 64-query blocks, then 40 tokens
  // are decoded one by one against a cache longer than one key block.
  const moh::MultiHeadAttention<float> layer(mha_config(), 2);
  const Tensor3<float> x = moh_test::random_tensor<float>(1, 300, 24, 20);
  const Outcome<float> full = full_forward<float>(layer, x);
  const Outcome<float> dec = decode<float>(layer, x, prompt_then_tokens(260, 300));
  EXPECT_LE(rel_error(dec.y, full.y), 1e-5);
  const Outcome<float> chunked = decode<float>(layer, x, chunks_of(70, 300));
  EXPECT_LE(rel_error(chunked.y, full.y), 1e-5);
}

TEST(Decode, MoHLearnedRouterFloat) {
  const moh::MoHAttention<float> layer(moh_learned_config(), 3);
  check_decode_equals_full<float>(layer, 2, 10, 30, {0, 1, 3, 10});
}

TEST(Decode, MoHLearnedRouterDouble) {
  const moh::MoHAttention<double> layer(moh_learned_config(), 3);
  check_decode_equals_full<double>(layer, 3, 7, 31, {0, 1, 5});
}

TEST(Decode, MoHQueryNormRouterFloat) {
  const moh::MoHAttention<float> layer(moh_llama_config(), 4);
  check_decode_equals_full<float>(layer, 2, 10, 40, {0, 1, 6, 10});
}

TEST(Decode, MoHQueryNormRouterDouble) {
  const moh::MoHAttention<double> layer(moh_llama_config(), 4);
  check_decode_equals_full<double>(layer, 2, 8, 41, {0, 1, 2, 8});
}

TEST(Decode, MoAFloat) {
  const moh::MoAAttention<float> layer(moa_config(), 5);
  check_decode_equals_full<float>(layer, 2, 9, 50, {0, 1, 4, 9});
}

TEST(Decode, MoADouble) {
  const moh::MoAAttention<double> layer(moa_config(), 5);
  check_decode_equals_full<double>(layer, 2, 9, 51, {0, 1, 7});
}

TEST(Decode, ZeroTokenCallIsANoOp) {
  // A call with no new tokens appends nothing and writes nothing.
  const moh::MultiHeadAttention<float> layer(mha_config(), 6);
  moh::KvCache<float> cache = layer.make_cache(2, 4);
  const Tensor3<float> x = moh_test::random_tensor<float>(2, 3, 24, 60);
  Tensor3<float> y(2, 3, 24), empty_y(2, 0, 24);
  const Tensor3<float> empty_x(2, 0, 24);
  ForwardOptions o;
  o.causal = true;
  layer.forward_cached(empty_x, empty_y, cache, o);
  EXPECT_EQ(cache.length(), 0);
  layer.forward_cached(x, y, cache, o);
  layer.forward_cached(empty_x, empty_y, cache, o);
  EXPECT_EQ(cache.length(), 3);
  const moh::MoHAttention<float> moh_layer(moh_llama_config(), 6);
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

template <class T, class Layer>
void check_padded_batch(const Layer& layer, std::uint64_t seed) {
  const std::vector<Index> lengths = {7, 4, 1, 6};
  const Index B = 4, Tn = 7, D = embed_dim_of(layer.config());
  const Tensor3<T> x = moh_test::random_tensor<T>(B, Tn, D, seed);
  const Mask pad = right_padding(lengths, Tn);
  const Outcome<T> batched = full_forward<T>(layer, x, &pad);
  // Every real token of sequence b equals running sequence b alone at batch 1.
  for (Index b = 0; b < B; ++b) {
    const Tensor3<T> xb = batch_item(x, b, lengths[b]);
    const Outcome<T> alone = full_forward<T>(layer, xb);
    const Tensor3<T> yb = batch_item(batched.y, b, lengths[b]);
    EXPECT_LE(rel_error(yb, alone.y), tolerance<T>()) << "sequence " << b;
    if (alone.gates.size()) {
      const Matrix<T> rows = batched.gates.middleRows(b * Tn, lengths[b]);
      expect_same_routing(rows, alone.gates, tolerance<T>() * 10, "sequence " + std::to_string(b));
    }
  }
  // Decoding the padded batch (prompt 3, then tokens; or chunks of 3) equals the padded full
  // forward on every row, padded ones included (they see the same keys either way).
  for (const std::vector<Index>& schedule : {prompt_then_tokens(3, Tn), chunks_of(3, Tn)}) {
    const Outcome<T> dec = decode<T>(layer, x, schedule, &pad);
    EXPECT_LE(rel_error(dec.y, batched.y), tolerance<T>());
  }
}

TEST(Decode, PaddedBatchMatchesSequencesAloneMha) {
  check_padded_batch<float>(moh::MultiHeadAttention<float>(mha_config(), 7), 70);
  check_padded_batch<double>(moh::MultiHeadAttention<double>(mha_config(), 7), 71);
}

TEST(Decode, PaddedBatchMatchesSequencesAloneMoH) {
  check_padded_batch<float>(moh::MoHAttention<float>(moh_llama_config(), 8), 80);
  check_padded_batch<double>(moh::MoHAttention<double>(moh_learned_config(), 8), 81);
}

TEST(Decode, PaddedBatchMatchesSequencesAloneMoA) {
  check_padded_batch<float>(moh::MoAAttention<float>(moa_config(), 9), 90);
  check_padded_batch<double>(moh::MoAAttention<double>(moa_config(), 9), 91);
}

TEST(Decode, LeftPaddingWithRopeMatchesAloneAndHiddenRowsAreBias) {
  // Left padding shifts the real tokens' RoPE positions by the pad count; RoPE scores depend on
  // relative positions only, so the real tokens still match the sequence alone. A padded query
  // before the first real token sees no key at all: its attention output is zeros, so y is
  // exactly the output bias.
  const moh::MultiHeadAttention<double> layer(mha_config(), 10);
  const Index Tn = 6, pads = 2, D = 24;
  const Tensor3<double> x = moh_test::random_tensor<double>(1, Tn, D, 100);
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

TEST(Decode, GqaEqualsMhaWithRepeatedKvHeads) {
  const moh::MhaConfig c = mha_config();  // H = 6, Hkv = 2, d = 6
  const moh::MultiHeadAttention<double> gqa(c, 11);
  moh::MhaConfig full_c = c;
  full_c.num_kv_heads = c.num_heads;
  moh::MultiHeadAttention<double> mha(full_c);
  mha.set_in_proj_weight(expand_kv_rows(gqa.in_proj_weight(), 6, 2, 6));
  const Matrix<double> bias_col = gqa.in_proj_bias();
  mha.set_in_proj_bias(expand_kv_rows(bias_col, 6, 2, 6));
  mha.set_out_proj_weight(gqa.out_proj_weight());
  mha.set_out_proj_bias(gqa.out_proj_bias());
  const Tensor3<double> x = moh_test::random_tensor<double>(2, 8, 24, 110);
  const Outcome<double> a = full_forward<double>(gqa, x), b = full_forward<double>(mha, x);
  EXPECT_LE(rel_error(a.y, b.y), 1e-12);
  const Outcome<double> da = decode<double>(gqa, x, prompt_then_tokens(3, 8));
  const Outcome<double> db = decode<double>(mha, x, prompt_then_tokens(3, 8));
  EXPECT_LE(rel_error(da.y, b.y), 1e-12);
  EXPECT_LE(rel_error(db.y, b.y), 1e-12);
  // Multi-query attention (Hkv = 1) too, without cache.
  moh::MhaConfig mqa_c = c;
  mqa_c.num_kv_heads = 1;
  const moh::MultiHeadAttention<double> mqa(mqa_c, 12);
  moh::MultiHeadAttention<double> mqa_full(full_c);
  mqa_full.set_in_proj_weight(expand_kv_rows(mqa.in_proj_weight(), 6, 1, 6));
  mqa_full.set_in_proj_bias(expand_kv_rows(Matrix<double>(mqa.in_proj_bias()), 6, 1, 6));
  mqa_full.set_out_proj_weight(mqa.out_proj_weight());
  mqa_full.set_out_proj_bias(mqa.out_proj_bias());
  EXPECT_LE(rel_error(full_forward<double>(mqa, x).y, full_forward<double>(mqa_full, x).y), 1e-12);
}

TEST(Decode, MoHQueryNormGqaEqualsRepeatedKvHeads) {
  const moh::MoHConfig c = moh_llama_config();  // H = 8, Hkv = 2, d = 8
  const moh::MoHAttention<float> gqa(c, 13);
  moh::MoHConfig full_c = c;
  full_c.num_kv_heads = c.num_heads;
  moh::MoHAttention<float> moh_full(full_c);
  moh_full.set_qkv_weight(expand_kv_rows(gqa.qkv_weight(), 8, 2, 8));
  moh_full.set_proj_weight(gqa.proj_weight());
  const Tensor3<float> x = moh_test::random_tensor<float>(2, 9, 24, 130);
  const Outcome<float> want = full_forward<float>(moh_full, x);
  const Outcome<float> got = full_forward<float>(gqa, x);
  EXPECT_LE(rel_error(got.y, want.y), 1e-5);
  expect_same_routing(got.gates, want.gates, 0.0, "full");
  const Outcome<float> dec = decode<float>(gqa, x, prompt_then_tokens(4, 9));
  EXPECT_LE(rel_error(dec.y, want.y), 1e-5);
}

// ---- the cache itself -------------------------------------------------------------------------

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const moh::Error& e) {
    return e.what();
  }
  return "";
}

TEST(Decode, FullCacheThrowsNamingCapacityAndKeepsState) {
  const moh::MultiHeadAttention<float> layer(mha_config(), 14);
  const Tensor3<float> x = moh_test::random_tensor<float>(1, 6, 24, 140);
  moh::KvCache<float> cache = layer.make_cache(1, 5);
  EXPECT_EQ(cache.capacity(), 5);
  ForwardOptions o;
  o.causal = true;
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
  const moh::MoAAttention<float> moa(moa_config(), 14);
  moh::KvCache<float> moa_cache = moa.make_cache(1, 2);
  const Tensor3<float> xm = moh_test::random_tensor<float>(1, 3, 16, 141);
  Tensor3<float> ym(1, 3, 16);
  const std::string moa_msg = error_of([&] { moa.forward_cached(xm, ym, moa_cache, o); });
  EXPECT_NE(moa_msg.find("capacity 2"), std::string::npos) << moa_msg;
  const moh::MoHAttention<float> mohl(moh_llama_config(), 14);
  moh::KvCache<float> moh_cache = mohl.make_cache(1, 2);
  const Tensor3<float> xh = moh_test::random_tensor<float>(1, 3, 24, 142);
  Tensor3<float> yh(1, 3, 24);
  const std::string moh_msg = error_of([&] { mohl.forward_cached(xh, yh, moh_cache, o); });
  EXPECT_NE(moh_msg.find("capacity 2"), std::string::npos) << moh_msg;
  EXPECT_EQ(moh_cache.length(), 0);
}

TEST(Decode, MismatchedCacheThrows) {
  const moh::MultiHeadAttention<float> layer(mha_config(), 15);  // Hkv = 2, d = 6
  const Tensor3<float> x = moh_test::random_tensor<float>(2, 1, 24, 150);
  Tensor3<float> y(2, 1, 24);
  ForwardOptions o;
  o.causal = true;
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
  o.key_padding_mask = moh::map_mask(bad);
  EXPECT_THROW(layer.forward_cached(x, y, cache, o), moh::Error);
  // MoA caches have one kv head of size head_dim; a wider one is refused.
  const moh::MoAAttention<float> moa(moa_config(), 15);
  moh::KvCache<float> moa_wrong(2, 1, 7, 8);
  const Tensor3<float> xm = moh_test::random_tensor<float>(2, 1, 16, 151);
  Tensor3<float> ym(2, 1, 16);
  ForwardOptions om;
  EXPECT_THROW(moa.forward_cached(xm, ym, moa_wrong, om), moh::Error);
  // Sizes must be positive.
  EXPECT_THROW(moh::KvCache<float>(0, 1, 4, 4), moh::Error);
  EXPECT_THROW(moh::KvCache<float>(1, 1, 4, 0), moh::Error);
}

TEST(Decode, ResetThenReuseGivesTheSameResult) {
  const moh::MoHAttention<float> layer(moh_llama_config(), 16);
  const Tensor3<float> x = moh_test::random_tensor<float>(2, 7, 24, 160);
  moh::KvCache<float> cache = layer.make_cache(2, 7);
  const Outcome<float> first = decode<float>(layer, x, prompt_then_tokens(2, 7), nullptr, {}, &cache);
  EXPECT_EQ(cache.length(), 7);
  cache.reset();
  EXPECT_EQ(cache.length(), 0);
  EXPECT_EQ(cache.capacity(), 7);
  const Outcome<float> second = decode<float>(layer, x, prompt_then_tokens(2, 7), nullptr, {}, &cache);
  EXPECT_TRUE(bitwise_equal(first.y, second.y));
  EXPECT_EQ(first.gates, second.gates);
  // A cache reset after a padded batch forgets the padding.
  const Mask pad = right_padding({3, 7}, 7);
  cache.reset();
  decode<float>(layer, x, chunks_of(3, 7), &pad, {}, &cache);
  EXPECT_TRUE(cache.any_padding());
  cache.reset();
  EXPECT_FALSE(cache.any_padding());
  const Outcome<float> third = decode<float>(layer, x, prompt_then_tokens(2, 7), nullptr, {}, &cache);
  EXPECT_TRUE(bitwise_equal(first.y, third.y));
}

TEST(Decode, CloneIsIndependent) {
  const moh::MultiHeadAttention<double> layer(mha_config(), 17);
  const Index Tn = 8, split = 5;
  const Tensor3<double> x = moh_test::random_tensor<double>(1, Tn, 24, 170);
  // x2 shares the first `split` tokens with x and continues differently.
  Tensor3<double> x2 = moh_test::random_tensor<double>(1, Tn, 24, 171);
  for (Index t = 0; t < split; ++t)
    for (Index j = 0; j < 24; ++j) x2(0, t, j) = x(0, t, j);
  moh::KvCache<double> a = layer.make_cache(1, Tn);
  decode<double>(layer, tokens(x, 0, split), prompt_then_tokens(2, split), nullptr, {}, &a);
  moh::KvCache<double> b = a.clone();
  EXPECT_EQ(b.length(), split);
  const Outcome<double> ya =
      decode<double>(layer, tokens(x, split, Tn - split), chunks_of(1, Tn - split), nullptr, {}, &a);
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
  const Index D = embed_dim_of(layer.config());
  const Tensor3<T> x = moh_test::random_tensor<T>(2, 9, D, seed);
  const Mask pad = right_padding({9, 6}, 9);
  ForwardOptions sparse, dense;
  sparse.mode = moh::ComputeMode::Sparse;
  dense.mode = moh::ComputeMode::Dense;
  for (const std::vector<Index>& schedule : {prompt_then_tokens(4, 9), chunks_of(3, 9)}) {
    const Outcome<T> s = decode<T>(layer, x, schedule, &pad, sparse);
    const Outcome<T> d = decode<T>(layer, x, schedule, &pad, dense);
    EXPECT_LE(rel_error(s.y, d.y), tolerance<T>());
    EXPECT_EQ(s.gates, d.gates);  // the same router call either way
  }
}

TEST(Decode, SparseEqualsDenseInCachedDecodingMoH) {
  check_sparse_equals_dense<float>(moh::MoHAttention<float>(moh_learned_config(), 18), 180);
  check_sparse_equals_dense<float>(moh::MoHAttention<float>(moh_llama_config(), 18), 181);
  check_sparse_equals_dense<double>(moh::MoHAttention<double>(moh_llama_config(), 18), 182);
}

TEST(Decode, SparseEqualsDenseInCachedDecodingMoA) {
  check_sparse_equals_dense<float>(moh::MoAAttention<float>(moa_config(), 19), 190);
  check_sparse_equals_dense<double>(moh::MoAAttention<double>(moa_config(), 19), 191);
}

TEST(Decode, ThreadCountDoesNotChangeCachedResults) {
  moh::ThreadPool p2(2), p3(3);
  auto check = [&](const auto& layer, Index D, std::uint64_t seed, const char* name) {
    const Tensor3<float> x = moh_test::random_tensor<float>(3, 70, D, seed);
    ForwardOptions o;
    const Outcome<float> serial = decode<float>(layer, x, chunks_of(66, 70), nullptr, o);
    for (moh::ThreadPool* pool : {&p2, &p3}) {
      o.pool = pool;
      const Outcome<float> par = decode<float>(layer, x, chunks_of(66, 70), nullptr, o);
      EXPECT_TRUE(bitwise_equal(serial.y, par.y)) << name << " threads " << pool->size();
      EXPECT_EQ(serial.gates, par.gates) << name;
    }
  };
  check(moh::MultiHeadAttention<float>(mha_config(), 20), 24, 200, "mha");
  check(moh::MoHAttention<float>(moh_learned_config(), 20), 20, 201, "moh learned");
  check(moh::MoHAttention<float>(moh_llama_config(), 20), 24, 202, "moh llama");
  check(moh::MoAAttention<float>(moa_config(), 20), 16, 203, "moa");
}

}  // namespace
