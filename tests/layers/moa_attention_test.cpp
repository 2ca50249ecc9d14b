// Tests for moh::MoAAttention against the naive reference (docs/semantics.md §5): both compute
// modes over odd sizes and (E, k) combinations, masks, cross-attention, k = E as a gate-weighted
// sum of every expert, the JetMoE gating option, thread-count independence, weights that must be
// set before a forward call, and the messages of bad input.
#include "moh/layers/moa_attention.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "layers/layer_test_support.hpp"
#include "reference/naive.hpp"
#include "test_helpers.hpp"

namespace {

using moh::MoAAttention;
using moh::MoAConfig;
using moh::MoAGating;
using moh::MoARouting;
using namespace moh_test;  // the shared helpers, with layer_test_support.hpp's

template <class T>
Mat reference(const MoAAttention<T>& m, const Tensor3<T>& x, const moh_ref::AttnOptions& o,
              moh_ref::MoARoute* route = nullptr) {
  const int B = static_cast<int>(x.dimension(0)), Tn = static_cast<int>(x.dimension(1));
  return moh_ref::naive_moa(weights_of(m), to_ref(x), B, Tn, to_ref(x), Tn, o, route);
}

struct Experts {
  Index E, k;
};
const std::vector<Experts> kExperts = {{4, 1}, {4, 2}, {3, 3}, {5, 2}, {1, 1}};

template <class T>
using MoATest = moh_test::ScalarTest<T>;
TYPED_TEST_SUITE(MoATest, moh_test::Scalars);

/// MoA has no output bias: a query that sees no key outputs zeros.
template <class T>
const moh::Vector<T> kNoBias = moh::Vector<T>();

TYPED_TEST(MoATest, MatchesReferenceOverOddSizesInBothModes) {
  using T = TypeParam;
  const Index D = 7;
  for (const Experts& ek : kExperts)
    for (Index d : {3, 5, 12})
      for (Index Tn : {1, 3, 17}) {
        const MoAAttention<T> m(moa_config(D, d, ek.E, ek.k), 100 * ek.E + 10 * ek.k + d);
        const Tensor3<T> x = random_tensor<T>(2, Tn, D, Tn + d);
        moh_ref::MoARoute route;
        const Mat want = reference(m, x, {}, &route);
        for (ComputeMode mode : kModes) {
          MoARouting<T> r;
          EXPECT_LE(relative_error(run(m, x, in_mode(mode), &r), want), Tol<T>::rel)
              << "E=" << ek.E << " k=" << ek.k << " d=" << d << " T=" << Tn << " "
              << mode_name(mode);
          EXPECT_LE(relative_error(to_ref(r.gates), route.gates), Tol<T>::rel);
          EXPECT_NEAR(r.switch_loss, route.switch_loss, Tol<T>::rel * route.switch_loss);
          EXPECT_NEAR(r.z_loss, route.z_loss, Tol<T>::rel * std::max(1.0, route.z_loss));
          EXPECT_NEAR(r.cv_loss, route.cv_loss,
                      Tol<T>::rel * std::max(1.0, route.cv_loss));
        }
      }
}

// D = 320: the output experts are stored in column panels of 128, 128 and 64, in T and in
// bfloat16. With 12 and 40 tokens the routed output stage runs in column tiles (unpacked products
// for the few rows of an expert), with 400 in row tiles across the panels; the dense path
// multiplies panel by panel. All against the reference, which reads the weights back.
TYPED_TEST(MoATest, MatchesReferenceWithOutputWeightsInPanels) {
  using T = TypeParam;
  const Index D = 320, d = 8;
  for (moh::WeightStorage storage : {moh::WeightStorage::Native, moh::WeightStorage::BFloat16}) {
    MoAConfig c = moa_config(D, d, 3, 2);
    c.weight_storage = storage;
    const MoAAttention<T> m(c, 800);
    const moh::Matrix<T> out = m.output_experts();
    MoAAttention<T> copy(c, 801);
    copy.set_output_experts(out);
    EXPECT_EQ(copy.output_experts(), out);
    for (Index Tn : {12, 40, 400}) {
      const Tensor3<T> x = random_tensor<T>(2, Tn, D, 802 + Tn);
      const Mat want = reference(m, x, {});
      for (ComputeMode mode : kModes)
        EXPECT_LE(relative_error(run(m, x, in_mode(mode)), want), Tol<T>::rel)
            << "T=" << Tn << " " << mode_name(mode) << " " << moh::enum_name(storage);
    }
  }
}

TYPED_TEST(MoATest, MasksInBothModes) {
  using T = TypeParam;
  const Tensor3<T> x = random_tensor<T>(3, 17, 10, 1);
  // Sequence 0: some keys padded, key 0 among them; sequence 1: none; sequence 2: every key.
  const Mask pad = three_sequence_padding(17, {0, 3, 9, 16});
  for (const Experts& ek : kExperts) {
    const MoAAttention<T> m(moa_config(10, 5, ek.E, ek.k), 200 + ek.E + ek.k);
    check_three_sequence_masks(
        m, x, pad, [&](const Masking& mk) { return reference(m, x, mk.reference()); },
        kNoBias<T>, {ComputeMode::Sparse, ComputeMode::Dense},
        "E=" + std::to_string(ek.E) + " k=" + std::to_string(ek.k));
  }
}

TYPED_TEST(MoATest, CrossAttentionInBothModes) {
  using T = TypeParam;
  const Index B = 2, D = 8;
  const MoAAttention<T> m(moa_config(D, 3, 4, 2), 300);
  const std::vector<std::pair<Index, Index>> lengths = {{3, 17}, {17, 5}, {1, 3}};
  for (auto [Tn, S] : lengths)
    for (bool causal : {false, true}) {
      const Tensor3<T> x = random_tensor<T>(B, Tn, D, 301 + Tn);
      const Tensor3<T> mem = random_tensor<T>(B, S, D, 302 + S);
      const Mask pad = padding(B, S, {{0, S - 1}});
      const Masking mk{causal, &pad};
      const Mat want = moh_ref::naive_moa(weights_of(m), to_ref(x), B, static_cast<int>(Tn),
                                          to_ref(mem), static_cast<int>(S), mk.reference());
      for (ComputeMode mode : kModes) {
        const Tensor3<T> y = run_cross(m, x, mem, mk.options(mode));
        const std::string where = "T=" + std::to_string(Tn) + " S=" + std::to_string(S) +
                                  " causal=" + std::to_string(causal) + " " + mode_name(mode);
        EXPECT_LE(relative_error(y, want), Tol<T>::rel) << where;
        // Bottom-right causal with S < T: the first T - S queries see no key.
        const Index unseeing = causal ? Tn - S : 0;
        expect_rows_are_bias(y, kNoBias<T>, [unseeing](Index, Index i) { return i < unseeing; },
                             where);
      }
    }
}

// k = E: every expert is selected, and y = sum_e p_e (o_e W_o^e) over all of them, with p the
// softmax over all experts (so the gates of a token sum to 1).
TYPED_TEST(MoATest, EveryExpertSelectedIsTheGateWeightedSum) {
  using T = TypeParam;
  const Index B = 2, Tn = 17, D = 9, E = 4;
  const MoAAttention<T> m(moa_config(D, 5, E, E), 400);
  const Tensor3<T> x = random_tensor<T>(B, Tn, D, 401);
  const Masking mk{true};
  const std::vector<Mat> experts =
      moh_ref::naive_moa_experts(weights_of(m), to_ref(x), B, Tn, to_ref(x), Tn, mk.reference());
  for (ComputeMode mode : kModes) {
    MoARouting<T> r;
    const Tensor3<T> y = run(m, x, mk.options(mode), &r);
    Mat want = Mat::Zero(B * Tn, D);
    for (Index n = 0; n < B * Tn; ++n) {
      T sum = 0;
      for (Index e = 0; e < E; ++e) {
        EXPECT_EQ(r.gates(n, e), r.probs(n, e)) << "k = E keeps every expert with gate p_e";
        want.row(n) += double(r.gates(n, e)) * experts[e].row(n);
        sum += r.gates(n, e);
      }
      EXPECT_NEAR(sum, T(1), 1e-5);
    }
    EXPECT_LE(relative_error(y, want), Tol<T>::rel) << mode_name(mode);
  }
}

TYPED_TEST(MoATest, SparseAndDenseAgree) {
  using T = TypeParam;
  const Index B = 2, Tn = 17, D = 12;
  const Tensor3<T> x = random_tensor<T>(B, Tn, D, 500);
  const Mask pad = padding(B, Tn, {{1, 4}});
  const Masking mk{true, &pad};
  for (const Experts& ek : kExperts) {
    const MoAAttention<T> m(moa_config(D, 3, ek.E, ek.k), 501 + ek.E);
    MoARouting<T> rs, rd;
    const Tensor3<T> sparse = run(m, x, mk.options(), &rs);
    const Tensor3<T> dense = run(m, x, mk.options(ComputeMode::Dense), &rd);
    EXPECT_LE(relative_error(sparse, to_ref(dense)), Tol<T>::rel)
        << "E=" << ek.E << " k=" << ek.k;
    EXPECT_TRUE(rs.selected == rd.selected);
    EXPECT_TRUE(rs.gates == rd.gates);
  }
}

TYPED_TEST(MoATest, JetMoEGatingMatchesReference) {
  using T = TypeParam;
  const Index B = 2, Tn = 17, D = 7;
  const Masking mk{true};
  for (Index k : {1, 2, 4}) {
    const MoAAttention<T> m(moa_config(D, 5, 4, k, MoAGating::TopKSoftmax), 600 + k);
    const Tensor3<T> x = random_tensor<T>(B, Tn, D, 601);
    const Mat want = reference(m, x, mk.reference());
    for (ComputeMode mode : kModes) {
      MoARouting<T> r;
      EXPECT_LE(relative_error(run(m, x, mk.options(mode), &r), want), Tol<T>::rel)
          << "k=" << k << " " << mode_name(mode);
      for (Index n = 0; n < B * Tn; ++n) EXPECT_NEAR(r.gates.row(n).sum(), T(1), 1e-5);
    }
  }
}

// Results must not depend on the number of threads: bitwise, self and cross, both modes. The
// sparse path (row or column tiles, by shape) agrees with the dense one.
template <class T>
void check_threads(Index D, Index Tn) {
  const MoAAttention<T> m(moa_config(D, 6, 5, 2), 700);
  const Tensor3<T> x = random_tensor<T>(2, Tn, D, 701);
  const Tensor3<T> mem = random_tensor<T>(2, 70, D, 702);
  const Mask pad = padding(2, Tn, {{0, 3}, {1, Tn - 1}});
  std::vector<Tensor3<T>> self, cross;  // of each mode
  for (ComputeMode mode : kModes) {
    const ForwardOptions o = Masking{true, &pad}.options(mode), oc = in_mode(mode);
    const std::string what = mode_name(mode);
    self.push_back(moh_test::expect_same_bits_for_any_thread_count(
        [&](moh::ThreadPool* pool) { return run(m, x, moh_test::with_pool(o, pool)); }, what));
    cross.push_back(moh_test::expect_same_bits_for_any_thread_count(
        [&](moh::ThreadPool* pool) { return run_cross(m, x, mem, moh_test::with_pool(oc, pool)); },
        "cross, " + what));
  }
  EXPECT_LE(relative_error(self[0], to_ref(self[1])), Tol<T>::rel) << "sparse vs dense";
  EXPECT_LE(relative_error(cross[0], to_ref(cross[1])), Tol<T>::rel) << "sparse vs dense, cross";
}

TYPED_TEST(MoATest, ThreadCountDoesNotChangeBits) {
  // 400 tokens: 320 rows per expert, so the routed output stage runs in row tiles. D = 300 with
  // 60 tokens: few rows per expert, so it runs in several column tiles (128 + 128 + 44).
  for (const auto& [D, Tn] : {std::pair<Index, Index>{20, 400}, std::pair<Index, Index>{300, 60}})
    check_threads<TypeParam>(D, Tn);
}

// ---- weights ------------------------------------------------------------------------------------

// A layer built from its config alone has no weights: forward refuses to run, naming the tensors
// still unset, until the typed setters set all five.
TEST(MoAWeights, UnsetWeightsAreNamedUntilEverySetterRan) {
  moh_test::UnsetLayer<MoAAttention<float>> u(moa_config(8, 3, 4, 2), 30);
  EXPECT_FALSE(u.m.weights_set());
  EXPECT_TRUE(EveryEntryPointRefuses(
      u.m, u.x, u.y, u.cache,
      {"MoAAttention", "weights not set",
       "[q_proj.experts.w, q_proj.output_experts.w, q_proj.w_gate, k_proj.weight, "
       "v_proj.weight]"}));
  EXPECT_EQ(u.cache.length(), 0);

  u.m.set_query_experts(u.seeded.query_experts());
  u.m.set_output_experts(u.seeded.output_experts());
  u.m.set_value_weight(u.seeded.value_weight());
  EXPECT_TRUE(ErrorMentions([&] { u.m.forward(u.x, u.y); },
                            {"weights not set: [q_proj.w_gate, k_proj.weight]"}));
  u.m.set_gate_weight(u.seeded.gate_weight());
  u.m.set_key_weight(u.seeded.key_weight());
  EXPECT_TRUE(u.m.weights_set());
  moh_test::expect_same_bits_as_in_every_mode(u.m, u.seeded, u.x);
}

// moh::zero_weights: every weight 0, so every output is exactly 0 (MoA has no bias).
TYPED_TEST(MoATest, ZeroWeightsGiveZeroOutput) {
  using T = TypeParam;
  const MoAAttention<T> m(moa_config(7, 5, 3, 2), moh::zero_weights);
  EXPECT_TRUE(m.weights_set());
  EXPECT_TRUE(m.query_experts().isZero() && m.output_experts().isZero() &&
              m.gate_weight().isZero() && m.key_weight().isZero() && m.value_weight().isZero());
  const Tensor3<T> x = random_tensor<T>(2, 17, 7, 32);
  for (ComputeMode mode : kModes) {
    const Tensor3<T> y = run(m, x, in_mode(mode));
    for (Index i = 0; i < y.size(); ++i)
      ASSERT_EQ(y.data()[i], T(0)) << i << " " << mode_name(mode);
  }
}

// ---- bad input ----------------------------------------------------------------------------------

TEST(MoAErrors, ImpossibleConfigsNameExpectedAndActual) {
  const std::pair<MoAConfig, std::vector<std::string>> cases[] = {
      {moa_config(8, 4, 4, 5), {"1..4", "got 5"}},
      {moa_config(8, 4, 4, 0), {"1..4", "got 0"}},
      {moa_config(0, 4, 4, 1), {"embed_dim", "> 0", "got 0"}},
      {moa_config(8, 0, 4, 1), {"head_dim", "> 0", "got 0"}},
      {moa_config(8, 4, 0, 1), {"num_experts", "> 0", "got 0"}}};
  for (const auto& k : cases)
    EXPECT_TRUE(ErrorMentions([&] { MoAAttention<float> m(k.first); }, k.second));
}

TEST(MoAErrors, SettersCheckShapes) {
  // D = 6, d = 3, E = 4: query experts [24, 3], output experts [12, 6], gate [6, 4], k/v [3, 6].
  MoAAttention<double> m(moa_config(6, 3, 4, 2), moh::zero_weights);
  using M = moh::Matrix<double>;
  EXPECT_TRUE(ErrorMentions([&] { m.set_query_experts(M::Zero(24, 4)); }, {"[24, 3]", "[24, 4]"}));
  EXPECT_TRUE(ErrorMentions([&] { m.set_output_experts(M::Zero(6, 12)); }, {"[12, 6]", "[6, 12]"}));
  EXPECT_TRUE(ErrorMentions([&] { m.set_gate_weight(M::Zero(4, 6)); }, {"[6, 4]", "[4, 6]"}));
  EXPECT_TRUE(ErrorMentions([&] { m.set_key_weight(M::Zero(6, 3)); }, {"[3, 6]", "[6, 3]"}));
  EXPECT_TRUE(ErrorMentions([&] { m.set_value_weight(M::Zero(3, 7)); }, {"[3, 6]", "[3, 7]"}));
  // A right-shaped key weight is accepted and lands in key_weight(), not value_weight().
  const M k = random_matrix<double>(3, 6, 1);
  m.set_key_weight(k);
  EXPECT_TRUE(m.key_weight() == k);
  EXPECT_TRUE(m.value_weight().isZero());
  EXPECT_TRUE(m.weights_set());
}

TEST(MoAErrors, MismatchedShapesNameBoth) {
  const MoAAttention<float> m(moa_config(8, 4, 3, 2), 1);
  // y [2, 5, 8] for x [2, 3, 8]; a key padding mask [2, 5].
  expect_mismatched_shapes_named(m, 2, 5, 2, 5, {ComputeMode::Sparse, ComputeMode::Dense});
  const Tensor3<float> x = random_tensor<float>(2, 3, 8, 2);
  Tensor3<float> good(2, 3, 8);
  const Tensor3<float> mem = random_tensor<float>(1, 4, 8, 3);
  EXPECT_TRUE(ErrorMentions([&] { m.forward_cross(x, mem, good); }, {"[2, *, 8]", "[1, 4, 8]"}));
  // Cross-attention: the mask covers the memory's 4 keys.
  const Mask pad = no_padding(2, 5);
  const Tensor3<float> mem4 = random_tensor<float>(2, 4, 8, 4);
  for (ComputeMode mode : kModes) {
    ForwardOptions o = in_mode(mode);
    o.key_padding_mask = moh::map_mask(pad);
    EXPECT_TRUE(ErrorMentions([&] { m.forward_cross(x, mem4, good, o); }, {"[2, 4]", "[2, 5]"}));
  }
}

}  // namespace
