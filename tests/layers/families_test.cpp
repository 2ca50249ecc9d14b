// The model families of docs/semantics.md §6-9 as the layers compute them, against the naive
// references of reference/naive_families.hpp: MoH's qkv_bias / qk_norm / dense weighted-sum
// options, MoH-ViT's cosine attention with its position bias, fairseq MoA's query padding and
// memory of another width, and JetMoE's multi-head experts, on odd sizes with masks and a bias
// together, in both compute modes; then decoding, caches, weights by name and the errors of bad
// settings.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "layers/layer_test_support.hpp"
#include "moh/io.hpp"
#include "reference/naive_families.hpp"

namespace {

using namespace moh_test;
using moh::Tensor4;

template <class T>
using FamiliesTest = ScalarTest<T>;
TYPED_TEST_SUITE(FamiliesTest, Scalars);

// ---- inputs as the layer and as the reference take them --------------------------------------

/// A random bias [B, H, T, S] in (-1, 1) with key 1 of query 2 hidden (-inf) everywhere.
template <class T>
Tensor4<T> some_bias(Index B, Index H, Index Tn, Index S, std::uint64_t seed) {
  Tensor4<T> m(B, H, Tn, S);
  fill_random(m.data(), m.size(), seed);
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < H; ++h) m(b, h, 2, 1) = -std::numeric_limits<T>::infinity();
  return m;
}

template <class T>
moh_ref::AttnBias to_ref_bias(const Tensor4<T>& m) {
  moh_ref::AttnBias r;
  r.B = static_cast<int>(m.dimension(0));
  r.H = static_cast<int>(m.dimension(1));
  r.T = static_cast<int>(m.dimension(2));
  r.S = static_cast<int>(m.dimension(3));
  for (Index i = 0; i < m.size(); ++i) r.values.push_back(static_cast<double>(m.data()[i]));
  return r;
}

/// One call: x [B, T, D], optionally a memory, a key padding mask, a bias and causal masking,
/// as the layer's options and as the reference's input.
template <class T>
struct Call {
  Tensor3<T> x, memory;
  Mask key_padding, query_padding;
  Tensor4<T> bias;
  bool causal = false;

  ForwardOptions options(ComputeMode mode) const {
    ForwardOptions o = in_mode(mode);
    o.causal = causal ? moh::Causal::On : moh::Causal::Off;
    if (key_padding.size()) o.key_padding_mask = moh::map_mask(key_padding);
    if (query_padding.size()) o.query_padding_mask = moh::map_mask(query_padding);
    if (bias.size()) o.attn_bias = bias;
    return o;
  }
  moh_ref::FamilyInput reference() const {
    moh_ref::FamilyInput in;
    in.B = static_cast<int>(x.dimension(0));
    in.T = static_cast<int>(x.dimension(1));
    in.x = to_ref(x);
    if (memory.size()) {
      in.memory = to_ref(memory);
      in.S = static_cast<int>(memory.dimension(1));
    }
    in.causal = causal;
    if (key_padding.size()) in.key_padding = to_ref(key_padding);
    if (query_padding.size()) in.query_padding = to_ref(query_padding);
    if (bias.size()) in.bias = to_ref_bias(bias);
    return in;
  }
  template <class Layer>
  Tensor3<T> on(const Layer& layer, const ForwardOptions& o,
                typename Layer::RoutingRecord* routing = nullptr) const {
    return memory.size() ? run_cross(layer, x, memory, o, routing) : run(layer, x, o, routing);
  }
};

template <class T>
double max_prob_error(const Tensor4<T>& got, const moh_ref::Probs& want) {
  double err = 0;
  for (Index i = 0; i < got.size(); ++i)
    err = std::max(err, std::abs(static_cast<double>(got.data()[i]) - want.values[i]));
  return err;
}

// ---- MoH: the authors' module options (docs/semantics.md §7) ------------------------------------

template <class T>
moh_ref::MoHFamilyWeights moh_family_weights(const moh::MoHAttention<T>& m) {
  moh_ref::MoHFamilyWeights w;
  w.attn = weights_of(m);
  w.shared = static_cast<int>(m.config().shared_heads);
  w.routed_k = static_cast<int>(m.config().active_routed_heads);
  w.Wr = to_ref(m.router().routed_weight());
  w.Ws = to_ref(m.router().shared_weight());
  w.Wm = to_ref(m.router().mix_weight());
  if (m.config().qk_norm) {
    auto vec = [&](const char* name) {
      const std::vector<T> v = m.weight(name);
      moh_ref::Vec out(static_cast<Index>(v.size()));
      for (std::size_t i = 0; i < v.size(); ++i) out[static_cast<Index>(i)] = v[i];
      return out;
    };
    w.norm = moh_ref::QkNorm{vec("q_norm.weight"), vec("q_norm.bias"), vec("k_norm.weight"),
                             vec("k_norm.bias")};
  }
  return w;
}

/// A MoH layer whose LayerNorm weights are not the trivial 1 and 0.
template <class T>
moh::MoHAttention<T> qk_norm_layer(moh::MoHConfig c, std::uint64_t seed) {
  c.qk_norm = true;
  moh::MoHAttention<T> m(c, seed);
  const Index d = m.head_dim();
  for (const char* name : {"q_norm.weight", "q_norm.bias", "k_norm.weight", "k_norm.bias"})
    m.set_weight(name, random_vector<T>(d, seed + 7 + name[0] + name[7]));
  return m;
}

