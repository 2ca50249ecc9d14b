// Several threads calling forward on one layer object at once (detail/layer.hpp, the skeleton
// every layer shares): each gets exactly the output it gets alone (forward is const and keeps no
// state; a call without a workspace makes a temporary one, a call with one leases it), with and
// without a ThreadPool shared by the callers, with a workspace per calling thread or none. A
// workspace serves one call at a time: a call that finds it busy is a moh::Error, never a race.
#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "layers/layer_test_support.hpp"
#include "moh/moh.hpp"
#include "test_helpers.hpp"

namespace {

using moh_test::BitEqual;

constexpr int kCallers = 4;
constexpr int kRounds = 8;

std::vector<moh::Tensor3<float>> inputs(moh::Index D) {
  std::vector<moh::Tensor3<float>> xs;
  for (int i = 0; i < kCallers; ++i)  // different lengths, so scratch sizes differ
    xs.push_back(moh_test::random_tensor<float>(2, 17 + 9 * i, D, 40 + i));
  return xs;
}

// Runs `layer` from kCallers threads at once, kRounds times each, and counts outputs that differ
// from the single-threaded reference. With `workspaces`, each caller passes its own Workspace,
// reused over its rounds.
template <class Layer>
int mismatches(const Layer& layer, moh::ThreadPool* pool, bool causal, bool workspaces = false) {
  const std::vector<moh::Tensor3<float>> xs = inputs(layer.embed_dim());
  moh::ForwardOptions opts;
  opts.causal = causal ? moh::Causal::On : moh::Causal::Off;
  std::vector<moh::Tensor3<float>> expected;
  for (const auto& x : xs) expected.push_back(layer(x, opts));
  opts.pool = pool;
  std::vector<int> bad(kCallers, 0);
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c)
    callers.emplace_back([&, c] {
      moh::Workspace ws;
      moh::ForwardOptions mine = opts;
      if (workspaces) mine.workspace = &ws;
      for (int r = 0; r < kRounds; ++r)
        if (!BitEqual(layer(xs[c], mine), expected[c])) ++bad[c];
    });
  for (auto& t : callers) t.join();
  int total = 0;
  for (int b : bad) total += b;
  return total;
}

// No mismatches with the callers on their own threads (causal or not, as `causal_alone` says),
// nor with the callers sharing a pool of `threads` (causal).
template <class Layer>
void expect_matches_alone(const Layer& layer, bool causal_alone, int threads) {
  EXPECT_EQ(mismatches(layer, nullptr, causal_alone), 0);
  moh::ThreadPool pool(threads);
  EXPECT_EQ(mismatches(layer, &pool, true), 0) << threads << " threads";
}

moh::MoHConfig moh_config() { return moh_test::moh_config(64, 8, 2, 2); }

moh::MoAConfig moa_config() { return moh_test::moa_config(64, 16, 6, 2); }

}  // namespace

TEST(Concurrency, MhaFromSeveralThreadsMatchesAlone) {
  expect_matches_alone(moh::MultiHeadAttention<float>(moh_test::mha_config(64, 4, 2), 11), true, 2);
}

TEST(Concurrency, MoHSparseFromSeveralThreadsMatchesAlone) {
  expect_matches_alone(moh::MoHAttention<float>(moh_config(), 12), false, 3);
}

TEST(Concurrency, MoHQueryNormFromSeveralThreadsMatchesAlone) {
  const moh::MoHAttention<float> layer(
      moh_test::moh_config(64, 8, 2, 2, moh::MoHRouterKind::QueryNorm, 4, 0, false, true), 13);
  moh::ThreadPool pool(2);
  EXPECT_EQ(mismatches(layer, &pool, true), 0);
}

TEST(Concurrency, MoAFromSeveralThreadsMatchesAlone) {
  expect_matches_alone(moh::MoAAttention<float>(moa_config(), 14), false, 2);
}

