// Tests for moh::MultiHeadAttention against the naive reference (SEMANTICS 1 and 2): odd sizes,
// causal and padding masks, fully masked rows, cross-attention, grouped-query heads, RoPE, a
// sequence longer than one key block, thread-count independence and the messages of bad input.
#include "moh/multi_head_attention.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "reference/naive.hpp"

namespace {

using moh::ForwardOptions;
using moh::Index;
using moh::Mask;
using moh::MhaConfig;
using moh::MultiHeadAttention;
using moh::Tensor3;
using moh_ref::Mat;
using moh_ref::relative_error;
using moh_ref::to_ref;

template <class T>
moh_ref::MhaWeights weights_of(const MultiHeadAttention<T>& m) {
  moh_ref::MhaWeights w;
  w.D = static_cast<int>(m.embed_dim());
  w.H = static_cast<int>(m.num_heads());
  w.d = static_cast<int>(m.head_dim());
  w.Hkv = static_cast<int>(m.num_kv_heads());
  w.W_in = to_ref(m.in_proj_weight());
  w.b_in = to_ref(m.in_proj_bias());
  w.W_out = to_ref(m.out_proj_weight());
  w.b_out = to_ref(m.out_proj_bias());
  w.rope = m.config().rope;
  w.rope_base = m.config().rope_base;
  return w;
}

template <class T>
Tensor3<T> run(const MultiHeadAttention<T>& m, const Tensor3<T>& x, const ForwardOptions& o) {
  Tensor3<T> y(x.dimension(0), x.dimension(1), m.embed_dim());
  m.forward(x, y, o);
  return y;
}

template <class T>
Tensor3<T> run_cross(const MultiHeadAttention<T>& m, const Tensor3<T>& x, const Tensor3<T>& mem,
                     const ForwardOptions& o) {
  Tensor3<T> y(x.dimension(0), x.dimension(1), m.embed_dim());
  m.forward_cross(x, mem, y, o);
  return y;
}

/// Row r of y (as [B*T, D] rows) equals the output bias exactly (or zero without bias).
template <class T>
bool row_is_out_bias(const MultiHeadAttention<T>& m, const Tensor3<T>& y, Index r) {
  const Index D = y.dimension(2);
  for (Index c = 0; c < D; ++c) {
    const T want = m.out_proj_bias().size() ? m.out_proj_bias()(c) : T(0);
    if (!(y.data()[r * D + c] == want)) return false;
  }
  return true;
}

struct Shape {
  Index D, H, d;  // d = 0: D / H
};
// Head sizes 3, 5, 12 (not multiples of 8), one derived from D / H.
const std::vector<Shape> kShapes = {{9, 3, 3}, {10, 2, 5}, {12, 1, 0}, {7, 3, 5}};
const std::vector<Index> kTokens = {1, 3, 17};

template <class T>
class MhaTest : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(MhaTest, Scalars);

TYPED_TEST(MhaTest, MatchesReferenceOverOddSizes) {
  using T = TypeParam;
  for (bool causal : {false, true})
    for (const Shape& s : kShapes)
      for (Index Tn : kTokens) {
        MhaConfig c;
        c.embed_dim = s.D;
        c.num_heads = s.H;
        c.head_dim = s.d;
        const MultiHeadAttention<T> m(c, 11 + s.D);
        const Tensor3<T> x = moh_ref::random_tensor<T>(2, Tn, s.D, 100 + Tn);
        ForwardOptions o;
        o.causal = causal;
        moh_ref::AttnOptions ro;
        ro.causal = causal;
        EXPECT_LE(relative_error(run(m, x, o), moh_ref::naive_mha(weights_of(m), to_ref(x), 2,
                                                                   static_cast<int>(Tn), ro)),
                  moh_ref::Tol<T>::rel)
            << "D=" << s.D << " H=" << s.H << " d=" << s.d << " T=" << Tn << " causal=" << causal;
      }
}

TYPED_TEST(MhaTest, KeyPaddingMatchesReference) {
  using T = TypeParam;
  MhaConfig c;
  c.embed_dim = 10;
  c.num_heads = 2;
  c.head_dim = 5;
  const MultiHeadAttention<T> m(c, 3);
  const Index B = 3, Tn = 17;
  const Tensor3<T> x = moh_ref::random_tensor<T>(B, Tn, c.embed_dim, 4);
  // Sequence 0: a few keys padded; sequence 1: none; sequence 2: every key.
  Mask pad = moh_ref::no_padding(B, Tn);
  for (Index s : {0, 4, 5, 16}) pad(0, s) = true;
  for (Index s = 0; s < Tn; ++s) pad(2, s) = true;
  for (bool causal : {false, true}) {
    ForwardOptions o;
    o.causal = causal;
    o.key_padding_mask = moh::map_mask(pad);
    moh_ref::AttnOptions ro;
    ro.causal = causal;
    ro.pad = to_ref(pad);
    const Tensor3<T> y = run(m, x, o);
    EXPECT_LE(relative_error(y, moh_ref::naive_mha(weights_of(m), to_ref(x), B, Tn, ro)),
              moh_ref::Tol<T>::rel)
        << "causal=" << causal;
    for (Index t = 0; t < Tn; ++t)
      EXPECT_TRUE(row_is_out_bias(m, y, 2 * Tn + t)) << "all-padding sequence, token " << t;
    // Causal: query 0 of sequence 0 sees only key 0, which is padding -> output is the bias.
    if (causal) {
      EXPECT_TRUE(row_is_out_bias(m, y, 0));
    }
  }
}

TYPED_TEST(MhaTest, AllPaddingWithoutBiasIsExactlyZero) {
  using T = TypeParam;
  MhaConfig c;
  c.embed_dim = 6;
  c.num_heads = 2;
  c.bias = false;
  const MultiHeadAttention<T> m(c, 8);
  const Tensor3<T> x = moh_ref::random_tensor<T>(2, 3, 6, 9);
  Mask pad = moh_ref::no_padding(2, 3);
  for (Index s = 0; s < 3; ++s) pad(1, s) = true;
  ForwardOptions o;
  o.key_padding_mask = moh::map_mask(pad);
  const Tensor3<T> y = run(m, x, o);
  for (Index i = 0; i < 3 * 6; ++i) {
    EXPECT_EQ(y.data()[3 * 6 + i], T(0)) << i;
    EXPECT_FALSE(std::isnan(y.data()[i]));
  }
  moh_ref::AttnOptions ro;
  ro.pad = to_ref(pad);
  EXPECT_LE(relative_error(y, moh_ref::naive_mha(weights_of(m), to_ref(x), 2, 3, ro)),
            moh_ref::Tol<T>::rel);
}

TYPED_TEST(MhaTest, CrossAttentionMatchesReference) {
  using T = TypeParam;
  MhaConfig c;
  c.embed_dim = 12;
  c.num_heads = 4;
  c.head_dim = 3;
  const MultiHeadAttention<T> m(c, 21);
  const Index B = 2;
  const std::vector<std::pair<Index, Index>> lengths = {{3, 17}, {17, 5}, {1, 3}, {3, 1}};
  for (auto [Tn, S] : lengths)
    for (bool causal : {false, true}) {
      const Tensor3<T> x = moh_ref::random_tensor<T>(B, Tn, 12, 30 + Tn);
      const Tensor3<T> mem = moh_ref::random_tensor<T>(B, S, 12, 40 + S);
      Mask pad = moh_ref::no_padding(B, S);
      pad(1, S - 1) = true;  // the last key of sequence 1
      ForwardOptions o;
      o.causal = causal;
      o.key_padding_mask = moh::map_mask(pad);
      moh_ref::AttnOptions ro;
      ro.causal = causal;
      ro.pad = to_ref(pad);
      const Tensor3<T> y = run_cross(m, x, mem, o);
      EXPECT_LE(relative_error(y, moh_ref::naive_mha_cross(weights_of(m), to_ref(x), B, Tn,
                                                           to_ref(mem), S, ro)),
                moh_ref::Tol<T>::rel)
          << "T=" << Tn << " S=" << S << " causal=" << causal;
      // Bottom-right causal with S < T: query i sees keys j <= i + S - T, so the first T - S
      // queries of every sequence see nothing and output the bias.
      if (causal) {
        for (Index b = 0; b < B; ++b)
          for (Index i = 0; i < Tn - S; ++i)
            EXPECT_TRUE(row_is_out_bias(m, y, b * Tn + i)) << "T=" << Tn << " S=" << S;
      }
    }
}

TYPED_TEST(MhaTest, GroupedQueryHeadsMatchReference) {
  using T = TypeParam;
  for (Index kv : {1, 2, 4}) {
    MhaConfig c;
    c.embed_dim = 8;
    c.num_heads = 4;
    c.head_dim = 3;
    c.num_kv_heads = kv;
    const MultiHeadAttention<T> m(c, 50 + kv);
    ASSERT_EQ(m.in_proj_weight().rows(), (4 + 2 * kv) * 3);
    const Tensor3<T> x = moh_ref::random_tensor<T>(2, 17, 8, 51);
    Mask pad = moh_ref::no_padding(2, 17);
    pad(0, 3) = pad(1, 16) = true;
    ForwardOptions o;
    o.causal = true;
    o.key_padding_mask = moh::map_mask(pad);
    moh_ref::AttnOptions ro;
    ro.causal = true;
    ro.pad = to_ref(pad);
    EXPECT_LE(relative_error(run(m, x, o), moh_ref::naive_mha(weights_of(m), to_ref(x), 2, 17, ro)),
              moh_ref::Tol<T>::rel)
        << "kv heads " << kv;
  }
}

TYPED_TEST(MhaTest, RopeMatchesReference) {
  using T = TypeParam;
  MhaConfig c;
  c.embed_dim = 10;
  c.num_heads = 4;
  c.head_dim = 6;
  c.num_kv_heads = 2;
  c.rope = true;
  c.rope_base = 500.0;
  const MultiHeadAttention<T> m(c, 60);
  for (Index Tn : kTokens)
    for (int offset : {0, 5}) {
      const Tensor3<T> x = moh_ref::random_tensor<T>(2, Tn, 10, 61 + Tn);
      ForwardOptions o;
      o.causal = true;
      o.position_offset = offset;
      moh_ref::AttnOptions ro;
      ro.causal = true;
      ro.position_offset = offset;
      const Mat want = moh_ref::naive_mha(weights_of(m), to_ref(x), 2, static_cast<int>(Tn), ro);
      EXPECT_LE(relative_error(run(m, x, o), want), moh_ref::Tol<T>::rel)
          << "T=" << Tn << " offset=" << offset;
    }
  // RoPE must matter: the same weights without it give a different output.
  MhaConfig plain = c;
  plain.rope = false;
  MultiHeadAttention<T> no_rope(plain);
  no_rope.set_in_proj_weight(m.in_proj_weight());
  no_rope.set_in_proj_bias(m.in_proj_bias());
  no_rope.set_out_proj_weight(m.out_proj_weight());
  no_rope.set_out_proj_bias(m.out_proj_bias());
  const Tensor3<T> x = moh_ref::random_tensor<T>(1, 17, 10, 62);
  EXPECT_GT(relative_error(run(m, x, {}), to_ref(run(no_rope, x, {}))), 1e-3);
}

TYPED_TEST(MhaTest, NoBiasMatchesReference) {
  using T = TypeParam;
  MhaConfig c;
  c.embed_dim = 9;
  c.num_heads = 3;
  c.bias = false;
  const MultiHeadAttention<T> m(c, 70);
  EXPECT_EQ(m.in_proj_bias().size(), 0);
  EXPECT_EQ(m.out_proj_bias().size(), 0);
  const Tensor3<T> x = moh_ref::random_tensor<T>(3, 3, 9, 71);
  EXPECT_LE(relative_error(run(m, x, {}), moh_ref::naive_mha(weights_of(m), to_ref(x), 3, 3, {})),
            moh_ref::Tol<T>::rel);
}

// 300 keys span two blocks of the tiled kernel (online softmax across blocks).
TYPED_TEST(MhaTest, LongSequenceMatchesReference) {
  using T = TypeParam;
  MhaConfig c;
  c.embed_dim = 10;
  c.num_heads = 2;
  c.head_dim = 5;
  const MultiHeadAttention<T> m(c, 80);
  const Index Tn = 300;
  const Tensor3<T> x = moh_ref::random_tensor<T>(1, Tn, 10, 81, 2.0);
  Mask pad = moh_ref::no_padding(1, Tn);
  for (Index s : {0, 1, 2, 200, 256, 299}) pad(0, s) = true;
  ForwardOptions o;
  o.causal = true;
  o.key_padding_mask = moh::map_mask(pad);
  moh_ref::AttnOptions ro;
  ro.causal = true;
  ro.pad = to_ref(pad);
  EXPECT_LE(relative_error(run(m, x, o), moh_ref::naive_mha(weights_of(m), to_ref(x), 1, Tn, ro)),
            moh_ref::Tol<T>::rel);
}

// Large scores: the softmax must subtract the row max. Scores reach 18 * 36 = 648 here, and
// exp of an unshifted score overflows float from 89 on.
TYPED_TEST(MhaTest, LargeScoresStayFiniteAndMatch) {
  using T = TypeParam;
  MhaConfig c;
  c.embed_dim = 4;
  c.num_heads = 1;
  c.bias = false;
  MultiHeadAttention<T> m(c);
  // W_q = W_k = 6 I, W_v = I, W_out = I: scores = 36 x_i.x_j / 2, up to ~ 18 * |x|^2.
  moh::Matrix<T> w_in = moh::Matrix<T>::Zero(12, 4);
  for (Index i = 0; i < 4; ++i) {
    w_in(i, i) = T(6);
    w_in(4 + i, i) = T(6);
    w_in(8 + i, i) = T(1);
  }
  m.set_in_proj_weight(w_in);
  m.set_out_proj_weight(moh::Matrix<T>::Identity(4, 4));
  const Tensor3<T> x = moh_ref::random_tensor<T>(1, 17, 4, 90, 3.0);
  const Tensor3<T> y = run(m, x, {});
  for (Index i = 0; i < y.size(); ++i) ASSERT_TRUE(std::isfinite(y.data()[i])) << i;
  // Near one-hot softmax amplifies the float rounding of the scores: 10x the usual bound.
  EXPECT_LE(relative_error(y, moh_ref::naive_mha(weights_of(m), to_ref(x), 1, 17, {})),
            10 * moh_ref::Tol<T>::rel);
}

TYPED_TEST(MhaTest, SequencesOfABatchAreIndependent) {
  using T = TypeParam;
  MhaConfig c;
  c.embed_dim = 10;
  c.num_heads = 2;
  c.head_dim = 5;
  const MultiHeadAttention<T> m(c, 95);
  const Tensor3<T> x = moh_ref::random_tensor<T>(3, 17, 10, 96);
  ForwardOptions o;
  o.causal = true;
  const Tensor3<T> y = run(m, x, o);
  for (Index b = 0; b < 3; ++b) {
    Tensor3<T> xb(1, 17, 10);
    std::memcpy(xb.data(), x.data() + b * 170, 170 * sizeof(T));
    const Tensor3<T> yb = run(m, xb, o);
    Mat slice = to_ref(y).middleRows(b * 17, 17);
    EXPECT_LE(relative_error(yb, slice), moh_ref::Tol<T>::rel) << "sequence " << b;
  }
}

TYPED_TEST(MhaTest, CallOperatorEqualsForward) {
  using T = TypeParam;
  MhaConfig c;
  c.embed_dim = 6;
  c.num_heads = 3;
  const MultiHeadAttention<T> m(c, 97);
  const Tensor3<T> x = moh_ref::random_tensor<T>(2, 3, 6, 98);
  const Tensor3<T> a = m(x), b = run(m, x, {});
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(T)), 0);
}

