// Tests for moh::MultiHeadAttention against the naive reference (docs/semantics.md §1 and §2): odd
// sizes, causal and padding masks, fully masked rows, cross-attention, grouped-query heads, RoPE, a
// sequence longer than one key block, thread-count independence, weights that must be set before
// a forward call, and the messages of bad input.
#include "moh/layers/multi_head_attention.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "layers/layer_test_support.hpp"
#include "reference/naive.hpp"
#include "test_helpers.hpp"

namespace {

using moh::MHAConfig;
using moh::MultiHeadAttention;
using namespace moh_test;  // the shared helpers, with layer_test_support.hpp's

/// The reference self-attention of x [B, T, D] with the masking `mk`.
template <class T>
Mat reference(const MultiHeadAttention<T>& m, const Tensor3<T>& x, const Masking& mk = {}) {
  const int B = static_cast<int>(x.dimension(0)), Tn = static_cast<int>(x.dimension(1));
  return moh_ref::naive_mha(weights_of(m), to_ref(x), B, Tn, mk.reference());
}

struct Shape {
  Index D, H, d;  // d = 0: D / H
};
// Head sizes 3, 5, 12 (not multiples of 8), one derived from D / H.
const std::vector<Shape> kShapes = {{9, 3, 3}, {10, 2, 5}, {12, 1, 0}, {7, 3, 5}};
const std::vector<Index> kTokens = {1, 3, 17};

template <class T>
using MhaTest = moh_test::ScalarTest<T>;
TYPED_TEST_SUITE(MhaTest, moh_test::Scalars);

TYPED_TEST(MhaTest, MatchesReferenceOverOddSizes) {
  using T = TypeParam;
  for (bool causal : {false, true})
    for (const Shape& s : kShapes)
      for (Index Tn : kTokens) {
        const MultiHeadAttention<T> m(mha_config(s.D, s.H, 0, s.d), 11 + s.D);
        const Tensor3<T> x = random_tensor<T>(2, Tn, s.D, 100 + Tn);
        const Masking mk{causal};
        EXPECT_LE(relative_error(run(m, x, mk.options()), reference(m, x, mk)), Tol<T>::rel)
            << "D=" << s.D << " H=" << s.H << " d=" << s.d << " T=" << Tn << " causal=" << causal;
      }
}

TYPED_TEST(MhaTest, KeyPaddingMatchesReference) {
  using T = TypeParam;
  const MultiHeadAttention<T> m(mha_config(10, 2, 0, 5), 3);
  const Tensor3<T> x = random_tensor<T>(3, 17, 10, 4);
  // Sequence 0: a few keys padded; sequence 1: none; sequence 2: every key.
  check_three_sequence_masks(
      m, x, three_sequence_padding(17, {0, 4, 5, 16}),
      [&](const Masking& mk) { return reference(m, x, mk); }, m.out_proj_bias(),
      {ComputeMode::Auto}, "MHA");
}

TYPED_TEST(MhaTest, AllPaddingWithoutBiasIsExactlyZero) {
  using T = TypeParam;
  const MultiHeadAttention<T> m(mha_config(6, 2, 0, 0, /*bias=*/false), 8);
  const Tensor3<T> x = random_tensor<T>(2, 3, 6, 9);
  const Mask pad = padding(2, 3, {{1, 0}, {1, 1}, {1, 2}});  // every key of sequence 1
  ForwardOptions o;
  o.key_padding_mask = moh::map_mask(pad);
  const Tensor3<T> y = run(m, x, o);
  for (Index i = 0; i < 3 * 6; ++i) {
    EXPECT_EQ(y.data()[3 * 6 + i], T(0)) << i;
    EXPECT_FALSE(std::isnan(y.data()[i]));
  }
  EXPECT_LE(relative_error(y, reference(m, x, Masking{false, &pad})), Tol<T>::rel);
}

TYPED_TEST(MhaTest, CrossAttentionMatchesReference) {
  using T = TypeParam;
  const MultiHeadAttention<T> m(mha_config(12, 4, 0, 3), 21);
  const Index B = 2;
  const std::vector<std::pair<Index, Index>> lengths = {{3, 17}, {17, 5}, {1, 3}, {3, 1}};
  for (auto [Tn, S] : lengths)
    for (bool causal : {false, true}) {
      const Tensor3<T> x = random_tensor<T>(B, Tn, 12, 30 + Tn);
      const Tensor3<T> mem = random_tensor<T>(B, S, 12, 40 + S);
      const Mask pad = padding(B, S, {{1, S - 1}});  // the last key of sequence 1
      const Masking mk{causal, &pad};
      const Tensor3<T> y = run_cross(m, x, mem, mk.options());
      const std::string where = "T=" + std::to_string(Tn) + " S=" + std::to_string(S) +
                                " causal=" + std::to_string(causal);
      EXPECT_LE(relative_error(y, moh_ref::naive_mha_cross(weights_of(m), to_ref(x), B, Tn,
                                                           to_ref(mem), S, mk.reference())),
                Tol<T>::rel)
          << where;
      // Bottom-right causal with S < T: query i sees keys j <= i + S - T, so the first T - S
      // queries of every sequence see nothing and output the bias.
      const Index unseeing = causal ? Tn - S : 0;
      expect_rows_are_bias(y, m.out_proj_bias(),
                           [unseeing](Index, Index i) { return i < unseeing; }, where);
    }
}

TYPED_TEST(MhaTest, GroupedQueryHeadsMatchReference) {
  using T = TypeParam;
  for (Index kv : {1, 2, 4}) {
    const MultiHeadAttention<T> m(mha_config(8, 4, kv, 3), 50 + kv);
    ASSERT_EQ(m.in_proj_weight().rows(), (4 + 2 * kv) * 3);
    const Tensor3<T> x = random_tensor<T>(2, 17, 8, 51);
    const Mask pad = padding(2, 17, {{0, 3}, {1, 16}});
    const Masking mk{true, &pad};
    EXPECT_LE(relative_error(run(m, x, mk.options()), reference(m, x, mk)), Tol<T>::rel)
        << "kv heads " << kv;
  }
}

TYPED_TEST(MhaTest, RopeMatchesReference) {
  using T = TypeParam;
  MHAConfig c = mha_config(10, 4, 2, 6, true, /*rope=*/true);
  c.rope_theta = 500.0;
  const MultiHeadAttention<T> m(c, 60);
  for (Index Tn : kTokens)
    for (int offset : {0, 5}) {
      const Tensor3<T> x = random_tensor<T>(2, Tn, 10, 61 + Tn);
      const Masking mk{true, nullptr, offset};
      EXPECT_LE(relative_error(run(m, x, mk.options()), reference(m, x, mk)), Tol<T>::rel)
          << "T=" << Tn << " offset=" << offset;
    }
  // RoPE must matter: the same weights without it give a different output.
  MHAConfig plain = c;
  plain.rope = false;
  MultiHeadAttention<T> no_rope(plain);
  no_rope.set_in_proj_weight(m.in_proj_weight());
  no_rope.set_in_proj_bias(m.in_proj_bias());
  no_rope.set_out_proj_weight(m.out_proj_weight());
  no_rope.set_out_proj_bias(m.out_proj_bias());
  const Tensor3<T> x = random_tensor<T>(1, 17, 10, 62);
  EXPECT_GT(relative_error(run(m, x), to_ref(run(no_rope, x))), 1e-3);
}

TYPED_TEST(MhaTest, NoBiasMatchesReference) {
  using T = TypeParam;
  const MultiHeadAttention<T> m(mha_config(9, 3, 0, 0, /*bias=*/false), 70);
  EXPECT_EQ(m.in_proj_bias().size(), 0);
  EXPECT_EQ(m.out_proj_bias().size(), 0);
  const Tensor3<T> x = random_tensor<T>(3, 3, 9, 71);
  EXPECT_LE(relative_error(run(m, x), reference(m, x)), Tol<T>::rel);
}

// 300 keys span two blocks of the tiled kernel (online softmax across blocks).
TYPED_TEST(MhaTest, LongSequenceMatchesReference) {
  using T = TypeParam;
  const MultiHeadAttention<T> m(mha_config(10, 2, 0, 5), 80);
  const Index Tn = 300;
  const Tensor3<T> x = random_tensor<T>(1, Tn, 10, 81, 2.0);
  const Mask pad = padding(1, Tn, {{0, 0}, {0, 1}, {0, 2}, {0, 200}, {0, 256}, {0, 299}});
  const Masking mk{true, &pad};
  EXPECT_LE(relative_error(run(m, x, mk.options()), reference(m, x, mk)), Tol<T>::rel);
}

// Large scores: the softmax must subtract the row max. Scores reach 18 * 36 = 648 here, and
// exp of an unshifted score overflows float from 89 on.
TYPED_TEST(MhaTest, LargeScoresStayFiniteAndMatch) {
  using T = TypeParam;
  MultiHeadAttention<T> m(mha_config(4, 1, 0, 0, /*bias=*/false));
  // W_q = W_k = 6 I, W_v = I, W_out = I: scores = 36 x_i.x_j / 2, up to ~ 18 * |x|^2.
  moh::Matrix<T> w_in = moh::Matrix<T>::Zero(12, 4);
  for (Index i = 0; i < 4; ++i) {
    w_in(i, i) = T(6);
    w_in(4 + i, i) = T(6);
    w_in(8 + i, i) = T(1);
  }
  m.set_in_proj_weight(w_in);
  m.set_out_proj_weight(moh::Matrix<T>::Identity(4, 4));
  const Tensor3<T> x = random_tensor<T>(1, 17, 4, 90, 3.0);
  const Tensor3<T> y = run(m, x);
  for (Index i = 0; i < y.size(); ++i) ASSERT_TRUE(std::isfinite(y.data()[i])) << i;
  // Near one-hot softmax amplifies the float rounding of the scores: 10x the usual bound.
  EXPECT_LE(relative_error(y, reference(m, x)), 10 * Tol<T>::rel);
}

TYPED_TEST(MhaTest, SequencesOfABatchAreIndependent) {
  using T = TypeParam;
  const MultiHeadAttention<T> m(mha_config(10, 2, 0, 5), 95);
  const Tensor3<T> x = random_tensor<T>(3, 17, 10, 96);
  ForwardOptions o;
  o.causal = moh::Causal::On;
  const Tensor3<T> y = run(m, x, o);
  for (Index b = 0; b < 3; ++b) {
    Tensor3<T> xb(1, 17, 10);
    std::memcpy(xb.data(), x.data() + b * 170, 170 * sizeof(T));
    const Tensor3<T> yb = run(m, xb, o);
    Mat slice = to_ref(y).middleRows(b * 17, 17);
    EXPECT_LE(relative_error(yb, slice), Tol<T>::rel) << "sequence " << b;
  }
}

TYPED_TEST(MhaTest, CallOperatorEqualsForward) {
  using T = TypeParam;
  const MultiHeadAttention<T> m(mha_config(6, 3), 97);
  const Tensor3<T> x = random_tensor<T>(2, 3, 6, 98);
  const Tensor3<T> a = m(x), b = run(m, x);
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(T)), 0);
}

