// WeightMatrix: bfloat16 rounding against an independent nearest-value search, and bfloat16
// linear() against the native GEMM on the rounded weights.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>

#include "moh/moh.hpp"

namespace {

using moh::Index;
using moh::Matrix;
using moh::WeightMatrix;
using moh::WeightStorage;

float from_bits(std::uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
std::uint32_t to_bits(float f) {
  std::uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

// Reference: of the two bfloat16 values around x (truncated toward zero, and the next one away
// from zero, whose value is 2^128 when it is the infinity encoding), the nearer one, ties to the
// one with an even last mantissa bit. Distances in double are exact.
std::uint16_t nearest_bfloat16(float x) {
  const std::uint32_t bits = to_bits(x);
  const std::uint32_t lo = bits & 0xFFFF0000u, hi = lo + 0x10000u;
  const double sign = (bits >> 31) ? -1.0 : 1.0;
  const double lo_value = from_bits(lo);
  const double hi_value = (hi & 0x7FFFFFFFu) == 0x7F800000u ? sign * std::ldexp(1.0, 128)
                                                             : static_cast<double>(from_bits(hi));
  const double down = std::abs(static_cast<double>(x) - lo_value);
  const double up = std::abs(hi_value - static_cast<double>(x));
  if (down < up || (down == up && ((lo >> 16) & 1u) == 0)) return static_cast<std::uint16_t>(lo >> 16);
  return static_cast<std::uint16_t>(hi >> 16);
}

TEST(BFloat16, RoundsToNearestEvenOnRandomBitPatterns) {
  std::mt19937 rng(7);
  int checked = 0;
  for (int i = 0; i < 1 << 20; ++i) {
    const std::uint32_t bits = rng();
    const float x = from_bits(bits);
    if (std::isnan(x) || std::isinf(x)) continue;
    ASSERT_EQ(moh::float_to_bfloat16(x), nearest_bfloat16(x)) << "bits 0x" << std::hex << bits;
    ++checked;
  }
  EXPECT_GT(checked, 1 << 19);
}

TEST(BFloat16, HandPickedTiesAndSpecialValues) {
  // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties to the even one, 1.
  EXPECT_EQ(moh::float_to_bfloat16(1.0f + std::ldexp(1.0f, -8)), 0x3F80);
  // 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even): rounds up.
  EXPECT_EQ(moh::float_to_bfloat16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3F82);
  // Just above the tie rounds up.
  EXPECT_EQ(moh::float_to_bfloat16(from_bits(0x3F808001u)), 0x3F81);
  EXPECT_EQ(moh::float_to_bfloat16(std::numeric_limits<float>::max()), 0x7F80);  // overflow
  EXPECT_EQ(moh::float_to_bfloat16(-std::numeric_limits<float>::infinity()), 0xFF80);
  EXPECT_EQ(moh::float_to_bfloat16(-0.0f), 0x8000);
  EXPECT_EQ(moh::float_to_bfloat16(from_bits(0x00000001u)), 0x0000);  // tiny subnormal
  EXPECT_EQ(moh::float_to_bfloat16(from_bits(0x00018000u)), 0x0002);  // subnormal tie, to even
  for (std::uint32_t nan : {0x7FC00000u, 0x7F800001u, 0xFF800001u, 0x7FFFFFFFu})
    EXPECT_TRUE(std::isnan(moh::bfloat16_to_float(moh::float_to_bfloat16(from_bits(nan)))));
}

TEST(BFloat16, EveryPatternSurvivesWidenAndRound) {
  for (std::uint32_t b = 0; b <= 0xFFFFu; ++b) {
    const float f = moh::bfloat16_to_float(static_cast<std::uint16_t>(b));
    EXPECT_EQ(to_bits(f), b << 16);
    if (std::isnan(f)) continue;
    ASSERT_EQ(moh::float_to_bfloat16(f), b);
  }
}

Matrix<float> random_matrix(Index rows, Index cols, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  Matrix<float> m(rows, cols);
  for (Index i = 0; i < m.size(); ++i) m.data()[i] = dist(rng);
  return m;
}

Matrix<float> rounded(const Matrix<float>& m) {
  Matrix<float> out(m.rows(), m.cols());
  for (Index i = 0; i < m.size(); ++i)
    out.data()[i] = moh::bfloat16_to_float(moh::float_to_bfloat16(m.data()[i]));
  return out;
}

TEST(WeightMatrix, StoresValuesRoundedAndHalvesTheBytes) {
  const Matrix<float> w = random_matrix(37, 53, 1);
  WeightMatrix<float> native(37, 53, WeightStorage::Native), bf16(37, 53, WeightStorage::BFloat16);
  native.set(w);
  bf16.set(w);
  EXPECT_EQ(native.values(), w);
  EXPECT_EQ(bf16.values(), rounded(w));
  EXPECT_NE(bf16.values(), w);
  EXPECT_EQ(bf16.bytes() * 2, native.bytes());
  const Matrix<float> top = random_matrix(5, 53, 2);
  bf16.set_rows(10, top);
  EXPECT_EQ(Matrix<float>(bf16.values().middleRows(10, 5)), rounded(top));
  EXPECT_EQ(Matrix<float>(bf16.values().topRows(10)), Matrix<float>(rounded(w).topRows(10)));
}

// Column panels change where the weights live, not what they are: values() and set_rows() see
// the same matrix as in row-major storage, and an untransposed operand at a panel's first column
// multiplies to the same bits as the row-major operand, for whole panels and a narrower last one.
TEST(WeightMatrix, ColumnPanelsHoldTheSameMatrix) {
  const Index rows = 40, cols = 300, panel = 128;  // panels of 128, 128 and 44 columns
  const Matrix<float> w = random_matrix(rows, cols, 6), part = random_matrix(7, cols, 7);
  const Matrix<float> A = random_matrix(13, 10, 8);
  for (WeightStorage storage : {WeightStorage::Native, WeightStorage::BFloat16}) {
    SCOPED_TRACE(moh::weight_storage_name(storage));
    WeightMatrix<float> plain(rows, cols, storage), panels(rows, cols, storage, panel);
    EXPECT_EQ(panels.panel(), panel);
    EXPECT_EQ(plain.panel(), cols);
    plain.set(w);
    panels.set(w);
    plain.set_rows(20, part);
    panels.set_rows(20, part);
    EXPECT_EQ(panels.values(), plain.values());
    EXPECT_EQ(panels.bytes(), plain.bytes());
    EXPECT_THROW(panels.operand(0, 0, true), moh::Error);  // W^T would cross panels
    for (Index c0 = 0; c0 < cols; c0 += panel)
      for (Index r0 : {Index(0), Index(10), Index(30)}) {
        const Index n = std::min(panel, cols - c0);
        const moh::detail::GemmB<float> b = panels.operand(r0, c0, false);
        EXPECT_EQ(b.ld, n);
        EXPECT_EQ(b.reach, rows - r0);
        Matrix<float> got(A.rows(), n), want(A.rows(), n);
        moh::detail::multiply<float>(A.data(), A.cols(), b, got.data(), n, A.rows(), n, A.cols(),
                                     false);
        moh::detail::multiply<float>(A.data(), A.cols(), plain.operand(r0, c0, false), want.data(),
                                     n, A.rows(), n, A.cols(), false);
        EXPECT_EQ(got, want) << "rows from " << r0 << ", columns from " << c0;
      }
  }
}

// linear() on bfloat16 weights equals the GEMM on the rounded weights to float rounding, for a
// decode-sized and larger inputs, narrow and very wide rows, with and without bias.
TEST(WeightMatrix, LinearMatchesTheGemmOnRoundedWeights) {
  struct Shape { Index n, in, out; };
  for (const Shape& s : {Shape{1, 64, 96}, Shape{5, 33, 17}, Shape{130, 512, 700}, Shape{3, 70001, 5}}) {
    const Matrix<float> X = random_matrix(s.n, s.in, 3), W = random_matrix(s.out, s.in, 4);
    const Matrix<float> bias = random_matrix(1, s.out, 5);
    WeightMatrix<float> wm(s.out, s.in, WeightStorage::BFloat16);
    wm.set(W);
    const Matrix<double> ref = X.cast<double>() * rounded(W).cast<double>().transpose() +
                               bias.cast<double>().replicate(s.n, 1);
    moh::ThreadPool pool(2);
    for (moh::ThreadPool* p : {static_cast<moh::ThreadPool*>(nullptr), &pool}) {
      Matrix<float> Y(s.n, s.out);
      moh::linear<float>(X, wm, bias.data(), Y, p);
      const double scale = std::sqrt(static_cast<double>(s.in));
      EXPECT_LE((Y.cast<double>() - ref).cwiseAbs().maxCoeff(), 1e-5 * scale)
          << s.n << "x" << s.in << "x" << s.out;
    }
    // A sub-range of rows, no bias.
    const Index first = s.out / 3, count = s.out - first;
    Matrix<float> Z(s.n, count);
    moh::linear<float>(X, wm, first, count, nullptr, Z, nullptr);
    const Matrix<double> ref_z =
        X.cast<double>() * rounded(W).middleRows(first, count).cast<double>().transpose();
    EXPECT_LE((Z.cast<double>() - ref_z).cwiseAbs().maxCoeff(), 1e-5 * std::sqrt(double(s.in)));
  }
}

// ---- layers with bfloat16 weights ----------------------------------------------------------

double max_abs(const moh::Tensor3<float>& t) {
  double m = 0;
  for (Index i = 0; i < t.size(); ++i) m = std::max(m, std::abs(double(t.data()[i])));
  return m;
}
double max_diff(const moh::Tensor3<float>& a, const moh::Tensor3<float>& b) {
  EXPECT_EQ(a.dimensions(), b.dimensions());
  double m = 0;
  for (Index i = 0; i < a.size(); ++i) m = std::max(m, std::abs(double(a.data()[i]) - b.data()[i]));
  return m;
}
bool same_bits(const moh::Tensor3<float>& a, const moh::Tensor3<float>& b) {
  return a.dimensions() == b.dimensions() &&
         std::memcmp(a.data(), b.data(), sizeof(float) * static_cast<std::size_t>(a.size())) == 0;
}
moh::Tensor3<float> input(Index B, Index T, Index D, unsigned seed) {
  const Matrix<float> m = random_matrix(B * T, D, seed);
  moh::Tensor3<float> x(B, T, D);
  std::copy(m.data(), m.data() + m.size(), x.data());
  return x;
}

// Three copies of a layer: `bf16` stores bfloat16, `rounded` stores in float the values `bf16`
// reports, `exact` keeps the original float weights. The bfloat16 layer must equal `rounded` to
// float rounding (the storage is the only difference), and `exact` within bfloat16's precision.
template <class Layer, class Config, class CopyWeights>
void check_bf16_layer(Config config, CopyWeights copy, bool same_routing, const char* what) {
  SCOPED_TRACE(what);
  Config native_config = config, bf16_config = config;
  native_config.weight_storage = WeightStorage::Native;
  bf16_config.weight_storage = WeightStorage::BFloat16;
  const Layer exact(native_config, 11), bf16(bf16_config, 11);
  Layer rounded(native_config);
  copy(bf16, rounded);
  EXPECT_LT(bf16.weight_bytes(), exact.weight_bytes() * 6 / 10);

  moh::ThreadPool pool(2);
  for (bool causal : {false, true}) {
    moh::ForwardOptions o;
    o.causal = causal;
    const moh::Tensor3<float> x = input(2, 19, config.embed_dim, 5);
    const moh::Tensor3<float> y = bf16(x, o), y_rounded = rounded(x, o), y_exact = exact(x, o);
    const double scale = std::max(1.0, max_abs(y_rounded));
    EXPECT_LE(max_diff(y, y_rounded), 2e-5 * scale);
    if (same_routing) {
      EXPECT_LE(max_diff(y, y_exact), 2e-2 * scale);
      EXPECT_GT(max_diff(y, y_exact), 0.0);  // the weights really were rounded
    }
    o.pool = &pool;
    EXPECT_TRUE(same_bits(bf16(x, o), y));  // thread count does not change bfloat16 results

    // Decoding through the cache, one token at a time, equals the full forward.
    if (!causal) continue;
    moh::KvCache<float> cache = bf16.make_cache(2, 19);
    moh::Tensor3<float> y_steps(2, 19, config.embed_dim);
    for (Index t = 0; t < 19; ++t) {
      const Eigen::array<Index, 3> off{0, t, 0}, ext{2, 1, config.embed_dim};
      const moh::Tensor3<float> xs = x.slice(off, ext);
      moh::Tensor3<float> ys(2, 1, config.embed_dim);
      bf16.forward_cached(xs, ys, cache, o);
      y_steps.slice(off, ext) = ys;
    }
    EXPECT_LE(max_diff(y_steps, y), 2e-5 * scale);
  }
}

TEST(BFloat16Layers, MultiHeadAttention) {
  moh::MhaConfig c;
  c.embed_dim = 512;  // 512 x 512 query rows span several widened tiles
  c.num_heads = 8;
  c.num_kv_heads = 2;
  c.rope = true;
  auto copy = [](const moh::MultiHeadAttention<float>& from, moh::MultiHeadAttention<float>& to) {
    to.set_in_proj_weight(from.in_proj_weight());
    to.set_in_proj_bias(from.in_proj_bias());
    to.set_out_proj_weight(from.out_proj_weight());
    to.set_out_proj_bias(from.out_proj_bias());
  };
  check_bf16_layer<moh::MultiHeadAttention<float>>(c, copy, true, "MHA, GQA, RoPE");
}

auto copy_moh = [](const moh::MoHAttention<float>& from, moh::MoHAttention<float>& to) {
  to.set_qkv_weight(from.qkv_weight());
  if (from.config().bias) {
    to.set_qkv_bias(from.qkv_bias());
    to.set_proj_bias(from.proj_bias());
  }
  to.set_proj_weight(from.proj_weight());
  to.set_router_routed_weight(from.router().routed_weight());
  to.set_router_mix_weight(from.router().mix_weight());
  to.set_router_shared_weight(from.router().shared_weight());
};

TEST(BFloat16Layers, MoHLearnedRouter) {
  moh::MoHConfig c;
  c.embed_dim = 96;
  c.num_heads = 8;
  c.head_dim = 24;
  c.shared_heads = 2;
  c.active_routed_heads = 3;
  // The learned router's weights stay in float, so routing matches the float layer exactly.
  check_bf16_layer<moh::MoHAttention<float>>(c, copy_moh, true, "MoH learned");
}

TEST(BFloat16Layers, MoHQueryNormRouterWithGqaAndRope) {
  moh::MoHConfig c;
  c.embed_dim = 128;
  c.num_heads = 8;
  c.num_kv_heads = 4;
  c.shared_heads = 1;
  c.active_routed_heads = 4;
  c.router = moh::MoHRouter::QueryNorm;
  c.bias = false;
  c.rope = true;
  // Rounded query weights may flip a near-tied routing decision: compare with `rounded` only.
  check_bf16_layer<moh::MoHAttention<float>>(c, copy_moh, false, "MoH query norm");
}

TEST(BFloat16Layers, MoAWithWideExpertBlocks) {
  moh::MoAConfig c;
  c.embed_dim = 1100;  // an expert's [D, d] query block spans several depth blocks
  c.head_dim = 64;
  c.num_experts = 6;
  c.top_k = 2;
  auto copy = [](const moh::MoAAttention<float>& from, moh::MoAAttention<float>& to) {
    to.set_query_experts(from.query_experts());
    to.set_output_experts(from.output_experts());
    to.set_gate_weight(from.gate_weight());
    to.set_key_weight(from.key_weight());
    to.set_value_weight(from.value_weight());
  };
  check_bf16_layer<moh::MoAAttention<float>>(c, copy, true, "MoA");
  // The dense reference path agrees with the sparse one on bfloat16 weights too.
  c.weight_storage = WeightStorage::BFloat16;
  const moh::MoAAttention<float> layer(c, 3);
  const moh::Tensor3<float> x = input(1, 9, c.embed_dim, 8);
  moh::ForwardOptions dense;
  dense.mode = moh::ComputeMode::Dense;
  const moh::Tensor3<float> y = layer(x);
  EXPECT_LE(max_diff(layer(x, dense), y), 2e-5 * std::max(1.0, max_abs(y)));
}

}  // namespace
