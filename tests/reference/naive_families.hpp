// Naive double-precision references for docs/semantics.md §6-9 (the layer families and
// options beyond §1-5), written from docs/semantics.md alone, in the style of naive.hpp:
// plain loops over plain matrices, every product an explicit loop, no library layer, kernel or op.
//
//   §6         additive attention bias M [B|1, H|1, T, S]          AttnBias, attend_scores()
//   §7         MoH module options: qkv_bias, qk_norm, dense S_h=H  naive_moh_family()
//   §8         MoH-ViT cosine attention with a continuous bias     naive_moh_vit(), naive_cpb_bias()
//   §9         MoA query padding, kdim cross-attention, cv-loss    naive_moa_family()
//              JetMoE multi-head experts                          naive_jetmoe()
//   and the attention probabilities of MHA                         naive_mha_family()
//
// Conventions (as in naive.hpp): a [B, T, F] activation is a Mat of B*T rows (row b*T + t); a
// weight is a Mat in its PyTorch layout; an absent bias is an empty Vec; a padding mask is a
// PadMask [B][S] (empty = none). Every layer here takes its call inputs in one FamilyInput.
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "reference/naive.hpp"

namespace moh_ref {

// ------------------------------------------------------------------------------------------------
// Call inputs and outputs shared by the families
// ------------------------------------------------------------------------------------------------

/// docs/semantics.md §6: an additive bias M [Bm, Hm, T, S], row-major in `values`, with
/// Bm in {1, B} and Hm in {1, H}: a dimension of size 1 is broadcast. -inf means "masked".
/// Empty = no bias.
struct AttnBias {
  int B = 0, H = 0, T = 0, S = 0;
  std::vector<double> values;  // B*H*T*S entries, row-major

  bool empty() const { return values.empty(); }
  /// M[b, h, t, s] with broadcasting over a dimension of size 1.
  double at(int b, int h, int t, int s) const {
    const int bb = B == 1 ? 0 : b, hh = H == 1 ? 0 : h;
    return values[((static_cast<std::size_t>(bb) * H + hh) * T + t) * S + s];
  }
};

/// Attention probabilities [B, H, T, S] (row-major in `values`); for MoH a head a token does
/// not use has a zero row.
struct Probs {
  int B = 0, H = 0, T = 0, S = 0;
  std::vector<double> values;

  Probs() = default;
  Probs(int b, int h, int t, int s)
      : B(b), H(h), T(t), S(s), values(static_cast<std::size_t>(b) * h * t * s, 0.0) {}
  double& at(int b, int h, int t, int s) {
    return values[((static_cast<std::size_t>(b) * H + h) * T + t) * S + s];
  }
  double at(int b, int h, int t, int s) const {
    return values[((static_cast<std::size_t>(b) * H + h) * T + t) * S + s];
  }
};

/// One call of a layer: queries (and routing) from x, keys and values from x (self-attention,
/// S = T) or from `memory` (cross-attention).
struct FamilyInput {
  int B = 0, T = 0;
  Mat x;                    // [B*T, D]
  Mat memory;               // [B*S, D_kv]; 0 rows = self-attention
  int S = 0;                // memory tokens per batch entry (ignored for self-attention)
  bool causal = false;      // docs/semantics.md §1: key j masked for query i when j > i + (S - T)
  PadMask key_padding;      // [B][S], true = padding key; empty = none
  AttnBias bias;            // docs/semantics.md §6; empty = none
  PadMask query_padding;    // [B][T], true = padding query (MoA, docs/semantics.md §9); empty: none
  int position_offset = 0;  // RoPE position of query 0, and of key 0 in self-attention

  bool self() const { return memory.rows() == 0; }
  int keys() const { return self() ? T : S; }
  const Mat& kv_input() const { return self() ? x : memory; }
  std::vector<bool> key_pad(int b) const {
    return key_padding.empty() ? std::vector<bool>() : key_padding[b];
  }
};

/// Throws std::invalid_argument with `what` unless `ok` (a reference misused by its caller).
inline void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("moh_ref: " + what);
}

