// The additive attention bias (docs/semantics.md §6) and the attention probabilities on request, as
// every layer takes them through ForwardOptions: broadcasting, -inf as a mask (and the key blocks
// it hides skipped), decoding with a bias, thread independence, and the errors of bad shapes and
// types. The numbers against the naive reference are in reference/naive_families_test.cpp and
// the layers' own family tests.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "layers/layer_test_support.hpp"

namespace {

using namespace moh_test;
using moh::Tensor4;

constexpr double kInf = std::numeric_limits<double>::infinity();

template <class T>
using AttentionBiasTest = ScalarTest<T>;
TYPED_TEST_SUITE(AttentionBiasTest, Scalars);

/// A random bias [B, H, T, S] in (-scale, scale).
template <class T>
Tensor4<T> random_bias(Index B, Index H, Index Tn, Index S, std::uint64_t seed, double scale = 1.0) {
  Tensor4<T> m(B, H, Tn, S);
  fill_random(m.data(), m.size(), seed, scale);
  return m;
}

/// `m` [b0|1, h0|1, T, S] repeated to [B, H, T, S].
template <class T>
Tensor4<T> broadcast(const Tensor4<T>& m, Index B, Index H) {
  Tensor4<T> out(B, H, m.dimension(2), m.dimension(3));
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < H; ++h)
      for (Index i = 0; i < m.dimension(2); ++i)
        for (Index j = 0; j < m.dimension(3); ++j)
          out(b, h, i, j) = m(m.dimension(0) == 1 ? 0 : b, m.dimension(1) == 1 ? 0 : h, i, j);
  return out;
}

template <class Layer>
Tensor3<typename Layer::Scalar> with_bias(const Layer& layer, const Tensor3<typename Layer::Scalar>& x,
                                          const Tensor4<typename Layer::Scalar>& bias,
                                          ForwardOptions o = {}) {
  o.attn_bias = bias;
  return run(layer, x, o);
}

TYPED_TEST(AttentionBiasTest, BroadcastDimensionsEqualTheRepeatedBiasBitForBit) {
  using T = TypeParam;
  const moh::MultiHeadAttention<T> mha(mha_config(12, 3), 1);
  const moh::MoHAttention<T> moh_layer(moh_config(12, 4, 1, 2), 2);
  const moh::MoAAttention<T> moa(moa_config(12, 4, 5, 2), 3);
  const Tensor3<T> x = random_tensor<T>(2, 5, 12, 4);
  for (const auto& [b0, h0] : {std::pair<Index, Index>{1, 1}, {2, 1}, {1, 3}}) {
    const Tensor4<T> m = random_bias<T>(b0, h0, 5, 5, 10 + b0 + h0);
    EXPECT_TRUE(BitEqual(with_bias(mha, x, m), with_bias(mha, x, broadcast(m, 2, 3))))
        << b0 << " x " << h0;
  }
  const Tensor4<T> shared = random_bias<T>(1, 1, 5, 5, 20);
  for (ComputeMode mode : kModes) {
    EXPECT_TRUE(BitEqual(with_bias(moh_layer, x, shared, in_mode(mode)),
                          with_bias(moh_layer, x, broadcast(shared, 2, 4), in_mode(mode))))
        << mode_name(mode);
    EXPECT_TRUE(BitEqual(with_bias(moa, x, shared, in_mode(mode)),
                          with_bias(moa, x, broadcast(shared, 2, 1), in_mode(mode))))
        << mode_name(mode);
  }
}

TYPED_TEST(AttentionBiasTest, MinusInfinityHidesAKeyExactlyAsPaddingDoes) {
  using T = TypeParam;
  // 150 keys: more than one key block, and keys 64..127 hidden from every query, so whole
  // blocks are skipped; key 3 of sequence 1 hidden too.
  const Index Tn = 150, D = 16;
  const moh::MultiHeadAttention<T> mha(mha_config(D, 4), 5);
  const moh::MoHAttention<T> moh_layer(moh_config(D, 4, 1, 1), 6);
  const moh::MoAAttention<T> moa(moa_config(D, 4, 3, 1), 7);
  const Tensor3<T> x = random_tensor<T>(2, Tn, D, 8);
  Tensor4<T> bias(2, 1, Tn, Tn);
  bias.setZero();
  Mask pad(2, Tn);
  pad.setConstant(false);
  for (Index b = 0; b < 2; ++b)
    for (Index j = 0; j < Tn; ++j) {
      const bool hidden = (j >= 64 && j < 128) || (b == 1 && j == 3);
      pad(b, j) = hidden;
      for (Index i = 0; i < Tn; ++i)
        if (hidden) bias(b, 0, i, j) = static_cast<T>(-kInf);
    }
  ForwardOptions padded;
  padded.key_padding_mask = moh::map_mask(pad);
  padded.causal = moh::Causal::On;
  ForwardOptions biased;
  biased.causal = moh::Causal::On;
  const Tensor4<T> mha_bias = broadcast(bias, 2, 4);
  EXPECT_TRUE(BitEqual(with_bias(mha, x, mha_bias, biased), run(mha, x, padded)));
  for (ComputeMode mode : kModes) {
    padded.mode = biased.mode = mode;
    EXPECT_TRUE(BitEqual(with_bias(moh_layer, x, mha_bias, biased), run(moh_layer, x, padded)))
        << mode_name(mode);
    EXPECT_TRUE(BitEqual(with_bias(moa, x, bias, biased), run(moa, x, padded))) << mode_name(mode);
  }
}

