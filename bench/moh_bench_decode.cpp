// Decode benchmarks: one causal decode step (one new token per sequence) through a KV cache that
// already holds `context` tokens, for dense MHA and MoH, plus a plain memcpy so that the bandwidth
// a decode step reaches reads against the machine's copy rate in the same run.
//
//   BM_MHA_Decode/batch:B/context:C/d_model:D/heads:H/kv_heads:G[/bf16:1]
//   BM_MoH_Decode/batch:B/context:C/d_model:D/heads:H/kv_heads:G/active_pct:P[/bf16:1]
//   BM_JetMoE_Decode/batch:1/context:4096/d_model:2048/kv_heads:16/experts:8/top_k:2/head_dim:128
//   BM_MHA_Decode/batch:1/context:4096/d_model:2048/heads:32/kv_heads:16/head_dim:128
//   BM_MHA_Decode/batch:1/context:4096/d_model:4096/heads:32/kv_heads:8/threads:2 (wall_us)
//   BM_MHA_Decode/batch:1/context:4096/d_model:4096/heads:32/kv_heads:8/bf16:1/kv_bf16:1
//   BM_MHA_Decode/batch:16/context:1024/d_model:1024/heads:16/kv_heads:16 (more rows than kDotRows)
//   BM_MHA_Decode/batch:8/context:4096/d_model:1024/heads:16/kv_heads:16/ragged:1, and the
//   BM_MoH_Decode row with /active_pct:50/ragged:1 (contexts spread evenly over [C/2, C])
//   BM_MHA_Prefill/batch:1/tokens:2048/d_model:4096/heads:32/kv_heads:8/causal:1
//   BM_MoH_Prefill/batch:1/tokens:2048/d_model:4096/heads:32/kv_heads:8/causal:1/active_pct:75
//   BM_MemRead/bytes:N, BM_MemCopy/bytes:N
//
// Layer settings: d_model 1024 runs the defaults (bias, no RoPE) and MoH's learned router with
// shared = H/4; d_model 4096 is the LLaMA3-8B attention layer (32 heads, 8 kv heads, no bias,
// RoPE) and MoH is MoH-LLaMA3-8B as released (MoHConfig::moh_llama3_8b(): the query-norm router,
// heads 0..15 shared, the top 8 of the 16 routed heads). JetMoE-8B's
// attention (16 kv heads of 128, 8 experts, top 2, bias, RoPE) runs against the dense layer with
// its number of active query heads (2 x 16 = 32 heads of 128 over the same 16 kv heads, RoPE, no
// bias): a JetMoE step computes only its 2 experts. The label
// of each run repeats its settings. `bf16:1` runs the same layer with bfloat16 weight storage
// (WeightStorage::BFloat16): the weight bytes a step streams are halved.
//
// Keeping the context at C: the cache is filled once with C real tokens (forward_cached in causal
// chunks of 512, on a thread pool, outside the timing) and has capacity C + 1. Every iteration
// first rolls the cache back to C tokens with `cache.truncate(C)` (O(1): it forgets the last
// token but keeps the stored keys/values, so slots [0, C) still hold the filled tokens) and then
// runs the timed step, which appends token C and attends over C + 1 keys. The context is
// therefore exactly C at every iteration, with no PauseTiming and no refill. The step runs with a
// moh::Workspace held across iterations, so warm steps allocate nothing.
// The filled cache is kept between Google Benchmark's calls of the same benchmark (iteration
// search, repetitions), so the fill runs once per benchmark.
//
// Reading from memory: each row steps through equal copies of its layer and filled cache, as many
// as it takes for all of them to exceed 256 MiB (moh_bench::rotation_of), one copy per step in
// turn, so that no step finds the bytes of the step before in the last-level cache, as none of a
// model's layers does. The copies are made once per benchmark, after the fill.
//
// Counters: kv_GBps = key/value bytes the step reads / time. For MoH a kv head of a sequence is
// counted when any of its query heads is active for that sequence's token (measured from the
// routing of the step itself). total_GBps adds the weight bytes the step touches: all K/V
// projection rows, the query rows and output columns of the active heads (all of them for the
// query-norm router, which needs every query), the biases and the router's weights. step_MB: those
// bytes per step. wall_us: wall-clock time per step; the `threads:N` rows compare by it (their
// reported time is the calling thread's CPU time, so that the names carry no /real_time).
// copies: the layer copies the row steps through; rotation_MiB: their weights and caches
// together (> 256). The byte counters are one step's, on one copy.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "bench_common.hpp"

