// One decode step of an attention layer in ggml (the tensor library under llama.cpp), on the CPU
// backend, one thread: the peer of moh's BM_MHA_Decode rows (bench/moh_bench_decode.cpp).
// Not part of moh's build; bench/peers/README.md says how to build it against a ggml checkout.
//
// One step, for one sequence (batch 1) whose KV cache already holds C tokens:
//   q = Wq x (+ bq), k = Wk x (+ bk), v = Wv x (+ bv)    ggml_mul_mat, weights [H d, D], [G d, D]
//   RoPE on q and k at position C (--rope 1)           ggml_rope_ext, rotate-half (NEOX), 10000
//   K[:, C] = k, V[:, C] = v                             ggml_cpy into a view of the cache
//                                                       (converts to the cache type)
//   o = attention of the H query heads over the C + 1 cached keys of their G kv heads
//                                                       ggml_flash_attn_ext, F32 precision
//   y = Wo o (+ bo)                                      ggml_mul_mat, weight [D, H d]
// The cache is laid out as llama.cpp lays it out: one [G d, capacity] tensor for K and one for
// V, a token's G heads side by side; attention reads a [d, C + 1, G] view of each. The cache's
// capacity is C + 1 and every step writes slot C again, so the context is C at every step.
// Attention takes ggml_flash_attn_ext, the path llama.cpp takes for decode on the CPU (its default
// `--flash-attn auto` turns flash attention on when the CPU backend runs the layer); no mask
// (every cached key is visible to the one new query), no softcap, no ALiBi.
//
// Memory: `--copies N` builds N independent copies of the layer (weights, cache and graph) and
// step i runs copy i mod N. `--copies 1` repeats one layer, as moh's decode rows do today (part of
// each step's bytes then come from the last-level cache, left there by the step before);
// `--min-mib M` (default 256) instead takes the fewest copies whose weights and caches together
// exceed M MiB, so that no step finds the previous step's bytes in the cache, as in a model's
// stack of layers.
//
// Output: one line per run, `key=value` pairs; ms_per_step is the mean wall time over the timed
// steps (after --warmup untimed passes over the copies, as many steps as fill --seconds),
// cpu_ms_per_step the mean CPU time of the calling thread (which runs the graph when --threads
// is 1), min_ms the fastest step. rel_err (f32 weights and cache only, else -1): the largest
// error of layer 0's output against the step in plain double arithmetic, relative to its
// largest value.
//
// Usage: ggml_decode --d-model D --heads H --kv-heads G [--head-dim d] --context C
//                    [--wtype f32|f16|bf16] [--kvtype f32|f16|bf16] [--bias 0|1] [--rope 0|1]
//                    [--copies N | --min-mib M] [--seconds S] [--warmup W] [--threads T]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

#include "ggml-cpu.h"
#include "ggml.h"

namespace {

struct Options {
  int64_t D = 1024, H = 16, G = 16, d = 0, C = 4096;
  ggml_type wtype = GGML_TYPE_F32, kvtype = GGML_TYPE_F32;
  bool bias = true, rope = false;
  int copies = 0;  // 0: from min_mib
  double min_mib = 256.0;
  double seconds = 1.0;
  int warmup = 3;
  int threads = 1;
};

[[noreturn]] void usage(const char* msg) {
  std::fprintf(stderr, "ggml_decode: %s\n", msg);
  std::exit(2);
}

ggml_type parse_type(const std::string& s) {
  if (s == "f32") return GGML_TYPE_F32;
  if (s == "f16") return GGML_TYPE_F16;
  if (s == "bf16") return GGML_TYPE_BF16;
  usage(("unknown type '" + s + "' (f32, f16 or bf16)").c_str());
}

const char* type_name(ggml_type t) { return ggml_type_name(t); }

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) usage(("missing value after " + a).c_str());
    const std::string v = argv[++i];
    if (a == "--d-model") o.D = std::stoll(v);
    else if (a == "--heads") o.H = std::stoll(v);
    else if (a == "--kv-heads") o.G = std::stoll(v);
    else if (a == "--head-dim") o.d = std::stoll(v);
    else if (a == "--context") o.C = std::stoll(v);
    else if (a == "--wtype") o.wtype = parse_type(v);
    else if (a == "--kvtype") o.kvtype = parse_type(v);
    else if (a == "--bias") o.bias = std::stoi(v) != 0;
    else if (a == "--rope") o.rope = std::stoi(v) != 0;
    else if (a == "--copies") o.copies = std::stoi(v);
    else if (a == "--min-mib") o.min_mib = std::stod(v);
    else if (a == "--seconds") o.seconds = std::stod(v);
    else if (a == "--warmup") o.warmup = std::stoi(v);
    else if (a == "--threads") o.threads = std::stoi(v);
    else usage(("unknown option " + a).c_str());
  }
  if (o.d == 0) o.d = o.D / o.H;
  if (o.H % o.G != 0) usage("--heads must be a multiple of --kv-heads");
  return o;
}

