// Tests for moh::MoHAttention against the naive reference (docs/semantics.md §3 and §4): both
// compute modes over activation ratios and odd sizes, masks, grouped-query heads, the query-norm
// router with RoPE, the reduction to MHA, cross-attention (queries and routing from x, keys and
// values from the memory), thread-count independence, weights that must be set before a forward
// call, and the messages of bad input.
#include "moh/layers/moh_attention.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "layers/layer_test_support.hpp"
#include "moh/layers/multi_head_attention.hpp"
#include "reference/naive.hpp"
#include "test_helpers.hpp"

namespace {

using moh::MoHAttention;
using moh::MoHConfig;
using moh::MoHRouterKind;
using moh::MoHRouting;
using moh::MultiHeadAttention;
using namespace moh_test;  // the shared helpers, with layer_test_support.hpp's

/// Sets the four projections of `m` (queries, keys and values; output).
template <class T>
void set_projections(MoHAttention<T>& m, const moh::Matrix<T>& qkv, const moh::Vector<T>& qkv_bias,
                     const moh::Matrix<T>& proj, const moh::Vector<T>& proj_bias) {
  m.set_qkv_weight(qkv);
  m.set_qkv_bias(qkv_bias);
  m.set_proj_weight(proj);
  m.set_proj_bias(proj_bias);
}

/// The reference's own routing of X [B*T, D] (never the layer's record).
template <class T>
moh_ref::MoHGates reference_gates(const MoHAttention<T>& m, const Mat& X) {
  const MoHConfig& c = m.config();
  const int H = static_cast<int>(c.num_heads), S = static_cast<int>(c.shared_heads);
  const int K = static_cast<int>(c.active_routed_heads);
  if (c.router == MoHRouterKind::QueryNorm) {
    const moh_ref::MhaWeights w = weights_of(m);
    return moh_ref::naive_moh_gates_query_norm(moh_ref::naive_queries(w, X), H, w.d, S, K);
  }
  return moh_ref::naive_moh_gates(X, H, S, K, to_ref(m.router().routed_weight()),
                                  to_ref(m.router().shared_weight()),
                                  to_ref(m.router().mix_weight()));
}

/// The reference MoH output for self-attention of x [B, T, D].
template <class T>
Mat reference(const MoHAttention<T>& m, const Tensor3<T>& x, const moh_ref::AttnOptions& o) {
  const Mat X = to_ref(x);
  const int B = static_cast<int>(x.dimension(0)), Tn = static_cast<int>(x.dimension(1));
  return moh_ref::naive_moh(weights_of(m), reference_gates(m, X).gates, X, B, Tn, o);
}

/// The reference MoH cross-attention: gates routed on x [B, T, D], keys/values from mem [B, S, D].
template <class T>
Mat reference_cross(const MoHAttention<T>& m, const Tensor3<T>& x, const Tensor3<T>& mem,
                    const moh_ref::AttnOptions& o) {
  const Mat X = to_ref(x);
  const int B = static_cast<int>(x.dimension(0)), Tn = static_cast<int>(x.dimension(1));
  const int S = static_cast<int>(mem.dimension(1));
  return moh_ref::naive_moh_cross(weights_of(m), reference_gates(m, X).gates, X, B, Tn,
                                  to_ref(mem), S, o);
}

struct Ratio {
  Index H, S, K;
};
// Activation ratios: no shared head, one shared head (g_s = a_s), several shared heads with and
// without routed heads (K = 0), and every head active.
const std::vector<Ratio> kRatios = {{4, 0, 1}, {4, 1, 2}, {5, 2, 1},
                                    {5, 2, 0}, {4, 1, 3}, {4, 0, 4}};

template <class T>
using MoHTest = moh_test::ScalarTest<T>;
TYPED_TEST_SUITE(MoHTest, moh_test::Scalars);

TYPED_TEST(MoHTest, LearnedRouterMatchesReferenceInBothModes) {
  using T = TypeParam;
  for (const Ratio& r : kRatios)
    for (Index d : {3, 5, 12})
      for (Index Tn : {1, 3, 17}) {
        const Index D = 7;
        const MoHAttention<T> m(moh_config(D, r.H, r.S, r.K, MoHRouterKind::Learned, 0, d),
                                1000 + 10 * d + r.K);
        const Tensor3<T> x = random_tensor<T>(2, Tn, D, 7 + Tn);
        const Mat want = reference(m, x, {});
        for (ComputeMode mode : kModes) {
          MoHRouting<T> routing;
          const Tensor3<T> y = run(m, x, in_mode(mode), &routing);
          EXPECT_LE(relative_error(y, want), Tol<T>::rel)
              << "H=" << r.H << " S=" << r.S << " K=" << r.K << " d=" << d << " T=" << Tn << " "
              << mode_name(mode);
          EXPECT_LE(relative_error(to_ref(routing.gates), reference_gates(m, to_ref(x)).gates),
                    Tol<T>::rel);
        }
      }
}

TYPED_TEST(MoHTest, MasksInBothModes) {
  using T = TypeParam;
  const Tensor3<T> x = random_tensor<T>(3, 17, 10, 5);
  // Sequence 0: some keys padded (key 0 too, so its first causal query sees nothing);
  // sequence 1: none; sequence 2: every key.
  const Mask pad = three_sequence_padding(17, {0, 6, 7, 16});
  for (const Ratio& r : kRatios) {
    const MoHAttention<T> m(moh_config(10, r.H, r.S, r.K, MoHRouterKind::Learned, 0, 5),
                            2000 + r.K);
    check_three_sequence_masks(
        m, x, pad, [&](const Masking& mk) { return reference(m, x, mk.reference()); },
        m.proj_bias(), {ComputeMode::Sparse, ComputeMode::Dense},
        "H=" + std::to_string(r.H) + " S=" + std::to_string(r.S) + " K=" + std::to_string(r.K));
  }
}

TYPED_TEST(MoHTest, SparseAndDenseAgree) {
  using T = TypeParam;
  const Index D = 12, Tn = 17;
  const Tensor3<T> x = random_tensor<T>(2, Tn, D, 6);
  const Mask pad = padding(2, Tn, {{1, 3}});
  for (const Ratio& r : kRatios) {
    const MoHAttention<T> m(moh_config(D, r.H, r.S, r.K, MoHRouterKind::Learned, 0, 3),
                            3000 + r.S);
    const ForwardOptions o = Masking{true, &pad}.options();
    MoHRouting<T> rs, rd;
    const Tensor3<T> sparse = run(m, x, o, &rs);
    const Tensor3<T> dense = run(m, x, Masking{true, &pad}.options(ComputeMode::Dense), &rd);
    EXPECT_LE(relative_error(sparse, to_ref(dense)), Tol<T>::rel)
        << "H=" << r.H << " S=" << r.S << " K=" << r.K;
    // The routing does not depend on the mode.
    EXPECT_TRUE(rs.active == rd.active);
    EXPECT_TRUE(rs.gates == rd.gates);
  }
}

TYPED_TEST(MoHTest, GroupedQueryHeadsMatchReference) {
  using T = TypeParam;
  const Index D = 9, Tn = 17;
  const Tensor3<T> x = random_tensor<T>(2, Tn, D, 8);
  for (bool rope : {false, true})
    for (Index kv : {1, 2})
      for (const Ratio& r : std::vector<Ratio>{{4, 1, 2}, {4, 0, 1}, {4, 2, 2}}) {
        const Index d = rope ? 6 : 5;  // RoPE needs an even head size
        const MoHAttention<T> m(
            moh_config(D, r.H, r.S, r.K, MoHRouterKind::Learned, kv, d, true, rope), 4000 + kv);
        ASSERT_EQ(m.qkv_weight().rows(), (4 + 2 * kv) * d);
        const Masking mk{true, nullptr, rope ? 3 : 0};
        const Mat want = reference(m, x, mk.reference());
        for (ComputeMode mode : kModes)
          EXPECT_LE(relative_error(run(m, x, mk.options(mode)), want), Tol<T>::rel)
              << "kv=" << kv << " S=" << r.S << " K=" << r.K << " rope=" << rope << " "
              << mode_name(mode);
      }
}

// MoH-LLaMA3: query-norm router, RoPE, grouped-query heads, no bias, causal (docs/semantics.md §4).
TYPED_TEST(MoHTest, QueryNormRouterWithRopeMatchesReference) {
  using T = TypeParam;
  const MoHAttention<T> m(moh_config(10, 6, 2, 2, MoHRouterKind::QueryNorm, 2, 6, false, true),
                          5000);
  for (Index Tn : {1, 3, 17})
    for (int offset : {0, 4}) {
      const Tensor3<T> x = random_tensor<T>(2, Tn, 10, 50 + Tn);
      const Mask pad = padding(2, Tn, {{1, Tn - 1}});
      const Masking mk{true, &pad, offset};
      const Mat want = reference(m, x, mk.reference());
      for (ComputeMode mode : kModes) {
        MoHRouting<T> routing;
        EXPECT_LE(relative_error(run(m, x, mk.options(mode), &routing), want), Tol<T>::rel)
            << "T=" << Tn << " offset=" << offset << " " << mode_name(mode);
        for (Index i = 0; i < routing.gates.size(); ++i)
          EXPECT_TRUE(routing.gates.data()[i] == T(0) || routing.gates.data()[i] == T(1));
      }
    }
}

// docs/semantics.md §3, "Reduction to MHA": every head active and zero router weights -> every gate
// is exactly 1 and MoH equals MHA with the same projections.
TYPED_TEST(MoHTest, ReducesToMhaWithEveryHeadActiveAndZeroRouter) {
  using T = TypeParam;
  const Index D = 10, Tn = 17, B = 2;
  const Tensor3<T> x = random_tensor<T>(B, Tn, D, 9);
  const Mask pad = padding(B, Tn, {{0, 2}, {1, 0}});
  for (Index kv : {0, 2})
    for (const Ratio& r :
         std::vector<Ratio>{{4, 0, 4}, {4, 1, 3}, {4, 2, 2}, {4, 3, 1}, {4, 4, 0}}) {
      const MultiHeadAttention<T> mha(moh_test::mha_config(D, 4, kv, 5), 6000 + kv);
      // Zero router weights (and projections, replaced below).
      MoHAttention<T> moh_layer(moh_config(D, r.H, r.S, r.K, MoHRouterKind::Learned, kv, 5),
                                moh::zero_weights);
      set_projections(moh_layer, mha.in_proj_weight(), mha.in_proj_bias(), mha.out_proj_weight(),
                      mha.out_proj_bias());
      const Masking mk{true, &pad};
      const Tensor3<T> want = run(mha, x, mk.options());
      for (ComputeMode mode : kModes) {
        MoHRouting<T> routing;
        const Tensor3<T> y = run(moh_layer, x, mk.options(mode), &routing);
        EXPECT_LE(relative_error(y, to_ref(want)), Tol<T>::exact)
            << "kv=" << kv << " S=" << r.S << " K=" << r.K << " " << mode_name(mode);
        for (Index i = 0; i < routing.gates.size(); ++i)
          EXPECT_EQ(routing.gates.data()[i], T(1))
              << "gate " << i << " S=" << r.S << " K=" << r.K << " " << mode_name(mode);
      }
    }
}

// With every head active and random router weights, MoH is MHA whose per-head outputs are
// scaled by the gates: y = concat_h(g_h o_h) W_o^T + b_o with o_h from the reference MHA.
TYPED_TEST(MoHTest, EveryHeadActiveEqualsGateScaledMha) {
  using T = TypeParam;
  const Index D = 8, Tn = 17, B = 2;
  const Tensor3<T> x = random_tensor<T>(B, Tn, D, 10);
  const Masking mk{true};
  for (const Ratio& r : std::vector<Ratio>{{4, 1, 3}, {4, 2, 2}, {4, 0, 4}}) {
    const MoHAttention<T> m(moh_config(D, r.H, r.S, r.K, MoHRouterKind::Learned, 0, 3),
                            7000 + r.S);
    for (ComputeMode mode : kModes) {
      MoHRouting<T> routing;
      const Tensor3<T> y = run(m, x, mk.options(mode), &routing);
      const moh_ref::MhaWeights w = weights_of(m);
      Mat heads = moh_ref::naive_mha_heads(w, to_ref(x), B, Tn, to_ref(x), Tn, mk.reference());
      for (Index n = 0; n < heads.rows(); ++n)
        for (Index h = 0; h < 4; ++h) heads.block(n, h * 3, 1, 3) *= double(routing.gates(n, h));
      EXPECT_LE(relative_error(y, moh_ref::linear(heads, w.W_out, w.b_out)), Tol<T>::rel)
          << "S=" << r.S << " " << mode_name(mode);
      // And the gates really are not all 1, or this test would be the reduction test again.
      EXPECT_GT((routing.gates.array() - T(1)).abs().maxCoeff(), T(1e-3));
    }
  }
}

// A routed head nobody picks contributes nothing: changing its query and output weights leaves
// y bitwise unchanged. Zero router weights make p uniform, and ties go to the lower index, so
// with K = 1 of E = 3 routed heads every token keeps routed head 0 (head S).
TYPED_TEST(MoHTest, UnpickedHeadsDoNotAffectOutput) {
  using T = TypeParam;
  const Index D = 6, d = 3, H = 4, S = 1;
  const MoHConfig c = moh_config(D, H, S, 1, MoHRouterKind::Learned, 0, d);
  MoHAttention<T> m(c, moh::zero_weights);  // zero router weights
  const MoHAttention<T> seeded(c, 8000);
  set_projections(m, seeded.qkv_weight(), seeded.qkv_bias(), seeded.proj_weight(),
                  seeded.proj_bias());
  const Tensor3<T> x = random_tensor<T>(2, 17, D, 11);
  for (ComputeMode mode : kModes) {
    const ForwardOptions o = Masking{true}.options(mode);
    MoHRouting<T> routing;
    const Tensor3<T> before = run(m, x, o, &routing);
    for (Index n = 0; n < routing.active.rows(); ++n)
      ASSERT_TRUE(routing.active(n, 0) && routing.active(n, 1) && !routing.active(n, 2) &&
                  !routing.active(n, 3));
    MoHAttention<T> changed = m;
    moh::Matrix<T> qkv = m.qkv_weight(), proj = m.proj_weight();
    qkv.middleRows(2 * d, 2 * d).setConstant(T(3));  // queries of heads 2 and 3
    proj.middleCols(2 * d, 2 * d).setConstant(T(-5));
    changed.set_qkv_weight(qkv);
    changed.set_proj_weight(proj);
    const Tensor3<T> after = run(changed, x, o);
    EXPECT_EQ(std::memcmp(before.data(), after.data(), before.size() * sizeof(T)), 0)
        << mode_name(mode);
    // ... while changing a picked head does change y.
    qkv.middleRows(d, d).setConstant(T(0.25));
    changed.set_qkv_weight(qkv);
    EXPECT_GT(relative_error(run(changed, x, o), to_ref(before)), 1e-3) << mode_name(mode);
  }
}

// forward_cross (docs/semantics.md §2 and §3): queries and routing from x, keys and values from the
// memory, the key padding mask over the memory's keys, bottom-right causal alignment. Odd lengths
// on both sides, head sizes 5 and 6, both routers (the query-norm one with RoPE: queries from the
// position offset, keys from 0), both modes.
TYPED_TEST(MoHTest, CrossAttentionMatchesReferenceInBothModes) {
  using T = TypeParam;
  const Index B = 2, D = 9;
  const std::vector<std::pair<Index, Index>> lengths = {{3, 17}, {17, 5}, {1, 3}, {3, 1}};
  std::vector<MoHConfig> configs;
  for (const Ratio& r : std::vector<Ratio>{{4, 1, 2}, {5, 2, 1}, {5, 2, 0}, {4, 0, 4}})
    configs.push_back(moh_config(D, r.H, r.S, r.K, MoHRouterKind::Learned, 0, 5));
  // MoH-LLaMA3 style: query-norm router, RoPE, grouped-query heads, no bias.
  configs.push_back(moh_config(D, 6, 2, 2, MoHRouterKind::QueryNorm, 2, 6, false, true));
  for (const MoHConfig& c : configs) {
    const MoHAttention<T> m(c, 10000 + c.num_heads + 10 * c.shared_heads);
    const std::string cfg = "H=" + std::to_string(c.num_heads) + " S=" +
                            std::to_string(c.shared_heads) + " K=" +
                            std::to_string(c.active_routed_heads) + (c.rope ? " rope" : "");
    for (auto [Tn, S] : lengths)
      for (bool causal : {false, true}) {
        const Tensor3<T> x = random_tensor<T>(B, Tn, D, 10100 + Tn);
        const Tensor3<T> mem = random_tensor<T>(B, S, D, 10200 + S);
        // The last key of sequence 1 (its only one when S = 1).
        const Mask pad = padding(B, S, {{1, S - 1}});
        const Masking mk{causal, &pad, c.rope ? 2 : 0};
        const Mat want = reference_cross(m, x, mem, mk.reference());
        const moh_ref::MoHGates gates = reference_gates(m, to_ref(x));
        for (ComputeMode mode : kModes) {
          MoHRouting<T> routing;
          const Tensor3<T> y = run_cross(m, x, mem, mk.options(mode), &routing);
          const std::string where = cfg + " T=" + std::to_string(Tn) + " S=" +
                                    std::to_string(S) + " causal=" + std::to_string(causal) +
                                    " " + mode_name(mode);
          EXPECT_LE(relative_error(y, want), Tol<T>::rel) << where;
          // The routing is x's: one row per query token.
          ASSERT_EQ(routing.batch, B) << where;
          ASSERT_EQ(routing.tokens, Tn) << where;
          EXPECT_LE(relative_error(to_ref(routing.gates), gates.gates), Tol<T>::rel) << where;
          for (Index n = 0; n < B * Tn; ++n)
            for (Index h = 0; h < c.num_heads; ++h)
              ASSERT_EQ(routing.active(n, h), gates.active[n][h]) << where;
          // Sequence 1 with S = 1 has no key left: every query outputs the bias. Bottom-right
          // causal with S < T: the first T - S queries of every sequence see no key.
          const bool no_key_left = S == 1;
          const Index unseeing = causal ? Tn - S : 0;
          expect_rows_are_bias(
              y, m.proj_bias(),
              [&](Index b, Index i) { return (b == 1 && no_key_left) || i < unseeing; }, where);
        }
      }
  }
}

// Cross-attention reads the keys and values of the memory, not of x: with the memory equal to x
// it is self-attention, with another memory the output changes.
TYPED_TEST(MoHTest, CrossAttentionOnItselfIsSelfAttention) {
  using T = TypeParam;
  const MoHAttention<T> m(moh_config(10, 5, 1, 2, MoHRouterKind::Learned, 0, 3), 10300);
  const Tensor3<T> x = random_tensor<T>(2, 17, 10, 10301);
  const Tensor3<T> other = random_tensor<T>(2, 17, 10, 10302);
  for (ComputeMode mode : kModes) {
    const ForwardOptions o = Masking{true}.options(mode);
    const Tensor3<T> self = run(m, x, o);
    EXPECT_TRUE(moh_test::BitEqual(run_cross(m, x, x, o), self)) << mode_name(mode);
    EXPECT_GT(relative_error(run_cross(m, x, other, o), to_ref(self)), 1e-3) << mode_name(mode);
  }
}

// Results must not depend on the number of threads: bitwise, both routers, both modes. The
// sparse path (row or column tiles, by shape) agrees with the dense one.
template <class T>
void check_threads(Index D, Index Tn) {
  const Tensor3<T> x = random_tensor<T>(2, Tn, D, 12);
  const Mask pad = padding(2, Tn, {{0, Tn - 10}, {1, 3}});
  for (MoHRouterKind router : {MoHRouterKind::Learned, MoHRouterKind::QueryNorm}) {
    const bool rope = router == MoHRouterKind::QueryNorm;
    const MoHAttention<T> m(moh_config(D, 5, 1, 2, router, 0, 6, true, rope), 9000);
    std::vector<Tensor3<T>> bases;
    for (ComputeMode mode : kModes) {
      const ForwardOptions o = Masking{true, &pad}.options(mode);
      bases.push_back(moh_test::expect_same_bits_for_any_thread_count(
          [&](moh::ThreadPool* pool) { return run(m, x, moh_test::with_pool(o, pool)); },
          mode_name(mode)));
    }
    EXPECT_LE(relative_error(bases[0], to_ref(bases[1])), Tol<T>::rel) << "sparse vs dense";
  }
}

TYPED_TEST(MoHTest, ThreadCountDoesNotChangeBits) {
  // 400 tokens: 480 rows per head, so the routed output stage runs in row tiles. D = 300 with
  // 60 tokens: few rows per head, so it runs in several column tiles (128 + 128 + 44).
  for (const auto& [D, Tn] : {std::pair<Index, Index>{20, 400}, std::pair<Index, Index>{300, 60}})
    check_threads<TypeParam>(D, Tn);
}

// Heads of at least 1 MiB of output weights (MoH-LLaMA3's 128 x 4096 floats) project their
// outputs in row tiles of 512 (detail/attend.hpp): 2 x 300 rows make two tiles, the second one
// partial. Same bits on any thread count; the sparse path agrees with the dense one.
TEST(MoHLargeHeads, RowTilesOfLargeHeadsGiveTheSameBitsOnAnyThreadCount) {
  const Index D = 512, Tn = 300, d = 512;  // d x D floats = 1 MiB per head
  const MoHAttention<float> m(moh_config(D, 3, 1, 1, MoHRouterKind::Learned, 0, d), 9100);
  const Tensor3<float> x = random_tensor<float>(2, Tn, D, 13);
  const Mask pad = padding(2, Tn, {{0, Tn - 7}, {1, 2}});
  const ForwardOptions sparse = Masking{true, &pad}.options(moh::ComputeMode::Sparse);
  const Tensor3<float> got = moh_test::expect_same_bits_for_any_thread_count(
      [&](moh::ThreadPool* pool) { return run(m, x, moh_test::with_pool(sparse, pool)); },
      "sparse, large heads");
  const Tensor3<float> dense = run(m, x, Masking{true, &pad}.options(moh::ComputeMode::Dense));
  EXPECT_LE(relative_error(got, to_ref(dense)), Tol<float>::rel) << "sparse vs dense";
}

// ---- weights ------------------------------------------------------------------------------------

// A layer built from its config alone has no weights: forward refuses to run, naming the tensors
// still unset (projections and the learned router's), until the typed setters set all of them.
TEST(MoHWeights, UnsetWeightsAreNamedUntilEverySetterRan) {
  // wg, wg_0, wg_1
  moh_test::UnsetLayer<MoHAttention<float>> u(moh_config(8, 5, 2, 1, MoHRouterKind::Learned, 0, 3),
                                              20);
  EXPECT_FALSE(u.m.weights_set());
  EXPECT_TRUE(EveryEntryPointRefuses(
      u.m, u.x, u.y, u.cache,
      {"MoHAttention", "weights not set",
       "[qkv.weight, qkv.bias, proj.weight, proj.bias, wg.weight, wg_0.weight, wg_1.weight]"}));
  EXPECT_EQ(u.cache.length(), 0);

  set_projections(u.m, u.seeded.qkv_weight(), u.seeded.qkv_bias(), u.seeded.proj_weight(),
                  u.seeded.proj_bias());
  u.m.set_router_mix_weight(u.seeded.router().mix_weight());
  EXPECT_TRUE(
      ErrorMentions([&] { u.m.forward(u.x, u.y); }, {"weights not set: [wg.weight, wg_1.weight]"}));
  u.m.set_router_routed_weight(u.seeded.router().routed_weight());
  u.m.set_router_shared_weight(u.seeded.router().shared_weight());
  EXPECT_TRUE(u.m.weights_set());
  moh_test::expect_same_bits_as_in_every_mode(u.m, u.seeded, u.x);
}

// Which tensors a config has: the router's follow S_h and K; the query-norm router has none.
TEST(MoHWeights, TheTensorsListedFollowTheConfig) {
  auto names = [](const MoHConfig& c) {
    std::string out;
    for (const moh::WeightInfo& w : MoHAttention<float>::weight_infos(c))
      out += (out.empty() ? "" : " ") + w.name;
    return out;
  };
  EXPECT_EQ(names(moh_config(8, 4, 1, 2)), "qkv.weight qkv.bias proj.weight proj.bias "
                                           "wg.weight wg_0.weight");
  EXPECT_EQ(names(moh_config(8, 4, 2, 0)), "qkv.weight qkv.bias proj.weight proj.bias "
                                           "wg_1.weight");
  EXPECT_EQ(names(moh_config(8, 4, 0, 2)), "qkv.weight qkv.bias proj.weight proj.bias "
                                           "wg.weight");
  EXPECT_EQ(names(moh_config(8, 4, 1, 2, MoHRouterKind::QueryNorm, 2, 0, false, true)),
            "qkv.weight proj.weight");
  // A query-norm layer without bias runs once its two projections are set.
  const MoHConfig c = moh_config(8, 4, 1, 2, MoHRouterKind::QueryNorm, 2, 0, false, true);
  const MoHAttention<float> seeded(c, 22);
  MoHAttention<float> m(c);
  const Tensor3<float> x = random_tensor<float>(1, 17, 8, 23);
  Tensor3<float> y(1, 17, 8);
  EXPECT_TRUE(
      ErrorMentions([&] { m.forward(x, y); }, {"weights not set: [qkv.weight, proj.weight]"}));
  m.set_qkv_weight(seeded.qkv_weight());
  m.set_proj_weight(seeded.proj_weight());
  m.forward(x, y);
  EXPECT_TRUE(moh_test::BitEqual(y, seeded(x)));
}

// MoH-LLaMA3-8B as released (SkyworkAI/MoH, modeling_llama.py: shared_head = int(H * 0.5),
// routed_head = int(H * 0.25)): heads 0..15 always on, the top 8 of the routed heads 16..31.
TEST(MoHPresets, Llama3_8bIsTheReleasedSplit) {
  const MoHConfig c = MoHConfig::moh_llama3_8b();
  EXPECT_NO_THROW(c.validate());
  EXPECT_EQ(c.embed_dim, 4096);
  EXPECT_EQ(c.num_heads, 32);
  EXPECT_EQ(c.num_kv_heads, 8);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.shared_heads, 16);
  EXPECT_EQ(c.active_routed_heads, 8);
  EXPECT_EQ(c.routed_heads(), 16);
  EXPECT_EQ(c.router, MoHRouterKind::QueryNorm);
  EXPECT_TRUE(c.rope);
  EXPECT_EQ(c.rope_theta, 500000.0);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_FALSE(c.proj_bias);
  EXPECT_EQ(c.active_fraction(), 0.75);
  // The authors' q_proj [4096, 4096], k_proj and v_proj [1024, 4096], o_proj [4096, 4096].
  std::string shapes;
  for (const moh::WeightInfo& w : MoHAttention<float>::weight_infos(c)) {
    shapes += w.name + "[" + std::to_string(w.shape[0]) + "," + std::to_string(w.shape[1]) + "] ";
    for (const moh::WeightInfo& p : w.parts)
      shapes += p.name + "[" + std::to_string(p.shape[0]) + "," + std::to_string(p.shape[1]) + "] ";
    for (const std::string& a : w.aliases) shapes += "=" + a + " ";
  }
  EXPECT_EQ(shapes, "qkv.weight[6144,4096] q_proj.weight[4096,4096] k_proj.weight[1024,4096] "
                    "v_proj.weight[1024,4096] proj.weight[4096,4096] =o_proj.weight ");
}

