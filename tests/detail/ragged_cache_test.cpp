// A batch of sequences of different lengths in one KvCache (detail/layer.hpp's forward_cached,
// runtime/kv_cache.hpp): each step of the batch gives, row for row, the bits of each sequence
// decoded alone in a cache of its own, on the calling thread and on pools of 1-3 threads, for
// every layer kind; a sequence reset mid-way restarts at position 0 without touching the others.
// The same holds for batches of more sequences than kDotRows, for bfloat16 and packed weights,
// for a bfloat16 cache, and for calls of several new tokens per sequence, some of them padding.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "layers/layer_test_support.hpp"
#include "moh/moh.hpp"
#include "test_helpers.hpp"

namespace {

using moh::Index;
using moh_test::BitEqual;

constexpr Index kSteps = 4;
// Tokens of each sequence before the steps (a batch takes the first n). Each prompt has more rows
// than a decode step's projections take as dot products (kDotRows), so that alone and in the
// batch it goes through the same GEMM (the routes differ in rounding; the steps are what this
// test compares).
constexpr Index kMaxSequences = 12;
constexpr Index kPrompts[kMaxSequences] = {9, 14, 11, 12, 10, 13, 9, 14, 12, 11, 10, 13};
constexpr Index kLongest = 14;
constexpr bool all_prompts_longer_than_a_step() {
  for (Index p : kPrompts)
    if (p <= moh::detail::kDotRows || p > kLongest) return false;
  return true;
}
static_assert(all_prompts_longer_than_a_step(),
              "each prompt must be longer than a decode step's rows and at most kLongest");
// A batch of more sequences than kDotRows: its steps have more rows than multiply() takes as
// dot products by count, so they are dot products only because the call is a decode step.
constexpr Index kLargeBatch = kMaxSequences;
static_assert(kLargeBatch > moh::detail::kDotRows, "the large batch must exceed kDotRows rows");
constexpr Index kResetSequence = 1, kResetAfter = 2;  // sequence 1 restarts after step 2

/// Row b of token t of a [B, T, D] tensor as a [1, 1, D] tensor.
moh::Tensor3<float> token(const moh::Tensor3<float>& x, Index b, Index t) {
  return x.slice(Eigen::array<Index, 3>{b, t, 0}, Eigen::array<Index, 3>{1, 1, x.dimension(2)});
}

/// How the steps decode: where the cache keeps keys and values, how many new tokens of each
/// sequence one forward_cached call takes, and whether some of them are padding.
struct Steps {
  moh::CacheStorage storage = moh::CacheStorage::Native;
  Index per_call = 1;
  bool padded = false;  // new token i of sequence b is padding when (b + i) % 3 == 1
  Index tokens() const { return kSteps * per_call; }
};

/// The new_token_padding_mask of call s for sequences [first, first + n) (empty unless padded).
moh::Mask step_padding(const Steps& steps, Index first, Index n, Index s) {
  moh::Mask mask(n, steps.per_call);
  for (Index b = 0; b < n; ++b)
    for (Index t = 0; t < steps.per_call; ++t)
      mask(b, t) = steps.padded && (first + b + s * steps.per_call + t) % 3 == 1;
  return mask;
}

/// New tokens [s * per_call, (s + 1) * per_call) of sequences [first, first + n) of x.
moh::Tensor3<float> call_tokens(const moh::Tensor3<float>& x, const Steps& steps, Index first,
                                Index n, Index s) {
  return x.slice(Eigen::array<Index, 3>{first, s * steps.per_call, 0},
                 Eigen::array<Index, 3>{n, steps.per_call, x.dimension(2)});
}

/// The step outputs [n, steps.tokens(), D] of the ragged batch of n = prompt.dimension(0)
/// sequences, decoded on `pool`: prompts of kPrompts[b] tokens (one call over kLongest tokens,
/// then each sequence cut back to its own), then kSteps calls of steps.per_call new tokens each;
/// sequence kResetSequence is reset after call kResetAfter.
template <class Layer>
moh::Tensor3<float> ragged(const Layer& layer, const moh::Tensor3<float>& prompt,
                           const moh::Tensor3<float>& x, const Steps& steps,
                           moh::ThreadPool* pool) {
  const Index D = layer.embed_dim(), sequences = prompt.dimension(0), n = steps.per_call;
  moh::KvCache<float> cache = layer.make_cache(sequences, kLongest + steps.tokens(), steps.storage);
  moh::ForwardOptions opts;
  opts.pool = pool;
  moh::Tensor3<float> y(sequences, kLongest, D);
  layer.forward_cached(prompt, y, cache, opts);
  for (Index b = 0; b < sequences; ++b) cache.truncate(b, kPrompts[b]);
  EXPECT_TRUE(cache.ragged());
  moh::Tensor3<float> out(sequences, steps.tokens(), D);
  for (Index s = 0; s < kSteps; ++s) {
    if (s == kResetAfter) cache.reset(kResetSequence);
    const moh::Mask padding = step_padding(steps, 0, sequences, s);
    moh::ForwardOptions call = opts;
    if (steps.padded) call.new_token_padding_mask = moh::map_mask(padding);
    moh::Tensor3<float> ys(sequences, n, D);
    layer.forward_cached(call_tokens(x, steps, 0, sequences, s), ys, cache, call);
    out.slice(Eigen::array<Index, 3>{0, s * n, 0}, Eigen::array<Index, 3>{sequences, n, D}) = ys;
  }
  EXPECT_EQ(cache.length(kResetSequence), (kSteps - kResetAfter) * n);
  return out;
}

/// The same steps, each sequence alone in a cache of its own (the reset sequence's later steps
/// in a fresh cache), with its own rows of the padding.
template <class Layer>
moh::Tensor3<float> alone(const Layer& layer, const moh::Tensor3<float>& prompt,
                          const moh::Tensor3<float>& x, const Steps& steps) {
  const Index D = layer.embed_dim(), sequences = prompt.dimension(0), n = steps.per_call;
  moh::Tensor3<float> out(sequences, steps.tokens(), D);
  for (Index b = 0; b < sequences; ++b) {
    moh::KvCache<float> cache = layer.make_cache(1, kLongest + steps.tokens(), steps.storage);
    moh::Tensor3<float> p = prompt.slice(Eigen::array<Index, 3>{b, 0, 0},
                                         Eigen::array<Index, 3>{1, kPrompts[b], D});
    moh::Tensor3<float> yp(1, kPrompts[b], D);
    layer.forward_cached(p, yp, cache);
    for (Index s = 0; s < kSteps; ++s) {
      if (b == kResetSequence && s == kResetAfter) cache.reset();
      const moh::Mask padding = step_padding(steps, b, 1, s);
      moh::ForwardOptions call;
      if (steps.padded) call.new_token_padding_mask = moh::map_mask(padding);
      moh::Tensor3<float> ys(1, n, D);
      layer.forward_cached(call_tokens(x, steps, b, 1, s), ys, cache, call);
      out.slice(Eigen::array<Index, 3>{b, s * n, 0}, Eigen::array<Index, 3>{1, n, D}) = ys;
    }
  }
  return out;
}

/// A ragged batch of `sequences` against each sequence alone.
template <class Layer>
void expect_ragged_equals_alone(const typename Layer::Config& config, const std::string& what,
                                Index sequences = 3, const Steps& steps = {}) {
  ASSERT_LE(sequences, kMaxSequences);
  const Layer layer(config, 23);
  const Index D = layer.embed_dim();
  const moh::Tensor3<float> prompt = moh_test::random_tensor<float>(sequences, kLongest, D, 3);
  const moh::Tensor3<float> x = moh_test::random_tensor<float>(sequences, steps.tokens(), D, 4);
  const moh::Tensor3<float> expected = alone(layer, prompt, x, steps);
  const moh::Tensor3<float> got = moh_test::expect_same_bits_for_any_thread_count(
      [&](moh::ThreadPool* pool) { return ragged(layer, prompt, x, steps, pool); }, what);
  EXPECT_TRUE(BitEqual(got, expected)) << what << ": the ragged batch against each sequence alone";
}

/// `config` with its projections stored as `storage`.
template <class Config>
Config stored(Config config, moh::WeightStorage storage) {
  config.weight_storage = storage;
  return config;
}

TEST(RaggedCache, MhaGroupedQueryWithRope) {
  expect_ragged_equals_alone<moh::MultiHeadAttention<float>>(
      moh_test::mha_config(128, 8, 2, 32, /*bias=*/false, /*rope=*/true), "mha");
}

TEST(RaggedCache, MhaOddHeadSizeWithBias) {
  expect_ragged_equals_alone<moh::MultiHeadAttention<float>>(
      moh_test::mha_config(56, 4, 0, 14, /*bias=*/true, /*rope=*/true), "mha head_dim 14");
}

TEST(RaggedCache, MoHQueryNormRouter) {
  expect_ragged_equals_alone<moh::MoHAttention<float>>(
      moh_test::moh_config(128, 8, 2, 4, moh::MoHRouterKind::QueryNorm, 2, 32, false, true),
      "moh query-norm");
}

TEST(RaggedCache, MoHLearnedRouter) {
  expect_ragged_equals_alone<moh::MoHAttention<float>>(
      moh_test::moh_config(96, 6, 2, 2, moh::MoHRouterKind::Learned, 0, 16, true, true),
      "moh learned");
}

TEST(RaggedCache, JetMoE) {
  expect_ragged_equals_alone<moh::MoAAttention<float>>(moh::MoAConfig::jetmoe(128, 2, 6, 2, 32),
                                                       "jetmoe");
}

// More sequences than kDotRows: the steps' projections still take each row as a dot product (a
// decode call's products, Exec::dot_rows), so that each sequence keeps the bits it has alone; a
// GEMM over the batch's rows rounds differently.
TEST(RaggedCache, LargeBatchMha) {
  expect_ragged_equals_alone<moh::MultiHeadAttention<float>>(
      moh_test::mha_config(128, 8, 2, 32, /*bias=*/true, /*rope=*/true), "mha, large batch",
      kLargeBatch);
}

TEST(RaggedCache, LargeBatchMoHQueryNormRouter) {
  expect_ragged_equals_alone<moh::MoHAttention<float>>(
      moh_test::moh_config(128, 8, 2, 4, moh::MoHRouterKind::QueryNorm, 2, 32, false, true),
      "moh query-norm, large batch", kLargeBatch);
}

TEST(RaggedCache, LargeBatchMoHLearnedRouter) {
  expect_ragged_equals_alone<moh::MoHAttention<float>>(
      moh_test::moh_config(96, 6, 2, 2, moh::MoHRouterKind::Learned, 0, 16, true, true),
      "moh learned, large batch", kLargeBatch);
}

TEST(RaggedCache, LargeBatchJetMoE) {
  expect_ragged_equals_alone<moh::MoAAttention<float>>(moh::MoAConfig::jetmoe(128, 2, 6, 2, 32),
                                                       "jetmoe, large batch", kLargeBatch);
}

// The large batch with bfloat16 weights (widened in registers by the dot products), with the
// panel copy of NativePacked weights beside the float ones, and with a bfloat16 cache.
TEST(RaggedCache, LargeBatchStoredWeightsAndCaches) {
  const Steps bf16_cache{moh::CacheStorage::BFloat16};
  for (moh::WeightStorage storage : {moh::WeightStorage::BFloat16,
                                     moh::WeightStorage::NativePacked}) {
    const std::string what = storage == moh::WeightStorage::BFloat16 ? "bf16 weights" : "packed";
    for (const Steps& steps : {Steps{}, bf16_cache}) {
      const std::string how =
          what + (steps.storage == moh::CacheStorage::BFloat16 ? ", bf16 cache" : "");
      expect_ragged_equals_alone<moh::MultiHeadAttention<float>>(
          stored(moh_test::mha_config(128, 8, 2, 32, true, true), storage), "mha, " + how,
          kLargeBatch, steps);
      expect_ragged_equals_alone<moh::MoHAttention<float>>(
          stored(moh_test::moh_config(128, 8, 2, 4, moh::MoHRouterKind::QueryNorm, 2, 32, false,
                                      true),
                 storage),
          "moh query-norm, " + how, kLargeBatch, steps);
      expect_ragged_equals_alone<moh::MoAAttention<float>>(
          stored(moh::MoAConfig::jetmoe(128, 2, 6, 2, 32), storage), "jetmoe, " + how,
          kLargeBatch, steps);
    }
  }
}

// Calls of several new tokens per sequence (causal within the call), some of them padding
// (new_token_padding_mask, stored with the token): up to kDotRows tokens per sequence a call is
// a decode call whatever the batch, so each sequence still keeps its bits alone.
TEST(RaggedCache, SeveralTokensPerCallWithPadding) {
  {  // the padding changes what the steps give (else the cases below would not test it)
    const moh::MultiHeadAttention<float> layer(moh_test::mha_config(128, 8, 2, 32, true, true), 23);
    const moh::Tensor3<float> prompt = moh_test::random_tensor<float>(3, kLongest, 128, 3);
    const moh::Tensor3<float> x = moh_test::random_tensor<float>(3, 3 * kSteps, 128, 4);
    EXPECT_FALSE(BitEqual(alone(layer, prompt, x, Steps{moh::CacheStorage::Native, 3, true}),
                          alone(layer, prompt, x, Steps{moh::CacheStorage::Native, 3, false})));
  }
  for (Index per_call : {Index{2}, Index{3}, moh::detail::kDotRows}) {
    const Steps steps{moh::CacheStorage::Native, per_call, /*padded=*/true};
    const std::string what = std::to_string(per_call) + " tokens per call, padded";
    for (Index sequences : {Index{3}, kLargeBatch}) {
      expect_ragged_equals_alone<moh::MultiHeadAttention<float>>(
          moh_test::mha_config(128, 8, 2, 32, true, true), "mha, " + what, sequences, steps);
      expect_ragged_equals_alone<moh::MoHAttention<float>>(
          moh_test::moh_config(96, 6, 2, 2, moh::MoHRouterKind::Learned, 0, 16, true, true),
          "moh learned, " + what, sequences, steps);
      expect_ragged_equals_alone<moh::MoAAttention<float>>(
          moh::MoAConfig::jetmoe(128, 2, 6, 2, 32), "jetmoe, " + what, sequences, steps);
    }
  }
}

// Decoding against a memory is a decode call too: a batch of kLargeBatch sequences, one new token
// each, on a memory cache (make_memory_cache) gives each sequence its bits alone, and the same
// bits as forward_cross with the memory tensor. Memories of at most kDotRows tokens are
// projected as dot products, longer ones by the GEMM, alone and in the batch alike.
template <class Layer>
void expect_cross_batch_equals_alone(const typename Layer::Config& config, const std::string& what) {
  const Layer layer(config, 29);
  const Index D = layer.embed_dim();
  for (Index S : {Index(5), moh::detail::kDotRows + 3}) {
    const std::string where = what + ", memory of " + std::to_string(S);
    const moh::Tensor3<float> memory = moh_test::random_tensor<float>(kLargeBatch, S, D, 5);
    const moh::Tensor3<float> x = moh_test::random_tensor<float>(kLargeBatch, 1, D, 6);
    const moh::KvCache<float> cache = layer.make_memory_cache(memory);
    const moh::Tensor3<float> got = moh_test::expect_same_bits_for_any_thread_count(
        [&](moh::ThreadPool* pool) {
          moh::ForwardOptions opts;
          opts.pool = pool;
          moh::Tensor3<float> y(kLargeBatch, 1, D);
          layer.forward_cross(x, cache, y, opts);
          return y;
        },
        where);
    moh::Tensor3<float> direct(kLargeBatch, 1, D);
    layer.forward_cross(x, memory, direct);
    EXPECT_TRUE(BitEqual(direct, got)) << where << ": forward_cross with the memory tensor";
    for (Index b = 0; b < kLargeBatch; ++b) {
      const moh::Tensor3<float> m = memory.slice(Eigen::array<Index, 3>{b, 0, 0},
                                                 Eigen::array<Index, 3>{1, S, D});
      const moh::KvCache<float> one = layer.make_memory_cache(m);
      moh::Tensor3<float> y(1, 1, D);
      layer.forward_cross(token(x, b, 0), one, y);
      EXPECT_TRUE(BitEqual(y, token(got, b, 0))) << where << ": sequence " << b;
    }
  }
}

TEST(RaggedCache, LargeBatchCrossAttentionOnAMemory) {
  expect_cross_batch_equals_alone<moh::MultiHeadAttention<float>>(
      moh_test::mha_config(64, 4, 0, 0, /*bias=*/true), "mha");
  expect_cross_batch_equals_alone<moh::MoHAttention<float>>(moh_test::moh_config(64, 8, 2, 3),
                                                            "moh");
  expect_cross_batch_equals_alone<moh::MoAAttention<float>>(moh_test::moa_config(64, 16, 6, 2),
                                                            "moa");
}

// The cache's own bookkeeping: lengths per sequence, the longest as length(), and errors that
// name the sequence.
TEST(RaggedCache, LengthsPerSequence) {
  moh::KvCache<float> cache(3, 2, 16, 10);
  EXPECT_FALSE(cache.ragged());
  EXPECT_THROW(cache.truncate(0, 1), moh::Error);  // nothing cached yet
  const moh::MultiHeadAttention<float> layer(moh_test::mha_config(32, 2, 2, 16), 1);
  moh::KvCache<float> c = layer.make_cache(3, 10);
  const moh::Tensor3<float> x = moh_test::random_tensor<float>(3, 6, 32, 9);
  moh::Tensor3<float> y(3, 6, 32);
  layer.forward_cached(x, y, c);
  c.truncate(0, 2);
  c.reset(2);
  EXPECT_TRUE(c.ragged());
  EXPECT_EQ(c.length(), 6);
  EXPECT_EQ(c.length(0), 2);
  EXPECT_EQ(c.length(1), 6);
  EXPECT_EQ(c.length(2), 0);
  EXPECT_TRUE(moh_test::Mentions(moh_test::error_of([&] { c.truncate(0, 3); }), {"sequence 0",
                                                                                  "[0, 2]", "3"}));
  EXPECT_TRUE(moh_test::Mentions(moh_test::error_of([&] { c.length(3); }), {"[0, 3)", "3"}));
  EXPECT_TRUE(moh_test::Mentions(moh_test::error_of([&] { c.reset(3); }),
                                 {"KvCache::reset", "[0, 3)", "3"}));
  c.truncate(4);  // every sequence at most 4
  EXPECT_EQ(c.length(0), 2);
  EXPECT_EQ(c.length(1), 4);
  EXPECT_EQ(c.length(), 4);
  // Room is checked against the longest sequence: 4 + 7 > 10.
  moh::Tensor3<float> big = moh_test::random_tensor<float>(3, 7, 32, 10), yb(3, 7, 32);
  EXPECT_TRUE(moh_test::Mentions(moh_test::error_of([&] { layer.forward_cached(big, yb, c); }),
                                 {"full", "6"}));
  c.reset();
  EXPECT_FALSE(c.ragged());
  EXPECT_EQ(c.length(1), 0);
}

}  // namespace