template <class T>
void expect_moh_matches_reference(const moh::MoHAttention<T>& layer, const Call<T>& call,
                                  const std::string& what) {
  const moh_ref::MoHFamilyResult want =
      moh_ref::naive_moh_family(moh_family_weights(layer), call.reference());
  for (ComputeMode mode : kModes) {
    ForwardOptions o = call.options(mode);
    const Index B = call.x.dimension(0), Tn = call.x.dimension(1);
    const Index S = call.memory.size() ? call.memory.dimension(1) : Tn;
    Tensor4<T> p(B, layer.num_heads(), Tn, S);
    o.attention_weights = p;
    moh::MoHRouting<T> routing;
    const Tensor3<T> y = call.on(layer, o, &routing);
    const std::string where = what + " " + mode_name(mode);
    EXPECT_LE(relative_error(y, want.y), Tol<T>::rel) << where;
    EXPECT_LE(max_abs_diff(routing.gates, want.gates.gates), Tol<T>::rel * 10) << where;
    EXPECT_LE(max_prob_error(p, want.probs), Tol<T>::rel) << where;
  }
}

TYPED_TEST(FamiliesTest, MoHWithQkNormAndWithoutQkvBiasMatchesTheReference) {
  using T = TypeParam;
  moh::MoHConfig c = moh_config(15, 5, 1, 2);  // d = 3: odd sizes
  c.qkv_bias = false;
  const moh::MoHAttention<T> layer = qk_norm_layer<T>(c, 30);
  EXPECT_TRUE(layer.qkv_bias().size() == 0 && layer.proj_bias().size() == 15);
  Call<T> self{random_tensor<T>(3, 7, 15, 31), {}, three_sequence_padding(7, {4}), {},
               some_bias<T>(3, 5, 7, 7, 32), true};
  expect_moh_matches_reference(layer, self, "self");
  Call<T> cross{random_tensor<T>(2, 5, 15, 33), random_tensor<T>(2, 9, 15, 34),
                padding(2, 9, {{1, 8}}), {}, some_bias<T>(1, 1, 5, 9, 35), false};
  expect_moh_matches_reference(layer, cross, "cross");
}

TYPED_TEST(FamiliesTest, MoHDenseWeightedSumVariantMatchesTheReference) {
  using T = TypeParam;
  // S_h = H, K = 0: the authors' routed_head = 0, gates H softmax(x W_s^T) over all heads.
  const moh::MoHAttention<T> layer(moh_config(12, 4, 4, 0), 36);
  EXPECT_EQ(layer.weight_infos().size(), 5u);  // qkv, its bias, proj, its bias, wg_1 only
  Call<T> call{random_tensor<T>(2, 6, 12, 37), {}, padding(2, 6, {{0, 5}}), {},
               some_bias<T>(2, 1, 6, 6, 38), true};
  expect_moh_matches_reference(layer, call, "dense variant");
  moh::MoHRouting<T> routing;
  run(layer, call.x, call.options(ComputeMode::Sparse), &routing);
  for (Index i = 0; i < routing.gates.rows(); ++i) {
    EXPECT_NEAR(static_cast<double>(routing.gates.row(i).sum()), 4.0, Tol<T>::exact * 10);
    EXPECT_GT(routing.gates.row(i).minCoeff(), T(0));
  }
}

// ---- MoH-ViT (docs/semantics.md §8) -------------------------------------------------------------

template <class T>
moh_ref::MoHVitWeights vit_weights(const moh::MoHAttention<T>& m) {
  const moh::MoHConfig& c = m.config();
  const Index H = m.num_heads(), d = m.head_dim(), hid = c.cpb_hidden;
  auto values = [&](const char* name, Index rows, Index cols) {
    const std::vector<T> v = m.weight(name);
    moh_ref::Mat out(rows, cols);
    for (Index r = 0; r < rows; ++r)
      for (Index k = 0; k < cols; ++k) out(r, k) = v[static_cast<std::size_t>(r * cols + k)];
    return out;
  };
  moh_ref::MoHVitWeights w;
  w.moh = moh_family_weights(m);
  w.temperature = values("temperature", H, 1).col(0);
  w.query_embedding = values("query_embedding", H, d);
  w.cpb_fc1_w = values("cpb_fc1.weight", hid, 2);
  w.cpb_fc1_b = values("cpb_fc1.bias", hid, 1).col(0);
  w.cpb_fc2_w = values("cpb_fc2.weight", H, hid);
  w.cpb_fc2_b = values("cpb_fc2.bias", H, 1).col(0);
  w.pretrain_h = static_cast<int>(c.pretrain_h);
  w.pretrain_w = static_cast<int>(c.pretrain_w);
  w.train_tokens = static_cast<double>(c.train_tokens);
  return w;
}

/// A MoH-ViT layer (D 20, 4 heads of 5, 1 shared, K 2) pretrained on a 4 x 4 grid with N_0 = 12,
/// with a temperature and query embedding that are not the initial ones.
template <class T>
moh::MoHAttention<T> vit_layer(std::uint64_t seed, Index hidden = 9) {
  moh::MoHConfig c = moh::MoHConfig::vit(20, 4, 1, 2, 4, 4);
  c.train_tokens = 12;
  c.cpb_hidden = hidden;
  moh::MoHAttention<T> m(c, seed);
  m.set_weight("temperature", random_vector<T>(4, seed + 1));
  m.set_weight("query_embedding", random_matrix<T>(4, 5, seed + 2, 0.5));
  return m;
}

