// Tests for moh::MoAAttention against the naive reference (SEMANTICS 5): both compute modes over
// odd sizes and (E, k) combinations, masks, cross-attention, k = E as a gate-weighted sum of every
// expert, the JetMoE gating option, thread-count independence and the messages of bad input.
#include "moh/moa_attention.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "reference/naive.hpp"

namespace {

using moh::ComputeMode;
using moh::ForwardOptions;
using moh::Index;
using moh::Mask;
using moh::MoAAttention;
using moh::MoAConfig;
using moh::MoAGating;
using moh::MoARouting;
using moh::Tensor3;
using moh_ref::Mat;
using moh_ref::relative_error;
using moh_ref::to_ref;

constexpr ComputeMode kModes[] = {ComputeMode::Sparse, ComputeMode::Dense};
const char* name(ComputeMode m) { return m == ComputeMode::Sparse ? "sparse" : "dense"; }

MoAConfig config(Index D, Index d, Index E, Index k, MoAGating g = MoAGating::Softmax) {
  MoAConfig c;
  c.embed_dim = D;
  c.head_dim = d;
  c.num_experts = E;
  c.top_k = k;
  c.gating = g;
  return c;
}

template <class T>
moh_ref::MoAWeights weights_of(const MoAAttention<T>& m) {
  const MoAConfig& c = m.config();
  moh_ref::MoAWeights w;
  w.D = static_cast<int>(c.embed_dim);
  w.d = static_cast<int>(c.head_dim);
  w.E = static_cast<int>(c.num_experts);
  w.k = static_cast<int>(c.top_k);
  w.Wq = to_ref(m.query_experts());
  w.Wo = to_ref(m.output_experts());
  w.Wg = to_ref(m.gate_weight());
  w.Wk = to_ref(m.key_weight());
  w.Wv = to_ref(m.value_weight());
  w.topk_softmax = c.gating == MoAGating::TopKSoftmax;
  return w;
}

template <class T>
Mat reference(const MoAAttention<T>& m, const Tensor3<T>& x, const moh_ref::AttnOptions& o,
              moh_ref::MoARoute* route = nullptr) {
  const int B = static_cast<int>(x.dimension(0)), Tn = static_cast<int>(x.dimension(1));
  return moh_ref::naive_moa(weights_of(m), to_ref(x), B, Tn, to_ref(x), Tn, o, route);
}

template <class T>
Tensor3<T> run(const MoAAttention<T>& m, const Tensor3<T>& x, const ForwardOptions& o,
               MoARouting<T>* r = nullptr) {
  Tensor3<T> y(x.dimension(0), x.dimension(1), m.config().embed_dim);
  m.forward(x, y, o, r);
  return y;
}

template <class T>
Tensor3<T> run_cross(const MoAAttention<T>& m, const Tensor3<T>& x, const Tensor3<T>& mem,
                     const ForwardOptions& o) {
  Tensor3<T> y(x.dimension(0), x.dimension(1), m.config().embed_dim);
  m.forward_cross(x, mem, y, o);
  return y;
}

/// Row r of y is exactly zero (MoA has no output bias).
template <class T>
bool row_is_zero(const Tensor3<T>& y, Index r) {
  for (Index c = 0; c < y.dimension(2); ++c)
    if (!(y.data()[r * y.dimension(2) + c] == T(0))) return false;
  return true;
}

struct Experts {
  Index E, k;
};
const std::vector<Experts> kExperts = {{4, 1}, {4, 2}, {3, 3}, {5, 2}, {1, 1}};

template <class T>
class MoATest : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(MoATest, Scalars);

TYPED_TEST(MoATest, MatchesReferenceOverOddSizesInBothModes) {
  using T = TypeParam;
  const Index D = 7;
  for (const Experts& ek : kExperts)
    for (Index d : {3, 5, 12})
      for (Index Tn : {1, 3, 17}) {
        const MoAAttention<T> m(config(D, d, ek.E, ek.k), 100 * ek.E + 10 * ek.k + d);
        const Tensor3<T> x = moh_ref::random_tensor<T>(2, Tn, D, Tn + d);
        moh_ref::MoARoute route;
        const Mat want = reference(m, x, {}, &route);
        for (ComputeMode mode : kModes) {
          ForwardOptions o;
          o.mode = mode;
          MoARouting<T> r;
          EXPECT_LE(relative_error(run(m, x, o, &r), want), moh_ref::Tol<T>::rel)
              << "E=" << ek.E << " k=" << ek.k << " d=" << d << " T=" << Tn << " " << name(mode);
          EXPECT_LE(relative_error(to_ref(r.gates), route.gates), moh_ref::Tol<T>::rel);
          EXPECT_NEAR(r.switch_loss, route.switch_loss, moh_ref::Tol<T>::rel * route.switch_loss);
          EXPECT_NEAR(r.z_loss, route.z_loss, moh_ref::Tol<T>::rel * std::max(1.0, route.z_loss));
          EXPECT_NEAR(r.cv_loss, route.cv_loss,
                      moh_ref::Tol<T>::rel * std::max(1.0, route.cv_loss));
        }
      }
}

// D = 320: the output experts are stored in column panels of 128, 128 and 64, in T and in
// bfloat16. With 12 and 40 tokens the routed output stage runs in column tiles (unpacked products
// for the few rows of an expert), with 400 in row tiles across the panels; the dense path
// multiplies panel by panel. All against the reference, which reads the weights back.
TYPED_TEST(MoATest, MatchesReferenceWithOutputWeightsInPanels) {
  using T = TypeParam;
  const Index D = 320, d = 8;
  for (moh::WeightStorage storage : {moh::WeightStorage::Native, moh::WeightStorage::BFloat16}) {
    MoAConfig c = config(D, d, 3, 2);
    c.weight_storage = storage;
    const MoAAttention<T> m(c, 800);
    const moh::Matrix<T> out = m.output_experts();
    MoAAttention<T> copy(c, 801);
    copy.set_output_experts(out);
    EXPECT_EQ(copy.output_experts(), out);
    for (Index Tn : {12, 40, 400}) {
      const Tensor3<T> x = moh_ref::random_tensor<T>(2, Tn, D, 802 + Tn);
      const Mat want = reference(m, x, {});
      for (ComputeMode mode : kModes) {
        ForwardOptions o;
        o.mode = mode;
        EXPECT_LE(relative_error(run(m, x, o), want), moh_ref::Tol<T>::rel)
            << "T=" << Tn << " " << name(mode) << " " << moh::weight_storage_name(storage);
      }
    }
  }
}

TYPED_TEST(MoATest, MasksInBothModes) {
  using T = TypeParam;
  const Index B = 3, Tn = 17, D = 10;
  const Tensor3<T> x = moh_ref::random_tensor<T>(B, Tn, D, 1);
  // Sequence 0: some keys padded, key 0 among them; sequence 1: none; sequence 2: every key.
  Mask pad = moh_ref::no_padding(B, Tn);
  for (Index s : {0, 3, 9, 16}) pad(0, s) = true;
  for (Index s = 0; s < Tn; ++s) pad(2, s) = true;
  for (const Experts& ek : kExperts) {
    const MoAAttention<T> m(config(D, 5, ek.E, ek.k), 200 + ek.E + ek.k);
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
            << "E=" << ek.E << " k=" << ek.k << " causal=" << causal << " " << name(mode);
        for (Index t = 0; t < Tn; ++t)
          EXPECT_TRUE(row_is_zero(y, 2 * Tn + t)) << "all-padding row " << t << " " << name(mode);
        // Causal: query 0 of sequence 0 sees only key 0, which is padding.
        if (causal) {
          EXPECT_TRUE(row_is_zero(y, 0)) << name(mode);
        }
      }
    }
  }
}