TYPED_TEST(AttentionBiasTest, AQueryWhoseKeysTheBiasHidesOutputsTheOutputBias) {
  using T = TypeParam;
  const moh::MultiHeadAttention<T> mha(mha_config(8, 2), 9);
  const Tensor3<T> x = random_tensor<T>(1, 4, 8, 10);
  Tensor4<T> bias = random_bias<T>(1, 1, 4, 4, 11);
  for (Index j = 0; j < 4; ++j) bias(0, 0, 2, j) = static_cast<T>(-kInf);  // query 2 sees nothing
  const Tensor3<T> y = with_bias(mha, x, bias);
  expect_rows_are_bias(y, mha.out_proj_bias(), [](Index, Index i) { return i == 2; }, "MHA");
}

TYPED_TEST(AttentionBiasTest, DecodingWithTheBiasRowsOfEachStepEqualsTheFullForward) {
  using T = TypeParam;
  moh::MoAConfig jc = moh::MoAConfig::jetmoe(16, 2, 4, 2, 4);
  const moh::MoAAttention<T> jet(jc, 12);
  moh::MoHConfig hc = moh_config(16, 4, 1, 2, moh::MoHRouterKind::Learned, 2, 0, true, true);
  const moh::MoHAttention<T> moh_layer(hc, 13);
  const moh::MultiHeadAttention<T> mha(mha_config(16, 4, 2, 0, true, true), 14);
  const Index Tn = 7;
  const Tensor3<T> x = random_tensor<T>(2, Tn, 16, 15);
  auto check = [&](const auto& layer, Index heads) {
    const Tensor4<T> bias = random_bias<T>(2, heads, Tn, Tn, 16 + heads);
    ForwardOptions causal;
    causal.causal = moh::Causal::On;
    const Tensor3<T> full = with_bias(layer, x, bias, causal);
    auto cache = layer.make_cache(2, Tn);
    Tensor3<T> stepped(2, Tn, 16);
    for (Index t0 = 0; t0 < Tn;) {
      const Index n = t0 == 0 ? 3 : 1;  // a prompt of 3, then one token at a time
      const Eigen::array<Index, 3> xo{0, t0, 0}, xe{2, n, 16};
      const Tensor3<T> xs = x.slice(xo, xe);
      const Eigen::array<Index, 4> bo{0, 0, t0, 0}, be{2, heads, n, t0 + n};
      const Tensor4<T> rows = bias.slice(bo, be);
      ForwardOptions o;
      o.attn_bias = rows;
      Tensor3<T> ys(2, n, 16);
      layer.forward_cached(xs, ys, cache, o);
      stepped.slice(xo, xe) = ys;
      t0 += n;
    }
    EXPECT_LE(relative_error(stepped, rows_of(full)), Tol<T>::rel) << layer.kName;
  };
  check(jet, 1);
  check(moh_layer, 4);
  check(mha, 4);
}

/// y [B, T, D] and the probabilities p [B, H, T, S] of one call side by side: [B, T, D + H S].
template <class T>
Tensor3<T> output_and_probabilities(const Tensor3<T>& y, const Tensor4<T>& p) {
  const Index B = y.dimension(0), Tn = y.dimension(1), D = y.dimension(2);
  const Index H = p.dimension(1), S = p.dimension(3);
  Tensor3<T> both(B, Tn, D + H * S);
  for (Index b = 0; b < B; ++b)
    for (Index t = 0; t < Tn; ++t) {
      for (Index j = 0; j < D; ++j) both(b, t, j) = y(b, t, j);
      for (Index h = 0; h < H; ++h)
        for (Index s = 0; s < S; ++s) both(b, t, D + h * S + s) = p(b, h, t, s);
    }
  return both;
}

