// Tests for reference/naive_families.hpp (the naive references of docs/semantics.md §6-9):
// every public golden case in tests/data/families passes the reference, read by the tensor and
// metadata names of FIXTURES.md (an unknown tensor or metadata key fails the case, and so does a
// file in the folder that this test does not list); jetmoe_decode's prompt-then-one-token calls,
// replayed through the reference with the earlier tokens as keys, give the same y and counts;
// and self-consistency checks that can fail: a row whose bias is all -inf outputs zeros, a
// broadcast bias equals its explicit repeat, a -inf column equals key padding, the bias is added
// after the 1/sqrt(d) scaling, MoA's query padding leaves the other tokens alone, the dense MoH
// variant with zero router weights is MHA, MoH-ViT's probability rows sum to 1 or are zero, and
// JetMoE with one kv head, no RoPE, no bias and softmax-then-top-k gates is fairseq MoA.
#include "reference/naive_families.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "moh/io/safetensors.hpp"
#include "test_helpers.hpp"

namespace {

using moh_ref::AttnBias;
using moh_ref::FamilyInput;
using moh_ref::Mat;
using moh_ref::PadMask;
using moh_ref::Vec;

const std::vector<std::string> kFamilyCases = {
    "jetmoe_decode",  "jetmoe_prefill",      "mha_attn_bias",
    "moa_cross_kdim", "moa_query_padding",   "moh_cross_memory",
    "moh_dense",      "moh_qknorm_nobias",   "moh_vit_basic",
};

std::string families_dir() { return moh_test::fixtures_dir() + "/families"; }

// ---- reading a case -----------------------------------------------------------------------------

/// A golden case with bookkeeping of which tensors and metadata keys the runner used.
class Case {
 public:
  explicit Case(const std::string& path) : st_(moh::SafeTensors::open(path)) {}

  bool has(const std::string& name) const { return st_.contains(name); }
  std::vector<std::int64_t> shape(const std::string& name) const { return st_.info(name).shape; }
  std::vector<double> values(const std::string& name) {
    used_.insert(name);
    return st_.values<double>(name);
  }
  /// A tensor as a matrix of its last dimension's columns, all others flattened into rows.
  Mat mat(const std::string& name) {
    const std::vector<std::int64_t> s = shape(name);
    const std::vector<double> v = values(name);
    const std::int64_t cols = s.empty() ? 1 : s.back();
    const std::int64_t rows = cols ? static_cast<std::int64_t>(v.size()) / cols : 0;
    Mat m(rows, cols);
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t c = 0; c < cols; ++c) m(r, c) = v[r * cols + c];
    return m;
  }
  /// A [rows, cols] tensor, its shape checked.
  Mat mat(const std::string& name, std::int64_t rows, std::int64_t cols) {
    EXPECT_EQ(shape(name), (std::vector<std::int64_t>{rows, cols})) << name;
    return mat(name);
  }
  Vec vec(const std::string& name) {
    const std::vector<double> v = values(name);
    Vec out(static_cast<Eigen::Index>(v.size()));
    for (std::size_t i = 0; i < v.size(); ++i) out(i) = v[i];
    return out;
  }
  Vec vec_or_empty(const std::string& name) { return has(name) ? vec(name) : Vec(); }
  Mat mat_or_empty(const std::string& name) { return has(name) ? mat(name) : Mat(); }
  /// [E, r, c] as E matrices [r, c].
  std::vector<Mat> mats3(const std::string& name) {
    const std::vector<std::int64_t> s = shape(name);
    EXPECT_EQ(s.size(), 3u) << name;
    const std::vector<double> v = values(name);
    std::vector<Mat> out;
    for (std::int64_t e = 0; e < s[0]; ++e) {
      Mat m(s[1], s[2]);
      for (std::int64_t r = 0; r < s[1]; ++r)
        for (std::int64_t c = 0; c < s[2]; ++c) m(r, c) = v[(e * s[1] + r) * s[2] + c];
      out.push_back(m);
    }
    return out;
  }
  PadMask mask(const std::string& name) {
    const std::vector<std::int64_t> s = shape(name);
    EXPECT_EQ(s.size(), 2u) << name;
    const std::vector<double> v = values(name);
    PadMask m(s[0], std::vector<bool>(s[1]));
    for (std::int64_t b = 0; b < s[0]; ++b)
      for (std::int64_t j = 0; j < s[1]; ++j) m[b][j] = v[b * s[1] + j] != 0.0;
    return m;
  }

