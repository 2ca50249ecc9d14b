// ForwardOptions (moh/options.hpp): its defaults, and the padding masks (key_padding_mask,
// new_token_padding_mask), views that rebind on assignment and never write into the mask they
// viewed before (Eigen's TensorMap assignment would copy elements).
#include "moh/options.hpp"

#include <gtest/gtest.h>

#include <vector>

#include "moh/layers/multi_head_attention.hpp"
#include "test_helpers.hpp"

namespace {

TEST(ForwardOptions, DefaultsAreAutoWithNothingAttached) {
  const moh::ForwardOptions o;
  EXPECT_EQ(o.causal, moh::Causal::Auto);
  EXPECT_EQ(o.mode, moh::ComputeMode::Auto);
  EXPECT_FALSE(o.key_padding_mask);
  EXPECT_FALSE(o.new_token_padding_mask);
  EXPECT_EQ(o.pool, nullptr);
  EXPECT_EQ(o.workspace, nullptr);
  EXPECT_EQ(o.position_offset, 0);
}

/// The rebinding checks on one of ForwardOptions' two masks.
void check_rebinds(moh::PaddingMask moh::ForwardOptions::*field) {
  moh::Mask full(2, 5), chunk(2, 1);
  full.setConstant(false);
  full(1, 4) = true;
  chunk.setConstant(true);
  moh::ForwardOptions o;
  moh::PaddingMask& mask = o.*field;
  EXPECT_FALSE(mask);
  mask = moh::map_mask(full);
  ASSERT_TRUE(mask.has_value());
  EXPECT_EQ(mask->dimension(1), 5);
  EXPECT_TRUE(mask(1, 4));
  EXPECT_FALSE(mask(0, 4));
  mask = moh::map_mask(chunk);
  EXPECT_EQ(mask->data(), chunk.data());
  EXPECT_EQ(mask->dimension(0), 2);
  EXPECT_EQ(mask->dimension(1), 1);
  EXPECT_TRUE((*mask)(1, 0));
  // The first mask is untouched.
  for (moh::Index b = 0; b < 2; ++b)
    for (moh::Index k = 0; k < 5; ++k) EXPECT_EQ(full(b, k), b == 1 && k == 4);
  mask = std::nullopt;
  EXPECT_FALSE(mask.has_value());
  mask = moh::map_mask(full);
  mask.reset();
  EXPECT_FALSE(mask);
}

TEST(PaddingMask, AssigningANewMaskRebindsTheView) {
  check_rebinds(&moh::ForwardOptions::key_padding_mask);
  check_rebinds(&moh::ForwardOptions::new_token_padding_mask);
}

// Reusing one ForwardOptions across decode steps with a different padding chunk each step gives
// the same outputs as fresh options per step.
TEST(PaddingMask, ReusedOptionsDecodeLikeFreshOnes) {
  const moh::MultiHeadAttention<float> layer(moh_test::mha_config(16, 2), 3);
  const moh::Tensor3<float> x = moh_test::random_tensor<float>(2, 4, 16, 4);
  moh::Mask pad(2, 4);
  pad.setConstant(false);
  pad(0, 0) = true;
  pad(1, 2) = true;
  auto run = [&](bool reuse) {
    moh::KvCache<float> cache = layer.make_cache(2, 4);
    moh::ForwardOptions shared;
    shared.causal = moh::Causal::On;
    shared.new_token_padding_mask = moh::map_mask(pad);  // engaged before the loop, as a user might
    std::vector<moh::Mask> chunks(4);
    moh::Tensor3<float> y(2, 4, 16);
    for (moh::Index t = 0; t < 4; ++t) {
      const Eigen::array<moh::Index, 3> off{0, t, 0}, ext{2, 1, 16};
      const moh::Tensor3<float> xs = x.slice(off, ext);
      const Eigen::array<moh::Index, 2> poff{0, t}, pext{2, 1};
      chunks[t] = pad.slice(poff, pext);
      moh::ForwardOptions fresh;
      fresh.causal = moh::Causal::On;
      moh::ForwardOptions& o = reuse ? shared : fresh;
      o.new_token_padding_mask = moh::map_mask(chunks[t]);
      moh::Tensor3<float> ys(2, 1, 16);
      layer.forward_cached(xs, ys, cache, o);
      y.slice(off, ext) = ys;
    }
    for (moh::Index b = 0; b < 2; ++b)
      for (moh::Index t = 0; t < 4; ++t) EXPECT_EQ(cache.is_padding(b, t), pad(b, t));
    return y;
  };
  const moh::Tensor3<float> a = run(false), b = run(true);
  EXPECT_TRUE(moh_test::BitEqual(a, b));
  EXPECT_TRUE(pad(0, 0) && pad(1, 2) && !pad(0, 1));  // the full mask was not written to
}

}  // namespace
