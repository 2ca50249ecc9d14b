// Tests for the MoH routers (moh_router.hpp, docs/semantics.md §3 and §4): the learned two-stage
// router and the query-norm router against the naive reference, the invariants of the MoHRouting
// record (exactly K routed heads, zero gates elsewhere, gate sums, head counts, active fraction)
// and the load-balance loss on cases derived by hand.
#include "moh/layers/moh_router.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "layers/layer_test_support.hpp"
#include "moh/layers/moh_attention.hpp"
#include "reference/naive.hpp"
#include "test_helpers.hpp"

namespace {

using moh::Index;
using moh::Matrix;
using moh::MoHRouting;
using moh::MoHTwoStageRouter;
using moh_ref::Mat;
using moh_ref::to_ref;
using moh_test::random_matrix;
using moh_test::random_tensor;
using moh_test::relative_error;
using moh_test::Tol;

struct Ratio {
  Index H, S, K;
};
const std::vector<Ratio> kRatios = {{4, 0, 1}, {4, 1, 2}, {6, 3, 2}, {5, 2, 0}, {5, 1, 0},
                                    {4, 1, 3}, {6, 0, 6}, {7, 2, 4}};

/// A learned router with seeded random weights in +-scale.
template <class T>
MoHTwoStageRouter<T> random_router(Index D, const Ratio& r, std::uint64_t seed,
                                   double scale = 1.0) {
  MoHTwoStageRouter<T> router(D, r.H, r.S, r.K);
  Matrix<T>* ws[] = {&router.routed_weight(), &router.shared_weight(), &router.mix_weight()};
  for (Matrix<T>* w : ws)
    *w = random_matrix<T>(w->rows(), w->cols(), seed++, scale);
  return router;
}

template <class T>
moh_ref::MoHGates reference(const MoHTwoStageRouter<T>& router, const Matrix<T>& X,
                            const Ratio& r) {
  return moh_ref::naive_moh_gates(to_ref(X), static_cast<int>(r.H), static_cast<int>(r.S),
                                  static_cast<int>(r.K), to_ref(router.routed_weight()),
                                  to_ref(router.shared_weight()), to_ref(router.mix_weight()));
}

/// [a_s, a_r] = 2 softmax(x W_m^T) of row n, in double (docs/semantics.md §3.3).
std::pair<double, double> mix_of(const Mat& X, const Mat& Wm, Index n) {
  double l0 = 0, l1 = 0;
  for (Index c = 0; c < X.cols(); ++c) {
    l0 += X(n, c) * Wm(0, c);
    l1 += X(n, c) * Wm(1, c);
  }
  const double m = std::max(l0, l1), e0 = std::exp(l0 - m), e1 = std::exp(l1 - m);
  return {2 * e0 / (e0 + e1), 2 * e1 / (e0 + e1)};
}

template <class T>
using MoHRouterTest = moh_test::ScalarTest<T>;
TYPED_TEST_SUITE(MoHRouterTest, moh_test::Scalars);

TYPED_TEST(MoHRouterTest, LearnedRouterMatchesReference) {
  using T = TypeParam;
  const Index D = 9, B = 2, Tn = 17;
  const Matrix<T> X = random_matrix<T>(B * Tn, D, 1);
  for (const Ratio& r : kRatios) {
    const MoHTwoStageRouter<T> router = random_router<T>(D, r, 10 + r.H * 10 + r.S);
    MoHRouting<T> got;
    router.route(X, B, Tn, got);
    const moh_ref::MoHGates want = reference(router, X, r);
    const std::string where = "H=" + std::to_string(r.H) + " S=" + std::to_string(r.S) +
                              " K=" + std::to_string(r.K);
    EXPECT_EQ(got.batch, B);
    EXPECT_EQ(got.tokens, Tn);
    EXPECT_LE(relative_error(to_ref(got.gates), want.gates), Tol<T>::rel) << where;
    if (r.K > 0) {
      EXPECT_LE(relative_error(to_ref(got.routed_probs), want.probs), Tol<T>::rel)
          << where;
    }
    for (Index n = 0; n < B * Tn; ++n)
      for (Index h = 0; h < r.H; ++h) ASSERT_EQ(got.active(n, h), want.active[n][h]) << where;
    for (Index h = 0; h < r.H; ++h) EXPECT_EQ(got.head_counts[h], want.head_counts[h]) << where;
    EXPECT_NEAR(got.load_balance_loss, want.load_balance_loss,
                Tol<T>::rel * std::max(1.0, want.load_balance_loss))
        << where;
  }
}

TYPED_TEST(MoHRouterTest, ExactlyKRoutedHeadsAndZeroGatesElsewhere) {
  using T = TypeParam;
  const Index D = 6, B = 3, Tn = 5;
  const Matrix<T> X = random_matrix<T>(B * Tn, D, 2);
  for (const Ratio& r : kRatios) {
    MoHRouting<T> g;
    random_router<T>(D, r, 20 + r.H + r.K).route(X, B, Tn, g);
    for (Index n = 0; n < B * Tn; ++n) {
      Index routed = 0;
      for (Index h = 0; h < r.H; ++h) {
        if (h < r.S) {
          EXPECT_TRUE(g.active(n, h)) << "shared head " << h;
          EXPECT_GT(g.gates(n, h), T(0));
          continue;
        }
        routed += g.active(n, h) ? 1 : 0;
        if (g.active(n, h)) {
          EXPECT_GT(g.gates(n, h), T(0));
        } else {
          EXPECT_EQ(g.gates(n, h), T(0)) << "unpicked head " << h << " must be exactly 0";
        }
      }
      EXPECT_EQ(routed, r.K) << "token " << n;
    }
  }
}

// docs/semantics.md §3: sum of the kept g_r = K (before the mix), sum of g_s = S_h softmax sums =
// S_h, so after the mix the routed gates sum to K a_r and the shared ones to S_h a_s; with one
// group only there is no mix (a = 1).
TYPED_TEST(MoHRouterTest, GateSumsFollowTheMix) {
  using T = TypeParam;
  const Index D = 7, B = 2, Tn = 3;
  const Matrix<T> X = random_matrix<T>(B * Tn, D, 3);
  const Mat Xd = to_ref(X);
  for (const Ratio& r : kRatios) {
    const MoHTwoStageRouter<T> router = random_router<T>(D, r, 30 + r.S, 2.0);
    MoHRouting<T> g;
    router.route(X, B, Tn, g);
    const bool mix = r.S > 0 && r.K > 0;
    EXPECT_EQ(router.mix_weight().size(), mix ? 2 * D : 0);
    for (Index n = 0; n < B * Tn; ++n) {
      const auto [as, ar] = mix ? mix_of(Xd, to_ref(router.mix_weight()), n)
                                : std::pair<double, double>{1.0, 1.0};
      double shared = 0, routed = 0;
      for (Index h = 0; h < r.H; ++h) (h < r.S ? shared : routed) += double(g.gates(n, h));
      EXPECT_NEAR(shared, r.S * as, 10 * Tol<T>::rel) << "S=" << r.S << " K=" << r.K;
      EXPECT_NEAR(routed, r.K * ar, 10 * Tol<T>::rel) << "S=" << r.S << " K=" << r.K;
      if (r.S == 1) {
        EXPECT_NEAR(double(g.gates(n, 0)), as, Tol<T>::rel);
      }
    }
  }
}

TYPED_TEST(MoHRouterTest, KeptHeadsHaveTheLargestProbabilities) {
  using T = TypeParam;
  const Index D = 5, N = 17;
  const Matrix<T> X = random_matrix<T>(N, D, 4);
  const Ratio r{6, 1, 2};
  MoHRouting<T> g;
  random_router<T>(D, r, 40).route(X, 1, N, g);
  for (Index n = 0; n < N; ++n)
    for (Index i = 0; i < r.H - r.S; ++i)
      for (Index j = 0; j < r.H - r.S; ++j)
        if (g.active(n, r.S + i) && !g.active(n, r.S + j)) {
          EXPECT_GE(g.routed_probs(n, i), g.routed_probs(n, j)) << "token " << n;
        }
}

// Zero router weights: p = 1/E for every token and every routed head, so every row is one tie
// and the lowest K routed indices win; every gate is then exactly 1 (K (1/E) / (K/E) = 1 and
// a_s = a_r = 2 * 1/2 = 1). f_i = 1 for i < K, 0 otherwise, P_i = 1/E, so
// L_b = E sum_i f_i P_i = E * K * (1/E) = K.
TYPED_TEST(MoHRouterTest, ZeroWeightsKeepLowestIndicesAndGiveLossK) {
  using T = TypeParam;
  const Index D = 4, B = 2, Tn = 3;
  const Matrix<T> X = random_matrix<T>(B * Tn, D, 5);
  for (const Ratio& r : std::vector<Ratio>{{6, 2, 2}, {4, 0, 1}, {5, 1, 3}}) {
    MoHRouting<T> g;
    MoHTwoStageRouter<T>(D, r.H, r.S, r.K).route(X, B, Tn, g);
    for (Index n = 0; n < B * Tn; ++n)
      for (Index h = 0; h < r.H; ++h) {
        EXPECT_EQ(g.active(n, h), h < r.S + r.K) << "token " << n << " head " << h;
        EXPECT_EQ(g.gates(n, h), h < r.S + r.K ? T(1) : T(0)) << "token " << n << " head " << h;
      }
    EXPECT_NEAR(g.load_balance_loss, T(r.K), 4 * std::numeric_limits<T>::epsilon() * r.K)
        << "S=" << r.S << " K=" << r.K;
  }
}

// Hand-computed load-balance losses with E = 2 routed heads, K = 1, D = 2, no shared head.
// W_r = [[ln 3, 0], [0, ln 3]].
//  * Both tokens x = (1, 0): logits (ln 3, 0), p = (3/4, 1/4), both keep head 0.
//    f = (1, 0), P = (3/4, 1/4): L_b = 2 (1 * 3/4 + 0) = 3/2.
//  * Tokens (1, 0) and (0, 1): p = (3/4, 1/4) keeps head 0, p = (1/4, 3/4) keeps head 1.
//    f = (1/2, 1/2), P = (1/2, 1/2): L_b = 2 (1/4 + 1/4) = 1 = K (balanced).
TYPED_TEST(MoHRouterTest, LoadBalanceLossHandComputed) {
  using T = TypeParam;
  MoHTwoStageRouter<T> router(2, 2, 0, 1);
  router.routed_weight() << T(std::log(3.0)), T(0), T(0), T(std::log(3.0));
  Matrix<T> same(2, 2), split(2, 2);
  same << 1, 0, 1, 0;
  split << 1, 0, 0, 1;
  MoHRouting<T> g;
  router.route(same, 1, 2, g);
  EXPECT_NEAR(g.routed_probs(0, 0), T(0.75), 4 * std::numeric_limits<T>::epsilon());
  EXPECT_EQ(g.head_counts, (std::vector<Index>{2, 0}));
  EXPECT_NEAR(g.load_balance_loss, T(1.5), 8 * std::numeric_limits<T>::epsilon());
  // One routed head kept out of one per token, no mix: the gate is K p / p = 1.
  EXPECT_NEAR(g.gates(0, 0), T(1), 4 * std::numeric_limits<T>::epsilon());
  router.route(split, 2, 1, g);
  EXPECT_EQ(g.head_counts, (std::vector<Index>{1, 1}));
  EXPECT_NEAR(g.load_balance_loss, T(1.0), 8 * std::numeric_limits<T>::epsilon());
}

TYPED_TEST(MoHRouterTest, HeadCountsAndActiveFraction) {
  using T = TypeParam;
  const Index D = 6, B = 2, Tn = 17, N = B * Tn;
  const Matrix<T> X = random_matrix<T>(N, D, 6);
  for (const Ratio& r : kRatios) {
    MoHRouting<T> g;
    random_router<T>(D, r, 60 + r.K).route(X, B, Tn, g);
    ASSERT_EQ(g.head_counts.size(), static_cast<std::size_t>(r.H));
    Index routed_total = 0;
    for (Index h = 0; h < r.H; ++h) {
      Index count = 0;
      for (Index n = 0; n < N; ++n) count += g.active(n, h) ? 1 : 0;
      EXPECT_EQ(g.head_counts[h], count) << "head " << h;
      if (h < r.S) {
        EXPECT_EQ(count, N);
      } else {
        routed_total += count;
      }
    }
    EXPECT_EQ(routed_total, N * r.K);
    moh::MoHConfig c;
    c.num_heads = r.H;
    c.shared_heads = r.S;
    c.active_routed_heads = r.K;
    const double want = static_cast<double>(r.S + r.K) / static_cast<double>(r.H);
    EXPECT_DOUBLE_EQ(g.active_fraction(), want);
    EXPECT_DOUBLE_EQ(c.active_fraction(), want);
    // heads_of lists the active heads in ascending order.
    for (Index b = 0; b < B; ++b)
      for (Index t = 0; t < Tn; ++t) {
        std::vector<Index> want_heads;
        for (Index h = 0; h < r.H; ++h)
          if (g.active(b * Tn + t, h)) want_heads.push_back(h);
        EXPECT_EQ(g.heads_of(b, t), want_heads);
      }
  }
}

// A record routed into before (another shape, other tokens) is resized and fully overwritten:
// it ends up equal to a fresh one.
TYPED_TEST(MoHRouterTest, ReusedRecordEqualsAFreshOne) {
  using T = TypeParam;
  const Index D = 6;
  const Ratio r{5, 1, 2};
  const MoHTwoStageRouter<T> router = random_router<T>(D, r, 75);
  const Matrix<T> big = random_matrix<T>(2 * 17, D, 76), small = random_matrix<T>(3, D, 77);
  MoHRouting<T> reused, fresh;
  router.route(big, 2, 17, reused);
  router.route(small, 1, 3, reused);
  router.route(small, 1, 3, fresh);
  EXPECT_EQ(reused.batch, 1);
  EXPECT_EQ(reused.tokens, 3);
  EXPECT_TRUE(moh_test::BitEqual(reused.gates, fresh.gates));
  EXPECT_TRUE(moh_test::BitEqual(reused.routed_probs, fresh.routed_probs));
  EXPECT_TRUE(reused.active == fresh.active);
  EXPECT_EQ(reused.head_counts, fresh.head_counts);
  EXPECT_EQ(reused.load_balance_loss, fresh.load_balance_loss);
}

// Routing over a pool gives the same bits as on the calling thread.
TYPED_TEST(MoHRouterTest, PoolDoesNotChangeBits) {
  using T = TypeParam;
  const Index D = 300, N = 300;  // several linear tiles
  const Matrix<T> X = random_matrix<T>(N, D, 8);
  const Ratio r{8, 2, 3};
  const MoHTwoStageRouter<T> router = random_router<T>(D, r, 80, 0.1);
  MoHRouting<T> base;
  router.route(X, 2, N / 2, base);
  for (int threads : {1, 2, 3}) {
    moh::ThreadPool pool(threads);
    MoHRouting<T> g;
    router.route(X, 2, N / 2, g, &pool);
    EXPECT_EQ(std::memcmp(g.gates.data(), base.gates.data(), g.gates.size() * sizeof(T)), 0);
    EXPECT_EQ(g.load_balance_loss, base.load_balance_loss);
  }
}

// ---- query-norm router (docs/semantics.md §4) ---------------------------------------------------

TYPED_TEST(MoHRouterTest, QueryNormMatchesReference) {
  using T = TypeParam;
  const Index d = 5, B = 2, Tn = 17;
  for (const Ratio& r : std::vector<Ratio>{{6, 2, 2}, {4, 0, 1}, {5, 1, 3}, {4, 2, 0}}) {
    const Matrix<T> Q = random_matrix<T>(B * Tn, r.H * d, 90 + r.H);
    MoHRouting<T> g;
    moh::route_by_query_norm<T>(Q, B, Tn, r.H, d, r.S, r.K, g);
    const moh_ref::MoHGates want = moh_ref::naive_moh_gates_query_norm(
        to_ref(Q), static_cast<int>(r.H), static_cast<int>(d), static_cast<int>(r.S),
        static_cast<int>(r.K));
    EXPECT_LE(relative_error(to_ref(g.routed_probs), want.probs), Tol<T>::rel);
    for (Index n = 0; n < B * Tn; ++n)
      for (Index h = 0; h < r.H; ++h) {
        ASSERT_EQ(g.active(n, h), want.active[n][h]) << "token " << n << " head " << h;
        EXPECT_EQ(g.gates(n, h), g.active(n, h) ? T(1) : T(0)) << "gates are a 0/1 mask";
      }
    EXPECT_NEAR(g.load_balance_loss, want.load_balance_loss,
                Tol<T>::rel * std::max(1.0, want.load_balance_loss));
  }
}

// z = l / std(l) does not change when every query is scaled by the same factor.
TYPED_TEST(MoHRouterTest, QueryNormIsScaleInvariant) {
  using T = TypeParam;
  const Index d = 3, H = 6, S = 1, K = 2, N = 17;
  const Matrix<T> Q = random_matrix<T>(N, H * d, 100);
  const Matrix<T> Q4 = Q * T(4);  // a power of two: exact in floating point
  MoHRouting<T> a, b;
  moh::route_by_query_norm<T>(Q, 1, N, H, d, S, K, a);
  moh::route_by_query_norm<T>(Q4, 1, N, H, d, S, K, b);
  EXPECT_TRUE(a.active == b.active);
  EXPECT_LE(relative_error(to_ref(b.routed_probs), to_ref(a.routed_probs)), Tol<T>::rel);
}

// Every routed head with the same norm (permuted copies of one vector): std(l) = 0. The library
// documents z = 0 then (docs/semantics.md leaves 0/0 open): p is uniform and ties go to the lower
// index.
TYPED_TEST(MoHRouterTest, QueryNormEqualNormsKeepLowestIndices) {
  using T = TypeParam;
  const Index d = 3, H = 5, S = 1, K = 2;
  Matrix<T> Q(1, H * d);
  Q << 9, 9, 9, 1, 2, 3, 3, 1, 2, 2, 3, 1, -1, -2, -3;
  MoHRouting<T> g;
  moh::route_by_query_norm<T>(Q, 1, 1, H, d, S, K, g);
  EXPECT_EQ(g.heads_of(0, 0), (std::vector<Index>{0, 1, 2}));
  for (Index e = 0; e < H - S; ++e) EXPECT_NEAR(g.routed_probs(0, e), T(0.25), T(1e-6));
}

// The layer routes on queries before RoPE (docs/semantics.md §4): its record equals the reference
// router applied to Linear(x; W_q, b_q). (RoPE is a rotation per head, so it would keep the norms
// in exact arithmetic; the check is that the layer routes on the right queries at all, including a
// large position offset.)
TYPED_TEST(MoHRouterTest, LayerQueryNormRoutesOnPreRopeQueries) {
  using T = TypeParam;
  const moh::MoHAttention<T> m(
      moh_test::moh_config(8, 6, 2, 2, moh::MoHRouterKind::QueryNorm, 2, 4, true, /*rope=*/true),
      110);
  const moh::Tensor3<T> x = random_tensor<T>(2, 17, 8, 111);
  const moh_ref::MoHGates want = moh_ref::naive_moh_gates_query_norm(
      moh_ref::naive_queries(moh_test::weights_of(m), to_ref(x)), 6, 4, 2, 2);
  for (moh::ComputeMode mode : moh_test::kModes) {
    moh::ForwardOptions o = moh_test::in_mode(mode);
    o.position_offset = 1000;
    MoHRouting<T> g;
    moh_test::run(m, x, o, &g);
    EXPECT_LE(relative_error(to_ref(g.routed_probs), want.probs), Tol<T>::rel);
    for (Index n = 0; n < 34; ++n)
      for (Index h = 0; h < 6; ++h) ASSERT_EQ(g.active(n, h), want.active[n][h]);
  }
}

// The learned router's logits are dot products per token (detail::project_dots), so a token's
// gates and probabilities are the same bits whether it is routed with many others (a prefill),
// alone (a decode step) or on any number of threads: decode routes as the full forward did.
TEST(MoHTwoStageRouterBits, ATokenRoutesTheSameAloneAsInABatch) {
  const Index D = 200, H = 12, S = 3, K = 4, T = 150;  // three blocks of rows on the pool
  MoHTwoStageRouter<float> router(D, H, S, K);
  router.routed_weight() = random_matrix<float>(H - S, D, 61);
  router.shared_weight() = random_matrix<float>(S, D, 62);
  router.mix_weight() = random_matrix<float>(2, D, 63);
  const Matrix<float> X = random_matrix<float>(T, D, 64);
  MoHRouting<float> all, threaded;
  router.route(X, 1, T, all);
  moh::ThreadPool pool(3);
  router.route(X, 1, T, threaded, &pool);
  EXPECT_TRUE(moh_test::BitEqual(threaded.gates, all.gates));
  EXPECT_TRUE(moh_test::BitEqual(threaded.routed_probs, all.routed_probs));
  for (Index t = 0; t < T; ++t) {
    MoHRouting<float> one;
    router.route(X.middleRows(t, 1), 1, 1, one);
    EXPECT_TRUE(moh_test::BitEqual(one.gates, Matrix<float>(all.gates.row(t)))) << "token " << t;
    EXPECT_TRUE(moh_test::BitEqual(one.routed_probs, Matrix<float>(all.routed_probs.row(t))))
        << "token " << t;
  }
}

}  // namespace
