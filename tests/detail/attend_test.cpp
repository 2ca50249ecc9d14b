// Tests for moh/detail/attend.hpp's HeadPlan: the two builders (from an activity mask, and from
// each row's k picked heads) give the same plan, grouped by head with each head's rows ascending,
// in the arena they were built in. And attend_heads()' decode step in pairs of heads: each head
// with the bits attention() gives it alone.
#include "moh/detail/attend.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
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

// A decode step of one query head per kv head over heads of one value panel or half of one
// (attend_head_pairs(): heads 2p and 2p + 1 in one task, their weighted values in one pass,
// unless kPairedValues turns the pairs off) gives each head the bits that attention()
// gives it alone: an odd head count (the last head alone), sequences of different lengths (a
// ragged cache; none, one key, hundreds), causal or not (a decode query sees every key either
// way), padding keys, a sequence whose keys are all padding (zeros), queries and keys at row
// strides of every head, on the calling thread and on a pool of 3. The calls do take the pairs
// where kPairedValues, and calls the pairs must not take do not.
// `packets`: the head's size in packets, kPairedPanel or kPairedHalfPanel.
void expect_paired_decode_heads_have_each_heads_bits_alone(int packets) {
  const Index d = packets * moh::detail::packet_size<float>();
  SCOPED_TRACE(testing::Message() << "head_dim " << d);
  ASSERT_EQ(moh::detail::paired_values_packets<float>(d), packets);
  ASSERT_TRUE(moh::detail::paired_values_head<float>(d));
  const Index batch = 4, heads = 5, keys = 300;
  const Index lengths[batch] = {300, 1, 0, 137};
  const Index width = heads * d;  // a row of every head
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> q(static_cast<std::size_t>(batch * width));
  std::vector<float> k(static_cast<std::size_t>(batch * keys * width));
  std::vector<float> v(k.size());
  for (float& x : q) x = u(rng);
  for (float& x : k) x = u(rng);
  for (float& x : v) x = u(rng);
  std::unique_ptr<bool[]> padding(new bool[static_cast<std::size_t>(batch * keys)]);
  for (Index i = 0; i < batch * keys; ++i) padding[i] = i % 7 == 2 || i / keys == 3;
  const float scale = 0.125f;
  for (const bool causal : {false, true})
    for (const bool padded : {false, true})
      for (const int threads : {1, 3}) {
        SCOPED_TRACE(testing::Message() << "causal " << causal << " padding " << padded
                                        << " threads " << threads);
        moh::detail::KeyValues<float> kv;
        kv.k = moh::detail::HeadsView<float>{k.data(), width, keys * width, d};
        kv.v = moh::detail::HeadsView<float>{v.data(), width, keys * width, d};
        kv.keys = keys;
        kv.kv_heads = heads;
        kv.lengths = lengths;
        kv.padding = padded ? padding.get() : nullptr;
        kv.padding_stride = keys;
        std::vector<float> got(static_cast<std::size_t>(batch * width), 9.0f);
        moh::ThreadPool pool(threads);
        moh::Workspace workspace;
        const moh::detail::WorkspaceLease lease(&workspace, &pool, "test");
        const moh::detail::ScoreExtras<float> none;
        EXPECT_EQ(moh::detail::pairs_decode_heads(kv, batch, 1, heads, d, none, lease.exec()),
                  moh::detail::kPairedValues);
        moh::detail::attend_heads<float>(
            moh::detail::HeadsView<float>{q.data(), width, width, d}, kv, batch, 1, heads, d,
            scale, causal, moh::detail::ScoreExtras<float>{}, got.data(), lease.exec());
        for (Index b = 0; b < batch; ++b)
          for (Index h = 0; h < heads; ++h) {
            std::vector<float> want(static_cast<std::size_t>(d), 9.0f);
            const Index n = lengths[b];
            moh::attention<float>(
                moh::AttentionQueries<float>{q.data() + b * width + h * d, width, 1, d, scale,
                                             {nullptr, 0}},
                moh::AttentionKeysValues<float>{k.data() + b * keys * width + h * d, width,
                                                v.data() + b * keys * width + h * d, width, n},
                moh::AttentionMasking{causal, n - 1, padded ? padding.get() + b * keys : nullptr},
                moh::AttentionOutput<float>{want.data(), d});
            EXPECT_EQ(std::memcmp(want.data(), got.data() + b * width + h * d, d * sizeof(float)),
                      0)
                << "sequence " << b << " head " << h;
          }
        for (Index i = 0; i < width; ++i) EXPECT_EQ(got[2 * width + i], 0.0f) << "no keys";
      }
  // Calls the pairs must not take: two tokens, grouped queries, a head three times as wide
  // (three panels or three halves), a bfloat16 cache, keys past one block, a bias,
  // probabilities, fewer pairs than threads.
  moh::detail::KeyValues<float> kv;
  kv.k = moh::detail::HeadsView<float>{k.data(), width, keys * width, d};
  kv.v = kv.k;
  kv.keys = keys;
  kv.kv_heads = heads;
  moh::ThreadPool pool(3);
  moh::Workspace workspace;
  const moh::detail::WorkspaceLease lease(&workspace, &pool, "test");
  const moh::detail::Exec exec = lease.exec();
  const moh::detail::ScoreExtras<float> none;
  EXPECT_EQ(moh::detail::pairs_decode_heads(kv, batch, 1, heads, d, none, exec),
            moh::detail::kPairedValues);
  EXPECT_FALSE(moh::detail::pairs_decode_heads(kv, batch, 2, heads, d, none, exec));
  EXPECT_FALSE(moh::detail::pairs_decode_heads(kv, batch, 1, 2 * heads, d, none, exec));
  EXPECT_FALSE(moh::detail::pairs_decode_heads(kv, batch, 1, heads, 3 * d, none, exec));
  const std::vector<std::uint16_t> k16(16);
  moh::detail::KeyValues<float> narrow = kv;
  narrow.k.bf16 = narrow.v.bf16 = k16.data();
  EXPECT_FALSE(moh::detail::pairs_decode_heads(narrow, batch, 1, heads, d, none, exec));
  moh::detail::KeyValues<float> longer = kv;
  longer.keys = moh::detail::kDeferredKeys;
  EXPECT_EQ(moh::detail::pairs_decode_heads(longer, batch, 1, heads, d, none, exec),
            moh::detail::kPairedValues);
  longer.keys = moh::detail::kDeferredKeys + 1;
  EXPECT_FALSE(moh::detail::pairs_decode_heads(longer, batch, 1, heads, d, none, exec));
  moh::detail::ScoreExtras<float> bias, probabilities;
  bias.bias = q.data();
  probabilities.weights = q.data();
  EXPECT_FALSE(moh::detail::pairs_decode_heads(kv, batch, 1, heads, d, bias, exec));
  EXPECT_FALSE(moh::detail::pairs_decode_heads(kv, batch, 1, heads, d, probabilities, exec));
  moh::detail::KeyValues<float> four = kv, six = kv;
  four.kv_heads = 4;
  six.kv_heads = 6;
  EXPECT_FALSE(moh::detail::pairs_decode_heads(four, 1, 1, 4, d, none, exec));  // 2 pairs
  EXPECT_EQ(moh::detail::pairs_decode_heads(six, 1, 1, 6, d, none, exec),      // 3 pairs
            moh::detail::kPairedValues);
}

TEST(AttendHeads, PairedDecodeHeadsHaveEachHeadsBitsAlone) {
  expect_paired_decode_heads_have_each_heads_bits_alone(moh::detail::kPairedPanel);
}

TEST(AttendHeads, PairedDecodeHeadsOfHalfAPanelHaveEachHeadsBitsAlone) {
  expect_paired_decode_heads_have_each_heads_bits_alone(moh::detail::kPairedHalfPanel);
}

}  // namespace