// Seeded uniform values in [-a, a) (a small xorshift; the values do not change the work).
struct Rng {
  uint64_t s;
  float next(float a) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return a * (static_cast<float>(s >> 40) / static_cast<float>(1 << 24) * 2.0f - 1.0f);
  }
};

void fill(ggml_tensor* t, Rng& rng, float a) {
  const int64_t n = ggml_nelements(t);
  std::vector<float> f(static_cast<size_t>(n));
  for (auto& x : f) x = rng.next(a);
  switch (t->type) {
    case GGML_TYPE_F32: std::memcpy(t->data, f.data(), f.size() * sizeof(float)); break;
    case GGML_TYPE_F16: ggml_fp32_to_fp16_row(f.data(), static_cast<ggml_fp16_t*>(t->data), n); break;
    case GGML_TYPE_BF16: ggml_fp32_to_bf16_row(f.data(), static_cast<ggml_bf16_t*>(t->data), n); break;
    default: usage("fill: unsupported type");
  }
}

// One copy of the layer: its own weights, cache, input and graph.
struct Layer {
  ggml_context* ctx = nullptr;
  ggml_cgraph* graph = nullptr;
  ggml_tensor* y = nullptr;
  ggml_tensor *x = nullptr, *wq = nullptr, *wk = nullptr, *wv = nullptr, *wo = nullptr;
  ggml_tensor *bq = nullptr, *bk = nullptr, *bv = nullptr, *bo = nullptr, *kc = nullptr,
              *vc = nullptr;
  size_t bytes = 0;  // weights + biases + K/V cache
};