// Results must not depend on the number of threads (SEMANTICS 1): bitwise, for self- and
// cross-attention, on sizes large enough to split every stage into several tasks.
TYPED_TEST(MhaTest, ThreadCountDoesNotChangeBits) {
  using T = TypeParam;
  MhaConfig c;
  c.embed_dim = 20;
  c.num_heads = 4;
  c.head_dim = 5;
  c.num_kv_heads = 2;
  c.rope = false;
  const MultiHeadAttention<T> m(c, 99);
  const Tensor3<T> x = moh_ref::random_tensor<T>(2, 150, 20, 100);
  const Tensor3<T> mem = moh_ref::random_tensor<T>(2, 70, 20, 101);
  Mask pad = moh_ref::no_padding(2, 150), mpad = moh_ref::no_padding(2, 70);
  pad(1, 7) = mpad(0, 69) = true;
  ForwardOptions o;
  o.causal = true;
  o.key_padding_mask = moh::map_mask(pad);
  ForwardOptions oc;
  oc.key_padding_mask = moh::map_mask(mpad);
  const Tensor3<T> base = run(m, x, o), base_cross = run_cross(m, x, mem, oc);
  for (int threads : {1, 2, 3}) {
    moh::ThreadPool pool(threads);
    o.pool = oc.pool = &pool;
    const Tensor3<T> y = run(m, x, o), yc = run_cross(m, x, mem, oc);
    EXPECT_EQ(std::memcmp(y.data(), base.data(), y.size() * sizeof(T)), 0) << threads;
    EXPECT_EQ(std::memcmp(yc.data(), base_cross.data(), yc.size() * sizeof(T)), 0) << threads;
  }
}