namespace {

using moh::Index;
using moh_bench::HeadSplit;

constexpr Index kFillChunk = 512;

/// Fills `cache` to `context` tokens with causal forward_cached calls on random tokens.
template <class Layer>
void fill_cache(const Layer& layer, moh::KvCache<float>& cache, Index B, Index D, Index context) {
  moh::ThreadPool pool(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  moh::ForwardOptions opts;
  opts.causal = moh::Causal::On;
  opts.pool = &pool;
  for (Index start = 0; start < context; start += kFillChunk) {
    const Index n = std::min(kFillChunk, context - start);
    const moh::Tensor3<float> x = moh_bench::random_activation(B, n, D, 1000 + start);
    moh::Tensor3<float> y(B, n, D);
    layer.forward_cached(moh::ConstTensorMap3<float>(x.data(), B, n, D),
                         moh::TensorMap3<float>(y.data(), B, n, D), cache, opts);
  }
}

/// The copies of a layer with its cache filled to `context` (moh_bench::rotation_of), the next one
/// to step, and the step's input/output, built once per benchmark.
template <class Layer>
struct DecodeFixture {
  std::string key;
  std::vector<moh_bench::DecodeCopy<Layer>> copies;
  std::size_t next = 0;
  moh::Tensor3<float> x, y;  // [B, 1, D]
  double kv_bytes = 0, weight_bytes = 0, kv_heads_read = 0;
  std::string label;
  std::vector<Index> lengths;  // ragged: each sequence's context; empty: all C
  /// Keys sequence b's step attends to (its context plus the new token).
  double keys(Index b, Index C) const {
    return static_cast<double>((lengths.empty() ? C : lengths[static_cast<std::size_t>(b)]) + 1);
  }
};

/// A fixture for `key`: the layer with seeded weights, its cache filled to C tokens (room for
/// C + 1), its copies, and the step's input and output. `ragged`: sequence b is then cut back to
/// C/2 + b (C/2) / (B - 1) tokens, contexts spread evenly over [C/2, C].
template <class Layer>
std::unique_ptr<DecodeFixture<Layer>> make_fixture(
    const std::string& key, const typename Layer::Config& cfg, Index B, Index C, Index D,
    bool ragged = false, moh::CacheStorage storage = moh::CacheStorage::Native) {
  auto fx = std::make_unique<DecodeFixture<Layer>>();
  fx->key = key;
  moh_bench::DecodeCopy<Layer> first;
  first.layer = std::make_unique<Layer>(cfg, 42);
  first.cache = first.layer->make_cache(B, C + 1, storage);
  fill_cache(*first.layer, first.cache, B, D, C);
  if (ragged)
    for (Index b = 0; b < B; ++b)
      fx->lengths.push_back(C / 2 + b * (C / 2) / std::max<Index>(1, B - 1));
  fx->copies = moh_bench::rotation_of(std::move(first));
  fx->x = moh_bench::random_activation(B, 1, D, 99);
  fx->y = moh::Tensor3<float>(B, 1, D);
  return fx;
}

template <class Layer>
std::unique_ptr<DecodeFixture<Layer>>& fixture_slot() {
  static std::unique_ptr<DecodeFixture<Layer>> slot;
  return slot;
}

/// Identifies a benchmark instance (this Google Benchmark has no State::name()).
std::string fixture_key(const benchmark::State& state, int args, bool llama) {
  std::string key = llama ? "llama" : "plain";
  for (int i = 0; i < args; ++i) key += "/" + std::to_string(state.range(i));
  return key;
}

/// `cache` back to the fixture's contexts (C, or each sequence's own in `lengths`), keeping the
/// stored keys/values.
void roll_back(moh::KvCache<float>& cache, const std::vector<Index>& lengths, Index context) {
  if (lengths.empty()) {
    cache.truncate(context);
    return;
  }
  for (Index b = 0; b < cache.batch(); ++b)
    cache.truncate(b, lengths[static_cast<std::size_t>(b)]);
}

/// The pool of the `threads:N` rows (null: the calling thread alone).
moh::ThreadPool* decode_pool(Index threads) {
  static std::unique_ptr<moh::ThreadPool> pool;
  if (threads <= 1) return nullptr;
  if (!pool || pool->size() != threads)
    pool = std::make_unique<moh::ThreadPool>(static_cast<int>(threads));
  return pool.get();
}

template <class Layer>
void run_decode(benchmark::State& state, DecodeFixture<Layer>& f, Index B, Index C, Index D,
                double flops, double active_ratio, Index threads = 1) {
  const moh::ConstTensorMap3<float> xm(f.x.data(), B, 1, D);
  moh::ForwardOptions opts;
  opts.causal = moh::Causal::On;
  opts.workspace = &moh_bench::bench_workspace();
  opts.pool = decode_pool(threads);
  for (auto& c : f.copies) {  // one untimed step per copy sizes the workspace
    roll_back(c.cache, f.lengths, C);
    c.layer->forward_cached(xm, moh::TensorMap3<float>(f.y.data(), B, 1, D), c.cache, opts);
  }
  double wall = 0;  // seconds: the `threads:N` rows keep their plain names (no /real_time)
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    auto& c = f.copies[f.next];  // the copy least recently stepped
    f.next = (f.next + 1) % f.copies.size();
    roll_back(c.cache, f.lengths, C);
    c.layer->forward_cached(xm, moh::TensorMap3<float>(f.y.data(), B, 1, D), c.cache, opts);
    moh_bench::keep(f.y.data());
    wall += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  state.counters["wall_us"] =
      wall * 1e6 / static_cast<double>(std::max<std::int64_t>(1, state.iterations()));
  moh_bench::set_layer_counters(state, flops, static_cast<double>(B), active_ratio);
  const double it = static_cast<double>(state.iterations());
  state.counters["kv_GBps"] = benchmark::Counter(f.kv_bytes * it * 1e-9, benchmark::Counter::kIsRate);
  state.counters["total_GBps"] = benchmark::Counter((f.kv_bytes + f.weight_bytes) * it * 1e-9,
                                                    benchmark::Counter::kIsRate);
  state.counters["step_MB"] = (f.kv_bytes + f.weight_bytes) * 1e-6;  // bytes moved per step
  state.counters["kv_MiB"] = f.kv_bytes / (1024.0 * 1024.0);
  state.counters["weight_MiB"] = f.weight_bytes / (1024.0 * 1024.0);
  state.counters["kv_heads_read"] = f.kv_heads_read;
  state.counters["threads"] = static_cast<double>(threads);
  double rotation = 0;
  for (const auto& c : f.copies) rotation += c.bytes();
  state.counters["copies"] = static_cast<double>(f.copies.size());
  state.counters["rotation_MiB"] = rotation / (1024.0 * 1024.0);  // all copies' weights + caches
  state.SetLabel(f.label);
}

// ---------------------------------------------------------------------------------------------
// Dense MHA.
// ---------------------------------------------------------------------------------------------
void BM_MHA_Decode(benchmark::State& state, bool llama, bool bf16, Index threads = 1,
                   bool ragged = false, bool kv_bf16 = false) {
  const Index B = state.range(0), C = state.range(1), D = state.range(2), H = state.range(3),
              G = state.range(4), d = D / H;
  auto& f = fixture_slot<moh::MultiHeadAttention<float>>();
  const std::string key = fixture_key(state, 5, llama) + (bf16 ? "/bf16" : "") +
                          (ragged ? "/ragged" : "") +
                          (kv_bf16 ? "/kv_bf16" : "");  // the same for any threads
  if (!f || f->key != key) {
    f.reset();  // free the previous benchmark's cache first
    moh::MHAConfig cfg = moh_test::mha_config(D, H, G, 0, /*bias=*/!llama, /*rope=*/llama);
    if (bf16) cfg.weight_storage = moh::WeightStorage::BFloat16;
    const moh::CacheStorage storage =
        kv_bf16 ? moh::CacheStorage::BFloat16 : moh::CacheStorage::Native;
    auto fx = make_fixture<moh::MultiHeadAttention<float>>(key, cfg, B, C, D, ragged, storage);
    fx->kv_heads_read = static_cast<double>(B * G);
    const double kv_value = kv_bf16 ? 2.0 : sizeof(float);
    for (Index b = 0; b < B; ++b) fx->kv_bytes += 2.0 * G * fx->keys(b, C) * d * kv_value;
    const double w = static_cast<double>((H + 2 * G) * d * D + D * H * d);
    const double b = cfg.bias ? static_cast<double>((H + 2 * G) * d + D) : 0.0;
    fx->weight_bytes = w * (bf16 ? 2.0 : 4.0) + b * sizeof(float);
    fx->label = std::string(llama ? "llama3: bias=0 rope=1" : "bias=1 rope=0") +
                (bf16 ? " weights=bf16" : "") + (kv_bf16 ? " cache=bf16" : "") +
                (ragged ? " contexts C/2..C" : "");
    f = std::move(fx);
  }
  run_decode(state, *f, B, C, D, moh_bench::mha_flops(B, 1, C + 1, D, H, G, d, true), 1.0,
             threads);
}

// ---------------------------------------------------------------------------------------------
// MoH, sparse path.
// ---------------------------------------------------------------------------------------------
void BM_MoH_Decode(benchmark::State& state, bool llama, bool bf16, bool ragged = false) {
  const Index B = state.range(0), C = state.range(1), D = state.range(2), H = state.range(3),
              G = state.range(4), pct = state.range(5), d = D / H;
  // The LLaMA3-8B rows run MoH-LLaMA3-8B's released split; the others the prefill split rule,
  // which at the decode P values (50, 75, 100) gives shared = H/4.
  moh::MoHConfig cfg;
  if (llama) {
    const std::optional<moh::MoHConfig> released = moh_bench::llama3_moh_config(D, H, G, pct);
    if (!released) {
      state.SkipWithError("the LLaMA3 rows run MoH-LLaMA3's released split: active_pct 75");
      return;
    }
    cfg = *released;
  } else {
    cfg = moh_bench::moh_config(D, H, G, moh_bench::moh_split(H, pct));
  }
  if (bf16) cfg.weight_storage = moh::WeightStorage::BFloat16;
  const HeadSplit split = moh_bench::split_of(cfg);
  const moh::MoHRouterKind router = cfg.router;
  auto& f = fixture_slot<moh::MoHAttention<float>>();
  const std::string key =
      fixture_key(state, 6, llama) + (bf16 ? "/bf16" : "") + (ragged ? "/ragged" : "");
  if (!f || f->key != key) {
    f.reset();
    auto fx = make_fixture<moh::MoHAttention<float>>(key, cfg, B, C, D, ragged);
    moh_bench::DecodeCopy<moh::MoHAttention<float>>& first = fx->copies.front();
    roll_back(first.cache, fx->lengths, C);

    // One untimed step with the routing record: which heads and kv heads the step uses. The input
    // is the same at every iteration and the copies are equal, so the routing is too.
    moh::MoHRouting<float> routing;
    moh::ForwardOptions opts;
    opts.causal = moh::Causal::On;
    first.layer->forward_cached(moh::ConstTensorMap3<float>(fx->x.data(), B, 1, D),
                                moh::TensorMap3<float>(fx->y.data(), B, 1, D), first.cache, opts,
                                &routing);
    roll_back(first.cache, fx->lengths, C);
    const Index group = H / G;
    std::set<Index> heads_used;
    Index kv_heads = 0;
    for (Index b = 0; b < B; ++b) {
      std::set<Index> groups;
      for (Index h = 0; h < H; ++h)
        if (routing.active(b, h)) {
          heads_used.insert(h);
          groups.insert(h / group);
        }
      kv_heads += static_cast<Index>(groups.size());
      fx->kv_bytes += 2.0 * static_cast<double>(groups.size()) * fx->keys(b, C) * d * sizeof(float);
    }
    const bool all_queries = router == moh::MoHRouterKind::QueryNorm || split.active() == H;
    const Index q_heads = all_queries ? H : static_cast<Index>(heads_used.size());
    const Index out_heads = split.active() == H ? H : static_cast<Index>(heads_used.size());
    const double w = static_cast<double>(2 * G * d * D + q_heads * d * D + out_heads * d * D);
    double other = cfg.qkv_bias ? static_cast<double>(2 * G * d + q_heads * d + D) : 0.0;
    if (router == moh::MoHRouterKind::Learned) {
      const auto& r = first.layer->router();
      other += static_cast<double>(r.routed_weight().size() + r.shared_weight().size() +
                                   r.mix_weight().size());
    }
    fx->weight_bytes = w * (bf16 ? 2.0 : 4.0) + other * sizeof(float);
    fx->kv_heads_read = static_cast<double>(kv_heads);
    fx->label = std::string(llama ? "llama3: query-norm router bias=0 rope=1"
                                  : "learned router bias=1 rope=0") +
                " shared=" + std::to_string(split.shared) + " K=" + std::to_string(split.routed_k) +
                (bf16 ? " weights=bf16" : "") + (ragged ? " contexts C/2..C" : "");
    f = std::move(fx);
  }
  const double flops = moh_bench::moh_flops(B, 1, C + 1, D, H, G, d, true, split, router);
  state.counters["shared_heads"] = static_cast<double>(split.shared);
  state.counters["routed_k"] = static_cast<double>(split.routed_k);
  run_decode(state, *f, B, C, D, flops, split.ratio());
}

// ---------------------------------------------------------------------------------------------
// JetMoE-8B's attention, and the dense layer with its number of active query heads.
// ---------------------------------------------------------------------------------------------
void BM_JetMoE_Decode(benchmark::State& state) {
  const Index B = state.range(0), C = state.range(1), D = state.range(2), G = state.range(3),
              E = state.range(4), k = state.range(5), d = state.range(6);
  auto& f = fixture_slot<moh::MoAAttention<float>>();
  const std::string key = fixture_key(state, 7, true);
  if (!f || f->key != key) {
    f.reset();
    const moh::MoAConfig cfg = moh::MoAConfig::jetmoe(D, G, E, k, d);
    auto fx = make_fixture<moh::MoAAttention<float>>(key, cfg, B, C, D);
    fx->kv_heads_read = static_cast<double>(B * G);
    fx->kv_bytes = 2.0 * B * G * static_cast<double>(C + 1) * d * sizeof(float);
    // K/V projection, the k experts' query and output projections, the router and the bias.
    fx->weight_bytes = (2.0 * G * d * D + 2.0 * k * G * d * D + D * E + D) * sizeof(float);
    fx->label = "jetmoe: top-k softmax gates, bias=1 rope=1";
    f = std::move(fx);
  }
  run_decode(state, *f, B, C, D, moh_bench::jetmoe_flops(B, 1, C + 1, D, G, E, k, d, true),
             static_cast<double>(k) / static_cast<double>(E));
}

void BM_MHA_Decode_HeadDim(benchmark::State& state) {
  const Index B = state.range(0), C = state.range(1), D = state.range(2), H = state.range(3),
              G = state.range(4), d = state.range(5);
  auto& f = fixture_slot<moh::MultiHeadAttention<float>>();
  const std::string key = fixture_key(state, 6, true);
  if (!f || f->key != key) {
    f.reset();
    const moh::MHAConfig cfg = moh_test::mha_config(D, H, G, d, /*bias=*/false, /*rope=*/true);
    auto fx = make_fixture<moh::MultiHeadAttention<float>>(key, cfg, B, C, D);
    fx->kv_heads_read = static_cast<double>(B * G);
    fx->kv_bytes = 2.0 * B * G * static_cast<double>(C + 1) * d * sizeof(float);
    fx->weight_bytes = static_cast<double>((H + 2 * G) * d * D + D * H * d) * sizeof(float);
    fx->label = "bias=0 rope=1 (JetMoE's active heads, dense)";
    f = std::move(fx);
  }
  run_decode(state, *f, B, C, D, moh_bench::mha_flops(B, 1, C + 1, D, H, G, d, true), 1.0);
}

// ---------------------------------------------------------------------------------------------
// MoH-LLaMA3's prefill: the LLaMA3-8B layer (RoPE, 8 kv heads, no bias), causal, MoH-LLaMA3-8B
// as released (16 shared heads, the top 8 of 16 routed, 75 %) against the dense layer.
// ---------------------------------------------------------------------------------------------
void BM_MHA_Prefill_Llama(benchmark::State& state) {
  const Index B = state.range(0), T = state.range(1), D = state.range(2), H = state.range(3),
              G = state.range(4);
  const moh::MHAConfig cfg = moh_test::mha_config(D, H, G, 0, /*bias=*/false, /*rope=*/true);
  moh_bench::time_forward(state, moh::MultiHeadAttention<float>(cfg, 42), B, T, nullptr,
                          moh_bench::causal_options());
  moh_bench::set_layer_counters(state, moh_bench::mha_flops(B, T, T, D, H, G, D / H, true),
                                static_cast<double>(B * T), 1.0);
  state.SetLabel("llama3: bias=0 rope=1");
}

void BM_MoH_Prefill_Llama(benchmark::State& state) {
  const Index B = state.range(0), T = state.range(1), D = state.range(2), H = state.range(3),
              G = state.range(4), pct = state.range(6);
  const std::optional<moh::MoHConfig> released = moh_bench::llama3_moh_config(D, H, G, pct);
  if (!released) {
    state.SkipWithError("the LLaMA3 rows run MoH-LLaMA3's released split: active_pct 75");
    return;
  }
  const moh::MoHConfig& cfg = *released;
  const HeadSplit split = moh_bench::split_of(cfg);
  moh_bench::time_forward(state, moh::MoHAttention<float>(cfg, 42), B, T, nullptr,
                          moh_bench::causal_options());
  moh_bench::set_layer_counters(
      state,
      moh_bench::moh_flops(B, T, T, D, H, G, D / H, true, split, moh::MoHRouterKind::QueryNorm),
      static_cast<double>(B * T), split.ratio());
  state.counters["shared_heads"] = static_cast<double>(split.shared);
  state.counters["routed_k"] = static_cast<double>(split.routed_k);
  state.SetLabel("llama3: query-norm router bias=0 rope=1");
}

// ---------------------------------------------------------------------------------------------
// A vectorised sum over a buffer far beyond the last-level cache: the rate at which one core
// reads memory, the limit of a decode step that streams its weights and cache once. The buffer
// is a moh::LargeBuffer, like the layers' weights and caches (huge pages where the system
// allows); 8 parts read side by side, a line of each per step, into 8 independent accumulators
// (each load of a step to the next one in turn) keep enough loads in flight. read_GBps = bytes /
// time.
// On N threads each sums its own share (bytes / N): Google Benchmark reports the row's time as
// the wall time over the iterations of all N threads (a share's time / N), so bytes / that
// time counts the bytes N times; read_GBps, which it sums over the threads, is the N cores'
// combined rate.
// ---------------------------------------------------------------------------------------------
void BM_MemRead(benchmark::State& state) {
  using P = Eigen::internal::packet_traits<float>::type;
  constexpr Index L = Eigen::internal::packet_traits<float>::size;
  constexpr Index kAcc = 8;
  // The sum reads kStreams equal parts of the buffer side by side, one 64-byte line of each per
  // step, as a decode step reads several weight rows or key blocks side by side (one stream alone
  // reads below a core's limit).
  constexpr Index kStreams = 8;
  constexpr Index kLine = std::max<Index>(1, 64 / Index(sizeof(float)) / L);  // packets
  // With threads, each reads its own share of the bytes (the machine's read rate on that many
  // cores: what a threaded decode step can reach at most).
  const std::size_t bytes = static_cast<std::size_t>(state.range(0)) /
                            static_cast<std::size_t>(state.threads());
  const Index step = kStreams * kLine * L;
  const Index n = static_cast<Index>(bytes / sizeof(float)) / step * step;
  const Index part = n / kStreams;
  moh::LargeBuffer<float> buffer(static_cast<std::size_t>(n));
  for (Index i = 0; i < n; ++i) buffer[static_cast<std::size_t>(i)] = 1.0f;  // fault pages in
  const float* a = buffer.data();
  for (auto _ : state) {
    P acc[kAcc];
    for (Index j = 0; j < kAcc; ++j) acc[j] = Eigen::internal::pset1<P>(0.0f);
    for (Index i = 0; i < part; i += kLine * L)
      for (Index s = 0; s < kStreams; ++s)
        for (Index j = 0; j < kLine; ++j) {
          P& sum = acc[(s * kLine + j) % kAcc];
          sum = Eigen::internal::padd(sum, Eigen::internal::ploadu<P>(a + s * part + i + j * L));
        }
    for (Index j = 1; j < kAcc; ++j) acc[0] = Eigen::internal::padd(acc[0], acc[j]);
    float sum = Eigen::internal::predux(acc[0]);
    benchmark::DoNotOptimize(sum);
  }
  const double read = static_cast<double>(n) * sizeof(float);
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(read));
  state.counters["read_GBps"] = benchmark::Counter(
      read * static_cast<double>(state.iterations()) * 1e-9, benchmark::Counter::kIsRate);
}

// ---------------------------------------------------------------------------------------------
// memcpy of a buffer far beyond the last-level cache: the machine's streaming copy rate.
// bytes_per_second counts the bytes copied; rw_GBps counts read + write traffic (2x).
// ---------------------------------------------------------------------------------------------
void BM_MemCopy(benchmark::State& state) {
  const std::size_t n = static_cast<std::size_t>(state.range(0));
  std::unique_ptr<char[]> src(new char[n]), dst(new char[n]);
  std::memset(src.get(), 1, n);  // fault every page in before timing
  std::memset(dst.get(), 2, n);
  for (auto _ : state) {
    std::memcpy(dst.get(), src.get(), n);
    benchmark::DoNotOptimize(dst.get());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(n));
  state.counters["rw_GBps"] = benchmark::Counter(
      2.0 * static_cast<double>(n) * static_cast<double>(state.iterations()) * 1e-9,
      benchmark::Counter::kIsRate);
}

// A whole decimal number from environment variable `name` in [lo, hi], or `fallback` when it is
// not set; anything else ends the program with a message that names the variable, the range and
// the text given.
int env_int(const char* name, int lo, int hi, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr) return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (end == v || *end != '\0' || x < lo || x > hi) {
    std::fprintf(stderr, "%s: expected a whole number in [%d, %d], got \"%s\"\n", name, lo, hi,
                 v);
    std::exit(2);
  }
  return static_cast<int>(x);
}