TYPED_TEST(FamiliesTest, MoHVitOnAnotherGridThanItsPretrainingMatchesTheReference) {
  using T = TypeParam;
  const moh::MoHAttention<T> layer = vit_layer<T>(40);
  for (const auto& [gh, gw] : {std::pair<Index, Index>{3, 5}, {4, 4}}) {
    const Index Tn = gh * gw;
    Call<T> call{random_tensor<T>(2, Tn, 20, 41), {}, padding(2, Tn, {{1, 0}}), {},
                 some_bias<T>(1, 4, Tn, Tn, 42), false};
    moh_ref::FamilyInput in = call.reference();
    const moh_ref::MoHFamilyResult want =
        moh_ref::naive_moh_vit(vit_weights(layer), in, static_cast<int>(gh), static_cast<int>(gw));
    const std::vector<moh_ref::Mat> P =
        moh_ref::naive_cpb_bias(vit_weights(layer), static_cast<int>(gh), static_cast<int>(gw));
    const std::vector<T> bias = layer.position_bias(gh, gw);
    double bias_err = 0;
    for (Index h = 0; h < 4; ++h)
      for (Index i = 0; i < Tn; ++i)
        for (Index j = 0; j < Tn; ++j)
          bias_err = std::max(bias_err, std::abs(static_cast<double>(bias[(h * Tn + i) * Tn + j]) -
                                                 P[h](i, j)));
    EXPECT_LE(bias_err, Tol<T>::rel) << gh << " x " << gw;
    for (ComputeMode mode : kModes) {
      ForwardOptions o = call.options(mode);
      o.grid_h = gh;
      o.grid_w = gw;
      Tensor4<T> p(2, 4, Tn, Tn);
      o.attention_weights = p;
      moh::MoHRouting<T> routing;
      const Tensor3<T> y = run(layer, call.x, o, &routing);
      const std::string where = std::to_string(gh) + " x " + std::to_string(gw) + " " + mode_name(mode);
      EXPECT_LE(relative_error(y, want.y), Tol<T>::rel) << where;
      EXPECT_LE(max_abs_diff(routing.gates, want.gates.gates), Tol<T>::rel * 10) << where;
      EXPECT_LE(max_prob_error(p, want.probs), Tol<T>::rel) << where;
    }
  }
}

TYPED_TEST(FamiliesTest, MoHVitWithQkNormNormalisesBeforeTheCosine) {
  using T = TypeParam;
  // FIXTURES allows qk_norm on moh_vit: LayerNorm(d) on each head (docs/semantics.md §7), then the
  // cosine attention of docs/semantics.md §8 on the normalised heads.
  moh::MoHConfig c = moh::MoHConfig::vit(20, 4, 1, 2, 4, 4);
  c.cpb_hidden = 6;
  c.qkv_bias = false;
  const moh::MoHAttention<T> layer = qk_norm_layer<T>(c, 55);
  Call<T> call{random_tensor<T>(2, 16, 20, 56), {}, {}, {}, {}, false};
  const moh_ref::MoHFamilyResult want =
      moh_ref::naive_moh_vit(vit_weights(layer), call.reference(), 4, 4);
  for (ComputeMode mode : kModes)
    EXPECT_LE(relative_error(run(layer, call.x, call.options(mode)), want.y), Tol<T>::rel)
        << mode_name(mode);
}

TYPED_TEST(FamiliesTest, MoHVitKeepsItsPositionBiasPerGridUntilTheMlpChanges) {
  using T = TypeParam;
  moh::MoHAttention<T> layer = vit_layer<T>(43);
  const Tensor3<T> x = random_tensor<T>(1, 16, 20, 44);
  const Tensor3<T> before = run(layer, x);  // the pretraining grid 4 x 4 by default
  ForwardOptions grid;
  grid.grid_h = grid.grid_w = 4;
  EXPECT_TRUE(BitEqual(run(layer, x, grid), before));
  const moh::MoHAttention<T> copy = layer;  // a copy computes its own
  EXPECT_TRUE(BitEqual(run(copy, x), before));
  const std::vector<T> old_bias = layer.position_bias(4, 4);
  layer.set_weight("cpb_fc2.bias", random_vector<T>(4, 45));
  const std::vector<T> new_bias = layer.position_bias(4, 4);
  EXPECT_NE(old_bias, new_bias);
  const moh_ref::MoHFamilyResult want = moh_ref::naive_moh_vit(
      vit_weights(layer), Call<T>{x, {}, {}, {}, {}, false}.reference(), 4, 4);
  EXPECT_LE(relative_error(run(layer, x), want.y), Tol<T>::rel);
  EXPECT_TRUE(BitEqual(run(copy, x), before));  // the copy kept its weights and its bias
}