TYPED_TEST(MoATest, CrossAttentionInBothModes) {
  using T = TypeParam;
  const Index B = 2, D = 8;
  const MoAAttention<T> m(config(D, 3, 4, 2), 300);
  const std::vector<std::pair<Index, Index>> lengths = {{3, 17}, {17, 5}, {1, 3}};
  for (auto [Tn, S] : lengths)
    for (bool causal : {false, true}) {
      const Tensor3<T> x = moh_ref::random_tensor<T>(B, Tn, D, 301 + Tn);
      const Tensor3<T> mem = moh_ref::random_tensor<T>(B, S, D, 302 + S);
      Mask pad = moh_ref::no_padding(B, S);
      pad(0, S - 1) = true;
      moh_ref::AttnOptions ro;
      ro.causal = causal;
      ro.pad = to_ref(pad);
      const Mat want = moh_ref::naive_moa(weights_of(m), to_ref(x), B, static_cast<int>(Tn),
                                          to_ref(mem), static_cast<int>(S), ro);
      for (ComputeMode mode : kModes) {
        ForwardOptions o;
        o.mode = mode;
        o.causal = causal;
        o.key_padding_mask = moh::map_mask(pad);
        const Tensor3<T> y = run_cross(m, x, mem, o);
        EXPECT_LE(relative_error(y, want), moh_ref::Tol<T>::rel)
            << "T=" << Tn << " S=" << S << " causal=" << causal << " " << name(mode);
        // Bottom-right causal with S < T: the first T - S queries see no key.
        if (causal) {
          for (Index b = 0; b < B; ++b)
            for (Index i = 0; i < Tn - S; ++i) EXPECT_TRUE(row_is_zero(y, b * Tn + i));
        }
      }
    }
}