/// Checks the bias against a call with `H` heads (1 for MoA): Bm in {1, B}, Hm in {1, H},
/// [T, S] exactly, every entry finite or -inf.
inline void check_bias(const FamilyInput& in, int H) {
  if (in.bias.empty()) return;
  const AttnBias& m = in.bias;
  require(m.B == 1 || m.B == in.B, "attn_bias batch must be 1 or B");
  require(m.H == 1 || m.H == H, "attn_bias head dimension must be 1 or H");
  require(m.T == in.T && m.S == in.keys(), "attn_bias must be [., ., T, S]");
  require(m.values.size() == static_cast<std::size_t>(m.B) * m.H * m.T * m.S,
          "attn_bias values must have B*H*T*S entries");
  for (double v : m.values)
    require(!std::isnan(v) && v != std::numeric_limits<double>::infinity(),
            "attn_bias entries are finite or -inf");
}

// ------------------------------------------------------------------------------------------------
// docs/semantics.md §1 + §6: one head's softmax over given scores
// ------------------------------------------------------------------------------------------------

/// What one head computed: o [T, dv] and A [T, S].
struct HeadOut {
  Mat out, probs;
};

/// One head from its already-scaled scores [T, S] (q k^T / sqrt(d) for dot-product attention):
/// adds `bias(t, s)` (docs/semantics.md §6; `bias` may be null = none) after the scaling, drops
/// keys masked by causality (j > i + (S - T)) or padding (`pad` [S] or empty), softmaxes each row
/// stably over the keys whose score is finite, and returns A and A v. A row with no finite
/// score is zeros in both A and o (docs/semantics.md §1 and §6).
template <class BiasFn>
HeadOut attend_scores(const Mat& scores, const Mat& v, bool causal, const std::vector<bool>& pad,
                      const BiasFn* bias) {
  const int T = static_cast<int>(scores.rows()), S = static_cast<int>(scores.cols());
  const double ninf = -std::numeric_limits<double>::infinity();
  HeadOut r;
  r.out = Mat::Zero(T, v.cols());
  r.probs = Mat::Zero(T, S);
  for (int i = 0; i < T; ++i) {
    std::vector<double> s(S, ninf);
    double mx = ninf;
    for (int j = 0; j < S; ++j) {
      if (causal && j > i + (S - T)) continue;
      if (!pad.empty() && pad[j]) continue;
      s[j] = scores(i, j) + (bias ? (*bias)(i, j) : 0.0);
      if (std::isfinite(s[j])) mx = std::max(mx, s[j]);
    }
    if (mx == ninf) continue;  // no finite score: zeros, never NaN
    double sum = 0.0;
    for (int j = 0; j < S; ++j) {
      s[j] = std::isfinite(s[j]) ? std::exp(s[j] - mx) : 0.0;
      sum += s[j];
    }
    for (int j = 0; j < S; ++j) {
      r.probs(i, j) = s[j] / sum;
      for (int c = 0; c < v.cols(); ++c) r.out(i, c) += r.probs(i, j) * v(j, c);
    }
  }
  return r;
}

/// Scaled dot-product scores q k^T * scale, [T, S].
inline Mat dot_scores(const Mat& q, const Mat& k, double scale) {
  Mat s(q.rows(), k.rows());
  for (int i = 0; i < q.rows(); ++i)
    for (int j = 0; j < k.rows(); ++j) {
      double dot = 0.0;
      for (int c = 0; c < q.cols(); ++c) dot += q(i, c) * k(j, c);
      s(i, j) = dot * scale;
    }
  return s;
}

