// Causal decoding: a small LLaMA-style decoder written in user code around moh::MoHAttention with
// the parameter-free query-norm router (MoH-LLaMA3): RoPE, grouped-query heads (8 query heads
// over 2 key/value heads), no bias, and one moh::KvCache per layer. Each layer is
//
//   h = h + MoH(RMSNorm(h))                                 4 shared + top 2 of 4 routed heads
//   h = h + down(SiLU(gate(RMSNorm(h))) * up(RMSNorm(h)))   SwiGLU MLP
//
// followed by a final RMSNorm and an LM head tied to the token embedding (logits = h E^T).
// Greedy generation: the 8-token prompt goes through as one forward_cached call, then each new
// token one call at a time. Prints the generated ids, tokens/s and which heads each layer used.
//
//   cmake -S . -B build -DCMAKE_BUILD_TYPE=Release && cmake --build build --target causal_decode
//   ./build/examples/causal_decode [new_tokens=32] [weights.safetensors]
//
// With a safetensors file, layer i's attention is loaded from "layers.<i>.self_attn.q_proj.weight"
// [256, 256], k_proj / v_proj [64, 256] and o_proj [256, 256]; everything else stays random.
#include <moh/io.hpp>  // moh.hpp plus SafeTensors and load_weights

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <iomanip>
#include <iostream>
#include <random>
#include <string>
#include <vector>

using moh::Index;
using Matrix = moh::Matrix<float>;  // row-major [rows, cols]
using Vector = moh::Vector<float>;


// out [T, D]: each row of x [T, D] divided by its root mean square, times weight [D].
void rms_norm(const Matrix& x, const Vector& weight, Matrix& out) {
  const Vector inv_rms =
      ((x.rowwise().squaredNorm() / static_cast<float>(x.cols())).array() + 1e-6f).rsqrt();
  out = inv_rms.asDiagonal() * x;
  out.array().rowwise() *= weight.transpose().array();
}

struct DecoderLayer {
  DecoderLayer(const moh::MoHConfig& config, Index ffn, Index max_tokens, std::uint64_t seed)
      : attn(config, seed),
        cache(attn.make_cache(/*batch=*/1, max_tokens)),
        attn_norm(Vector::Ones(config.embed_dim)),
        mlp_norm(Vector::Ones(config.embed_dim)),
        head_counts(config.num_heads, 0) {
    std::srand(static_cast<unsigned>(seed));  // Eigen's Random draws from std::rand
    const Index D = config.embed_dim;
    gate_proj = 1.0f / std::sqrt(static_cast<float>(D)) * Matrix::Random(ffn, D);
    up_proj = 1.0f / std::sqrt(static_cast<float>(D)) * Matrix::Random(ffn, D);
    down_proj = 1.0f / std::sqrt(static_cast<float>(ffn)) * Matrix::Random(D, ffn);
  }

  moh::MoHAttention<float> attn;
  moh::KvCache<float> cache;             // this layer's keys/values [1, kv_heads, max_tokens, d]
  Vector attn_norm, mlp_norm;            // RMSNorm weights [D]
  Matrix gate_proj, up_proj, down_proj;  // [ffn, D], [ffn, D], [D, ffn]
  std::vector<Index> head_counts;        // [H]: single-token calls that used each head
  Index calls = 0;                       // single-token calls counted in head_counts
};

struct Decoder {
  Matrix embedding;   // [vocab, D], also the LM head
  Vector final_norm;  // [D]
  std::vector<DecoderLayer> layers;
  moh::Workspace workspace;  // scratch of every call: warm decode steps allocate nothing