// k = E: every expert is selected, and y = sum_e p_e (o_e W_o^e) over all of them, with p the
// softmax over all experts (so the gates of a token sum to 1).
TYPED_TEST(MoATest, EveryExpertSelectedIsTheGateWeightedSum) {
  using T = TypeParam;
  const Index B = 2, Tn = 17, D = 9, E = 4;
  const MoAAttention<T> m(config(D, 5, E, E), 400);
  const Tensor3<T> x = moh_ref::random_tensor<T>(B, Tn, D, 401);
  moh_ref::AttnOptions ro;
  ro.causal = true;
  const std::vector<Mat> experts =
      moh_ref::naive_moa_experts(weights_of(m), to_ref(x), B, Tn, to_ref(x), Tn, ro);
  for (ComputeMode mode : kModes) {
    ForwardOptions o;
    o.mode = mode;
    o.causal = true;
    MoARouting<T> r;
    const Tensor3<T> y = run(m, x, o, &r);
    Mat want = Mat::Zero(B * Tn, D);
    for (Index n = 0; n < B * Tn; ++n) {
      T sum = 0;
      for (Index e = 0; e < E; ++e) {
        EXPECT_EQ(r.gates(n, e), r.probs(n, e)) << "k = E keeps every expert with gate p_e";
        want.row(n) += double(r.gates(n, e)) * experts[e].row(n);
        sum += r.gates(n, e);
      }
      EXPECT_NEAR(sum, T(1), 1e-5);
    }
    EXPECT_LE(relative_error(y, want), moh_ref::Tol<T>::rel) << name(mode);
  }
}

TYPED_TEST(MoATest, SparseAndDenseAgree) {
  using T = TypeParam;
  const Index B = 2, Tn = 17, D = 12;
  const Tensor3<T> x = moh_ref::random_tensor<T>(B, Tn, D, 500);
  Mask pad = moh_ref::no_padding(B, Tn);
  pad(1, 4) = true;
  for (const Experts& ek : kExperts) {
    const MoAAttention<T> m(config(D, 3, ek.E, ek.k), 501 + ek.E);
    ForwardOptions o;
    o.causal = true;
    o.key_padding_mask = moh::map_mask(pad);
    MoARouting<T> rs, rd;
    const Tensor3<T> sparse = run(m, x, o, &rs);
    o.mode = ComputeMode::Dense;
    const Tensor3<T> dense = run(m, x, o, &rd);
    EXPECT_LE(relative_error(sparse, to_ref(dense)), moh_ref::Tol<T>::rel)
        << "E=" << ek.E << " k=" << ek.k;
    EXPECT_TRUE(rs.selected == rd.selected);
    EXPECT_TRUE(rs.gates == rd.gates);
  }
}