Layer build(const Options& o, uint64_t seed) {
  const int64_t D = o.D, H = o.H, G = o.G, d = o.d, C = o.C, cap = C + 1;
  const size_t wbytes = ggml_row_size(o.wtype, D) * static_cast<size_t>((H + 2 * G) * d) +
                        ggml_row_size(o.wtype, H * d) * static_cast<size_t>(D);
  const size_t bbytes = o.bias ? sizeof(float) * static_cast<size_t>((H + 2 * G) * d + D) : 0;
  const size_t kvbytes = 2 * ggml_row_size(o.kvtype, G * d) * static_cast<size_t>(cap);
  ggml_init_params ip{};
  ip.mem_size = wbytes + bbytes + kvbytes + (size_t{64} << 20);  // + graph and activations
  ip.mem_buffer = nullptr;
  ip.no_alloc = false;
  Layer L;
  L.ctx = ggml_init(ip);
  if (!L.ctx) usage("ggml_init failed (out of memory?)");
  L.bytes = wbytes + bbytes + kvbytes;
  ggml_context* ctx = L.ctx;
  Rng rng{seed * 0x9E3779B97F4A7C15ull + 1};

  // ggml_mul_mat(W, x) with W [ne0 = in, ne1 = out]: y[out] = W x.
  ggml_tensor* wq = ggml_new_tensor_2d(ctx, o.wtype, D, H * d);
  ggml_tensor* wk = ggml_new_tensor_2d(ctx, o.wtype, D, G * d);
  ggml_tensor* wv = ggml_new_tensor_2d(ctx, o.wtype, D, G * d);
  ggml_tensor* wo = ggml_new_tensor_2d(ctx, o.wtype, H * d, D);
  const float wa = 1.0f / std::sqrt(static_cast<float>(D));
  for (ggml_tensor* w : {wq, wk, wv, wo}) fill(w, rng, wa);
  ggml_tensor *bq = nullptr, *bk = nullptr, *bv = nullptr, *bo = nullptr;
  if (o.bias) {
    bq = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, H * d);
    bk = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, G * d);
    bv = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, G * d);
    bo = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, D);
    for (ggml_tensor* b : {bq, bk, bv, bo}) fill(b, rng, 0.1f);
  }
  ggml_tensor* kc = ggml_new_tensor_2d(ctx, o.kvtype, G * d, cap);
  ggml_tensor* vc = ggml_new_tensor_2d(ctx, o.kvtype, G * d, cap);
  fill(kc, rng, 1.0f);
  fill(vc, rng, 1.0f);
  ggml_tensor* x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, D, 1);
  fill(x, rng, 1.0f);
  ggml_tensor* pos = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, 1);
  static_cast<int32_t*>(pos->data)[0] = static_cast<int32_t>(C);

  ggml_tensor* q = ggml_mul_mat(ctx, wq, x);  // [H d, 1]
  ggml_tensor* k = ggml_mul_mat(ctx, wk, x);  // [G d, 1]
  ggml_tensor* v = ggml_mul_mat(ctx, wv, x);
  if (o.bias) {
    q = ggml_add(ctx, q, bq);
    k = ggml_add(ctx, k, bk);
    v = ggml_add(ctx, v, bv);
  }
  q = ggml_reshape_3d(ctx, q, d, H, 1);
  k = ggml_reshape_3d(ctx, k, d, G, 1);
  if (o.rope) {
    q = ggml_rope_ext(ctx, q, pos, nullptr, static_cast<int>(d), GGML_ROPE_TYPE_NEOX, 0, 10000.0f,
                      1.0f, 0.0f, 1.0f, 0.0f, 0.0f);
    k = ggml_rope_ext(ctx, k, pos, nullptr, static_cast<int>(d), GGML_ROPE_TYPE_NEOX, 0, 10000.0f,
                      1.0f, 0.0f, 1.0f, 0.0f, 0.0f);
  }
  // Append token C: the cache's slot C, converted to the cache type.
  ggml_tensor* k_slot = ggml_view_1d(ctx, kc, G * d, static_cast<size_t>(C) * kc->nb[1]);
  ggml_tensor* v_slot = ggml_view_1d(ctx, vc, G * d, static_cast<size_t>(C) * vc->nb[1]);
  ggml_tensor* k_store = ggml_cpy(ctx, ggml_reshape_1d(ctx, k, G * d), k_slot);
  ggml_tensor* v_store = ggml_cpy(ctx, ggml_reshape_1d(ctx, v, G * d), v_slot);

  // The C + 1 keys and values of each kv head: [d, C + 1, G] views of the cache.
  const size_t es = ggml_type_size(o.kvtype);
  ggml_tensor* K = ggml_view_3d(ctx, kc, d, C + 1, G, kc->nb[1], static_cast<size_t>(d) * es, 0);
  ggml_tensor* V = ggml_view_3d(ctx, vc, d, C + 1, G, vc->nb[1], static_cast<size_t>(d) * es, 0);
  ggml_tensor* Q = ggml_permute(ctx, q, 0, 2, 1, 3);  // [d, 1 query, H]
  ggml_tensor* att = ggml_flash_attn_ext(ctx, Q, K, V, nullptr,
                                         1.0f / std::sqrt(static_cast<float>(d)), 0.0f, 0.0f);
  ggml_flash_attn_ext_set_prec(att, GGML_PREC_F32);  // [d, H, 1]
  ggml_tensor* y = ggml_mul_mat(ctx, wo, ggml_reshape_2d(ctx, att, H * d, 1));
  if (o.bias) y = ggml_add(ctx, y, bo);

  L.graph = ggml_new_graph(ctx);
  // The stores first: the graph runs its nodes in order, so attention sees token C.
  ggml_build_forward_expand(L.graph, k_store);
  ggml_build_forward_expand(L.graph, v_store);
  ggml_build_forward_expand(L.graph, y);
  L.y = y;
  L.x = x;
  L.wq = wq, L.wk = wk, L.wv = wv, L.wo = wo;
  L.bq = bq, L.bk = bk, L.bv = bv, L.bo = bo;
  L.kc = kc, L.vc = vc;
  return L;
}

// The step in plain double arithmetic from the layer's f32 tensors (after the step ran, so the
// cache holds token C): the largest |y - y_ref| over the output, relative to max |y_ref|.
double verify(const Options& o, const Layer& L) {
  const int64_t D = o.D, H = o.H, G = o.G, d = o.d, C = o.C;
  auto f = [](const ggml_tensor* t) { return static_cast<const float*>(t->data); };
  auto matvec = [&](const ggml_tensor* w, const ggml_tensor* b, const std::vector<double>& in,
                    int64_t rows) {
    std::vector<double> out(static_cast<size_t>(rows));
    const int64_t cols = w->ne[0];
    for (int64_t r = 0; r < rows; ++r) {
      double s = b ? f(b)[r] : 0.0;
      for (int64_t c = 0; c < cols; ++c) s += static_cast<double>(f(w)[r * cols + c]) * in[c];
      out[static_cast<size_t>(r)] = s;
    }
    return out;
  };
  std::vector<double> x(f(L.x), f(L.x) + D);
  std::vector<double> q = matvec(L.wq, L.bq, x, H * d);
  if (o.rope)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t j = 0; j < d / 2; ++j) {
        const double a = static_cast<double>(C) * std::pow(10000.0, -2.0 * j / d);
        double& u = q[h * d + j];
        double& w = q[h * d + j + d / 2];
        const double u0 = u, w0 = w;
        u = u0 * std::cos(a) - w0 * std::sin(a);
        w = w0 * std::cos(a) + u0 * std::sin(a);
      }
  std::vector<double> o_att(static_cast<size_t>(H * d), 0.0);
  const float* K = f(L.kc);
  const float* V = f(L.vc);
  for (int64_t h = 0; h < H; ++h) {
    const int64_t g = h / (H / G);
    std::vector<double> s(static_cast<size_t>(C + 1));
    double m = -1e300;
    for (int64_t t = 0; t <= C; ++t) {
      double dot = 0;
      for (int64_t j = 0; j < d; ++j) dot += q[h * d + j] * K[t * G * d + g * d + j];
      s[t] = dot / std::sqrt(static_cast<double>(d));
      m = std::max(m, s[t]);
    }
    double z = 0;
    for (auto& e : s) z += (e = std::exp(e - m));
    for (int64_t t = 0; t <= C; ++t)
      for (int64_t j = 0; j < d; ++j) o_att[h * d + j] += s[t] / z * V[t * G * d + g * d + j];
  }
  std::vector<double> y = matvec(L.wo, L.bo, o_att, D);
  double err = 0, scale = 0;
  for (int64_t i = 0; i < D; ++i) {
    err = std::max(err, std::abs(y[i] - f(L.y)[i]));
    scale = std::max(scale, std::abs(y[i]));
  }
  return err / scale;
}