// MOH_WEIGHT_STREAMS=n and MOH_PREFETCH_FLOAT_CACHE=0|1 replace the kernel tuning chosen for
// this CPU (moh::KernelTuning), so that one binary can compare read patterns in separate runs;
// the tuning a run used is in its context (JSON "context").
[[maybe_unused]] const bool tuned = [] {
  moh::KernelTuning t = moh::kernel_tuning();
  t.weight_streams =
      env_int("MOH_WEIGHT_STREAMS", 1, moh::KernelTuning::kMaxWeightStreams, t.weight_streams);
  t.prefetch_float_cache = env_int("MOH_PREFETCH_FLOAT_CACHE", 0, 1, t.prefetch_float_cache) != 0;
  moh::set_kernel_tuning(t);
  benchmark::AddCustomContext("moh_weight_streams", std::to_string(t.weight_streams));
  benchmark::AddCustomContext("moh_prefetch_float_cache", t.prefetch_float_cache ? "1" : "0");
  return true;
}();

constexpr Index kContexts[] = {512, 4096, 16384};
constexpr Index kDecodePct[] = {50, 75, 100};

using Row = std::vector<std::int64_t>;

/// Registers benchmark `name` running `fn`, with these argument names, in microseconds, one
/// row of arguments per entry of `rows`.
template <class Fn>
void decode_rows(const char* name, Fn fn, const std::vector<std::string>& arg_names,
                 const std::vector<Row>& rows) {
  auto* b = benchmark::RegisterBenchmark(name, fn);
  b->ArgNames(arg_names)->Unit(benchmark::kMicrosecond);
  for (const Row& r : rows) b->Args(r);
}

