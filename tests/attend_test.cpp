// Tests for moh/detail/attend.hpp's HeadPlan: the two builders (from an activity mask, and from
// each row's k picked heads) give the same plan, grouped by head with each head's rows ascending.
#include "moh/detail/attend.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

namespace {

using moh::Index;

TEST(HeadPlan, PickedAndMaskBuildersAgree) {
  const Index batch = 3, tokens = 11, heads = 9, k = 3, n = batch * tokens;
  std::mt19937 rng(5);
  std::vector<Index> picks(static_cast<std::size_t>(n * k));  // k distinct heads per row, any order
  std::vector<float> gate(static_cast<std::size_t>(n * heads), 0.0f);
  for (Index r = 0; r < n; ++r) {
    std::vector<Index> all(static_cast<std::size_t>(heads));
    std::iota(all.begin(), all.end(), Index(0));
    std::shuffle(all.begin(), all.end(), rng);
    for (Index s = 0; s < k; ++s) {
      picks[r * k + s] = all[s];
      gate[r * heads + all[s]] = 0.5f + static_cast<float>(r * heads + all[s]);
    }
  }
  moh::detail::HeadPlan<float> masked, picked;
  masked.build(heads, batch, tokens, [&](Index r, Index h) { return gate[r * heads + h] != 0.0f; },
               [&](Index r, Index h) { return gate[r * heads + h]; });
  picked.build_picked(heads, batch, tokens, k, [&](Index r, Index s) { return picks[r * k + s]; },
                      [&](Index r, Index h) { return gate[r * heads + h]; });
  EXPECT_EQ(picked.pairs(), n * k);
  EXPECT_EQ(picked.offsets, masked.offsets);
  EXPECT_EQ(picked.rows, masked.rows);
  EXPECT_EQ(picked.positions, masked.positions);
  EXPECT_EQ(picked.gates, masked.gates);
  for (Index h = 0; h < heads; ++h) {
    const auto first = picked.rows.begin() + picked.offsets[h];
    const auto last = picked.rows.begin() + picked.offsets[h + 1];
    EXPECT_TRUE(std::is_sorted(first, last)) << "head " << h;
    for (auto it = first; it != last; ++it) EXPECT_NE(gate[*it * heads + h], 0.0f);
  }
  for (Index i = 0; i < picked.pairs(); ++i) EXPECT_EQ(picked.positions[i], picked.rows[i] % tokens);
}

}  // namespace
