// Naive double-precision references for the moh layers, written from docs/semantics.md alone.
//
// Plain loops over plain matrices, no tiling, no online softmax, no sparse paths: slow and
// obvious, so that a disagreement with the library points at the library. Every matrix is an
// Eigen::MatrixXd used only as storage (rows = tokens, columns = features); every product is an
// explicit loop. Sections of docs/semantics.md are cited where a formula is implemented.
//
// The last section bridges moh's types (float or double) to these references; it is the only
// part that knows about the library. Random inputs, comparisons and tolerances are the shared
// test helpers' (tests/test_helpers.hpp, namespace moh_test).
#pragma once

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "moh/tensor.hpp"
#include "test_helpers.hpp"

namespace moh_ref {

using Mat = Eigen::MatrixXd;  // [rows, cols], storage only
using Vec = Eigen::VectorXd;
using PadMask = std::vector<std::vector<bool>>;  // [B][S], true = padding; empty = no mask

// ------------------------------------------------------------------------------------------------
// Building blocks
// ------------------------------------------------------------------------------------------------

/// Linear(X; W, b) = X W^T + b. X [N, in], W [out, in], b [out] or empty (no bias).
inline Mat linear(const Mat& X, const Mat& W, const Vec& b) {
  Mat Y(X.rows(), W.rows());
  for (int n = 0; n < X.rows(); ++n)
    for (int o = 0; o < W.rows(); ++o) {
      double acc = b.size() ? b(o) : 0.0;
      for (int i = 0; i < X.cols(); ++i) acc += X(n, i) * W(o, i);
      Y(n, o) = acc;
    }
  return Y;
}

/// X W (no transpose). X [N, in], W [in, out].
inline Mat matmul(const Mat& X, const Mat& W) {
  Mat Y(X.rows(), W.cols());
  for (int n = 0; n < X.rows(); ++n)
    for (int o = 0; o < W.cols(); ++o) {
      double acc = 0.0;
      for (int i = 0; i < X.cols(); ++i) acc += X(n, i) * W(i, o);
      Y(n, o) = acc;
    }
  return Y;
}

/// Stable softmax of a short row: exp(v - max) / sum.
inline std::vector<double> softmax(const std::vector<double>& v) {
  double mx = -std::numeric_limits<double>::infinity();
  for (double x : v) mx = std::max(mx, x);
  std::vector<double> out(v.size());
  double sum = 0.0;
  for (std::size_t i = 0; i < v.size(); ++i) {
    out[i] = std::exp(v[i] - mx);
    sum += out[i];
  }
  for (double& x : out) x /= sum;
  return out;
}

/// log(sum exp(v)), stably.
inline double log_sum_exp(const std::vector<double>& v) {
  double mx = -std::numeric_limits<double>::infinity();
  for (double x : v) mx = std::max(mx, x);
  double sum = 0.0;
  for (double x : v) sum += std::exp(x - mx);
  return mx + std::log(sum);
}

/// Indices of the k largest entries of v, largest first; among equal values the lower index wins.
inline std::vector<int> top_k(const std::vector<double>& v, int k) {
  std::vector<bool> taken(v.size(), false);
  std::vector<int> out;
  for (int r = 0; r < k; ++r) {
    int best = -1;
    for (int i = 0; i < static_cast<int>(v.size()); ++i)
      if (!taken[i] && (best < 0 || v[i] > v[best])) best = i;  // strict: lower index on ties
    taken[best] = true;
    out.push_back(best);
  }
  return out;
}

/// Row r of M as a std::vector.
inline std::vector<double> row(const Mat& M, int r) {
  std::vector<double> v(M.cols());
  for (int c = 0; c < M.cols(); ++c) v[c] = M(r, c);
  return v;
}

/// RoPE (docs/semantics.md §4, rotate-half) of one head vector x[0, d) at position m, in place.
inline void rope(double* x, int d, double m, double base) {
  const int half = d / 2;
  for (int j = 0; j < half; ++j) {
    const double theta = std::pow(base, -2.0 * j / d);
    const double c = std::cos(m * theta), s = std::sin(m * theta);
    const double a = x[j], b = x[j + half];
    x[j] = a * c - b * s;
    x[j + half] = b * c + a * s;
  }
}

// ------------------------------------------------------------------------------------------------
// docs/semantics.md §1: one head of scaled dot-product attention
// ------------------------------------------------------------------------------------------------

/// q [T, d], k [S, d], v [S, d]; causal masks key j for query i when j > i + (S - T); `pad`
/// [S] (or empty), true = key never attended. A query with no visible key outputs zeros.
inline Mat naive_attention(const Mat& q, const Mat& k, const Mat& v, bool causal,
                           const std::vector<bool>& pad) {
  const int T = static_cast<int>(q.rows()), S = static_cast<int>(k.rows());
  const int d = static_cast<int>(q.cols());
  Mat o = Mat::Zero(T, v.cols());
  for (int i = 0; i < T; ++i) {
    std::vector<int> visible;
    for (int j = 0; j < S; ++j) {
      if (causal && j > i + (S - T)) continue;
      if (!pad.empty() && pad[j]) continue;
      visible.push_back(j);
    }
    if (visible.empty()) continue;  // zeros, never NaN
    std::vector<double> scores;
    for (int j : visible) {
      double dot = 0.0;
      for (int c = 0; c < d; ++c) dot += q(i, c) * k(j, c);
      scores.push_back(dot / std::sqrt(static_cast<double>(d)));
    }
    const std::vector<double> a = softmax(scores);
    for (std::size_t n = 0; n < visible.size(); ++n)
      for (int c = 0; c < v.cols(); ++c) o(i, c) += a[n] * v(visible[n], c);
  }
  return o;
}

/// Per-call attention options.
struct AttnOptions {
  bool causal = false;
  PadMask pad;              // [B][S] or empty
  int position_offset = 0;  // RoPE position of the first query (and first key in self-attention)
};

// ------------------------------------------------------------------------------------------------
// docs/semantics.md §2: dense multi-head attention (also the per-head outputs MoH gates)
// ------------------------------------------------------------------------------------------------

/// Query head h and key/value head g of sequence b: q [T, d] from Q [B*T, H d], k and v [S, d]
/// from K, V [B*S, H_kv d].
inline void head_slices(const Mat& Q, const Mat& K, const Mat& V, int b, int h, int g, int T,
                        int S, int d, Mat& q, Mat& k, Mat& v) {
  q.resize(T, d);
  k.resize(S, d);
  v.resize(S, d);
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < d; ++c) q(t, c) = Q(b * T + t, h * d + c);
  for (int s = 0; s < S; ++s)
    for (int c = 0; c < d; ++c) {
      k(s, c) = K(b * S + s, g * d + c);
      v(s, c) = V(b * S + s, g * d + c);
    }
}