const bool registered = [] {
  auto mha = [](benchmark::State& s) { BM_MHA_Decode(s, false, false); };
  auto mha_llama = [](benchmark::State& s) { BM_MHA_Decode(s, true, false); };
  auto mha_llama_bf16 = [](benchmark::State& s) { BM_MHA_Decode(s, true, true); };
  auto mha_llama_threads = [](benchmark::State& s) { BM_MHA_Decode(s, true, false, s.range(5)); };
  auto mha_ragged = [](benchmark::State& s) { BM_MHA_Decode(s, false, false, 1, s.range(5) != 0); };
  auto mha_llama_kv_bf16 = [](benchmark::State& s) {
    BM_MHA_Decode(s, true, true, 1, false, s.range(6) != 0);
  };
  auto moh_ragged = [](benchmark::State& s) { BM_MoH_Decode(s, false, false, s.range(6) != 0); };
  auto moh = [](benchmark::State& s) { BM_MoH_Decode(s, false, false); };
  auto moh_llama = [](benchmark::State& s) { BM_MoH_Decode(s, true, false); };
  auto moh_llama_bf16 = [](benchmark::State& s) { BM_MoH_Decode(s, true, true); };

  const auto with = [](std::initializer_list<const char*> extra) {  // the decode argument names
    std::vector<std::string> names = {"batch", "context", "d_model", "heads", "kv_heads"};
    names.insert(names.end(), extra.begin(), extra.end());
    return names;
  };
  std::vector<Row> rows;
  for (Index c : kContexts) rows.push_back({1, c, 1024, 16, 16});
  rows.push_back({8, 4096, 1024, 16, 16});
  // More sequences than kDotRows: still dot products (a decode call's rows stay bit-exact
  // against each sequence alone), where by row count they would have gone to gemm().
  rows.push_back({16, 1024, 1024, 16, 16});
  decode_rows("BM_MHA_Decode", mha, with({}), rows);
  decode_rows("BM_MHA_Decode", mha_ragged, with({"ragged"}), {{8, 4096, 1024, 16, 16, 1}});
  decode_rows("BM_MHA_Decode", mha_llama, with({}), {{1, 4096, 4096, 32, 8}});
  // Time is the calling thread's CPU time, as everywhere here; compare threads by wall_us.
  decode_rows("BM_MHA_Decode", mha_llama_threads, with({"threads"}), {{1, 4096, 4096, 32, 8, 2}});
  decode_rows("BM_MHA_Decode", mha_llama_bf16, with({"bf16"}), {{1, 4096, 4096, 32, 8, 1}});
  decode_rows("BM_MHA_Decode", mha_llama_kv_bf16, with({"bf16", "kv_bf16"}),
              {{1, 4096, 4096, 32, 8, 1, 1}});

  rows.clear();
  for (Index c : kContexts)
    for (Index p : kDecodePct) rows.push_back({1, c, 1024, 16, 16, p});
  rows.push_back({8, 4096, 1024, 16, 16, 50});
  decode_rows("BM_MoH_Decode", moh, with({"active_pct"}), rows);
  decode_rows("BM_MoH_Decode", moh_ragged, with({"active_pct", "ragged"}),
              {{8, 4096, 1024, 16, 16, 50, 1}});
  decode_rows("BM_MoH_Decode", moh_llama, with({"active_pct"}), {{1, 4096, 4096, 32, 8, 75}});
  decode_rows("BM_MoH_Decode", moh_llama_bf16, with({"active_pct", "bf16"}),
              {{1, 4096, 4096, 32, 8, 75, 1}});

  decode_rows("BM_JetMoE_Decode", BM_JetMoE_Decode,
              {"batch", "context", "d_model", "kv_heads", "experts", "top_k", "head_dim"},
              {{1, 4096, 2048, 16, 8, 2, 128}});
  decode_rows("BM_MHA_Decode", BM_MHA_Decode_HeadDim, with({"head_dim"}),
              {{1, 4096, 2048, 32, 16, 128}});

  auto* b = benchmark::RegisterBenchmark("BM_MHA_Prefill", BM_MHA_Prefill_Llama);
  b->ArgNames({"batch", "tokens", "d_model", "heads", "kv_heads", "causal"})
      ->Args({1, 2048, 4096, 32, 8, 1})
      ->Unit(benchmark::kMillisecond);
  b = benchmark::RegisterBenchmark("BM_MoH_Prefill", BM_MoH_Prefill_Llama);
  b->ArgNames({"batch", "tokens", "d_model", "heads", "kv_heads", "causal", "active_pct"})
      ->Args({1, 2048, 4096, 32, 8, 1, 75})
      ->Unit(benchmark::kMillisecond);

  benchmark::RegisterBenchmark("BM_MemRead", BM_MemRead)
      ->ArgNames({"bytes"})
      ->Arg(Index{256} << 20)
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("BM_MemRead", BM_MemRead)
      ->ArgNames({"bytes"})
      ->Arg(Index{256} << 20)
      ->Threads(2)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("BM_MemCopy", BM_MemCopy)
      ->ArgNames({"bytes"})
      ->Arg(Index{256} << 20)
      ->Unit(benchmark::kMillisecond);
  return true;
}();

}  // namespace