TYPED_TEST(FamiliesTest, MoHVitRefusesWhatCosineAttentionCannotDo) {
  using T = TypeParam;
  const moh::MoHAttention<T> layer = vit_layer<T>(46);
  const Tensor3<T> x = random_tensor<T>(1, 15, 20, 47);
  Tensor3<T> y(1, 15, 20);
  ForwardOptions o;
  EXPECT_TRUE(ErrorMentions([&] { layer.forward(x, y, o); }, {"grid", "15 tokens", "0 x 0"}));
  o.grid_h = 4;
  o.grid_w = 4;
  EXPECT_TRUE(ErrorMentions([&] { layer.forward(x, y, o); }, {"grid", "15 tokens", "4 x 4"}));
  o.grid_h = 3;
  o.grid_w = 5;
  EXPECT_NO_THROW(layer.forward(x, y, o));
  EXPECT_TRUE(ErrorMentions([&] { layer.forward_cross(x, x, y, o); }, {"forward_cross", "grid"}));
  moh::KvCache<T> cache = layer.make_cache(1, 15);
  EXPECT_TRUE(ErrorMentions([&] { layer.forward_cached(x, y, cache, o); }, {"forward_cached"}));
  EXPECT_TRUE(ErrorMentions([&] { layer.make_memory_cache(x); }, {"make_memory_cache"}));
  // A grid on a layer that has none.
  const moh::MoHAttention<T> dot(moh_config(20, 4, 1, 2), 48);
  EXPECT_TRUE(ErrorMentions([&] { dot.forward(x, y, o); }, {"grid_h", "cosine", "3 x 5"}));
  // Settings that cannot go together.
  moh::MoHConfig c = moh::MoHConfig::vit(20, 4, 1, 2, 1, 4);
  EXPECT_TRUE(ErrorMentions([&] { moh::MoHAttention<T> m(c); }, {"pretrain_h", "1 x 4"}));
  c = moh::MoHConfig::vit(24, 4, 1, 2, 4, 4);  // heads of 6: RoPE could rotate them
  c.rope = true;
  EXPECT_TRUE(ErrorMentions([&] { moh::MoHAttention<T> m(c); }, {"rope", "cosine"}));
}

TYPED_TEST(FamiliesTest, LoadingWeightsOfAnotherModuleNamesIt) {
  using T = TypeParam;
  const moh::MoHAttention<T> vit = vit_layer<T>(49);
  moh::SafeTensorsWriter vit_file;
  moh::save_weights(vit_file, vit, "blocks.0.attn.", moh::dtype_for<T>());
  const moh::SafeTensors vit_source = moh::SafeTensors::from_bytes(vit_file.to_bytes(), "vit");
  // MoH-ViT's tensors into a dot-product layer: the cosine tensors are not silently ignored.
  moh::MoHAttention<T> dot(moh_config(20, 4, 1, 2));
  EXPECT_TRUE(ErrorMentions([&] { moh::load_weights(dot, vit_source, "blocks.0.attn."); },
                            {"blocks.0.attn.temperature", "cosine"}));
  moh::MoHAttention<T> again(vit.config());
  moh::load_weights(again, vit_source, "blocks.0.attn.");
  const Tensor3<T> x = random_tensor<T>(1, 16, 20, 50);
  EXPECT_TRUE(BitEqual(run(again, x), run(vit, x)));
  // TransNeXt's aggregated attention (stages 1-3) is named, whatever layer reads it.
  moh::SafeTensorsWriter aggregated;
  aggregated.add("q.weight", random_matrix<T>(20, 20, 51));
  aggregated.add("kv.weight", random_matrix<T>(40, 20, 52));
  aggregated.add("sr.weight", random_matrix<T>(20, 20, 53));
  const moh::SafeTensors agg = moh::SafeTensors::from_bytes(aggregated.to_bytes(), "stage1");
  EXPECT_TRUE(ErrorMentions([&] { moh::load_weights(again, agg); }, {"AggregatedAttention"}));
  // A bias the layer was configured without.
  moh::MoHConfig no_bias = vit.config();
  no_bias.qkv_bias = false;
  moh::MoHAttention<T> unbiased(no_bias);
  EXPECT_TRUE(ErrorMentions([&] { moh::load_weights(unbiased, vit_source, "blocks.0.attn."); },
                            {"blocks.0.attn.qkv.bias", "qkv_bias = false"}));
}

// ---- MoA: query padding and a memory of another width (docs/semantics.md §9) --------------------

TYPED_TEST(FamiliesTest, MoAWithQueryPaddingAMemoryOfAnotherWidthAndABiasMatchesTheReference) {
  using T = TypeParam;
  moh::MoAConfig c = moa_config(14, 3, 5, 2);
  c.kdim = 9;
  const moh::MoAAttention<T> layer(c, 60);
  Mask qpad = padding(3, 5, {{0, 1}, {2, 0}, {2, 4}});
  Call<T> call{random_tensor<T>(3, 5, 14, 61), random_tensor<T>(3, 8, 9, 62),
               padding(3, 8, {{1, 7}}), qpad, some_bias<T>(3, 1, 5, 8, 63), false};
  const moh_ref::MoAFamilyResult want =
      moh_ref::naive_moa_family(weights_of(layer), call.reference());
  for (ComputeMode mode : kModes) {
    moh::MoARouting<T> routing;
    const Tensor3<T> y = call.on(layer, call.options(mode), &routing);
    const std::string where = mode_name(mode);
    EXPECT_LE(relative_error(y, want.y), Tol<T>::rel) << where;
    for (Index e = 0; e < 5; ++e) EXPECT_EQ(routing.expert_counts[e], want.route.counts[e]) << where;
    EXPECT_NEAR(routing.switch_loss, want.route.switch_loss, Tol<T>::rel * 10) << where;
    EXPECT_NEAR(routing.z_loss, want.route.z_loss, Tol<T>::rel * 10) << where;
    EXPECT_NEAR(routing.cv_loss, want.route.cv_loss, Tol<T>::rel * 10) << where;
    for (const auto& [b, t] : {std::pair<Index, Index>{0, 1}, {2, 0}, {2, 4}}) {
      for (Index j = 0; j < 14; ++j) EXPECT_EQ(y(b, t, j), T(0)) << where;
      for (Index s = 0; s < 2; ++s) EXPECT_EQ(routing.selected(b * 5 + t, s), -1) << where;
    }
  }
}