// The same rule at a small size: every token runs heads 0..3 and exactly 2 of heads 4..7, with
// 0/1 gates, as the reference query-norm router picks them.
TEST(MoHPresets, Llama3SplitRunsHalfTheHeadsAndAQuarterRouted) {
  const MoHConfig c = MoHConfig::moh_llama3(32, 8, 2);
  EXPECT_EQ(c.shared_heads, 4);
  EXPECT_EQ(c.active_routed_heads, 2);
  const MoHAttention<double> m(c, 71);
  const Tensor3<double> x = random_tensor<double>(2, 9, 32, 72);
  const moh_ref::MoHGates want = reference_gates(m, to_ref(x));
  MoHRouting<double> routing;
  moh::ForwardOptions o;
  o.causal = moh::Causal::On;
  run(m, x, o, &routing);
  for (Index n = 0; n < 18; ++n) {
    for (Index h = 0; h < 4; ++h) EXPECT_EQ(routing.gates(n, h), 1.0) << n << " " << h;
    Index routed_on = 0;
    for (Index h = 4; h < 8; ++h) {
      EXPECT_TRUE(routing.gates(n, h) == 0.0 || routing.gates(n, h) == 1.0);
      EXPECT_EQ(routing.gates(n, h), want.gates(static_cast<int>(n), static_cast<int>(h)))
          << n << " " << h;
      routed_on += routing.gates(n, h) == 1.0;
    }
    EXPECT_EQ(routed_on, 2) << n;
  }
}