  // Runs the next tokens `ids` (after those already cached) and returns the logits [vocab] of the
  // last one.
  Vector forward(const std::vector<Index>& ids) {
    const Index T = static_cast<Index>(ids.size()), D = embedding.cols();
    Matrix h(T, D), normed(T, D), update(T, D);  // [T, D]
    for (Index t = 0; t < T; ++t) h.row(t) = embedding.row(ids[t]);
    moh::ForwardOptions opts;  // forward_cached is causal by default
    opts.workspace = &workspace;
    moh::MoHRouting<float> routing;
    for (DecoderLayer& layer : layers) {
      rms_norm(h, layer.attn_norm, normed);
      layer.attn.forward_cached(moh::ConstTensorMap3<float>(normed.data(), 1, T, D),
                                moh::TensorMap3<float>(update.data(), 1, T, D), layer.cache,
                                opts, &routing);
      h += update;
      if (T == 1) {
        for (Index head = 0; head < routing.num_heads; ++head)
          layer.head_counts[head] += routing.head_counts[head];
        ++layer.calls;
      }

      rms_norm(h, layer.mlp_norm, normed);
      Matrix gate(T, layer.gate_proj.rows()), up(T, layer.up_proj.rows());  // [T, ffn]
      moh::linear<float>(normed, layer.gate_proj, gate, nullptr, &workspace);
      moh::linear<float>(normed, layer.up_proj, up, nullptr, &workspace);
      gate.array() = gate.array() / (1.0f + (-gate.array()).exp()) * up.array();  // SiLU(g) * u
      moh::linear<float>(gate, layer.down_proj, update, nullptr, &workspace);
      h += update;
    }
    rms_norm(h, final_norm, normed);
    return embedding * normed.row(T - 1).transpose();  // tied LM head
  }
};

int main(int argc, char** argv) {
  const int new_tokens = argc > 1 ? std::stoi(argv[1]) : 32;
  if (new_tokens < 1) {
    std::cerr << "new_tokens must be >= 1, got " << new_tokens << '\n';
    return 1;
  }
  const std::vector<Index> prompt = {1, 17, 230, 42, 999, 5, 64, 311};
  const Index vocab = 1024, D = 256, ffn = 688, num_layers = 4;
  const Index max_tokens = static_cast<Index>(prompt.size()) + new_tokens;

  moh::MoHConfig config;
  config.embed_dim = D;
  config.num_heads = 8;
  config.num_kv_heads = 2;         // grouped-query attention: 4 query heads per key/value head
  config.shared_heads = 4;
  config.active_routed_heads = 2;  // of 4 routed heads: 6 of 8 heads per token
  config.router = moh::MoHRouterKind::QueryNorm;
  config.qkv_bias = config.proj_bias = false;
  config.rope = true;

  Decoder model;
  std::mt19937 rng(0);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  model.embedding.resize(vocab, D);
  for (Index i = 0; i < model.embedding.size(); ++i) model.embedding.data()[i] = normal(rng);
  model.final_norm = Vector::Ones(D);
  for (Index i = 0; i < num_layers; ++i) model.layers.emplace_back(config, ffn, max_tokens, 10 + i);

  try {
    if (argc > 2) {
      const moh::SafeTensors weights = moh::SafeTensors::open(argv[2]);
      for (Index i = 0; i < num_layers; ++i)
        moh::load_weights(model.layers[i].attn, weights,
                          "layers." + std::to_string(i) + ".self_attn.");
      std::cout << "attention weights loaded from " << argv[2] << '\n';
    }
  } catch (const moh::Error& e) {
    std::cerr << e.what() << '\n';
    return 1;
  }

  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  Vector logits = model.forward(prompt);  // the whole prompt in one call
  const Clock::time_point prompt_done = Clock::now();
  std::vector<Index> generated;
  for (int i = 0; i < new_tokens; ++i) {
    Index next = 0;
    logits.maxCoeff(&next);  // greedy
    generated.push_back(next);
    logits = model.forward({next});  // one new token per call
  }
  const std::chrono::duration<double> prefill = prompt_done - start;
  const std::chrono::duration<double> decode = Clock::now() - prompt_done;

  std::cout << "prompt:   ";
  for (Index id : prompt) std::cout << ' ' << id;
  std::cout << "\ngenerated:";
  for (Index id : generated) std::cout << ' ' << id;
  std::cout << std::fixed << std::setprecision(1) << "\nprompt: " << prompt.size() << " tokens in "
            << 1e3 * prefill.count() << " ms; decode: " << new_tokens << " tokens in "
            << 1e3 * decode.count() << " ms = " << new_tokens / decode.count()
            << " tokens/s (1 thread)\n";

  std::cout << "heads used per decoded token (heads 0-3 shared, 4-7 routed by query norm):\n";
  for (Index i = 0; i < num_layers; ++i) {
    const DecoderLayer& layer = model.layers[i];
    Index used = 0;
    for (Index c : layer.head_counts) used += c;
    std::cout << "  layer " << i << ": " << 100.0 * used / (layer.calls * config.num_heads)
              << "% of heads; tokens per head:";
    for (Index c : layer.head_counts) std::cout << ' ' << c;
    std::cout << '\n';
  }
  return 0;
}