// Each calling thread with a workspace of its own, reused over its calls, alone or sharing a pool.
TEST(Concurrency, EachThreadWithItsOwnWorkspaceMatchesAlone) {
  const moh::MultiHeadAttention<float> mha(moh_test::mha_config(64, 4, 2), 15);
  const moh::MoHAttention<float> moh_layer(moh_config(), 16);
  const moh::MoAAttention<float> moa(moa_config(), 17);
  moh::ThreadPool pool(3);
  for (moh::ThreadPool* p : {static_cast<moh::ThreadPool*>(nullptr), &pool}) {
    EXPECT_EQ(mismatches(mha, p, true, true), 0) << "mha, pool " << (p != nullptr);
    EXPECT_EQ(mismatches(moh_layer, p, false, true), 0) << "moh, pool " << (p != nullptr);
    EXPECT_EQ(mismatches(moa, p, true, true), 0) << "moa, pool " << (p != nullptr);
  }
}

// A workspace held by a call in progress (marked busy the way a running call marks it) refuses a
// second call, whatever the entry point, and serves calls again once it is free.
TEST(Concurrency, BusyWorkspaceIsAnError) {
  const moh::MoHAttention<float> layer(moh_config(), 18);
  const moh::Tensor3<float> x = moh_test::random_tensor<float>(2, 5, 64, 180);
  moh::Tensor3<float> y(2, 5, 64);
  moh::KvCache<float> cache = layer.make_cache(2, 5);
  moh::Workspace ws;
  moh::ForwardOptions o;
  o.workspace = &ws;
  ASSERT_TRUE(moh::detail::WorkspaceAccess::try_acquire(ws));  // a call in progress
  EXPECT_TRUE(moh_test::EveryEntryPointRefuses(layer, x, y, cache,
                                               {"MoHAttention", "workspace is in use"}, o));
  EXPECT_EQ(cache.length(), 0) << "a refused cached call appends nothing";
  EXPECT_THROW(ws.release(), moh::Error);
  moh::detail::WorkspaceAccess::finish(ws);  // that call ends
  layer.forward(x, y, o);
  EXPECT_TRUE(BitEqual(y, layer(x)));
  // A call that fails after leasing the workspace (a padding mask of the wrong shape) frees it.
  moh::Mask bad = moh_test::no_padding(2, 4);
  moh::ForwardOptions ob = o;
  ob.key_padding_mask = moh::map_mask(bad);
  EXPECT_THROW(layer.forward(x, y, ob), moh::Error);
  EXPECT_NO_THROW(layer.forward(x, y, o));
  EXPECT_NO_THROW(ws.release());
}

// Two threads sharing one workspace: every call either runs alone on it and gives the right bits,
// or finds it busy and throws that moh::Error; nothing else (no race, no wrong output).
TEST(Concurrency, SharedWorkspaceEitherRunsAloneOrRefuses) {
  const moh::MoAAttention<float> layer(moa_config(), 19);
  const std::vector<moh::Tensor3<float>> xs = inputs(64);
  std::vector<moh::Tensor3<float>> expected;
  for (const auto& x : xs) expected.push_back(layer(x));
  moh::Workspace ws;
  moh::ForwardOptions o;
  o.workspace = &ws;
  std::atomic<int> wrong{0}, refused{0}, ran{0}, other_errors{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 2; ++c)
    callers.emplace_back([&, c] {
      for (int r = 0; r < 4 * kRounds; ++r) {
        const int i = (c + r) % kCallers;
        try {
          if (!BitEqual(layer(xs[i], o), expected[i])) ++wrong;
          ++ran;
        } catch (const moh::Error& e) {
          if (std::string(e.what()).find("workspace is in use") != std::string::npos)
            ++refused;
          else
            ++other_errors;
        }
      }
    });
  for (auto& t : callers) t.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(other_errors.load(), 0);
  EXPECT_EQ(ran.load() + refused.load(), 2 * 4 * kRounds);
  EXPECT_GT(ran.load(), 0);
  // Free again afterwards.
  EXPECT_TRUE(BitEqual(layer(xs[0], o), expected[0]));
}