/// docs/semantics.md §1 + §6 for one head of dot-product attention: q [T, d], k [S, d], v [S, dv],
/// scale 1/sqrt(d); `bias` [T, S] (0x0 = none) added after the scaling.
inline HeadOut naive_biased_attention(const Mat& q, const Mat& k, const Mat& v, bool causal,
                                      const std::vector<bool>& pad, const Mat& bias) {
  const auto fn = [&](int i, int j) { return bias(i, j); };
  return attend_scores(dot_scores(q, k, 1.0 / std::sqrt(static_cast<double>(q.cols()))), v, causal,
                       pad, bias.size() ? &fn : nullptr);
}

/// The [T, S] slice M[b, h] of the call's bias (broadcast), or a 0x0 matrix without one.
inline Mat bias_slice(const FamilyInput& in, int b, int h) {
  if (in.bias.empty()) return Mat();
  Mat m(in.T, in.keys());
  for (int t = 0; t < in.T; ++t)
    for (int s = 0; s < in.keys(); ++s) m(t, s) = in.bias.at(b, h, t, s);
  return m;
}

/// LayerNorm over one row of size d (biased variance, eps), affine with w, b [d].
inline void layer_norm_row(double* x, int d, const Vec& w, const Vec& b, double eps = 1e-5) {
  double mean = 0.0;
  for (int c = 0; c < d; ++c) mean += x[c];
  mean /= d;
  double var = 0.0;
  for (int c = 0; c < d; ++c) var += (x[c] - mean) * (x[c] - mean);
  var /= d;
  const double inv = 1.0 / std::sqrt(var + eps);
  for (int c = 0; c < d; ++c) x[c] = (x[c] - mean) * inv * w(c) + b(c);
}

// ------------------------------------------------------------------------------------------------
// docs/semantics.md §2 + §6 (+ §7's qk_norm): heads of MHA/MoH with a bias and their probabilities
// ------------------------------------------------------------------------------------------------

/// docs/semantics.md §7 `qk_norm`: LayerNorm(d) (eps 1e-5) on every query and key head row, q_norm
/// for queries and k_norm for keys, shared by all heads. Empty vectors = off.
struct QkNorm {
  Vec q_w, q_b, k_w, k_b;  // [d] each
  bool on() const { return q_w.size() != 0; }
};

/// What the heads of an MHA-style layer computed for one call.
struct HeadsOut {
  Mat concat;   // [B*T, H d]: concat_h o_h, before gating and the output projection
  Probs probs;  // [B, H, T, S]
};

/// Per-head attention of MHA/MoH (docs/semantics.md §1, §2, §6, §7):
/// Q, K, V = Linear(.; W_in, b_in) (b_in empty = qkv_bias off), keys/values from in.kv_input();
/// GQA head h -> kv head h / (H / Hkv); optional qk_norm after the split into heads and before
/// RoPE and the scores; optional RoPE (queries at offset + t, keys at offset + s in
/// self-attention, s in cross-attention); scores scaled by 1/sqrt(d), plus in.bias[b, h], causal
/// and key padding. `active` [B*T][H] (empty = every head) marks which (token, head) pairs are
/// computed: an inactive one gets a zero o row and a zero probability row.
inline HeadsOut naive_heads_family(const MhaWeights& w, const QkNorm& norm, const FamilyInput& in,
                                   const std::vector<std::vector<bool>>& active = {}) {
  const int H = w.H, d = w.d, Hkv = w.Hkv ? w.Hkv : w.H, B = in.B, T = in.T, S = in.keys();
  require(H % Hkv == 0, "H must be a multiple of Hkv");
  check_bias(in, H);
  const Mat Q = linear(in.x, rows_of(w.W_in, 0, H * d), segment_of(w.b_in, 0, H * d));
  const Mat& Xkv = in.kv_input();
  const Mat K = linear(Xkv, rows_of(w.W_in, H * d, Hkv * d), segment_of(w.b_in, H * d, Hkv * d));
  const Mat V = linear(Xkv, rows_of(w.W_in, (H + Hkv) * d, Hkv * d),
                       segment_of(w.b_in, (H + Hkv) * d, Hkv * d));
  HeadsOut r;
  r.concat = Mat::Zero(static_cast<Eigen::Index>(B) * T, H * d);
  r.probs = Probs(B, H, T, S);
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      const int g = h / (H / Hkv);
      Mat q, k, v;
      head_slices(Q, K, V, b, h, g, T, S, d, q, k, v);
      for (int t = 0; t < T; ++t) {
        std::vector<double> rq = row(q, t);
        if (norm.on()) layer_norm_row(rq.data(), d, norm.q_w, norm.q_b);
        if (w.rope) rope(rq.data(), d, in.position_offset + t, w.rope_theta);
        for (int c = 0; c < d; ++c) q(t, c) = rq[c];
      }
      for (int s = 0; s < S; ++s) {
        std::vector<double> rk = row(k, s);
        if (norm.on()) layer_norm_row(rk.data(), d, norm.k_w, norm.k_b);
        if (w.rope) rope(rk.data(), d, (in.self() ? in.position_offset : 0) + s, w.rope_theta);
        for (int c = 0; c < d; ++c) k(s, c) = rk[c];
      }
      const HeadOut o = naive_biased_attention(q, k, v, in.causal, in.key_pad(b), bias_slice(in, b, h));
      for (int t = 0; t < T; ++t) {
        if (!active.empty() && !active[b * T + t][h]) continue;  // not computed: zeros
        for (int c = 0; c < d; ++c) r.concat(b * T + t, h * d + c) = o.out(t, c);
        for (int s = 0; s < S; ++s) r.probs.at(b, h, t, s) = o.probs(t, s);
      }
    }
  }
  return r;
}

