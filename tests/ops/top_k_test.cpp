// Tests for moh/ops/top_k.hpp: descending order, ties to the lower index, k = 0 and k = n, the error on
// k outside [0, n], and a sweep against a stable-sort reference.
#include "moh/ops/top_k.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include "test_helpers.hpp"

namespace {

using moh::Index;
using moh_test::error_of;
using moh_test::Mentions;

std::vector<Index> run_top_k(const std::vector<double>& x, Index k) {
  std::vector<Index> out(static_cast<std::size_t>(k), -1);
  moh::top_k(x.data(), static_cast<Index>(x.size()), k, out.data());
  return out;
}

/// Reference: indices stably sorted by value descending (equal values keep index order), first k.
std::vector<Index> reference_top_k(const std::vector<double>& x, Index k) {
  std::vector<Index> idx(x.size());
  std::iota(idx.begin(), idx.end(), Index(0));
  std::stable_sort(idx.begin(), idx.end(), [&](Index a, Index b) { return x[a] > x[b]; });
  idx.resize(static_cast<std::size_t>(k));
  return idx;
}

TEST(TopK, LargestFirst) {
  // Values by index: 0.1 0.5 0.3 0.9 0.2 -> sorted: 0.9 (3), 0.5 (1), 0.3 (2), 0.2 (4), 0.1 (0).
  const std::vector<double> x = {0.1, 0.5, 0.3, 0.9, 0.2};
  EXPECT_EQ(run_top_k(x, 3), (std::vector<Index>{3, 1, 2}));
  EXPECT_EQ(run_top_k(x, 1), (std::vector<Index>{3}));
  // Negative values and the largest at the end.
  const std::vector<double> y = {-3.0, -1.0, -2.0, 7.0};
  EXPECT_EQ(run_top_k(y, 2), (std::vector<Index>{3, 1}));
}

TEST(TopK, TiesGoToLowerIndex) {
  const std::vector<double> equal = {1.0, 1.0, 1.0, 1.0};
  EXPECT_EQ(run_top_k(equal, 2), (std::vector<Index>{0, 1}));
  EXPECT_EQ(run_top_k(equal, 4), (std::vector<Index>{0, 1, 2, 3}));
  // Two tied maxima (1, 3) come in index order; among the three 0.5s index 0 wins the last slot.
  const std::vector<double> x = {0.5, 0.9, 0.5, 0.9, 0.5};
  EXPECT_EQ(run_top_k(x, 3), (std::vector<Index>{1, 3, 0}));
  EXPECT_EQ(run_top_k(x, 4), (std::vector<Index>{1, 3, 0, 2}));
  // A tie that appears after the slots are full must not displace the earlier index.
  const std::vector<double> z = {0.2, 0.7, 0.1, 0.7, 0.7};
  EXPECT_EQ(run_top_k(z, 2), (std::vector<Index>{1, 3}));
  // Float: ties in the kind of row a router sees (uniform softmax of zero logits).
  const std::vector<float> f = {0.25f, 0.25f, 0.25f, 0.25f};
  Index out[2] = {-1, -1};
  moh::top_k(f.data(), 4, 2, out);
  EXPECT_EQ(out[0], 0);
  EXPECT_EQ(out[1], 1);
}

TEST(TopK, KZeroWritesNothing) {
  const std::vector<double> x = {3.0, 1.0, 2.0};
  Index out[2] = {-7, -7};
  moh::top_k(x.data(), 3, 0, out);
  EXPECT_EQ(out[0], -7);
  EXPECT_EQ(out[1], -7);
  moh::top_k(x.data(), 0, 0, out);  // empty row, k = 0: fine
  EXPECT_EQ(out[0], -7);
}

TEST(TopK, KEqualsNIsFullDescendingPermutation) {
  const std::vector<double> x = {0.4, -1.0, 2.0, 0.4, 3.5, 0.0};
  // 3.5 (4), 2.0 (2), 0.4 (0), 0.4 (3), 0.0 (5), -1.0 (1).
  EXPECT_EQ(run_top_k(x, 6), (std::vector<Index>{4, 2, 0, 3, 5, 1}));
  EXPECT_EQ(run_top_k({42.0}, 1), (std::vector<Index>{0}));
}

TEST(TopK, KOutsideRangeThrowsNamingBothNumbers) {
  const std::vector<double> x = {1.0, 2.0, 3.0, 4.0};
  std::vector<Index> out(16, -3);
  // k = 7 > n = 4: the message names both numbers (error_of fails the test if nothing is thrown).
  EXPECT_TRUE(Mentions(error_of([&] { moh::top_k(x.data(), 4, 7, out.data()); }),
                       {"4", "7", "top_k"}));
  EXPECT_TRUE(Mentions(error_of([&] { moh::top_k(x.data(), 4, 5, out.data()); }),
                       {"<= 4", "got 5"}));
  EXPECT_EQ(out, std::vector<Index>(16, -3));  // checked before anything is written
  EXPECT_THROW(moh::top_k(x.data(), 4, -1, out.data()), moh::Error);
  EXPECT_THROW(moh::top_k(x.data(), 0, 1, out.data()), moh::Error);
  // moh::Error is a std::invalid_argument.
  EXPECT_THROW(moh::top_k(x.data(), 4, 9, out.data()), std::invalid_argument);
}

TEST(TopK, RandomRowsWithManyTiesMatchStableSort) {
  std::mt19937 rng(1234);
  std::uniform_int_distribution<int> value(0, 4);  // few distinct values: many ties
  for (int trial = 0; trial < 300; ++trial) {
    const Index n = 1 + trial % 13;
    std::vector<double> x(static_cast<std::size_t>(n));
    for (double& v : x) v = 0.25 * value(rng);
    for (Index k = 0; k <= n; ++k)
      ASSERT_EQ(run_top_k(x, k), reference_top_k(x, k)) << "trial " << trial << " n " << n
                                                        << " k " << k;
  }
}

}  // namespace
