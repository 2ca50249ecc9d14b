// Tests for moh/io/checkpoint.hpp: the one generic load_weights() over a layer's weight_infos(),
// for every layer kind, from a safetensors file built in memory (a tiny writer below), under a
// prefix such as "blocks.3.attn."; F16 / BF16 / F64 conversion; errors that name the missing or
// mis-shaped tensor and both shapes, and the other names a missing tensor may have; the layer is
// unchanged when loading fails (every tensor is read before any is set); the LLaMA-style layout
// (q_proj / k_proj / v_proj rows split, o_proj an alias) for MHA and MoH with grouped-query heads;
// save_weights() under the layer's names with its config as JSON (every field of the configs'
// fields(), enums by name, "rope_theta"), load_config / load_layer back from a file or a sharded
// checkpoint, unknown config keys refused; routing records.
#include "moh/io/checkpoint.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "io/float16_reference.hpp"
#include "io/io_test_support.hpp"
#include "moh/io/sharded_safetensors.hpp"
#include "test_helpers.hpp"

namespace {

using moh::Index;
using moh::Matrix;
using moh_float16_test::float_bits;
using moh_io_test::Bytes;
using moh_test::error_of;
using moh_test::Mentions;
using moh_test::mha_config;
using moh_test::moa_config;
using moh_test::moh_config;

// ---- a tiny safetensors writer ------------------------------------------------------------------

template <class U>
void put_le(Bytes& out, U bits) {
  for (std::size_t i = 0; i < sizeof(U); ++i) out.push_back(static_cast<std::uint8_t>(bits >> (8 * i)));
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

std::vector<Entry> without(std::vector<Entry> entries, const std::string& name) {
  entries.erase(std::remove_if(entries.begin(), entries.end(),
                               [&](const Entry& e) { return e.name == name; }),
                entries.end());
  return entries;
}

/// MoH tensors under `prefix`, seeds seed, seed + 1, ...: qkv.weight [3 Hd, D] and qkv.bias,
/// proj.weight [D, Hd] and proj.bias, then wg.weight, wg_0.weight, wg_1.weight with the given rows
/// (as many of them as `router_rows` has).
std::vector<Entry> moh_entries(const std::string& prefix, std::int64_t D, std::int64_t Hd,
                               const std::vector<std::int64_t>& router_rows, std::uint64_t seed) {
  std::vector<Entry> e = {exact_entry(prefix + "qkv.weight", {3 * Hd, D}, seed),
                          exact_entry(prefix + "qkv.bias", {3 * Hd}, seed + 1),
                          exact_entry(prefix + "proj.weight", {D, Hd}, seed + 2),
                          exact_entry(prefix + "proj.bias", {D}, seed + 3)};
  const char* router[] = {"wg.weight", "wg_0.weight", "wg_1.weight"};
  for (std::size_t i = 0; i < router_rows.size(); ++i)
    e.push_back(exact_entry(prefix + router[i], {router_rows[i], D}, seed + 4 + i));
  return e;
}

/// MoA tensors (fairseq names), seeds seed, seed + 1, ...: E experts of [D, d] queries and their
/// [d, D] outputs, the [D, E] gate, the [d, D] key and value projections.
std::vector<Entry> moa_entries(std::int64_t E, std::int64_t D, std::int64_t d, std::uint64_t seed,
                               const std::string& prefix = "") {
  return {exact_entry(prefix + "q_proj.experts.w", {E, D, d}, seed),
          exact_entry(prefix + "q_proj.output_experts.w", {E, d, D}, seed + 1),
          exact_entry(prefix + "q_proj.w_gate", {D, E}, seed + 2),
          exact_entry(prefix + "k_proj.weight", {d, D}, seed + 3),
          exact_entry(prefix + "v_proj.weight", {d, D}, seed + 4)};
}

/// The float layer a config builds.
template <class Config>
struct FloatLayer;
template <>
struct FloatLayer<moh::MHAConfig> {
  using type = moh::MultiHeadAttention<float>;
};
template <>
struct FloatLayer<moh::MoHConfig> {
  using type = moh::MoHAttention<float>;
};
template <>
struct FloatLayer<moh::MoAConfig> {
  using type = moh::MoAAttention<float>;
};

/// The error of loading `entries` (under `prefix`) into a new float layer built from `config`.
template <class Config>
std::string load_error(const Config& config, const std::vector<Entry>& entries,
                       const std::string& prefix = "") {
  return error_of([&] {
    typename FloatLayer<Config>::type layer(config);
    moh::load_weights(layer, open(entries), prefix);
  });
}

const std::string kPrefix = "blocks.3.attn.";

// ---- MHA (torch nn.MultiheadAttention names) -----------------------------------------------------

moh::MHAConfig small_mha() { return mha_config(8, 2, /*kv_heads=*/0, /*head_dim=*/3); }  // H d = 6 != D

std::vector<Entry> mha_entries(const std::string& prefix, std::uint64_t seed) {
  return {exact_entry(prefix + "in_proj_weight", {18, 8}, seed),
          exact_entry(prefix + "in_proj_bias", {18}, seed + 1),
          exact_entry(prefix + "out_proj.weight", {8, 6}, seed + 2),
          exact_entry(prefix + "out_proj.bias", {8}, seed + 3)};
}

/// small_mha()'s tensors with the input projection in the LLaMA-style parts, seeds seed, seed + 1,
/// ...: q_proj, k_proj, v_proj [6, 8], in_proj_bias [18], out_proj.weight [8, 6], out_proj.bias.
std::vector<Entry> split_mha_entries(const std::string& prefix, std::uint64_t seed) {
  return {exact_entry(prefix + "q_proj.weight", {6, 8}, seed),
          exact_entry(prefix + "k_proj.weight", {6, 8}, seed + 1),
          exact_entry(prefix + "v_proj.weight", {6, 8}, seed + 2),
          exact_entry(prefix + "in_proj_bias", {18}, seed + 3),
          exact_entry(prefix + "out_proj.weight", {8, 6}, seed + 4),
          exact_entry(prefix + "out_proj.bias", {8}, seed + 5)};
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
  moh::MHAConfig c = small_mha();
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
  const moh::MoHConfig c = moh_config(8, 5, /*shared=*/2, /*routed_k=*/2, moh::MoHRouterKind::Learned,
                                       /*kv_heads=*/0, /*head_dim=*/2);
  const std::vector<Entry> entries = moh_entries(kPrefix, 8, 10, {3, 2, 2}, 10);
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
  const std::string msg = load_error(c, without(entries, kPrefix + "wg_0.weight"), kPrefix);
  EXPECT_TRUE(Mentions(msg, {kPrefix + "wg_0.weight"})) << msg;
}

TEST(Checkpoint, MoHNeedsOnlyTheRouterWeightsItHas) {
  // One shared head: no wg_1. Only shared heads (K = 0): only wg_1. Query-norm router: none.
  const moh::MoHConfig one_shared = moh_config(8, 4, /*shared=*/1, /*routed_k=*/2);  // d = 2, 24 qkv rows, 3 routed heads
  moh::MoHAttention<float> a(one_shared);
  const std::vector<Entry> ea = moh_entries("", 8, 8, {3, 2}, 20);
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
  qn.router = moh::MoHRouterKind::QueryNorm;
  moh::MoHAttention<float> q(qn);
  EXPECT_NO_THROW(moh::load_weights(q, open(std::vector<Entry>(ea.begin(), ea.begin() + 4))));
  EXPECT_EQ(q.qkv_weight(), as_matrix<float>(ea[0], 24, 8));
}

// ---- MoA (fairseq names) --------------------------------------------------------------------------

TEST(Checkpoint, LoadsMoAUnderPrefix) {
  const moh::MoAConfig c = moa_config(8, /*head_dim=*/4, /*experts=*/3, /*top_k=*/2);
  const std::vector<Entry> entries = moa_entries(3, 8, 4, 30, kPrefix);
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
  const moh::MoAConfig c = moa_config(8, /*head_dim=*/4, /*experts=*/2, /*top_k=*/1);
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
    const std::string msg = load_error(small_mha(), without(entries, kPrefix + name), kPrefix);
    EXPECT_TRUE(Mentions(msg, {kPrefix + name})) << name << ": " << msg;
  }
  // The right names under the wrong prefix are missing too.
  const std::string msg = load_error(small_mha(), entries, "blocks.4.attn.");
  EXPECT_TRUE(Mentions(msg, {"blocks.4.attn.in_proj_weight"})) << msg;
  // MoA without its key projection.
  const std::string moa_msg = load_error(moa_config(8, /*head_dim=*/4, /*experts=*/3, /*top_k=*/1),
                                         without(moa_entries(3, 8, 4, 51), "k_proj.weight"));
  EXPECT_TRUE(Mentions(moa_msg, {"k_proj.weight"})) << moa_msg;
}

TEST(Checkpoint, MisShapedTensorNamesItAndBothShapes) {
  std::vector<Entry> entries = mha_entries(kPrefix, 60);
  entries[2] = exact_entry(kPrefix + "out_proj.weight", {8, 7}, 61);  // expected [8, 6]
  std::string msg = load_error(small_mha(), entries, kPrefix);
  EXPECT_TRUE(Mentions(msg, {kPrefix + "out_proj.weight", "[8, 6]", "[8, 7]"})) << msg;

  entries = mha_entries(kPrefix, 62);
  entries[1] = exact_entry(kPrefix + "in_proj_bias", {17}, 63);  // expected [18]
  msg = load_error(small_mha(), entries, kPrefix);
  EXPECT_TRUE(Mentions(msg, {kPrefix + "in_proj_bias", "[18]", "[17]"})) << msg;

  // A MoA expert stack with D and d swapped (same element count).
  std::vector<Entry> moa = moa_entries(3, 8, 4, 64);
  moa[0] = exact_entry("q_proj.experts.w", {3, 4, 8}, 64);
  msg = load_error(moa_config(8, /*head_dim=*/4, /*experts=*/3, /*top_k=*/1), moa);
  EXPECT_TRUE(Mentions(msg, {"q_proj.experts.w", "[3, 8, 4]", "[3, 4, 8]"})) << msg;

  // A MoH routed-head router with one row too many.
  msg = load_error(moh_config(8, 4, /*shared=*/1, /*routed_k=*/1), moh_entries("", 8, 8, {4, 2}, 70));
  EXPECT_TRUE(Mentions(msg, {"wg.weight", "[3, 8]", "[4, 8]"})) << msg;
}

// A missing tensor reads "tensor '<p>NAME' missing in <file>: expected it", then the other names
// the layer would take it under: its rows split over the LLaMA-style parts, or an alias.
TEST(Checkpoint, MissingTensorMessagesNameTheOtherLayouts) {
  const std::vector<Entry> entries = mha_entries(kPrefix, 55);
  const auto message_without = [&](const std::string& name) {
    return load_error(small_mha(), without(entries, kPrefix + name), kPrefix);
  };
  const std::string p = kPrefix;
  EXPECT_EQ(message_without("in_proj_weight"),
            "moh: tensor '" + p + "in_proj_weight' missing in test.safetensors: expected it, or its "
            "rows split over '" + p + "q_proj.weight' '" + p + "k_proj.weight' '" + p + "v_proj.weight'");
  EXPECT_EQ(message_without("in_proj_bias"),
            "moh: tensor '" + p + "in_proj_bias' missing in test.safetensors: expected it, or its "
            "rows split over '" + p + "q_proj.bias' '" + p + "k_proj.bias' '" + p + "v_proj.bias'");
  EXPECT_EQ(message_without("out_proj.weight"),
            "moh: tensor '" + p + "out_proj.weight' missing in test.safetensors: expected it, or '" + p +
                "o_proj.weight'");
  EXPECT_EQ(message_without("out_proj.bias"),
            "moh: tensor '" + p + "out_proj.bias' missing in test.safetensors: expected it, or '" + p +
                "o_proj.bias'");

  // MoH: the same other layouts for its own names; the router weights have none.
  const moh::MoHConfig mc = moh_config(8, 4, /*shared=*/2, /*routed_k=*/1);
  const std::vector<Entry> mh = moh_entries("", 8, 8, {2, 2, 2}, 56);
  const auto moh_without = [&](const std::string& name) { return load_error(mc, without(mh, name)); };
  EXPECT_EQ(moh_without("qkv.weight"),
            "moh: tensor 'qkv.weight' missing in test.safetensors: expected it, or its rows split "
            "over 'q_proj.weight' 'k_proj.weight' 'v_proj.weight'");
  EXPECT_EQ(moh_without("proj.bias"),
            "moh: tensor 'proj.bias' missing in test.safetensors: expected it, or 'o_proj.bias'");
  EXPECT_EQ(moh_without("wg_1.weight"), "moh: tensor 'wg_1.weight' missing in test.safetensors: expected it");

  // MoA: no other layouts.
  const std::string moa_msg = load_error(moa_config(8, /*head_dim=*/4, /*experts=*/3, /*top_k=*/1),
                                         without(moa_entries(3, 8, 4, 63), "q_proj.w_gate"));
  EXPECT_EQ(moa_msg, "moh: tensor 'q_proj.w_gate' missing in test.safetensors: expected it");

  // Some of the split parts there but one missing: the source's own message for that part.
  const std::string part_msg = load_error(small_mha(), without(split_mha_entries(p, 67), p + "k_proj.weight"), kPrefix);
  EXPECT_TRUE(Mentions(part_msg, {"tensor '" + p + "k_proj.weight' missing in test.safetensors: expected one of ["}))
      << part_msg;
}

// load_weights reads and checks every tensor before it sets any: on error the layer keeps every
// weight it had (or stays without weights).
TEST(Checkpoint, LayerIsUnchangedWhenLoadingFails) {
  const auto all_weights = [](const auto& layer) {
    std::vector<std::vector<float>> out;
    for (const moh::WeightInfo& w : layer.weight_infos()) out.push_back(layer.weight(w.name));
    return out;
  };
  moh::MultiHeadAttention<float> mha(small_mha(), 3);
  const auto before = all_weights(mha);
  std::vector<Entry> entries = mha_entries(kPrefix, 72);
  // The last tensor of weight_infos() is the bad one: the first three were read and are fine.
  ASSERT_EQ(mha.weight_infos().back().name, "out_proj.bias");
  entries[3] = exact_entry(kPrefix + "out_proj.bias", {9}, 73);
  const auto load_into_mha = [&](const std::vector<Entry>& e) {
    return error_of([&] { moh::load_weights(mha, open(e), kPrefix); });
  };
  EXPECT_TRUE(Mentions(load_into_mha(entries), {"out_proj.bias", "expected shape [8], got [9]"}));
  EXPECT_EQ(all_weights(mha), before);
  EXPECT_TRUE(Mentions(load_into_mha(without(entries, kPrefix + "out_proj.bias")), {"out_proj.bias' missing"}));
  EXPECT_EQ(all_weights(mha), before);
  // A split layout whose last part is mis-shaped leaves the fused tensor as it was.
  std::vector<Entry> split = split_mha_entries(kPrefix, 74);
  split[2] = exact_entry(kPrefix + "v_proj.weight", {5, 8}, 76);
  EXPECT_TRUE(Mentions(load_into_mha(split), {"v_proj.weight", "expected shape [6, 8], got [5, 8]"}));
  EXPECT_EQ(all_weights(mha), before);
  // And a good file afterwards loads every tensor.
  entries[3] = exact_entry(kPrefix + "out_proj.bias", {8}, 80);
  moh::load_weights(mha, open(entries), kPrefix);
  EXPECT_EQ(mha.in_proj_weight(), as_matrix<float>(entries[0], 18, 8));
  EXPECT_EQ(mha.out_proj_bias(), as_vector<float>(entries[3]));

  // A layer built without weights stays without them: forward still refuses to run.
  moh::MoHAttention<float> fresh(moh_config(8, 4, /*shared=*/2, /*routed_k=*/1));
  const std::vector<Entry> mh = moh_entries("", 8, 8, {2, 2}, 81);
  EXPECT_TRUE(Mentions(error_of([&] { moh::load_weights(fresh, open(mh)); }), {"wg_1.weight"}));
  EXPECT_FALSE(fresh.weights_set());
  EXPECT_TRUE(Mentions(error_of([&] { fresh(moh_test::random_tensor<float>(1, 2, 8, 1)); }),
                       {"weights not set", "qkv.weight", "wg_1.weight"}));
  std::vector<Entry> complete = mh;
  complete.push_back(exact_entry("wg_1.weight", {2, 8}, 87));
  moh::load_weights(fresh, open(complete));
  EXPECT_TRUE(fresh.weights_set());
  EXPECT_NO_THROW(fresh(moh_test::random_tensor<float>(1, 2, 8, 1)));
}

// ---- LLaMA-style names ------------------------------------------------------------------------------

std::vector<Entry> llama_entries(const std::string& prefix, Index H, Index Hkv, Index d, Index D,
                                 std::uint64_t seed) {
  return {exact_entry(prefix + "q_proj.weight", {H * d, D}, seed),
          exact_entry(prefix + "k_proj.weight", {Hkv * d, D}, seed + 1),
          exact_entry(prefix + "v_proj.weight", {Hkv * d, D}, seed + 2),
          exact_entry(prefix + "o_proj.weight", {D, H * d}, seed + 3)};
}

/// The LLaMA-style biases under `prefix`, seeds seed .. seed + 3: q_proj.bias [H d], k_proj.bias and
/// v_proj.bias [Hkv d], o_proj.bias [D].
std::vector<Entry> llama_bias_entries(const std::string& prefix, Index H, Index Hkv, Index d, Index D,
                                      std::uint64_t seed) {
  return {exact_entry(prefix + "q_proj.bias", {H * d}, seed),
          exact_entry(prefix + "k_proj.bias", {Hkv * d}, seed + 1),
          exact_entry(prefix + "v_proj.bias", {Hkv * d}, seed + 2),
          exact_entry(prefix + "o_proj.bias", {D}, seed + 3)};
}
/// `entries` followed by `more`.
std::vector<Entry> joined(std::vector<Entry> entries, const std::vector<Entry>& more) {
  entries.insert(entries.end(), more.begin(), more.end());
  return entries;
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
/// The q, k and v biases (entries 4, 5, 6 of llama_entries() joined with llama_bias_entries())
/// stacked as the fused input bias.
template <class T>
moh::Vector<T> stacked_bias(const std::vector<Entry>& e) {
  moh::Vector<T> b(static_cast<Index>(e[4].values.size() + e[5].values.size() + e[6].values.size()));
  b << as_vector<T>(e[4]), as_vector<T>(e[5]), as_vector<T>(e[6]);
  return b;
}

TEST(Checkpoint, LlamaNamesLoadIntoGqaMhaAndMoH) {
  const Index D = 16, H = 4, Hkv = 2, d = 4;
  const std::vector<Entry> entries = llama_entries("model.layers.3.self_attn.", H, Hkv, d, D, 80);
  const moh::SafeTensors st = open(entries);

  const moh::MHAConfig mc = mha_config(D, H, Hkv, /*head_dim=*/0, /*bias=*/false, /*rope=*/true);
  moh::MultiHeadAttention<float> mha(mc);
  moh::load_weights(mha, st, "model.layers.3.self_attn.");
  EXPECT_EQ(mha.in_proj_weight(), stacked<float>(entries, H, Hkv, d, D));
  EXPECT_EQ(mha.out_proj_weight(), as_matrix<float>(entries[3], D, H * d));

  moh::MoHAttention<double> mh(moh_config(D, H, /*shared=*/2, /*routed_k=*/1, moh::MoHRouterKind::QueryNorm,
                                          Hkv, /*head_dim=*/0, /*bias=*/false, /*rope=*/true));
  moh::load_weights(mh, st, "model.layers.3.self_attn.");
  EXPECT_EQ(mh.qkv_weight(), stacked<double>(entries, H, Hkv, d, D));
  EXPECT_EQ(mh.proj_weight(), as_matrix<double>(entries[3], D, H * d));

  // With GQA the k_proj rows are Hkv * d: a file written for H kv heads is refused, naming it.
  const std::string msg = load_error(mc, llama_entries("", H, H, d, D, 90));
  EXPECT_TRUE(Mentions(msg, {"k_proj.weight", "[8, 16]", "[16, 16]"})) << msg;
}

TEST(Checkpoint, LlamaNamesWithBiasesAndFusedNamesWin) {
  const Index D = 8, H = 2, Hkv = 1, d = 4;
  const std::vector<Entry> entries =
      joined(llama_entries("", H, Hkv, d, D, 100), llama_bias_entries("", H, Hkv, d, D, 104));
  const moh::MHAConfig mc = mha_config(D, H, Hkv);
  moh::MultiHeadAttention<float> mha(mc);
  moh::load_weights(mha, open(entries));
  EXPECT_EQ(mha.in_proj_bias(), stacked_bias<float>(entries));
  EXPECT_EQ(mha.out_proj_bias(), as_vector<float>(entries[7]));
  // Missing o_proj.bias in a layer with biases is named.
  const std::string msg = load_error(mc, without(entries, "o_proj.bias"));
  EXPECT_TRUE(Mentions(msg, {"o_proj.bias"})) << msg;
  // When the fused torch names are present they are used, not the LLaMA ones.
  const std::vector<Entry> both =
      joined(entries, {exact_entry("in_proj_weight", {16, 8}, 110), exact_entry("in_proj_bias", {16}, 111),
                       exact_entry("out_proj.weight", {8, 8}, 112), exact_entry("out_proj.bias", {8}, 113)});
  moh::MultiHeadAttention<float> fused(mc);
  moh::load_weights(fused, open(both));
  EXPECT_EQ(fused.in_proj_weight(), as_matrix<float>(both[8], 16, 8));
  EXPECT_EQ(fused.out_proj_bias(), as_vector<float>(both[11]));
}

// Each layer lists its tensors with their PyTorch shapes and the other layouts they are published
// in; load_weights and save_weights walk that list.
TEST(Checkpoint, WeightInfosListEveryTensorAndItsOtherLayouts) {
  moh::MHAConfig mc = small_mha();
  mc.num_kv_heads = 1;  // q rows 6, k and v rows 3 each
  const moh::MultiHeadAttention<float> mha(mc);
  const std::vector<moh::WeightInfo>& w = mha.weight_infos();
  ASSERT_EQ(w.size(), 4u);
  EXPECT_EQ(w[0].name, "in_proj_weight");
  EXPECT_EQ(w[0].shape, (std::vector<std::int64_t>{12, 8}));
  ASSERT_EQ(w[0].parts.size(), 3u);
  EXPECT_EQ(w[0].parts[0].name, "q_proj.weight");
  EXPECT_EQ(w[0].parts[0].shape, (std::vector<std::int64_t>{6, 8}));
  EXPECT_EQ(w[0].parts[1].name, "k_proj.weight");
  EXPECT_EQ(w[0].parts[1].shape, (std::vector<std::int64_t>{3, 8}));
  EXPECT_EQ(w[0].parts[2].name, "v_proj.weight");
  EXPECT_EQ(w[0].parts[2].shape, (std::vector<std::int64_t>{3, 8}));
  EXPECT_TRUE(w[0].aliases.empty());
  EXPECT_EQ(w[1].name, "in_proj_bias");
  EXPECT_EQ(w[1].shape, (std::vector<std::int64_t>{12}));
  ASSERT_EQ(w[1].parts.size(), 3u);
  EXPECT_EQ(w[1].parts[1].name, "k_proj.bias");
  EXPECT_EQ(w[2].name, "out_proj.weight");
  EXPECT_EQ(w[2].shape, (std::vector<std::int64_t>{8, 6}));
  EXPECT_TRUE(w[2].parts.empty());
  EXPECT_EQ(w[2].aliases, std::vector<std::string>{"o_proj.weight"});
  EXPECT_EQ(w[3].name, "out_proj.bias");
  EXPECT_EQ(w[3].aliases, std::vector<std::string>{"o_proj.bias"});
  // The static list of a config is the layer's list.
  const auto listed = moh::MultiHeadAttention<float>::weight_infos(mc);
  ASSERT_EQ(listed.size(), w.size());
  for (std::size_t i = 0; i < w.size(); ++i) {
    EXPECT_EQ(listed[i].name, w[i].name);
    EXPECT_EQ(listed[i].shape, w[i].shape);
  }
  mc.bias = false;
  EXPECT_EQ(moh::MultiHeadAttention<float>::weight_infos(mc).size(), 2u);

  moh::MoHConfig hc = moh_config(8, 5, /*shared=*/2, /*routed_k=*/2, moh::MoHRouterKind::Learned,
                                 /*kv_heads=*/0, /*head_dim=*/2);
  std::vector<std::string> names;
  for (const moh::WeightInfo& i : moh::MoHAttention<float>::weight_infos(hc)) names.push_back(i.name);
  EXPECT_EQ(names, (std::vector<std::string>{"qkv.weight", "qkv.bias", "proj.weight", "proj.bias",
                                             "wg.weight", "wg_0.weight", "wg_1.weight"}));
  EXPECT_EQ(moh::MoHAttention<float>::weight_infos(hc)[4].shape, (std::vector<std::int64_t>{3, 8}));
  EXPECT_EQ(moh::MoHAttention<float>::weight_infos(hc)[6].shape, (std::vector<std::int64_t>{2, 8}));
  hc.router = moh::MoHRouterKind::QueryNorm;
  EXPECT_EQ(moh::MoHAttention<float>::weight_infos(hc).size(), 4u);

  const auto moa = moh::MoAAttention<float>::weight_infos(moa_config(8, /*head_dim=*/4, /*experts=*/3, /*top_k=*/1));
  names.clear();
  for (const moh::WeightInfo& i : moa) {
    names.push_back(i.name);
    EXPECT_TRUE(i.parts.empty() && i.aliases.empty()) << i.name;
  }
  EXPECT_EQ(names, (std::vector<std::string>{"q_proj.experts.w", "q_proj.output_experts.w",
                                             "q_proj.w_gate", "k_proj.weight", "v_proj.weight"}));
  EXPECT_EQ(moa[0].shape, (std::vector<std::int64_t>{3, 8, 4}));
  EXPECT_EQ(moa[1].shape, (std::vector<std::int64_t>{3, 4, 8}));
  EXPECT_EQ(moa[2].shape, (std::vector<std::int64_t>{8, 3}));
}

// MoH in the LLaMA-style layout with biases and a learned router: q/k/v_proj rows stacked into
// qkv, o_proj for proj (weight and bias), the router weights under their own names.
TEST(Checkpoint, LlamaLayoutAndAliasesLoadIntoMoHWithBiases) {
  const Index D = 8, H = 4, Hkv = 2, d = 2;
  const moh::MoHConfig c = moh_config(D, H, /*shared=*/1, /*routed_k=*/2, moh::MoHRouterKind::Learned, Hkv);
  const std::vector<Entry> entries =
      joined(joined(llama_entries(kPrefix, H, Hkv, d, D, 130), llama_bias_entries(kPrefix, H, Hkv, d, D, 134)),
             {exact_entry(kPrefix + "wg.weight", {3, D}, 138), exact_entry(kPrefix + "wg_0.weight", {2, D}, 139)});
  moh::MoHAttention<float> layer(c);
  moh::load_weights(layer, open(entries), kPrefix);
  EXPECT_EQ(layer.qkv_weight(), stacked<float>(entries, H, Hkv, d, D));
  EXPECT_EQ(layer.qkv_bias(), stacked_bias<float>(entries));
  EXPECT_EQ(layer.proj_weight(), as_matrix<float>(entries[3], D, H * d));
  EXPECT_EQ(layer.proj_bias(), as_vector<float>(entries[7]));
  EXPECT_EQ(layer.router().routed_weight(), as_matrix<float>(entries[8], 3, D));
  EXPECT_EQ(layer.router().mix_weight(), as_matrix<float>(entries[9], 2, D));
  EXPECT_TRUE(layer.weights_set());
  // Under its fused name a tensor wins over its alias.
  std::vector<Entry> both = entries;
  both.push_back(exact_entry(kPrefix + "proj.weight", {D, H * d}, 140));
  moh::MoHAttention<float> fused(c);
  moh::load_weights(fused, open(both), kPrefix);
  EXPECT_EQ(fused.proj_weight(), as_matrix<float>(both.back(), D, H * d));
  EXPECT_EQ(fused.qkv_weight(), layer.qkv_weight());
  // An alias of the wrong shape is refused like the fused name would be.
  std::vector<Entry> bad = entries;
  bad[3] = exact_entry(kPrefix + "o_proj.weight", {D, D + 1}, 141);
  EXPECT_TRUE(Mentions(load_error(c, bad, kPrefix),
                       {"tensor '" + kPrefix + "o_proj.weight'", "expected shape [8, 8], got [8, 9]"}));
}

TEST(Checkpoint, LoadsFromAFileOnDisk) {
  const std::vector<Entry> entries = mha_entries(kPrefix, 120);
  const std::string path = moh_io_test::temp_path("checkpoint.safetensors");
  moh_io_test::write_file(path, write_safetensors(entries));
  moh::MultiHeadAttention<float> layer(small_mha());
  moh::load_weights(layer, moh::SafeTensors::open(path), kPrefix);
  std::remove(path.c_str());
  EXPECT_EQ(layer.in_proj_weight(), as_matrix<float>(entries[0], 18, 8));
  EXPECT_EQ(layer.out_proj_bias(), as_vector<float>(entries[3]));
}

// ---- saving, load_layer, sharded checkpoints, routing records ------------------------------------

/// Same dimensions and the same bits.
::testing::AssertionResult same_bits(const moh::Tensor3<float>& a, const moh::Tensor3<float>& b) {
  if (a.dimensions() != b.dimensions()) return ::testing::AssertionFailure() << "dimensions differ";
  return moh_test::BitEqual(a, b);
}
/// Layers `a` and `b` give the same bits on the same seeded [B, T, D] input.
template <class A, class B>
::testing::AssertionResult same_output(const A& a, const B& b, Index batch, Index tokens,
                                       std::uint64_t seed, const moh::ForwardOptions& o = {}) {
  const Index D = a.config().embed_dim;
  return same_bits(a(moh_test::random_tensor<float>(batch, tokens, D, seed), o),
                   b(moh_test::random_tensor<float>(batch, tokens, D, seed), o));
}

moh::MoHConfig llama_moh() {
  moh::MoHConfig c = moh_config(32, 8, /*shared=*/2, /*routed_k=*/3, moh::MoHRouterKind::QueryNorm,
                                /*kv_heads=*/2, /*head_dim=*/0, /*bias=*/false, /*rope=*/true);
  c.rope_theta = 500000.0;
  return c;
}

moh::MoAConfig small_moa() {
  return moa_config(24, /*head_dim=*/8, /*experts=*/5, /*top_k=*/2, moh::MoAGating::TopKSoftmax);
}

// Saving then load_layer() rebuilds the same layer: config and weights, so the same output bits.
TEST(CheckpointSave, EveryLayerRoundTripsThroughAFile) {
  // small_mha() with one key/value head, RoPE and head_dim 4 (RoPE needs an even head size).
  const moh::MultiHeadAttention<float> mha(
      mha_config(8, 2, /*kv_heads=*/1, /*head_dim=*/4, /*bias=*/true, /*rope=*/true), 1);
  const moh::MoHAttention<float> moh_learned(
      moh_config(24, 6, /*shared=*/2, /*routed_k=*/2, moh::MoHRouterKind::Learned, /*kv_heads=*/0, /*head_dim=*/5), 2);
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
  EXPECT_EQ(llama2.config().router, moh::MoHRouterKind::QueryNorm);
  EXPECT_EQ(llama2.config().weight_storage, moh::WeightStorage::BFloat16);
  EXPECT_EQ(llama2.config().rope_theta, 500000.0);
  EXPECT_EQ(moa2.config().gating, moh::MoAGating::TopKSoftmax);
  EXPECT_EQ(st.info("layers.0.self_attn.qkv.weight").dtype, moh::DType::BF16);

  moh::ForwardOptions o;
  o.causal = moh::Causal::On;
  EXPECT_TRUE(same_output(mha2, mha, 2, 7, 5, o));
  EXPECT_TRUE(same_output(learned2, moh_learned, 2, 7, 6, o));
  EXPECT_TRUE(same_output(llama2, moh_llama, 1, 9, 7, o));
  EXPECT_TRUE(same_output(moa2, moa, 2, 7, 8, o));
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
  EXPECT_TRUE(same_output(a2, a, 1, 5, 9));
  EXPECT_TRUE(same_output(b2, b, 1, 5, 9));
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
      {"{not json", "not valid JSON"},
      {"[1, 2]", "JSON object"},
      {std::string(200, '[') + std::string(200, ']'), "nests too deeply"},
      {R"({"layer": "MoHAttention", "embed_dim": 32, "embed_dim": 64})", "repeats the key 'embed_dim'"},
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
      {edited("rope_base", -1.0), "unknown key 'rope_base'"},  // the old name of rope_theta
      {edited("rope_theta", -1.0), "rope_theta must be positive"},
      {edited("rope_theta", "1e4"), "rope_theta"},
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

// ---- configs as JSON ------------------------------------------------------------------------------

/// Every field of a config as "key=value" (enums by name, doubles exactly).
template <class Config>
std::vector<std::string> field_values(const Config& c) {
  std::vector<std::string> out;
  Config::fields(c, [&](const char* key, const auto& value) {
    using V = std::decay_t<decltype(value)>;
    std::ostringstream text;
    text.precision(17);
    if constexpr (std::is_enum<V>::value)
      text << moh::enum_name(value);
    else
      text << value;
    out.push_back(std::string(key) + "=" + text.str());
  });
  return out;
}

/// The keys of a config's fields(), in order.
template <class Config>
std::vector<std::string> field_keys() {
  std::vector<std::string> keys;
  Config c;
  Config::fields(c, [&](const char* key, const auto&) { keys.push_back(key); });
  return keys;
}

/// save_weights(layer) under `prefix`, read back: the stored config JSON and load_config's result.
template <class Layer>
std::pair<nlohmann::json, typename Layer::Config> stored_config(const Layer& layer, const std::string& prefix) {
  moh::SafeTensorsWriter w;
  moh::save_weights(w, layer, prefix);
  const moh::SafeTensors st = moh::SafeTensors::from_bytes(w.to_bytes(), "saved");
  return {nlohmann::json::parse(st.metadata_value(prefix + "moh.config")),
          moh::load_config<typename Layer::Config>(st, prefix)};
}

/// The JSON has "layer" and exactly the keys of the config's fields().
template <class Config>
void expect_keys_are_the_fields(const nlohmann::json& j) {
  std::vector<std::string> keys;
  for (auto it = j.begin(); it != j.end(); ++it) keys.push_back(it.key());
  std::vector<std::string> want = field_keys<Config>();
  want.push_back("layer");
  std::sort(keys.begin(), keys.end());
  std::sort(want.begin(), want.end());
  EXPECT_EQ(keys, want);
  EXPECT_EQ(j.at("layer"), Config::kLayer);
}

TEST(CheckpointConfig, MHAConfigRoundTrips) {
  moh::MHAConfig c = mha_config(12, 4, /*kv_heads=*/2, /*head_dim=*/6, /*bias=*/false, /*rope=*/true);
  c.rope_theta = 12345.678;
  c.weight_storage = moh::WeightStorage::BFloat16;
  const auto [j, back] = stored_config(moh::MultiHeadAttention<float>(c, 1), "enc.");
  expect_keys_are_the_fields<moh::MHAConfig>(j);
  EXPECT_EQ(j.at("layer"), "MultiHeadAttention");
  EXPECT_EQ(j.at("embed_dim"), 12);
  EXPECT_EQ(j.at("num_heads"), 4);
  EXPECT_EQ(j.at("head_dim"), 6);
  EXPECT_EQ(j.at("num_kv_heads"), 2);
  EXPECT_EQ(j.at("rope"), true);
  EXPECT_EQ(j.at("rope_theta").get<double>(), 12345.678);
  EXPECT_EQ(j.at("weight_storage"), "bfloat16");  // enums by name
  EXPECT_EQ(j.at("bias"), false);
  EXPECT_FALSE(j.contains("rope_base"));
  EXPECT_EQ(field_values(back), field_values(c));
  // The defaults round-trip too.
  const moh::MHAConfig d = mha_config(8, 2);
  const auto [jd, dback] = stored_config(moh::MultiHeadAttention<double>(d, moh::zero_weights), "");
  EXPECT_EQ(jd.at("weight_storage"), "native");
  EXPECT_EQ(jd.at("rope_theta").get<double>(), 10000.0);
  EXPECT_EQ(field_values(dback), field_values(d));
}

TEST(CheckpointConfig, MoHConfigRoundTrips) {
  for (moh::MoHRouterKind router : {moh::MoHRouterKind::Learned, moh::MoHRouterKind::QueryNorm}) {
    moh::MoHConfig c = llama_moh();
    c.router = router;
    c.rope_theta = 0.5;
    c.head_dim = 6;
    c.weight_storage = router == moh::MoHRouterKind::Learned ? moh::WeightStorage::BFloat16
                                                             : moh::WeightStorage::Native;
    const auto [j, back] = stored_config(moh::MoHAttention<float>(c, 2), "layers.7.attn.");
    expect_keys_are_the_fields<moh::MoHConfig>(j);
    EXPECT_EQ(j.at("layer"), "MoHAttention");
    EXPECT_EQ(j.at("router"), router == moh::MoHRouterKind::Learned ? "learned" : "query_norm");
    EXPECT_EQ(j.at("weight_storage"), router == moh::MoHRouterKind::Learned ? "bfloat16" : "native");
    EXPECT_EQ(j.at("shared_heads"), 2);
    EXPECT_EQ(j.at("active_routed_heads"), 3);
    EXPECT_EQ(j.at("num_kv_heads"), 2);
    EXPECT_EQ(j.at("rope_theta").get<double>(), 0.5);
    EXPECT_EQ(field_values(back), field_values(c));
    EXPECT_EQ(back.router, router);
  }
}

TEST(CheckpointConfig, MoAConfigRoundTrips) {
  moh::MoAConfig c = small_moa();  // gating TopKSoftmax
  c.num_kv_heads = 1;
  c.rope_theta = 777.25;  // saved even without RoPE
  c.weight_storage = moh::WeightStorage::BFloat16;
  const auto [j, back] = stored_config(moh::MoAAttention<float>(c, 3), "moa.");
  expect_keys_are_the_fields<moh::MoAConfig>(j);
  EXPECT_EQ(j.at("layer"), "MoAAttention");
  EXPECT_EQ(j.at("gating"), "top_k_softmax");
  EXPECT_EQ(j.at("weight_storage"), "bfloat16");
  EXPECT_EQ(j.at("num_experts"), 5);
  EXPECT_EQ(j.at("top_k"), 2);
  EXPECT_EQ(j.at("head_dim"), 8);
  EXPECT_EQ(j.at("rope"), false);
  EXPECT_EQ(j.at("rope_theta").get<double>(), 777.25);
  EXPECT_FALSE(j.contains("num_heads"));  // not a MoA field
  EXPECT_EQ(field_values(back), field_values(c));
  c.gating = moh::MoAGating::Softmax;
  EXPECT_EQ(stored_config(moh::MoAAttention<float>(c, 3), "").first.at("gating"), "softmax");
}

/// A safetensors file whose metadata "moh.config" is `config` (no tensors).
moh::SafeTensors with_config(const nlohmann::json& config) {
  moh::SafeTensorsWriter w;
  w.set_metadata("moh.config", config.dump());
  return moh::SafeTensors::from_bytes(w.to_bytes(), "edited");
}

TEST(CheckpointConfig, MissingFieldsKeepTheirDefaults) {
  const moh::MHAConfig mha = moh::load_config<moh::MHAConfig>(
      with_config({{"layer", "MultiHeadAttention"}, {"embed_dim", 8}, {"num_heads", 2}}));
  EXPECT_EQ(field_values(mha), field_values(mha_config(8, 2)));
  const moh::MoAConfig moa = moh::load_config<moh::MoAConfig>(with_config(
      {{"layer", "MoAAttention"}, {"embed_dim", 8}, {"head_dim", 4}, {"num_experts", 2}, {"top_k", 1}}));
  EXPECT_EQ(moa.gating, moh::MoAGating::Softmax);
  EXPECT_EQ(moa.rope_theta, 10000.0);
  EXPECT_EQ(moa.weight_storage, moh::WeightStorage::Native);
  // Impossible settings are still refused after the defaults are filled in.
  EXPECT_TRUE(Mentions(error_of([] { moh::load_config<moh::MHAConfig>(with_config({{"layer", "MultiHeadAttention"}})); }),
                       {"embed_dim"}));
}

// Keys that are no field of the config (a typo, another layer's field, the old "rope_base") are
// refused by name for every config, never ignored.
TEST(CheckpointConfig, UnknownKeysAreRefused) {
  const auto error_with = [](const auto& layer, const std::string& key, const nlohmann::json& value) {
    using Config = typename std::decay_t<decltype(layer)>::Config;
    moh::SafeTensorsWriter w;
    moh::save_weights(w, layer);
    nlohmann::json j = nlohmann::json::parse(
        moh::SafeTensors::from_bytes(w.to_bytes()).metadata_value(moh::config_key("")));
    j[key] = value;
    return error_of([&] { moh::load_config<Config>(with_config(j)); });
  };
  const moh::MultiHeadAttention<float> mha(small_mha(), 1);
  const moh::MoHAttention<float> moh_layer(llama_moh(), 1);
  const moh::MoAAttention<float> moa(small_moa(), 1);
  for (const std::string key : {"rope_base", "num_heads_typo", "dropout"}) {
    for (const std::string& msg : {error_with(mha, key, 1), error_with(moh_layer, key, 1), error_with(moa, key, 1)})
      EXPECT_TRUE(Mentions(msg, {"metadata 'moh.config' in edited", "unknown key '" + key + "'"})) << msg;
  }
  EXPECT_TRUE(Mentions(error_with(mha, "shared_heads", 1), {"unknown key 'shared_heads'"}));  // MoH's
  EXPECT_TRUE(Mentions(error_with(mha, "top_k", 1), {"unknown key 'top_k'"}));                // MoA's
  EXPECT_TRUE(Mentions(error_with(moa, "num_heads", 4), {"unknown key 'num_heads'"}));
  EXPECT_TRUE(Mentions(error_with(moa, "router", "learned"), {"unknown key 'router'"}));
  EXPECT_TRUE(Mentions(error_with(moh_layer, "gating", "softmax"), {"unknown key 'gating'"}));
  // Enum fields by their names only.
  EXPECT_TRUE(Mentions(error_with(moa, "gating", "TopKSoftmax"),
                       {"'gating'", "expected one of softmax, top_k_softmax", "got string \"TopKSoftmax\""}));
  EXPECT_TRUE(Mentions(error_with(moa, "gating", 1), {"'gating'", "expected one of softmax, top_k_softmax"}));
  EXPECT_TRUE(Mentions(error_with(mha, "weight_storage", "BFloat16"), {"'weight_storage'", "expected one of native, bfloat16"}));
  EXPECT_TRUE(Mentions(error_with(moh_layer, "router", "QueryNorm"), {"'router'", "expected one of learned, query_norm"}));
  // Another layer's config under the key is refused by its "layer".
  EXPECT_TRUE(Mentions(error_with(mha, "layer", "MoHAttention"), {"'layer': expected \"MultiHeadAttention\""}));
}

// save_weights writes exactly the tensors of weight_infos() (fused names, PyTorch shapes) in the
// requested dtype, with the values weight() gives.
TEST(CheckpointSave, WritesTheTensorsOfWeightInfos) {
  const moh::MultiHeadAttention<float> mha(small_mha(), 5);
  const moh::MoHAttention<float> moh_layer(llama_moh(), 6);
  moh::MoHConfig learned = llama_moh();
  learned.router = moh::MoHRouterKind::Learned;
  learned.rope = false;
  const moh::MoHAttention<float> moh_learned(learned, 7);
  const moh::MoAAttention<float> moa(small_moa(), 8);
  moh::SafeTensorsWriter w;
  moh::save_weights(w, mha, "a.");
  moh::save_weights(w, moh_layer, "b.", moh::DType::F64);
  moh::save_weights(w, moh_learned, "c.");
  moh::save_weights(w, moa, "d.", moh::DType::F16);
  const moh::SafeTensors st = moh::SafeTensors::from_bytes(w.to_bytes(), "saved");
  std::vector<std::string> want;
  const auto check = [&](const auto& layer, const std::string& prefix, moh::DType dtype, bool exact) {
    for (const moh::WeightInfo& info : layer.weight_infos()) {
      const std::string name = prefix + info.name;
      want.push_back(name);
      ASSERT_TRUE(st.contains(name)) << name;
      EXPECT_EQ(st.info(name).shape, info.shape) << name;
      EXPECT_EQ(st.info(name).dtype, dtype) << name;
      const std::vector<float> stored = st.values<float>(name);
      const std::vector<float> held = layer.weight(info.name);
      ASSERT_EQ(stored.size(), held.size()) << name;
      for (std::size_t i = 0; i < held.size(); ++i) {
        if (exact)
          ASSERT_EQ(stored[i], held[i]) << name << " " << i;
        else
          ASSERT_NEAR(stored[i], held[i], 1e-3 * std::max(1.0f, std::fabs(held[i]))) << name << " " << i;
      }
    }
    EXPECT_TRUE(st.has_metadata(prefix + "moh.config")) << prefix;
  };
  check(mha, "a.", moh::DType::F32, true);
  check(moh_layer, "b.", moh::DType::F64, true);
  check(moh_learned, "c.", moh::DType::F32, true);
  check(moa, "d.", moh::DType::F16, false);
  std::sort(want.begin(), want.end());
  EXPECT_EQ(st.names(), want);  // nothing else
  EXPECT_TRUE(st.contains("c.wg.weight"));
  EXPECT_FALSE(st.contains("b.wg.weight"));  // the query-norm router has no weights
}

// load_layer and load_config read a ShardedSafeTensors like a single file (TensorSource), also
// when it was opened from one .safetensors file.
TEST(CheckpointSave, LoadLayerFromAShardedSourceOfOneFile) {
  const moh::MultiHeadAttention<float> mha(small_mha(), 9);
  moh::SafeTensorsWriter w;
  moh::save_weights(w, mha, "enc.0.");
  const std::string path = ::testing::TempDir() + "moh_checkpoint_one_shard.safetensors";
  w.write(path);
  const moh::ShardedSafeTensors ckpt = moh::ShardedSafeTensors::open(path);
  const auto again = moh::load_layer<moh::MultiHeadAttention<float>>(ckpt, "enc.0.");
  EXPECT_EQ(field_values(moh::load_config<moh::MHAConfig>(ckpt, "enc.0.")), field_values(mha.config()));
  std::remove(path.c_str());
  for (const moh::WeightInfo& info : mha.weight_infos()) EXPECT_EQ(again.weight(info.name), mha.weight(info.name));
  EXPECT_TRUE(same_output(again, mha, 2, 3, 4));
  EXPECT_TRUE(Mentions(error_of([&] { moh::load_layer<moh::MultiHeadAttention<float>>(ckpt, "enc.1."); }),
                       {"metadata key 'enc.1.moh.config' missing"}));
}

TEST(CheckpointSave, RoutingRecordsRoundTrip) {
  moh::MoHConfig c = llama_moh();
  c.router = moh::MoHRouterKind::Learned;
  c.rope = false;
  const moh::MoHAttention<float> moh_layer(c, 21);
  const moh::MoAAttention<float> moa_layer(small_moa(), 22);
  moh::MoHRouting<float> r;
  moh::MoARouting<float> m;
  moh_layer(moh_test::random_tensor<float>(2, 6, 32, 1), {}, &r);
  moa_layer(moh_test::random_tensor<float>(2, 6, 24, 2), {}, &m);
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