// moh::zero_weights: zero projections and router; a learned router's gates are then uniform.
TYPED_TEST(MoHTest, ZeroWeightsGiveZeroOutput) {
  using T = TypeParam;
  const MoHAttention<T> m(moh_config(8, 4, 1, 2), moh::zero_weights);
  EXPECT_TRUE(m.weights_set());
  EXPECT_TRUE(m.qkv_weight().isZero() && m.qkv_bias().isZero() && m.proj_weight().isZero() &&
              m.proj_bias().isZero());
  EXPECT_TRUE(m.router().routed_weight().isZero() && m.router().mix_weight().isZero());
  const Tensor3<T> x = random_tensor<T>(2, 17, 8, 24);
  for (ComputeMode mode : kModes) {
    MoHRouting<T> routing;
    const Tensor3<T> y = run(m, x, in_mode(mode), &routing);
    for (Index i = 0; i < y.size(); ++i)
      ASSERT_EQ(y.data()[i], T(0)) << i << " " << mode_name(mode);
    // Uniform p over the 3 routed heads: the lowest 2 are kept (ties: lower index).
    for (Index n = 0; n < routing.active.rows(); ++n)
      ASSERT_EQ(routing.heads_of(n / 17, n % 17), (std::vector<Index>{0, 1, 2})) << mode_name(mode);
  }
}