TYPED_TEST(MoATest, JetMoEGatingMatchesReference) {
  using T = TypeParam;
  const Index B = 2, Tn = 17, D = 7;
  for (Index k : {1, 2, 4}) {
    const MoAAttention<T> m(config(D, 5, 4, k, MoAGating::TopKSoftmax), 600 + k);
    const Tensor3<T> x = moh_ref::random_tensor<T>(B, Tn, D, 601);
    moh_ref::AttnOptions ro;
    ro.causal = true;
    const Mat want = reference(m, x, ro);
    for (ComputeMode mode : kModes) {
      ForwardOptions o;
      o.mode = mode;
      o.causal = true;
      MoARouting<T> r;
      EXPECT_LE(relative_error(run(m, x, o, &r), want), moh_ref::Tol<T>::rel)
          << "k=" << k << " " << name(mode);
      for (Index n = 0; n < B * Tn; ++n) EXPECT_NEAR(r.gates.row(n).sum(), T(1), 1e-5);
    }
  }
}

// Results must not depend on the number of threads: bitwise, self and cross, both modes. The
// sparse path (row or column tiles, by shape) agrees with the dense one.
template <class T>
void check_threads(Index D, Index Tn) {
  const Index B = 2;
  const MoAAttention<T> m(config(D, 6, 5, 2), 700);
  const Tensor3<T> x = moh_ref::random_tensor<T>(B, Tn, D, 701);
  const Tensor3<T> mem = moh_ref::random_tensor<T>(B, 70, D, 702);
  Mask pad = moh_ref::no_padding(B, Tn);
  pad(0, 3) = pad(1, Tn - 1) = true;
  std::vector<Tensor3<T>> bases;  // self, cross of each mode
  for (ComputeMode mode : kModes) {
    ForwardOptions o;
    o.mode = mode;
    o.causal = true;
    o.key_padding_mask = moh::map_mask(pad);
    ForwardOptions oc;
    oc.mode = mode;
    const Tensor3<T> base = run(m, x, o), base_cross = run_cross(m, x, mem, oc);
    for (int threads : {1, 2, 3}) {
      moh::ThreadPool pool(threads);
      o.pool = oc.pool = &pool;
      const Tensor3<T> y = run(m, x, o), yc = run_cross(m, x, mem, oc);
      EXPECT_EQ(std::memcmp(y.data(), base.data(), y.size() * sizeof(T)), 0)
          << threads << " threads, " << name(mode);
      EXPECT_EQ(std::memcmp(yc.data(), base_cross.data(), yc.size() * sizeof(T)), 0)
          << threads << " threads, cross, " << name(mode);
    }
    bases.push_back(base);
    bases.push_back(base_cross);
  }
  EXPECT_LE(relative_error(bases[0], to_ref(bases[2])), moh_ref::Tol<T>::rel) << "sparse vs dense";
  EXPECT_LE(relative_error(bases[1], to_ref(bases[3])), moh_ref::Tol<T>::rel)
      << "sparse vs dense, cross";
}

TYPED_TEST(MoATest, ThreadCountDoesNotChangeBits) {
  // 400 tokens: 320 rows per expert, so the routed output stage runs in row tiles. D = 300 with
  // 60 tokens: few rows per expert, so it runs in several column tiles (128 + 128 + 44).
  for (const auto& [D, Tn] : {std::pair<Index, Index>{20, 400}, std::pair<Index, Index>{300, 60}})
    check_threads<TypeParam>(D, Tn);
}

// ---- bad input ----------------------------------------------------------------------------------

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