// Results must not depend on the number of threads (docs/semantics.md §1): bitwise, for self- and
// cross-attention, on sizes large enough to split every stage into several tasks.
TYPED_TEST(MhaTest, ThreadCountDoesNotChangeBits) {
  using T = TypeParam;
  const MultiHeadAttention<T> m(mha_config(20, 4, 2, 5), 99);
  const Tensor3<T> x = random_tensor<T>(2, 150, 20, 100);
  const Tensor3<T> mem = random_tensor<T>(2, 70, 20, 101);
  const Mask pad = padding(2, 150, {{1, 7}}), mpad = padding(2, 70, {{0, 69}});
  const ForwardOptions o = Masking{true, &pad}.options();
  ForwardOptions oc;
  oc.key_padding_mask = moh::map_mask(mpad);
  moh_test::expect_same_bits_for_any_thread_count(
      [&](moh::ThreadPool* pool) {
        ForwardOptions mine = o;
        mine.pool = pool;
        return run(m, x, mine);
      },
      "self");
  moh_test::expect_same_bits_for_any_thread_count(
      [&](moh::ThreadPool* pool) {
        ForwardOptions mine = oc;
        mine.pool = pool;
        return run_cross(m, x, mem, mine);
      },
      "cross");
}

// ---- weights ------------------------------------------------------------------------------------