/// MHA with everything of §1, §2 and §6.
struct MhaFamilyResult {
  Mat y;        // [B*T, D]
  Probs probs;  // [B, H, T, S]
};

/// docs/semantics.md §2 + §6: y = Linear(concat_h o_h; W_out, b_out) for self- or cross-attention
/// (per `in.memory`), with causal, key padding and the additive bias; also A per head.
inline MhaFamilyResult naive_mha_family(const MhaWeights& w, const FamilyInput& in) {
  HeadsOut h = naive_heads_family(w, QkNorm(), in);
  MhaFamilyResult r;
  r.y = linear(h.concat, w.W_out, w.b_out);
  r.probs = std::move(h.probs);
  return r;
}

// ------------------------------------------------------------------------------------------------
// docs/semantics.md §3 + §6 + §7: the authors' MoH module (ViT/DiT Attention)
// ------------------------------------------------------------------------------------------------

/// Weights of the MoH ViT/DiT attention (FIXTURES `moh`).
struct MoHFamilyWeights {
  MhaWeights attn;  // W_in = qkv.weight [3 H d, D], b_in = qkv.bias or empty (qkv_bias off),
                    // W_out = proj.weight [D, H d], b_out = proj.bias (always there)
  int shared = 0;   // S_h
  int routed_k = 0; // K
  Mat Wr;           // wg.weight   [H - S_h, D] (K > 0)
  Mat Ws;           // wg_1.weight [S_h, D]     (S_h > 1)
  Mat Wm;           // wg_0.weight [2, D]       (S_h > 0 and K > 0)
  QkNorm norm;      // qk_norm (§7), empty = off
};

/// What a MoH-family layer computed for one call.
struct MoHFamilyResult {
  Mat y;          // [B*T, D]
  MoHGates gates; // gates [B*T, H], probs [B*T, E], active, head counts, load_balance_loss (L_b)
  Probs probs;    // [B, H, T, S], zero rows for (token, head) pairs not active
};