// ---- bad input ----------------------------------------------------------------------------------

TEST(MoHErrors, ImpossibleConfigsNameExpectedAndActual) {
  const std::pair<MoHConfig, std::vector<std::string>> cases[] = {
      // K larger than the routed heads: H = 4, S = 1 leaves 3.
      {moh_config(8, 4, 1, 4), {"0..3", "got 4"}},
      {moh_config(8, 4, 5, 0), {"0..4", "got 5"}},
      {moh_config(8, 4, 0, 0), {">= 1", "0 + 0"}},
      {moh_config(8, 4, 1, 1, MoHRouterKind::Learned, 3), {"divisor of 4", "got 3"}},
      {moh_config(10, 4, 1, 1), {"multiple of 4", "got 10"}},
      {moh_config(0, 4, 1, 1, MoHRouterKind::Learned, 0, 2), {"embed_dim", "> 0", "got 0"}},
      {moh_config(8, 0, 0, 1, MoHRouterKind::Learned, 0, 2), {"num_heads", "got 0"}},
      {moh_config(8, 4, 1, 1, MoHRouterKind::Learned, 0, 3, true, /*rope=*/true),
       {"even", "got 3"}}};
  for (const auto& k : cases)
    EXPECT_TRUE(ErrorMentions([&] { MoHAttention<float> m(k.first); }, k.second));
}