  bool has_meta(const std::string& key) const { return st_.has_metadata(key); }
  std::string meta(const std::string& key) {
    used_meta_.insert(key);
    return st_.metadata_value(key);
  }
  int meta_int(const std::string& key) { return std::stoi(meta(key)); }
  int meta_int(const std::string& key, int fallback) {
    return has_meta(key) ? meta_int(key) : fallback;
  }
  double meta_double(const std::string& key) { return std::stod(meta(key)); }

  /// Tensors and metadata keys nobody read (expected tensors are read by the comparison).
  std::vector<std::string> unused() const {
    std::vector<std::string> out;
    for (const std::string& n : st_.names())
      if (!used_.count(n)) out.push_back("tensor " + n);
    for (const auto& kv : st_.metadata())
      if (!used_meta_.count(kv.first)) out.push_back("metadata " + kv.first);
    return out;
  }

 private:
  moh::SafeTensors st_;
  std::set<std::string> used_, used_meta_;
};

/// The call inputs of a case: x, memory, key padding, attention bias, query padding.
FamilyInput read_input(Case& c) {
  FamilyInput in;
  const std::vector<std::int64_t> xs = c.shape("x");
  EXPECT_EQ(xs.size(), 3u);
  in.B = static_cast<int>(xs[0]);
  in.T = static_cast<int>(xs[1]);
  in.x = c.mat("x");
  in.S = in.T;
  if (c.has("memory")) {
    const std::vector<std::int64_t> ms = c.shape("memory");
    EXPECT_EQ(ms.size(), 3u);
    EXPECT_EQ(ms[0], in.B);
    in.S = static_cast<int>(ms[1]);
    in.memory = c.mat("memory");
  }
  in.causal = c.meta_int("causal") != 0;
  if (c.has("key_padding_mask")) in.key_padding = c.mask("key_padding_mask");
  if (c.has("query_padding_mask")) in.query_padding = c.mask("query_padding_mask");
  if (c.has("attn_bias")) {
    const std::vector<std::int64_t> s = c.shape("attn_bias");
    EXPECT_EQ(s.size(), 4u);
    in.bias.B = static_cast<int>(s[0]);
    in.bias.H = static_cast<int>(s[1]);
    in.bias.T = static_cast<int>(s[2]);
    in.bias.S = static_cast<int>(s[3]);
    in.bias.values = c.values("attn_bias");
  }
  return in;
}

/// A [rows, cols] Mat as its row-major values.
std::vector<double> flat(const Mat& m) {
  std::vector<double> v;
  for (int r = 0; r < m.rows(); ++r)
    for (int c = 0; c < m.cols(); ++c) v.push_back(m(r, c));
  return v;
}
std::vector<double> flat(const std::vector<int>& counts) {
  return std::vector<double>(counts.begin(), counts.end());
}

/// FIXTURES' pass rule for one expected tensor: max|c - e| <= 1e-4 max(1, max|e|); for gates and
/// head masks, an expected 0 must be exactly 0.
void expect_matches(const std::string& what, const std::vector<double>& got,
                    const std::vector<double>& expected, bool exact_zeros = false) {
  ASSERT_EQ(got.size(), expected.size()) << what;
  double diff = 0.0, scale = 1.0;
  std::size_t worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double d = std::abs(got[i] - expected[i]);
    if (std::isnan(d) || d > diff) {
      diff = std::isnan(d) ? std::numeric_limits<double>::infinity() : d;
      worst = i;
    }
    scale = std::max(scale, std::abs(expected[i]));
    if (exact_zeros && expected[i] == 0.0) {
      EXPECT_EQ(got[i], 0.0) << what << "[" << i << "]: an unselected head must be exactly off";
    }
  }
  EXPECT_LE(diff, 1e-4 * scale) << what << ": max|c - e| = " << diff << " at " << worst
                                << " (c = " << got[worst] << ", e = " << expected[worst] << ")";
}

/// Computed tensors by their expected names.
using Outputs = std::map<std::string, std::vector<double>>;

/// Checks every expected tensor of the file against `out`; an expected tensor the reference did
/// not compute fails.
void check_expected(Case& c, const Outputs& out) {
  for (const char* name : {"y", "gates", "aux_loss", "expert_counts", "switch_loss", "z_loss",
                           "cv_loss", "head_mask"}) {
    if (!c.has(name)) continue;
    const auto it = out.find(name);
    if (it == out.end()) {
      ADD_FAILURE() << "expected tensor " << name << " is not computed by the reference";
      c.values(name);
      continue;
    }
    const std::string n = name;
    expect_matches(n, it->second, c.values(name), n == "gates" || n == "head_mask");
  }
}

// ---- the layers, from a case --------------------------------------------------------------------