TYPED_TEST(AttentionBiasTest, BiasAndProbabilitiesGiveTheSameBitsOnAnyThreadCount) {
  using T = TypeParam;
  const moh::MoHAttention<T> moh_layer(moh_config(16, 4, 1, 2), 17);
  const moh::MoAAttention<T> jet(moh::MoAConfig::jetmoe(16, 2, 5, 2, 4), 18);
  const Tensor3<T> x = random_tensor<T>(3, 70, 16, 19);
  const Tensor4<T> bias4 = random_bias<T>(3, 4, 70, 70, 20), bias1 = random_bias<T>(1, 1, 70, 70, 21);
  // MoH: 4 heads; JetMoE: top_k 2 slots of 2 kv heads. Both: [3, 4, 70, 70] probabilities.
  auto with_probabilities = [&](const auto& layer, const Tensor4<T>& bias, ComputeMode mode,
                                moh::Causal causal) {
    return [&x, layer_ptr = &layer, bias_ptr = &bias, mode, causal](moh::ThreadPool* pool) {
      Tensor4<T> p(3, 4, 70, 70);
      ForwardOptions o = with_pool(in_mode(mode), pool);
      o.attn_bias = *bias_ptr;
      o.attention_weights = p;
      o.causal = causal;
      return output_and_probabilities(run(*layer_ptr, x, o), p);
    };
  };
  for (ComputeMode mode : kModes) {
    expect_same_bits_for_any_thread_count(with_probabilities(moh_layer, bias4, mode, moh::Causal::Off),
                                          std::string("MoH ") + mode_name(mode));
    expect_same_bits_for_any_thread_count(with_probabilities(jet, bias1, mode, moh::Causal::On),
                                          std::string("JetMoE ") + mode_name(mode));
  }
}

TYPED_TEST(AttentionBiasTest, ProbabilitiesAreSoftmaxRowsAndCostNothingInTheOutput) {
  using T = TypeParam;
  const moh::MoHAttention<T> layer(moh_config(16, 4, 1, 1), 22);
  const Tensor3<T> x = random_tensor<T>(2, 9, 16, 23);
  const Tensor4<T> bias = random_bias<T>(2, 4, 9, 9, 24);
  for (ComputeMode mode : kModes) {
    ForwardOptions o = in_mode(mode);
    o.causal = moh::Causal::On;
    o.attn_bias = bias;
    moh::MoHRouting<T> routing;
    const Tensor3<T> plain = run(layer, x, o);
    Tensor4<T> p(2, 4, 9, 9);
    p.setConstant(T(7));  // every entry is written
    o.attention_weights = p;
    const Tensor3<T> y = run(layer, x, o, &routing);
    EXPECT_TRUE(BitEqual(y, plain)) << mode_name(mode);
    for (Index b = 0; b < 2; ++b)
      for (Index h = 0; h < 4; ++h)
        for (Index t = 0; t < 9; ++t) {
          double sum = 0;
          for (Index s = 0; s < 9; ++s) {
            sum += static_cast<double>(p(b, h, t, s));
            if (s > t) {
              EXPECT_EQ(p(b, h, t, s), T(0)) << "causal";
            }
          }
          const bool on = routing.gates(b * 9 + t, h) != T(0);
          EXPECT_NEAR(sum, on ? 1.0 : 0.0, Tol<T>::exact) << mode_name(mode) << " " << b << h << t;
        }
  }
}

TYPED_TEST(AttentionBiasTest, BadBiasesAndProbabilityTensorsAreNamedErrors) {
  using T = TypeParam;
  using Other = std::conditional_t<std::is_same<T, float>::value, double, float>;
  const moh::MultiHeadAttention<T> mha(mha_config(8, 2), 25);
  const moh::MoAAttention<T> moa(moa_config(8, 4, 3, 1), 26);
  const Tensor3<T> x = random_tensor<T>(2, 3, 8, 27);
  Tensor3<T> y(2, 3, 8);
  moh::KvCache<T> cache = mha.make_cache(2, 3);
  const Tensor4<T> wrong_keys(2, 2, 3, 4), wrong_heads(2, 3, 3, 3), per_head(1, 2, 3, 3);
  ForwardOptions o;
  o.attn_bias = wrong_keys;
  EXPECT_TRUE(ErrorMentions([&] { mha.forward(x, y, o); },
                            {"attn_bias", "[2 or 1, 2 or 1, 3, 3]", "[2, 2, 3, 4]"}));
  o.attn_bias = wrong_heads;
  EXPECT_TRUE(ErrorMentions([&] { mha.forward(x, y, o); }, {"attn_bias", "[2, 3, 3, 3]"}));
  EXPECT_TRUE(ErrorMentions([&] { mha.forward_cached(x, y, cache, o); }, {"attn_bias"}));
  o.attn_bias = per_head;  // an MoA bias has one head for every expert and slot
  EXPECT_TRUE(ErrorMentions([&] { moa.forward(x, y, o); }, {"attn_bias", "[2 or 1, 1, 3, 3]"}));
  const moh::Tensor4<Other> other(1, 1, 3, 3);
  o.attn_bias = other;
  EXPECT_TRUE(ErrorMentions([&] { mha.forward(x, y, o); }, {"attn_bias", "the layer's scalar type"}));
  ForwardOptions w;
  Tensor4<T> short_p(2, 2, 3, 2);
  w.attention_weights = short_p;
  EXPECT_TRUE(ErrorMentions([&] { mha.forward(x, y, w); },
                            {"attention_weights", "[2, 2, 3, 3]", "[2, 2, 3, 2]"}));
  Tensor4<T> moa_p(2, 3, 3, 3);  // MoA: top_k * num_kv_heads = 1 slot head
  w.attention_weights = moa_p;
  EXPECT_TRUE(ErrorMentions([&] { moa.forward(x, y, w); }, {"attention_weights", "[2, 1, 3, 3]"}));
}

}  // namespace
