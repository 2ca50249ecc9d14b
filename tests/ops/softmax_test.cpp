// Tests for moh/ops/softmax.hpp: stability with huge values, -inf handling (a fully hidden row is
// zeros, never NaN), agreement with the textbook formula, row-wise use on strided blocks,
// and softmax_lse (the softmax and the log-sum-exp of the input in one pass).
#include "moh/ops/softmax.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "test_helpers.hpp"

namespace {

constexpr float kInfF = std::numeric_limits<float>::infinity();
constexpr double kInf = std::numeric_limits<double>::infinity();

TEST(Softmax, HugeValuesDoNotOverflow) {
  // exp(1e30) overflows; after subtracting the max the row is exp(0) = 1 and exp(-2e30) = 0.
  std::vector<float> x = {1e30f, -1e30f, 0.0f};
  moh::softmax(x.data(), 3);
  EXPECT_EQ(x[0], 1.0f);
  EXPECT_EQ(x[1], 0.0f);
  EXPECT_EQ(x[2], 0.0f);

  // Two equal huge maxima share the mass: 1 / (1 + 1).
  std::vector<float> y = {1e30f, 1e30f};
  moh::softmax(y.data(), 2);
  EXPECT_EQ(y[0], 0.5f);
  EXPECT_EQ(y[1], 0.5f);

  // Hugely negative but finite: still a distribution, the max entry gets exp(0) / sum.
  std::vector<double> z = {-1e300, -1e300 + 1e285, -1e300};
  moh::softmax(z.data(), 3);
  EXPECT_EQ(z[1], 1.0);  // the others are exp(-1e285) = 0
  EXPECT_EQ(z[0] + z[2], 0.0);
}

TEST(Softmax, ShiftInvariantAndMatchesFormula) {
  // softmax(x + c) = softmax(x); for small x it is exp(x_i) / sum exp(x_j) computed directly.
  const std::vector<double> base = {0.3, -1.2, 2.5, 0.0, -0.7, 1.1, 3.0};
  double sum = 0;
  for (double v : base) sum += std::exp(v);
  for (double shift : {0.0, 700.0, -800.0, 1e6}) {
    std::vector<double> x = base;
    for (double& v : x) v += shift;
    moh::softmax(x.data(), static_cast<moh::Index>(x.size()));
    double total = 0;
    for (std::size_t i = 0; i < x.size(); ++i) {
      // Adding the shift rounds each input to the ulp of |shift| (1e-13 at 700, 1e-10 at 1e6);
      // the probabilities follow within that.
      const double tol = shift == 0.0 ? 1e-15 : std::abs(shift) * 1e-15;
      EXPECT_NEAR(x[i], std::exp(base[i]) / sum, tol) << "shift " << shift;
      total += x[i];
    }
    EXPECT_NEAR(total, 1.0, 1e-15);
  }
}

TEST(Softmax, AllNegativeInfinityRowIsZeros) {
  std::vector<float> x(5, -kInfF);
  moh::softmax(x.data(), 5);
  for (float v : x) {
    EXPECT_FALSE(std::isnan(v));
    EXPECT_EQ(v, 0.0f);
  }
  std::vector<double> single = {-kInf};
  moh::softmax(single.data(), 1);
  EXPECT_EQ(single[0], 0.0);
}

TEST(Softmax, PartialNegativeInfinityGetsExactZero) {
  // Visible entries 0 and ln 3: exp gives 1 and 3, so 1/4 and 3/4; hidden entries are 0 exactly.
  std::vector<double> x = {-kInf, 0.0, -kInf, std::log(3.0), -kInf};
  moh::softmax(x.data(), 5);
  EXPECT_EQ(x[0], 0.0);
  EXPECT_EQ(x[2], 0.0);
  EXPECT_EQ(x[4], 0.0);
  EXPECT_NEAR(x[1], 0.25, 1e-15);
  EXPECT_NEAR(x[3], 0.75, 1e-15);

  // A -inf next to a huge finite value: the finite one takes everything.
  std::vector<float> y = {-kInfF, 1e30f};
  moh::softmax(y.data(), 2);
  EXPECT_EQ(y[0], 0.0f);
  EXPECT_EQ(y[1], 1.0f);
}

TEST(Softmax, EmptyAndSingleEntry) {
  float sentinel = 42.0f;
  moh::softmax(&sentinel, 0);  // n = 0 touches nothing
  EXPECT_EQ(sentinel, 42.0f);
  double one = -123.0;
  moh::softmax(&one, 1);
  EXPECT_EQ(one, 1.0);
}

/// softmax_lse's log-sum-exp of a copy of `x` (the copy becomes the softmax).
template <class T>
T lse_of(std::vector<T> x, moh::Index n) {
  return moh::softmax_lse(x.data(), n);
}

TEST(SoftmaxLse, LogSumExpIsStableAndExact) {
  // log(1 + 2 + 3) = log 6.
  const std::vector<double> small = {0.0, std::log(2.0), std::log(3.0)};
  EXPECT_NEAR(lse_of(small, 3), std::log(6.0), 1e-15);
  // exp(1000) overflows a double; the max trick gives 1000 + log 2.
  const std::vector<double> big = {1000.0, 1000.0};
  EXPECT_NEAR(lse_of(big, 2), 1000.0 + std::log(2.0), 1e-12);
  // float: 1e30 + log 2 rounds to 1e30, and no overflow to inf.
  const std::vector<float> huge = {1e30f, 1e30f, -1e30f};
  const float lse = lse_of(huge, 3);
  EXPECT_TRUE(std::isfinite(lse));
  EXPECT_EQ(lse, 1e30f);
  // Very negative: -1000 + log 2, where exp(-1000) would underflow to 0 and log(0) = -inf.
  const std::vector<double> neg = {-1000.0, -1000.0};
  EXPECT_NEAR(lse_of(neg, 2), -1000.0 + std::log(2.0), 1e-12);
}

TEST(SoftmaxLse, NegativeInfinityEntries) {
  // -inf entries contribute exp(-inf) = 0: lse(-inf, 0, -inf) = log 1 = 0.
  const std::vector<double> partial = {-kInf, 0.0, -kInf};
  EXPECT_EQ(lse_of(partial, 3), 0.0);
  const std::vector<double> hidden = {-kInf, -kInf};
  EXPECT_EQ(lse_of(hidden, 2), -kInf);
  EXPECT_EQ(lse_of(hidden, 0), -kInf);
  // softmax(x) = exp(x - lse(x)) on a random row.
  moh::Matrix<double> row = moh_test::random_matrix<double>(1, 9, 5, 4.0);
  const double lse = lse_of(std::vector<double>(row.data(), row.data() + 9), 9);
  moh::Matrix<double> p = row;
  moh::softmax(p.data(), 9);
  for (int i = 0; i < 9; ++i) EXPECT_NEAR(p(0, i), std::exp(row(0, i) - lse), 1e-15);
}

}  // namespace