// This thread's CPU time in milliseconds.
double thread_cpu_ms() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) * 1e-6;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  ggml_cpu_init();

  // One layer's bytes decide the number of copies.
  std::vector<Layer> layers;
  layers.push_back(build(o, 1));
  const double layer_mib = static_cast<double>(layers[0].bytes) / (1024.0 * 1024.0);
  int copies = o.copies;
  if (copies <= 0) copies = static_cast<int>(std::floor(o.min_mib / layer_mib)) + 1;
  for (int i = 1; i < copies; ++i) layers.push_back(build(o, static_cast<uint64_t>(i) + 1));

  ggml_threadpool_params tpp = ggml_threadpool_params_default(o.threads);
  ggml_threadpool* pool = ggml_threadpool_new(&tpp);
  std::vector<ggml_cplan> plans;
  size_t work = 0;
  for (auto& L : layers) {
    plans.push_back(ggml_graph_plan(L.graph, o.threads, pool));
    work = std::max(work, plans.back().work_size);
  }
  std::vector<uint8_t> work_buf(work + 64);
  for (auto& p : plans) p.work_data = p.work_size > 0 ? work_buf.data() : nullptr;

  auto step = [&](size_t i) {
    const size_t c = i % layers.size();
    if (ggml_graph_compute(layers[c].graph, &plans[c]) != GGML_STATUS_SUCCESS)
      usage("ggml_graph_compute failed");
  };
  size_t i = 0;
  for (int w = 0; w < o.warmup * copies; ++w) step(i++);

  using clock = std::chrono::steady_clock;
  std::vector<double> times;
  const auto start = clock::now();
  const double cpu0 = thread_cpu_ms();
  while (std::chrono::duration<double>(clock::now() - start).count() < o.seconds ||
         times.size() < 10) {
    const auto t0 = clock::now();
    step(i++);
    times.push_back(std::chrono::duration<double, std::milli>(clock::now() - t0).count());
  }
  const double cpu_mean = (thread_cpu_ms() - cpu0) / static_cast<double>(times.size());
  double sum = 0;
  for (double t : times) sum += t;
  const double mean = sum / static_cast<double>(times.size());
  // The check reads layer 0 as its last step left it (every step writes the same values).
  const bool f32 = o.wtype == GGML_TYPE_F32 && o.kvtype == GGML_TYPE_F32;
  const double rel_err = f32 ? verify(o, layers[0]) : -1.0;
  const double fastest = *std::min_element(times.begin(), times.end());
  const float* y = static_cast<const float*>(layers[0].y->data);
  std::printf(
      "engine=ggml D=%lld H=%lld G=%lld d=%lld C=%lld wtype=%s kvtype=%s bias=%d rope=%d "
      "threads=%d copies=%d layer_MiB=%.1f total_MiB=%.1f steps=%zu ms_per_step=%.4f "
      "cpu_ms_per_step=%.4f min_ms=%.4f GBps=%.2f y0=%g rel_err=%.2g\n",
      static_cast<long long>(o.D), static_cast<long long>(o.H), static_cast<long long>(o.G),
      static_cast<long long>(o.d), static_cast<long long>(o.C), type_name(o.wtype),
      type_name(o.kvtype), o.bias ? 1 : 0, o.rope ? 1 : 0, o.threads, copies, layer_mib,
      layer_mib * copies, times.size(), mean, cpu_mean, fastest,
      static_cast<double>(layers[0].bytes) / (mean * 1e-3) * 1e-9, static_cast<double>(y[0]), rel_err);
  ggml_threadpool_free(pool);
  for (auto& L : layers) ggml_free(L.ctx);
  return 0;
}
