// Tests for moh::MoHAttention against the naive reference (SEMANTICS 3 and 4): both compute modes
// over activation ratios and odd sizes, masks, grouped-query heads, the query-norm router with
// RoPE, the reduction to MHA, thread-count independence and the messages of bad input.
#include "moh/moh_attention.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "moh/multi_head_attention.hpp"
#include "reference/naive.hpp"

namespace {

using moh::ComputeMode;
using moh::ForwardOptions;
using moh::Index;
using moh::Mask;
using moh::MhaConfig;
using moh::MoHAttention;
using moh::MoHConfig;
using moh::MoHRouter;
using moh::MoHRouting;
using moh::MultiHeadAttention;
using moh::Tensor3;
using moh_ref::Mat;
using moh_ref::relative_error;
using moh_ref::to_ref;

constexpr ComputeMode kModes[] = {ComputeMode::Sparse, ComputeMode::Dense};
const char* name(ComputeMode m) { return m == ComputeMode::Sparse ? "sparse" : "dense"; }

template <class T>
moh_ref::MhaWeights weights_of(const MoHAttention<T>& m) {
  const MoHConfig& c = m.config();
  moh_ref::MhaWeights w;
  w.D = static_cast<int>(c.embed_dim);
  w.H = static_cast<int>(c.num_heads);
  w.d = static_cast<int>(c.head_size());
  w.Hkv = static_cast<int>(c.num_kv_heads ? c.num_kv_heads : c.num_heads);
  w.W_in = to_ref(m.qkv_weight());
  w.b_in = to_ref(m.qkv_bias());
  w.W_out = to_ref(m.proj_weight());
  w.b_out = to_ref(m.proj_bias());
  w.rope = c.rope;
  w.rope_base = c.rope_base;
  return w;
}

/// The reference's own routing of X [B*T, D] (never the layer's record).
template <class T>
moh_ref::MoHGates reference_gates(const MoHAttention<T>& m, const Mat& X) {
  const MoHConfig& c = m.config();
  const int H = static_cast<int>(c.num_heads), S = static_cast<int>(c.shared_heads);
  const int K = static_cast<int>(c.active_routed_heads);
  if (c.router == MoHRouter::QueryNorm) {
    const moh_ref::MhaWeights w = weights_of(m);
    return moh_ref::naive_moh_gates_query_norm(moh_ref::naive_queries(w, X), H, w.d, S, K);
  }
  return moh_ref::naive_moh_gates(X, H, S, K, to_ref(m.router().routed_weight()),
                                  to_ref(m.router().shared_weight()),
                                  to_ref(m.router().mix_weight()));
}

/// The reference MoH output for self-attention of x [B, T, D].
template <class T>
Mat reference(const MoHAttention<T>& m, const Tensor3<T>& x, const moh_ref::AttnOptions& o) {
  const Mat X = to_ref(x);
  const int B = static_cast<int>(x.dimension(0)), Tn = static_cast<int>(x.dimension(1));
  return moh_ref::naive_moh(weights_of(m), reference_gates(m, X).gates, X, B, Tn, o);
}

template <class T>
Tensor3<T> run(const MoHAttention<T>& m, const Tensor3<T>& x, const ForwardOptions& o,
               MoHRouting<T>* r = nullptr) {
  Tensor3<T> y(x.dimension(0), x.dimension(1), m.config().embed_dim);
  m.forward(x, y, o, r);
  return y;
}

/// Row r of y equals the output bias exactly.
template <class T>
bool row_is_out_bias(const MoHAttention<T>& m, const Tensor3<T>& y, Index r) {
  const Index D = y.dimension(2);
  for (Index c = 0; c < D; ++c)
    if (!(y.data()[r * D + c] == (m.proj_bias().size() ? m.proj_bias()(c) : T(0)))) return false;
  return true;
}

MoHConfig config(Index D, Index H, Index d, Index S, Index K, Index kv = 0) {
  MoHConfig c;
  c.embed_dim = D;
  c.num_heads = H;
  c.head_dim = d;
  c.shared_heads = S;
  c.active_routed_heads = K;
  c.num_kv_heads = kv;
  return c;
}

struct Ratio {
  Index H, S, K;
};
// Activation ratios: no shared head, one shared head (g_s = a_s), several shared heads with and
// without routed heads (K = 0), and every head active.
const std::vector<Ratio> kRatios = {{4, 0, 1}, {4, 1, 2}, {5, 2, 1},
                                    {5, 2, 0}, {4, 1, 3}, {4, 0, 4}};

template <class T>
class MoHTest : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(MoHTest, Scalars);

TYPED_TEST(MoHTest, LearnedRouterMatchesReferenceInBothModes) {
  using T = TypeParam;
  for (const Ratio& r : kRatios)
    for (Index d : {3, 5, 12})
      for (Index Tn : {1, 3, 17}) {
        const Index D = 7;
        const MoHAttention<T> m(config(D, r.H, d, r.S, r.K), 1000 + 10 * d + r.K);
        const Tensor3<T> x = moh_ref::random_tensor<T>(2, Tn, D, 7 + Tn);
        const Mat want = reference(m, x, {});
        for (ComputeMode mode : kModes) {
          ForwardOptions o;
          o.mode = mode;
          MoHRouting<T> routing;
          const Tensor3<T> y = run(m, x, o, &routing);
          EXPECT_LE(relative_error(y, want), moh_ref::Tol<T>::rel)
              << "H=" << r.H << " S=" << r.S << " K=" << r.K << " d=" << d << " T=" << Tn << " "
              << name(mode);
          EXPECT_LE(relative_error(to_ref(routing.gates), reference_gates(m, to_ref(x)).gates),
                    moh_ref::Tol<T>::rel);
        }
      }
}

TYPED_TEST(MoHTest, MasksInBothModes) {
  using T = TypeParam;
  const Index B = 3, Tn = 17, D = 10;
  const Tensor3<T> x = moh_ref::random_tensor<T>(B, Tn, D, 5);
  // Sequence 0: some keys padded (key 0 too, so its first causal query sees nothing);
  // sequence 1: none; sequence 2: every key.
  Mask pad = moh_ref::no_padding(B, Tn);
  for (Index s : {0, 6, 7, 16}) pad(0, s) = true;
  for (Index s = 0; s < Tn; ++s) pad(2, s) = true;
  for (const Ratio& r : kRatios) {
    const MoHAttention<T> m(config(D, r.H, 5, r.S, r.K), 2000 + r.K);
    for (bool causal : {false, true}) {
      moh_ref::AttnOptions ro;
      ro.causal = causal;
      ro.pad = to_ref(pad);
      const Mat want = reference(m, x, ro);
      for (ComputeMode mode : kModes) {
        ForwardOptions o;
        o.mode = mode;
        o.causal = causal;
        o.key_padding_mask = moh::map_mask(pad);
        const Tensor3<T> y = run(m, x, o);
        EXPECT_LE(relative_error(y, want), moh_ref::Tol<T>::rel)
            << "H=" << r.H << " S=" << r.S << " K=" << r.K << " causal=" << causal << " "
            << name(mode);
        for (Index t = 0; t < Tn; ++t)
          EXPECT_TRUE(row_is_out_bias(m, y, 2 * Tn + t)) << "all-padding row " << t << name(mode);
        if (causal) {
          EXPECT_TRUE(row_is_out_bias(m, y, 0)) << name(mode);
        }
      }
    }
  }
}

TYPED_TEST(MoHTest, SparseAndDenseAgree) {
  using T = TypeParam;
  const Index D = 12, Tn = 17;
  const Tensor3<T> x = moh_ref::random_tensor<T>(2, Tn, D, 6);
  Mask pad = moh_ref::no_padding(2, Tn);
  pad(1, 3) = true;
  for (const Ratio& r : kRatios) {
    const MoHAttention<T> m(config(D, r.H, 3, r.S, r.K, 0), 3000 + r.S);
    ForwardOptions o;
    o.causal = true;
    o.key_padding_mask = moh::map_mask(pad);
    MoHRouting<T> rs, rd;
    const Tensor3<T> sparse = run(m, x, o, &rs);
    o.mode = ComputeMode::Dense;
    const Tensor3<T> dense = run(m, x, o, &rd);
    EXPECT_LE(relative_error(sparse, to_ref(dense)), moh_ref::Tol<T>::rel)
        << "H=" << r.H << " S=" << r.S << " K=" << r.K;
    // The routing does not depend on the mode.
    EXPECT_TRUE(rs.active == rd.active);
    EXPECT_TRUE(rs.gates == rd.gates);
  }
}

TYPED_TEST(MoHTest, GroupedQueryHeadsMatchReference) {
  using T = TypeParam;
  const Index D = 9, Tn = 17;
  const Tensor3<T> x = moh_ref::random_tensor<T>(2, Tn, D, 8);
  for (bool rope : {false, true})
    for (Index kv : {1, 2})
      for (const Ratio& r : std::vector<Ratio>{{4, 1, 2}, {4, 0, 1}, {4, 2, 2}}) {
        const Index d = rope ? 6 : 5;  // RoPE needs an even head size
        MoHConfig c = config(D, r.H, d, r.S, r.K, kv);
        c.rope = rope;
        const MoHAttention<T> m(c, 4000 + kv);
        ASSERT_EQ(m.qkv_weight().rows(), (4 + 2 * kv) * d);
        moh_ref::AttnOptions ro;
        ro.causal = true;
        ro.position_offset = rope ? 3 : 0;
        const Mat want = reference(m, x, ro);
        for (ComputeMode mode : kModes) {
          ForwardOptions o;
          o.mode = mode;
          o.causal = true;
          o.position_offset = ro.position_offset;
          EXPECT_LE(relative_error(run(m, x, o), want), moh_ref::Tol<T>::rel)
              << "kv=" << kv << " S=" << r.S << " K=" << r.K << " rope=" << rope << " "
              << name(mode);
        }
      }
}

// MoH-LLaMA3: query-norm router, RoPE, grouped-query heads, no bias, causal (SEMANTICS 4).
TYPED_TEST(MoHTest, QueryNormRouterWithRopeMatchesReference) {
  using T = TypeParam;
  MoHConfig c = config(10, 6, 6, 2, 2, 2);
  c.router = MoHRouter::QueryNorm;
  c.rope = true;
  c.bias = false;
  const MoHAttention<T> m(c, 5000);
  for (Index Tn : {1, 3, 17})
    for (int offset : {0, 4}) {
      const Tensor3<T> x = moh_ref::random_tensor<T>(2, Tn, 10, 50 + Tn);
      Mask pad = moh_ref::no_padding(2, Tn);
      pad(1, Tn - 1) = true;
      moh_ref::AttnOptions ro;
      ro.causal = true;
      ro.position_offset = offset;
      ro.pad = to_ref(pad);
      const Mat want = reference(m, x, ro);
      for (ComputeMode mode : kModes) {
        ForwardOptions o;
        o.mode = mode;
        o.causal = true;
        o.position_offset = offset;
        o.key_padding_mask = moh::map_mask(pad);
        MoHRouting<T> routing;
        EXPECT_LE(relative_error(run(m, x, o, &routing), want), moh_ref::Tol<T>::rel)
            << "T=" << Tn << " offset=" << offset << " " << name(mode);
        for (Index i = 0; i < routing.gates.size(); ++i)
          EXPECT_TRUE(routing.gates.data()[i] == T(0) || routing.gates.data()[i] == T(1));
      }
    }
}

// SEMANTICS 3, "Reduction to MHA": every head active and zero router weights -> every gate is
// exactly 1 and MoH equals MHA with the same projections.
TYPED_TEST(MoHTest, ReducesToMhaWithEveryHeadActiveAndZeroRouter) {
  using T = TypeParam;
  const Index D = 10, Tn = 17, B = 2;
  const Tensor3<T> x = moh_ref::random_tensor<T>(B, Tn, D, 9);
  Mask pad = moh_ref::no_padding(B, Tn);
  pad(0, 2) = pad(1, 0) = true;
  for (Index kv : {0, 2})
    for (const Ratio& r :
         std::vector<Ratio>{{4, 0, 4}, {4, 1, 3}, {4, 2, 2}, {4, 3, 1}, {4, 4, 0}}) {
      MhaConfig mc;
      mc.embed_dim = D;
      mc.num_heads = 4;
      mc.head_dim = 5;
      mc.num_kv_heads = kv;
      const MultiHeadAttention<T> mha(mc, 6000 + kv);
      MoHAttention<T> moh_layer(config(D, r.H, 5, r.S, r.K, kv));  // zero router weights
      moh_layer.set_qkv_weight(mha.in_proj_weight());
      moh_layer.set_qkv_bias(mha.in_proj_bias());
      moh_layer.set_proj_weight(mha.out_proj_weight());
      moh_layer.set_proj_bias(mha.out_proj_bias());
      ForwardOptions o;
      o.causal = true;
      o.key_padding_mask = moh::map_mask(pad);
      Tensor3<T> want(B, Tn, D);
      mha.forward(x, want, o);
      for (ComputeMode mode : kModes) {
        o.mode = mode;
        MoHRouting<T> routing;
        const Tensor3<T> y = run(moh_layer, x, o, &routing);
        EXPECT_LE(relative_error(y, to_ref(want)), moh_ref::Tol<T>::exact)
            << "kv=" << kv << " S=" << r.S << " K=" << r.K << " " << name(mode);
        for (Index i = 0; i < routing.gates.size(); ++i)
          EXPECT_EQ(routing.gates.data()[i], T(1))
              << "gate " << i << " S=" << r.S << " K=" << r.K << " " << name(mode);
      }
    }
}

// With every head active and random router weights, MoH is MHA whose per-head outputs are
// scaled by the gates: y = concat_h(g_h o_h) W_o^T + b_o with o_h from the reference MHA.
TYPED_TEST(MoHTest, EveryHeadActiveEqualsGateScaledMha) {
  using T = TypeParam;
  const Index D = 8, Tn = 17, B = 2;
  const Tensor3<T> x = moh_ref::random_tensor<T>(B, Tn, D, 10);
  for (const Ratio& r : std::vector<Ratio>{{4, 1, 3}, {4, 2, 2}, {4, 0, 4}}) {
    const MoHAttention<T> m(config(D, r.H, 3, r.S, r.K), 7000 + r.S);
    for (ComputeMode mode : kModes) {
      ForwardOptions o;
      o.mode = mode;
      o.causal = true;
      MoHRouting<T> routing;
      const Tensor3<T> y = run(m, x, o, &routing);
      moh_ref::AttnOptions ro;
      ro.causal = true;
      const moh_ref::MhaWeights w = weights_of(m);
      Mat heads = moh_ref::naive_mha_heads(w, to_ref(x), B, Tn, to_ref(x), Tn, ro);
      for (Index n = 0; n < heads.rows(); ++n)
        for (Index h = 0; h < 4; ++h) heads.block(n, h * 3, 1, 3) *= double(routing.gates(n, h));
      EXPECT_LE(relative_error(y, moh_ref::linear(heads, w.W_out, w.b_out)), moh_ref::Tol<T>::rel)
          << "S=" << r.S << " " << name(mode);
      // And the gates really are not all 1, or this test would be the reduction test again.
      EXPECT_GT((routing.gates.array() - T(1)).abs().maxCoeff(), T(1e-3));
    }
  }
}

// A routed head nobody picks contributes nothing: changing its query and output weights leaves
// y bitwise unchanged. Zero router weights make p uniform, and ties go to the lower index, so
// with K = 1 of E = 3 routed heads every token keeps routed head 0 (head S).
TYPED_TEST(MoHTest, UnpickedHeadsDoNotAffectOutput) {
  using T = TypeParam;
  const Index D = 6, d = 3, H = 4, S = 1;
  MoHAttention<T> m(config(D, H, d, S, 1));
  const MoHAttention<T> seeded(config(D, H, d, S, 1), 8000);
  m.set_qkv_weight(seeded.qkv_weight());
  m.set_qkv_bias(seeded.qkv_bias());
  m.set_proj_weight(seeded.proj_weight());
  m.set_proj_bias(seeded.proj_bias());
  const Tensor3<T> x = moh_ref::random_tensor<T>(2, 17, D, 11);
  for (ComputeMode mode : kModes) {
    ForwardOptions o;
    o.mode = mode;
    o.causal = true;
    MoHRouting<T> routing;
    const Tensor3<T> before = run(m, x, o, &routing);
    for (Index n = 0; n < routing.active.rows(); ++n)
      ASSERT_TRUE(routing.active(n, 0) && routing.active(n, 1) && !routing.active(n, 2) &&
                  !routing.active(n, 3));
    MoHAttention<T> changed = m;
    moh::Matrix<T> qkv = m.qkv_weight(), proj = m.proj_weight();
    qkv.middleRows(2 * d, 2 * d).setConstant(T(3));  // queries of heads 2 and 3
    proj.middleCols(2 * d, 2 * d).setConstant(T(-5));
    changed.set_qkv_weight(qkv);
    changed.set_proj_weight(proj);
    const Tensor3<T> after = run(changed, x, o);
    EXPECT_EQ(std::memcmp(before.data(), after.data(), before.size() * sizeof(T)), 0) << name(mode);
    // ... while changing a picked head does change y.
    qkv.middleRows(d, d).setConstant(T(0.25));
    changed.set_qkv_weight(qkv);
    EXPECT_GT(relative_error(run(changed, x, o), to_ref(before)), 1e-3) << name(mode);
  }
}

// Results must not depend on the number of threads: bitwise, both routers, both modes. The
// sparse path (row or column tiles, by shape) agrees with the dense one.
template <class T>
void check_threads(Index D, Index Tn) {
  const Index B = 2;
  const Tensor3<T> x = moh_ref::random_tensor<T>(B, Tn, D, 12);
  Mask pad = moh_ref::no_padding(B, Tn);
  pad(0, Tn - 10) = pad(1, 3) = true;
  for (MoHRouter router : {MoHRouter::Learned, MoHRouter::QueryNorm}) {
    MoHConfig c = config(D, 5, 6, 1, 2);
    c.router = router;
    c.rope = router == MoHRouter::QueryNorm;
    const MoHAttention<T> m(c, 9000);
    std::vector<Tensor3<T>> bases;
    for (ComputeMode mode : kModes) {
      ForwardOptions o;
      o.mode = mode;
      o.causal = true;
      o.key_padding_mask = moh::map_mask(pad);
      const Tensor3<T> base = run(m, x, o);
      bases.push_back(base);
      for (int threads : {1, 2, 3}) {
        moh::ThreadPool pool(threads);
        o.pool = &pool;
        const Tensor3<T> y = run(m, x, o);
        EXPECT_EQ(std::memcmp(y.data(), base.data(), y.size() * sizeof(T)), 0)
            << threads << " threads, " << name(mode);
      }
    }
    EXPECT_LE(relative_error(bases[0], to_ref(bases[1])), moh_ref::Tol<T>::rel)
        << "sparse vs dense";
  }
}

TYPED_TEST(MoHTest, ThreadCountDoesNotChangeBits) {
  // 400 tokens: 480 rows per head, so the routed output stage runs in row tiles. D = 300 with
  // 60 tokens: few rows per head, so it runs in several column tiles (128 + 128 + 44).
  for (const auto& [D, Tn] : {std::pair<Index, Index>{20, 400}, std::pair<Index, Index>{300, 60}})
    check_threads<TypeParam>(D, Tn);
}

// ---- bad input ----------------------------------------------------------------------------------

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

TEST(MoHErrors, ImpossibleConfigsNameExpectedAndActual) {
  // K larger than the routed heads: H = 4, S = 1 leaves 3.
  std::string msg = moh_ref::error_of([] { MoHAttention<float> m(config(8, 4, 0, 1, 4)); });
  EXPECT_TRUE(contains(msg, "0..3") && contains(msg, "got 4")) << msg;
  msg = moh_ref::error_of([] { MoHAttention<float> m(config(8, 4, 0, 5, 0)); });
  EXPECT_TRUE(contains(msg, "0..4") && contains(msg, "got 5")) << msg;
  msg = moh_ref::error_of([] { MoHAttention<float> m(config(8, 4, 0, 0, 0)); });
  EXPECT_TRUE(contains(msg, ">= 1") && contains(msg, "0 + 0")) << msg;
  msg = moh_ref::error_of([] { MoHAttention<float> m(config(8, 4, 0, 1, 1, 3)); });
  EXPECT_TRUE(contains(msg, "divisor of 4") && contains(msg, "got 3")) << msg;
  msg = moh_ref::error_of([] { MoHAttention<float> m(config(10, 4, 0, 1, 1)); });
  EXPECT_TRUE(contains(msg, "multiple of 4") && contains(msg, "got 10")) << msg;
  msg = moh_ref::error_of([] { MoHAttention<float> m(config(0, 4, 2, 1, 1)); });
  EXPECT_TRUE(contains(msg, "embed_dim") && contains(msg, "> 0") && contains(msg, "got 0")) << msg;
  msg = moh_ref::error_of([] { MoHAttention<float> m(config(8, 0, 2, 0, 1)); });
  EXPECT_TRUE(contains(msg, "num_heads") && contains(msg, "got 0")) << msg;
  MoHConfig odd = config(8, 4, 3, 1, 1);
  odd.rope = true;
  msg = moh_ref::error_of([&] { MoHAttention<float> m(odd); });
  EXPECT_TRUE(contains(msg, "even") && contains(msg, "got 3")) << msg;
}

TEST(MoHErrors, SettersCheckShapes) {
  // H = 4, S = 2, K = 1, d = 3, H_kv = 2: qkv [(4 + 4) 3, 8] = [24, 8], proj [8, 12],
  // wg [2, 8], wg_0 [2, 8], wg_1 [2, 8].
  MoHAttention<double> m(config(8, 4, 3, 2, 1, 2));
  std::string msg = moh_ref::error_of([&] { m.set_qkv_weight(moh::Matrix<double>::Zero(36, 8)); });
  EXPECT_TRUE(contains(msg, "[24, 8]") && contains(msg, "[36, 8]")) << msg;
  msg = moh_ref::error_of([&] { m.set_proj_weight(moh::Matrix<double>::Zero(12, 8)); });
  EXPECT_TRUE(contains(msg, "[8, 12]") && contains(msg, "[12, 8]")) << msg;
  msg = moh_ref::error_of([&] { m.set_qkv_bias(moh::Vector<double>::Zero(36)); });
  EXPECT_TRUE(contains(msg, "[24]") && contains(msg, "[36]")) << msg;
  msg = moh_ref::error_of([&] { m.set_proj_bias(moh::Vector<double>::Zero(7)); });
  EXPECT_TRUE(contains(msg, "[8]") && contains(msg, "[7]")) << msg;
  msg = moh_ref::error_of([&] { m.set_router_routed_weight(moh::Matrix<double>::Zero(3, 8)); });
  EXPECT_TRUE(contains(msg, "[2, 8]") && contains(msg, "[3, 8]")) << msg;
  msg = moh_ref::error_of([&] { m.set_router_mix_weight(moh::Matrix<double>::Zero(2, 9)); });
  EXPECT_TRUE(contains(msg, "[2, 8]") && contains(msg, "[2, 9]")) << msg;
  msg = moh_ref::error_of([&] { m.set_router_shared_weight(moh::Matrix<double>::Zero(1, 8)); });
  EXPECT_TRUE(contains(msg, "[2, 8]") && contains(msg, "[1, 8]")) << msg;
  EXPECT_EQ(moh_ref::error_of([&] { m.set_router_shared_weight(moh::Matrix<double>::Zero(2, 8)); }),
            "<no moh::Error>");
}

TEST(MoHErrors, MismatchedShapesNameBoth) {
  const MoHAttention<float> m(config(8, 4, 0, 1, 2), 1);
  const Tensor3<float> x = moh_ref::random_tensor<float>(2, 3, 8, 2);
  Tensor3<float> y(1, 3, 8);
  std::string msg = moh_ref::error_of([&] { m.forward(x, y); });
  EXPECT_TRUE(contains(msg, "[2, 3, 8]") && contains(msg, "[1, 3, 8]")) << msg;
  Tensor3<float> good(2, 3, 8);
  Mask pad = moh_ref::no_padding(1, 3);
  for (ComputeMode mode : kModes) {
    ForwardOptions o;
    o.mode = mode;
    o.key_padding_mask = moh::map_mask(pad);
    msg = moh_ref::error_of([&] { m.forward(x, good, o); });
    EXPECT_TRUE(contains(msg, "[2, 3]") && contains(msg, "[1, 3]")) << msg;
  }
}

}  // namespace