/// Weights of MHA/MoH in PyTorch layout.
struct MhaWeights {
  int D = 0, H = 0, d = 0, Hkv = 0;
  Mat W_in;   // [(H + 2 Hkv) d, D]: query heads, key heads, value heads
  Vec b_in;   // [(H + 2 Hkv) d] or empty
  Mat W_out;  // [D, H d]
  Vec b_out;  // [D] or empty
  bool rope = false;
  double rope_theta = 10000.0;  // RoPE base (docs/semantics.md §4)
};

/// Rows [first, first + count) of W (and b) as a Linear of their own.
inline Mat rows_of(const Mat& W, int first, int count) { return W.middleRows(first, count); }
inline Vec segment_of(const Vec& b, int first, int count) {
  return b.size() ? Vec(b.segment(first, count)) : Vec();
}

/// Queries before RoPE: Q [N, H d] = Linear(X; W_q, b_q).
inline Mat naive_queries(const MhaWeights& w, const Mat& X) {
  return linear(X, rows_of(w.W_in, 0, w.H * w.d), segment_of(w.b_in, 0, w.H * w.d));
}

/// concat_h o_h, [B*T, H d], before the output projection. X [B*T, D] queries' input; Xkv
/// [B*S, D] keys' input (X itself for self-attention). RoPE positions: queries offset + t; keys
/// offset + s in self-attention, s in cross-attention.
inline Mat naive_mha_heads(const MhaWeights& w, const Mat& X, int B, int T, const Mat& Xkv, int S,
                           const AttnOptions& o, bool cross = false) {
  const int H = w.H, d = w.d, Hkv = w.Hkv;
  Mat Q = naive_queries(w, X);
  Mat K = linear(Xkv, rows_of(w.W_in, H * d, Hkv * d), segment_of(w.b_in, H * d, Hkv * d));
  Mat V = linear(Xkv, rows_of(w.W_in, (H + Hkv) * d, Hkv * d),
                 segment_of(w.b_in, (H + Hkv) * d, Hkv * d));
  Mat O = Mat::Zero(static_cast<Eigen::Index>(B) * T, H * d);
  for (int b = 0; b < B; ++b) {
    const std::vector<bool> pad = o.pad.empty() ? std::vector<bool>() : o.pad[b];
    for (int h = 0; h < H; ++h) {
      const int g = h / (H / Hkv);  // GQA: repeat_interleave
      Mat q, k, v;
      head_slices(Q, K, V, b, h, g, T, S, d, q, k, v);
      if (w.rope) {
        for (int t = 0; t < T; ++t) {
          std::vector<double> r = row(q, t);
          rope(r.data(), d, o.position_offset + t, w.rope_theta);
          for (int c = 0; c < d; ++c) q(t, c) = r[c];
        }
        for (int s = 0; s < S; ++s) {
          std::vector<double> r = row(k, s);
          rope(r.data(), d, (cross ? 0 : o.position_offset) + s, w.rope_theta);
          for (int c = 0; c < d; ++c) k(s, c) = r[c];
        }
      }
      const Mat oh = naive_attention(q, k, v, o.causal, pad);
      for (int t = 0; t < T; ++t)
        for (int c = 0; c < d; ++c) O(b * T + t, h * d + c) = oh(t, c);
    }
  }
  return O;
}