TEST(MoHErrors, SettersCheckShapes) {
  // H = 4, S = 2, K = 1, d = 3, H_kv = 2: qkv [(4 + 4) 3, 8] = [24, 8], proj [8, 12],
  // wg [2, 8], wg_0 [2, 8], wg_1 [2, 8].
  MoHAttention<double> m(moh_config(8, 4, 2, 1, MoHRouterKind::Learned, 2, 3));
  using M = moh::Matrix<double>;
  using V = moh::Vector<double>;
  EXPECT_TRUE(ErrorMentions([&] { m.set_qkv_weight(M::Zero(36, 8)); }, {"[24, 8]", "[36, 8]"}));
  EXPECT_TRUE(ErrorMentions([&] { m.set_proj_weight(M::Zero(12, 8)); }, {"[8, 12]", "[12, 8]"}));
  EXPECT_TRUE(ErrorMentions([&] { m.set_qkv_bias(V::Zero(36)); }, {"[24]", "[36]"}));
  EXPECT_TRUE(ErrorMentions([&] { m.set_proj_bias(V::Zero(7)); }, {"[8]", "[7]"}));
  EXPECT_TRUE(
      ErrorMentions([&] { m.set_router_routed_weight(M::Zero(3, 8)); }, {"[2, 8]", "[3, 8]"}));
  EXPECT_TRUE(
      ErrorMentions([&] { m.set_router_mix_weight(M::Zero(2, 9)); }, {"[2, 8]", "[2, 9]"}));
  EXPECT_TRUE(
      ErrorMentions([&] { m.set_router_shared_weight(M::Zero(1, 8)); }, {"[2, 8]", "[1, 8]"}));
  EXPECT_NO_THROW(m.set_router_shared_weight(M::Zero(2, 8)));
}

TEST(MoHErrors, MismatchedShapesNameBoth) {
  // y [1, 3, 8] for x [2, 3, 8]; a key padding mask [1, 3].
  expect_mismatched_shapes_named(MoHAttention<float>(moh_config(8, 4, 1, 2), 1), 1, 3, 1, 3,
                                 {ComputeMode::Sparse, ComputeMode::Dense});
}

}  // namespace