moh_ref::MhaWeights read_mha(Case& c) {
  moh_ref::MhaWeights w;
  w.D = c.meta_int("embed_dim");
  w.H = c.meta_int("num_heads");
  w.d = c.meta_int("head_dim");
  w.Hkv = w.H;
  w.W_in = c.mat("in_proj_weight", 3 * w.H * w.d, w.D);
  w.b_in = c.vec("in_proj_bias");
  w.W_out = c.mat("out_proj.weight", w.D, w.H * w.d);
  w.b_out = c.vec("out_proj.bias");
  return w;
}

moh_ref::MoHFamilyWeights read_moh(Case& c) {
  moh_ref::MoHFamilyWeights w;
  moh_ref::MhaWeights& a = w.attn;
  a.D = c.meta_int("embed_dim");
  a.H = c.meta_int("num_heads");
  a.d = c.meta_int("head_dim");
  a.Hkv = a.H;
  w.shared = c.meta_int("shared_heads");
  w.routed_k = c.meta_int("active_routed_heads");
  const bool qkv_bias = c.meta_int("qkv_bias", 1) != 0;
  const bool qk_norm = c.meta_int("qk_norm", 0) != 0;
  a.W_in = c.mat("qkv.weight", 3 * a.H * a.d, a.D);
  EXPECT_EQ(c.has("qkv.bias"), qkv_bias) << "qkv.bias must be there exactly when qkv_bias";
  if (qkv_bias) a.b_in = c.vec("qkv.bias");
  a.W_out = c.mat("proj.weight", a.D, a.H * a.d);
  a.b_out = c.vec("proj.bias");
  const int E = a.H - w.shared;
  if (w.routed_k > 0) w.Wr = c.mat("wg.weight", E, a.D);
  if (w.shared > 1) w.Ws = c.mat("wg_1.weight", w.shared, a.D);
  if (w.shared > 0 && w.routed_k > 0) w.Wm = c.mat("wg_0.weight", 2, a.D);
  EXPECT_EQ(c.has("q_norm.weight"), qk_norm) << "q_norm must be there exactly when qk_norm";
  if (qk_norm) {
    w.norm.q_w = c.vec("q_norm.weight");
    w.norm.q_b = c.vec("q_norm.bias");
    w.norm.k_w = c.vec("k_norm.weight");
    w.norm.k_b = c.vec("k_norm.bias");
  }
  return w;
}

Outputs moh_outputs(const moh_ref::MoHFamilyResult& r) {
  return {{"y", flat(r.y)},
          {"gates", flat(r.gates.gates)},
          {"aux_loss", {r.gates.load_balance_loss}}};
}

moh_ref::MoHVitWeights read_moh_vit(Case& c, int* grid_h, int* grid_w) {
  moh_ref::MoHVitWeights w;
  w.moh = read_moh(c);
  const int H = w.moh.attn.H, d = w.moh.attn.d;
  EXPECT_EQ(H * d, w.moh.attn.D) << "docs/semantics.md §8: d = D / H";
  w.temperature = c.vec("temperature");
  EXPECT_EQ(c.shape("temperature"), (std::vector<std::int64_t>{H, 1, 1}));
  EXPECT_EQ(c.shape("query_embedding"), (std::vector<std::int64_t>{H, 1, d}));
  w.query_embedding = c.mat("query_embedding");
  w.cpb_fc1_w = c.mat("cpb_fc1.weight");
  EXPECT_EQ(w.cpb_fc1_w.cols(), 2);
  w.cpb_fc1_b = c.vec("cpb_fc1.bias");
  w.cpb_fc2_w = c.mat("cpb_fc2.weight", H, w.cpb_fc1_w.rows());
  w.cpb_fc2_b = c.vec("cpb_fc2.bias");
  w.pretrain_h = c.meta_int("pretrain_h");
  w.pretrain_w = c.meta_int("pretrain_w");
  w.train_tokens = c.meta_double("train_tokens");
  *grid_h = c.meta_int("grid_h");
  *grid_w = c.meta_int("grid_w");
  return w;
}

moh_ref::MoAWeights read_moa(Case& c, int D_kv) {
  moh_ref::MoAWeights w;
  w.D = c.meta_int("embed_dim");
  w.d = c.meta_int("head_dim");
  w.E = c.meta_int("num_experts");
  w.k = c.meta_int("top_k");
  EXPECT_EQ(c.shape("q_proj.experts.w"), (std::vector<std::int64_t>{w.E, w.D, w.d}));
  EXPECT_EQ(c.shape("q_proj.output_experts.w"), (std::vector<std::int64_t>{w.E, w.d, w.D}));
  w.Wq = c.mat("q_proj.experts.w");          // [E*D, d]
  w.Wo = c.mat("q_proj.output_experts.w");   // [E*d, D]
  w.Wg = c.mat("q_proj.w_gate", w.D, w.E);
  w.Wk = c.mat("k_proj.weight", w.d, D_kv);
  w.Wv = c.mat("v_proj.weight", w.d, D_kv);
  return w;
}