TYPED_TEST(FamiliesTest, AMemoryCacheGivesTheBitsOfTheMemoryAndStaysAsItWas) {
  using T = TypeParam;
  moh::MoAConfig c = moh::MoAConfig::jetmoe(12, 2, 4, 2, 3 * 2);
  c.kdim = 7;
  const moh::MoAAttention<T> jet(c, 64);
  moh::MoAConfig f = moa_config(12, 4, 3, 2);
  f.kdim = 7;
  const moh::MoAAttention<T> moa(f, 65);
  const moh::MoHAttention<T> moh_layer(moh_config(12, 4, 1, 1), 66);
  const moh::MultiHeadAttention<T> mha(mha_config(12, 3, 0, 0, true, true), 67);
  const Tensor3<T> memory7 = random_tensor<T>(2, 6, 7, 68), memory12 = random_tensor<T>(2, 6, 12, 69);
  const Mask pad = padding(2, 6, {{0, 5}});
  auto check = [&](const auto& layer, const Tensor3<T>& memory) {
    ForwardOptions with_pad;
    with_pad.key_padding_mask = moh::map_mask(pad);
    const auto cache = layer.make_memory_cache(memory, with_pad);
    EXPECT_EQ(cache.length(), 6);
    for (Index step = 0; step < 3; ++step) {  // decoding steps reuse it
      const Tensor3<T> x = random_tensor<T>(2, 1, 12, 70 + step);
      ForwardOptions o;
      o.position_offset = layer.config().rope ? step : 0;
      Tensor3<T> from_cache(2, 1, 12);
      layer.forward_cross(x, cache, from_cache, o);
      ForwardOptions direct = o;
      direct.key_padding_mask = moh::map_mask(pad);
      EXPECT_TRUE(BitEqual(from_cache, run_cross(layer, x, memory, direct))) << layer.kName;
      EXPECT_EQ(cache.length(), 6);
    }
    Tensor3<T> y(2, 1, 12);
    EXPECT_TRUE(ErrorMentions([&] { layer.forward_cross(random_tensor<T>(2, 1, 12, 1), cache, y, with_pad); },
                              {"key_padding_mask", "make_memory_cache"}));
    Tensor3<T> y1(1, 1, 12);
    EXPECT_TRUE(ErrorMentions([&] { layer.forward_cross(random_tensor<T>(1, 1, 12, 1), cache, y1); },
                              {"batch", "expected 1, got 2"}));
    const moh::KvCache<T> own = layer.make_cache(2, 8);  // the layer's own tokens, not a memory
    EXPECT_TRUE(ErrorMentions([&] { layer.forward_cross(random_tensor<T>(2, 1, 12, 1), own, y); },
                              {"forward_cross", "make_memory_cache", "make_cache"}));
  };
  check(jet, memory7);
  check(moa, memory7);
  check(moh_layer, memory12);
  check(mha, memory12);
}

TYPED_TEST(FamiliesTest, KdimAndTopKAreCheckedWithNamedErrors) {
  using T = TypeParam;
  moh::MoAConfig c = moa_config(12, 4, 3, 2);
  c.kdim = 7;
  const moh::MoAAttention<T> layer(c, 80);
  const Tensor3<T> x = random_tensor<T>(2, 3, 12, 81);
  Tensor3<T> y(2, 3, 12);
  EXPECT_TRUE(ErrorMentions([&] { layer.forward(x, y); }, {"kdim = 7", "forward_cross"}));
  moh::KvCache<T> cache = layer.make_cache(2, 3);
  EXPECT_TRUE(ErrorMentions([&] { layer.forward_cached(x, y, cache); }, {"kdim = 7"}));
  EXPECT_TRUE(ErrorMentions([&] { layer.forward_cross(x, x, y); }, {"memory", "[2, *, 7]"}));
  c.kdim = 0;
  c.top_k = 4;
  EXPECT_TRUE(ErrorMentions([&] { moh::MoAAttention<T> m(c); }, {"top_k", "1..3", "got 4"}));
  c.top_k = 2;
  c.out_bias = true;
  EXPECT_TRUE(ErrorMentions([&] { moh::MoAAttention<T> m(c); }, {"out_bias", "fairseq"}));
  c.out_bias = false;
  ASSERT_EQ(moh::MoAConfig{}.num_kv_heads, 1);  // fairseq's MoA
  c.num_kv_heads = 0;
  EXPECT_TRUE(ErrorMentions([&] { moh::MoAAttention<T> m(c); }, {"num_kv_heads", ">= 1", "got 0"}));
  c.num_kv_heads = 1;
  const moh::MultiHeadAttention<T> mha(mha_config(12, 3), 82);
  ForwardOptions o;
  const Mask qpad = no_padding(2, 3);
  o.query_padding_mask = moh::map_mask(qpad);
  EXPECT_TRUE(ErrorMentions([&] { mha.forward(x, y, o); }, {"query_padding_mask", "MoAAttention"}));
  const Mask wrong = no_padding(2, 4);
  o.query_padding_mask = moh::map_mask(wrong);
  EXPECT_TRUE(ErrorMentions([&] { layer.forward_cross(x, random_tensor<T>(2, 3, 7, 83), y, o); },
                            {"query_padding_mask", "[2, 3]", "[2, 4]"}));
}