// A layer built from its config alone has no weights: every forward entry point refuses to run,
// naming the tensors still unset, until the typed setters have set all of them.
TEST(MhaWeights, UnsetWeightsAreNamedUntilEverySetterRan) {
  const MHAConfig c = mha_config(10, 2, 0, 5);  // with biases
  const MultiHeadAttention<float> seeded(c, 5);
  MultiHeadAttention<float> m(c);
  EXPECT_FALSE(m.weights_set());
  const Tensor3<float> x = random_tensor<float>(2, 3, 10, 6);
  Tensor3<float> y(2, 3, 10);
  moh::KvCache<float> cache = m.make_cache(2, 3);
  const std::vector<std::string> all = {"MultiHeadAttention", "weights not set",
                                        "[in_proj_weight, in_proj_bias, out_proj.weight, "
                                        "out_proj.bias]"};
  EXPECT_TRUE(EveryEntryPointRefuses(m, x, y, cache, all));
  EXPECT_TRUE(ErrorMentions([&] { (void)m(x); }, all));
  EXPECT_EQ(cache.length(), 0);

  m.set_in_proj_weight(seeded.in_proj_weight());
  m.set_out_proj_bias(seeded.out_proj_bias());
  EXPECT_FALSE(m.weights_set());
  const std::string msg = error_of([&] { m.forward(x, y); });
  EXPECT_TRUE(Mentions(msg, {"weights not set: [in_proj_bias, out_proj.weight]"})) << msg;
  EXPECT_EQ(msg.find("in_proj_weight"), std::string::npos) << msg;

  m.set_in_proj_bias(seeded.in_proj_bias());
  m.set_out_proj_weight(seeded.out_proj_weight());
  EXPECT_TRUE(m.weights_set());
  EXPECT_NO_THROW(m.forward(x, y));
  EXPECT_TRUE(moh_test::BitEqual(y, seeded(x)));
  EXPECT_NO_THROW(m.forward_cached(x, y, cache));
  EXPECT_EQ(cache.length(), 3);
}