moh_ref::JetMoEWeights read_jetmoe(Case& c) {
  moh_ref::JetMoEWeights w;
  w.D = c.meta_int("embed_dim");
  w.d = c.meta_int("head_dim");
  w.Hkv = c.meta_int("num_kv_heads");
  w.E = c.meta_int("num_experts");
  w.k = c.meta_int("top_k");
  w.rope_theta = c.meta_double("rope_theta");
  const int hd = w.Hkv * w.d;
  EXPECT_EQ(c.shape("experts.input_linear.weight"), (std::vector<std::int64_t>{w.E, hd, w.D}));
  EXPECT_EQ(c.shape("experts.output_linear.weight"), (std::vector<std::int64_t>{w.E, w.D, hd}));
  w.W_in = c.mats3("experts.input_linear.weight");
  w.W_out = c.mats3("experts.output_linear.weight");
  w.W_r = c.mat("experts.router.layer.weight", w.E, w.D);
  w.b = c.vec("experts.bias");
  w.W_kv = c.mat("kv_proj.weight", 2 * hd, w.D);
  return w;
}

/// Runs the reference on a case and checks its expected tensors; returns nothing, fails on a
/// mismatch or on anything of the file left unread.
void run_family_case(const std::string& name) {
  const std::string path = families_dir() + "/" + name + ".safetensors";
  ASSERT_TRUE(std::filesystem::is_regular_file(path)) << "golden case missing: " << path;
  Case c(path);
  EXPECT_EQ(c.meta("format"), "moh-case/1");
  const std::string layer = c.meta("layer");
  FamilyInput in = read_input(c);
  Outputs out;
  if (layer == "mha") {
    const moh_ref::MhaWeights w = read_mha(c);
    out["y"] = flat(moh_ref::naive_mha_family(w, in).y);
  } else if (layer == "moh") {
    out = moh_outputs(moh_ref::naive_moh_family(read_moh(c), in));
  } else if (layer == "moh_vit") {
    int gh = 0, gw = 0;
    const moh_ref::MoHVitWeights w = read_moh_vit(c, &gh, &gw);
    out = moh_outputs(moh_ref::naive_moh_vit(w, in, gh, gw));
  } else if (layer == "moa") {
    const int D = c.meta_int("embed_dim");
    const int D_kv = c.meta_int("kdim", D);
    if (c.has_meta("kdim")) {
      EXPECT_FALSE(in.self()) << "kdim comes only with memory";
    }
    if (in.self()) {
      EXPECT_EQ(D_kv, D);
    }
    const moh_ref::MoAWeights w = read_moa(c, in.self() ? D : D_kv);
    const moh_ref::MoAFamilyResult r = moh_ref::naive_moa_family(w, in);
    out = {{"y", flat(r.y)},
           {"expert_counts", flat(r.route.counts)},
           {"switch_loss", {r.route.switch_loss}},
           {"z_loss", {r.route.z_loss}},
           {"cv_loss", {r.route.cv_loss}}};
  } else if (layer == "jetmoe") {
    const moh_ref::JetMoEWeights w = read_jetmoe(c);
    // decode_from: the prompt call and the one-token calls through the cache put together are
    // the full causal forward (checked by replaying them in JetMoEDecodeReplay below).
    if (c.has_meta("decode_from")) {
      const int P = c.meta_int("decode_from");
      EXPECT_TRUE(P >= 1 && P <= in.T) << "decode_from " << P << " for T = " << in.T;
      EXPECT_TRUE(in.causal) << "decode_from needs a causal case";
      EXPECT_FALSE(c.has("switch_loss") || c.has("z_loss"))
          << "FIXTURES: per-call losses are not stored with decode_from";
    }
    const moh_ref::MoAFamilyResult r = moh_ref::naive_jetmoe(w, in);
    out = {{"y", flat(r.y)},
           {"expert_counts", flat(r.route.counts)},
           {"switch_loss", {r.route.switch_loss}},
           {"z_loss", {r.route.z_loss}}};
  } else {
    FAIL() << "layer '" << layer << "' is not one of the families of docs/semantics.md §6-9";
  }
  check_expected(c, out);
  for (const std::string& u : c.unused()) ADD_FAILURE() << name << ": unused " << u;
}

