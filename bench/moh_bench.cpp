// Prefill benchmarks: dense MultiHeadAttention against MoHAttention at several activation ratios
// and MoAAttention at several expert counts, at three shapes, plus the projection GEMM alone
// (Eigen's and moh's own) so that the layers' GFLOP/s read against both in the same run.
//
//   BM_GEMM/rows:N/in:D/out:3D          (Eigen)
//   BM_MohGEMM/rows:N/in:D/out:3D       (moh::linear)
//   BM_MHA_Prefill/batch:B/tokens:T/d_model:D/heads:H
//   BM_MoH_Prefill/batch:B/tokens:T/d_model:D/heads:H/active_pct:P
//   BM_MoA_Prefill/batch:B/tokens:T/d_model:D/experts:E/top_k:k/head_dim:d
//   BM_MHA_Prefill_Threads/batch:1/tokens:2048/d_model:1024/heads:16/threads:N
//   BM_MoH_Prefill_Threads/batch:1/tokens:2048/d_model:1024/heads:16/active_pct:50/threads:N
//
// Prefill is non-causal self-attention (ViT style) at every shape, with a moh::Workspace held
// across iterations (warm calls allocate nothing). Everything runs on the calling
// thread (ForwardOptions::pool = nullptr) except the *_Threads benchmarks, which pass a
// moh::ThreadPool and measure real time (Google Benchmark appends "/real_time" to their names).
// Decode and memory-bandwidth benchmarks live in moh_bench_decode.cpp. bench/run_suite.sh runs the
// suite and bench/report.py turns its JSON into tables.
#include "bench_common.hpp"

namespace {

using moh::Index;
using moh_bench::HeadSplit;

// Shapes (batch, tokens, d_model, heads): ViT-B/16 at 224 px (196 patches + CLS), a batched
// mid-size encoder, and one long sequence at d_model 1024.
constexpr Index kShapes[][4] = {{1, 197, 768, 12}, {8, 256, 512, 8}, {1, 2048, 1024, 16}};
constexpr Index kActivePct[] = {25, 50, 75, 90, 100};
constexpr Index kExperts[] = {8, 16, 32};
constexpr Index kTopK[] = {2, 4};

// ---------------------------------------------------------------------------------------------
// GEMM at the fused q/k/v projection shape: Y[N, 3D] = X[N, D] W[3D, D]^T, row-major floats.
// ---------------------------------------------------------------------------------------------
void BM_GEMM(benchmark::State& state) {
  const Index N = state.range(0), D = state.range(1), O = state.range(2);
  moh::Matrix<float> X(N, D), W(O, D), Y(N, O);
  moh_bench::fill_uniform(X.data(), X.size(), 1);
  moh_bench::fill_uniform(W.data(), W.size(), 2);
  for (auto _ : state) {
    Y.noalias() = X * W.transpose();
    moh_bench::keep(Y.data());
  }
  state.counters["GFLOPs"] = benchmark::Counter(
      2.0 * N * D * O * static_cast<double>(state.iterations()) * 1e-9, benchmark::Counter::kIsRate);
}

// The same product through moh::linear (ops/gemm.hpp), the path every projection of the
// layers takes, so that its rate reads against Eigen's in the same run.
void BM_MohGEMM(benchmark::State& state) {
  const Index N = state.range(0), D = state.range(1), O = state.range(2);
  moh::Matrix<float> X(N, D), W(O, D), Y(N, O);
  moh_bench::fill_uniform(X.data(), X.size(), 1);
  moh_bench::fill_uniform(W.data(), W.size(), 2);
  moh::linear<float>(X, W, Y, nullptr, &moh_bench::bench_workspace());  // sizes the workspace
  for (auto _ : state) {
    moh::linear<float>(X, W, Y, nullptr, &moh_bench::bench_workspace());
    moh_bench::keep(Y.data());
  }
  state.counters["GFLOPs"] = benchmark::Counter(
      2.0 * N * D * O * static_cast<double>(state.iterations()) * 1e-9, benchmark::Counter::kIsRate);
}

void gemm_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"rows", "in", "out"});
  for (const auto& s : kShapes) b->Args({s[0] * s[1], s[2], 3 * s[2]});
}

// ---------------------------------------------------------------------------------------------
// Dense MHA.
// ---------------------------------------------------------------------------------------------
void run_mha_prefill(benchmark::State& state, Index B, Index T, Index D, Index H,
                     moh::ThreadPool* pool) {
  moh_bench::time_forward(state, moh::MultiHeadAttention<float>(moh_test::mha_config(D, H), 42),
                          B, T, pool);
  const Index d = D / H;
  moh_bench::set_layer_counters(state, moh_bench::mha_flops(B, T, T, D, H, H, d, false),
                                static_cast<double>(B * T), 1.0);
}