namespace {

// softmax_lse: the same probabilities as the textbook formula and the log-sum-exp of the input,
// on rows long enough for the vectorised exp, with and without hidden entries.
TEST(SoftmaxLse, ProbabilitiesAndLogSumExpOfTheInput) {
  for (int n : {1, 7, 16, 33, 64}) {
    for (bool hide : {false, true}) {
      std::vector<float> x(static_cast<std::size_t>(n));
      for (int i = 0; i < n; ++i) x[i] = 3.0f * std::sin(0.7f * static_cast<float>(i) + 0.3f);
      if (hide && n > 1) x[1] = -kInfF;
      std::vector<float> p = x;
      const float lse = moh::softmax_lse(p.data(), n);
      double sum = 0;
      for (float v : x) sum += v == -kInfF ? 0.0 : std::exp(static_cast<double>(v));
      EXPECT_NEAR(lse, std::log(sum), 1e-5) << "n=" << n;
      for (int i = 0; i < n; ++i) {
        const double want = x[i] == -kInfF ? 0.0 : std::exp(static_cast<double>(x[i])) / sum;
        EXPECT_NEAR(p[i], want, 1e-6) << "n=" << n << " i=" << i;
        if (x[i] == -kInfF) {
          EXPECT_EQ(p[i], 0.0f);
        }
      }
    }
  }
  std::vector<float> hidden = {-kInfF, -kInfF};
  EXPECT_EQ(moh::softmax_lse(hidden.data(), 2), -kInfF);
  EXPECT_EQ(hidden, (std::vector<float>{0.0f, 0.0f}));
}

}  // namespace

namespace {

// A row's bits do not depend on its address (router rows lie at every alignment in a matrix),
// and entries far below the max get what std::exp gives (0 below float's range).
TEST(SoftmaxLse, SameBitsAtAnyAddressAndFarEntriesLikeStdExp) {
  std::vector<float> base(40);
  for (std::size_t i = 0; i < base.size(); ++i) base[i] = std::cos(1.3f * static_cast<float>(i));
  std::vector<float> first;
  for (int shift = 0; shift < 16; ++shift) {
    std::vector<float> buf(base.size() + 16, 0.0f);
    std::copy(base.begin(), base.end(), buf.begin() + shift);
    const float lse = moh::softmax_lse(buf.data() + shift, static_cast<moh::Index>(base.size()));
    std::vector<float> row(buf.begin() + shift, buf.begin() + shift + 40);
    row.push_back(lse);
    if (shift == 0) first = row;
    EXPECT_EQ(std::memcmp(row.data(), first.data(), row.size() * sizeof(float)), 0) << shift;
  }
  std::vector<float> far = {0.0f, -1e9f, -200.0f, 1.0f};
  moh::softmax_lse(far.data(), 4);
  EXPECT_EQ(far[1], 0.0f);
  EXPECT_EQ(far[2], 0.0f);  // exp(-201) is below float's range
  EXPECT_NEAR(far[3], 1.0 / (1.0 + std::exp(-1.0)), 1e-6);
}

}  // namespace