/// docs/semantics.md §3 with §6 and §7: gates from the learned two-stage router on x (the dense
/// variant S_h = H, K = 0 gives g = H softmax(x W_s^T)), heads as naive_heads_family (qk_norm,
/// bias, causal, padding, cross-attention on in.memory),
/// y = Linear(concat_h g_h o_h; W_out, b_out).
inline MoHFamilyResult naive_moh_family(const MoHFamilyWeights& w, const FamilyInput& in) {
  const int H = w.attn.H;
  require(w.shared >= 0 && w.routed_k >= 0 && w.shared + w.routed_k >= 1 &&
              w.shared + w.routed_k <= H && (w.routed_k == 0 || w.shared < H),
          "MoH needs 0 <= S_h, 0 <= K, 1 <= S_h + K <= H");
  MoHFamilyResult r;
  r.gates = naive_moh_gates(in.x, H, w.shared, w.routed_k, w.Wr, w.Ws, w.Wm);
  HeadsOut h = naive_heads_family(w.attn, w.norm, in, r.gates.active);
  r.y = naive_gated_output(w.attn, r.gates.gates, h.concat);
  r.probs = std::move(h.probs);
  return r;
}

// ------------------------------------------------------------------------------------------------
// docs/semantics.md §8: MoH-ViT (TransNeXt's last-stage attention, routed as MoH)
// ------------------------------------------------------------------------------------------------

/// Weights and settings of a moh_vit layer (FIXTURES `moh_vit`); head size d = D / H.
struct MoHVitWeights {
  MoHFamilyWeights moh;   // qkv, proj, wg, wg_0, wg_1, optional qk_norm, S_h, K
  Vec temperature;        // [H]       (temperature [H, 1, 1])
  Mat query_embedding;    // [H, d]    (query_embedding [H, 1, d])
  Mat cpb_fc1_w;          // [hidden, 2] (hidden = 512)
  Vec cpb_fc1_b;          // [hidden]
  Mat cpb_fc2_w;          // [H, hidden]
  Vec cpb_fc2_b;          // [H]
  int pretrain_h = 0, pretrain_w = 0;  // (h_0, w_0), each >= 2
  double train_tokens = 0;             // N_0: lambda = ln(N_0)
};

/// The continuous position bias P [H][T*T] (row-major [i, j]) over an h x w grid in row-major
/// token order (docs/semantics.md §8): r = ((y_i - y_j) 8 / (h_0 - 1), (x_i - x_j) 8 / (w_0 - 1)),
/// c = sign(r) log2(|r| + 1) / log2(8), P[:, i, j] = W_2 relu(W_1 c + b_1) + b_2.
inline std::vector<Mat> naive_cpb_bias(const MoHVitWeights& w, int grid_h, int grid_w) {
  require(w.pretrain_h >= 2 && w.pretrain_w >= 2, "moh_vit pretrain grid sides must be >= 2");
  const int T = grid_h * grid_w, H = static_cast<int>(w.cpb_fc2_w.rows());
  const int hidden = static_cast<int>(w.cpb_fc1_w.rows());
  std::vector<Mat> P(H, Mat(T, T));
  const auto squash = [](double r) {
    const double sgn = r > 0 ? 1.0 : (r < 0 ? -1.0 : 0.0);
    return sgn * std::log2(std::abs(r) + 1.0) / std::log2(8.0);
  };
  for (int i = 0; i < T; ++i)
    for (int j = 0; j < T; ++j) {
      const int yi = i / grid_w, xi = i % grid_w, yj = j / grid_w, xj = j % grid_w;
      const double c0 = squash((yi - yj) * 8.0 / (w.pretrain_h - 1));
      const double c1 = squash((xi - xj) * 8.0 / (w.pretrain_w - 1));
      std::vector<double> hid(hidden);
      for (int u = 0; u < hidden; ++u)
        hid[u] = std::max(0.0, w.cpb_fc1_w(u, 0) * c0 + w.cpb_fc1_w(u, 1) * c1 + w.cpb_fc1_b(u));
      for (int h = 0; h < H; ++h) {
        double acc = w.cpb_fc2_b(h);
        for (int u = 0; u < hidden; ++u) acc += w.cpb_fc2_w(h, u) * hid[u];
        P[h](i, j) = acc;
      }
    }
  return P;
}

