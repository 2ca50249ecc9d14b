// Decoding on a thread pool (detail/layer.hpp's forward_cached, detail/attend.hpp's drivers): a
// prompt and then single-token steps through a KV cache give the same bits on 1, 2 or 3 threads
// as on the calling thread alone, for every layer kind, dense and routed, float and bfloat16
// weights. Also built into moh_thread_tests, which CI runs under ThreadSanitizer.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "layers/layer_test_support.hpp"
#include "moh/moh.hpp"
#include "test_helpers.hpp"

namespace {

using moh::Index;

constexpr Index kBatch = 2, kPrompt = 21, kSteps = 4;

/// The prompt's outputs and then each step's, [B, kPrompt + kSteps, D], decoded on `pool`.
template <class Layer>
moh::Tensor3<float> decode(const Layer& layer, moh::ThreadPool* pool) {
  moh::ForwardOptions opts;
  opts.pool = pool;
  return moh_test::decode_prompt_then_steps(
      layer, moh_test::random_tensor<float>(kBatch, kPrompt + kSteps, layer.embed_dim(), 5),
      kPrompt, opts);
}

template <class Layer>
void expect_decode_independent_of_threads(const typename Layer::Config& c, const std::string& what) {
  for (moh::WeightStorage storage : {moh::WeightStorage::Native, moh::WeightStorage::BFloat16}) {
    typename Layer::Config config = c;
    config.weight_storage = storage;
    const Layer layer(config, 17);
    moh_test::expect_same_bits_for_any_thread_count(
        [&](moh::ThreadPool* pool) { return decode(layer, pool); },
        what + (storage == moh::WeightStorage::BFloat16 ? " bf16" : " float"));
  }
}

TEST(DecodeThreads, MhaGroupedQueryWithRope) {
  // head_dim 32: the register-tiled and few-query kernels (whole packets) run.
  expect_decode_independent_of_threads<moh::MultiHeadAttention<float>>(
      moh_test::mha_config(128, 8, 2, 32, /*bias=*/false, /*rope=*/true), "mha gqa rope");
}

TEST(DecodeThreads, MhaPairedHeads) {
  // One query head per kv head, heads of one value panel (64 floats with AVX2, 128 with
  // AVX-512, 32 with SSE alone) or of half of one (32, 64, 16), 5 of them: the steps attend
  // heads in pairs (attend_head_pairs(), unless kPairedValues turns them off), the last alone.
  // Paired against unpaired, head by head: AttendHeads.PairedDecodeHeadsHaveEachHeadsBitsAlone
  // and AttendHeads.PairedDecodeHeadsOfHalfAPanelHaveEachHeadsBitsAlone.
  const Index L = moh::detail::packet_size<float>();
  for (const Index d : {moh::detail::kPairedPanel * L, moh::detail::kPairedHalfPanel * L})
    expect_decode_independent_of_threads<moh::MultiHeadAttention<float>>(
        moh_test::mha_config(5 * d, 5, 0, d), "mha paired heads of " + std::to_string(d));
}

TEST(DecodeThreads, MhaPairedHeadsAroundThePoolSize) {
  // 2 such heads, 2 sequences: 2 pairs, so the steps pair the heads on 1 or 2 threads and
  // attend one head a task on 3 (pairs_decode_heads()): the same bits either way.
  const Index d = moh::detail::kPairedPanel * moh::detail::packet_size<float>();
  expect_decode_independent_of_threads<moh::MultiHeadAttention<float>>(
      moh_test::mha_config(2 * d, 2, 0, d), "mha paired heads, 2 pairs");
}

TEST(DecodeThreads, MhaOddHeadSize) {
  expect_decode_independent_of_threads<moh::MultiHeadAttention<float>>(
      moh_test::mha_config(60, 4, 0, 15), "mha head_dim 15");
}

TEST(DecodeThreads, MoHQueryNormRouter) {
  expect_decode_independent_of_threads<moh::MoHAttention<float>>(
      moh_test::moh_config(128, 8, 2, 4, moh::MoHRouterKind::QueryNorm, 2, 32, false, true),
      "moh query-norm");
}

TEST(DecodeThreads, MoHWideOutput) {
  // D = 512: on a pool the routed heads' outputs are projected in two column tiles, on the
  // calling thread alone in one; heads of 64 read in parts with rows left over.
  expect_decode_independent_of_threads<moh::MoHAttention<float>>(
      moh_test::moh_config(512, 8, 2, 3, moh::MoHRouterKind::QueryNorm, 2, 64, false, true),
      "moh D 512");
}

TEST(DecodeThreads, MoHLearnedRouter) {
  expect_decode_independent_of_threads<moh::MoHAttention<float>>(
      moh_test::moh_config(128, 8, 2, 3, moh::MoHRouterKind::Learned, 0, 16), "moh learned");
}

TEST(DecodeThreads, JetMoEMultiHeadExperts) {
  expect_decode_independent_of_threads<moh::MoAAttention<float>>(
      moh::MoAConfig::jetmoe(128, 2, 6, 2, 32), "jetmoe");
}

TEST(DecodeThreads, FairseqMoA) {
  expect_decode_independent_of_threads<moh::MoAAttention<float>>(
      moh_test::moa_config(64, 16, 6, 2), "fairseq moa");
}

}  // namespace
