// Tests for the MoA router (moa_router.hpp, docs/semantics.md §5): selection, gates (default and
// JetMoE), and the switch, z and cv losses, on hand-computed cases and against the naive reference.
#include "moh/layers/moa_router.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <set>
#include <vector>

#include "reference/naive.hpp"
#include "test_helpers.hpp"

namespace {

using moh::Index;
using moh::Matrix;
using moh::MoAGating;
using moh::MoARouting;
using moh_ref::to_ref;
using moh_test::random_matrix;
using moh_test::relative_error;
using moh_test::Tol;

template <class T>
class MoARouterTest : public ::testing::Test {
 protected:
  // A few ulps of T around values of order 1.
  static T eps() { return 8 * std::numeric_limits<T>::epsilon(); }
  /// route_moa of `logits` for `batch` sequences of `tokens`, keeping `k` experts.
  static MoARouting<T> route(const Matrix<T>& logits, Index batch, Index tokens, Index k,
                             MoAGating gating = MoAGating::Softmax) {
    MoARouting<T> r;
    moh::route_moa<T>(logits, batch, tokens, k, gating, r);
    return r;
  }
  /// Two tokens with logits (ln 3, 0) and (0, 0) over E = 2 experts.
  static Matrix<T> two_token_logits() {
    Matrix<T> logits(2, 2);
    logits << T(std::log(3.0)), T(0), T(0), T(0);
    return logits;
  }
};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(MoARouterTest, Scalars);

// E = 2, k = 1, two tokens with logits (ln 3, 0) and (0, 0):
//   p_0 = (3/4, 1/4), p_1 = (1/2, 1/2); token 0 picks expert 0, token 1 ties and picks the lower
//   index, expert 0. c = (2, 0), gates (3/4, 0) and (1/2, 0).
//   switch = 2 [ (5/4) / 2 * 2/2 + (3/4) / 2 * 0 ] = 5/4
//   z      = [ ln(3 + 1)^2 + ln(1 + 1)^2 ] / 2 = [ 4 ln^2 2 + ln^2 2 ] / 2 = 5/2 ln^2 2
//   G = (3/4 + 1/2, 0) = (5/4, 0) -> normalised (1, 0); mean 1/2;
//   unbiased var = (1/4 + 1/4) / 1 = 1/2; cv = (1/2) / (1/4 + 1e-10).
TYPED_TEST(MoARouterTest, HandComputedTopOne) {
  using T = TypeParam;
  const MoARouting<T> r = this->route(this->two_token_logits(), 1, 2, 1);
  EXPECT_EQ(r.selected(0, 0), 0);
  EXPECT_EQ(r.selected(1, 0), 0) << "tie: the lower index wins";
  EXPECT_EQ(r.expert_counts, (std::vector<Index>{2, 0}));
  EXPECT_NEAR(r.gates(0, 0), T(0.75), this->eps());
  EXPECT_NEAR(r.gates(1, 0), T(0.5), this->eps());
  EXPECT_EQ(r.gates(0, 1), T(0));
  EXPECT_EQ(r.gates(1, 1), T(0));
  const double ln2 = std::log(2.0);
  EXPECT_NEAR(r.switch_loss, T(1.25), this->eps());
  EXPECT_NEAR(r.z_loss, T(2.5 * ln2 * ln2), this->eps());
  EXPECT_NEAR(r.cv_loss, T(0.5 / (0.25 + 1e-10)), this->eps());
}

// Same logits, k = 2 = E: c = (2, 2).
//   switch = 2 [ (5/4)/2 * 1/2 + (3/4)/2 * 1/2 ] = 2 (5/16 + 3/16) = 1
//   G = (3/4 + 1/2, 1/4 + 1/2) = (5/4, 3/4) -> (5/8, 3/8); mean 1/2;
//   var = (1/64 + 1/64) / 1 = 1/32; cv = (1/32) / (1/4 + 1e-10).
TYPED_TEST(MoARouterTest, HandComputedTopTwo) {
  using T = TypeParam;
  const MoARouting<T> r = this->route(this->two_token_logits(), 2, 1, 2);
  EXPECT_EQ(r.expert_counts, (std::vector<Index>{2, 2}));
  EXPECT_NEAR(r.gates(0, 1), T(0.25), this->eps());
  EXPECT_NEAR(r.switch_loss, T(1), this->eps());
  EXPECT_NEAR(r.cv_loss, T((1.0 / 32) / (0.25 + 1e-10)), this->eps());
}

// E = 3, k = 2, logits (ln 2, ln 6, 0): p = (2, 6, 1) / 9, the top two are experts 1 and 0.
//   default: gates (2/9, 6/9, 0), summing to 8/9 (not renormalised);
//   JetMoE:  softmax over the kept logits (ln 6, ln 2) = (6/8, 2/8) -> gates (1/4, 3/4, 0).
TYPED_TEST(MoARouterTest, HandComputedGatingConventions) {
  using T = TypeParam;
  Matrix<T> logits(1, 3);
  logits << T(std::log(2.0)), T(std::log(6.0)), T(0);
  const MoARouting<T> def = this->route(logits, 1, 1, 2);
  const MoARouting<T> jet = this->route(logits, 1, 1, 2, MoAGating::TopKSoftmax);
  EXPECT_NEAR(def.gates(0, 0), T(2.0 / 9), this->eps());
  EXPECT_NEAR(def.gates(0, 1), T(6.0 / 9), this->eps());
  EXPECT_EQ(def.gates(0, 2), T(0));
  EXPECT_NEAR(def.gates.sum(), T(8.0 / 9), this->eps());
  EXPECT_NEAR(jet.gates(0, 0), T(0.25), this->eps());
  EXPECT_NEAR(jet.gates(0, 1), T(0.75), this->eps());
  EXPECT_EQ(jet.gates(0, 2), T(0));
  // p (and so the losses) is the softmax over all experts in both conventions.
  EXPECT_NEAR(jet.probs(0, 2), T(1.0 / 9), this->eps());
  EXPECT_EQ(jet.z_loss, def.z_loss);
}

TYPED_TEST(MoARouterTest, MatchesReference) {
  using T = TypeParam;
  const Index B = 2, Tn = 17, E = 5;
  const Matrix<T> logits = random_matrix<T>(B * Tn, E, 1, 3.0);
  for (MoAGating gating : {MoAGating::Softmax, MoAGating::TopKSoftmax})
    for (Index k : {1, 2, 5}) {
      const MoARouting<T> r = this->route(logits, B, Tn, k, gating);
      const moh_ref::MoARoute want = moh_ref::naive_moa_route(
          to_ref(logits), static_cast<int>(k), gating == MoAGating::TopKSoftmax);
      EXPECT_LE(relative_error(to_ref(r.probs), want.probs), Tol<T>::rel);
      EXPECT_LE(relative_error(to_ref(r.gates), want.gates), Tol<T>::rel);
      for (Index n = 0; n < B * Tn; ++n) {
        std::set<Index> got, expected(want.selected[n].begin(), want.selected[n].end());
        for (Index s = 0; s < k; ++s) got.insert(r.selected(n, s));
        EXPECT_EQ(got, expected) << "token " << n;
      }
      for (Index e = 0; e < E; ++e) EXPECT_EQ(r.expert_counts[e], want.counts[e]);
      EXPECT_NEAR(r.switch_loss, want.switch_loss, Tol<T>::rel * want.switch_loss);
      EXPECT_NEAR(r.z_loss, want.z_loss, Tol<T>::rel * want.z_loss);
      EXPECT_NEAR(r.cv_loss, want.cv_loss, Tol<T>::rel * std::max(1.0, want.cv_loss));
    }
}

TYPED_TEST(MoARouterTest, ExactlyKDistinctExpertsAndZeroGatesElsewhere) {
  using T = TypeParam;
  const Index N = 17, E = 6;
  const Matrix<T> logits = random_matrix<T>(N, E, 2, 2.0);
  for (MoAGating gating : {MoAGating::Softmax, MoAGating::TopKSoftmax})
    for (Index k : {1, 3, 6}) {
      const MoARouting<T> r = this->route(logits, 1, N, k, gating);
      ASSERT_EQ(r.selected.rows(), N);
      ASSERT_EQ(r.selected.cols(), k);
      Index total = 0;
      for (Index e = 0; e < E; ++e) total += r.expert_counts[e];
      EXPECT_EQ(total, N * k);
      EXPECT_DOUBLE_EQ(r.active_fraction(), static_cast<double>(k) / E);
      for (Index n = 0; n < N; ++n) {
        std::set<Index> sel;
        for (Index s = 0; s < k; ++s) sel.insert(r.selected(n, s));
        EXPECT_EQ(static_cast<Index>(sel.size()), k) << "distinct experts";
        T sum = 0;
        for (Index e = 0; e < E; ++e) {
          if (sel.count(e)) {
            EXPECT_GT(r.gates(n, e), T(0));
            // The kept experts are the largest p (and the largest logits).
            for (Index o = 0; o < E; ++o)
              if (!sel.count(o)) {
                EXPECT_GE(r.probs(n, e), r.probs(n, o));
              }
          } else {
            EXPECT_EQ(r.gates(n, e), T(0)) << "unselected expert " << e;
          }
          sum += r.gates(n, e);
        }
        if (gating == MoAGating::TopKSoftmax) {
          EXPECT_NEAR(sum, T(1), this->eps()) << "JetMoE gates sum to 1";
        } else if (k < E) {
          EXPECT_LT(sum, T(1) - T(1e-3)) << "default gates are not renormalised";
        } else {
          EXPECT_NEAR(sum, T(1), this->eps());
        }
      }
    }
}

// p uniform (all logits equal): switch = E sum_e (1/E) (c_e / sum c) = sum_e c_e / sum c = 1,
// whatever the ties did to c; and z = (ln E + l)^2 for constant logits l.
TYPED_TEST(MoARouterTest, UniformProbabilitiesGiveSwitchLossOne) {
  using T = TypeParam;
  const Index N = 5, E = 4;
  const Matrix<T> logits = Matrix<T>::Constant(N, E, T(0.5));
  const MoARouting<T> r = this->route(logits, 1, N, 2);
  EXPECT_NEAR(r.switch_loss, T(1), this->eps());
  // Ties go to the lower indices: every token picks experts 0 and 1. (Checked element by element:
  // GCC 12.2 with AVX-512 miscompiles std::vector<long>{5, 5, 0, 0} here into {5, 5, 5, 5}.)
  ASSERT_EQ(r.expert_counts.size(), 4u);
  EXPECT_EQ(r.expert_counts[0], N);
  EXPECT_EQ(r.expert_counts[1], N);
  EXPECT_EQ(r.expert_counts[2], 0);
  EXPECT_EQ(r.expert_counts[3], 0);
  const double lse = std::log(4.0) + 0.5;
  EXPECT_NEAR(r.z_loss, T(lse * lse), this->eps());
  // G = (N/4, N/4, 0, 0) normalised = (1/2, 1/2, 0, 0), mean 1/4,
  // var = (1/16 * 4) / 3 = 1/12, cv = (1/12) / (1/16 + 1e-10).
  EXPECT_NEAR(r.cv_loss, T((1.0 / 12) / (1.0 / 16 + 1e-10)), this->eps());
}

// Logits of 1000: an unshifted exp would overflow; lse = 1000 + ln 2, z = lse^2.
TYPED_TEST(MoARouterTest, ZLossIsStableForLargeLogits) {
  using T = TypeParam;
  Matrix<T> logits(1, 2);
  logits << T(1000), T(1000);
  const MoARouting<T> r = this->route(logits, 1, 1, 1);
  ASSERT_TRUE(std::isfinite(r.z_loss));
  const double lse = 1000 + std::log(2.0);
  EXPECT_NEAR(r.z_loss, T(lse * lse), 1e-5 * lse * lse);
  EXPECT_NEAR(r.probs(0, 0), T(0.5), this->eps());
}

// One expert: p = 1, the gate is 1, switch = 1 * (N/N) * (N/N) = 1; the variance of one value is
// undefined and the library documents cv = 0.
TYPED_TEST(MoARouterTest, SingleExpert) {
  using T = TypeParam;
  const Matrix<T> logits = random_matrix<T>(3, 1, 3);
  const MoARouting<T> r = this->route(logits, 1, 3, 1);
  for (Index n = 0; n < 3; ++n) EXPECT_EQ(r.gates(n, 0), T(1));
  EXPECT_NEAR(r.switch_loss, T(1), this->eps());
  EXPECT_EQ(r.cv_loss, T(0));
}

}  // namespace