// ---- JetMoE: multi-head experts (docs/semantics.md §9) ------------------------------------------

template <class T>
moh_ref::JetMoEWeights jetmoe_weights(const moh::MoAAttention<T>& m) {
  const moh::MoAConfig& c = m.config();
  moh_ref::JetMoEWeights w;
  w.D = static_cast<int>(c.embed_dim);
  w.d = static_cast<int>(c.head_dim);
  w.Hkv = static_cast<int>(c.kv_heads());
  w.E = static_cast<int>(c.num_experts);
  w.k = static_cast<int>(c.top_k);
  const Index D = c.embed_dim, wd = c.kv_heads() * c.head_dim;
  const moh_ref::Mat q = to_ref(m.query_experts()), o = to_ref(m.output_experts());
  for (Index e = 0; e < c.num_experts; ++e) {
    w.W_in.push_back(q.middleRows(e * D, D).transpose());
    w.W_out.push_back(o.middleRows(e * wd, wd).transpose());
  }
  w.W_r = to_ref(m.gate_weight()).transpose();
  w.b = to_ref(m.output_bias());
  moh_ref::Mat kv(2 * wd, m.memory_dim());
  kv << to_ref(m.key_weight()), to_ref(m.value_weight());
  w.W_kv = kv;
  w.rope = c.rope;
  w.rope_theta = c.rope_theta;
  w.topk_softmax = c.gating == moh::MoAGating::TopKSoftmax;
  return w;
}

TYPED_TEST(FamiliesTest, JetMoEMatchesTheReferenceAndDecodesAsItPrefills) {
  using T = TypeParam;
  // 3 kv heads of 4, 5 experts, top 2, RoPE base 500, a bias: odd sizes everywhere.
  const moh::MoAAttention<T> layer(moh::MoAConfig::jetmoe(10, 3, 5, 2, 4, 500.0), 90);
  const Index Tn = 9;
  Call<T> call{random_tensor<T>(2, Tn, 10, 91), {}, padding(2, Tn, {{1, 2}}), {},
               some_bias<T>(2, 1, Tn, Tn, 92), true};
  const moh_ref::MoAFamilyResult want = moh_ref::naive_jetmoe(jetmoe_weights(layer), call.reference());
  for (ComputeMode mode : kModes) {
    moh::MoARouting<T> routing;
    const Tensor3<T> y = call.on(layer, call.options(mode), &routing);
    EXPECT_LE(relative_error(y, want.y), Tol<T>::rel) << mode_name(mode);
    for (Index e = 0; e < 5; ++e) EXPECT_EQ(routing.expert_counts[e], want.route.counts[e]);
    EXPECT_NEAR(routing.switch_loss, want.route.switch_loss, Tol<T>::rel * 10);
    EXPECT_NEAR(routing.z_loss, want.route.z_loss, Tol<T>::rel * 10);
  }
  // Decoding: a prompt of 4, then one token at a time; each step's bias rows over the keys so far.
  moh::KvCache<T> cache = layer.make_cache(2, Tn);
  Tensor3<T> stepped(2, Tn, 10);
  for (Index t0 = 0; t0 < Tn;) {
    const Index n = t0 == 0 ? 4 : 1;
    const Eigen::array<Index, 3> xo{0, t0, 0}, xe{2, n, 10};
    const Tensor3<T> xs = call.x.slice(xo, xe);
    const Eigen::array<Index, 4> bo{0, 0, t0, 0}, be{2, 1, n, t0 + n};
    const Tensor4<T> rows = call.bias.slice(bo, be);
    const Eigen::array<Index, 2> po{0, t0}, pe{2, n};
    const Mask pad = call.key_padding.slice(po, pe);
    ForwardOptions o;
    o.attn_bias = rows;
    o.new_token_padding_mask = moh::map_mask(pad);
    Tensor3<T> ys(2, n, 10);
    layer.forward_cached(xs, ys, cache, o);
    stepped.slice(xo, xe) = ys;
    t0 += n;
  }
  EXPECT_LE(relative_error(stepped, want.y), Tol<T>::rel);
}