TEST(MoAErrors, ImpossibleConfigsNameExpectedAndActual) {
  std::string msg = moh_ref::error_of([] { MoAAttention<float> m(config(8, 4, 4, 5)); });
  EXPECT_TRUE(contains(msg, "1..4") && contains(msg, "got 5")) << msg;
  msg = moh_ref::error_of([] { MoAAttention<float> m(config(8, 4, 4, 0)); });
  EXPECT_TRUE(contains(msg, "1..4") && contains(msg, "got 0")) << msg;
  msg = moh_ref::error_of([] { MoAAttention<float> m(config(0, 4, 4, 1)); });
  EXPECT_TRUE(contains(msg, "embed_dim") && contains(msg, "> 0") && contains(msg, "got 0")) << msg;
  msg = moh_ref::error_of([] { MoAAttention<float> m(config(8, 0, 4, 1)); });
  EXPECT_TRUE(contains(msg, "head_dim") && contains(msg, "> 0") && contains(msg, "got 0")) << msg;
  msg = moh_ref::error_of([] { MoAAttention<float> m(config(8, 4, 0, 1)); });
  EXPECT_TRUE(contains(msg, "num_experts") && contains(msg, "> 0") && contains(msg, "got 0"))
      << msg;
}

TEST(MoAErrors, SettersCheckShapes) {
  // D = 6, d = 3, E = 4: query experts [24, 3], output experts [12, 6], gate [6, 4], k/v [3, 6].
  MoAAttention<double> m(config(6, 3, 4, 2));
  using M = moh::Matrix<double>;
  std::string msg = moh_ref::error_of([&] { m.set_query_experts(M::Zero(24, 4)); });
  EXPECT_TRUE(contains(msg, "[24, 3]") && contains(msg, "[24, 4]")) << msg;
  msg = moh_ref::error_of([&] { m.set_output_experts(M::Zero(6, 12)); });
  EXPECT_TRUE(contains(msg, "[12, 6]") && contains(msg, "[6, 12]")) << msg;
  msg = moh_ref::error_of([&] { m.set_gate_weight(M::Zero(4, 6)); });
  EXPECT_TRUE(contains(msg, "[6, 4]") && contains(msg, "[4, 6]")) << msg;
  msg = moh_ref::error_of([&] { m.set_key_weight(M::Zero(6, 3)); });
  EXPECT_TRUE(contains(msg, "[3, 6]") && contains(msg, "[6, 3]")) << msg;
  msg = moh_ref::error_of([&] { m.set_value_weight(M::Zero(3, 7)); });
  EXPECT_TRUE(contains(msg, "[3, 6]") && contains(msg, "[3, 7]")) << msg;
  // A right-shaped key weight is accepted and lands in key_weight(), not value_weight().
  const M k = moh_ref::random_matrix<double>(3, 6, 1);
  m.set_key_weight(k);
  EXPECT_TRUE(m.key_weight() == k);
  EXPECT_TRUE(m.value_weight().isZero());
}

TEST(MoAErrors, MismatchedShapesNameBoth) {
  const MoAAttention<float> m(config(8, 4, 3, 2), 1);
  const Tensor3<float> x = moh_ref::random_tensor<float>(2, 3, 8, 2);
  Tensor3<float> y(2, 5, 8);
  std::string msg = moh_ref::error_of([&] { m.forward(x, y); });
  EXPECT_TRUE(contains(msg, "[2, 3, 8]") && contains(msg, "[2, 5, 8]")) << msg;
  Tensor3<float> good(2, 3, 8);
  const Tensor3<float> mem = moh_ref::random_tensor<float>(1, 4, 8, 3);
  msg = moh_ref::error_of([&] { m.forward_cross(x, mem, good); });
  EXPECT_TRUE(contains(msg, "[2, *, 8]") && contains(msg, "[1, 4, 8]")) << msg;
  Mask pad = moh_ref::no_padding(2, 5);
  for (ComputeMode mode : kModes) {
    ForwardOptions o;
    o.mode = mode;
    o.key_padding_mask = moh::map_mask(pad);
    msg = moh_ref::error_of([&] { m.forward(x, good, o); });
    EXPECT_TRUE(contains(msg, "[2, 3]") && contains(msg, "[2, 5]")) << msg;
    // Cross-attention: the mask covers the memory's 4 keys.
    const Tensor3<float> mem4 = moh_ref::random_tensor<float>(2, 4, 8, 4);
    msg = moh_ref::error_of([&] { m.forward_cross(x, mem4, good, o); });
    EXPECT_TRUE(contains(msg, "[2, 4]") && contains(msg, "[2, 5]")) << msg;
  }
}

}  // namespace
