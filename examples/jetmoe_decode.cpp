// JetMoE-style decoding: a small decoder written in user code around moh::MoAAttention with
// multi-head experts (MoAConfig::jetmoe, SEMANTICS 9): 8 attention experts, each token routed
// to its top 2, every expert with 4 query heads of 64 over 4 shared key/value heads, RoPE, and
// one moh::KvCache per layer. Each layer is
//
//   h = h + MoA(RMSNorm(h))                  y = sum of the 2 chosen experts' outputs, gated
//   h = h + down(SiLU(up(RMSNorm(h))))       a plain MLP (JetMoE's own is a mixture of MLPs)
//
// followed by a final RMSNorm and an LM head tied to the token embedding (logits = h E^T).
// Greedy generation: the 8-token prompt goes through as one forward_cached call, then each new
// token one call at a time. Prints the generated ids, tokens/s, how often each layer picked each
// expert while decoding, and a check that layer 0 decoding the sequence token by token matches
// one causal forward over all of it.
//
//   cmake -S . -B build -DCMAKE_BUILD_TYPE=Release && cmake --build build --target jetmoe_decode
//   ./build/examples/jetmoe_decode [new_tokens=32]
//
// The weights are seeded. A JetMoE checkpoint's attention loads with <moh/io.hpp> as
//   moh::load_weights(layer.attn, weights, "model.layers.<i>.self_attention.");
// (experts.input_linear, experts.output_linear, experts.router.layer, experts.bias, kv_proj).
#include <moh/moh.hpp>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
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

Matrix random_matrix(Index rows, Index cols, float stddev, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, stddev);
  Matrix m(rows, cols);
  for (Index i = 0; i < m.size(); ++i) m.data()[i] = normal(rng);
  return m;
}

struct DecoderLayer {
  DecoderLayer(const moh::MoAConfig& config, Index ffn, Index max_tokens, std::uint64_t seed)
      : attn(config, seed),
        cache(attn.make_cache(/*batch=*/1, max_tokens)),
        attn_norm(Vector::Ones(config.embed_dim)),
        mlp_norm(Vector::Ones(config.embed_dim)),
        expert_counts(config.num_experts, 0) {
    std::mt19937 rng(static_cast<std::uint32_t>(seed));
    const Index D = config.embed_dim;
    up_proj = random_matrix(ffn, D, 1.0f / std::sqrt(static_cast<float>(D)), rng);
    down_proj = random_matrix(D, ffn, 1.0f / std::sqrt(static_cast<float>(ffn)), rng);
  }

  moh::MoAAttention<float> attn;
  moh::KvCache<float> cache;         // this layer's keys/values [1, kv_heads, max_tokens, d]
  Vector attn_norm, mlp_norm;        // RMSNorm weights [D]
  Matrix up_proj, down_proj;         // [ffn, D], [D, ffn]
  std::vector<Index> expert_counts;  // [E]: decoded tokens routed to each expert (top 2 each)
};

struct Decoder {
  Matrix embedding;   // [vocab, D], also the LM head
  Vector final_norm;  // [D]
  std::vector<DecoderLayer> layers;
  moh::Workspace workspace;  // scratch of every call, reused

  // Runs the next tokens `ids` (after those already cached) and returns the logits [vocab] of the
  // last one. Single-token calls add their routing to each layer's expert_counts.
  Vector forward(const std::vector<Index>& ids) {
    const Index T = static_cast<Index>(ids.size()), D = embedding.cols();
    Matrix h(T, D), normed(T, D), update(T, D);  // [T, D]
    for (Index t = 0; t < T; ++t) h.row(t) = embedding.row(ids[t]);
    moh::ForwardOptions opts;  // forward_cached is causal by default
    opts.workspace = &workspace;
    moh::MoARouting<float> routing;
    for (DecoderLayer& layer : layers) {
      rms_norm(h, layer.attn_norm, normed);
      layer.attn.forward_cached(moh::ConstTensorMap3<float>(normed.data(), 1, T, D),
                                moh::TensorMap3<float>(update.data(), 1, T, D), layer.cache,
                                opts, &routing);
      h += update;
      if (T == 1)
        for (Index e = 0; e < routing.num_experts; ++e)
          layer.expert_counts[e] += routing.expert_counts[e];

      rms_norm(h, layer.mlp_norm, normed);
      Matrix hidden(T, layer.up_proj.rows());  // [T, ffn]
      moh::linear<float>(normed, layer.up_proj, hidden, nullptr, &workspace);
      hidden.array() = hidden.array() / (1.0f + (-hidden.array()).exp());  // SiLU
      moh::linear<float>(hidden, layer.down_proj, update, nullptr, &workspace);
      h += update;
    }
    rms_norm(h, final_norm, normed);
    return embedding * normed.row(T - 1).transpose();  // tied LM head
  }
};