TEST(MhaWeights, WithoutBiasOnlyTheTwoMatricesAreNeeded) {
  const MHAConfig c = mha_config(9, 3, 0, 0, /*bias=*/false);
  MultiHeadAttention<double> m(c);
  const Tensor3<double> x = random_tensor<double>(1, 3, 9, 7);
  Tensor3<double> y(1, 3, 9);
  EXPECT_TRUE(ErrorMentions([&] { m.forward(x, y); },
                            {"weights not set: [in_proj_weight, out_proj.weight]"}));
  const MultiHeadAttention<double> seeded(c, 8);
  m.set_in_proj_weight(seeded.in_proj_weight());
  m.set_out_proj_weight(seeded.out_proj_weight());
  EXPECT_TRUE(m.weights_set());
  m.forward(x, y);
  EXPECT_LE(relative_error(y, reference(seeded, x)), Tol<double>::rel);
}

// moh::zero_weights builds a layer whose every weight and bias is 0, so every output is exactly
// 0.
TYPED_TEST(MhaTest, ZeroWeightsGiveZeroOutput) {
  using T = TypeParam;
  const MultiHeadAttention<T> m(mha_config(10, 2, 1, 5), moh::zero_weights);
  EXPECT_TRUE(m.weights_set());
  EXPECT_TRUE(m.in_proj_weight().isZero());
  EXPECT_TRUE(m.in_proj_bias().isZero());
  EXPECT_TRUE(m.out_proj_weight().isZero());
  EXPECT_TRUE(m.out_proj_bias().isZero());
  EXPECT_EQ(m.in_proj_bias().size(), (2 + 2 * 1) * 5);
  const Tensor3<T> x = random_tensor<T>(2, 17, 10, 9);
  const Tensor3<T> y = run(m, x);
  for (Index i = 0; i < y.size(); ++i) ASSERT_EQ(y.data()[i], T(0)) << i;
}