/// docs/semantics.md §8 (self-attention only, T = grid_h * grid_w): per head,
/// q^ = q / max(|q|, 1e-12), k^ likewise, s_ij = ((q^_i + e_h) softplus(tau_h) ln(N_0)) . k^_j +
/// P_h[i, j] (no 1/sqrt(d)), then in.bias (§6), causal and key padding as for every layer,
/// softmax, A v; gates and output projection as §3 (with §7's qkv_bias and qk_norm, the norm
/// applied to the head rows before the L2 normalisation). Probabilities: zero rows for inactive
/// heads.
inline MoHFamilyResult naive_moh_vit(const MoHVitWeights& w, const FamilyInput& in, int grid_h,
                                     int grid_w) {
  const MhaWeights& a = w.moh.attn;
  const int H = a.H, d = a.d, B = in.B, T = in.T;
  require(in.self(), "moh_vit is self-attention");
  require(T == grid_h * grid_w, "moh_vit needs T = grid_h * grid_w");
  require(a.Hkv == 0 || a.Hkv == H, "moh_vit has no GQA");
  check_bias(in, H);
  const double lambda = std::log(w.train_tokens);
  const std::vector<Mat> P = naive_cpb_bias(w, grid_h, grid_w);
  MoHFamilyResult r;
  r.gates = naive_moh_gates(in.x, H, w.moh.shared, w.moh.routed_k, w.moh.Wr, w.moh.Ws, w.moh.Wm);
  const Mat QKV = linear(in.x, a.W_in, a.b_in);  // [B*T, 3 H d]
  Mat concat = Mat::Zero(static_cast<Eigen::Index>(B) * T, H * d);
  r.probs = Probs(B, H, T, T);
  const auto l2_normalised = [](std::vector<double> v) {
    double sq = 0.0;
    for (double x : v) sq += x * x;
    const double n = std::max(std::sqrt(sq), 1e-12);
    for (double& x : v) x /= n;
    return v;
  };
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      const double softplus_tau = std::log1p(std::exp(w.temperature(h)));
      Mat q(T, d), k(T, d), v(T, d);
      for (int t = 0; t < T; ++t) {
        std::vector<double> rq(d), rk(d);
        for (int c = 0; c < d; ++c) {
          rq[c] = QKV(b * T + t, h * d + c);
          rk[c] = QKV(b * T + t, (H + h) * d + c);
          v(t, c) = QKV(b * T + t, (2 * H + h) * d + c);
        }
        if (w.moh.norm.on()) {
          layer_norm_row(rq.data(), d, w.moh.norm.q_w, w.moh.norm.q_b);
          layer_norm_row(rk.data(), d, w.moh.norm.k_w, w.moh.norm.k_b);
        }
        rq = l2_normalised(rq);
        rk = l2_normalised(rk);
        for (int c = 0; c < d; ++c) {
          q(t, c) = (rq[c] + w.query_embedding(h, c)) * softplus_tau * lambda;
          k(t, c) = rk[c];
        }
      }
      Mat scores = dot_scores(q, k, 1.0);
      for (int i = 0; i < T; ++i)
        for (int j = 0; j < T; ++j) scores(i, j) += P[h](i, j);
      const Mat m = bias_slice(in, b, h);
      const auto fn = [&](int i, int j) { return m(i, j); };
      const HeadOut o = attend_scores(scores, v, in.causal, in.key_pad(b), m.size() ? &fn : nullptr);
      for (int t = 0; t < T; ++t) {
        if (!r.gates.active[b * T + t][h]) continue;
        for (int c = 0; c < d; ++c) concat(b * T + t, h * d + c) = o.out(t, c);
        for (int s = 0; s < T; ++s) r.probs.at(b, h, t, s) = o.probs(t, s);
      }
    }
  r.y = naive_gated_output(a, r.gates.gates, concat);
  return r;
}

// ------------------------------------------------------------------------------------------------
// docs/semantics.md §5 + §9: MoA with query padding, kdim cross-attention, cv-loss, and the bias
// ------------------------------------------------------------------------------------------------