TYPED_TEST(FamiliesTest, JetMoEProbabilitiesArePerSlotAndAgreeAcrossModes) {
  using T = TypeParam;
  const moh::MoAAttention<T> layer(moh::MoAConfig::jetmoe(12, 2, 4, 3, 6), 93);
  const Tensor3<T> x = random_tensor<T>(2, 6, 12, 94);
  Tensor4<T> sparse(2, 6, 6, 6), dense(2, 6, 6, 6);
  ForwardOptions o = in_mode(ComputeMode::Sparse);
  o.causal = moh::Causal::On;
  o.attention_weights = sparse;
  moh::MoARouting<T> routing;
  run(layer, x, o, &routing);
  o.mode = ComputeMode::Dense;
  o.attention_weights = dense;
  run(layer, x, o);
  double diff = 0;
  for (Index i = 0; i < sparse.size(); ++i)
    diff = std::max(diff, std::abs(static_cast<double>(sparse.data()[i] - dense.data()[i])));
  EXPECT_LE(diff, Tol<T>::exact * 10);
  for (Index b = 0; b < 2; ++b)
    for (Index h = 0; h < 6; ++h)
      for (Index t = 0; t < 6; ++t) {
        double sum = 0;
        for (Index s = 0; s < 6; ++s) sum += static_cast<double>(sparse(b, h, t, s));
        EXPECT_NEAR(sum, 1.0, Tol<T>::exact * 10);
      }
}

TYPED_TEST(FamiliesTest, FairseqMoAIsTheOneKvHeadCaseOfTheSameLayer) {
  using T = TypeParam;
  // The same weights under JetMoE's names with fairseq's settings give fairseq's bits.
  const moh::MoAAttention<T> fairseq(moa_config(12, 4, 5, 2), 95);
  moh::MoAConfig c = fairseq.config();
  c.names = moh::MoANames::JetMoE;
  moh::MoAAttention<T> jet(c);
  jet.set_query_experts(fairseq.query_experts());
  jet.set_output_experts(fairseq.output_experts());
  jet.set_gate_weight(fairseq.gate_weight());
  moh::Matrix<T> kv(8, 12);
  kv << fairseq.key_weight(), fairseq.value_weight();
  jet.set_key_value_weight(kv);
  EXPECT_TRUE(ErrorMentions([&] { jet.set_key_weight(fairseq.key_weight()); },
                            {"kv_proj.weight", "set_key_value_weight"}));
  const Tensor3<T> x = random_tensor<T>(2, 5, 12, 96);
  for (ComputeMode mode : kModes)
    EXPECT_TRUE(BitEqual(run(jet, x, in_mode(mode)), run(fairseq, x, in_mode(mode))));
  // JetMoE's names are its own: saved and loaded, and refused by a fairseq-named layer.
  const moh::MoAAttention<T> real(moh::MoAConfig::jetmoe(12, 2, 4, 2, 3 * 2), 97);
  moh::SafeTensorsWriter w;
  moh::save_weights(w, real, "model.layers.0.self_attention.", moh::dtype_for<T>());
  const moh::SafeTensors st = moh::SafeTensors::from_bytes(w.to_bytes(), "jetmoe");
  for (const char* name : {"experts.input_linear.weight", "experts.output_linear.weight",
                           "experts.router.layer.weight", "experts.bias", "kv_proj.weight"})
    EXPECT_TRUE(st.contains(std::string("model.layers.0.self_attention.") + name)) << name;
  moh::MoAAttention<T> loaded(real.config());
  moh::load_weights(loaded, st, "model.layers.0.self_attention.");
  ForwardOptions causal;
  causal.causal = moh::Causal::On;
  EXPECT_TRUE(BitEqual(run(loaded, x, causal), run(real, x, causal)));
  moh::MoAConfig named_fairseq = real.config();
  named_fairseq.names = moh::MoANames::Fairseq;
  named_fairseq.out_bias = false;
  moh::MoAAttention<T> wrong(named_fairseq);
  EXPECT_TRUE(ErrorMentions([&] { moh::load_weights(wrong, st, "model.layers.0.self_attention."); },
                            {"JetMoE", "names = jetmoe"}));
}

}  // namespace