// ---- bad input ----------------------------------------------------------------------------------

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

TEST(MhaErrors, ImpossibleConfigsNameExpectedAndActual) {
  MhaConfig c;
  c.embed_dim = 8;
  c.num_heads = 4;
  c.num_kv_heads = 3;
  std::string msg = moh_ref::error_of([&] { MultiHeadAttention<float> m(c); });
  EXPECT_TRUE(contains(msg, "divisor of 4") && contains(msg, "got 3")) << msg;

  c.num_kv_heads = 0;
  c.embed_dim = 10;
  msg = moh_ref::error_of([&] { MultiHeadAttention<float> m(c); });
  EXPECT_TRUE(contains(msg, "multiple of 4") && contains(msg, "got 10")) << msg;

  c.embed_dim = 10;
  c.num_heads = 2;
  c.rope = true;  // head_dim 5
  msg = moh_ref::error_of([&] { MultiHeadAttention<float> m(c); });
  EXPECT_TRUE(contains(msg, "even") && contains(msg, "got 5")) << msg;

  MhaConfig zero;
  zero.num_heads = 2;
  msg = moh_ref::error_of([&] { MultiHeadAttention<float> m(zero); });
  EXPECT_TRUE(contains(msg, "embed_dim") && contains(msg, "> 0") && contains(msg, "got 0")) << msg;
  zero.embed_dim = 4;
  zero.num_heads = 0;
  msg = moh_ref::error_of([&] { zero.validate(); });
  EXPECT_TRUE(contains(msg, "num_heads") && contains(msg, "> 0") && contains(msg, "got 0")) << msg;
}

