// ForwardOptions::key_padding_mask: a view that rebinds on assignment and never writes into the
// mask it viewed before (Eigen's TensorMap assignment would copy elements).
#include <gtest/gtest.h>

#include "moh/moh.hpp"

namespace {

TEST(PaddingMask, AssigningANewMaskRebindsTheView) {
  moh::Mask full(2, 5), chunk(2, 1);
  full.setConstant(false);
  full(1, 4) = true;
  chunk.setConstant(true);
  moh::ForwardOptions o;
  EXPECT_FALSE(o.key_padding_mask);
  o.key_padding_mask = moh::map_mask(full);
  ASSERT_TRUE(o.key_padding_mask.has_value());
  EXPECT_EQ(o.key_padding_mask->dimension(1), 5);
  o.key_padding_mask = moh::map_mask(chunk);
  EXPECT_EQ(o.key_padding_mask->data(), chunk.data());
  EXPECT_EQ(o.key_padding_mask->dimension(0), 2);
  EXPECT_EQ(o.key_padding_mask->dimension(1), 1);
  EXPECT_TRUE((*o.key_padding_mask)(1, 0));
  // The first mask is untouched.
  for (moh::Index b = 0; b < 2; ++b)
    for (moh::Index k = 0; k < 5; ++k) EXPECT_EQ(full(b, k), b == 1 && k == 4);
  o.key_padding_mask = std::nullopt;
  EXPECT_FALSE(o.key_padding_mask.has_value());
  o.key_padding_mask = moh::map_mask(full);
  o.key_padding_mask.reset();
  EXPECT_FALSE(o.key_padding_mask);
}

// Reusing one ForwardOptions across decode steps with a different padding chunk each step gives
// the same outputs as fresh options per step.
TEST(PaddingMask, ReusedOptionsDecodeLikeFreshOnes) {
  moh::MhaConfig c;
  c.embed_dim = 16;
  c.num_heads = 2;
  const moh::MultiHeadAttention<float> layer(c, 3);
  moh::Tensor3<float> x(2, 4, 16);
  x.setRandom();
  moh::Mask pad(2, 4);
  pad.setConstant(false);
  pad(0, 0) = true;
  pad(1, 2) = true;
  auto run = [&](bool reuse) {
    moh::KvCache<float> cache = layer.make_cache(2, 4);
    moh::ForwardOptions shared;
    shared.causal = true;
    shared.key_padding_mask = moh::map_mask(pad);  // engaged before the loop, as a user might
    std::vector<moh::Mask> chunks(4);
    moh::Tensor3<float> y(2, 4, 16);
    for (moh::Index t = 0; t < 4; ++t) {
      const Eigen::array<moh::Index, 3> off{0, t, 0}, ext{2, 1, 16};
      const moh::Tensor3<float> xs = x.slice(off, ext);
      const Eigen::array<moh::Index, 2> poff{0, t}, pext{2, 1};
      chunks[t] = pad.slice(poff, pext);
      moh::ForwardOptions fresh;
      fresh.causal = true;
      moh::ForwardOptions& o = reuse ? shared : fresh;
      o.key_padding_mask = moh::map_mask(chunks[t]);
      moh::Tensor3<float> ys(2, 1, 16);
      layer.forward_cached(xs, ys, cache, o);
      y.slice(off, ext) = ys;
    }
    return y;
  };
  const moh::Tensor3<float> a = run(false), b = run(true);
  for (moh::Index i = 0; i < a.size(); ++i) ASSERT_EQ(a.data()[i], b.data()[i]);
  EXPECT_TRUE(pad(0, 0) && pad(1, 2) && !pad(0, 1));  // the full mask was not written to
}

}  // namespace
