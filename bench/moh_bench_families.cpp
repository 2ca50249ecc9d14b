// Prefill benchmarks of the model families of docs/semantics.md §6-9, each against the dense
// layer it should cost no more than (one thread):
//
//   BM_JetMoE_Prefill/batch:1/tokens:2048/d_model:2048/kv_heads:16/experts:8/top_k:2/head_dim:128
//   BM_MHA_Prefill/batch:1/tokens:2048/d_model:2048/heads:32/kv_heads:16/head_dim:128/causal:1
//       JetMoE-8B's attention (causal, RoPE, bias) and the dense layer with its number of active
//       query heads: 2 experts x 16 heads = 32 heads of 128 over the same 16 kv heads.
//   BM_MoH_ViT_Prefill/batch:1/tokens:49/d_model:768/heads:24/active_pct:P      (P = 50, 75, 100)
//       against BM_MHA_Prefill/batch:1/tokens:49/d_model:768/heads:24:
//       MoH-ViT's stage-4 attention (cosine attention with its position bias, 7 x 7 grid, heads
//       of 32) and plain MHA of the same size. Keys and values stay dense, so at 50 % the FLOP
//       ratio is 0.77, not 0.5. Both layers store their weights WeightStorage::NativePacked
//       (at 49 tokens, packing 768-wide weights on every call is a large share of the call);
//       the same two rows with /weights:native appended store them Native.
//   BM_MHA_Prefill/batch:1/tokens:2048/d_model:1024/heads:16/bias:per_head
//       a [1, H, T, S] additive bias, against BM_MHA_Prefill/batch:1/tokens:2048/d_model:1024/
//       heads:16 (moh_bench.cpp).
//
// Every call runs with the run's moh::Workspace, after an untimed warm-up call (time_forward).
#include "bench_common.hpp"