/// MHA self-attention (Xkv = X) or cross-attention: y [B*T, D].
inline Mat naive_mha(const MhaWeights& w, const Mat& X, int B, int T, const AttnOptions& o) {
  return linear(naive_mha_heads(w, X, B, T, X, T, o), w.W_out, w.b_out);
}
inline Mat naive_mha_cross(const MhaWeights& w, const Mat& X, int B, int T, const Mat& M, int S,
                           const AttnOptions& o) {
  return linear(naive_mha_heads(w, X, B, T, M, S, o, true), w.W_out, w.b_out);
}

// ------------------------------------------------------------------------------------------------
// docs/semantics.md §3 and §4: MoH routers and MoH attention
// ------------------------------------------------------------------------------------------------

/// What a MoH router decided for N tokens.
struct MoHGates {
  Mat gates;                             // [N, H], 0 for inactive heads
  Mat probs;                             // [N, E], p before top-K
  std::vector<std::vector<bool>> active;  // [N][H]
  std::vector<int> head_counts;          // [H]
  double load_balance_loss = 0.0;
};

/// A record for N tokens, H heads (E of them routed) with every gate and probability 0 and no
/// head active yet.
inline MoHGates no_gates(int N, int H, int E) {
  MoHGates g;
  g.gates = Mat::Zero(N, H);
  g.probs = Mat::Zero(N, E);
  g.active.assign(N, std::vector<bool>(H, false));
  return g;
}

/// L_b = E sum_i f_i P_i over the routed heads (docs/semantics.md §3), plus head counts.
inline void finish_gates(MoHGates& g, int H, int S) {
  const int N = static_cast<int>(g.active.size()), E = H - S;
  g.head_counts.assign(H, 0);
  for (int n = 0; n < N; ++n)
    for (int h = 0; h < H; ++h) g.head_counts[h] += g.active[n][h] ? 1 : 0;
  g.load_balance_loss = 0.0;
  if (N == 0 || E == 0) return;
  double sum = 0.0;
  for (int i = 0; i < E; ++i) {
    const double f = static_cast<double>(g.head_counts[S + i]) / N;
    double P = 0.0;
    for (int n = 0; n < N; ++n) P += g.probs(n, i);
    P /= N;
    sum += f * P;
  }
  g.load_balance_loss = E * sum;
}