TEST(MhaErrors, MismatchedShapesNameBoth) {
  MhaConfig c;
  c.embed_dim = 8;
  c.num_heads = 2;
  const MultiHeadAttention<float> m(c, 1);
  const Tensor3<float> x = moh_ref::random_tensor<float>(2, 3, 8, 2);
  Tensor3<float> y(2, 4, 8);
  std::string msg = moh_ref::error_of([&] { m.forward(x, y); });
  EXPECT_TRUE(contains(msg, "[2, 3, 8]") && contains(msg, "[2, 4, 8]")) << msg;

  const Tensor3<float> x7 = moh_ref::random_tensor<float>(2, 3, 7, 2);
  Tensor3<float> y7(2, 3, 7);
  msg = moh_ref::error_of([&] { m.forward(x7, y7); });
  EXPECT_TRUE(contains(msg, "8") && contains(msg, "[2, 3, 7]")) << msg;

  Tensor3<float> y3(2, 3, 8);
  const Tensor3<float> mem = moh_ref::random_tensor<float>(3, 5, 8, 2);
  msg = moh_ref::error_of([&] { m.forward_cross(x, mem, y3); });
  EXPECT_TRUE(contains(msg, "memory") && contains(msg, "[2, *, 8]") && contains(msg, "[3, 5, 8]"))
      << msg;

  Mask pad = moh_ref::no_padding(2, 4);
  ForwardOptions o;
  o.key_padding_mask = moh::map_mask(pad);
  msg = moh_ref::error_of([&] { m.forward(x, y3, o); });
  EXPECT_TRUE(contains(msg, "[2, 3]") && contains(msg, "[2, 4]")) << msg;
}