/// naive_moa_route() of naive.hpp, which takes §9's query padding (kept under this name
/// for the family tests).
inline MoARoute naive_moa_route_padded(const Mat& logits, int k, bool topk_softmax,
                                       const std::vector<bool>& query_pad) {
  require(k >= 1 && k <= static_cast<int>(logits.cols()), "MoA needs 1 <= k <= E");
  return naive_moa_route(logits, k, topk_softmax, query_pad);
}

/// The [B*T] flattening of a [B][T] mask (empty stays empty).
inline std::vector<bool> flatten(const PadMask& m) {
  std::vector<bool> out;
  for (const std::vector<bool>& r : m) out.insert(out.end(), r.begin(), r.end());
  return out;
}

/// Whether token n's slots include expert e.
inline bool selects(const MoARoute& r, int n, int e) {
  return std::find(r.selected[n].begin(), r.selected[n].end(), e) != r.selected[n].end();
}

/// What MoA or JetMoE computed for one call.
struct MoAFamilyResult {
  Mat y;           // [B*T, D]
  MoARoute route;  // logits, probs, gates, selected, counts, switch/z/cv losses
};

/// docs/semantics.md §5 + §6 + §9: fairseq MoA with `w` (Wk, Wv [d, D_kv]: D_kv = D for
/// self-attention, the memory's width for cross-attention), routing on x with in.query_padding,
/// keys/values from in.kv_input() computed once, per selected (token, expert): q_e = x W_q^e,
/// attention with causal, key padding and in.bias (head dimension 1), y = sum w_e o_e W_o^e; padded
/// queries output 0.
inline MoAFamilyResult naive_moa_family(const MoAWeights& w, const FamilyInput& in) {
  const int B = in.B, T = in.T, S = in.keys(), d = w.d;
  check_bias(in, 1);  // head dimension 1: one bias for every expert and slot
  require(w.Wk.cols() == in.kv_input().cols(), "MoA W_k must be [d, D_kv]");
  MoAFamilyResult r;
  r.route = naive_moa_route_padded(matmul(in.x, w.Wg), w.k, w.topk_softmax, flatten(in.query_padding));
  const Vec none;
  const Mat K = linear(in.kv_input(), w.Wk, none), V = linear(in.kv_input(), w.Wv, none);
  r.y = Mat::Zero(in.x.rows(), w.D);
  for (int b = 0; b < B; ++b)
    for (int e = 0; e < w.E; ++e) {
      // Every query of this batch entry through expert e; only the tokens that selected e use
      // their row.
      const Mat Qe = matmul(in.x.middleRows(b * T, T), w.Wq.middleRows(e * w.D, w.D));  // [T, d]
      const HeadOut o = naive_biased_attention(Qe, K.middleRows(b * S, S), V.middleRows(b * S, S),
                                               in.causal, in.key_pad(b), bias_slice(in, b, 0));
      const Mat Ye = matmul(o.out, w.Wo.middleRows(e * d, d));  // [T, D]
      for (int t = 0; t < T; ++t) {
        const int n = b * T + t;
        if (!selects(r.route, n, e)) continue;
        for (int c = 0; c < w.D; ++c) r.y(n, c) += r.route.gates(n, e) * Ye(t, c);
      }
    }
  return r;
}

// ------------------------------------------------------------------------------------------------
// docs/semantics.md §9: JetMoE multi-head experts
// ------------------------------------------------------------------------------------------------

/// Weights of a jetmoe layer (FIXTURES `jetmoe`).
struct JetMoEWeights {
  int D = 0, d = 0, Hkv = 0, E = 0, k = 0;
  std::vector<Mat> W_in;   // E of [Hkv d, D] (experts.input_linear.weight[e]), applied x W^T
  std::vector<Mat> W_out;  // E of [D, Hkv d] (experts.output_linear.weight[e]), applied o W^T
  Mat W_r;                 // [E, D] (experts.router.layer.weight)
  Vec b;                   // [D] (experts.bias) or empty = no bias
  Mat W_kv;                // [2 Hkv d, D] (kv_proj.weight): keys first, then values
  bool rope = true;
  double rope_theta = 10000.0;
  bool topk_softmax = true;  // JetMoE gates; false = §5's p_e of the top k (for tests)
};