// ---- bad input ----------------------------------------------------------------------------------

TEST(MhaErrors, ImpossibleConfigsNameExpectedAndActual) {
  // {embed_dim, num_heads, num_kv_heads, rope} and what the message must say.
  struct Case {
    Index D, H, kv;
    bool rope;
    std::vector<std::string> parts;
  };
  const Case cases[] = {{8, 4, 3, false, {"divisor of 4", "got 3"}},
                        {10, 4, 0, false, {"multiple of 4", "got 10"}},
                        {10, 2, 0, true, {"even", "got 5"}},  // head_dim 5
                        {0, 2, 0, false, {"embed_dim", "> 0", "got 0"}}};
  for (const Case& k : cases) {
    const MHAConfig c = mha_config(k.D, k.H, k.kv, 0, true, k.rope);
    EXPECT_TRUE(ErrorMentions([&] { MultiHeadAttention<float> m(c); }, k.parts));
  }
  MHAConfig zero;
  zero.embed_dim = 4;
  EXPECT_TRUE(ErrorMentions([&] { zero.validate(); }, {"num_heads", "> 0", "got 0"}));
}

TEST(MhaErrors, MismatchedShapesNameBoth) {
  const MultiHeadAttention<float> m(mha_config(8, 2), 1);
  // y [2, 4, 8] for x [2, 3, 8]; a key padding mask [2, 4].
  expect_mismatched_shapes_named(m, 2, 4, 2, 4, {ComputeMode::Auto});

  const Tensor3<float> x7 = random_tensor<float>(2, 3, 7, 2);
  Tensor3<float> y7(2, 3, 7);
  EXPECT_TRUE(ErrorMentions([&] { m.forward(x7, y7); }, {"8", "[2, 3, 7]"}));

  const Tensor3<float> x = random_tensor<float>(2, 3, 8, 2);
  Tensor3<float> y3(2, 3, 8);
  const Tensor3<float> mem = random_tensor<float>(3, 5, 8, 2);
  EXPECT_TRUE(ErrorMentions([&] { m.forward_cross(x, mem, y3); },
                            {"memory", "[2, *, 8]", "[3, 5, 8]"}));
}

TEST(MhaErrors, SettersCheckShapes) {
  // in_proj [(4 + 2 * 2) 3, 8] = [24, 8], out_proj [8, 12].
  MultiHeadAttention<double> m(mha_config(8, 4, 2, 3));
  using M = moh::Matrix<double>;
  using V = moh::Vector<double>;
  EXPECT_TRUE(ErrorMentions([&] { m.set_in_proj_weight(M::Zero(25, 8)); }, {"[24, 8]", "[25, 8]"}));
  EXPECT_TRUE(ErrorMentions([&] { m.set_out_proj_weight(M::Zero(8, 8)); }, {"[8, 12]", "[8, 8]"}));
  EXPECT_TRUE(ErrorMentions([&] { m.set_in_proj_bias(V::Zero(23)); }, {"[24]", "[23]"}));
  EXPECT_TRUE(ErrorMentions([&] { m.set_out_proj_bias(V::Zero(9)); }, {"[8]", "[9]"}));
  // The right shapes are accepted.
  EXPECT_NO_THROW(m.set_in_proj_weight(M::Zero(24, 8)));
}

}  // namespace