class FamilyCase : public ::testing::TestWithParam<std::string> {};

TEST_P(FamilyCase, ReferenceMatchesTheGoldenCase) { run_family_case(GetParam()); }

INSTANTIATE_TEST_SUITE_P(NaiveFamilies, FamilyCase, ::testing::ValuesIn(kFamilyCases),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

TEST(NaiveFamilies, EveryCaseInTheFolderIsListed) {
  std::set<std::string> listed(kFamilyCases.begin(), kFamilyCases.end()), found;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(families_dir(), ec))
    if (e.path().extension() == ".safetensors") found.insert(e.path().stem().string());
  EXPECT_FALSE(ec) << families_dir();
  EXPECT_EQ(found, listed);
}

/// jetmoe_decode replayed as its calls: tokens 0..P-1 as one causal prompt, then each later
/// token t alone with tokens 0..t as its keys (positions 0..t, the query at position t): the
/// rows put together equal y, and the counts summed equal expert_counts.
TEST(NaiveFamilies, JetMoEDecodeReplay) {
  Case c(families_dir() + "/jetmoe_decode.safetensors");
  FamilyInput full = read_input(c);
  const moh_ref::JetMoEWeights w = read_jetmoe(c);
  const int P = c.meta_int("decode_from"), T = full.T, B = full.B;
  Mat y = Mat::Zero(full.x.rows(), w.D);
  std::vector<int> counts(w.E, 0);
  const auto add_counts = [&](const moh_ref::MoAFamilyResult& r) {
    for (int e = 0; e < w.E; ++e) counts[e] += r.route.counts[e];
  };
  for (int b = 0; b < B; ++b) {
    FamilyInput prompt;
    prompt.B = 1;
    prompt.T = P;
    prompt.causal = true;
    prompt.x = full.x.middleRows(b * T, P);
    const moh_ref::MoAFamilyResult r = moh_ref::naive_jetmoe(w, prompt);
    y.middleRows(b * T, P) = r.y;
    add_counts(r);
    for (int t = P; t < T; ++t) {
      FamilyInput step;
      step.B = 1;
      step.T = 1;
      step.x = full.x.middleRows(b * T + t, 1);
      step.memory = full.x.middleRows(b * T, t + 1);  // the cache: keys at positions 0..t
      step.S = t + 1;
      step.causal = true;
      step.position_offset = t;
      const moh_ref::MoAFamilyResult s = moh_ref::naive_jetmoe(w, step);
      y.row(b * T + t) = s.y.row(0);
      add_counts(s);
    }
  }
  expect_matches("y", flat(y), c.values("y"));
  expect_matches("expert_counts", flat(counts), c.values("expert_counts"));
}

// ---- self-consistency ---------------------------------------------------------------------------

Mat rnd(int rows, int cols, std::uint64_t seed, double scale = 1.0) {
  return moh_test::random_matrix<double>(rows, cols, seed, scale);
}
Vec rndv(int n, std::uint64_t seed) { return moh_test::random_vector<double>(n, seed); }

/// fairseq MoA weights of E experts of size d, top k, seeds seed .. seed + 4 (the router's scaled
/// by gate_scale).
moh_ref::MoAWeights random_moa(int D, int d, int E, int k, std::uint64_t seed,
                               double gate_scale = 1.0) {
  moh_ref::MoAWeights a;
  a.D = D;
  a.d = d;
  a.E = E;
  a.k = k;
  a.Wq = rnd(E * D, d, seed);
  a.Wo = rnd(E * d, D, seed + 1);
  a.Wg = rnd(D, E, seed + 2, gate_scale);
  a.Wk = rnd(d, D, seed + 3);
  a.Wv = rnd(d, D, seed + 4);
  return a;
}

moh_ref::MhaWeights random_mha(int D, int H, int d, std::uint64_t seed) {
  moh_ref::MhaWeights w;
  w.D = D;
  w.H = H;
  w.d = d;
  w.Hkv = H;
  w.W_in = rnd(3 * H * d, D, seed, 0.5);
  w.b_in = rndv(3 * H * d, seed + 1);
  w.W_out = rnd(D, H * d, seed + 2, 0.5);
  w.b_out = rndv(D, seed + 3);
  return w;
}

FamilyInput random_input(int B, int T, int D, std::uint64_t seed) {
  FamilyInput in;
  in.B = B;
  in.T = T;
  in.S = T;
  in.x = rnd(B * T, D, seed);
  return in;
}

AttnBias random_bias(int B, int H, int T, int S, std::uint64_t seed) {
  AttnBias m;
  m.B = B;
  m.H = H;
  m.T = T;
  m.S = S;
  const Mat v = rnd(B * H * T, S, seed);
  m.values = flat(v);
  return m;
}

