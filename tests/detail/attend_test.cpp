// Tests for moh/detail/attend.hpp's HeadPlan: the two builders (from an activity mask, and from
// each row's k picked heads) give the same plan, grouped by head with each head's rows ascending,
// in the arena they were built in.
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
  moh::detail::Arena arena;
  const moh::detail::Arena::Scope scope(arena);
  moh::detail::HeadPlan<float> masked, picked;
  masked.build(arena, heads, batch, tokens,
               [&](Index r, Index h) { return gate[r * heads + h] != 0.0f; },
               [&](Index r, Index h) { return gate[r * heads + h]; });
  picked.build_picked(arena, heads, batch, tokens, k,
                      [&](Index r, Index s) { return picks[r * k + s]; },
                      [&](Index r, Index h) { return gate[r * heads + h]; });
  ASSERT_EQ(picked.pairs, n * k);
  ASSERT_EQ(masked.pairs, n * k);
  EXPECT_EQ(picked.heads, heads);
  EXPECT_EQ(picked.batch, batch);
  EXPECT_EQ(picked.tokens, tokens);
  EXPECT_TRUE(std::equal(picked.offsets, picked.offsets + heads + 1, masked.offsets));
  EXPECT_TRUE(std::equal(picked.rows, picked.rows + n * k, masked.rows));
  EXPECT_TRUE(std::equal(picked.positions, picked.positions + n * k, masked.positions));
  EXPECT_TRUE(std::equal(picked.gates, picked.gates + n * k, masked.gates));
  EXPECT_EQ(picked.offsets[0], 0);
  EXPECT_EQ(picked.offsets[heads], n * k);
  Index total = 0;
  for (Index h = 0; h < heads; ++h) {
    EXPECT_EQ(picked.count(h), picked.offsets[h + 1] - picked.offsets[h]);
    total += picked.count(h);
    const Index* first = picked.rows + picked.offsets[h];
    const Index* last = picked.rows + picked.offsets[h + 1];
    EXPECT_TRUE(std::is_sorted(first, last)) << "head " << h;
    for (const Index* it = first; it != last; ++it) {
      EXPECT_NE(gate[*it * heads + h], 0.0f);
      EXPECT_EQ(picked.gates[it - picked.rows], gate[*it * heads + h]);
    }
  }
  EXPECT_EQ(total, n * k);
  for (Index i = 0; i < picked.pairs; ++i) EXPECT_EQ(picked.positions[i], picked.rows[i] % tokens);
  // The plan's arrays live in the arena.
  EXPECT_GT(arena.in_use(), 0u);
}

// range(h, r0, r1): the pairs of head h whose rows lie in [r0, r1), as [first, last) indices.
TEST(HeadPlan, RangeSelectsAHeadsRowsInAnInterval) {
  const Index batch = 2, tokens = 17, heads = 5, n = batch * tokens;
  // Head h is used by the rows r with (r + h) % (h + 1) == 0: a different spacing per head.
  auto active = [](Index r, Index h) { return (r + h) % (h + 1) == 0; };
  moh::detail::Arena arena;
  const moh::detail::Arena::Scope scope(arena);
  moh::detail::HeadPlan<double> plan;
  plan.build(arena, heads, batch, tokens, active, [](Index r, Index h) { return r + 0.5 * h; });
  for (Index h = 0; h < heads; ++h)
    for (Index r0 = 0; r0 <= n; r0 += 3)
      for (Index r1 = r0; r1 <= n; r1 += 5) {
        const auto [lo, hi] = plan.range(h, r0, r1);
        std::vector<Index> got(plan.rows + lo, plan.rows + hi), want;
        for (Index r = r0; r < r1; ++r)
          if (active(r, h)) want.push_back(r);
        EXPECT_EQ(got, want) << "head " << h << " rows [" << r0 << ", " << r1 << ")";
        EXPECT_GE(lo, plan.offsets[h]);
        EXPECT_LE(hi, plan.offsets[h + 1]);
      }
  for (Index i = 0; i < plan.pairs; ++i) {
    // gates[i] is the gate of (rows[i], the head whose range holds i).
    Index h = 0;
    while (plan.offsets[h + 1] <= i) ++h;
    EXPECT_EQ(plan.gates[i], plan.rows[i] + 0.5 * h);
  }
}

// A plan with no (token, head) pair: every head's range is empty.
TEST(HeadPlan, NoActivePairIsAnEmptyPlan) {
  moh::detail::Arena arena;
  const moh::detail::Arena::Scope scope(arena);
  moh::detail::HeadPlan<float> plan;
  plan.build(arena, 4, 2, 3, [](Index, Index) { return false; }, [](Index, Index) { return 1.0f; });
  EXPECT_EQ(plan.pairs, 0);
  for (Index h = 0; h < 4; ++h) EXPECT_EQ(plan.count(h), 0);
}

}  // namespace