void BM_MHA_Prefill(benchmark::State& state) {
  run_mha_prefill(state, state.range(0), state.range(1), state.range(2), state.range(3), nullptr);
}

void mha_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"batch", "tokens", "d_model", "heads"});
  for (const auto& s : kShapes) b->Args({s[0], s[1], s[2], s[3]});
}

// ---------------------------------------------------------------------------------------------
// MoH, sparse path, learned router with seeded random weights. Split rule: bench_common.hpp.
// ---------------------------------------------------------------------------------------------
void run_moh_prefill(benchmark::State& state, Index B, Index T, Index D, Index H, Index pct,
                     moh::ThreadPool* pool) {
  const HeadSplit split = moh_bench::moh_split(H, pct);
  moh_bench::time_forward(  // the sparse path
      state, moh::MoHAttention<float>(moh_bench::moh_config(D, H, H, split), /*seed=*/42), B, T,
      pool);
  const Index d = D / H;
  moh_bench::set_layer_counters(
      state,
      moh_bench::moh_flops(B, T, T, D, H, H, d, false, split, moh::MoHRouterKind::Learned),
      static_cast<double>(B * T), split.ratio());
  state.counters["shared_heads"] = static_cast<double>(split.shared);
  state.counters["routed_k"] = static_cast<double>(split.routed_k);
}

void BM_MoH_Prefill(benchmark::State& state) {
  run_moh_prefill(state, state.range(0), state.range(1), state.range(2), state.range(3),
                  state.range(4), nullptr);
}

void moh_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"batch", "tokens", "d_model", "heads", "active_pct"});
  for (const auto& s : kShapes)
    for (Index p : kActivePct) b->Args({s[0], s[1], s[2], s[3], p});
}

// ---------------------------------------------------------------------------------------------
// MoA, sparse path: E query/output experts of size d = D/H of the shape, one shared key/value
// head, top-k softmax gating.
// ---------------------------------------------------------------------------------------------
void BM_MoA_Prefill(benchmark::State& state) {
  const Index B = state.range(0), T = state.range(1), D = state.range(2), E = state.range(3),
              k = state.range(4), d = state.range(5);
  moh::MoAConfig cfg;
  cfg.embed_dim = D;
  cfg.head_dim = d;
  cfg.num_experts = E;
  cfg.top_k = k;
  moh_bench::time_forward(state, moh::MoAAttention<float>(cfg, /*seed=*/42), B, T);
  moh_bench::set_layer_counters(state, moh_bench::moa_flops(B, T, T, D, E, k, d, false),
                                static_cast<double>(B * T),
                                static_cast<double>(k) / static_cast<double>(E));
}

void moa_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"batch", "tokens", "d_model", "experts", "top_k", "head_dim"});
  for (const auto& s : kShapes)
    for (Index k : kTopK)
      for (Index e : kExperts) b->Args({s[0], s[1], s[2], e, k, s[2] / s[3]});
}

// ---------------------------------------------------------------------------------------------
// Thread scaling at the long shape: a moh::ThreadPool of N threads (the caller included).
// ---------------------------------------------------------------------------------------------
void BM_MHA_Prefill_Threads(benchmark::State& state) {
  moh::ThreadPool pool(static_cast<int>(state.range(4)));
  run_mha_prefill(state, state.range(0), state.range(1), state.range(2), state.range(3), &pool);
}

void BM_MoH_Prefill_Threads(benchmark::State& state) {
  moh::ThreadPool pool(static_cast<int>(state.range(5)));
  run_moh_prefill(state, state.range(0), state.range(1), state.range(2), state.range(3),
                  state.range(4), &pool);
}

constexpr Index kThreadCounts[] = {1, 2};

void mha_thread_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"batch", "tokens", "d_model", "heads", "threads"});
  for (Index n : kThreadCounts) b->Args({1, 2048, 1024, 16, n});
}

void moh_thread_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"batch", "tokens", "d_model", "heads", "active_pct", "threads"});
  for (Index n : kThreadCounts) b->Args({1, 2048, 1024, 16, 50, n});
}

}  // namespace

BENCHMARK(BM_GEMM)->Apply(gemm_args)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_MohGEMM)->Apply(gemm_args)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_MHA_Prefill)->Apply(mha_args)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_MoH_Prefill)->Apply(moh_args)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_MoA_Prefill)->Apply(moa_args)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_MHA_Prefill_Threads)
    ->Apply(mha_thread_args)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_MoH_Prefill_Threads)
    ->Apply(moh_thread_args)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

BENCHMARK_MAIN();