double max_diff(const Mat& a, const Mat& b) { return moh_test::max_abs_diff(a, b); }

TEST(NaiveFamilies, BiasRowAllMinusInfOutputsZeros) {
  const int B = 2, T = 4, D = 12, H = 3, d = 4;
  const double ninf = -std::numeric_limits<double>::infinity();
  const moh_ref::MhaWeights w = random_mha(D, H, d, 11);
  FamilyInput in = random_input(B, T, D, 12);
  in.bias = random_bias(1, 1, T, T, 13);
  for (int s = 0; s < T; ++s) in.bias.values[1 * T + s] = ninf;  // query row 1: nothing
  in.bias.values[2 * T + 0] = ninf;                               // query row 2: key 0 only off
  const moh_ref::HeadsOut h = moh_ref::naive_heads_family(w, moh_ref::QkNorm(), in);
  const moh_ref::MhaFamilyResult r = moh_ref::naive_mha_family(w, in);
  for (int b = 0; b < B; ++b) {
    for (int c = 0; c < H * d; ++c) EXPECT_EQ(h.concat(b * T + 1, c), 0.0);
    for (int c = 0; c < D; ++c) EXPECT_EQ(r.y(b * T + 1, c), w.b_out(c));  // zeros, projected
    for (int hh = 0; hh < H; ++hh) {
      double sum2 = 0.0;
      for (int s = 0; s < T; ++s) {
        EXPECT_EQ(r.probs.at(b, hh, 1, s), 0.0);
        sum2 += r.probs.at(b, hh, 2, s);
      }
      EXPECT_EQ(r.probs.at(b, hh, 2, 0), 0.0);
      EXPECT_NEAR(sum2, 1.0, 1e-12);
    }
  }
  // The same with a causal mask: row 0 sees only key 0; -inf on it leaves nothing.
  FamilyInput causal = random_input(B, T, D, 14);
  causal.causal = true;
  causal.bias = random_bias(B, 1, T, T, 15);
  causal.bias.values[(1 * T + 0) * T + 0] = ninf;  // batch 1, query 0, key 0
  const moh_ref::MhaFamilyResult rc = moh_ref::naive_mha_family(w, causal);
  for (int c = 0; c < D; ++c) EXPECT_EQ(rc.y(1 * T + 0, c), w.b_out(c));
  EXPECT_GT(std::abs(rc.y(0, 0) - w.b_out(0)), 0.0);  // batch 0's row 0 still attends
  // MoA (head dimension 1): the row's output is exactly 0.
  const moh_ref::MoAWeights a = random_moa(D, d, 3, 2, 16);
  const moh_ref::MoAFamilyResult ra = moh_ref::naive_moa_family(a, in);
  for (int b = 0; b < B; ++b)
    for (int c = 0; c < D; ++c) EXPECT_EQ(ra.y(b * T + 1, c), 0.0);
  EXPECT_GT(ra.y.row(2).norm(), 0.0);
}

TEST(NaiveFamilies, BroadcastBiasEqualsItsExplicitRepeat) {
  const int B = 2, T = 3, S = 5, D = 16, H = 4, d = 4;
  const moh_ref::MhaWeights w = random_mha(D, H, d, 21);
  FamilyInput in = random_input(B, T, D, 22);
  in.memory = rnd(B * S, D, 23);
  in.S = S;
  in.causal = true;
  in.key_padding = PadMask{{false, true, false, false, false}, {false, false, false, false, true}};
  for (const std::pair<int, int>& shape : {std::pair<int, int>{1, 1}, {B, 1}, {1, H}}) {
    FamilyInput small = in, full = in;
    small.bias = random_bias(shape.first, shape.second, T, S, 24);
    full.bias = random_bias(B, H, T, S, 0);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < H; ++h)
        for (int t = 0; t < T; ++t)
          for (int s = 0; s < S; ++s)
            full.bias.values[((b * H + h) * T + t) * S + s] = small.bias.at(b, h, t, s);
    const moh_ref::MhaFamilyResult rs = moh_ref::naive_mha_family(w, small);
    const moh_ref::MhaFamilyResult rf = moh_ref::naive_mha_family(w, full);
    EXPECT_EQ(max_diff(rs.y, rf.y), 0.0) << shape.first << "x" << shape.second;
    EXPECT_EQ(rs.probs.values, rf.probs.values);
    // And it changes something: the bias is really added.
    EXPECT_GT(max_diff(rs.y, moh_ref::naive_mha_family(w, in).y), 1e-6);
    // MoH too (routed heads, so some heads are off).
    moh_ref::MoHFamilyWeights m;
    m.attn = w;
    m.shared = 1;
    m.routed_k = 2;
    m.Wr = rnd(H - 1, D, 25);
    m.Wm = rnd(2, D, 26);
    EXPECT_EQ(max_diff(moh_ref::naive_moh_family(m, small).y, moh_ref::naive_moh_family(m, full).y),
              0.0);
  }
}