/// Learned two-stage router (docs/semantics.md §3). X [N, D]; Wr [H-S, D] (when K > 0), Ws [S, D]
/// (when S > 1), Wm [2, D] (when S > 0 and K > 0).
inline MoHGates naive_moh_gates(const Mat& X, int H, int S, int K, const Mat& Wr, const Mat& Ws,
                                const Mat& Wm) {
  const int N = static_cast<int>(X.rows()), E = H - S;
  const Vec none;
  const Mat lr = K > 0 ? linear(X, Wr, none) : Mat(N, 0);
  const Mat ls = S > 1 ? linear(X, Ws, none) : Mat(N, 0);
  const Mat lm = (S > 0 && K > 0) ? linear(X, Wm, none) : Mat(N, 0);
  MoHGates g = no_gates(N, H, E);
  for (int n = 0; n < N; ++n) {
    // Step 1: routed gates g_r = K p_kept / max(sum p_kept, eps).
    std::vector<double> gr(E, 0.0);
    if (K > 0) {
      const std::vector<double> p = softmax(row(lr, n));
      for (int i = 0; i < E; ++i) g.probs(n, i) = p[i];
      const std::vector<int> kept = top_k(p, K);
      double sum = 0.0;
      for (int i : kept) sum += p[i];
      for (int i : kept) {
        gr[i] = K * p[i] / std::max(sum, std::numeric_limits<double>::min());
        g.active[n][S + i] = true;
      }
    }
    // Step 2: shared gates g_s = S softmax(x W_s^T), or 1 with one shared head.
    std::vector<double> gs(S, 1.0);
    if (S > 1) {
      const std::vector<double> p = softmax(row(ls, n));
      for (int i = 0; i < S; ++i) gs[i] = S * p[i];
    }
    for (int i = 0; i < S; ++i) g.active[n][i] = true;
    // Step 3: mix [a_s, a_r] = 2 softmax(x W_m^T) when both groups exist.
    double as = 1.0, ar = 1.0;
    if (S > 0 && K > 0) {
      const std::vector<double> m = softmax(row(lm, n));
      as = 2.0 * m[0];
      ar = 2.0 * m[1];
    }
    for (int i = 0; i < S; ++i) g.gates(n, i) = gs[i] * as;
    for (int i = 0; i < E; ++i) g.gates(n, S + i) = gr[i] * ar;
  }
  finish_gates(g, H, S);
  return g;
}

/// Query-norm router (docs/semantics.md §4). Q [N, H d] queries before RoPE. Gates are 0/1.
inline MoHGates naive_moh_gates_query_norm(const Mat& Q, int H, int d, int S, int K) {
  const int N = static_cast<int>(Q.rows()), E = H - S;
  MoHGates g = no_gates(N, H, E);
  for (int n = 0; n < N; ++n) {
    std::vector<double> l(E, 0.0);
    for (int i = 0; i < E; ++i) {
      double sq = 0.0;
      for (int c = 0; c < d; ++c) sq += Q(n, (S + i) * d + c) * Q(n, (S + i) * d + c);
      l[i] = std::sqrt(sq);
    }
    double mean = 0.0;
    for (double x : l) mean += x;
    mean /= E;
    double var = 0.0;
    for (double x : l) var += (x - mean) * (x - mean);
    const double sd = std::sqrt(var / (E - 1));  // unbiased; callers use E >= 2
    std::vector<double> z(E);
    for (int i = 0; i < E; ++i) z[i] = l[i] / sd;
    const std::vector<double> p = softmax(z);
    for (int i = 0; i < E; ++i) g.probs(n, i) = p[i];
    for (int i = 0; i < S; ++i) {
      g.gates(n, i) = 1.0;
      g.active[n][i] = true;
    }
    for (int i : top_k(p, K)) {
      g.gates(n, S + i) = 1.0;
      g.active[n][S + i] = true;
    }
  }
  finish_gates(g, H, S);
  return g;
}

/// concat_h (g_h o_h) projected (docs/semantics.md §3.4): heads O [B*T, H d] scaled by gates
/// [B*T, H].
inline Mat naive_gated_output(const MhaWeights& w, const Mat& gates, Mat O) {
  for (int n = 0; n < O.rows(); ++n)
    for (int h = 0; h < w.H; ++h)
      for (int c = 0; c < w.d; ++c) O(n, h * w.d + c) *= gates(n, h);
  return linear(O, w.W_out, w.b_out);
}