namespace {

using namespace moh_test;

// ---- what a cache, a record or a file must not do silently -------------------------------------

TEST(FamiliesChecks, AMemoryCacheNeedsWeightsTakesOnlyItsOptionsAndIsNotDecodedInto) {
  moh::MoAConfig c = moh::MoAConfig::jetmoe(12, 2, 4, 2, 6);
  c.kdim = 7;
  const moh::MoAAttention<float> unset(c);
  const Tensor3<float> memory = random_tensor<float>(2, 5, 7, 1);
  EXPECT_TRUE(ErrorMentions([&] { unset.make_memory_cache(memory); }, {"weights not set"}));
  const moh::MoAAttention<float> layer(c, 2);
  moh::Tensor4<float> bias(2, 1, 5, 5);
  bias.setZero();
  ForwardOptions o;
  o.attn_bias = bias;
  EXPECT_TRUE(ErrorMentions([&] { layer.make_memory_cache(memory, o); },
                            {"make_memory_cache", "attn_bias", "forward_cross"}));
  moh::KvCache<float> cache = layer.make_memory_cache(memory);
  EXPECT_TRUE(cache.is_memory());
  cache.truncate(3);  // room again, but still a memory
  const moh::MoAAttention<float> self(moh::MoAConfig::jetmoe(12, 2, 4, 2, 6), 3);
  const Tensor3<float> x = random_tensor<float>(2, 1, 12, 4);
  Tensor3<float> y(2, 1, 12);
  EXPECT_TRUE(ErrorMentions([&] { self.forward_cached(x, y, cache); },
                            {"forward_cached", "make_memory_cache"}));
}

TEST(FamiliesChecks, ARoutingRecordWithQueryPaddingRoundTrips) {
  const moh::MoAAttention<float> layer(moa_config(12, 4, 3, 2), 5);
  const Tensor3<float> x = random_tensor<float>(2, 4, 12, 6);
  const Mask pad = padding(2, 4, {{1, 3}});
  ForwardOptions o;
  o.query_padding_mask = moh::map_mask(pad);
  moh::MoARouting<float> routing;
  run(layer, x, o, &routing);
  moh::SafeTensorsWriter w;
  moh::save_routing(w, routing, "r.");
  moh::MoARouting<float> back;
  moh::load_routing(moh::SafeTensors::from_bytes(w.to_bytes()), back, "r.");
  EXPECT_EQ(back.selected(7, 0), -1);
  EXPECT_EQ(back.selected(7, 1), -1);
  EXPECT_TRUE(BitEqual(back.gates, routing.gates));
  EXPECT_EQ(back.expert_counts, routing.expert_counts);
}

TEST(FamiliesChecks, LoadLayerRefusesForeignTensorsAndReadsOldMoHConfigs) {
  const moh::MoHAttention<float> layer(moh_config(8, 2, 1, 1), 7);
  moh::SafeTensorsWriter w;
  moh::save_weights(w, layer, "a.");
  w.add("a.sr.weight", random_matrix<float>(8, 8, 8));
  EXPECT_TRUE(ErrorMentions(
      [&] { moh::load_layer<moh::MoHAttention<float>>(moh::SafeTensors::from_bytes(w.to_bytes()), "a."); },
      {"a.sr.weight", "AggregatedAttention"}));
  // A config saved before qkv_bias and proj_bias were apart: "bias" sets both.
  for (const bool bias : {false, true}) {
    moh::MoHConfig c = moh_config(8, 2, 1, 1, moh::MoHRouterKind::Learned, 0, 0, bias);
    const moh::MoHAttention<float> saved(c, 9);
    moh::SafeTensorsWriter old;
    moh::save_weights(old, saved, "b.");
    std::string json = moh::detail::config_json(c).dump();
    auto j = nlohmann::json::parse(json);
    j.erase("qkv_bias");
    j.erase("proj_bias");
    j["bias"] = bias;
    old.set_metadata("b.moh.config", j.dump());
    const moh::MoHConfig back =
        moh::load_config<moh::MoHConfig>(moh::SafeTensors::from_bytes(old.to_bytes()), "b.");
    EXPECT_EQ(back.qkv_bias, bias);
    EXPECT_EQ(back.proj_bias, bias);
  }
}

TEST(FamiliesChecks, LoadWeightsRefusesAddBiasKvAndReadsOldMoAConfigs) {
  // torch.nn.MultiheadAttention(add_bias_kv=True) saves bias_k and bias_v [1, 1, D].
  const moh::MultiHeadAttention<float> mha(mha_config(8, 2), 11);
  for (const char* name : {"bias_k", "bias_v"}) {
    moh::SafeTensorsWriter w;
    moh::save_weights(w, mha, "m.");
    w.add(std::string("m.") + name, random_matrix<float>(1, 8, 12));
    moh::MultiHeadAttention<float> target(mha_config(8, 2));
    EXPECT_TRUE(ErrorMentions(
        [&] { moh::load_weights(target, moh::SafeTensors::from_bytes(w.to_bytes()), "m."); },
        {std::string("m.") + name, "add_bias_kv"}));
  }
  // A MoA config saved when its output bias was the field "bias".
  const moh::MoAConfig c = moh::MoAConfig::jetmoe(16, 2, 3, 2, 4);
  const moh::MoAAttention<float> saved(c, 13);
  moh::SafeTensorsWriter old;
  moh::save_weights(old, saved, "j.");
  auto j = nlohmann::json::parse(moh::detail::config_json(c).dump());
  ASSERT_TRUE(j.contains("out_bias"));
  j.erase("out_bias");
  j["bias"] = true;
  old.set_metadata("j.moh.config", j.dump());
  const moh::MoAConfig back =
      moh::load_config<moh::MoAConfig>(moh::SafeTensors::from_bytes(old.to_bytes()), "j.");
  EXPECT_TRUE(back.out_bias);
}

TEST(FamiliesChecks, TheKernelTakesBiasRowsAtOffsets) {
  // Two queries whose bias rows are given by offsets into one buffer (stride 0): the second
  // reuses the first's row, so both must see key 1 hidden.
  const float q[] = {1, 0, 0, 1}, k[] = {1, 0, 0, 1, 1, 1}, v[] = {1, 2, 3, 4, 5, 6};
  const float row[] = {0, -std::numeric_limits<float>::infinity(), 0};
  const Index offsets[] = {0, 0};
  float out[4] = {};
  moh::attention<float>(moh::AttentionQueries<float>{q, 2, 2, 2, 1.0f, {nullptr, 0}},
                        moh::AttentionKeysValues<float>{k, 2, v, 2, 3}, moh::AttentionMasking{},
                        moh::AttentionOutput<float>{out, 2}, nullptr,
                        moh::AttentionBias<float>{row, 0, offsets});
  // Query 0 = (1, 0): scores 1, -, 1 over keys 0 and 2: the mean of values 0 and 2.
  EXPECT_FLOAT_EQ(out[0], 3.0f);
  EXPECT_FLOAT_EQ(out[1], 4.0f);
}

}  // namespace