TEST(NaiveFamilies, MinusInfBiasColumnEqualsKeyPadding) {
  const int B = 2, T = 4, D = 12, H = 3, d = 4;
  const moh_ref::MhaWeights w = random_mha(D, H, d, 31);
  FamilyInput padded = random_input(B, T, D, 32);
  padded.key_padding = PadMask{{false, false, true, false}, {true, false, false, false}};
  FamilyInput biased = padded;
  biased.key_padding.clear();
  biased.bias = random_bias(B, 1, T, T, 0);
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t)
      for (int s = 0; s < T; ++s)
        biased.bias.values[(b * T + t) * T + s] =
            padded.key_padding[b][s] ? -std::numeric_limits<double>::infinity() : 0.0;
  const Mat a = moh_ref::naive_mha_family(w, padded).y, b = moh_ref::naive_mha_family(w, biased).y;
  EXPECT_LE(max_diff(a, b), 1e-14);
  EXPECT_GT(max_diff(a, moh_ref::naive_mha_family(w, random_input(B, T, D, 32)).y), 1e-6);
}

TEST(NaiveFamilies, BiasIsAddedAfterTheScaling) {
  // One head: a bias of ln 2 on key 0 exactly doubles its odds against any other key.
  const int T = 2, S = 3, d = 4;
  const Mat q = rnd(T, d, 41), k = rnd(S, d, 42), v = rnd(S, d, 43);
  Mat bias = Mat::Zero(T, S);
  bias(0, 0) = bias(1, 0) = std::log(2.0);
  const moh_ref::HeadOut plain = moh_ref::naive_biased_attention(q, k, v, false, {}, Mat());
  const moh_ref::HeadOut biased = moh_ref::naive_biased_attention(q, k, v, false, {}, bias);
  for (int t = 0; t < T; ++t)
    for (int s = 1; s < S; ++s)
      EXPECT_NEAR(biased.probs(t, 0) / biased.probs(t, s),
                  2.0 * plain.probs(t, 0) / plain.probs(t, s), 1e-12);
  // A constant per row changes nothing (softmax invariance).
  Mat shift = Mat::Constant(T, S, 3.5);
  EXPECT_LE(max_diff(moh_ref::naive_biased_attention(q, k, v, false, {}, shift).out, plain.out),
            1e-14);
}

TEST(NaiveFamilies, MoAQueryPaddingLeavesTheOtherTokensAlone) {
  const int B = 2, T = 5, D = 12, d = 4;
  const moh_ref::MoAWeights a = random_moa(D, d, 4, 2, 51, 2.0);
  FamilyInput in = random_input(B, T, D, 56);
  FamilyInput padded = in;
  padded.query_padding = PadMask{{false, true, false, false, true}, {true, false, false, false, false}};
  const moh_ref::MoAFamilyResult r = moh_ref::naive_moa_family(a, in);
  const moh_ref::MoAFamilyResult p = moh_ref::naive_moa_family(a, padded);
  std::vector<int> counts(a.E, 0);
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t) {
      const int n = b * T + t;
      if (padded.query_padding[b][t]) {
        EXPECT_EQ(p.y.row(n).norm(), 0.0);
        EXPECT_TRUE(p.route.selected[n].empty());
      } else {
        EXPECT_EQ(max_diff(p.y.row(n), r.y.row(n)), 0.0);  // keys still come from every token
        for (int e : r.route.selected[n]) ++counts[e];
      }
    }
  EXPECT_EQ(p.route.counts, counts);
  EXPECT_NEAR(p.route.z_loss, r.route.z_loss, 1e-14);  // over all N either way
  EXPECT_NE(p.route.switch_loss, r.route.switch_loss);
  EXPECT_NE(p.route.cv_loss, r.route.cv_loss);
}

