// Tests for moh/runtime/kv_cache.hpp on its own: the sizes and layout of a cache, the errors of
// its constructor, truncate() and reset() (what they keep, what they forget, what they refuse),
// clone() giving an independent copy, and the checks a layer makes before writing
// (detail::KvCacheAccess). The cache is filled here through detail::KvCacheAccess, as a layer
// fills it; how the layers use a cache is tested with the layers (tests/detail/layer_test.cpp).
#include "moh/runtime/kv_cache.hpp"

#include <gtest/gtest.h>

#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "test_helpers.hpp"

namespace {

using moh::Index;
using moh::KvCache;
using moh::detail::KvCacheAccess;
using moh_test::error_of;
using moh_test::Mentions;

/// Appends `n` tokens to every sequence and head: key element (b, g, slot, j) is
/// 1000 b + 100 g + slot + j / 10 (values the negative); slots listed in `pad_slots` of sequence
/// `pad_b` are marked padding.
template <class T>
void append(KvCache<T>& c, Index n, Index pad_b = -1, std::vector<Index> pad_slots = {}) {
  const Index start = c.length();
  for (Index b = 0; b < c.batch(); ++b) {
    for (Index g = 0; g < c.kv_heads(); ++g)
      for (Index slot = start; slot < start + n; ++slot)
        for (Index j = 0; j < c.head_dim(); ++j) {
          const T v = static_cast<T>(1000 * b + 100 * g + slot + j / 10.0);
          KvCacheAccess::keys(c, b, g)[slot * c.head_dim() + j] = v;
          KvCacheAccess::values(c, b, g)[slot * c.head_dim() + j] = -v;
        }
    for (Index slot = start; slot < start + n; ++slot) {
      bool pad = false;
      for (Index p : pad_slots) pad = pad || (b == pad_b && p == slot);
      KvCacheAccess::set_padding(c, b, slot, pad);
    }
  }
  KvCacheAccess::commit(c, n);
}

/// True if slots [0, length) of every sequence and head hold what append() wrote.
template <class T>
::testing::AssertionResult holds_appended(const KvCache<T>& c, Index length) {
  for (Index b = 0; b < c.batch(); ++b)
    for (Index g = 0; g < c.kv_heads(); ++g)
      for (Index slot = 0; slot < length; ++slot)
        for (Index j = 0; j < c.head_dim(); ++j) {
          const T v = static_cast<T>(1000 * b + 100 * g + slot + j / 10.0);
          if (c.keys(b, g)[slot * c.head_dim() + j] != v || c.values(b, g)[slot * c.head_dim() + j] != -v)
            return ::testing::AssertionFailure()
                   << "b " << b << " g " << g << " slot " << slot << " j " << j;
        }
  return ::testing::AssertionSuccess();
}

static_assert(!std::is_copy_constructible<KvCache<float>>::value, "a cache is never copied by accident");
static_assert(!std::is_copy_assignable<KvCache<float>>::value, "a cache is never copied by accident");
static_assert(std::is_nothrow_move_constructible<KvCache<float>>::value, "caches move");
static_assert(std::is_nothrow_move_assignable<KvCache<float>>::value, "caches move");

TEST(KvCache, DefaultConstructedIsEmpty) {
  const KvCache<float> c;
  EXPECT_EQ(c.batch(), 0);
  EXPECT_EQ(c.kv_heads(), 0);
  EXPECT_EQ(c.head_dim(), 0);
  EXPECT_EQ(c.capacity(), 0);
  EXPECT_EQ(c.length(), 0);
}

TEST(KvCache, SizesAndLayout) {
  KvCache<float> c(2, 3, 4, 5);
  EXPECT_EQ(c.batch(), 2);
  EXPECT_EQ(c.kv_heads(), 3);
  EXPECT_EQ(c.head_dim(), 4);
  EXPECT_EQ(c.capacity(), 5);
  EXPECT_EQ(c.length(), 0);
  // [batch, kv_heads, capacity, head_dim] for keys and for values: each (b, g) owns a
  // [capacity, head_dim] block.
  for (Index b = 0; b < 2; ++b)
    for (Index g = 0; g < 3; ++g) {
      EXPECT_EQ(c.keys(b, g) - c.keys(0, 0), (b * 3 + g) * 5 * 4);
      EXPECT_EQ(c.values(b, g) - c.values(0, 0), (b * 3 + g) * 5 * 4);
      for (Index i = 0; i < 5 * 4; ++i) {
        EXPECT_EQ(c.keys(b, g)[i], 0.0f);  // allocated zeroed
        EXPECT_EQ(c.values(b, g)[i], 0.0f);
      }
    }
  for (Index b = 0; b < 2; ++b)
    for (Index slot = 0; slot < 5; ++slot) EXPECT_FALSE(c.is_padding(b, slot));
  const KvCache<double> d(1, 1, 1, 1);
  EXPECT_EQ(d.capacity(), 1);
}

TEST(KvCache, ConstructorRefusesSizesThatAreNotPositive) {
  struct Bad {
    Index batch, kv_heads, head_dim, capacity;
    std::string got;
  };
  const std::vector<Bad> bad = {{0, 2, 4, 8, "got 0, 2, 4, 8"},  {2, 0, 4, 8, "got 2, 0, 4, 8"},
                                {2, 2, 0, 8, "got 2, 2, 0, 8"},  {2, 2, 4, 0, "got 2, 2, 4, 0"},
                                {-1, 2, 4, 8, "got -1, 2, 4, 8"}, {2, 2, 4, -8, "got 2, 2, 4, -8"}};
  for (const Bad& b : bad) {
    EXPECT_TRUE(Mentions(error_of([&] { KvCache<float> c(b.batch, b.kv_heads, b.head_dim, b.capacity); }),
                         {"KvCache: sizes must be positive",
                          "expected batch, kv_heads, head_dim, capacity > 0", b.got}));
  }
}

TEST(KvCache, AppendedTokensAreReadBack) {
  KvCache<float> c(2, 2, 3, 6);
  append(c, 2);
  append(c, 3, 1, {3});
  EXPECT_EQ(c.length(), 5);
  EXPECT_TRUE(holds_appended(c, 5));
  EXPECT_TRUE(c.is_padding(1, 3));
  EXPECT_FALSE(c.is_padding(0, 3));
  EXPECT_FALSE(c.is_padding(1, 2));
  EXPECT_NE(KvCacheAccess::padding(c, 1), nullptr);
  EXPECT_TRUE(KvCacheAccess::padding(c, 1)[3]);
}

TEST(KvCache, TruncateForgetsTheLaterTokensAndKeepsTheEarlierOnes) {
  KvCache<float> c(2, 2, 3, 8);
  append(c, 5);
  const float* keys = c.keys(1, 1);
  c.truncate(3);
  EXPECT_EQ(c.length(), 3);
  EXPECT_EQ(c.capacity(), 8);
  EXPECT_EQ(c.keys(1, 1), keys);  // no reallocation
  EXPECT_TRUE(holds_appended(c, 3));
  // The next tokens continue from slot 3 and overwrite what was there.
  append(c, 4);
  EXPECT_EQ(c.length(), 7);
  EXPECT_TRUE(holds_appended(c, 7));
  // Truncating to the current length changes nothing; truncate(0) empties the cache.
  c.truncate(7);
  EXPECT_EQ(c.length(), 7);
  c.truncate(0);
  EXPECT_EQ(c.length(), 0);
}

TEST(KvCache, TruncateRefusesLengthsOutsideTheCachedTokens) {
  KvCache<float> c(1, 1, 2, 6);
  append(c, 3);
  EXPECT_TRUE(Mentions(error_of([&] { c.truncate(4); }),
                       {"KvCache::truncate", "expected a length in [0, 3]", "got 4"}));
  EXPECT_TRUE(Mentions(error_of([&] { c.truncate(-1); }), {"expected a length in [0, 3]", "got -1"}));
  // Beyond the tokens cached but within the capacity is still refused: nothing is there.
  EXPECT_TRUE(Mentions(error_of([&] { c.truncate(6); }), {"got 6"}));
  EXPECT_EQ(c.length(), 3);  // unchanged by the refused calls
  EXPECT_TRUE(holds_appended(c, 3));
  KvCache<float> empty;
  EXPECT_TRUE(Mentions(error_of([&] { empty.truncate(1); }), {"expected a length in [0, 0]", "got 1"}));
  EXPECT_NO_THROW(empty.truncate(0));
  EXPECT_NO_THROW(empty.reset());
}

TEST(KvCache, ResetEmptiesTheCacheAndKeepsTheAllocation) {
  KvCache<double> c(2, 1, 4, 5);
  append(c, 4, 0, {1, 2});
  ASSERT_NE(KvCacheAccess::padding(c, 0), nullptr);
  const double* keys = c.keys(0, 0);
  const double* values = c.values(1, 0);
  c.reset();
  EXPECT_EQ(c.length(), 0);
  EXPECT_EQ(c.batch(), 2);
  EXPECT_EQ(c.kv_heads(), 1);
  EXPECT_EQ(c.head_dim(), 4);
  EXPECT_EQ(c.capacity(), 5);
  EXPECT_EQ(c.keys(0, 0), keys);
  EXPECT_EQ(c.values(1, 0), values);
  // An empty cache has no padded slot: the layers skip the padding mask again.
  EXPECT_EQ(KvCacheAccess::padding(c, 0), nullptr);
  EXPECT_EQ(KvCacheAccess::padding(c, 1), nullptr);
  // The whole capacity is free again.
  EXPECT_NO_THROW(KvCacheAccess::check(c, 2, 1, 4, 5, "Layer"));
  append(c, 5);
  EXPECT_TRUE(holds_appended(c, 5));
  EXPECT_EQ(KvCacheAccess::padding(c, 0), nullptr);  // no padding among the new tokens
}

TEST(KvCache, PaddingFlagsSurviveATruncationThatKeepsThem) {
  KvCache<float> c(2, 1, 2, 6);
  append(c, 3, 1, {0});
  c.truncate(2);
  EXPECT_TRUE(c.is_padding(1, 0));
  ASSERT_NE(KvCacheAccess::padding(c, 1), nullptr);
  EXPECT_TRUE(KvCacheAccess::padding(c, 1)[0]);
  append(c, 2);
  EXPECT_TRUE(c.is_padding(1, 0));
  EXPECT_FALSE(c.is_padding(1, 2));
  EXPECT_FALSE(c.is_padding(1, 3));
}

TEST(KvCache, CloneIsIndependent) {
  KvCache<float> original(2, 2, 3, 6);
  append(original, 4, 0, {2});
  KvCache<float> copy = original.clone();
  EXPECT_EQ(copy.batch(), 2);
  EXPECT_EQ(copy.kv_heads(), 2);
  EXPECT_EQ(copy.head_dim(), 3);
  EXPECT_EQ(copy.capacity(), 6);
  EXPECT_EQ(copy.length(), 4);
  EXPECT_TRUE(holds_appended(copy, 4));
  EXPECT_TRUE(copy.is_padding(0, 2));
  ASSERT_NE(KvCacheAccess::padding(copy, 0), nullptr);
  EXPECT_NE(copy.keys(0, 0), original.keys(0, 0));  // its own storage
  EXPECT_NE(copy.values(0, 0), original.values(0, 0));

  // Changing the original leaves the copy as it was, and the other way round.
  KvCacheAccess::keys(original, 1, 1)[0] = 12345.0f;
  KvCacheAccess::values(original, 1, 1)[0] = 12345.0f;
  KvCacheAccess::set_padding(original, 1, 0, true);
  original.truncate(1);
  EXPECT_EQ(copy.length(), 4);
  EXPECT_TRUE(holds_appended(copy, 4));
  EXPECT_FALSE(copy.is_padding(1, 0));
  append(copy, 2);
  EXPECT_EQ(copy.length(), 6);
  EXPECT_EQ(original.length(), 1);
  EXPECT_EQ(original.keys(1, 1)[0], 12345.0f);
  EXPECT_EQ(original.values(1, 1)[0], 12345.0f);
  copy.reset();
  EXPECT_EQ(original.length(), 1);
  EXPECT_TRUE(original.is_padding(1, 0));

  const KvCache<float> empty_clone = KvCache<float>().clone();
  EXPECT_EQ(empty_clone.capacity(), 0);
}

TEST(KvCache, MovesKeepTheContents) {
  KvCache<float> a(1, 2, 2, 4);
  append(a, 3);
  const float* keys = a.keys(0, 1);
  KvCache<float> b(std::move(a));
  EXPECT_EQ(b.length(), 3);
  EXPECT_EQ(b.keys(0, 1), keys);
  EXPECT_TRUE(holds_appended(b, 3));
  KvCache<float> c;
  c = std::move(b);
  EXPECT_EQ(c.capacity(), 4);
  EXPECT_TRUE(holds_appended(c, 3));
}

TEST(KvCache, LayersCheckTheCacheBeforeWriting) {
  KvCache<float> c(2, 2, 4, 5);
  EXPECT_NO_THROW(KvCacheAccess::check(c, 2, 2, 4, 5, "Layer"));
  EXPECT_TRUE(Mentions(error_of([&] { KvCacheAccess::check(KvCache<float>(), 2, 2, 4, 1, "Layer"); }),
                       {"Layer: KvCache is empty (default-constructed)", "make_cache"}));
  // Each size names the cache's field: expected what the call needs, got what the cache has.
  EXPECT_TRUE(Mentions(error_of([&] { KvCacheAccess::check(c, 2, 1, 4, 1, "Layer"); }),
                       {"Layer: KvCache kv_heads: expected 1, got 2"}));
  EXPECT_TRUE(Mentions(error_of([&] { KvCacheAccess::check(c, 2, 2, 8, 1, "Layer"); }),
                       {"Layer: KvCache head_dim: expected 8, got 4"}));
  EXPECT_TRUE(Mentions(error_of([&] { KvCacheAccess::check(c, 3, 2, 4, 1, "Layer"); }),
                       {"Layer: KvCache batch: expected"}));
  EXPECT_TRUE(Mentions(error_of([&] { KvCacheAccess::check(c, 2, 2, 4, 6, "Layer"); }),
                       {"Layer: KvCache is full", "expected at most 5 new tokens", "capacity 5",
                        "length 0", "got 6"}));
  append(c, 4);
  EXPECT_NO_THROW(KvCacheAccess::check(c, 2, 2, 4, 1, "Layer"));
  EXPECT_TRUE(Mentions(error_of([&] { KvCacheAccess::check(c, 2, 2, 4, 2, "Layer"); }),
                       {"expected at most 1 new tokens", "length 4", "got 2"}));
  c.truncate(2);
  EXPECT_NO_THROW(KvCacheAccess::check(c, 2, 2, 4, 3, "Layer"));  // truncation frees room
}

// As for kv_heads and head_dim: "KvCache batch: expected <the call's batch>, got <the cache's>".
TEST(KvCache, BatchMismatchReadsLikeTheOtherSizes) {
  const KvCache<float> c(2, 2, 4, 5);
  EXPECT_TRUE(Mentions(error_of([&] { KvCacheAccess::check(c, 3, 2, 4, 1, "Layer"); }),
                       {"Layer: KvCache batch: expected 3, got 2"}));
}

}  // namespace
