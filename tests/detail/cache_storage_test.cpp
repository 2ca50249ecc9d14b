// KV caches stored in bfloat16 (runtime/kv_cache.hpp's CacheStorage, read by ops/attention_kernel
// in every path: the few-query decode kernels widen in registers, the tiled and Eigen paths widen
// each block): a prompt and decode steps through a bfloat16 cache match the float cache within
// bfloat16 precision and give the same bits on any number of threads; the cache holds the keys
// and values rounded to nearest.
#include <gtest/gtest.h>

#include <string>

#include "layers/layer_test_support.hpp"
#include "moh/moh.hpp"
#include "test_helpers.hpp"

namespace {

using moh::Index;

constexpr Index kBatch = 2, kPrompt = 40, kSteps = 3;

/// Outputs [B, kPrompt + kSteps, D] of a prompt and single-token steps through a cache of
/// `storage`, on `pool`.
template <class Layer>
moh::Tensor3<float> decode(const Layer& layer, moh::CacheStorage storage, moh::ThreadPool* pool) {
  moh::ForwardOptions opts;
  opts.pool = pool;
  return moh_test::decode_prompt_then_steps(
      layer, moh_test::random_tensor<float>(kBatch, kPrompt + kSteps, layer.embed_dim(), 8),
      kPrompt, opts, storage);
}

template <class Layer>
void expect_bf16_cache_close(const typename Layer::Config& config, const std::string& what) {
  const Layer layer(config, 31);
  const moh::Tensor3<float> wide = decode(layer, moh::CacheStorage::Native, nullptr);
  const moh::Tensor3<float> narrow = moh_test::expect_same_bits_for_any_thread_count(
      [&](moh::ThreadPool* pool) { return decode(layer, moh::CacheStorage::BFloat16, pool); },
      what);
  const double err = moh_test::relative_error(narrow, moh_test::rows_of(wide));
  // bfloat16 keeps 8 mantissa bits (relative rounding 2^-9 = 0.002 per key and value): the
  // outputs, sums of many rounded terms, stay within a few of those; and they do differ.
  EXPECT_LT(err, 1e-2) << what;
  EXPECT_GT(err, 1e-5) << what << ": the keys and values were not rounded";
}

TEST(CacheStorage, MhaBfloat16CacheWithinBfloat16Precision) {
  // head_dim 32: the few-query kernels (steps) and the tiled path with packed keys (the prompt).
  expect_bf16_cache_close<moh::MultiHeadAttention<float>>(
      moh_test::mha_config(128, 8, 2, 32, false, true), "mha gqa rope");
}

TEST(CacheStorage, MhaOddHeadSizeBfloat16Cache) {
  // head_dim 14: Eigen's products on widened blocks.
  expect_bf16_cache_close<moh::MultiHeadAttention<float>>(moh_test::mha_config(56, 4, 0, 14),
                                                          "mha head_dim 14");
}

TEST(CacheStorage, MoHBothRoutersBfloat16Cache) {
  expect_bf16_cache_close<moh::MoHAttention<float>>(
      moh_test::moh_config(128, 8, 2, 4, moh::MoHRouterKind::QueryNorm, 2, 32, false, true),
      "moh query-norm");
  expect_bf16_cache_close<moh::MoHAttention<float>>(
      moh_test::moh_config(96, 6, 2, 2, moh::MoHRouterKind::Learned, 0, 16), "moh learned");
}

TEST(CacheStorage, JetMoEBfloat16Cache) {
  expect_bf16_cache_close<moh::MoAAttention<float>>(moh::MoAConfig::jetmoe(128, 2, 6, 2, 32),
                                                    "jetmoe");
}

// What the cache holds: the keys rounded to bfloat16, read back through keys_bf16(); the float
// accessors refuse a bfloat16 cache and the other way round, naming the right one.
TEST(CacheStorage, HoldsRoundedKeysAndNamesTheAccessor) {
  const moh::MultiHeadAttention<float> layer(moh_test::mha_config(32, 2, 0, 16), 3);
  moh::KvCache<float> narrow = layer.make_cache(1, 4, moh::CacheStorage::BFloat16);
  moh::KvCache<float> wide = layer.make_cache(1, 4);
  EXPECT_EQ(narrow.storage(), moh::CacheStorage::BFloat16);
  EXPECT_EQ(wide.storage(), moh::CacheStorage::Native);
  EXPECT_EQ(narrow.bytes() * 2, wide.bytes());
  const moh::Tensor3<float> x = moh_test::random_tensor<float>(1, 3, 32, 4);
  moh::Tensor3<float> y(1, 3, 32);
  layer.forward_cached(x, y, narrow);
  layer.forward_cached(x, y, wide);
  for (Index g = 0; g < 2; ++g)
    for (Index i = 0; i < 3 * 16; ++i) {
      EXPECT_EQ(narrow.keys_bf16(0, g)[i], moh::float_to_bfloat16(wide.keys(0, g)[i]));
      EXPECT_EQ(narrow.values_bf16(0, g)[i], moh::float_to_bfloat16(wide.values(0, g)[i]));
    }
  EXPECT_TRUE(moh_test::Mentions(moh_test::error_of([&] { narrow.keys(0, 0); }),
                                 {"bfloat16", "keys_bf16"}));
  EXPECT_TRUE(moh_test::Mentions(moh_test::error_of([&] { wide.values_bf16(0, 0); }),
                                 {"values(b, g)"}));
  const moh::KvCache<float> copy = narrow.clone();
  EXPECT_EQ(copy.storage(), moh::CacheStorage::BFloat16);
  EXPECT_EQ(copy.keys_bf16(0, 1)[5], narrow.keys_bf16(0, 1)[5]);
}

}  // namespace