/// MoH output (docs/semantics.md §3.4): every head computed densely, scaled by its gate, projected.
/// gates [B*T, H].
inline Mat naive_moh(const MhaWeights& w, const Mat& gates, const Mat& X, int B, int T,
                     const AttnOptions& o) {
  return naive_gated_output(w, gates, naive_mha_heads(w, X, B, T, X, T, o));
}

/// MoH cross-attention (docs/semantics.md §2 and §3): queries and gates from X [B*T, D] (gates
/// [B*T, H], routed on X), keys and values from the memory M [B*S, D]; RoPE positions as in
/// naive_mha_heads' cross-attention (queries offset + t, keys s).
inline Mat naive_moh_cross(const MhaWeights& w, const Mat& gates, const Mat& X, int B, int T,
                           const Mat& M, int S, const AttnOptions& o) {
  return naive_gated_output(w, gates, naive_mha_heads(w, X, B, T, M, S, o, true));
}

// ------------------------------------------------------------------------------------------------
// docs/semantics.md §5: Mixture of Attention heads
// ------------------------------------------------------------------------------------------------

/// Weights of MoA.
struct MoAWeights {
  int D = 0, d = 0, E = 0, k = 0;
  Mat Wq;  // [E*D, d]: expert e is rows [e D, (e+1) D), applied as x W
  Mat Wo;  // [E*d, D]: expert e is rows [e d, (e+1) d), applied as o W
  Mat Wg;  // [D, E], applied as x W
  Mat Wk;  // [d, D], Linear (x W^T)
  Mat Wv;  // [d, D]
  bool topk_softmax = false;  // JetMoE: top k logits, then softmax over those k
};

/// What the MoA router decided for N tokens, with the auxiliary losses.
struct MoARoute {
  Mat logits, probs, gates;                // [N, E]
  std::vector<std::vector<int>> selected;  // [N][k]
  std::vector<int> counts;                 // [E]: (token, slot) pairs
  double switch_loss = 0.0, z_loss = 0.0, cv_loss = 0.0;
};

/// The MoA router (docs/semantics.md §5.1 and its losses, with §9's query padding) from logits
/// [N, E]. `query_pad` [N] (empty = none): a padded token gets p = 0 and no expert (empty
/// `selected`, zero gates), and is left out of counts, the switch loss and the cv-loss; the
/// z-loss mean_t (logsumexp_e l_te)^2 runs over all N tokens, padded ones included (their own
/// logits). `topk_softmax`: gates = softmax over the k largest logits (JetMoE) instead of the
/// unrenormalised p_e; p = softmax over all E for the losses either way.
inline MoARoute naive_moa_route(const Mat& logits, int k, bool topk_softmax = false,
                                const std::vector<bool>& query_pad = {}) {
  const int N = static_cast<int>(logits.rows()), E = static_cast<int>(logits.cols());
  MoARoute r;
  r.logits = logits;
  r.probs = Mat::Zero(N, E);
  r.gates = Mat::Zero(N, E);
  r.counts.assign(E, 0);
  r.selected.assign(N, {});
  double z = 0.0;
  for (int n = 0; n < N; ++n) {
    const std::vector<double> l = row(logits, n);
    const double lse = log_sum_exp(l);
    z += lse * lse;
    if (!query_pad.empty() && query_pad[n]) continue;  // p = 0, nothing selected
    const std::vector<double> p = softmax(l);
    for (int e = 0; e < E; ++e) r.probs(n, e) = p[e];
    const std::vector<int> sel = top_k(p, k);
    r.selected[n] = sel;
    for (int e : sel) ++r.counts[e];
    if (topk_softmax) {
      std::vector<double> kept;
      for (int e : sel) kept.push_back(l[e]);
      const std::vector<double> g = softmax(kept);
      for (int s = 0; s < k; ++s) r.gates(n, sel[s]) = g[s];
    } else {
      for (int e : sel) r.gates(n, e) = p[e];
    }
  }
  if (N == 0) return r;
  r.z_loss = z / N;
  double total_p = 0.0, total_c = 0.0;
  for (int n = 0; n < N; ++n)
    for (int e = 0; e < E; ++e) total_p += r.probs(n, e);
  for (int e = 0; e < E; ++e) total_c += r.counts[e];
  if (total_c > 0) {
    double sw = 0.0;
    for (int e = 0; e < E; ++e) {
      double pe = 0.0;
      for (int n = 0; n < N; ++n) pe += r.probs(n, e);
      sw += (pe / total_p) * (r.counts[e] / total_c);
    }
    r.switch_loss = E * sw;
  }
  if (E > 1 && total_c > 0) {
    std::vector<double> G(E, 0.0);
    double sum = 0.0;
    for (int e = 0; e < E; ++e) {
      for (int n = 0; n < N; ++n) G[e] += r.gates(n, e);
      sum += G[e];
    }
    for (double& x : G) x /= sum;
    double mean = 0.0;
    for (double x : G) mean += x;
    mean /= E;
    double var = 0.0;
    for (double x : G) var += (x - mean) * (x - mean);
    var /= (E - 1);
    r.cv_loss = var / (mean * mean + 1e-10);
  }
  return r;
}