int main(int argc, char** argv) {
  const int new_tokens = argc > 1 ? std::stoi(argv[1]) : 32;
  if (new_tokens < 1) {
    std::fprintf(stderr, "new_tokens must be >= 1, got %d\n", new_tokens);
    return 1;
  }
  const std::vector<Index> prompt = {1, 17, 230, 42, 999, 5, 64, 311};
  const Index vocab = 1024, D = 256, ffn = 4 * D, num_layers = 4;
  const Index P = static_cast<Index>(prompt.size()), max_tokens = P + new_tokens;
  // 4 key/value heads of 64; 8 experts of 4 query heads each, top 2 per token; RoPE base 10000.
  const moh::MoAConfig config = moh::MoAConfig::jetmoe(D, /*kv_heads=*/4, /*experts=*/8,
                                                       /*top_k=*/2, /*head_dim=*/64, 10000.0);

  Decoder model;
  std::mt19937 rng(0);
  model.embedding = random_matrix(vocab, D, 0.02f, rng);
  model.final_norm = Vector::Ones(D);
  for (Index i = 0; i < num_layers; ++i) model.layers.emplace_back(config, ffn, max_tokens, 10 + i);

  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  Vector logits = model.forward(prompt);  // the whole prompt in one call
  const Clock::time_point prompt_done = Clock::now();
  std::vector<Index> sequence = prompt;  // every token fed to the model
  for (int i = 0; i < new_tokens; ++i) {
    Index next = 0;
    logits.maxCoeff(&next);  // greedy
    sequence.push_back(next);
    logits = model.forward({next});  // one new token per call
  }
  const std::chrono::duration<double> prefill = prompt_done - start;
  const std::chrono::duration<double> decode = Clock::now() - prompt_done;

  std::printf("%ld layers, D = %ld, MoA: %ld experts (top %ld) of %ld heads of %ld over %ld kv "
              "heads, RoPE\nprompt:   ",
              long(num_layers), long(D), long(config.num_experts), long(config.top_k),
              long(config.kv_heads()), long(config.head_dim), long(config.kv_heads()));
  for (Index t = 0; t < P; ++t) std::printf(" %ld", long(sequence[t]));
  std::printf("\ngenerated:");
  for (Index t = P; t < max_tokens; ++t) std::printf(" %ld", long(sequence[t]));
  std::printf("\nprompt: %ld tokens in %.2f ms; decode: %d tokens in %.2f ms = %.0f tokens/s "
              "(1 thread)\n",
              long(P), 1e3 * prefill.count(), new_tokens, 1e3 * decode.count(),
              new_tokens / decode.count());

  std::printf("expert picks while decoding (%d tokens x top %ld per layer):\n", new_tokens,
              long(config.top_k));
  std::printf("  expert: ");
  for (Index e = 0; e < config.num_experts; ++e) std::printf(" %3ld", long(e));
  std::printf("\n");
  for (Index i = 0; i < num_layers; ++i) {
    std::printf("  layer %ld:", long(i));
    for (Index c : model.layers[i].expert_counts) std::printf(" %3ld", long(c));
    std::printf("\n");
  }

  // Check: layer 0 over the whole sequence, as decoding feeds it (the prompt in one cached call,
  // then one token per call through a fresh cache), against one causal forward over all of it.
  const Index L = static_cast<Index>(sequence.size());
  const DecoderLayer& layer = model.layers[0];
  Matrix tokens(L, D), x(L, D), stepwise(L, D), full(L, D);  // [L, D]
  for (Index t = 0; t < L; ++t) tokens.row(t) = model.embedding.row(sequence[t]);
  rms_norm(tokens, layer.attn_norm, x);
  moh::KvCache<float> cache = layer.attn.make_cache(1, L);
  moh::ForwardOptions opts;
  opts.workspace = &model.workspace;
  for (Index t = 0, n = P; t < L; t += n, n = 1) {
    layer.attn.forward_cached(moh::ConstTensorMap3<float>(x.data() + t * D, 1, n, D),
                              moh::TensorMap3<float>(stepwise.data() + t * D, 1, n, D), cache,
                              opts);
  }
  opts.causal = moh::Causal::On;  // forward is not causal by default
  layer.attn.forward(moh::ConstTensorMap3<float>(x.data(), 1, L, D),
                     moh::TensorMap3<float>(full.data(), 1, L, D), opts);
  std::printf("layer 0, %ld tokens: max |cached decoding - one causal forward| = %.2e "
              "(output scale %.2f)\n",
              long(L), (stepwise - full).cwiseAbs().maxCoeff(), full.cwiseAbs().maxCoeff());
  return 0;
}