TEST(MhaErrors, SettersCheckShapes) {
  MhaConfig c;
  c.embed_dim = 8;
  c.num_heads = 4;
  c.head_dim = 3;
  c.num_kv_heads = 2;  // in_proj [(4 + 4) 3, 8] = [24, 8], out_proj [8, 12]
  MultiHeadAttention<double> m(c);
  using M = moh::Matrix<double>;
  std::string msg = moh_ref::error_of([&] { m.set_in_proj_weight(M::Zero(25, 8)); });
  EXPECT_TRUE(contains(msg, "[24, 8]") && contains(msg, "[25, 8]")) << msg;
  msg = moh_ref::error_of([&] { m.set_out_proj_weight(M::Zero(8, 8)); });
  EXPECT_TRUE(contains(msg, "[8, 12]") && contains(msg, "[8, 8]")) << msg;
  msg = moh_ref::error_of([&] { m.set_in_proj_bias(moh::Vector<double>::Zero(23)); });
  EXPECT_TRUE(contains(msg, "[24]") && contains(msg, "[23]")) << msg;
  msg = moh_ref::error_of([&] { m.set_out_proj_bias(moh::Vector<double>::Zero(9)); });
  EXPECT_TRUE(contains(msg, "[8]") && contains(msg, "[9]")) << msg;
  // The right shapes are accepted.
  EXPECT_EQ(moh_ref::error_of([&] { m.set_in_proj_weight(M::Zero(24, 8)); }), "<no moh::Error>");
}

}  // namespace