namespace {

using moh::Index;

// ---------------------------------------------------------------------------------------------
// JetMoE against dense MHA with its active query heads.
// ---------------------------------------------------------------------------------------------
void BM_JetMoE_Prefill(benchmark::State& state) {
  const Index B = state.range(0), T = state.range(1), D = state.range(2), G = state.range(3),
              E = state.range(4), k = state.range(5), d = state.range(6);
  const moh::MoAAttention<float> layer(moh::MoAConfig::jetmoe(D, G, E, k, d), /*seed=*/42);
  moh_bench::time_forward(state, layer, B, T, nullptr, moh_bench::causal_options());
  moh_bench::set_layer_counters(state, moh_bench::jetmoe_flops(B, T, T, D, G, E, k, d, true),
                                static_cast<double>(B * T),
                                static_cast<double>(k) / static_cast<double>(E));
  state.SetLabel("causal, rope=1 bias=1, top-k softmax gates");
}

void BM_MHA_Prefill_Causal(benchmark::State& state) {
  const Index B = state.range(0), T = state.range(1), D = state.range(2), H = state.range(3),
              G = state.range(4), d = state.range(5);
  const moh::MHAConfig cfg = moh_test::mha_config(D, H, G, d, /*bias=*/false, /*rope=*/true);
  const bool causal = state.range(6) != 0;
  moh_bench::time_forward(state, moh::MultiHeadAttention<float>(cfg, /*seed=*/42), B, T, nullptr,
                          causal ? moh_bench::causal_options() : moh::ForwardOptions());
  moh_bench::set_layer_counters(state, moh_bench::mha_flops(B, T, T, D, H, G, d, causal),
                                static_cast<double>(B * T), 1.0);
  state.SetLabel("rope=1 bias=0");
}

// ---------------------------------------------------------------------------------------------
// MoH-ViT's cosine attention on a 7 x 7 grid. Split rule: bench_common.hpp.
// ---------------------------------------------------------------------------------------------
void run_moh_vit_prefill(benchmark::State& state, Index B, Index T, Index D, Index H, Index pct,
                         moh::WeightStorage storage) {
  const Index grid = static_cast<Index>(std::llround(std::sqrt(static_cast<double>(T))));
  const moh_bench::HeadSplit split = moh_bench::moh_split(H, pct);
  moh::MoHConfig cfg = moh::MoHConfig::vit(D, H, split.shared, split.routed_k, grid, grid);
  cfg.weight_storage = storage;
  const moh::MoHAttention<float> layer(cfg, /*seed=*/42);
  moh::ForwardOptions o;
  o.grid_h = o.grid_w = grid;
  moh_bench::time_forward(state, layer, B, T, nullptr, o);
  const Index d = D / H;
  moh_bench::set_layer_counters(
      state, moh_bench::moh_flops(B, T, T, D, H, H, d, false, split, moh::MoHRouterKind::Learned),
      static_cast<double>(B * T), split.ratio());
  state.counters["shared_heads"] = static_cast<double>(split.shared);
  state.counters["routed_k"] = static_cast<double>(split.routed_k);
  state.SetLabel("cosine attention, position bias, grid " + std::to_string(grid) + "x" +
                 std::to_string(grid) + ", weights " + moh::enum_name(storage));
}

void BM_MoH_ViT_Prefill(benchmark::State& state, moh::WeightStorage storage) {
  run_moh_vit_prefill(state, state.range(0), state.range(1), state.range(2), state.range(3),
                      state.range(4), storage);
}

// The dense layer of MoH-ViT's size, with the same weight storage.
void run_mha_vit_prefill(benchmark::State& state, Index B, Index T, Index D, Index H,
                         moh::WeightStorage storage) {
  moh::MHAConfig cfg = moh_test::mha_config(D, H);
  cfg.weight_storage = storage;
  moh_bench::time_forward(state, moh::MultiHeadAttention<float>(cfg, 42), B, T);
  moh_bench::set_layer_counters(state, moh_bench::mha_flops(B, T, T, D, H, H, D / H, false),
                                static_cast<double>(B * T), 1.0);
  state.SetLabel(std::string("weights ") + moh::enum_name(storage));
}

void BM_MHA_Prefill_ViT(benchmark::State& state, moh::WeightStorage storage) {
  run_mha_vit_prefill(state, state.range(0), state.range(1), state.range(2), state.range(3),
                      storage);
}

// ---------------------------------------------------------------------------------------------
// MHA with a per-head additive bias [1, H, T, S].
// ---------------------------------------------------------------------------------------------
void BM_MHA_Prefill_Bias(benchmark::State& state, Index B, Index T, Index D, Index H) {
  moh::Tensor4<float> bias(1, H, T, T);
  moh_bench::fill_uniform(bias.data(), bias.size(), 11);
  moh::ForwardOptions o;
  o.attn_bias = bias;
  moh_bench::time_forward(state, moh::MultiHeadAttention<float>(moh_test::mha_config(D, H), 42),
                          B, T, nullptr, o);
  moh_bench::set_layer_counters(state, moh_bench::mha_flops(B, T, T, D, H, H, D / H, false),
                                static_cast<double>(B * T), 1.0);
}

const bool registered = [] {
  auto* b = benchmark::RegisterBenchmark("BM_JetMoE_Prefill", BM_JetMoE_Prefill);
  b->ArgNames({"batch", "tokens", "d_model", "kv_heads", "experts", "top_k", "head_dim"})
      ->Args({1, 2048, 2048, 16, 8, 2, 128})
      ->Unit(benchmark::kMillisecond);
  b = benchmark::RegisterBenchmark("BM_MHA_Prefill", BM_MHA_Prefill_Causal);
  b->ArgNames({"batch", "tokens", "d_model", "heads", "kv_heads", "head_dim", "causal"})
      ->Args({1, 2048, 2048, 32, 16, 128, 1})
      ->Unit(benchmark::kMillisecond);
  using moh::WeightStorage;
  b = benchmark::RegisterBenchmark("BM_MHA_Prefill", BM_MHA_Prefill_ViT,
                                   WeightStorage::NativePacked);
  b->ArgNames({"batch", "tokens", "d_model", "heads"})->Args({1, 49, 768, 24});
  b->Unit(benchmark::kMicrosecond);
  b = benchmark::RegisterBenchmark("BM_MoH_ViT_Prefill", BM_MoH_ViT_Prefill,
                                   WeightStorage::NativePacked);
  b->ArgNames({"batch", "tokens", "d_model", "heads", "active_pct"})->Unit(benchmark::kMicrosecond);
  for (Index p : {50, 75, 100}) b->Args({1, 49, 768, 24, p});
  benchmark::RegisterBenchmark(
      "BM_MHA_Prefill/batch:1/tokens:49/d_model:768/heads:24/weights:native",
      [](benchmark::State& s) { run_mha_vit_prefill(s, 1, 49, 768, 24, WeightStorage::Native); })
      ->Unit(benchmark::kMicrosecond);
  benchmark::RegisterBenchmark(
      "BM_MoH_ViT_Prefill/batch:1/tokens:49/d_model:768/heads:24/active_pct:50/weights:native",
      [](benchmark::State& s) {
        run_moh_vit_prefill(s, 1, 49, 768, 24, 50, WeightStorage::Native);
      })
      ->Unit(benchmark::kMicrosecond);
  benchmark::RegisterBenchmark(
      "BM_MHA_Prefill/batch:1/tokens:2048/d_model:1024/heads:16/bias:per_head",
      [](benchmark::State& s) { BM_MHA_Prefill_Bias(s, 1, 2048, 1024, 16); })
      ->Unit(benchmark::kMillisecond);
  return true;
}();

}  // namespace