/// o_e W_o^e of every expert for every token (ungated): out[e] is [B*T, D]. Keys/values from
/// Xkv [B*S, D] (X itself for self-attention).
inline std::vector<Mat> naive_moa_experts(const MoAWeights& w, const Mat& X, int B, int T,
                                          const Mat& Xkv, int S, const AttnOptions& o) {
  const Vec none;
  const Mat K = linear(Xkv, w.Wk, none), V = linear(Xkv, w.Wv, none);  // [B*S, d]
  std::vector<Mat> out;
  for (int e = 0; e < w.E; ++e) {
    const Mat Qe = matmul(X, w.Wq.middleRows(e * w.D, w.D));  // [B*T, d]
    Mat Oe(static_cast<Eigen::Index>(B) * T, w.d);
    for (int b = 0; b < B; ++b) {
      const Mat oh = naive_attention(Qe.middleRows(b * T, T), K.middleRows(b * S, S),
                                     V.middleRows(b * S, S), o.causal,
                                     o.pad.empty() ? std::vector<bool>() : o.pad[b]);
      Oe.middleRows(b * T, T) = oh;
    }
    out.push_back(matmul(Oe, w.Wo.middleRows(e * w.d, w.d)));
  }
  return out;
}

/// MoA output y [B*T, D] = sum over selected experts w_e (o_e W_o^e); fills `route` when given.
inline Mat naive_moa(const MoAWeights& w, const Mat& X, int B, int T, const Mat& Xkv, int S,
                     const AttnOptions& o, MoARoute* route = nullptr) {
  const MoARoute r = naive_moa_route(matmul(X, w.Wg), w.k, w.topk_softmax);
  const std::vector<Mat> experts = naive_moa_experts(w, X, B, T, Xkv, S, o);
  Mat Y = Mat::Zero(X.rows(), w.D);
  for (int n = 0; n < X.rows(); ++n)
    for (int e : r.selected[n])
      for (int c = 0; c < w.D; ++c) Y(n, c) += r.gates(n, e) * experts[e](n, c);
  if (route) *route = r;
  return Y;
}

// ------------------------------------------------------------------------------------------------
// Bridge to moh's types (float or double)
// ------------------------------------------------------------------------------------------------

template <class T>
Mat to_ref(const moh::Matrix<T>& m) {
  return m.template cast<double>();
}
template <class T>
Vec to_ref(const moh::Vector<T>& v) {
  return v.template cast<double>();
}
/// A [B, T, F] tensor as [B*T, F] rows.
template <class T>
Mat to_ref(const moh::Tensor3<T>& t) {
  return moh_test::rows_of(t);
}
inline PadMask to_ref(const moh::Mask& m) {
  PadMask p(m.dimension(0), std::vector<bool>(m.dimension(1)));
  for (Eigen::Index b = 0; b < m.dimension(0); ++b)
    for (Eigen::Index s = 0; s < m.dimension(1); ++s) p[b][s] = m(b, s);
  return p;
}

}  // namespace moh_ref