TEST(NaiveFamilies, DenseMoHWithZeroRouterIsMHA) {
  const int B = 2, T = 4, D = 12, H = 3, d = 5;  // d != D / H on purpose
  moh_ref::MoHFamilyWeights m;
  m.attn = random_mha(D, H, d, 61);
  m.shared = H;
  m.routed_k = 0;
  m.Ws = Mat::Zero(H, D);
  FamilyInput in = random_input(B, T, D, 62);
  in.causal = true;
  in.bias = random_bias(B, H, T, T, 63);
  const moh_ref::MoHFamilyResult r = moh_ref::naive_moh_family(m, in);
  EXPECT_LE(max_diff(r.gates.gates, Mat::Ones(B * T, H)), 1e-15);
  EXPECT_EQ(r.gates.load_balance_loss, 0.0);
  EXPECT_LE(max_diff(r.y, moh_ref::naive_mha_family(m.attn, in).y), 1e-13);
  // A non-zero W_s weights the heads: no longer MHA.
  m.Ws = rnd(H, D, 64);
  EXPECT_GT(max_diff(moh_ref::naive_moh_family(m, in).y, moh_ref::naive_mha_family(m.attn, in).y),
            1e-6);
}

TEST(NaiveFamilies, MoHVitProbabilityRowsSumToOneOrAreOff) {
  Case c(families_dir() + "/moh_vit_basic.safetensors");
  FamilyInput in = read_input(c);
  int gh = 0, gw = 0;
  const moh_ref::MoHVitWeights w = read_moh_vit(c, &gh, &gw);
  const moh_ref::MoHFamilyResult r = moh_ref::naive_moh_vit(w, in, gh, gw);
  const moh_ref::Probs& p = r.probs;
  for (int b = 0; b < p.B; ++b)
    for (int h = 0; h < p.H; ++h)
      for (int t = 0; t < p.T; ++t) {
        double sum = 0.0;
        for (int s = 0; s < p.S; ++s) sum += p.at(b, h, t, s);
        EXPECT_NEAR(sum, r.gates.active[b * in.T + t][h] ? 1.0 : 0.0, 1e-12);
      }
  // The position bias depends on i - j only: P[i, i] is the same for every i.
  const std::vector<Mat> P = moh_ref::naive_cpb_bias(w, gh, gw);
  for (int i = 1; i < gh * gw; ++i) EXPECT_EQ(P[0](i, i), P[0](0, 0));
}

TEST(NaiveFamilies, JetMoEWithOneKvHeadIsFairseqMoA) {
  const int B = 2, T = 5, D = 12, d = 4, E = 4, k = 2;
  moh_ref::JetMoEWeights j;
  j.D = D;
  j.d = d;
  j.Hkv = 1;
  j.E = E;
  j.k = k;
  j.rope = false;
  j.topk_softmax = false;
  for (int e = 0; e < E; ++e) {
    j.W_in.push_back(rnd(d, D, 70 + e));
    j.W_out.push_back(rnd(D, d, 80 + e));
  }
  j.W_r = rnd(E, D, 90, 2.0);
  j.W_kv = rnd(2 * d, D, 91);
  moh_ref::MoAWeights a;
  a.D = D;
  a.d = d;
  a.E = E;
  a.k = k;
  a.Wq = Mat(E * D, d);
  a.Wo = Mat(E * d, D);
  for (int e = 0; e < E; ++e) {
    a.Wq.middleRows(e * D, D) = j.W_in[e].transpose();   // W_q^e = W_in^{eT}
    a.Wo.middleRows(e * d, d) = j.W_out[e].transpose();  // W_o^e = W_out^{eT}
  }
  a.Wg = j.W_r.transpose();
  a.Wk = j.W_kv.topRows(d);
  a.Wv = j.W_kv.bottomRows(d);
  for (bool causal : {false, true}) {
    FamilyInput in = random_input(B, T, D, 92);
    in.causal = causal;
    in.key_padding = PadMask{{false, false, true, false, false}, {false, false, false, false, true}};
    in.bias = random_bias(B, 1, T, T, 93);
    const moh_ref::MoAFamilyResult rj = moh_ref::naive_jetmoe(j, in);
    const moh_ref::MoAFamilyResult ra = moh_ref::naive_moa_family(a, in);
    EXPECT_LE(max_diff(rj.y, ra.y), 1e-13);
    EXPECT_EQ(rj.route.counts, ra.route.counts);
    EXPECT_NEAR(rj.route.switch_loss, ra.route.switch_loss, 1e-13);
    EXPECT_NEAR(rj.route.z_loss, ra.route.z_loss, 1e-13);
    // JetMoE's own gates (softmax over the k logits) differ, and so does y.
    moh_ref::JetMoEWeights jk = j;
    jk.topk_softmax = true;
    const moh_ref::MoAFamilyResult rk = moh_ref::naive_jetmoe(jk, in);
    EXPECT_GT(max_diff(rk.y, ra.y), 1e-6);
    EXPECT_EQ(rk.route.counts, ra.route.counts);  // same experts chosen
  }
}

}  // namespace