/// docs/semantics.md §9 (JetMoE): l = x W_r^T, top k logits, gates softmax over those k; per slot
/// q = x W_in^{eT} split into Hkv heads, RoPE (base rope_theta) on every query and key head
/// (queries at offset + t, keys at offset + s in self-attention, s in cross-attention), query
/// head j attends with key/value head j (scale 1/sqrt(d), causal, key padding, in.bias with head
/// dimension 1 or Hkv), y = sum_s g_s (o_s W_out^{eT}) + b. The route's switch and z losses use
/// p = softmax(l) over all E. No query padding.
inline MoAFamilyResult naive_jetmoe(const JetMoEWeights& w, const FamilyInput& in) {
  const int B = in.B, T = in.T, S = in.keys(), d = w.d, Hkv = w.Hkv;
  require(in.query_padding.empty(), "jetmoe has no query padding");
  check_bias(in, Hkv);
  MoAFamilyResult r;
  const Vec none;
  r.route = naive_moa_route_padded(linear(in.x, w.W_r, none), w.k, w.topk_softmax, {});
  const Mat KV = linear(in.kv_input(), w.W_kv, none);  // [B*S, 2 Hkv d]
  r.y = Mat::Zero(in.x.rows(), w.D);
  for (int b = 0; b < B; ++b) {
    // Keys (after RoPE) and values of each kv head.
    std::vector<Mat> k(Hkv, Mat(S, d)), v(Hkv, Mat(S, d));
    for (int j = 0; j < Hkv; ++j)
      for (int s = 0; s < S; ++s) {
        std::vector<double> rk(d);
        for (int c = 0; c < d; ++c) {
          rk[c] = KV(b * S + s, j * d + c);
          v[j](s, c) = KV(b * S + s, (Hkv + j) * d + c);
        }
        if (w.rope) rope(rk.data(), d, (in.self() ? in.position_offset : 0) + s, w.rope_theta);
        for (int c = 0; c < d; ++c) k[j](s, c) = rk[c];
      }
    for (int e = 0; e < w.E; ++e) {
      // Every query of this batch entry through expert e; only selected slots are used.
      const Mat Qe = linear(in.x.middleRows(b * T, T), w.W_in[e], none);  // [T, Hkv d]
      Mat Oe(T, Hkv * d);
      for (int j = 0; j < Hkv; ++j) {
        Mat q(T, d);
        for (int t = 0; t < T; ++t) {
          std::vector<double> rq(d);
          for (int c = 0; c < d; ++c) rq[c] = Qe(t, j * d + c);
          if (w.rope) rope(rq.data(), d, in.position_offset + t, w.rope_theta);
          for (int c = 0; c < d; ++c) q(t, c) = rq[c];
        }
        const HeadOut o = naive_biased_attention(q, k[j], v[j], in.causal, in.key_pad(b),
                                                 bias_slice(in, b, j));
        for (int t = 0; t < T; ++t)
          for (int c = 0; c < d; ++c) Oe(t, j * d + c) = o.out(t, c);
      }
      const Mat Ye = linear(Oe, w.W_out[e], none);  // [T, D]
      for (int t = 0; t < T; ++t) {
        const int n = b * T + t;
        if (!selects(r.route, n, e)) continue;  // expert not in this token's slots
        for (int c = 0; c < w.D; ++c) r.y(n, c) += r.route.gates(n, e) * Ye(t, c);
      }
    }
  }
  if (w.b.size())
    for (int n = 0; n < r.y.rows(); ++n)
      for (int c = 0; c < w.D; ++c) r.y(n, c) += w.b(c);
  return r;
}

}  // namespace moh_ref
