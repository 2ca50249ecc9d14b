// Shared pieces of the moh benchmarks: shapes, the MoH shared/routed split rule, FLOP and byte
// models, random inputs, the counters every layer benchmark reports, and the rotation of decode
// rows through copies of their layer.
//
// Names and argument names are fixed (bench/report.py and results of older versions rely on
// them): BM_<Layer>_<Prefill|Decode>/<name>:<value>/... as STYLE.md point 8 asks.
#pragma once

#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "layer_configs.hpp"  // tests/layer_configs.hpp: the config builders tests and bench share
#include "moh/moh.hpp"

namespace moh_bench {

using moh::Index;

/// Fills `n` floats at `p` with uniform values in [-1, 1) from a fixed seed.
inline void fill_uniform(float* p, Index n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (Index i = 0; i < n; ++i) p[i] = dist(rng);
}

/// A [B, T, D] activation filled with seeded random values.
inline moh::Tensor3<float> random_activation(Index B, Index T, Index D, std::uint64_t seed) {
  moh::Tensor3<float> x(B, T, D);
  fill_uniform(x.data(), x.size(), seed);
  return x;
}

// ---------------------------------------------------------------------------------------------
// MoH head split.
//
// active heads  A = round(P * H / 100), the nearest whole head count (H=8: 90% -> 7; H=12: 90% ->
//               11; H=16: 90% -> 14), at least 1;
// shared heads  S = max(1, H/8) for P = 25 (a quarter of the heads cannot also hold H/4 shared
//               heads plus routed ones), otherwise S = H/4;
// routed K      K = A - S, chosen per token by the learned router (random seeded weights).
// The LLaMA3-8B rows do not use this rule: they run MoH-LLaMA3-8B's released split
// (llama3_moh_config below). The active ratio (S + K) / H is exact and reported as the
// `active_ratio` counter.
// ---------------------------------------------------------------------------------------------
struct HeadSplit {
  Index shared = 0, routed_k = 0, heads = 0;
  Index active() const { return shared + routed_k; }
  double ratio() const { return static_cast<double>(active()) / static_cast<double>(heads); }
};

inline HeadSplit moh_split(Index heads, Index active_pct) {
  Index active = static_cast<Index>(std::llround(static_cast<double>(active_pct) *
                                                  static_cast<double>(heads) / 100.0));
  if (active < 1) active = 1;
  if (active > heads) active = heads;
  Index shared = active_pct == 25 ? std::max<Index>(1, heads / 8) : heads / 4;
  if (shared > active) shared = active;
  return HeadSplit{shared, active - shared, heads};
}

/// The MoH config of a benchmark with `split` over H heads and G kv heads: learned router, bias,
/// no RoPE unless told otherwise (the builders are tests/layer_configs.hpp's).
inline moh::MoHConfig moh_config(Index D, Index H, Index G, const HeadSplit& s,
                                 moh::MoHRouterKind router = moh::MoHRouterKind::Learned,
                                 bool bias = true, bool rope = false) {
  return moh_test::moh_config(D, H, s.shared, s.routed_k, router, G, 0, bias, rope);
}

/// The MoH config of the LLaMA3-8B rows (d_model 4096, 32 heads, 8 kv heads) at active_pct 75:
/// MoH-LLaMA3-8B as released, MoHConfig::moh_llama3_8b() (heads 0..15 shared, the top 8 of the
/// 16 routed heads); another LLaMA3-style shape gets the same rule, MoHConfig::moh_llama3().
/// Other percentages are not what the released model runs: nullopt.
inline std::optional<moh::MoHConfig> llama3_moh_config(Index D, Index H, Index G, Index pct) {
  if (pct != 75) return std::nullopt;
  if (D == 4096 && H == 32 && G == 8) return moh::MoHConfig::moh_llama3_8b();
  return moh::MoHConfig::moh_llama3(D, H, G);
}

/// The split a MoH config runs.
inline HeadSplit split_of(const moh::MoHConfig& c) {
  return HeadSplit{c.shared_heads, c.active_routed_heads, c.num_heads};
}

// ---------------------------------------------------------------------------------------------
// FLOP models: the work each layer actually does (multiply-add = 2 FLOPs).
// ---------------------------------------------------------------------------------------------

/// Query-key pairs of one head of one sequence: Tq queries over S keys, bottom-right causal
/// alignment when causal (query t sees S - Tq + t + 1 keys; a square causal call is ~S^2/2).
inline double attention_pairs(Index Tq, Index S, bool causal) {
  const double tq = static_cast<double>(Tq), s = static_cast<double>(S);
  if (!causal) return tq * s;
  return tq * (s - tq) + tq * (tq + 1.0) / 2.0;
}

/// Dense MHA: projections 2 N D (H + 2 G) d, attention 4 B H pairs d, output 2 N H d D.
inline double mha_flops(Index B, Index Tq, Index S, Index D, Index H, Index G, Index d,
                        bool causal) {
  const double N = static_cast<double>(B * Tq);
  return 2.0 * N * D * static_cast<double>((H + 2 * G) * d) +
         4.0 * B * H * attention_pairs(Tq, S, causal) * d + 2.0 * N * H * d * D;
}

/// MoH sparse path: keys/values for every token; queries, attention and output only for the
/// active (token, head) pairs; plus the router. With the query-norm router (or when every head is
/// active, which takes the dense path) the queries of all heads are projected.
inline double moh_flops(Index B, Index Tq, Index S, Index D, Index H, Index G, Index d,
                        bool causal, const HeadSplit& s, moh::MoHRouterKind router) {
  const double N = static_cast<double>(B * Tq), r = s.ratio();
  const bool all_queries = router == moh::MoHRouterKind::QueryNorm || s.active() == H;
  const double kv = 2.0 * N * D * static_cast<double>(2 * G * d);
  const double q = 2.0 * N * D * static_cast<double>(H * d) * (all_queries ? 1.0 : r);
  const double att = 4.0 * B * H * attention_pairs(Tq, S, causal) * d * r;
  const double out = 2.0 * N * H * d * D * r;
  double route = 0.0;
  if (router == moh::MoHRouterKind::Learned) {
    Index rows = 0;  // W_r [H - S, D], W_s [S, D] when S > 1, W_m [2, D] when both groups exist
    if (s.routed_k > 0) rows += H - s.shared;
    if (s.shared > 1) rows += s.shared;
    if (s.shared > 0 && s.routed_k > 0) rows += 2;
    route = 2.0 * N * D * rows;
  } else {
    route = 2.0 * N * static_cast<double>((H - s.shared) * d);  // the routed queries' norms
  }
  return kv + q + att + out + route;
}

/// MoA: one shared key/value head 4 N D d; per token k experts x (2 D d query + 4 S d attention
/// + 2 d D output); router 2 N D E.
inline double moa_flops(Index B, Index Tq, Index S, Index D, Index E, Index k, Index d,
                        bool causal) {
  const double N = static_cast<double>(B * Tq);
  return 4.0 * N * D * d + k * (2.0 * N * D * d + 4.0 * B * attention_pairs(Tq, S, causal) * d +
                                2.0 * N * d * D) +
         2.0 * N * D * E;
}

/// JetMoE (multi-head experts, docs/semantics.md §9): keys/values 4 N D G d; per token k experts x
/// (2 D G d query + 4 pairs G d attention + 2 G d D output); router 2 N D E.
inline double jetmoe_flops(Index B, Index Tq, Index S, Index D, Index G, Index E, Index k,
                           Index d, bool causal) {
  const double N = static_cast<double>(B * Tq), w = static_cast<double>(G * d);
  return 4.0 * N * D * w +
         k * (2.0 * N * D * w + 4.0 * B * attention_pairs(Tq, S, causal) * w + 2.0 * N * w * D) +
         2.0 * N * D * E;
}

// ---------------------------------------------------------------------------------------------
// Counters.
// ---------------------------------------------------------------------------------------------

/// GFLOPs and tokens_per_s (rates over the measured time: real time where the benchmark uses
/// UseRealTime(), else CPU time) and active_ratio.
inline void set_layer_counters(benchmark::State& state, double flops_per_iter,
                               double tokens_per_iter, double active_ratio) {
  const double it = static_cast<double>(state.iterations());
  state.counters["GFLOPs"] = benchmark::Counter(flops_per_iter * it * 1e-9,
                                                benchmark::Counter::kIsRate);
  state.counters["tokens_per_s"] = benchmark::Counter(tokens_per_iter * it,
                                                      benchmark::Counter::kIsRate);
  state.counters["active_ratio"] = benchmark::Counter(active_ratio);
}

/// Keeps `data` alive and forces the writes to memory.
inline void keep(float* data) {
  benchmark::DoNotOptimize(data);
  benchmark::ClobberMemory();
}

/// The workspace every benchmark's calls use: kept for the whole run, as an application keeps
/// one, so that no timed call pays for sizing it (Google Benchmark calls a benchmark function
/// several times while it picks the iteration count).
inline moh::Workspace& bench_workspace() {
  static moh::Workspace ws;
  return ws;
}

/// Options of a causal self-attention call.
inline moh::ForwardOptions causal_options() {
  moh::ForwardOptions o;
  o.causal = moh::Causal::On;
  return o;
}

// ---------------------------------------------------------------------------------------------
// Decode rows read from memory as a model does: a model's step reads each of its layers once, so
// no layer finds its bytes of the step before in the last-level cache. A decode row steps through
// copies of its layer, weights and KV cache each, as many as it takes for all of them together
// to exceed kRotationBytes, one copy per step in turn. The copies are equal (same weights, same
// cached tokens), so every step computes the same thing and a step's byte counts are one copy's.
// ---------------------------------------------------------------------------------------------
inline constexpr double kRotationBytes = 256.0 * 1024.0 * 1024.0;

/// How many copies of `bytes` (> 0) exceed `total` together: floor(total / bytes) + 1.
inline Index copies_to_exceed(double bytes, double total = kRotationBytes) {
  return static_cast<Index>(std::floor(total / bytes)) + 1;
}

/// One copy of a decode row's layer and its KV cache.
template <class Layer>
struct DecodeCopy {
  std::unique_ptr<Layer> layer;
  moh::KvCache<float> cache;
  double bytes() const {
    return static_cast<double>(layer->weight_bytes() + cache.bytes());
  }
};

/// `first` followed by as many equal copies of it (layer copied, cache cloned) as it takes for
/// all of them to exceed kRotationBytes.
template <class Layer>
std::vector<DecodeCopy<Layer>> rotation_of(DecodeCopy<Layer> first) {
  const Index n = copies_to_exceed(first.bytes());
  std::vector<DecodeCopy<Layer>> out;
  out.reserve(static_cast<std::size_t>(n));
  for (Index i = 1; i < n; ++i)
    out.push_back({std::make_unique<Layer>(*first.layer), first.cache.clone()});
  out.insert(out.begin(), std::move(first));
  return out;
}

/// Times layer.forward (self-attention, non-causal unless `opts` says otherwise) on a seeded
/// random [B, T, D] input, one call per iteration, on `pool` (null: the calling thread), with
/// `opts`, the run's workspace and one untimed warm-up call, so that the timed calls allocate
/// nothing.
template <class Layer>
void time_forward(benchmark::State& state, const Layer& layer, Index B, Index T,
                  moh::ThreadPool* pool = nullptr, moh::ForwardOptions opts = {}) {
  const Index D = layer.embed_dim();
  const moh::Tensor3<float> x = random_activation(B, T, D, 7);
  moh::Tensor3<float> y(B, T, D);
  opts.pool = pool;
  opts.workspace = &bench_workspace();
  const moh::ConstTensorMap3<float> xm(x.data(), B, T, D);
  layer.forward(xm, moh::TensorMap3<float>(y.data(), B, T, D), opts);
  for (auto _ : state) {
    layer.forward(xm, moh::TensorMap3<float>(y.data(), B, T, D), opts);
    keep(y.data());
  }
}

}  // namespace moh_bench
