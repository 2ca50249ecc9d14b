// Several threads calling forward on one layer object at once: each gets exactly the output it
// gets alone (forward is const, keeps no state, and scratch is per thread), with and without a
// ThreadPool shared by the callers.
#include <gtest/gtest.h>

#include <cstring>
#include <thread>
#include <vector>

#include "moh/moh.hpp"

namespace {

constexpr int kCallers = 4;
constexpr int kRounds = 8;

std::vector<moh::Tensor3<float>> inputs(moh::Index D) {
  std::vector<moh::Tensor3<float>> xs;
  for (int i = 0; i < kCallers; ++i) {
    moh::Tensor3<float> x(2, 17 + 9 * i, D);  // different lengths, so scratch sizes differ
    x.setRandom();
    xs.push_back(x);
  }
  return xs;
}

bool same_bits(const moh::Tensor3<float>& a, const moh::Tensor3<float>& b) {
  return a.dimensions() == b.dimensions() &&
         std::memcmp(a.data(), b.data(), sizeof(float) * static_cast<std::size_t>(a.size())) == 0;
}

// Runs `layer` from kCallers threads at once, kRounds times each, and counts outputs that differ
// from the single-threaded reference.
template <class Layer>
int mismatches(const Layer& layer, moh::Index D, moh::ThreadPool* pool, bool causal) {
  const std::vector<moh::Tensor3<float>> xs = inputs(D);
  moh::ForwardOptions opts;
  opts.causal = causal;
  std::vector<moh::Tensor3<float>> expected;
  for (const auto& x : xs) expected.push_back(layer(x, opts));
  opts.pool = pool;
  std::vector<int> bad(kCallers, 0);
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c)
    callers.emplace_back([&, c] {
      for (int r = 0; r < kRounds; ++r)
        if (!same_bits(layer(xs[c], opts), expected[c])) ++bad[c];
    });
  for (auto& t : callers) t.join();
  int total = 0;
  for (int b : bad) total += b;
  return total;
}

moh::MoHConfig moh_config() {
  moh::MoHConfig c;
  c.embed_dim = 64;
  c.num_heads = 8;
  c.shared_heads = 2;
  c.active_routed_heads = 2;
  return c;
}

}  // namespace

TEST(Concurrency, MhaFromSeveralThreadsMatchesAlone) {
  moh::MhaConfig c;
  c.embed_dim = 64;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  const moh::MultiHeadAttention<float> layer(c, 11);
  EXPECT_EQ(mismatches(layer, 64, nullptr, true), 0);
  moh::ThreadPool pool(2);
  EXPECT_EQ(mismatches(layer, 64, &pool, true), 0);
}

TEST(Concurrency, MoHSparseFromSeveralThreadsMatchesAlone) {
  const moh::MoHAttention<float> layer(moh_config(), 12);
  EXPECT_EQ(mismatches(layer, 64, nullptr, false), 0);
  moh::ThreadPool pool(3);
  EXPECT_EQ(mismatches(layer, 64, &pool, true), 0);
}

TEST(Concurrency, MoHQueryNormFromSeveralThreadsMatchesAlone) {
  moh::MoHConfig c = moh_config();
  c.router = moh::MoHRouter::QueryNorm;
  c.rope = true;
  c.bias = false;
  c.num_kv_heads = 4;
  const moh::MoHAttention<float> layer(c, 13);
  moh::ThreadPool pool(2);
  EXPECT_EQ(mismatches(layer, 64, &pool, true), 0);
}

TEST(Concurrency, MoAFromSeveralThreadsMatchesAlone) {
  moh::MoAConfig c;
  c.embed_dim = 64;
  c.head_dim = 16;
  c.num_experts = 6;
  c.top_k = 2;
  const moh::MoAAttention<float> layer(c, 14);
  EXPECT_EQ(mismatches(layer, 64, nullptr, false), 0);
  moh::ThreadPool pool(2);
  EXPECT_EQ(mismatches(layer, 64, &pool, true), 0);
}
