// Tests for moh/checkpoint.hpp: load_weights() for every layer kind from a safetensors file built
// in memory (a tiny writer below), under a prefix such as "blocks.3.attn."; F16 / BF16 / F64
// conversion; errors that name the missing or mis-shaped tensor and both shapes; LLaMA-style
// q_proj / k_proj / v_proj / o_proj names for MHA and MoH with grouped-query heads.
#include "moh/checkpoint.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

namespace {

using moh::Index;
using moh::Matrix;
using Bytes = std::vector<std::uint8_t>;

// ---- a tiny safetensors writer ------------------------------------------------------------------

template <class U>
void put_le(Bytes& out, U bits) {
  for (std::size_t i = 0; i < sizeof(U); ++i) out.push_back(static_cast<std::uint8_t>(bits >> (8 * i)));
}

std::uint32_t float_bits(float v) {
  std::uint32_t b;
  std::memcpy(&b, &v, 4);
  return b;
}

/// binary16 bits of v; v must be exactly representable as a normal half or zero.
std::uint16_t half_bits(float v) {
  const std::uint32_t b = float_bits(v);
  const std::uint16_t sign = static_cast<std::uint16_t>((b >> 16) & 0x8000u);
  if ((b & 0x7FFFFFFFu) == 0) return sign;
  const int exponent = static_cast<int>((b >> 23) & 0xFF) - 127;
  const std::uint32_t mantissa = b & 0x7FFFFFu;
  EXPECT_TRUE(exponent >= -14 && exponent <= 15 && (mantissa & 0x1FFFu) == 0)
      << v << " is not exactly a normal half";
  return static_cast<std::uint16_t>(sign | ((exponent + 15) << 10) | (mantissa >> 13));
}

/// bfloat16 bits of v; v must have at most 8 significant bits.
std::uint16_t bf16_bits(float v) {
  const std::uint32_t b = float_bits(v);
  EXPECT_EQ(b & 0xFFFFu, 0u) << v << " is not exactly a bfloat16";
  return static_cast<std::uint16_t>(b >> 16);
}

struct Entry {
  std::string name;
  std::string dtype;  // F32, F64, F16, BF16
  std::vector<std::int64_t> shape;
  std::vector<double> values;  // row-major; encoded in `dtype`
};

Bytes encode(const Entry& e) {
  Bytes out;
  for (double v : e.values) {
    if (e.dtype == "F32") {
      put_le(out, float_bits(static_cast<float>(v)));
    } else if (e.dtype == "F64") {
      std::uint64_t b;
      std::memcpy(&b, &v, 8);
      put_le(out, b);
    } else if (e.dtype == "F16") {
      put_le(out, half_bits(static_cast<float>(v)));
    } else if (e.dtype == "BF16") {
      put_le(out, bf16_bits(static_cast<float>(v)));
    } else {
      ADD_FAILURE() << "unknown dtype " << e.dtype;
    }
  }
  return out;
}

/// 8-byte little-endian header length, the JSON header, then each entry's bytes back to back.
Bytes write_safetensors(const std::vector<Entry>& entries) {
  nlohmann::json header = nlohmann::json::object();
  Bytes data;
  for (const Entry& e : entries) {
    const Bytes b = encode(e);
    const std::size_t begin = data.size();
    data.insert(data.end(), b.begin(), b.end());
    header[e.name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {begin, data.size()}}};
  }
  header["__metadata__"] = {{"format", "pt"}};
  const std::string text = header.dump();
  Bytes out;
  put_le(out, static_cast<std::uint64_t>(text.size()));
  out.insert(out.end(), text.begin(), text.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

moh::SafeTensors open(const std::vector<Entry>& entries) {
  return moh::SafeTensors::from_bytes(write_safetensors(entries), "test.safetensors");
}

std::int64_t numel(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

/// An entry of multiples of 1/64 in [-1, 1] (exact in F16, BF16, F32 and F64).
Entry exact_entry(const std::string& name, std::vector<std::int64_t> shape, std::uint64_t seed,
                  const std::string& dtype = "F32") {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> k(-64, 64);
  Entry e{name, dtype, shape, {}};
  for (std::int64_t i = 0; i < numel(shape); ++i) e.values.push_back(k(rng) / 64.0);
  return e;
}

/// An entry of arbitrary doubles (not exact in float).
Entry double_entry(const std::string& name, std::vector<std::int64_t> shape, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(-1, 1);
  Entry e{name, "F64", shape, {}};
  for (std::int64_t i = 0; i < numel(shape); ++i) e.values.push_back(u(rng));
  return e;
}

/// The entry's values as a [rows, cols] matrix in T (each value converted as T(v)).
template <class T>
Matrix<T> as_matrix(const Entry& e, Index rows, Index cols) {
  Matrix<T> m(rows, cols);
  for (Index i = 0; i < m.size(); ++i) m.data()[i] = static_cast<T>(e.values[i]);
  return m;
}
template <class T>
moh::Vector<T> as_vector(const Entry& e) {
  moh::Vector<T> v(static_cast<Index>(e.values.size()));
  for (Index i = 0; i < v.size(); ++i) v[i] = static_cast<T>(e.values[i]);
  return v;
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const moh::Error& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::vector<Entry> without(std::vector<Entry> entries, const std::string& name) {
  entries.erase(std::remove_if(entries.begin(), entries.end(),
                               [&](const Entry& e) { return e.name == name; }),
                entries.end());
  return entries;
}

const std::string kPrefix = "blocks.3.attn.";

// ---- MHA (torch nn.MultiheadAttention names) -----------------------------------------------------

moh::MhaConfig small_mha() {
  moh::MhaConfig c;
  c.embed_dim = 8;
  c.num_heads = 2;
  c.head_dim = 3;  // H d = 6 != D
  return c;
}

std::vector<Entry> mha_entries(const std::string& prefix, std::uint64_t seed) {
  return {exact_entry(prefix + "in_proj_weight", {18, 8}, seed),
          exact_entry(prefix + "in_proj_bias", {18}, seed + 1),
          exact_entry(prefix + "out_proj.weight", {8, 6}, seed + 2),
          exact_entry(prefix + "out_proj.bias", {8}, seed + 3)};
}

TEST(Checkpoint, LoadsMhaUnderPrefix) {
  // The wanted block next to decoys: another block and the same names without prefix.
  std::vector<Entry> entries = mha_entries(kPrefix, 1);
  for (const Entry& e : mha_entries("blocks.2.attn.", 100)) entries.push_back(e);
  for (const Entry& e : mha_entries("", 200)) entries.push_back(e);
  const moh::SafeTensors st = open(entries);
  moh::MultiHeadAttention<float> layer(small_mha());
  moh::load_weights(layer, st, kPrefix);
  EXPECT_EQ(layer.in_proj_weight(), as_matrix<float>(entries[0], 18, 8));
  EXPECT_EQ(layer.in_proj_bias(), as_vector<float>(entries[1]));
  EXPECT_EQ(layer.out_proj_weight(), as_matrix<float>(entries[2], 8, 6));
  EXPECT_EQ(layer.out_proj_bias(), as_vector<float>(entries[3]));
  // No prefix: the unprefixed copy.
  moh::MultiHeadAttention<float> root(small_mha());
  moh::load_weights(root, st);
  EXPECT_EQ(root.in_proj_weight(), as_matrix<float>(entries[8], 18, 8));
  EXPECT_NE(root.in_proj_weight(), layer.in_proj_weight());
}

TEST(Checkpoint, LoadsGqaMhaWithoutBias) {
  moh::MhaConfig c = small_mha();
  c.num_kv_heads = 1;  // (2 + 2 * 1) * 3 = 12 input rows
  c.bias = false;
  const std::vector<Entry> entries = {exact_entry(kPrefix + "in_proj_weight", {12, 8}, 5),
                                      exact_entry(kPrefix + "out_proj.weight", {8, 6}, 6)};
  moh::MultiHeadAttention<double> layer(c);
  moh::load_weights(layer, open(entries), kPrefix);
  EXPECT_EQ(layer.in_proj_weight(), as_matrix<double>(entries[0], 12, 8));
  EXPECT_EQ(layer.out_proj_weight(), as_matrix<double>(entries[1], 8, 6));
  EXPECT_EQ(layer.in_proj_bias().size(), 0);
}

// ---- MoH (MoH ViT/DiT names) ----------------------------------------------------------------------

TEST(Checkpoint, LoadsMoHLearnedRouterUnderPrefix) {
  moh::MoHConfig c;
  c.embed_dim = 8;
  c.num_heads = 5;
  c.head_dim = 2;
  c.shared_heads = 2;
  c.active_routed_heads = 2;
  const std::vector<Entry> entries = {
      exact_entry(kPrefix + "qkv.weight", {30, 8}, 10), exact_entry(kPrefix + "qkv.bias", {30}, 11),
      exact_entry(kPrefix + "proj.weight", {8, 10}, 12), exact_entry(kPrefix + "proj.bias", {8}, 13),
      exact_entry(kPrefix + "wg.weight", {3, 8}, 14),    exact_entry(kPrefix + "wg_0.weight", {2, 8}, 15),
      exact_entry(kPrefix + "wg_1.weight", {2, 8}, 16)};
  moh::MoHAttention<float> layer(c);
  moh::load_weights(layer, open(entries), kPrefix);
  EXPECT_EQ(layer.qkv_weight(), as_matrix<float>(entries[0], 30, 8));
  EXPECT_EQ(layer.qkv_bias(), as_vector<float>(entries[1]));
  EXPECT_EQ(layer.proj_weight(), as_matrix<float>(entries[2], 8, 10));
  EXPECT_EQ(layer.proj_bias(), as_vector<float>(entries[3]));
  EXPECT_EQ(layer.router().routed_weight(), as_matrix<float>(entries[4], 3, 8));
  EXPECT_EQ(layer.router().mix_weight(), as_matrix<float>(entries[5], 2, 8));
  EXPECT_EQ(layer.router().shared_weight(), as_matrix<float>(entries[6], 2, 8));

  // Missing router weight: the error names it.
  const std::string msg = error_of([&] {
    moh::MoHAttention<float> l(c);
    moh::load_weights(l, open(without(entries, kPrefix + "wg_0.weight")), kPrefix);
  });
  EXPECT_TRUE(contains(msg, kPrefix + "wg_0.weight")) << msg;
}

TEST(Checkpoint, MoHNeedsOnlyTheRouterWeightsItHas) {
  // One shared head: no wg_1. Only shared heads (K = 0): only wg_1. Query-norm router: none.
  moh::MoHConfig one_shared;
  one_shared.embed_dim = 8;
  one_shared.num_heads = 4;
  one_shared.shared_heads = 1;
  one_shared.active_routed_heads = 2;  // d = 2, 24 qkv rows, 3 routed heads
  moh::MoHAttention<float> a(one_shared);
  const std::vector<Entry> ea = {exact_entry("qkv.weight", {24, 8}, 20), exact_entry("qkv.bias", {24}, 21),
                                 exact_entry("proj.weight", {8, 8}, 22), exact_entry("proj.bias", {8}, 23),
                                 exact_entry("wg.weight", {3, 8}, 24), exact_entry("wg_0.weight", {2, 8}, 25)};
  EXPECT_NO_THROW(moh::load_weights(a, open(ea)));
  EXPECT_EQ(a.router().routed_weight(), as_matrix<float>(ea[4], 3, 8));
  EXPECT_EQ(a.router().shared_weight().size(), 0);

  moh::MoHConfig shared_only = one_shared;
  shared_only.shared_heads = 3;
  shared_only.active_routed_heads = 0;
  moh::MoHAttention<float> b(shared_only);
  std::vector<Entry> eb(ea.begin(), ea.begin() + 4);
  eb.push_back(exact_entry("wg_1.weight", {3, 8}, 26));
  EXPECT_NO_THROW(moh::load_weights(b, open(eb)));
  EXPECT_EQ(b.router().shared_weight(), as_matrix<float>(eb[4], 3, 8));

  moh::MoHConfig qn = one_shared;
  qn.router = moh::MoHRouter::QueryNorm;
  moh::MoHAttention<float> q(qn);
  EXPECT_NO_THROW(moh::load_weights(q, open(std::vector<Entry>(ea.begin(), ea.begin() + 4))));
  EXPECT_EQ(q.qkv_weight(), as_matrix<float>(ea[0], 24, 8));
}

// ---- MoA (fairseq names) --------------------------------------------------------------------------

TEST(Checkpoint, LoadsMoAUnderPrefix) {
  moh::MoAConfig c;
  c.embed_dim = 8;
  c.head_dim = 4;
  c.num_experts = 3;
  c.top_k = 2;
  const std::vector<Entry> entries = {exact_entry(kPrefix + "q_proj.experts.w", {3, 8, 4}, 30),
                                      exact_entry(kPrefix + "q_proj.output_experts.w", {3, 4, 8}, 31),
                                      exact_entry(kPrefix + "q_proj.w_gate", {8, 3}, 32),
                                      exact_entry(kPrefix + "k_proj.weight", {4, 8}, 33),
                                      exact_entry(kPrefix + "v_proj.weight", {4, 8}, 34)};
  moh::MoAAttention<float> layer(c);
  moh::load_weights(layer, open(entries), kPrefix);
  // Expert e's [D, d] query matrix is rows e*D .. of query_experts(); w[e][i][j] at (e*D + i, j).
  for (Index e = 0; e < 3; ++e)
    for (Index i = 0; i < 8; ++i)
      for (Index j = 0; j < 4; ++j) {
        EXPECT_EQ(layer.query_experts()(e * 8 + i, j),
                  static_cast<float>(entries[0].values[(e * 8 + i) * 4 + j]));
        EXPECT_EQ(layer.output_experts()(e * 4 + j, i),
                  static_cast<float>(entries[1].values[(e * 4 + j) * 8 + i]));
      }
  EXPECT_EQ(layer.gate_weight(), as_matrix<float>(entries[2], 8, 3));
  EXPECT_EQ(layer.key_weight(), as_matrix<float>(entries[3], 4, 8));
  EXPECT_EQ(layer.value_weight(), as_matrix<float>(entries[4], 4, 8));
}

// ---- dtype conversion ----------------------------------------------------------------------------

TEST(Checkpoint, ConvertsF16Bf16F64) {
  // Multiples of 1/64 are exact in F16 and BF16, so the loaded floats equal them exactly; F64
  // values arrive as float(v) in a float layer and exactly in a double layer.
  std::vector<Entry> entries = {exact_entry(kPrefix + "in_proj_weight", {18, 8}, 40, "F16"),
                                exact_entry(kPrefix + "in_proj_bias", {18}, 41, "BF16"),
                                double_entry(kPrefix + "out_proj.weight", {8, 6}, 42),
                                exact_entry(kPrefix + "out_proj.bias", {8}, 43, "F16")};
  entries[0].values[0] = -0.0;  // signed zero and a large-exponent value survive
  entries[0].values[1] = 1024.0;
  const moh::SafeTensors st = open(entries);
  moh::MultiHeadAttention<float> f(small_mha());
  moh::load_weights(f, st, kPrefix);
  EXPECT_EQ(f.in_proj_weight(), as_matrix<float>(entries[0], 18, 8));
  EXPECT_EQ(f.in_proj_weight()(0, 1), 1024.0f);
  EXPECT_TRUE(std::signbit(f.in_proj_weight()(0, 0)));
  EXPECT_EQ(f.in_proj_bias(), as_vector<float>(entries[1]));
  EXPECT_EQ(f.out_proj_weight(), as_matrix<float>(entries[2], 8, 6));  // rounded to float
  EXPECT_EQ(f.out_proj_bias(), as_vector<float>(entries[3]));

  moh::MultiHeadAttention<double> d(small_mha());
  moh::load_weights(d, st, kPrefix);
  EXPECT_EQ(d.out_proj_weight(), as_matrix<double>(entries[2], 8, 6));  // exact
  EXPECT_EQ(d.in_proj_weight(), as_matrix<double>(entries[0], 18, 8));

  // A MoA layer from BF16 experts and F64 key/value weights.
  moh::MoAConfig c;
  c.embed_dim = 8;
  c.head_dim = 4;
  c.num_experts = 2;
  c.top_k = 1;
  const std::vector<Entry> moa = {exact_entry("q_proj.experts.w", {2, 8, 4}, 44, "BF16"),
                                  exact_entry("q_proj.output_experts.w", {2, 4, 8}, 45, "F16"),
                                  exact_entry("q_proj.w_gate", {8, 2}, 46, "F64"),
                                  double_entry("k_proj.weight", {4, 8}, 47),
                                  exact_entry("v_proj.weight", {4, 8}, 48, "BF16")};
  moh::MoAAttention<double> m(c);
  moh::load_weights(m, open(moa));
  EXPECT_EQ(m.query_experts(), as_matrix<double>(moa[0], 16, 4));
  EXPECT_EQ(m.output_experts(), as_matrix<double>(moa[1], 8, 8));
  EXPECT_EQ(m.key_weight(), as_matrix<double>(moa[3], 4, 8));
  EXPECT_EQ(m.value_weight(), as_matrix<double>(moa[4], 4, 8));
}

// ---- errors ----------------------------------------------------------------------------------------

TEST(Checkpoint, MissingTensorNamesIt) {
  const std::vector<Entry> entries = mha_entries(kPrefix, 50);
  for (const char* name : {"in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"}) {
    const std::string msg = error_of([&] {
      moh::MultiHeadAttention<float> layer(small_mha());
      moh::load_weights(layer, open(without(entries, kPrefix + name)), kPrefix);
    });
    EXPECT_TRUE(contains(msg, kPrefix + name)) << name << ": " << msg;
  }
  // The right names under the wrong prefix are missing too.
  const std::string msg = error_of([&] {
    moh::MultiHeadAttention<float> layer(small_mha());
    moh::load_weights(layer, open(entries), "blocks.4.attn.");
  });
  EXPECT_TRUE(contains(msg, "blocks.4.attn.in_proj_weight")) << msg;
  // MoA without its key projection.
  moh::MoAConfig c;
  c.embed_dim = 8;
  c.head_dim = 4;
  c.num_experts = 3;
  c.top_k = 1;
  const std::vector<Entry> moa = {exact_entry("q_proj.experts.w", {3, 8, 4}, 51),
                                  exact_entry("q_proj.output_experts.w", {3, 4, 8}, 52),
                                  exact_entry("q_proj.w_gate", {8, 3}, 53),
                                  exact_entry("v_proj.weight", {4, 8}, 54)};
  const std::string moa_msg = error_of([&] {
    moh::MoAAttention<float> layer(c);
    moh::load_weights(layer, open(moa));
  });
  EXPECT_TRUE(contains(moa_msg, "k_proj.weight")) << moa_msg;
}

TEST(Checkpoint, MisShapedTensorNamesItAndBothShapes) {
  std::vector<Entry> entries = mha_entries(kPrefix, 60);
  entries[2] = exact_entry(kPrefix + "out_proj.weight", {8, 7}, 61);  // expected [8, 6]
  std::string msg = error_of([&] {
    moh::MultiHeadAttention<float> layer(small_mha());
    moh::load_weights(layer, open(entries), kPrefix);
  });
  EXPECT_TRUE(contains(msg, kPrefix + "out_proj.weight")) << msg;
  EXPECT_TRUE(contains(msg, "[8, 6]")) << msg;
  EXPECT_TRUE(contains(msg, "[8, 7]")) << msg;

  entries = mha_entries(kPrefix, 62);
  entries[1] = exact_entry(kPrefix + "in_proj_bias", {17}, 63);  // expected [18]
  msg = error_of([&] {
    moh::MultiHeadAttention<float> layer(small_mha());
    moh::load_weights(layer, open(entries), kPrefix);
  });
  EXPECT_TRUE(contains(msg, kPrefix + "in_proj_bias")) << msg;
  EXPECT_TRUE(contains(msg, "[18]")) << msg;
  EXPECT_TRUE(contains(msg, "[17]")) << msg;

  // A MoA expert stack with D and d swapped (same element count).
  moh::MoAConfig c;
  c.embed_dim = 8;
  c.head_dim = 4;
  c.num_experts = 3;
  c.top_k = 1;
  const std::vector<Entry> moa = {exact_entry("q_proj.experts.w", {3, 4, 8}, 64),
                                  exact_entry("q_proj.output_experts.w", {3, 4, 8}, 65),
                                  exact_entry("q_proj.w_gate", {8, 3}, 66),
                                  exact_entry("k_proj.weight", {4, 8}, 67),
                                  exact_entry("v_proj.weight", {4, 8}, 68)};
  msg = error_of([&] {
    moh::MoAAttention<float> layer(c);
    moh::load_weights(layer, open(moa));
  });
  EXPECT_TRUE(contains(msg, "q_proj.experts.w")) << msg;
  EXPECT_TRUE(contains(msg, "[3, 8, 4]")) << msg;
  EXPECT_TRUE(contains(msg, "[3, 4, 8]")) << msg;

  // A MoH routed-head router with one row too many.
  moh::MoHConfig mc;
  mc.embed_dim = 8;
  mc.num_heads = 4;
  mc.shared_heads = 1;
  mc.active_routed_heads = 1;
  const std::vector<Entry> mh = {exact_entry("qkv.weight", {24, 8}, 70), exact_entry("qkv.bias", {24}, 71),
                                 exact_entry("proj.weight", {8, 8}, 72), exact_entry("proj.bias", {8}, 73),
                                 exact_entry("wg.weight", {4, 8}, 74), exact_entry("wg_0.weight", {2, 8}, 75)};
  msg = error_of([&] {
    moh::MoHAttention<float> layer(mc);
    moh::load_weights(layer, open(mh));
  });
  EXPECT_TRUE(contains(msg, "wg.weight")) << msg;
  EXPECT_TRUE(contains(msg, "[3, 8]")) << msg;
  EXPECT_TRUE(contains(msg, "[4, 8]")) << msg;
}

// ---- LLaMA-style names ------------------------------------------------------------------------------

std::vector<Entry> llama_entries(const std::string& prefix, Index H, Index Hkv, Index d, Index D,
                                 std::uint64_t seed) {
  return {exact_entry(prefix + "q_proj.weight", {H * d, D}, seed),
          exact_entry(prefix + "k_proj.weight", {Hkv * d, D}, seed + 1),
          exact_entry(prefix + "v_proj.weight", {Hkv * d, D}, seed + 2),
          exact_entry(prefix + "o_proj.weight", {D, H * d}, seed + 3)};
}

/// [q; k; v] stacked as the fused input projection.
template <class T>
Matrix<T> stacked(const std::vector<Entry>& e, Index H, Index Hkv, Index d, Index D) {
  Matrix<T> w(H * d + 2 * Hkv * d, D);
  w.topRows(H * d) = as_matrix<T>(e[0], H * d, D);
  w.middleRows(H * d, Hkv * d) = as_matrix<T>(e[1], Hkv * d, D);
  w.bottomRows(Hkv * d) = as_matrix<T>(e[2], Hkv * d, D);
  return w;
}

TEST(Checkpoint, LlamaNamesLoadIntoGqaMhaAndMoH) {
  const Index D = 16, H = 4, Hkv = 2, d = 4;
  const std::vector<Entry> entries = llama_entries("model.layers.3.self_attn.", H, Hkv, d, D, 80);
  const moh::SafeTensors st = open(entries);

  moh::MhaConfig mc;
  mc.embed_dim = D;
  mc.num_heads = H;
  mc.num_kv_heads = Hkv;
  mc.bias = false;
  mc.rope = true;
  moh::MultiHeadAttention<float> mha(mc);
  moh::load_weights(mha, st, "model.layers.3.self_attn.");
  EXPECT_EQ(mha.in_proj_weight(), stacked<float>(entries, H, Hkv, d, D));
  EXPECT_EQ(mha.out_proj_weight(), as_matrix<float>(entries[3], D, H * d));

  moh::MoHConfig hc;
  hc.embed_dim = D;
  hc.num_heads = H;
  hc.num_kv_heads = Hkv;
  hc.shared_heads = 2;
  hc.active_routed_heads = 1;
  hc.router = moh::MoHRouter::QueryNorm;
  hc.bias = false;
  hc.rope = true;
  moh::MoHAttention<double> mh(hc);
  moh::load_weights(mh, st, "model.layers.3.self_attn.");
  EXPECT_EQ(mh.qkv_weight(), stacked<double>(entries, H, Hkv, d, D));
  EXPECT_EQ(mh.proj_weight(), as_matrix<double>(entries[3], D, H * d));

  // With GQA the k_proj rows are Hkv * d: a file written for H kv heads is refused, naming it.
  const std::vector<Entry> mha_sized = llama_entries("", H, H, d, D, 90);
  const std::string msg = error_of([&] {
    moh::MultiHeadAttention<float> l(mc);
    moh::load_weights(l, open(mha_sized));
  });
  EXPECT_TRUE(contains(msg, "k_proj.weight")) << msg;
  EXPECT_TRUE(contains(msg, "[8, 16]")) << msg;
  EXPECT_TRUE(contains(msg, "[16, 16]")) << msg;
}

TEST(Checkpoint, LlamaNamesWithBiasesAndFusedNamesWin) {
  const Index D = 8, H = 2, Hkv = 1, d = 4;
  std::vector<Entry> entries = llama_entries("", H, Hkv, d, D, 100);
  entries.push_back(exact_entry("q_proj.bias", {H * d}, 104));
  entries.push_back(exact_entry("k_proj.bias", {Hkv * d}, 105));
  entries.push_back(exact_entry("v_proj.bias", {Hkv * d}, 106));
  entries.push_back(exact_entry("o_proj.bias", {D}, 107));
  moh::MhaConfig mc;
  mc.embed_dim = D;
  mc.num_heads = H;
  mc.num_kv_heads = Hkv;
  moh::MultiHeadAttention<float> mha(mc);
  moh::load_weights(mha, open(entries));
  moh::Vector<float> b(H * d + 2 * Hkv * d);
  b << as_vector<float>(entries[4]), as_vector<float>(entries[5]), as_vector<float>(entries[6]);
  EXPECT_EQ(mha.in_proj_bias(), b);
  EXPECT_EQ(mha.out_proj_bias(), as_vector<float>(entries[7]));
  // Missing o_proj.bias in a layer with biases is named.
  const std::string msg = error_of([&] {
    moh::MultiHeadAttention<float> l(mc);
    moh::load_weights(l, open(without(entries, "o_proj.bias")));
  });
  EXPECT_TRUE(contains(msg, "o_proj.bias")) << msg;
  // When the fused torch names are present they are used, not the LLaMA ones.
  std::vector<Entry> both = entries;
  for (const Entry& e : {exact_entry("in_proj_weight", {16, 8}, 110), exact_entry("in_proj_bias", {16}, 111),
                         exact_entry("out_proj.weight", {8, 8}, 112), exact_entry("out_proj.bias", {8}, 113)})
    both.push_back(e);
  moh::MultiHeadAttention<float> fused(mc);
  moh::load_weights(fused, open(both));
  EXPECT_EQ(fused.in_proj_weight(), as_matrix<float>(both[8], 16, 8));
  EXPECT_EQ(fused.out_proj_bias(), as_vector<float>(both[11]));
}

TEST(Checkpoint, LoadsFromAFileOnDisk) {
  const std::vector<Entry> entries = mha_entries(kPrefix, 120);
  const Bytes bytes = write_safetensors(entries);
  const std::string path = ::testing::TempDir() + "moh_checkpoint_test.safetensors";
  {
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  }
  moh::MultiHeadAttention<float> layer(small_mha());
  moh::load_weights(layer, moh::SafeTensors::open(path), kPrefix);
  std::remove(path.c_str());
  EXPECT_EQ(layer.in_proj_weight(), as_matrix<float>(entries[0], 18, 8));
  EXPECT_EQ(layer.out_proj_bias(), as_vector<float>(entries[3]));
}

// ---- saving, load_layer, sharded checkpoints, routing records ------------------------------------

bool same_bits(const moh::Tensor3<float>& a, const moh::Tensor3<float>& b) {
  return a.dimensions() == b.dimensions() &&
         std::memcmp(a.data(), b.data(), sizeof(float) * static_cast<std::size_t>(a.size())) == 0;
}

moh::Tensor3<float> random_input(Index B, Index T, Index D, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  moh::Tensor3<float> x(B, T, D);
  for (Index i = 0; i < x.size(); ++i) x.data()[i] = dist(rng);
  return x;
}

moh::MoHConfig llama_moh() {
  moh::MoHConfig c;
  c.embed_dim = 32;
  c.num_heads = 8;
  c.num_kv_heads = 2;
  c.shared_heads = 2;
  c.active_routed_heads = 3;
  c.router = moh::MoHRouter::QueryNorm;
  c.bias = false;
  c.rope = true;
  c.rope_base = 500000.0;
  return c;
}

moh::MoAConfig small_moa() {
  moh::MoAConfig c;
  c.embed_dim = 24;
  c.head_dim = 8;
  c.num_experts = 5;
  c.top_k = 2;
  c.gating = moh::MoAGating::TopKSoftmax;
  return c;
}

// Saving then load_layer() rebuilds the same layer: config and weights, so the same output bits.
TEST(CheckpointSave, EveryLayerRoundTripsThroughAFile) {
  moh::MhaConfig mha_config = small_mha();
  mha_config.head_dim = 4;  // RoPE needs an even head size
  mha_config.num_kv_heads = 1;
  mha_config.rope = true;
  const moh::MultiHeadAttention<float> mha(mha_config, 1);
  moh::MoHConfig learned;
  learned.embed_dim = 24;
  learned.num_heads = 6;
  learned.head_dim = 5;
  learned.shared_heads = 2;
  learned.active_routed_heads = 2;
  const moh::MoHAttention<float> moh_learned(learned, 2);
  moh::MoHConfig bf16 = llama_moh();
  bf16.weight_storage = moh::WeightStorage::BFloat16;
  const moh::MoHAttention<float> moh_llama(bf16, 3);
  const moh::MoAAttention<float> moa(small_moa(), 4);

  moh::SafeTensorsWriter w;
  moh::save_weights(w, mha, "blocks.0.attn.");
  moh::save_weights(w, moh_learned, "blocks.1.attn.");
  moh::save_weights(w, moh_llama, "layers.0.self_attn.", moh::DType::BF16);  // exact: bf16 values
  moh::save_weights(w, moa, "blocks.2.attn.");
  const std::string path = ::testing::TempDir() + "moh_checkpoint_save_roundtrip.safetensors";
  w.write(path);
  const moh::SafeTensors st = moh::SafeTensors::open(path);
  std::remove(path.c_str());

  const auto mha2 = moh::load_layer<moh::MultiHeadAttention<float>>(st, "blocks.0.attn.");
  const auto learned2 = moh::load_layer<moh::MoHAttention<float>>(st, "blocks.1.attn.");
  const auto llama2 = moh::load_layer<moh::MoHAttention<float>>(st, "layers.0.self_attn.");
  const auto moa2 = moh::load_layer<moh::MoAAttention<float>>(st, "blocks.2.attn.");
  EXPECT_EQ(mha2.num_kv_heads(), 1);
  EXPECT_TRUE(mha2.config().rope);
  EXPECT_EQ(learned2.config().head_dim, 5);
  EXPECT_EQ(llama2.config().router, moh::MoHRouter::QueryNorm);
  EXPECT_EQ(llama2.config().weight_storage, moh::WeightStorage::BFloat16);
  EXPECT_EQ(llama2.config().rope_base, 500000.0);
  EXPECT_EQ(moa2.config().gating, moh::MoAGating::TopKSoftmax);
  EXPECT_EQ(st.info("layers.0.self_attn.qkv.weight").dtype, moh::DType::BF16);

  moh::ForwardOptions o;
  o.causal = true;
  EXPECT_TRUE(same_bits(mha2(random_input(2, 7, 8, 5), o), mha(random_input(2, 7, 8, 5), o)));
  EXPECT_TRUE(same_bits(learned2(random_input(2, 7, 24, 6), o), moh_learned(random_input(2, 7, 24, 6), o)));
  EXPECT_TRUE(same_bits(llama2(random_input(1, 9, 32, 7), o), moh_llama(random_input(1, 9, 32, 7), o)));
  EXPECT_TRUE(same_bits(moa2(random_input(2, 7, 24, 8), o), moa(random_input(2, 7, 24, 8), o)));
}

// The same layers spread over shards with a Hugging Face index load identically.
TEST(CheckpointSave, LoadsLayersFromAShardedCheckpoint) {
  const moh::MoHAttention<float> a(llama_moh(), 11);
  const moh::MoAAttention<float> b(small_moa(), 12);
  const std::string dir = ::testing::TempDir();
  const std::string stem = "moh_checkpoint_shards_";
  moh::SafeTensorsWriter w1, w2;
  moh::save_weights(w1, a, "model.layers.0.");
  moh::save_weights(w2, b, "model.layers.1.");
  w1.write(dir + stem + "1.safetensors");
  w2.write(dir + stem + "2.safetensors");
  nlohmann::json index = {{"metadata", {{"total_size", 0},
                                        {moh::config_key("model.layers.0."),
                                         moh::SafeTensors::open(dir + stem + "1.safetensors")
                                             .metadata_value(moh::config_key("model.layers.0."))},
                                        {moh::config_key("model.layers.1."),
                                         moh::SafeTensors::open(dir + stem + "2.safetensors")
                                             .metadata_value(moh::config_key("model.layers.1."))}}},
                          {"weight_map", nlohmann::json::object()}};
  for (const std::string& n : moh::SafeTensors::open(dir + stem + "1.safetensors").names())
    index["weight_map"][n] = stem + "1.safetensors";
  for (const std::string& n : moh::SafeTensors::open(dir + stem + "2.safetensors").names())
    index["weight_map"][n] = stem + "2.safetensors";
  const std::string index_path = dir + stem + "model.safetensors.index.json";
  std::ofstream(index_path) << index.dump(2);

  const moh::ShardedSafeTensors ckpt = moh::ShardedSafeTensors::open(index_path);
  const auto a2 = moh::load_layer<moh::MoHAttention<float>>(ckpt, "model.layers.0.");
  moh::MoAAttention<float> b2(small_moa());
  moh::load_weights(b2, ckpt, "model.layers.1.");
  for (const char* f : {"1.safetensors", "2.safetensors", "model.safetensors.index.json"})
    std::remove((dir + stem + f).c_str());
  EXPECT_TRUE(same_bits(a2(random_input(1, 5, 32, 9)), a(random_input(1, 5, 32, 9))));
  EXPECT_TRUE(same_bits(b2(random_input(1, 5, 24, 9)), b(random_input(1, 5, 24, 9))));
}

// A stored config that is not a valid layer config is a moh::Error naming the problem.
TEST(CheckpointSave, MalformedStoredConfigThrows) {
  const moh::MoHAttention<float> layer(llama_moh(), 1);
  moh::SafeTensorsWriter good;
  moh::save_weights(good, layer);
  const nlohmann::json config = nlohmann::json::parse(
      moh::SafeTensors::from_bytes(good.to_bytes()).metadata_value(moh::config_key("")));
  auto load_with = [&](const std::string& text) {
    moh::SafeTensorsWriter w;
    moh::save_weights(w, layer);
    w.set_metadata(moh::config_key(""), text);
    const moh::SafeTensors st = moh::SafeTensors::from_bytes(w.to_bytes(), "edited");
    return error_of([&] { moh::load_layer<moh::MoHAttention<float>>(st); });
  };
  auto edited = [&](const char* key, const nlohmann::json& value) {
    nlohmann::json j = config;
    j[key] = value;
    return j.dump();
  };
  struct Bad { std::string text; const char* mentions; };
  const std::vector<Bad> cases = {
      {"{not json", "invalid JSON"},
      {"[1, 2]", "JSON object"},
      {std::string(200, '[') + std::string(200, ']'), "nesting"},
      {edited("layer", "MoAAttention"), "MoHAttention"},
      {edited("num_heads", "8"), "num_heads"},
      {edited("num_heads", 2.5), "num_heads"},
      {edited("num_heads", -8), "num_heads"},
      {edited("num_heads", 1LL << 40), "num_heads"},
      {edited("router", "clever"), "router"},
      {edited("bias", 1), "bias"},
      {edited("weight_storage", "int4"), "weight_storage"},
      {edited("num_heads_typo", 8), "num_heads_typo"},
      {edited("shared_heads", 9), "shared_heads"},        // more shared heads than heads
      {edited("num_kv_heads", 3), "num_kv_heads"},        // does not divide 8
      {edited("rope_base", -1.0), "rope_base"},
      {edited("head_dim", 3), "even head_dim"},           // RoPE needs an even head size
  };
  for (const Bad& bad : cases) {
    const std::string msg = load_with(bad.text);
    EXPECT_NE(msg.find(bad.mentions), std::string::npos) << bad.text.substr(0, 80) << ": " << msg;
  }
  moh::SafeTensorsWriter none;
  none.add("x", std::vector<float>{1.0f}, {1});
  const std::string msg = error_of([&] {
    moh::load_layer<moh::MoHAttention<float>>(moh::SafeTensors::from_bytes(none.to_bytes()), "p.");
  });
  EXPECT_NE(msg.find("p.moh.config"), std::string::npos) << msg;
}

TEST(CheckpointSave, RoutingRecordsRoundTrip) {
  moh::MoHConfig c = llama_moh();
  c.router = moh::MoHRouter::Learned;
  c.rope = false;
  const moh::MoHAttention<float> moh_layer(c, 21);
  const moh::MoAAttention<float> moa_layer(small_moa(), 22);
  moh::MoHRouting<float> r;
  moh::MoARouting<float> m;
  moh_layer(random_input(2, 6, 32, 1), {}, &r);
  moa_layer(random_input(2, 6, 24, 2), {}, &m);
  moh::SafeTensorsWriter w;
  moh::save_routing(w, r, "moh.");
  moh::save_routing(w, m, "moa.");
  const moh::SafeTensors st = moh::SafeTensors::from_bytes(w.to_bytes());
  moh::MoHRouting<float> r2;
  moh::MoARouting<float> m2;
  moh::load_routing(st, r2, "moh.");
  moh::load_routing(st, m2, "moa.");
  EXPECT_EQ(r2.batch, 2);
  EXPECT_EQ(r2.tokens, 6);
  EXPECT_EQ(r2.shared_heads, r.shared_heads);
  EXPECT_EQ(r2.active_routed_heads, r.active_routed_heads);
  EXPECT_EQ(r2.gates, r.gates);
  EXPECT_EQ(r2.active, r.active);
  EXPECT_EQ(r2.routed_probs, r.routed_probs);
  EXPECT_EQ(r2.head_counts, r.head_counts);
  EXPECT_EQ(r2.load_balance_loss, r.load_balance_loss);
  EXPECT_EQ(m2.logits, m.logits);
  EXPECT_EQ(m2.probs, m.probs);
  EXPECT_EQ(m2.gates, m.gates);
  EXPECT_EQ(m2.selected, m.selected);
  EXPECT_EQ(m2.expert_counts, m.expert_counts);
  EXPECT_EQ(m2.switch_loss, m.switch_loss);
  EXPECT_EQ(m2.z_loss, m.z_loss);
  EXPECT_EQ(m2.cv_loss, m.cv_loss);

  // A record of the other kind, or an expert index out of range, is an error.
  EXPECT_NE(error_of([&] { moh::load_routing(st, r2, "moa."); }).find("moh routing"), std::string::npos);
  moh::MoARouting<float> bad = m;
  bad.selected(0, 0) = 99;
  moh::SafeTensorsWriter wb;
  moh::save_routing(wb, bad, "moa.");
  const std::string msg = error_of(
      [&] { moh::load_routing(moh::SafeTensors::from_bytes(wb.to_bytes()), m2, "moa."); });
  EXPECT_NE(msg.find("expert index"), std::string::npos) << msg;
}

}  // namespace
